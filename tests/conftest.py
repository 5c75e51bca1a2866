"""Shared test setup: offline hub, the shared data directory, a tiny-model config factory."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # the tests use tiny models: threads cost more than they give

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("FEDTUNE_DATA_DIR", str(Path(__file__).resolve().parents[1].parent / "shared" / "data"))
warnings.filterwarnings("ignore", category=FutureWarning)

TINY = [
    "model.name=tiny-bert",
    "data.name=tweets",
    "data.max_train_samples=200",
    "data.max_test_samples=100",
    "data.max_length=32",
    "federation.num_clients=4",
    "train.local_steps=3",
    "train.batch_size=8",
    "rounds=2",
]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One torch thread in every test (tiny tensors, a shared 2-core machine), even after a test
    whose run set ``train.threads``."""
    torch.set_num_threads(1)


@pytest.fixture
def tiny_config(tmp_path):
    """``tiny_config(*overrides)``: a fast RunConfig (2-layer BERT, hidden 32) writing under tmp_path."""
    from fedtune.config import load_config

    def make(*overrides: str):
        return load_config(None, [*TINY, f"output_dir={tmp_path / 'runs'}", *overrides])

    return make
