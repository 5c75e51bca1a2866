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

from fedtune.config.aggregation import RobustConfig, SecureAggregationConfig, ServerConfig
from fedtune.config.base import DEVICE, RUN_NAME, ConfigError
from fedtune.config.federation import FederationConfig, PlacementConfig
from fedtune.config.legacy import split_federation
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
        default_factory=FederationConfig, description="[federation]: clients, sampling, uploads, a round's replies"
    )
    server: ServerConfig = Field(default_factory=ServerConfig, description="[server]: the server's optimizer step")
    robust: RobustConfig = Field(default_factory=RobustConfig, description="[robust]: robust aggregation, reply screen")
    secure_aggregation: SecureAggregationConfig = Field(
        default_factory=SecureAggregationConfig, description="[secure_aggregation]: Flower's SecAgg+"
    )
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="[placement]: where each engine runs the clients"
    )
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig, description="[privacy]: client-level DP")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="[logging]: experiment trackers")
    options: dict[str, Any] = Field(default_factory=dict, description="the method's own options")

    @model_validator(mode="before")
    @classmethod
    def _old_federation_keys(cls, value: Any) -> Any:
        return split_federation(value) if isinstance(value, dict) else value

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

    def config_refusal(self, config: RunConfig) -> str | None:
        """Why the method refuses ``config`` (from the config alone), or None."""


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


def _config_refusal(config: RunConfig, options: MethodRefusals | None) -> str | None:
    return None if options is None else options.config_refusal(config)


def _dp_not_with(key: str, broken: Callable[[RobustConfig], object]) -> Rule:
    """``robust.<key>``, a robust-aggregation setting, refused under DP."""
    return Rule(
        ("privacy.mode", f"robust.{key}"),
        lambda c, o: _dp(c) and broken(c.robust),
        f"robust.{key}: not with privacy.mode (DP-FedAvg clips and sums every update itself)",
    )


def _dp_no_retry(key: str) -> Rule:
    """``federation.<key>`` (a retry setting) left at its default under DP."""
    return Rule(
        ("privacy.mode", f"federation.{key}"),
        lambda c, o: _dp(c) and getattr(c.federation, key) != _default(c.federation, key),
        f"federation.{key}: not with privacy.mode (a DP round aggregates whatever its secret Poisson "
        "sample returns, missing replies as zero updates; a retry would condition the sample)",
    )


def _secagg_needs_each_update(config: RunConfig) -> str | None:
    """The first key ``config`` sets that needs each client's update (refused under SecAgg+), or None."""
    robust, fed = config.robust, config.federation
    given = {
        "robust.aggregation": robust.aggregation != "mean",
        "federation.upload_topk": fed.upload_topk is not None,
        "robust.clip_update_norm": robust.clip_update_norm is not None,
        "robust.max_client_weight": robust.max_client_weight is not None,
        "federation.wire_dtype": fed.wire_dtype != "float32",
    }
    return next((key for key, is_set in given.items() if is_set), None)


def _secagg_round(config: RunConfig) -> tuple[SecureAggregationConfig, int, int, int]:
    """SecAgg+'s settings and a round's clients m, shares per secret and reconstruction threshold."""
    secure, m = config.secure_aggregation, config.federation.sample_size()
    shares = secure.shares(m)
    return secure, m, shares, secure.reconstruction_threshold(shares)


def _secure(config: RunConfig) -> bool:
    return config.secure_aggregation.enabled


