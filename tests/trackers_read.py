"""Reading back what a run wrote to its trackers, each with its own library's reader: TensorBoard's
``EventAccumulator``, ``mlflow.MlflowClient`` and W&B's ``wandb leet inspect --json`` (the offline
run's ``.wandb`` log; ``wandb.Api`` is online only)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedtune.config import flat_keys


@dataclass
class Store:
    """What one tracker holds of a run: each metric's (step, value) points in write order, the
    config (flat ``section.key`` -> value as the tracker keeps it), its texts (TensorBoard), its
    summary (W&B) and artifact paths (MLflow)."""

    metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)

    def steps(self, key: str) -> list[int]:
        return [s for s, _ in self.metrics.get(key, [])]

    def values(self, key: str) -> dict[int, float]:
        return dict(self.metrics.get(key, []))


def tensorboard(run_dir: Path) -> Store:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    store = Store()
    for tag in acc.Tags()["scalars"]:
        store.metrics[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    for tag in acc.Tags()["tensors"]:
        store.texts[tag.split("/")[0]] = acc.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        for key, value in data.session_start_info.hparams.items():
            kind = value.WhichOneof("kind")
            store.config[key] = getattr(value, kind)
    return store


def mlflow(uri: str, experiment: str = "fedtune") -> dict[str, Store]:
    """Every MLflow run of ``experiment`` in the store ``uri``, by run name."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    out: dict[str, Store] = {}
    for run in client.search_runs([found.experiment_id]):
        rid = run.info.run_id
        store = Store(config=dict(run.data.params))
        for key in run.data.metrics:
            store.metrics[key] = [(m.step, m.value) for m in client.get_metric_history(rid, key)]

        folders: list[str | None] = [None]
        while folders:
            for item in client.list_artifacts(rid, folders.pop()):
                folders.append(item.path) if item.is_dir else store.artifacts.append(item.path)
        out[run.info.run_name] = store
    return out


def wandb_offline(run_dir: Path) -> Store:
    """Every offline W&B run folder under ``run_dir/wandb``, merged (a resumed run writes a second
    one), as ``wandb leet inspect --json`` reads its ``.wandb`` log."""
    store = Store()
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert folders, f"no offline W&B run under {run_dir}"
    for folder in folders:
        wandb = Path(sys.executable).with_name("wandb")
        text = subprocess.run([str(wandb), "leet", "inspect", str(folder), "--json"], capture_output=True, text=True)
        assert text.returncode == 0, text.stderr[-2000:]
        for line in text.stdout.splitlines():
            record = json.loads(line)
            kind = record["type"]
            if kind == "run":
                store.config.update(flat_keys(record["run"].get("config", {}).get("update", {})))
            elif kind == "config":
                store.config.update(flat_keys(record["config"].get("update", {})))
            elif kind == "history":
                item = record["history"]["item"]
                step = int(record["history"]["step"]["num"])
                for key, value in flat_keys(item).items():
                    if not key.startswith("_"):
                        store.metrics.setdefault(key, []).append((step, value))
            elif kind == "summary":
                for key, value in flat_keys(record["summary"].get("update", {})).items():
                    if not key.startswith("_"):
                        store.summary[key] = value
    store.config.pop("_wandb", None)
    return store
