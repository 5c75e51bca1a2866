"""Resume and read back: which planned runs are finished, and their results.

A run is finished when its folder holds a ``summary.json`` and its ``config.toml`` is the spec's
very config (``run_experiment`` writes the config first and the summary last, so a run cut short
has none). A suite runs only the unfinished ones, so an interrupted suite resumes where it stopped;
a run it cut short continues from its ``checkpoint.npz`` (:func:`fedtune.harness.pool.resumable`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import tomllib

from fedtune.config import RunConfig
from fedtune.harness.plan import RunSpec, config_key
from fedtune.report import ReportError, RunRecord, load_run

RunState = Literal["done", "stale", "todo"]


def run_state(spec: RunSpec) -> RunState:
    """``done`` (a summary of this very config), ``stale`` (a finished run of another config under
    the same name: it is rerun, the old one moved aside to ``<name>.old-<n>``) or ``todo``."""
    try:
        json.loads((spec.folder / "summary.json").read_text())
    except (OSError, ValueError):  # absent, or cut short by a kill
        return "todo"
    try:
        saved = RunConfig.model_validate(tomllib.loads((spec.folder / "config.toml").read_text()))
    except Exception:
        return "stale"
    return "done" if config_key(saved) == spec.key else "stale"


def unfinished(specs: list[RunSpec]) -> list[RunSpec]:
    """The specs whose run is not ``done`` (the ones to run), in order."""
    return [spec for spec in specs if run_state(spec) != "done"]


def load_finished(spec: RunSpec) -> RunRecord | None:
    """The run's summary and rounds if it is done with this spec's config, else None."""
    if run_state(spec) != "done":
        return None
    try:
        return load_run(spec.folder)
    except ReportError:
        return None


def load_summary(spec: RunSpec) -> dict[str, Any] | None:
    """The finished run's ``summary.json`` object, or None."""
    record = load_finished(spec)
    return record.summary if record else None


def load_rounds(spec: RunSpec) -> list[dict[str, Any]]:
    """The finished run's ``metrics.jsonl`` objects (one per round), or ``[]``."""
    record = load_finished(spec)
    return record.rounds if record else []
