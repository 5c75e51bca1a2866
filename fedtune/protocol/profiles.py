"""Per-client resource profiles: every per-client difference is data from the config, not code."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ClientProfile(BaseModel):
    """Resources of one client. Methods read the fields they need and ignore the rest."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # every number finite

    rank: int | None = Field(None, gt=0, description="LoRA rank budget (heterogeneous-rank methods)")
    sketch_ratio: float | None = Field(None, gt=0, le=1, description="FSLoRA k_i / r")
    capacity: float | None = Field(None, gt=0, le=1, description="fraction of the model it can train")
    speed: float = Field(
        1.0, gt=0, description="relative compute speed (1 = fedtune.planning.speed's reference FLOP/s)"
    )
    memory_gib: float | None = Field(None, gt=0, description="budget: memory for local training (GiB)")
    bandwidth_mb: float | None = Field(None, gt=0, description="budget: MB the client can upload per round")
    deadline_s: float | None = Field(None, gt=0, description="budget: seconds per round (slower: dropped)")
    device_class: str | None = Field(None, description="the federation.device_classes entry it was drawn from")
    upload_topk: float | None = Field(
        None, gt=0, le=1, description="its upload codec: top-k fraction (default federation.upload_topk)"
    )
    wire_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="its upload codec: dtype of its float arrays (default federation.wire_dtype)"
    )
    gradient_checkpointing: bool | None = Field(
        None, description="its local training with gradient checkpointing (default train.gradient_checkpointing)"
    )
    trains_on: Literal["full", "proxy"] | None = Field(
        None, description="FedPFT / FedOT: the model it trains the adapter on (default: the proxy)"
    )
    quantization: Literal["none", "8bit", "4bit"] | None = Field(
        None, description="its frozen base's quantization (default model.quantization): its own base in the process"
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="its frozen base's dtype (default model.dtype): its own base in the process"
    )
    failure_prob: float = Field(0.0, ge=0, le=1, description="fault injection: chance the client fails a request")
    delay_s: float = Field(0.0, ge=0, description="fault injection: seconds the client waits before answering")
    attack: Literal["sign-flip", "scale", "metadata"] | None = Field(
        None,
        description="fault injection: a hostile client's reply (its update sign-flipped, or times attack_scale; "
        "or its metadata replaced by attack_metadata)",
    )
    attack_scale: float = Field(100.0, gt=0, description="fault injection: the factor of attack = 'scale'")
    attack_metadata: Any = Field(
        None, description="fault injection: what attack = 'metadata' sends as its replies' metadata (any value)"
    )

    def upload_codec(self, topk: float | None, wire_dtype: str) -> tuple[float | None, str]:
        """(top-k fraction, wire dtype) of its uploads: its own where it states them, else the
        federation's ``topk`` and ``wire_dtype``."""
        return (topk if self.upload_topk is None else self.upload_topk), (self.wire_dtype or wire_dtype)


def _profile(fields: dict[str, Any], where: str) -> ClientProfile:
    try:  # strict: a bool or a string is not a number (as every config value, fedtune.config.loading)
        return ClientProfile.model_validate(fields, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ValueError(f"{where}.{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r})") from None


#: The profile fields a device class states (its budget).
BUDGET_FIELDS = ("memory_gib", "speed", "bandwidth_mb", "deadline_s")


class DeviceClass(BaseModel):
    """A kind of device (``federation.device_classes``): its budget, and the share of the clients
    drawn to it with the seed."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(min_length=1, description="the class's name (phone, laptop, ...)")
    share: float = Field(gt=0, le=1, description="chance that a client is of this class")
    memory_gib: float | None = Field(None, gt=0, description="the class's memory budget for local training (GiB)")
    speed: float = Field(1.0, gt=0, description="the class's relative compute speed (1: the reference)")
    bandwidth_mb: float | None = Field(None, gt=0, description="the class's upload budget (MB per round)")
    deadline_s: float | None = Field(None, gt=0, description="the class's deadline (seconds per round)")


def check_device_classes(classes: list[DeviceClass]) -> None:
    """The device ``classes``' names unique and shares summing to 1 (ValueError naming the field)."""
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"federation.device_classes: names must be unique (got {names})")
    total = sum(c.share for c in classes)
    if not classes or abs(total - 1) > 1e-6:
        raise ValueError(f"federation.device_classes: expected shares summing to 1 (got {total:g})")


