"""The trackers on Flower: the ServerApp runs :func:`fedtune.run.run_experiment`, in the process
that starts the simulation (``flower-sim``) or in Flower's own ServerApp process of a loopback
deployment (``flower``); either way TensorBoard and W&B hold every round of metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedtune.config import load_config
from fedtune.launch import launch
from tests import trackers_read
from tests.test_flower import TINY


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("engine", ["flower-sim", "flower"])
def test_trackers_hold_every_round_on_flower(tmp_path, engine):
    config = load_config(
        None, [*TINY, f"engine={engine}", f"output_dir={tmp_path}", 'logging.to=["tensorboard", "wandb"]']
    )
    summary = launch(config)
    run_dir = Path(summary["run_dir"])
    assert summary["engine"] == ("flower" if engine == "flower" else summary["engine"])
    accuracy = {
        x["round"]: x["accuracy"] for x in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }
    assert sorted(accuracy) == [1, 2]
    for store in (trackers_read.tensorboard(run_dir), trackers_read.wandb_offline(run_dir)):
        assert store.values("accuracy") == pytest.approx(accuracy, abs=1e-6)
        assert store.steps("accuracy") == [1, 2]
