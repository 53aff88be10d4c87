# Two commands on a fresh clone:  `make chat` (set up + chat with the default model)
# and `make test` (set up + run every test). `make setup` alone installs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup chat generate lint test test-fast fetch bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

fetch: setup
	$(BIN)/minillama fetch

chat: setup
	$(BIN)/minillama chat

generate: setup
	$(BIN)/minillama generate "The capital of France is"

lint: setup
	$(BIN)/ruff check minillama tests bench tools
	$(BIN)/ruff format --check minillama tests bench tools

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/pip install -q -c constraints.txt -e ".[bench]"
	$(BIN)/minillama bench --json > bench/results/minillama_bench.json

clean:
	rm -rf $(VENV) build *.egg-info
