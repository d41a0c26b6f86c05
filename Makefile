# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: install run test lint browser bench clean

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

# Debian's chromium, which the chat page's browser tests drive through Playwright
# (Playwright's own browser download cannot be fetched here). Installed where this runs
# as root with apt; elsewhere those tests are skipped, and say so.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "chromium is not installed: the chat page's browser tests will be skipped"

# Two pytest-xdist workers, each test file whole on one of them (its module fixtures
# load once), each worker on its own core (tests/conftest.py); TEST_WORKERS=0 runs
# the suite in this one process.
TEST_WORKERS ?= 2
test: install lint browser
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
