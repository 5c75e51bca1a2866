"""What a method lets a planned client vary (:class:`Knob`), and the LoRA methods' rank ladder
r, r/2, ..., 1 (:func:`rank_knob`), shared by the transformer and the measured planners."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedtune.protocol.profiles import ClientProfile


def ladder(rank: int) -> list[int]:
    """r, r/2, r/4, ..., 1 (largest first)."""
    out = [rank]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


@dataclass
class Knob:
    """What a method lets a client vary: its ladder (largest first), the value a profile states
    (None: unstated), each (value, gradient checkpointing, base format)'s (prediction, upload
    values), the setting's label, the profile field's value for a ladder value, and the
    checkpointing variants and base formats, (quantization, dtype), to try (the run's first; None:
    the knob prices one base)."""

    ladder: list
    stated: Callable[[ClientProfile], Any]
    cost: Callable[[Any, bool, tuple[str, str] | None], tuple]
    label: Callable[[Any], str]
    value: Callable[[Any], Any] = lambda v: v
    variants: tuple[bool, ...] = (False,)
    formats: tuple[tuple[str, str] | None, ...] = (None,)
    speed_note: str = ""


def rank_knob(r: int, knob: str | None, cost: Callable, **kwargs) -> Knob:
    """The rank r, r/2, ..., 1 (``knob`` "sketch_ratio": FSLoRA's rank / r) priced by ``cost``."""
    from fedtune.methods.base.lora import client_rank

    def stated(profile: ClientProfile):
        return client_rank(profile, r) if profile.rank is not None or profile.sketch_ratio is not None else None

    if knob == "sketch_ratio":
        return Knob(ladder(r), stated, cost, lambda v: f"sketch ratio {v / r:g}", lambda v: v / r, **kwargs)
    return Knob(ladder(r), stated, cost, "rank {}".format, **kwargs)
