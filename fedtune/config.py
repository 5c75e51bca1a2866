"""Typed run configuration: TOML recipes, ``key=value`` overrides, one-line errors.

A recipe is a TOML file whose tables mirror :class:`RunConfig`. A section given as a plain
string means its ``name`` (``data = "sst2"`` is ``[data] name = "sst2"``), so
``fedtune run --set method=fedit --set data=sst2`` works.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedtune.errors import FedtuneError
from fedtune.protocol.profiles import ClientProfile, check_profile_choices


class ConfigError(FedtuneError, ValueError):
    """An invalid configuration key or value; the message is one line naming it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite

    @model_validator(mode="before")
    @classmethod
    def _string_is_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class TaskConfig(_Section):
    """What a run learns (``fedtune tasks``): ``kind`` plus the task's own options, checked by the
    task (``task = "image-classification"`` is ``[task] kind = "image-classification"``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # every number finite
    kind: str = Field("text-classification", description="task kind (fedtune tasks)")

    @model_validator(mode="before")
    @classmethod
    def _string_is_name(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    @property
    def options(self) -> dict[str, Any]:
        """The task's own options (every key but ``kind``)."""
        return dict(self.model_extra or {})


class DataConfig(_Section):
    name: str | None = Field(
        None, description="data set (default: the task's; text: tweets, sst2, agnews, a local file, or hub:<dataset>)"
    )
    data_dir: str | None = Field(None, description="folder of named sets (default: $FEDTUNE_DATA_DIR)")
    test_path: str | None = Field(None, description="evaluation file when name is a local file")
    text_column: str | None = Field(None, description="text column (local files and hub sets)")
    label_column: str | None = Field(None, description="label column (local files and hub sets)")
    hub_config: str | None = Field(None, description="hub dataset configuration name")
    train_split: str = "train"
    test_split: str = "test"
    partition: Literal["iid", "dirichlet", "dirichlet-client", "shards", "column"] = Field(
        "dirichlet",
        description="iid; Dirichlet label skew per class or per client (Hsu et al. 2019); label shards; "
        "the data's own client column (client_column)",
    )
    client_column: str | None = Field(
        None, description="partition 'column': the column naming each example's client (dolly: fedit_client)"
    )
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (smaller = more label skew)")
    shards_per_client: int = Field(2, gt=0, description="shards partition: label-sorted shards per client")
    max_train_samples: int | None = Field(None, gt=0, description="subsample the training pool")
    max_test_samples: int | None = Field(None, gt=0, description="subsample the test set")
    max_length: int = Field(64, gt=1, le=4096, description="tokens per example")


