"""What the server does with a round's replies: ``[server]`` (its optimizer step), ``[robust]`` (robust
aggregation and the reply screen) and ``[secure_aggregation]`` (Flower's SecAgg+)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from fedtune.config.base import Section

BUILTIN_AGGREGATIONS = ("mean", "trimmed-mean", "median")  # fedtune's own combiners (methods.base.robust)
AGGREGATION_NAME = re.compile(r"[\w.-]+(:[\w.-]+)?")  # a combiner's name, or module:NAME (resolved at resolve)


def _given(section: BaseModel, keys: tuple[str, ...]) -> list[str]:
    """Those of ``keys`` that ``section`` sets to other than their default, in order."""
    return [k for k in keys if getattr(section, k) != type(section).model_fields[k].default]


class ServerConfig(Section):
    """``[server]``: the server's step on the aggregated update (plain, with momentum, or FedAdam)."""

    optimizer: Literal["sgd", "adam"] = Field(
        "sgd", description="server step on the aggregated update: sgd (lr 1: the method's own rule) or adam (FedAdam)"
    )
    lr: float | None = Field(None, gt=0, description="server learning rate (sgd: default 1; adam: required)")
    momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="sgd: heavy-ball momentum on the aggregated update (FedAvgM, Hsu et al. 2019; 0: none)",
    )
    betas: list[float] = Field([0.9, 0.999], min_length=2, max_length=2, description="FedAdam's (beta1, beta2)")
    eps: float = Field(1e-8, gt=0, description="FedAdam's epsilon (Reddi et al.'s tau)")
    weight_decay: float = Field(0.0, ge=0, description="FedAdam's decoupled weight decay (torch AdamW: 0.01)")
    bias_correction: bool = Field(
        True, description="FedAdam with Adam's bias correction (torch) or without (Reddi et al.)"
    )

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        adam_only = _given(self, ("betas", "eps", "weight_decay", "bias_correction"))
        if self.optimizer == "sgd" and adam_only:
            raise ValueError(f"server.{adam_only[0]}: applies to server.optimizer='adam'")
        if self.optimizer == "adam" and self.momentum != 0:
            raise ValueError("server.momentum: applies to server.optimizer='sgd' (adam: server.betas)")
        if self.optimizer == "adam" and self.lr is None:
            raise ValueError("server.lr: required with server.optimizer='adam' (the published FSLoRA code uses 5e-4)")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"server.betas: expected two values in [0, 1) (got {list(self.betas)})")
        return self

    def resolved_lr(self) -> float:
        """``lr``, or 1 (the plain sum of eq. (5) / FedAvg) when not given."""
        return 1.0 if self.lr is None else float(self.lr)

    def plain_step(self) -> bool:
        """Whether the server adds the aggregated update as it is (SGD at lr 1 without momentum: each
        paper's rule)."""
        return self.optimizer == "sgd" and self.resolved_lr() == 1.0 and self.momentum == 0


class RobustConfig(Section):
    """``[robust]``: how the server combines the updates (a robust combiner, clipping, bounded weights)
    and the screen that drops an outsized reply."""

    aggregation: str = Field(
        "mean",
        description='combine the updates by their weighted mean ("mean"), or per coordinate by a trimmed mean '
        '("trimmed-mean") or median ("median"), or by your own combiner (fedtune combiners): a name an installed '
        'package declares (entry point group fedtune.combiners) or "my_pkg.module:NAME"; like the robust ones it '
        "is refused under DP, SecAgg+ and by the methods that do not honour it",
    )
    trim_fraction: float = Field(0.1, ge=0, lt=0.5, description="trimmed-mean: the fraction cut at each end")
    clip_update_norm: float | None = Field(
        None, gt=0, description="scale each client's update down to this L2 norm (over all its arrays) first"
    )
    max_client_weight: float | None = Field(
        None, gt=0, le=1, description="bound each client's share of the weighted mean (the excess goes to the others)"
    )
    max_update_ratio: float = Field(
        1000.0,
        ge=0,
        description="a training reply whose L2 norm exceeds this many times the round's reference (the replies' "
        "lower median norm, or the norm of what the client was sent, the larger) is dropped; 0: no screen; "
        "refused under DP (central DP clips every update, local DP bounds each upload itself)",
    )

    @field_validator("aggregation")
    @classmethod
    def _aggregation_name(cls, name: str) -> str:
        if not AGGREGATION_NAME.fullmatch(name):
            raise ValueError(
                f"expected {', '.join(BUILTIN_AGGREGATIONS)}, a combiner an installed package declares, or "
                "my_pkg.module:NAME"
            )
        return name

    @field_validator("max_update_ratio")
    @classmethod
    def _ratio_above_one(cls, ratio: float) -> float:
        if 0 < ratio <= 1:
            raise ValueError(f"expected 0 (no screen) or a ratio above 1, as honest replies reach 1 (got {ratio})")
        return ratio

    @model_validator(mode="after")
    def _check(self) -> RobustConfig:
        if _given(self, ("trim_fraction",)) and self.aggregation != "trimmed-mean":
            raise ValueError('robust.trim_fraction: applies to robust.aggregation = "trimmed-mean"')
        if self.max_client_weight is not None and self.aggregation != "mean":
            raise ValueError(
                "robust.max_client_weight: bounds the weighted mean's shares (trimmed-mean, median: unweighted)"
            )
        return self


