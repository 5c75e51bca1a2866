"""Robust aggregation of client updates, for the methods whose server adds a weighted mean of
updates (``robust.aggregation``, ``robust.trim_fraction``, ``robust.clip_update_norm``,
``robust.max_client_weight``; the registry refuses them for every other method).

The defences a user with untrusted parties reaches for, applied in this order:

1. norm clipping: Delta_i <- Delta_i * min(1, C / ||Delta_i||_2), the L2 norm over all of the
   update's arrays (``clip_update_norm`` = C), so no client moves the model further than C;
2. a weight bound: p_i = w_i / sum_j w_j capped at ``max_client_weight``, the excess moved to the
   other clients in proportion to their weights (so a client claiming a huge ``num_examples``
   holds at most that share);
3. the combination: the weighted mean sum_i p_i Delta_i (``"mean"``, FedAvg), or, per coordinate,
   the trimmed mean (the ``trim_fraction`` largest and smallest values dropped, the rest averaged
   unweighted; Yin et al., "Byzantine-robust distributed learning", ICML 2018) or the median
   (unweighted: the robust estimators ignore the weights, which a client reports itself), or a
   combiner of the user's own package (:func:`register_combiner`, found as :mod:`fedtune.plugins`
   finds methods: entry point group ``fedtune.combiners`` or ``"my_pkg.module:NAME"``), refused
   wherever the robust ones are (a method that does not honour ``robust.aggregation``, DP,
   SecAgg+).

A bound only limits the damage: with clipping, f attackers among n can still move the mean by up
to f C / n in any direction they choose; a trimmed mean tolerates fewer attackers per coordinate
than it trims at each end.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedtune.config import ConfigError, RobustConfig
from fedtune.plugins import COMBINERS as COMBINER_GROUP
from fedtune.plugins import load_declared, resolve_reference

#: The cross-method options (fedtune.registry.CROSS_METHOD_OPTIONS) a method honours when its server
#: combines updates with its :func:`combiner`.
ROBUST_AGGREGATION = ("robust.aggregation", "robust.clip_update_norm", "robust.max_client_weight")


def weighted_average(updates: Sequence[Mapping[str, np.ndarray]], weights: Iterable[float]) -> dict[str, np.ndarray]:
    """sum_i p_i u_i with p_i = w_i / sum_j w_j, key by key."""
    w = np.asarray(list(weights), dtype=np.float64)
    w = w / w.sum()
    return {k: np.asarray(sum(float(p) * u[k] for p, u in zip(w, updates))).astype(np.float32) for k in updates[0]}


def clip_update(update: Mapping[str, np.ndarray], bound: float) -> dict[str, np.ndarray]:
    """``update`` scaled by min(1, bound / ||update||_2), the norm over all its arrays."""
    norm = float(np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in update.values())))
    if norm <= bound:
        return dict(update)
    scale = bound / norm
    return {k: (v * scale).astype(v.dtype) for k, v in update.items()}


def bounded_weights(weights: Iterable[float], cap: float) -> np.ndarray:
    """The normalized weights with none above ``cap``: a capped client's excess is spread over the
    others in proportion to their weights, repeatedly, until none exceeds it (uniform when
    ``cap`` < 1/n leaves no other way)."""
    p = np.asarray(list(weights), dtype=np.float64)
    p = p / p.sum()
    if cap * len(p) <= 1.0:
        return np.full(len(p), 1.0 / len(p))
    capped = np.zeros(len(p), dtype=bool)
    while (over := (p > cap + 1e-12) & ~capped).any():
        capped |= over
        free = ~capped
        p[capped] = cap
        rest = 1.0 - cap * capped.sum()
        p[free] = p[free] / p[free].sum() * rest if p[free].sum() > 0 else rest / free.sum()
    return p


def trimmed_mean(updates: list[Mapping[str, np.ndarray]], fraction: float) -> dict[str, np.ndarray]:
    """Per coordinate: the floor(fraction n) largest and smallest values dropped (fewer when that
    would leave none), the rest averaged."""
    n = len(updates)
    cut = min(int(np.floor(fraction * n)), (n - 1) // 2)
    out = {}
    for k in updates[0]:
        stacked = np.sort(np.stack([u[k] for u in updates]).astype(np.float64), axis=0)
        out[k] = stacked[cut : n - cut].mean(axis=0).astype(np.float32)
    return out


def coordinate_median(updates: list[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per coordinate: the median of the clients' values."""
    return {
        k: np.median(np.stack([u[k] for u in updates]).astype(np.float64), axis=0).astype(np.float32)
        for k in updates[0]
    }


