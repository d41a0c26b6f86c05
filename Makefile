# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: install run test lint bench clean

install: $(VENV)/.installed

# Re-run the install whenever the dependency list changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(BIN)/ember pull smollm2-135m
	touch $@

# The main job: serve the default model (OpenAI API at http://127.0.0.1:$(PORT)/v1).
run: install
	$(BIN)/ember serve --port $(PORT)

lint: install
	$(BIN)/ruff check ember tests scripts

test: install lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
