"""Top-k sparsification of uploads (Kuo et al. 2024), as an encoding of named arrays.

Each array ``x`` becomes three: ``<name>.topk_idx`` (int32 flat indices, ascending),
``<name>.topk_val`` (float32 values at them) and ``<name>.topk_shape`` (int64 shape), so the
bytes accounted are the bytes actually encoded: k * (4 + 4) + 8 * ndim per array, plus header.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

IDX, VAL, SHAPE = ".topk_idx", ".topk_val", ".topk_shape"


def topk_count(size: int, ratio: float) -> int:
    """k = ceil(ratio * size), at least 1."""
    return max(1, min(size, math.ceil(ratio * size)))


def topk_encode(arrays: Mapping[str, np.ndarray], ratio: float) -> dict[str, np.ndarray]:
    """Keep, per array, the ``topk_count`` entries of largest magnitude."""
    out: dict[str, np.ndarray] = {}
    for name, x in arrays.items():
        flat = np.ascontiguousarray(x, dtype=np.float32).ravel()
        k = topk_count(flat.size, ratio)
        idx = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k :]).astype(np.int32)
        out[name + IDX] = idx
        out[name + VAL] = flat[idx]
        out[name + SHAPE] = np.asarray(x.shape, dtype=np.int64)
    return out


def is_topk_encoded(arrays: Mapping[str, np.ndarray]) -> bool:
    return any(k.endswith(IDX) for k in arrays)


def topk_decode(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Dense arrays, zeros outside the kept indices."""
    out = {}
    for key in arrays:
        if key.endswith(IDX):
            name = key[: -len(IDX)]
            shape = tuple(int(s) for s in arrays[name + SHAPE])
            dense = np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
            dense[arrays[key]] = arrays[name + VAL]
            out[name] = dense.reshape(shape)
    return out
