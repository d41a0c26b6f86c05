# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: install run test check oracle fuzz lint browser bench clean

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
# the suite in this one process. Each run stores its tests' durations and fails when it
# passes but takes longer than its budget (seconds, on a 2-core machine under load).
TEST_WORKERS ?= 2
TEST_BUDGET ?= 1800
CHECK_BUDGET ?= 300
test: install lint browser
	EMBER_TEST_DURATIONS=bench-results/test-durations.json EMBER_SUITE_BUDGET=$(TEST_BUDGET) \
	  $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The edit loop's tier: every test that is not marked slow and starts no server process
# (tests/e2e: sockets, signals, Ray, the browser). `make test` runs them all.
check: install lint
	EMBER_TEST_DURATIONS=bench-results/check-durations.json EMBER_SUITE_BUDGET=$(CHECK_BUDGET) \
	  $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" --ignore=tests/e2e

# Coverage-guided fuzzing of the file readers (GGUF + loader, LoRA GGUF and PEFT, the KV
# disk tier's blocks, chat templates) under atheris, FUZZ_SECONDS each; a finding stops
# its target and leaves the input as crash-* in bench-results/fuzz/TARGET. `make test`
# runs the same targets on a bounded number of mutations (tests/test_fuzz_files.py).
FUZZ_SECONDS ?= 120
FUZZ_TARGETS ?= gguf_model lora_gguf lora_peft kv_block chat_template
fuzz: install
	$(BIN)/python -m pip install --quiet --disable-pip-version-check 'atheris>=2.3'
	@for t in $(FUZZ_TARGETS); do mkdir -p bench-results/fuzz/$$t && (cd bench-results/fuzz/$$t \
	  && ../../../$(BIN)/python ../../../scripts/fuzz.py $$t --seconds $(FUZZ_SECONDS)) || exit 1; done

# The checks against llama.cpp itself, which `make test` skips (they need llama-cpp-python,
# built from source: several minutes): every converted family's logits, a LoRA adapter's
# tokens and the pre-tokenizer goldens. LLAMA_PYTHON: an interpreter that has it already.
LLAMA_PYTHON ?= $(VENV)-llamacpp/bin/python
oracle: install
	@[ -x $(LLAMA_PYTHON) ] || { $(PYTHON) -m venv $(VENV)-llamacpp \
	  && $(VENV)-llamacpp/bin/python -m pip install --quiet 'llama-cpp-python==0.3.36'; }
	EMBER_LLAMA_PYTHON=$(LLAMA_PYTHON) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
	  --dist loadfile -k "llama_cpp" tests/test_converted_families.py tests/test_lora.py \
	  tests/test_tokenizer_vocabs.py tests/test_embeddings.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
