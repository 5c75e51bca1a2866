"""The whole run (:class:`RunConfig`) and :data:`RULES`, the one table of rules across its sections.

A rule names the fields it involves, when it is broken and its one-line message. The rules of
stage ``"config"`` read the config alone and are checked as it validates; those of stage
``"method"`` also read the method's validated options and are checked by
:func:`fedtune.runtime.resolve_run`. Both go through :func:`check_rules`, in table order, so the
first broken rule is the error. A rule inside one section stays with its section's model.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedtune.config.base import DEVICE, RUN_NAME, ConfigError
from fedtune.config.federation import FederationConfig
from fedtune.config.privacy import PrivacyConfig
from fedtune.config.sections import DataConfig, ModelConfig, TaskConfig, TrainConfig
from fedtune.config.tracking import LoggingConfig


class RunConfig(BaseModel):
    """One run's config: the method, seed, rounds, engine, device and output, and its sections."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite

    name: str | None = Field(None, description="run folder name under output_dir (default: method-data-seed)")
    method: str = Field(
        "fedit", description="the method (fedtune methods), or my_pkg.module:NAME from your own package"
    )
    seed: int = Field(0, ge=0, lt=2**32, description="fixes sampling, partitions, sketches, masks and data order")
    rounds: int = Field(10, gt=0, le=10**6, description="federated rounds (at most 10^6: a count the checkpoint holds)")
    eval_every: int = Field(1, gt=0, description="evaluate every this many rounds (and the last)")
    output_dir: str = Field("runs", description="where run folders go (output_dir/name)")
    engine: Literal["embedded", "flower-sim", "flower"] = Field(
        "embedded",
        description="embedded (in-process), flower-sim (Flower's simulation) or flower (a loopback deployment)",
    )
    device: str = Field(
        "cpu", description="where models compute: cpu, cuda, cuda:N, mps, or auto (CUDA when available, else cpu)"
    )
    task: TaskConfig = Field(default_factory=TaskConfig, description="[task]: what the run learns")
    data: DataConfig = Field(default_factory=DataConfig, description="[data]: the data set and its split")
    model: ModelConfig = Field(default_factory=ModelConfig, description="[model]: the base, LoRA, dtype")
    train: TrainConfig = Field(default_factory=TrainConfig, description="[train]: each client's local training")
    federation: FederationConfig = Field(
        default_factory=FederationConfig, description="[federation]: clients, sampling, aggregation"
    )
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig, description="[privacy]: client-level DP")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="[logging]: experiment trackers")
    options: dict[str, Any] = Field(default_factory=dict, description="the method's own options")

    @model_validator(mode="after")
    def _cross_section_rules(self) -> RunConfig:
        check_rules(self)  # its ConfigError is a ValueError: pydantic reports it as the field's error
        return self

    @field_validator("device")
    @classmethod
    def _device_name(cls, device: str) -> str:
        if not DEVICE.fullmatch(device):
            raise ValueError("expected auto, cpu, cuda, cuda:N or mps")
        return device

    @field_validator("name")
    @classmethod
    def _one_safe_component(cls, name: str | None) -> str | None:
        if name is not None and not RUN_NAME.fullmatch(name):
            raise ValueError(
                "expected one folder name: letters, digits and . _ + = - (first a letter or digit, at most 128)"
            )
        return name

    @property
    def run_name(self) -> str:
        """``name``, else ``method-data-seed`` with the data set's file stem mapped onto :data:`RUN_NAME`."""
        if self.name:
            return self.name
        data = re.sub(r"[^A-Za-z0-9._+=-]", "_", Path(self.data.name).stem) if self.data.name else self.task.kind
        method = self.method.rpartition(":")[2]  # "my_pkg.module:NAME": NAME
        return f"{method}-{data}-s{self.seed}"[:128]


class MethodRefusals(Protocol):
    """What the ``"method"`` rules ask of a method's validated options
    (:class:`~fedtune.registry.MethodOptions`)."""

    def privacy_refusal(self) -> str | None:
        """Why these options refuse client-level DP, or None."""

    def secure_refusal(self) -> str | None:
        """Why these options refuse secure aggregation, or None."""


@dataclass(frozen=True)
class Rule:
    """A rule across sections: ``fields`` it involves; ``broken(config, options)`` says whether this
    config breaks it; ``message`` is its one line (or makes it from the config and options)."""

    fields: tuple[str, ...]
    broken: Callable[[RunConfig, MethodRefusals | None], object]
    message: str | Callable[[RunConfig, MethodRefusals | None], str]
    stage: Literal["config", "method"] = "config"


def _default(section: BaseModel, key: str) -> Any:
    return type(section).model_fields[key].default


def _dp(config: RunConfig) -> bool:
    return config.privacy.mode != "none"


def _privacy_refusal(config: RunConfig, options: MethodRefusals | None) -> str | None:
    return None if options is None else options.privacy_refusal()


def _secure_refusal(config: RunConfig, options: MethodRefusals | None) -> str | None:
    return None if options is None else options.secure_refusal()


