"""Top-k sparsification of uploads (Kuo et al. 2024), as an encoding of named arrays.

Each array ``x`` of ``size`` entries keeps its k = ceil(ratio * size) entries of largest
magnitude (at least 1) and becomes three: ``<name>.topk_idx`` (flat indices, ascending; int32,
or int64 for arrays of 2**31 entries or more), ``<name>.topk_val`` (float32 values at them) and
``<name>.topk_shape`` (int64 shape). The bytes accounted are the bytes actually encoded::

    k * (4 + 4) + 8 * ndim per array, plus the Message header (names, dtypes, shapes, meta)

so top-k only saves bytes for ratio < 0.5 (at 0.5 it costs 8 * ndim more than dense float32).

Top-k applies to whatever update dict a client uploads through ``LoraClient.upload`` (FedIT's
dense deltas, FSLoRA's sliced deltas Delta B[:, I], Delta A[I, :] and the head delta); arrays
added to the Message outside the codec (FSLoRA's sketch index I) are never compressed, and
:func:`topk_decode` passes any array that is not part of a top-k triple through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

IDX, VAL, SHAPE = ".topk_idx", ".topk_val", ".topk_shape"
_INT32_MAX = np.iinfo(np.int32).max


def topk_count(size: int, ratio: float) -> int:
    """k = ceil(ratio * size), at least 1 (0 for an empty array)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"top-k ratio must be in (0, 1], got {ratio}")
    if size == 0:
        return 0
    # round() first: ceil(0.1 * 30) must be 3, not 4 (0.1 * 30 = 3.0000000000000004)
    return max(1, min(size, math.ceil(round(ratio * size, 9))))


def topk_select(flat: np.ndarray, k: int) -> np.ndarray:
    """Ascending flat indices of the ``k`` entries of ``flat`` with the largest magnitude
    (ties broken arbitrarily, as any top-k does)."""
    if k >= flat.size:
        return np.arange(flat.size)
    if k == 0:
        return np.arange(0)
    return np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k :])


def topk_encode(arrays: Mapping[str, np.ndarray], ratio: float) -> dict[str, np.ndarray]:
    """Keep, per array, the ``topk_count(size, ratio)`` entries of largest magnitude."""
    out: dict[str, np.ndarray] = {}
    for name, x in arrays.items():
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"top-k: {name!r} has dtype {x.dtype}; only float updates are compressed")
        flat = np.ascontiguousarray(x, dtype=np.float32).ravel()
        idx = topk_select(flat, topk_count(flat.size, ratio))
        out[name + IDX] = idx.astype(np.int32 if flat.size <= _INT32_MAX else np.int64)
        out[name + VAL] = flat[idx]
        out[name + SHAPE] = np.asarray(x.shape, dtype=np.int64)
    return out


def is_topk_encoded(arrays: Mapping[str, np.ndarray]) -> bool:
    return any(k.endswith(IDX) for k in arrays)


def topk_decode(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Dense float32 arrays, zeros outside the kept indices; arrays that are not part of a
    top-k triple pass through. Malformed triples (from an untrusted sender) raise ValueError."""
    out: dict[str, np.ndarray] = {}
    used: set[str] = set()
    for key in arrays:
        if not key.endswith(IDX):
            continue
        name = key[: -len(IDX)]
        if name + VAL not in arrays or name + SHAPE not in arrays:
            raise ValueError(f"top-k: {name!r} lacks its {VAL} or {SHAPE} array")
        idx, val = np.asarray(arrays[key]), np.asarray(arrays[name + VAL])
        shape = tuple(int(s) for s in np.asarray(arrays[name + SHAPE]).ravel())
        size = int(np.prod(shape, dtype=np.int64))
        if idx.ndim != 1 or val.shape != idx.shape or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"top-k: {name!r} needs 1-D integer indices and as many values")
        if idx.size and (idx.min() < 0 or idx.max() >= size):
            raise ValueError(f"top-k: {name!r} has indices outside its {size} entries")
        dense = np.zeros(size, dtype=np.float32)
        dense[idx] = val
        out[name] = dense.reshape(shape)
        used.update((key, name + VAL, name + SHAPE))
    for key, value in arrays.items():
        if key not in used:
            out[key] = value
    return out
