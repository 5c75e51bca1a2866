"""``[logging]``: the experiment trackers a run writes to (:mod:`fedtune.tracking`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedtune.config.base import Section


class LoggingConfig(Section):
    """``[logging]``: where a run's metrics go besides its run folder. Every tracker gets each
    round's ``metrics.jsonl`` line (under DP only what the mechanism releases), the resolved config
    as hyperparameters, the plan's per-client figures (budgets) and the summary."""

    to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="trackers: tensorboard (event files in RUN/tensorboard), mlflow (a local store), wandb "
        "(offline into RUN/wandb unless WANDB_API_KEY is set; `wandb sync` later); the tracking extra",
    )
    project: str = Field(
        "fedtune", min_length=1, max_length=128, description="the MLflow experiment and the W&B project"
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking store: a sqlite:/// URI, a folder (MLflow's file store), or a server's "
        "http(s):// address (default: sqlite:///RUN/mlflow.db, inside the run folder)",
    )
    wandb_mode: Literal["auto", "offline", "online"] = Field(
        "auto", description="W&B: auto (online when WANDB_API_KEY is set, else offline), offline or online"
    )

    @field_validator("to")
    @classmethod
    def _once_each(cls, to: list[str]) -> list[str]:
        twice = sorted({t for t in to if to.count(t) > 1})
        if twice:
            raise ValueError(f"logging.to: {twice[0]!r} is named twice")
        return to