class ModelConfig(_Section):
    name: str | None = Field(None, description="model (default: the task's; text: minilm), a hub name, or a local path")
    lora_rank: int = Field(8, gt=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = Field(
        None, description="LoRA target modules (default: the task's for its model)"
    )
    finetune: Literal["full", "head"] = Field(
        "full", description="what methods without LoRA (fedavg) train: every parameter, or the head only"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the frozen base weights (adapters, heads and optimizer state: float32)"
    )
    quantization: Literal["none", "8bit", "4bit"] = Field(
        "none", description="quantize the frozen base's linear layers with bitsandbytes (4bit: NF4 + double quant)"
    )


class TrainConfig(_Section):
    local_steps: int = Field(10, gt=0, description="optimizer steps per client per round (H)")
    batch_size: int = Field(16, gt=0)
    lr: float = Field(5e-4, gt=0)
    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="local optimizer; FSLoRA's Algorithm 1 takes plain SGD steps (eq. (4))"
    )
    momentum: float = Field(
        0.0, ge=0, lt=1, description="heavy-ball momentum of optimizer='sgd' (the published FSLoRA GLUE clients: 0.9)"
    )
    weight_decay: float = Field(0.0, ge=0)
    eval_batch_size: int = Field(128, gt=0)
    group_by_length: bool = Field(True, description="batch examples of similar length (less padding)")
    threads: int | None = Field(None, gt=0, description="torch threads (default: torch's choice)")
    gradient_checkpointing: bool = Field(
        False, description="recompute the base's activations in the backward pass (less memory, more compute)"
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.momentum and self.optimizer != "sgd":
            raise ValueError(f"train.momentum: applies to train.optimizer='sgd' (got optimizer={self.optimizer!r})")
        return self


SECAGG_PARAMETERS = (
    "secagg_clipping_range",
    "secagg_quantization_range",
    "secagg_modulus_range",
    "secagg_num_shares",
    "secagg_threshold",
)


class FederationConfig(_Section):
    num_clients: int = Field(10, gt=0)
    clients_per_round: int | None = Field(None, gt=0, description="clients sampled per round")
    fraction: float | None = Field(None, gt=0, le=1, description="fraction sampled per round")
    profiles: list[ClientProfile] | None = Field(None, description="one resource profile per client (or one for all)")
    profile_choices: dict[str, list[Any]] | None = Field(None, description="draw each profile field from a set")
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
    server_betas: tuple[float, float] = Field((0.9, 0.999), description="FedAdam's (beta1, beta2)")
    server_eps: float = Field(1e-8, gt=0, description="FedAdam's epsilon (Reddi et al.'s tau)")
    server_weight_decay: float = Field(0.0, ge=0, description="FedAdam's decoupled weight decay (torch AdamW: 0.01)")
    server_bias_correction: bool = Field(
        True, description="FedAdam with Adam's bias correction (torch) or without (Reddi et al.)"
    )
    aggregation: Literal["mean", "trimmed-mean", "median"] = Field(
        "mean", description="combine the updates by their weighted mean, or per coordinate by a trimmed mean or median"
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
        "not under DP (its clipping bounds updates)",
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
        None, ge=2, description="SecAgg+: shares that rebuild a secret (default: a majority of num_shares)"
    )

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
        adam_only = [
            k
            for k in ("server_betas", "server_eps", "server_weight_decay", "server_bias_correction")
            if getattr(self, k) != type(self).model_fields[k].default
        ]
        if self.server_optimizer == "sgd" and adam_only:
            raise ValueError(f"federation.{adam_only[0]}: applies to federation.server_optimizer='adam'")
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

    def secagg_reconstruction_threshold(self) -> int:
        """Shares that rebuild a secret: ``secagg_threshold``, default a majority of the shares (at least 2)."""
        return self.secagg_threshold or max(2, self.secagg_shares() // 2 + 1)

    def resolved_server_lr(self) -> float:
        """``server_lr``, or 1 (the plain sum of eq. (5) / FedAvg) when not given."""
        return 1.0 if self.server_lr is None else float(self.server_lr)

    def plain_server_step(self) -> bool:
        """Whether the server adds the aggregated update as it is (SGD at lr 1: each paper's rule)."""
        return self.server_optimizer == "sgd" and self.resolved_server_lr() == 1.0

    def sample_size(self) -> int:
        if self.clients_per_round is not None:
            return self.clients_per_round
        if self.fraction is not None:
            return max(1, round(self.fraction * self.num_clients))
        return self.num_clients


class PrivacyConfig(_Section):
    """Client-level differential privacy (DP-FedAvg, McMahan et al. 2018): see
    :mod:`fedtune.methods.base.privacy` for the mechanism, the accountant and what is guaranteed."""

    mode: Literal["none", "central", "local"] = Field(
        "none", description="Gaussian noise on the server's sum (central, trusted server) or on each upload (local)"
    )
    clip: float | None = Field(None, gt=0, description="C: each client's update clipped to this L2 norm")
    per_layer: bool = Field(False, description="clip each of the L arrays to C/sqrt(L) instead of the whole update")
    noise_multiplier: float | None = Field(
        None, gt=0, le=1e6, description="z: noise std z*C (or calibrate it: epsilon)"
    )
    epsilon: float | None = Field(None, gt=0, description="target epsilon after `rounds`: z calibrated to it")
    delta: float | None = Field(None, gt=0, lt=1, description="delta (default min(1/num_clients^2, 1e-5))")
    epsilon_budget: float | None = Field(None, gt=0, description="stop before a round whose epsilon would exceed this")
    accountant: Literal["pld", "rdp"] = Field("pld", description="pld (tight) or rdp (Renyi, an upper bound)")
    adjacency: Literal["replace-one", "add-remove"] = Field(
        "replace-one", description="neighbouring federations: one client's data replaced, or one client added/removed"
    )
    adaptive_clip: bool = Field(False, description="central: C follows a quantile of the update norms (Andrew 2021)")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="adaptive_clip: the norm quantile C tracks")
    clip_learning_rate: float = Field(0.2, gt=0, le=10, description="adaptive_clip: eta of C <- C exp(-eta (b - q))")
    clipped_count_stddev: float | None = Field(
        None, gt=0, description="adaptive_clip: sigma_b, noise std of the unclipped count (default max(m/20, z))"
    )
    insecure_reproducible_noise: bool = Field(
        False, description="TESTS ONLY, NOT PRIVATE: noise and sample derived from `seed`; epsilon reported as inf"
    )

    @model_validator(mode="after")
    def _check(self) -> PrivacyConfig:
        defaults = {k: f.default for k, f in type(self).model_fields.items()}
        if self.mode == "none":
            given = [k for k in type(self).model_fields if k != "mode" and getattr(self, k) != defaults[k]]
            if given:
                raise ValueError(f'privacy.{given[0]}: applies to privacy.mode = "central" or "local"')
            return self
        if self.clip is None:
            raise ValueError(f'privacy.clip: required with privacy.mode = "{self.mode}" (the L2 bound C)')
        if self.noise_multiplier is not None and self.epsilon is not None:
            raise ValueError("privacy: give privacy.noise_multiplier or privacy.epsilon (to calibrate it), not both")
        if self.noise_multiplier is None and self.epsilon is None:
            raise ValueError(
                f'privacy.noise_multiplier: required with privacy.mode = "{self.mode}" '
                "(or privacy.epsilon to calibrate it)"
            )
        if self.insecure_reproducible_noise and (self.epsilon is not None or self.epsilon_budget is not None):
            given = "epsilon" if self.epsilon is not None else "epsilon_budget"
            raise ValueError(
                f"privacy.{given}: not with privacy.insecure_reproducible_noise (its noise can be regenerated from "
                "the seed: it gives no privacy)"
            )
        adaptive = [k for k in ADAPTIVE_CLIP_KEYS if getattr(self, k) != defaults[k]]
        if adaptive and not self.adaptive_clip:
            raise ValueError(f"privacy.{adaptive[0]}: applies to privacy.adaptive_clip = true")
        if self.mode == "local":
            if self.adaptive_clip:
                raise ValueError("privacy.adaptive_clip: central only (its count is noised by the server)")
            if self.adjacency == "add-remove":
                raise ValueError(
                    'privacy.adjacency: local DP protects each upload against its replacement ("replace-one")'
                )
        elif self.accountant == "rdp" and self.adjacency == "replace-one":
            raise ValueError(
                'privacy.accountant: "rdp" has no Poisson-subsampled Gaussian under replace-one adjacency; '
                'use "pld" or privacy.adjacency = "add-remove"'
            )
        return self


ADAPTIVE_CLIP_KEYS = ("target_quantile", "clip_learning_rate", "clipped_count_stddev")


#: A run folder's name: one path component (no separator, no "." or ".."), of characters that need no
#: quoting in a shell; a default name made from a data set's file name is mapped onto it.
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,2})?|mps")
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite

    name: str | None = Field(None, description="run folder name under output_dir (default: method-data-seed)")
    method: str = "fedit"
    seed: int = Field(0, ge=0, lt=2**32)
    rounds: int = Field(10, gt=0)
    eval_every: int = Field(1, gt=0, description="evaluate every this many rounds (and the last)")
    output_dir: str = "runs"
    engine: Literal["embedded", "flower-sim", "flower"] = Field(
        "embedded",
        description="embedded (in-process), flower-sim (Flower's simulation) or flower (a loopback deployment)",
    )
    device: str = Field(
        "cpu", description="where models compute: cpu, cuda, cuda:N, mps, or auto (CUDA when available, else cpu)"
    )
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    options: dict[str, Any] = Field(default_factory=dict, description="the method's own options")

    @model_validator(mode="after")
    def _gpu_fractions(self) -> RunConfig:
        if self.federation.gpus_per_client and self.engine != "flower-sim":
            raise ValueError("federation.gpus_per_client: applies to engine = 'flower-sim'")
        if self.federation.client_devices is not None and self.engine != "embedded":
            raise ValueError(
                "federation.client_devices: applies to engine = 'embedded' (flower-sim: federation.gpus_per_client)"
            )
        if self.federation.gpus_per_client and not self.device.startswith(("cuda", "auto")):
            raise ValueError(f"federation.gpus_per_client: needs device = 'cuda' or 'auto' (got {self.device!r})")
        return self

    @model_validator(mode="after")
    def _check_secure_aggregation(self) -> RunConfig:
        fed = self.federation
        if not fed.secure_aggregation:
            return self
        if self.engine == "embedded":
            raise ValueError(
                'federation.secure_aggregation: runs on engine = "flower-sim" or "flower" (Flower\'s SecAgg+; '
                "the embedded engine has no masking)"
            )
        if self.engine == "flower" and fed.nodes is not None and fed.nodes != fed.num_clients:
            raise ValueError(
                f"federation.nodes: secure aggregation needs one client per node ({fed.num_clients}; SecAgg+ keys "
                f"and state belong to a node), got {fed.nodes}"
            )
        if self.privacy.adaptive_clip:
            raise ValueError(
                "privacy.adaptive_clip: not with federation.secure_aggregation (its count needs each update's norm)"
            )
        return self

    @model_validator(mode="after")
    def _check_privacy(self) -> RunConfig:
        if self.privacy.mode == "none":
            return self
        fed = self.federation
        robust = [
            k
            for k, v in (
                ("aggregation", fed.aggregation != "mean"),
                ("clip_update_norm", fed.clip_update_norm),
                ("max_client_weight", fed.max_client_weight),
            )
            if v
        ]
        if robust:
            raise ValueError(
                f"federation.{robust[0]}: not with privacy.mode (DP-FedAvg clips and sums every update itself)"
            )
        retry = [k for k in ("min_replies", "max_retries") if getattr(fed, k) != type(fed).model_fields[k].default]
        if retry:
            raise ValueError(
                f"federation.{retry[0]}: not with privacy.mode (a DP round aggregates whatever its secret Poisson "
                "sample returns, missing replies as zero updates; a retry would condition the sample)"
            )
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
        return f"{self.method}-{data}-s{self.seed}"[:128]


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".") or "config"
    msg = first["msg"].removeprefix("Value error, ")
    given = first.get("input")
    shown = "" if first["type"] == "missing" or isinstance(given, dict) else f" (got {given!r})"
    more = f" [+{len(err.errors()) - 1} more]" if len(err.errors()) > 1 else ""
    if first["type"] == "value_error" and (msg.startswith(where) or not first["loc"]):  # a check naming its field
        return f"{msg}{more}"
    return f"{where}: {msg}{shown}{more}"


