"""The one small interface every experiment tracker implements (:class:`Tracker`), and what the
run drives: :class:`Trackers`, the trackers ``logging.to`` names, fed the run's own records.

What a tracker receives is never derived here from the run's state: each round it gets the
``metrics.jsonl`` line the run has just written (:meth:`~fedtune.engines.record.RoundRecord.to_json`:
under DP only what the mechanism releases), the summary as ``summary.json`` holds it, the plan as
``plan.json`` holds it, and the resolved config as ``config.toml`` holds it. :func:`numbers`
flattens such a record to the named numbers a tracker stores.

Resume. A round reaches the trackers after its checkpoint is written, and ``trackers.json`` in the
run folder keeps each tracker's id (the MLflow run, the W&B run) and the last round it logged. A
resumed run reopens the same tracker runs and logs only the rounds after that one (rounds up to
the checkpoint that a tracker missed, or every round for a tracker added on resume, are logged
first), so no step is logged twice. Should a process die between a tracker's write and
``trackers.json``'s, MLflow's run says which round it holds (:meth:`Tracker.logged`), TensorBoard's
reader drops the later copy (``purge_step``) and W&B ignores a step below its run's current one.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
from abc import ABC, abstractmethod
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from fedtune.config import ConfigError, RunConfig, flat_keys

STATE_FILE = "trackers.json"  # run folder: each tracker's run id and the last round it logged
LOG = logging.getLogger("fedtune")


def numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The named numbers of ``record`` (a ``metrics.jsonl`` line, a summary, a plan entry): every
    finite int or float under its key, a nested dict's under ``key/sub`` (per-client maps:
    ``client_bytes_up/3``), a list's or a dict of strings' length under its key (``clients``,
    ``dropped``); booleans, strings and None are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool) or value is None or isinstance(value, str):
            continue
        if isinstance(value, (int, float)):
            if math.isfinite(value):
                out[name] = float(value)
        elif isinstance(value, dict):
            if value and all(isinstance(v, str) for v in value.values()):
                out[name] = float(len(value))  # dropped: client -> why (the reasons are text)
            else:
                out.update(numbers(value, f"{name}/"))
                if not value:
                    out[name] = 0.0
        elif isinstance(value, (list, tuple)):
            out[name] = float(len(value))
    return out


def hyperparameters(config: RunConfig) -> dict[str, str | float | int | bool]:
    """The resolved ``config`` as flat ``section.key`` hyperparameters (``config.toml``'s values;
    a list or table as its JSON text)."""
    flat = flat_keys(config.model_dump(mode="json", exclude_none=True))
    return {k: v if isinstance(v, (str, int, float, bool)) else json.dumps(v) for k, v in flat.items()}


def plan_figures(plan_text: str) -> dict[str, float]:
    """The per-client numbers of a run's ``plan.json`` (``plan/client_<cid>/peak_bytes``,
    ``.../seconds``, ``.../upload_mb``; an excluded client has ``excluded`` = 1)."""
    out: dict[str, float] = {}
    for client in json.loads(plan_text)["clients"]:
        cid = client["cid"]
        figures = {k: client[k] for k in ("peak_bytes", "seconds", "upload_mb")}
        figures["excluded"] = float(client.get("excluded") is not None)
        out.update(numbers(figures, f"plan/client_{cid}/"))
    return out


class Tracker(ABC):
    """One experiment tracker of a run. ``config``: the resolved run config; ``run_dir``: its run
    folder; ``state``: what :meth:`state` returned in the process that started the tracker's run
    (resume), or None for a tracker run that starts now."""

    name: ClassVar[str]  # as logging.to names it
    module: ClassVar[str]  # the package it imports
    pip: ClassVar[str]  # what installs that package

    def __init__(self, config: RunConfig, run_dir: Path, state: dict[str, Any] | None) -> None:
        self.config, self.run_dir = config, run_dir

    def state(self) -> dict[str, Any]:
        """What a resumed run needs to reopen this tracker's run (an id); JSON."""
        return {}

    def logged(self) -> int | None:
        """The last round the store itself says it holds (a reopened run), or None when it cannot
        tell (``trackers.json`` says)."""
        return None

    @abstractmethod
    def start(self, params: dict[str, str | float | int | bool], config_text: str) -> None:
        """A new tracker run: the resolved config as ``params`` (:func:`hyperparameters`) and as
        ``config_text`` (``config.toml``)."""

    @abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """Round ``step``'s named numbers (:func:`numbers` of its ``metrics.jsonl`` line)."""

    @abstractmethod
    def plan(self, figures: dict[str, float], plan_text: str) -> None:
        """The plan's per-client ``figures`` (:func:`plan_figures`) and ``plan.json`` itself."""

    @abstractmethod
    def finish(self, values: dict[str, float], summary: dict[str, Any]) -> None:
        """The run's end: the summary's numbers (``values``, named ``summary/<key>``) and
        ``summary``, as ``summary.json`` holds it."""

    def close(self, ok: bool) -> None:
        """Flush and release the tracker (``ok``: whether the run ended without an error)."""


