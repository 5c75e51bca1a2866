"""``[federation]`` (the clients, their sampling and profiles, what they upload, a round's replies) and
``[placement]`` (where each engine runs the clients)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedtune.config.base import DEVICE, Section
from fedtune.protocol.profiles import ClientProfile, DeviceClass, check_device_classes, check_profile_choices


class FederationConfig(Section):
    """``[federation]``: the clients, their sampling and profiles, what they upload, a round's replies."""

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
    min_replies: int = Field(1, gt=0, description="valid replies a round needs to aggregate (else it is retried)")
    max_retries: int = Field(2, ge=0, description="retries of a round short of min_replies before the run stops")
    round_timeout_s: float | None = Field(None, gt=0, description="a client slower than this in a round is dropped")
    max_reply_bytes: int = Field(256 * 2**20, gt=0, description="a larger reply is rejected")

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
        if self.clients_per_round is not None and self.fraction is not None:
            raise ValueError("give federation.clients_per_round or federation.fraction, not both")
        if self.clients_per_round is not None and self.clients_per_round > self.num_clients:
            raise ValueError(
                f"federation.clients_per_round: expected at most num_clients={self.num_clients}, "
                f"got {self.clients_per_round}"
            )
        if self.min_replies > self.sample_size():
            raise ValueError(
                f"federation.min_replies: expected at most the {self.sample_size()} clients sampled per round, "
                f"got {self.min_replies}"
            )
        return self

    def sample_size(self) -> int:
        """Clients sampled per round: ``clients_per_round``, else ``fraction`` of them (at least 1), else all."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        if self.fraction is not None:
            return max(1, round(self.fraction * self.num_clients))
        return self.num_clients


class PlacementConfig(Section):
    """``[placement]``: where the clients compute, one key per engine (each refused on the others)."""

    client_devices: list[str] | None = Field(
        None,
        description="engine 'embedded': one worker process per device (cuda:N, cpu, ...; two or more), the clients "
        "spread over them (default: every visible GPU when device is cuda or auto and there are several, "
        "else the run's process)",
    )
    gpus_per_client: float = Field(
        0.0, ge=0, le=1, description="engine 'flower-sim': the GPU fraction Ray gives each ClientApp (device cuda)"
    )
    nodes: int | None = Field(
        None,
        gt=0,
        description="engine 'flower': SuperNodes, each playing a group of clients "
        "(default: min(clients per round, cores); one per client with secure_aggregation)",
    )

    @field_validator("client_devices")
    @classmethod
    def _device_names(cls, devices: list[str] | None) -> list[str] | None:
        if devices is None:
            return None
        if len(devices) < 2:
            raise ValueError(
                f"placement.client_devices: expected two or more devices, one worker each (got {devices}; "
                "for one, set device)"
            )
        bad = next((d for d in devices if not DEVICE.fullmatch(d) or d == "auto"), None)
        if bad is not None:
            raise ValueError(f"placement.client_devices: expected cpu, cuda, cuda:N or mps per entry (got {bad!r})")
        return devices