class Combiner(Protocol):
    """How a server combines the round's updates into one (with their FedAvg weights)."""

    def __call__(self, updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
        """The combined update of ``updates`` (one weight each)."""
        ...


@dataclass(frozen=True)
class WeightedMean:
    """sum_i p_i Delta_i (FedAvg), each share capped at ``max_client_weight`` when given."""

    max_client_weight: float | None = None

    def __call__(self, updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
        if self.max_client_weight is not None:
            return weighted_average(list(updates), bounded_weights(weights, self.max_client_weight))
        return weighted_average(list(updates), weights)


@dataclass(frozen=True)
class TrimmedMean:
    """The per-coordinate trimmed mean (unweighted), ``fraction`` cut at each end."""

    fraction: float

    def __call__(self, updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
        return trimmed_mean(list(updates), self.fraction)


@dataclass(frozen=True)
class CoordinateMedian:
    """The per-coordinate median (unweighted)."""

    def __call__(self, updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
        return coordinate_median(list(updates))


@dataclass(frozen=True)
class NormClipped:
    """``combiner`` of the updates each clipped to L2 norm ``bound`` first."""

    bound: float
    combiner: Combiner

    def __call__(self, updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
        return self.combiner([clip_update(u, self.bound) for u in updates], weights)


CombinerFactory = Callable[[RobustConfig], Combiner]


@dataclass(frozen=True)
class CombinerSpec:
    """A registered combiner: its ``factory`` (the ``[robust]`` section -> a :class:`Combiner`),
    a one-line ``description`` and the ``module`` that registered it."""

    name: str
    factory: CombinerFactory
    description: str
    module: str


def _takes(function: Callable, count: int) -> bool:
    """Whether ``function`` can be called with ``count`` positional arguments."""
    try:
        inspect.signature(function).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call decide
        return True
    return True


#: ``robust.aggregation`` -> its combiner: fedtune's own here, a user's package's added by
#: :func:`register_combiner`.
COMBINERS: dict[str, CombinerSpec] = {}


def register_combiner(name: str, factory: CombinerFactory, description: str = "") -> CombinerSpec:
    """Register ``factory`` (called with the ``[robust]`` section, it returns a :class:`Combiner`:
    ``(updates, weights) -> update``) as ``robust.aggregation = name``; ``description``: one
    line (default: the first line of the factory's docstring). A name registered twice, or a
    ``factory`` that cannot take the section, raises."""
    module = sys._getframe(1).f_globals.get("__name__", "?")
    if not callable(factory) or not _takes(factory, 1):
        raise TypeError(
            f"register_combiner({name!r}): expected a factory taking the [robust] section and returning a "
            f"combiner (updates, weights) -> update, got {factory!r}"
        )
    if name in COMBINERS:
        raise ValueError(f"combiner {name!r} is registered twice: by {COMBINERS[name].module} and by {module}")
    doc = description or (factory.__doc__ or "").strip().split("\n")[0]
    COMBINERS[name] = spec = CombinerSpec(name, factory, doc, module)
    return spec


register_combiner("mean", lambda robust: WeightedMean(robust.max_client_weight), "the weighted mean (FedAvg)")
register_combiner("trimmed-mean", lambda robust: TrimmedMean(robust.trim_fraction), "per coordinate, the trimmed mean")
register_combiner("median", lambda robust: CoordinateMedian(), "per coordinate, the median")


def get_combiner(name: str) -> CombinerSpec:
    """The combiner ``robust.aggregation = name`` names: fedtune's own, one an installed package
    declares (entry point group ``fedtune.combiners``), or ``"my_pkg.module:NAME"``; one line naming
    ``robust.aggregation`` when it is none of them."""
    key = resolve_reference(name, "robust.aggregation")
    if key not in COMBINERS:
        load_declared(COMBINER_GROUP, "robust.aggregation")
    if key not in COMBINERS:
        raise ConfigError(
            f"robust.aggregation: unknown combiner {name!r}; expected one of {', '.join(sorted(COMBINERS))}, "
            "or my_pkg.module:NAME"
        )
    return COMBINERS[key]


def list_combiners(plugins: bool = False) -> list[CombinerSpec]:
    """fedtune's combiners (``plugins``: and those the installed packages declare), by name."""
    if plugins:
        load_declared(COMBINER_GROUP)
    return [COMBINERS[k] for k in sorted(COMBINERS)]


def combiner(robust: RobustConfig) -> Combiner:
    """The round's combiner under the ``[robust]`` section ``robust`` (see the module
    docstring); with none set, exactly :func:`weighted_average`. A user's factory that fails, or
    makes something that is not a combiner, stops with one line naming ``robust.aggregation``."""
    name = robust.aggregation
    try:
        chosen = get_combiner(name).factory(robust)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory: any failure is one line
        raise ConfigError(f"robust.aggregation: {name!r} failed ({type(exc).__name__}: {exc})") from None
    if not callable(chosen) or not _takes(chosen, 2):
        raise ConfigError(
            f"robust.aggregation: {name!r} made {type(chosen).__name__}, not a combiner (updates, weights) -> update"
        )
    return chosen if robust.clip_update_norm is None else NormClipped(robust.clip_update_norm, chosen)
