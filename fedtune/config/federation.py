"""``[federation]``: clients, sampling, the server step, robust aggregation, faults, placement and SecAgg+."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedtune.config.base import DEVICE, Section
from fedtune.protocol.profiles import ClientProfile, DeviceClass, check_device_classes, check_profile_choices

BUILTIN_AGGREGATIONS = ("mean", "trimmed-mean", "median")  # fedtune's own combiners (methods.base.robust)
AGGREGATION_NAME = re.compile(r"[\w.-]+(:[\w.-]+)?")  # a combiner's name, or module:NAME (resolved at resolve)

SECAGG_PARAMETERS = (
    "secagg_clipping_range",
    "secagg_quantization_range",
    "secagg_modulus_range",
    "secagg_num_shares",
    "secagg_threshold",
)


class FederationConfig(Section):
    """``[federation]``: the clients, their sampling and profiles, the wire, the server's aggregation."""

    num_clients: int = Field(10, gt=0, description="clients in the federation (N)")
    clients_per_round: int | None = Field(None, gt=0, description="clients sampled per round")
    fraction: float | None = Field(None, gt=0, le=1, description="fraction sampled per round")
    profiles: list[ClientProfile] | None = Field(None, description="one resource profile per client (or one for all)")
    profile_choices: dict[str, list[Any]] | None = Field(None, description="draw each profile field from a set")
    device_classes: list[DeviceClass] | None = Field(
        None, description="draw each client's budget (memory_gib, speed, bandwidth_mb, deadline_s) from these classes"
    )
    wire_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the float arrays a client uploads (aggregation stays in float32)"
    )
    upload_topk: float | None = Field(
        None, gt=0, le=1, description="keep this fraction of each uploaded update (top-k)"
    )
    server_optimizer: Literal["sgd", "adam"] = Field(
        "sgd", description="server step on the aggregated update: sgd (lr 1: the method's own rule) or adam (FedAdam)"
    )
    server_lr: float | None = Field(None, gt=0, description="server learning rate (sgd: default 1; adam: required)")
    server_momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="sgd: heavy-ball momentum on the aggregated update (FedAvgM, Hsu et al. 2019; 0: none)",
    )
    server_betas: list[float] = Field([0.9, 0.999], min_length=2, max_length=2, description="FedAdam's (beta1, beta2)")
    server_eps: float = Field(1e-8, gt=0, description="FedAdam's epsilon (Reddi et al.'s tau)")
    server_weight_decay: float = Field(0.0, ge=0, description="FedAdam's decoupled weight decay (torch AdamW: 0.01)")
    server_bias_correction: bool = Field(
        True, description="FedAdam with Adam's bias correction (torch) or without (Reddi et al.)"
    )
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
    min_replies: int = Field(1, gt=0, description="valid replies a round needs to aggregate (else it is retried)")
    max_retries: int = Field(2, ge=0, description="retries of a round short of min_replies before the run stops")
    round_timeout_s: float | None = Field(None, gt=0, description="a client slower than this in a round is dropped")
    max_reply_bytes: int = Field(256 * 2**20, gt=0, description="a larger reply is rejected")
    max_update_ratio: float = Field(
        1000.0,
        ge=0,
        description="a training reply whose L2 norm exceeds this many times the round's reference (the replies' "
        "lower median norm, or the norm of what the client was sent, the larger) is dropped; 0: no screen; "
        "refused under DP (central DP clips every update, local DP bounds each upload itself)",
    )
    gpus_per_client: float = Field(
        0.0, ge=0, le=1, description="engine 'flower-sim': the GPU fraction Ray gives each ClientApp (device cuda)"
    )
    client_devices: list[str] | None = Field(
        None,
        description="engine 'embedded': one worker process per device (cuda:N, cpu, ...; two or more), the clients "
        "spread over them (default: every visible GPU when device is cuda or auto and there are several, "
        "else the run's process)",
    )
    nodes: int | None = Field(
        None,
        gt=0,
        description="engine 'flower': SuperNodes, each playing a group of clients "
        "(default: min(clients per round, cores); one per client with secure_aggregation)",
    )
    secure_aggregation: bool = Field(
        False,
        description="engines 'flower-sim', 'flower': Flower's SecAgg+ (secaggplus_mod); the server sees only the "
        "sum of the sampled clients' (weighted, quantized) updates",
    )
    secagg_clipping_range: float = Field(
        8.0, gt=0, description="SecAgg+: each weighted update coordinate clipped to [-c, c] before quantization"
    )
    secagg_quantization_range: int = Field(
        2**22, ge=2, description="SecAgg+: [-c, c] mapped onto the integers 0..T (step 2c/T, stochastic rounding)"
    )
    secagg_modulus_range: int = Field(
        2**32, ge=4, le=2**32, description="SecAgg+: masks and sums modulo M (a power of 2 above m * T)"
    )
    secagg_num_shares: int | None = Field(
        None,
        ge=2,
        description="SecAgg+: neighbours each client shares its secrets with, itself included "
        "(default: every sampled client)",
    )
    secagg_threshold: int | None = Field(
        None, ge=2, description="SecAgg+: shares that rebuild a secret (default: a majority of the round's shares)"
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

    @field_validator("client_devices")
    @classmethod
    def _device_names(cls, devices: list[str] | None) -> list[str] | None:
        if devices is None:
            return None
        if len(devices) < 2:
            raise ValueError(
                f"federation.client_devices: expected two or more devices, one worker each (got {devices}; "
                "for one, set device)"
            )
        bad = next((d for d in devices if not DEVICE.fullmatch(d) or d == "auto"), None)
        if bad is not None:
            raise ValueError(f"federation.client_devices: expected cpu, cuda, cuda:N or mps per entry (got {bad!r})")
        return devices

    @model_validator(mode="after")
    def _check(self) -> FederationConfig:
        if self.profiles is not None and len(self.profiles) not in (1, self.num_clients):
            raise ValueError(
                f"federation.profiles: expected 1 or {self.num_clients} profiles (federation.num_clients), "
                f"got {len(self.profiles)}"
            )
        if self.profile_choices is not None:
            check_profile_choices(self.profile_choices)
        if self.device_classes is not None:
            check_device_classes(self.device_classes)
        adam_only = [
            k
            for k in ("server_betas", "server_eps", "server_weight_decay", "server_bias_correction")
            if getattr(self, k) != type(self).model_fields[k].default
        ]
        if self.server_optimizer == "sgd" and adam_only:
            raise ValueError(f"federation.{adam_only[0]}: applies to federation.server_optimizer='adam'")
        if self.server_optimizer == "adam" and self.server_momentum != 0:
            raise ValueError("federation.server_momentum: applies to server_optimizer='sgd' (adam: server_betas)")
        if self.server_optimizer == "adam" and self.server_lr is None:
            raise ValueError(
                "federation.server_lr: required with server_optimizer='adam' (the published FSLoRA code uses 5e-4)"
            )
        if not all(0 <= b < 1 for b in self.server_betas):
            raise ValueError(f"federation.server_betas: expected two values in [0, 1) (got {list(self.server_betas)})")
        if self.clients_per_round is not None and self.fraction is not None:
            raise ValueError("give federation.clients_per_round or federation.fraction, not both")
        if (
            self.trim_fraction != type(self).model_fields["trim_fraction"].default
            and self.aggregation != "trimmed-mean"
        ):
            raise ValueError('federation.trim_fraction: applies to federation.aggregation = "trimmed-mean"')
        if self.max_client_weight is not None and self.aggregation != "mean":
            raise ValueError(
                "federation.max_client_weight: bounds the weighted mean's shares (trimmed-mean, median: unweighted)"
            )
        if self.clients_per_round is not None and self.clients_per_round > self.num_clients:
            raise ValueError(
                f"federation.clients_per_round: expected at most num_clients={self.num_clients}, "
                f"got {self.clients_per_round}"
            )
        self._check_secure_aggregation()
        if self.min_replies > self.sample_size():
            raise ValueError(
                f"federation.min_replies: expected at most the {self.sample_size()} clients sampled per round, "
                f"got {self.min_replies}"
            )
        return self

    def _check_secure_aggregation(self) -> None:
        given = [k for k in SECAGG_PARAMETERS if getattr(self, k) != type(self).model_fields[k].default]
        if not self.secure_aggregation:
            if given:
                raise ValueError(f"federation.{given[0]}: applies to federation.secure_aggregation = true")
            return
        m, shares, t = self.sample_size(), self.secagg_shares(), self.secagg_reconstruction_threshold()
        if m < 2:
            raise ValueError(
                "federation.secure_aggregation: needs at least 2 clients per round (one's sum is its update)"
            )
        if self.secagg_modulus_range & (self.secagg_modulus_range - 1):
            raise ValueError(f"federation.secagg_modulus_range: expected a power of 2, got {self.secagg_modulus_range}")
        if m * self.secagg_quantization_range >= self.secagg_modulus_range:
            raise ValueError(
                f"federation.secagg_quantization_range: {m} clients x T = {self.secagg_quantization_range} must stay "
                f"below secagg_modulus_range = {self.secagg_modulus_range} (the sum would wrap around)"
            )
        if shares > m:
            raise ValueError(f"federation.secagg_num_shares: expected at most the {m} clients sampled per round")
        if not 2 <= t <= shares:
            raise ValueError(f"federation.secagg_threshold: expected 2..secagg_num_shares = {shares}, got {t}")
        bad = [k for k in ("upload_topk", "clip_update_norm", "max_client_weight") if getattr(self, k) is not None]
        if self.aggregation != "mean":
            bad.insert(0, "aggregation")
        if self.wire_dtype != "float32":
            bad.append("wire_dtype")
        if bad:
            raise ValueError(
                f"federation.{bad[0]}: not with federation.secure_aggregation (it needs each update; the server "
                "sees only their sum)"
            )

    def secagg_shares(self) -> int:
        """SecAgg+'s shares per secret: ``secagg_num_shares``, default every sampled client."""
        return self.secagg_num_shares or self.sample_size()

    def secagg_reconstruction_threshold(self, shares: int | None = None) -> int:
        """Shares that rebuild a secret: ``secagg_threshold``, default a majority (at least 2) of
        ``shares``, a round's shares per secret (default :meth:`secagg_shares`; under DP's Poisson
        sample a round's clients, and so its shares, vary)."""
        return self.secagg_threshold or max(2, (shares or self.secagg_shares()) // 2 + 1)

    def secagg_target(self, m: int) -> int:
        """SecAgg+'s quantization range T of a round summing ``m`` clients: ``secagg_quantization_range``,
        lowered to (M - 1) // m where m T would reach the modulus M (a DP round's Poisson sample may
        exceed the expected one), so the sum never wraps around."""
        return min(self.secagg_quantization_range, (self.secagg_modulus_range - 1) // m)

    def secagg_step(self) -> float:
        """The largest quantization step 2c/T any SecAgg+ round can use: T of a round that sums
        every client (:meth:`secagg_target` of ``num_clients``), c = ``secagg_clipping_range``."""
        return 2 * self.secagg_clipping_range / self.secagg_target(self.num_clients)

    def resolved_server_lr(self) -> float:
        """``server_lr``, or 1 (the plain sum of eq. (5) / FedAvg) when not given."""
        return 1.0 if self.server_lr is None else float(self.server_lr)

    def plain_server_step(self) -> bool:
        """Whether the server adds the aggregated update as it is (SGD at lr 1 without momentum: each
        paper's rule)."""
        return self.server_optimizer == "sgd" and self.resolved_server_lr() == 1.0 and self.server_momentum == 0

    def sample_size(self) -> int:
        """Clients sampled per round: ``clients_per_round``, else ``fraction`` of them (at least 1), else all."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        if self.fraction is not None:
            return max(1, round(self.fraction * self.num_clients))
        return self.num_clients