SHORTHAND = {"task": "kind"}  # what a section given as a plain string names (default: "name")


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML syntax if it parses (numbers, booleans, lists), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.key=value`` to a nested dict, in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value")
    key, text = assignment.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str):  # `data = "sst2"` then `--set data.alpha=0.1`
            child = {SHORTHAND.get(part, "name"): child}
        node[part] = child if isinstance(child, dict) else {}
        node = node[part]
    node[parts[-1]] = parse_value(text.strip())


def flat_keys(tree: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """A nested dict as one ``{"a.b.c": value}`` dict (the inverse of :func:`apply_override`'s
    nesting); ``sep`` joins the keys."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update({f"{key}{sep}{sub}": leaf for sub, leaf in flat_keys(value, sep).items()})
        else:
            out[key] = value
    return out


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML recipe (optional), apply ``key=value`` overrides, validate."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r}: file not found")
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"recipe {str(path)!r}: invalid TOML ({exc})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"recipe {str(path)!r}: invalid TOML (not UTF-8 text)") from None
        except OSError as exc:
            raise ConfigError(f"recipe {str(path)!r}: cannot be read ({exc.strerror})") from None
    for assignment in overrides or []:
        apply_override(tree, assignment)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def validate_options(values: dict[str, Any], options_cls: type[BaseModel], prefix: str = "options") -> BaseModel:
    """Typed options (a method's ``[options]``, a task's ``[task]``), errors prefixed with ``prefix.``."""
    try:
        return options_cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"{prefix}." + _format_error(exc)) from None
