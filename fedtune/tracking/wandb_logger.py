"""Weights & Biases: one W&B run per fedtune run, in the project ``logging.project``.

``logging.wandb_mode = "auto"`` (the default) runs offline unless ``WANDB_API_KEY`` is set (or
``WANDB_MODE`` says otherwise): the run is written to ``RUN/wandb/offline-run-*/`` and ``wandb sync
RUN/wandb/offline-run-*`` uploads it later (``wandb leet inspect --json`` reads it locally). Each
round's numbers are logged at step = round, the config is the W&B run's config (the nested tables
of ``config.toml``), the plan's figures and the summary's numbers go in the run's summary. W&B's
console capture is off (fedtune's own lines are the output). A resumed run reopens the same W&B
run id (``resume="allow"``; offline, a second ``offline-run-*`` folder that ``wandb sync`` merges).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tomllib

from fedtune.config import RunConfig
from fedtune.tracking.base import Tracker


def wandb_mode(setting: str) -> str:
    """``logging.wandb_mode`` ``setting`` as W&B's mode: ``auto`` is ``WANDB_MODE`` when set, else
    online with ``WANDB_API_KEY``, else offline."""
    if setting != "auto":
        return setting
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


class WandbTracker(Tracker):
    """A W&B run (offline without an API key)."""

    name, module, pip = "wandb", "wandb", "wandb"

    def __init__(self, config: RunConfig, run_dir: Path, state: dict[str, Any] | None) -> None:
        super().__init__(config, run_dir, state)
        import wandb
        from wandb.sdk import wandb_setup

        # W&B's service process, when this run starts it: stopped at close (a Flower simulation reaps
        # every process it started, and W&B's exit hook would then fail on the dead service)
        self.owns_service = getattr(wandb_setup, "_singleton", None) is None
        settings = wandb.Settings(console="off", silent=True, show_info=False, show_warnings=False)
        self.run = wandb.init(
            project=config.logging.project,
            name=config.run_name,
            id=str(state["id"]) if state else None,
            resume="allow" if state else None,
            dir=str(run_dir),
            mode=wandb_mode(config.logging.wandb_mode),  # type: ignore[arg-type]
            reinit="create_new",  # its own run, whatever else this process logs
            settings=settings,
        )
        self.last = 0

    def state(self) -> dict[str, Any]:
        """The W&B run's id."""
        return {"id": self.run.id}

    def start(self, params: dict[str, str | float | int | bool], config_text: str) -> None:
        """The config (``config.toml``'s tables) as the W&B run's config."""
        self.run.config.update(tomllib.loads(config_text))

    def log(self, step: int, values: dict[str, float]) -> None:
        """The round's numbers at ``step``."""
        self.run.log(values, step=step)
        self.last = step

    def plan(self, figures: dict[str, float], plan_text: str) -> None:
        """The plan's figures in the run's summary."""
        self.run.summary.update(figures)

    def finish(self, values: dict[str, float], summary: dict[str, Any]) -> None:
        """The summary's numbers in the run's summary."""
        self.run.summary.update(values)

    def close(self, ok: bool) -> None:
        """Finish the W&B run (its exit code: 0, or 1 after an error), and W&B's service when this
        run started it."""
        self.run.finish(exit_code=0 if ok else 1)
        if self.owns_service:
            import wandb

            wandb.teardown()
