"""TensorBoard: event files in ``RUN/tensorboard`` (``tensorboard --logdir runs`` shows every run).

Each round's numbers are scalars at step = round; the config is the hparams plugin's session (its
``section.key`` values) and the text ``config`` (``config.toml``); the plan's figures are scalars at
step 0 and the text ``plan``; the summary's numbers are scalars at the last round and the text
``summary``. A resumed run writes a new event file in the same folder, starting at the first round
it logs (``purge_step``: a reader drops any later step an earlier file holds).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedtune.config import RunConfig
from fedtune.tracking.base import Tracker

FOLDER = "tensorboard"


def _code(text: str) -> str:
    """``text`` as a Markdown code block (TensorBoard renders text summaries as Markdown)."""
    return "```\n" + text + "\n```"


class TensorBoardTracker(Tracker):
    """TensorBoard event files written with torch's ``SummaryWriter``."""

    name, module, pip = "tensorboard", "tensorboard", "tensorboard"

    def __init__(self, config: RunConfig, run_dir: Path, state: dict[str, Any] | None) -> None:
        super().__init__(config, run_dir, state)
        from torch.utils.tensorboard import SummaryWriter

        self.purge = int(state["next"]) if state else None
        self.writer = SummaryWriter(str(run_dir / FOLDER), purge_step=self.purge)
        self.last = self.purge - 1 if self.purge else 0

    def state(self) -> dict[str, Any]:
        """The round after the last one logged: where a resumed run's event file starts."""
        return {"next": self.last + 1}

    def start(self, params: dict[str, str | float | int | bool], config_text: str) -> None:
        """The hparams session (every key) and the config as text."""
        from torch.utils.tensorboard.summary import hparams

        events = self.writer.file_writer
        assert events is not None  # opened by SummaryWriter's constructor
        for summary in hparams(params, {}):
            events.add_summary(summary)
        self.writer.add_text("config", _code(config_text), 0)
        self.writer.flush()

    def log(self, step: int, values: dict[str, float]) -> None:
        """Every number of the round as a scalar at ``step``."""
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        self.last = step

    def plan(self, figures: dict[str, float], plan_text: str) -> None:
        """The plan's figures at step 0 and ``plan.json`` as text."""
        for key, value in figures.items():
            self.writer.add_scalar(key, value, 0)
        self.writer.add_text("plan", _code(plan_text), 0)
        self.writer.flush()

    def finish(self, values: dict[str, float], summary: dict[str, Any]) -> None:
        """The summary's numbers at the last round, and ``summary.json`` as text."""
        step = self.last or int(summary.get("rounds", 0))
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.add_text("summary", _code(json.dumps(summary, indent=1)), step)
        self.writer.flush()

    def close(self, ok: bool) -> None:
        """Close the event file."""
        self.writer.close()