#: Every rule across the config's sections (and, stage ``"method"``, the method's options), checked
#: in this order by :func:`check_rules`.
RULES: tuple[Rule, ...] = (
    Rule(
        ("secure_aggregation.enabled", "federation.clients_per_round"),
        lambda c, o: _secure(c) and c.federation.sample_size() < 2,
        "secure_aggregation.enabled: needs at least 2 clients per round (one's sum is its update)",
    ),
    Rule(
        ("secure_aggregation.quantization_range", "secure_aggregation.modulus_range", "federation.clients_per_round"),
        lambda c, o: (
            _secure(c)
            and c.federation.sample_size() * c.secure_aggregation.quantization_range
            >= c.secure_aggregation.modulus_range
        ),
        lambda c, o: (
            f"secure_aggregation.quantization_range: {c.federation.sample_size()} clients x T = "
            f"{c.secure_aggregation.quantization_range} must stay below secure_aggregation.modulus_range = "
            f"{c.secure_aggregation.modulus_range} (the sum would wrap around)"
        ),
    ),
    Rule(
        ("secure_aggregation.num_shares", "federation.clients_per_round"),
        lambda c, o: _secure(c) and _secagg_round(c)[2] > _secagg_round(c)[1],
        lambda c, o: (
            f"secure_aggregation.num_shares: expected at most the {c.federation.sample_size()} clients sampled "
            "per round"
        ),
    ),
    Rule(
        ("secure_aggregation.threshold", "secure_aggregation.num_shares"),
        lambda c, o: _secure(c) and not 2 <= _secagg_round(c)[3] <= _secagg_round(c)[2],
        lambda c, o: (
            f"secure_aggregation.threshold: expected 2..num_shares = {_secagg_round(c)[2]}, got {_secagg_round(c)[3]}"
        ),
    ),
    Rule(
        ("secure_aggregation.enabled", "robust", "federation.upload_topk", "federation.wire_dtype"),
        lambda c, o: _secure(c) and _secagg_needs_each_update(c),
        lambda c, o: (
            f"{_secagg_needs_each_update(c)}: not with secure_aggregation.enabled (it needs each update; the server "
            "sees only their sum)"
        ),
    ),
    Rule(
        ("placement.gpus_per_client", "engine"),
        lambda c, o: c.placement.gpus_per_client and c.engine != "flower-sim",
        "placement.gpus_per_client: applies to engine = 'flower-sim'",
    ),
    Rule(
        ("placement.client_devices", "engine"),
        lambda c, o: c.placement.client_devices is not None and c.engine != "embedded",
        "placement.client_devices: applies to engine = 'embedded' (flower-sim: placement.gpus_per_client)",
    ),
    Rule(
        ("placement.gpus_per_client", "device"),
        lambda c, o: c.placement.gpus_per_client and not c.device.startswith(("cuda", "auto")),
        lambda c, o: f"placement.gpus_per_client: needs device = 'cuda' or 'auto' (got {c.device!r})",
    ),
    Rule(
        ("secure_aggregation.enabled", "engine"),
        lambda c, o: _secure(c) and c.engine == "embedded",
        'secure_aggregation.enabled: runs on engine = "flower-sim" or "flower" (Flower\'s SecAgg+; '
        "the embedded engine has no masking)",
    ),
    Rule(
        ("secure_aggregation.enabled", "placement.nodes", "engine"),
        lambda c, o: (
            _secure(c)
            and c.engine == "flower"
            and c.placement.nodes is not None
            and c.placement.nodes != c.federation.num_clients
        ),
        lambda c, o: (
            f"placement.nodes: secure aggregation needs one client per node ({c.federation.num_clients}; SecAgg+ "
            f"keys and state belong to a node), got {c.placement.nodes}"
        ),
    ),
    Rule(
        ("secure_aggregation.enabled", "privacy.adaptive_clip"),
        lambda c, o: _secure(c) and c.privacy.adaptive_clip,
        "privacy.adaptive_clip: not with secure_aggregation.enabled (its count needs each update's norm)",
    ),
    _dp_not_with("aggregation", lambda robust: robust.aggregation != "mean"),
    _dp_not_with("clip_update_norm", lambda robust: robust.clip_update_norm),
    _dp_not_with("max_client_weight", lambda robust: robust.max_client_weight),
    Rule(
        ("privacy.mode", "robust.max_update_ratio"),
        lambda c, o: _dp(c) and c.robust.max_update_ratio != _default(c.robust, "max_update_ratio"),
        "robust.max_update_ratio: not with privacy.mode (its reference, the other replies' norms, would make "
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
        ("secure_aggregation.enabled", "options"),
        lambda c, o: _secure(c) and _secure_refusal(c, o),
        lambda c, o: _secure_refusal(c, o) or "",
        stage="method",
    ),
    Rule(  # a method's own rule on its options and the config (MethodOptions.config_refusal)
        ("options", "model", "federation"),
        _config_refusal,
        lambda c, o: _config_refusal(c, o) or "",
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