def _dp_not_with(key: str, broken: Callable[[FederationConfig], object]) -> Rule:
    """``federation.<key>``, a robust-aggregation setting, refused under DP."""
    return Rule(
        ("privacy.mode", f"federation.{key}"),
        lambda c, o: _dp(c) and broken(c.federation),
        f"federation.{key}: not with privacy.mode (DP-FedAvg clips and sums every update itself)",
    )


def _dp_no_retry(key: str) -> Rule:
    """``federation.<key>`` (a retry setting) left at its default under DP."""
    return Rule(
        ("privacy.mode", f"federation.{key}"),
        lambda c, o: _dp(c) and getattr(c.federation, key) != _default(c.federation, key),
        f"federation.{key}: not with privacy.mode (a DP round aggregates whatever its secret Poisson "
        "sample returns, missing replies as zero updates; a retry would condition the sample)",
    )


#: Every rule across the config's sections (and, stage ``"method"``, the method's options), checked
#: in this order by :func:`check_rules`.
RULES: tuple[Rule, ...] = (
    Rule(
        ("federation.gpus_per_client", "engine"),
        lambda c, o: c.federation.gpus_per_client and c.engine != "flower-sim",
        "federation.gpus_per_client: applies to engine = 'flower-sim'",
    ),
    Rule(
        ("federation.client_devices", "engine"),
        lambda c, o: c.federation.client_devices is not None and c.engine != "embedded",
        "federation.client_devices: applies to engine = 'embedded' (flower-sim: federation.gpus_per_client)",
    ),
    Rule(
        ("federation.gpus_per_client", "device"),
        lambda c, o: c.federation.gpus_per_client and not c.device.startswith(("cuda", "auto")),
        lambda c, o: f"federation.gpus_per_client: needs device = 'cuda' or 'auto' (got {c.device!r})",
    ),
    Rule(
        ("federation.secure_aggregation", "engine"),
        lambda c, o: c.federation.secure_aggregation and c.engine == "embedded",
        'federation.secure_aggregation: runs on engine = "flower-sim" or "flower" (Flower\'s SecAgg+; '
        "the embedded engine has no masking)",
    ),
    Rule(
        ("federation.secure_aggregation", "federation.nodes", "engine"),
        lambda c, o: (
            c.federation.secure_aggregation
            and c.engine == "flower"
            and c.federation.nodes is not None
            and c.federation.nodes != c.federation.num_clients
        ),
        lambda c, o: (
            f"federation.nodes: secure aggregation needs one client per node ({c.federation.num_clients}; SecAgg+ "
            f"keys and state belong to a node), got {c.federation.nodes}"
        ),
    ),
    Rule(
        ("federation.secure_aggregation", "privacy.adaptive_clip"),
        lambda c, o: c.federation.secure_aggregation and c.privacy.adaptive_clip,
        "privacy.adaptive_clip: not with federation.secure_aggregation (its count needs each update's norm)",
    ),
    _dp_not_with("aggregation", lambda fed: fed.aggregation != "mean"),
    _dp_not_with("clip_update_norm", lambda fed: fed.clip_update_norm),
    _dp_not_with("max_client_weight", lambda fed: fed.max_client_weight),
    Rule(
        ("privacy.mode", "federation.max_update_ratio"),
        lambda c, o: _dp(c) and c.federation.max_update_ratio != _default(c.federation, "max_update_ratio"),
        "federation.max_update_ratio: not with privacy.mode (its reference, the other replies' norms, would make "
        "a drop depend on other clients' data; central DP clips every update, local DP drops an upload beyond "
        "what a clipped and noised one can be)",
    ),
    _dp_no_retry("min_replies"),
    _dp_no_retry("max_retries"),
    Rule(
        ("privacy.mode", "options"),
        lambda c, o: _dp(c) and _privacy_refusal(c, o),
        lambda c, o: _privacy_refusal(c, o) or "",
        stage="method",
    ),
    Rule(
        ("privacy.mode", "options.weighting"),
        lambda c, o: _dp(c) and c.options.get("weighting") == "examples",
        'options.weighting: "examples" is not DP (a weight depends on the client\'s data); '
        "privacy.mode weighs every client 1/m",
        stage="method",
    ),
    Rule(
        ("federation.secure_aggregation", "options"),
        lambda c, o: c.federation.secure_aggregation and _secure_refusal(c, o),
        lambda c, o: _secure_refusal(c, o) or "",
        stage="method",
    ),
)


def check_rules(config: RunConfig, options: MethodRefusals | None = None) -> None:
    """Stop with :class:`ConfigError` on the first rule of :data:`RULES` that ``config`` breaks: of
    stage ``"config"`` without ``options``, else of stage ``"method"`` (``options``: the method's)."""
    stage = "config" if options is None else "method"
    for rule in RULES:
        if rule.stage == stage and rule.broken(config, options):
            raise ConfigError(rule.message if isinstance(rule.message, str) else rule.message(config, options))