class Trackers:
    """The trackers ``config.logging.to`` names, over the run folder ``run_dir``; ``resume``: the
    run continues, so each tracker reopens its run from ``trackers.json``. A tracker that fails is
    dropped with one warning: the run folder stays the record, and the run goes on."""

    def __init__(self, config: RunConfig, run_dir: Path, resume: bool) -> None:
        self.path = run_dir / STATE_FILE
        saved = self._saved() if resume else {}
        self.logged: dict[str, int] = {}
        self.active: list[Tracker] = []
        self.fresh: set[str] = set()
        for name in config.logging.to:
            old = saved.get(name)
            opened = partial(tracker_class(name), config, run_dir, old and old["state"])
            tracker = self._guard(name, "start", opened)
            if tracker is None:
                continue
            self.active.append(tracker)
            held = self._guard(name, "reopen", tracker.logged) if old else None
            self.logged[name] = held if held is not None else int(old["logged"]) if old else 0
            if old is None:
                self.fresh.add(name)

    def _saved(self) -> dict[str, Any]:
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def _guard(self, name: str, what: str, call: Any) -> Any:
        """``call()``; on an exception the tracker ``name`` is dropped with one warning."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
            LOG.warning("logging.to %s: %s failed (%s: %s); it logs nothing more", name, what, type(exc).__name__, exc)
            self.active = [t for t in self.active if t.name != name]
            return None

    def _each(self, what: str, call: Any) -> None:
        for tracker in list(self.active):
            self._guard(tracker.name, what, lambda t=tracker: call(t))

    def _save(self) -> None:
        state = {t.name: {"state": t.state(), "logged": self.logged[t.name]} for t in self.active}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.path)

    def start(self, config: RunConfig, config_text: str, plan_text: str | None, lines: list[dict[str, Any]]) -> None:
        """Before the first round this process runs: a tracker run that starts now gets the config
        (and the plan); every tracker gets the checkpointed ``lines`` it has not logged (resume)."""
        params = hyperparameters(config)
        for tracker in [t for t in self.active if t.name in self.fresh]:
            self._guard(tracker.name, "config", lambda t=tracker: t.start(params, config_text))
            if plan_text is not None:
                self._guard(tracker.name, "plan", lambda t=tracker: t.plan(plan_figures(plan_text), plan_text))
        for line in lines:
            self.round(line, save=False)
        if self.active:
            self._save()

    def round(self, line: dict[str, Any], save: bool = True) -> None:
        """Round ``line["round"]``'s ``metrics.jsonl`` line, to every tracker that has not logged it."""
        step = int(line["round"])
        values = {k: v for k, v in numbers(line).items() if k != "round"}  # the step itself
        for tracker in list(self.active):
            if step > self.logged[tracker.name]:
                self._guard(tracker.name, f"round {step}", lambda t=tracker: t.log(step, values))
                self.logged[tracker.name] = step
        if save and self.active:
            self._save()

    def finish(self, summary: dict[str, Any]) -> None:
        """The run's summary (``summary.json``) to every tracker."""
        values = numbers(summary, "summary/")
        self._each("summary", lambda t: t.finish(values, summary))

    def close(self, ok: bool) -> None:
        """Release every tracker (``ok``: the run ended without an error)."""
        self._each("close", lambda t: t.close(ok))
        self.active = []


#: ``logging.to`` name -> the module:class of its tracker (imported when a run uses it)
TRACKERS = {
    "tensorboard": "fedtune.tracking.tensorboard_logger:TensorBoardTracker",
    "mlflow": "fedtune.tracking.mlflow_logger:MlflowTracker",
    "wandb": "fedtune.tracking.wandb_logger:WandbTracker",
}
#: the package each tracker imports, and what installs it
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}


def tracker_class(name: str) -> type[Tracker]:
    """The :class:`Tracker` subclass of ``logging.to`` entry ``name``."""
    module, _, cls = TRACKERS[name].partition(":")
    found: type[Tracker] = getattr(importlib.import_module(module), cls)
    return found


def check_installed(config: RunConfig) -> None:
    """Stop with one line when ``config.logging.to`` names a tracker whose package is not installed."""
    for name in config.logging.to:
        module, pip = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"logging.to: {name!r} needs the {pip} package, which is not installed: "
                f"pip install 'fedtune[tracking]' (or pip install {pip})"
            )