class SecureAggregationConfig(Section):
    """``[secure_aggregation]``: Flower's SecAgg+ (``secure_aggregation = true`` is ``enabled = true``);
    its checks against the round's sample are :data:`~fedtune.config.run_config.RULES`."""

    enabled: bool = Field(
        False,
        description="engines 'flower-sim', 'flower': Flower's SecAgg+ (secaggplus_mod); the server sees only the "
        "sum of the sampled clients' (weighted, quantized) updates",
    )
    clipping_range: float = Field(
        8.0, gt=0, description="SecAgg+: each weighted update coordinate clipped to [-c, c] before quantization"
    )
    quantization_range: int = Field(
        2**22, ge=2, description="SecAgg+: [-c, c] mapped onto the integers 0..T (step 2c/T, stochastic rounding)"
    )
    modulus_range: int = Field(
        2**32, ge=4, le=2**32, description="SecAgg+: masks and sums modulo M (a power of 2 above m * T)"
    )
    num_shares: int | None = Field(
        None,
        ge=2,
        description="SecAgg+: neighbours each client shares its secrets with, itself included "
        "(default: every sampled client)",
    )
    threshold: int | None = Field(
        None, ge=2, description="SecAgg+: shares that rebuild a secret (default: a majority of the round's shares)"
    )

    @model_validator(mode="before")
    @classmethod
    def _string_is_name(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check(self) -> SecureAggregationConfig:
        given = _given(self, tuple(k for k in type(self).model_fields if k != "enabled"))
        if given and not self.enabled:
            raise ValueError(f"secure_aggregation.{given[0]}: applies to secure_aggregation.enabled = true")
        if self.modulus_range & (self.modulus_range - 1):
            raise ValueError(f"secure_aggregation.modulus_range: expected a power of 2, got {self.modulus_range}")
        return self

    def shares(self, m: int) -> int:
        """SecAgg+'s shares per secret: ``num_shares``, default every one of the ``m`` sampled clients."""
        return self.num_shares or m

    def reconstruction_threshold(self, shares: int) -> int:
        """Shares that rebuild a secret: ``threshold``, default a majority (at least 2) of ``shares``, a
        round's shares per secret (under DP's Poisson sample a round's clients, and so its shares, vary)."""
        return self.threshold or max(2, shares // 2 + 1)

    def target(self, m: int) -> int:
        """SecAgg+'s quantization range T of a round summing ``m`` clients: ``quantization_range``,
        lowered to (M - 1) // m where m T would reach the modulus M (a DP round's Poisson sample may
        exceed the expected one), so the sum never wraps around."""
        return min(self.quantization_range, (self.modulus_range - 1) // m)

    def step(self, num_clients: int) -> float:
        """The largest quantization step 2c/T any SecAgg+ round of a federation of ``num_clients`` can
        use: T of a round that sums every client (:meth:`target`), c = ``clipping_range``."""
        return 2 * self.clipping_range / self.target(num_clients)
