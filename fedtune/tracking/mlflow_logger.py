"""MLflow: one MLflow run per fedtune run, in the experiment ``logging.project`` of a local store.

The store is ``logging.mlflow_uri``: a ``sqlite:///`` URI (the default: ``sqlite:///RUN/mlflow.db``,
inside the run folder, with its artifacts beside it in ``RUN/mlartifacts``; point several runs at
one file to compare them), a folder (MLflow's file store, which MLflow keeps in maintenance mode: it
is allowed for this store only) or a tracking server's ``http(s)://`` address. Each round's
numbers are metrics at step = round, the config the run's params (``section.key``), the plan's
figures metrics at step 0, the summary's numbers metrics ``summary/<key>``; the artifacts are the
model (``adapter/`` or ``model.safetensors``) and the run's report files (``config.toml``,
``metrics.jsonl``, ``summary.json``, ``plan.json``), never the checkpoint (under DP it holds the
mechanism's secrets).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from fedtune.config import RunConfig
from fedtune.process import VERBOSE_ENV
from fedtune.tracking.base import Tracker

REPORT_FILES = ("config.toml", "metrics.jsonl", "summary.json", "plan.json")  # run folder -> artifacts report/
MODEL_FILES = ("adapter", "model.safetensors")  # run folder -> artifacts model/
ROUND_TAG = "fedtune.round"  # the last round whose metrics the MLflow run holds (resume)
MAX_PARAMS, MAX_METRICS, MAX_VALUE = 100, 1000, 6000  # MLflow's log_batch limits and param length


def store_uri(uri: str | None, run_dir: Path) -> str:
    """The tracking URI of ``logging.mlflow_uri`` ``uri`` (None: ``sqlite:///RUN/mlflow.db``); a
    path without a scheme is a folder, MLflow's file store."""
    if uri is None:
        return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    if "://" in uri or uri.startswith(("sqlite:", "file:")):
        return uri
    return Path(uri).resolve().as_uri()


def artifact_root(uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: ``mlartifacts`` beside the
    database file (MLflow's own default is relative to the working folder); None: the store's default."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class MlflowTracker(Tracker):
    """An MLflow run, written through ``mlflow.MlflowClient`` (no global active run)."""

    name, module, pip = "mlflow", "mlflow", "mlflow-skinny"

    def __init__(self, config: RunConfig, run_dir: Path, state: dict[str, Any] | None) -> None:
        super().__init__(config, run_dir, state)
        self.uri = store_uri(config.logging.mlflow_uri, run_dir)
        if self.uri.startswith("file:"):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # the user named a folder: MLflow's file store
        from mlflow import MlflowClient  # its import sets its loggers' levels

        if not os.environ.get(VERBOSE_ENV):
            logging.getLogger("mlflow").setLevel(logging.WARNING)  # its "Creating initial ... tables"

        self.client = MlflowClient(self.uri)
        if state:
            self.run_id = str(state["run_id"])
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            project = config.logging.project
            found = self.client.get_experiment_by_name(project)
            experiment = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(project, artifact_location=artifact_root(self.uri))
            )
            tags = {"fedtune.method": config.method, "fedtune.task": config.task.kind, "fedtune.run_dir": str(run_dir)}
            self.run_id = self.client.create_run(experiment, run_name=config.run_name, tags=tags).info.run_id
        self.last = 0

    def state(self) -> dict[str, Any]:
        """The MLflow run's id."""
        return {"run_id": self.run_id}

    def logged(self) -> int | None:
        """The round the MLflow run's tag ``fedtune.round`` names (written with the round's last metrics)."""
        tag = self.client.get_run(self.run_id).data.tags.get(ROUND_TAG)
        return None if tag is None else int(tag)

    def _metrics(self, values: dict[str, float], step: int, round_tag: bool = False) -> None:
        """``values`` at ``step``; ``round_tag``: the last batch also sets ``fedtune.round`` (one write)."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        chunks = _chunks([Metric(k, v, now, step) for k, v in values.items()], MAX_METRICS) or [[]]
        for i, chunk in enumerate(chunks):
            tags = [RunTag(ROUND_TAG, str(step))] if round_tag and i == len(chunks) - 1 else []
            self.client.log_batch(self.run_id, metrics=chunk, tags=tags)

    def start(self, params: dict[str, str | float | int | bool], config_text: str) -> None:
        """The config as params (values cut at MLflow's 6000 characters) and as ``config.toml``."""
        from mlflow.entities import Param

        entries = [Param(k, str(v)[:MAX_VALUE]) for k, v in params.items()]
        for chunk in _chunks(entries, MAX_PARAMS):
            self.client.log_batch(self.run_id, params=chunk)
        self.client.log_text(self.run_id, config_text, "report/config.toml")

    def log(self, step: int, values: dict[str, float]) -> None:
        """The round's numbers as metrics at ``step``."""
        self._metrics(values, step, round_tag=True)
        self.last = step

    def plan(self, figures: dict[str, float], plan_text: str) -> None:
        """The plan's figures as metrics at step 0, and ``plan.json``."""
        self._metrics(figures, 0)
        self.client.log_text(self.run_id, plan_text, "report/plan.json")

    def finish(self, values: dict[str, float], summary: dict[str, Any]) -> None:
        """The summary's numbers at the last round; the model and the report files as artifacts."""
        self._metrics(values, self.last or int(summary.get("rounds", 0)))
        for name in MODEL_FILES:
            path = self.run_dir / name
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), f"model/{name}")
            elif path.is_file():
                self.client.log_artifact(self.run_id, str(path), "model")
        for name in REPORT_FILES:
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name), "report")

    def close(self, ok: bool) -> None:
        """Mark the MLflow run finished (or failed)."""
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")
