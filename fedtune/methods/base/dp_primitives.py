"""The primitives of :mod:`fedtune.methods.base.privacy`'s mechanisms: secret randomness, clipping,
SecAgg+'s rounding margin, Gaussian noise and Poisson sampling (numpy, float64)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence

import numpy as np


def fresh_secret() -> np.ndarray:
    """128 bits of OS entropy, as 4 uint32 words."""
    return np.frombuffer(secrets.token_bytes(16), dtype=np.uint32).copy()


def generator(secret: Sequence[int] | np.ndarray, *stream: int) -> np.random.Generator:
    """The generator of ``stream`` (a tuple of non-negative ints) under ``secret``."""
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in secret], spawn_key=stream))


def clip(update: Mapping[str, np.ndarray], bound: float, per_layer: bool = False) -> dict[str, np.ndarray]:
    """``update`` (float64) scaled to L2 norm at most ``bound`` over all its arrays, or, with
    ``per_layer``, each of its L arrays to ``bound``/sqrt(L)."""
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in update.items()}
    if per_layer:
        each = bound / math.sqrt(len(arrays))
        return {k: v * min(1.0, each / max(float(np.linalg.norm(v)), 1e-300)) for k, v in arrays.items()}
    norm = l2_norm(arrays)
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {k: v * scale for k, v in arrays.items()}


def quantization_margin(step: float, size: int, bound: float) -> float:
    """How far SecAgg+'s stochastic rounding can lift the L2 norm of a vector of ``size`` coordinates
    and norm at most ``bound``: mu = s sqrt(d) (1 + 1e-5) + 1e-6 C. Each coordinate moves by less than
    one step s = 2c/T (rounded up or down to the grid; the mod's float64 arithmetic adds below 1e-5 of
    a step for T <= 2^32), so ||q(v)|| <= ||v|| + s sqrt(d) (triangle inequality; an update whose
    coordinates all round up comes within a hair of it); 1e-6 C covers the float rounding of v itself."""
    return step * math.sqrt(size) * (1 + 1e-5) + 1e-6 * bound


def l2_norm(update: Mapping[str, np.ndarray]) -> float:
    """The L2 norm over all the arrays of ``update``."""
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in update.values()))


def gaussian_like(arrays: Mapping[str, np.ndarray], std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """N(0, std^2) noise (float64) shaped like ``arrays``, drawn in sorted name order."""
    return {k: rng.normal(0.0, std, size=np.shape(arrays[k])) for k in sorted(arrays)}


def poisson_sample(num_clients: int, rate: float, rng: np.random.Generator) -> list[int]:
    """Each of ``num_clients`` independently with probability ``rate``."""
    return [int(c) for c in np.flatnonzero(rng.random(num_clients) < rate)]
