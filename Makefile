# Two commands on a fresh clone:  `make chat` (set up + chat with the default model)
# and `make test` (set up with the test extras + run every test). `make setup` alone installs
# the runtime; `make setup-test` adds what the tests need (transformers, pytest, ruff, ...).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup setup-test chat generate lint test test-fast fetch bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $(TEST_STAMP)

setup: $(STAMP)

setup-test: $(TEST_STAMP)

fetch: setup
	$(BIN)/minillama fetch

chat: setup
	$(BIN)/minillama chat

generate: setup
	$(BIN)/minillama generate "The capital of France is"

lint: setup-test
	$(BIN)/ruff check minillama tests bench tools
	$(BIN)/ruff format --check minillama tests bench tools

test: setup-test lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: setup-test
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/pip install -q -c constraints.txt -e ".[bench]"
	$(BIN)/minillama bench --json > bench/results/minillama_bench.json

clean:
	rm -rf $(VENV) build *.egg-info
