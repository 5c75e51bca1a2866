"""The LoRA methods' rank ladder r, r/2, ..., 1 as a :class:`~fedtune.planning.spec.Knob`
(:func:`rank_knob`), shared by the transformer and the measured planners."""

from __future__ import annotations

from collections.abc import Callable

from fedtune.planning.spec import Knob
from fedtune.protocol.profiles import ClientProfile

__all__ = ["Knob", "ladder", "rank_knob"]


def ladder(rank: int) -> list[int]:
    """r, r/2, r/4, ..., 1 (largest first)."""
    out = [rank]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def rank_knob(r: int, knob: str | None, cost: Callable, **kwargs) -> Knob:
    """The rank r, r/2, ..., 1 (``knob`` "sketch_ratio": rank / r) priced by ``cost``."""
    from fedtune.methods.base.lora import client_rank

    def stated(profile: ClientProfile):
        return client_rank(profile, r) if profile.rank is not None or profile.sketch_ratio is not None else None

    if knob == "sketch_ratio":
        return Knob(ladder(r), stated, cost, lambda v: f"sketch ratio {v / r:g}", lambda v: v / r, **kwargs)
    return Knob(ladder(r), stated, cost, "rank {}".format, **kwargs)
