"""The upload codec: top-k sparsification (Kuo et al. 2024) and the wire dtype, as encodings of named arrays.

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

The wire dtype (:func:`wire_encode`, ``federation.wire_dtype``) then sends every float array,
top-k values included, in bfloat16 or float16; :func:`wire_decode` restores float32 first, so the
server aggregates in float32.
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
    """Keep, per array of ``arrays``, the ``topk_count(size, ratio)`` entries of largest magnitude."""
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
    """Whether ``arrays`` hold a top-k triple."""
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


# -- the wire dtype (federation.wire_dtype) --------------------------------------------------------
#: suffix of an array sent in a narrower float dtype -> that dtype's numpy storage
WIRE_SUFFIXES = {"bfloat16": (".bf16", np.dtype(np.uint16)), "float16": (".f16", np.dtype(np.float16))}


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` -> the bits of the nearest bfloat16 (round to nearest, ties to even; NaN stays NaN),
    as uint16: numpy has no bfloat16 dtype, so its 16 bits cross as they are."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out: np.ndarray = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = (bits[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)  # quiet NaN
    return out


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    out: np.ndarray = (np.asarray(bits, dtype=np.uint32) << np.uint32(16)).view(np.float32)
    return out


def wire_encode(arrays: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """Every floating-point array in ``dtype`` (``federation.wire_dtype``): ``float32`` leaves
    them as they are; ``float16`` sends ``<name>.f16`` (numpy float16), ``bfloat16`` sends
    ``<name>.bf16`` (its bits as uint16). Other arrays (indices, shapes) pass through. The bytes
    accounted are the encoded ones: 2 per entry instead of 4."""
    if dtype == "float32":
        return dict(arrays)
    suffix, _ = WIRE_SUFFIXES[dtype]
    out: dict[str, np.ndarray] = {}
    for name, x in arrays.items():
        x = np.asarray(x)
        if x.dtype.kind != "f":
            out[name] = x
        elif dtype == "bfloat16":
            out[name + suffix] = bfloat16_bits(x)
        else:
            out[name + suffix] = x.astype(np.float16)
    return out


def wire_decode(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`wire_encode`: ``<name>.f16`` / ``<name>.bf16`` back to float32 ``<name>``.
    Never raises on an untrusted sender's arrays: one of the wrong storage dtype, or whose plain
    name is also present, keeps its encoded name (and a reply check then rejects it)."""
    out: dict[str, np.ndarray] = {}
    for key, value in arrays.items():
        value = np.asarray(value)
        for _dtype, (suffix, storage) in WIRE_SUFFIXES.items():
            name = key[: -len(suffix)]
            if key.endswith(suffix) and value.dtype == storage and name not in arrays:
                out[name] = from_bfloat16_bits(value) if suffix == ".bf16" else value.astype(np.float32)
                break
        else:
            out[key] = value
    return out


def encoded_base_name(key: str) -> str:
    """The array name an encoded key stands for (``x.topk_val.bf16`` -> ``x``)."""
    for suffix, _ in WIRE_SUFFIXES.values():
        key = key.removesuffix(suffix)
    for suffix in (IDX, VAL, SHAPE):
        key = key.removesuffix(suffix)
    return key