def draw_device_classes(classes: list[DeviceClass], num_clients: int, seed: int) -> list[DeviceClass]:
    """Each of ``num_clients`` clients' device class among ``classes``, drawn with ``seed`` (independent of
    every other draw)."""
    rng = np.random.default_rng([seed, 0xDC])
    picks = rng.choice(
        len(classes), size=num_clients, p=np.array([c.share for c in classes]) / sum(c.share for c in classes)
    )
    return [classes[i] for i in picks]


def check_profile_choices(choices: dict[str, list[Any]]) -> None:
    """Every key of ``choices`` a profile field, every choice a valid value of it (ValueError naming the
    first bad one)."""
    for key, values in choices.items():
        if key not in ClientProfile.model_fields:
            raise ValueError(
                f"federation.profile_choices.{key}: not a profile field; "
                f"expected one of {', '.join(ClientProfile.model_fields)}"
            )
        if not isinstance(values, list) or not values:
            raise ValueError(f"federation.profile_choices.{key}: expected a non-empty list")
        for value in values:
            _profile({key: value}, "federation.profile_choices")


def build_profiles(
    num_clients: int,
    explicit: Sequence[ClientProfile | dict[str, Any]] | None,
    choices: dict[str, list[Any]] | None,
    seed: int,
    classes: list[DeviceClass] | None = None,
) -> list[ClientProfile]:
    """Profiles for clients ``0..num_clients-1``: an explicit list (one per client, or one for
    all), or each field drawn uniformly from its choices with ``seed``; else defaults. With
    device ``classes``, each client's budget is its drawn class's (a profile may not state one too)."""
    profiles = _base_profiles(num_clients, explicit, choices, seed)
    if not classes:
        return profiles
    check_device_classes(classes)
    out = []
    for cid, (profile, cls) in enumerate(zip(profiles, draw_device_classes(classes, num_clients, seed))):
        both = sorted(set(BUDGET_FIELDS) & profile.model_fields_set)
        if both:
            raise ValueError(
                f"federation.device_classes: client {cid}'s profile also states {both[0]}; "
                "state a budget in the profiles or in the device classes, not both"
            )
        budget = {k: getattr(cls, k) for k in BUDGET_FIELDS}
        out.append(profile.model_copy(update={**budget, "device_class": cls.name}))
    return out


def _base_profiles(
    num_clients: int,
    explicit: Sequence[ClientProfile | dict[str, Any]] | None,
    choices: dict[str, list[Any]] | None,
    seed: int,
) -> list[ClientProfile]:
    if explicit is not None:
        if len(explicit) == 1:
            explicit = list(explicit) * num_clients
        if len(explicit) != num_clients:
            raise ValueError(
                f"federation.profiles: expected 1 or {num_clients} profiles (federation.num_clients), "
                f"got {len(explicit)}"
            )
        return [
            p if isinstance(p, ClientProfile) else _profile(p, f"federation.profiles[{i}]")
            for i, p in enumerate(explicit)
        ]
    if choices:
        check_profile_choices(choices)
        rng = np.random.default_rng([seed, 0x9F0F])
        drawn: dict[str, list[Any]] = {}
        for key in sorted(choices):
            values = list(choices[key])
            drawn[key] = [values[i] for i in rng.integers(0, len(values), size=num_clients)]
        return [_profile({k: v[i] for k, v in drawn.items()}, "federation.profile_choices") for i in range(num_clients)]
    return [ClientProfile() for _ in range(num_clients)]
