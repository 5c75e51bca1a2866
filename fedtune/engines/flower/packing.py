"""A message's arrays as one Flower Array per dtype: the few objects Flower moves per message.

Flower 1.41 stores and moves every Array of a message as separate objects (the Array and its
chunks), each one HTTP request per hop: server -> SuperLink -> SuperNode -> ClientApp and back, six
hops. A LoRA adapter of a 6-layer encoder is some 30 arrays, of a 30-layer LLM hundreds, so a
message cost hundreds of requests. Here the arrays of each dtype travel flattened and concatenated
in the message's order in one Array (keyed by the dtype's name) and the layout (names, dtypes,
shapes) travels in the message's ConfigRecord, so a message is about six objects whatever its
arrays.

The record stays one ArrayRecord of numbers: Flower's ``fixedclipping_mod`` clips ``reply -
request`` over it as over the separate arrays (the L2 norm of the concatenation is the norm over
all of them), and ``reply`` and ``request`` carry the same keys when they carry the same arrays.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from math import prod

import numpy as np
from flwr.app import Array, ArrayRecord

KINDS = "biufc"  # dtype kinds a layout may name: booleans and numbers (never objects)


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[ArrayRecord, str]:
    """``arrays`` as (an ArrayRecord of one flat Array per dtype, their layout as JSON: ``[[name,
    dtype, shape], ...]`` in order)."""
    layout: list[list[object]] = []
    parts: dict[str, list[np.ndarray]] = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        layout.append([str(name), value.dtype.str, list(value.shape)])
        parts.setdefault(value.dtype.str, []).append(value.reshape(-1))
    record = ArrayRecord({dtype: Array(np.concatenate(chunks)) for dtype, chunks in parts.items()})
    return record, json.dumps(layout, separators=(",", ":"))


def unpack_arrays(record: ArrayRecord, layout: str) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack_arrays`; ``record`` and ``layout`` are checked first (a peer's): a
    ValueError names what does not match."""
    entries = json.loads(layout)
    if not isinstance(entries, list) or not all(_entry(e) for e in entries):
        raise ValueError("array layout: expected a list of [name, dtype, shape]")
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError("array layout: a name appears twice")
    sizes: dict[str, int] = {}
    for _, dtype, shape in entries:
        try:
            kind = np.dtype(dtype).kind
        except TypeError:
            kind = "?"
        if kind not in KINDS:
            raise ValueError(f"array layout: dtype {dtype!r} is not a number type")
        sizes[dtype] = sizes.get(dtype, 0) + prod(shape)
    if set(record) != set(sizes):
        raise ValueError(f"arrays: the record holds dtypes {sorted(record)}, the layout names {sorted(sizes)}")
    flat = {}
    for dtype, size in sizes.items():
        value = record[dtype].numpy()
        if value.dtype.str != dtype or value.shape != (size,):
            raise ValueError(f"arrays: {dtype} holds {value.dtype.str} of shape {value.shape}, the layout ({size},)")
        flat[dtype] = value
    out, offsets = {}, dict.fromkeys(sizes, 0)
    for name, dtype, shape in entries:
        start, size = offsets[dtype], prod(shape)
        out[name] = flat[dtype][start : start + size].reshape(shape)
        offsets[dtype] = start + size
    return out


def _entry(entry: object) -> bool:
    """Whether ``entry`` is a layout entry: [str, str, list of non-negative ints]."""
    return (
        isinstance(entry, list)
        and len(entry) == 3
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
        and isinstance(entry[2], list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2])
    )
