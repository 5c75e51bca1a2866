"""Reply validation: is a client's reply what the method expects from that client this round?

A Strategy describes the arrays it expects back from a client (:meth:`Strategy.reply_spec`):
name -> :class:`ArraySpec` (shape and dtype). :func:`check_arrays` compares a reply with it:
the same names (an array the method lets the upload codec compress may instead arrive as its
top-k triple ``name.topk_idx / .topk_val / .topk_shape``, checked entry by entry, and any float
array in the wire dtype, ``name.bf16`` / ``name.f16``), the same
shapes and dtypes, and finite values everywhere. It returns the reason a reply is rejected,
or None; it never raises, whatever the reply holds.

A reply's metadata is untrusted too (a client's ``num_examples`` weighs its update in every
weighted sum): :meth:`Strategy.reply_meta_spec` declares the keys a method reads, each a
:class:`MetaField` (type and range), :data:`COMMON_META` the ones every method shares, and
:func:`check_meta` checks a reply's metadata against it. Keys nobody declared may hold any
JSON scalar or list, but a number among them must be finite.

A valid reply may still be outsized: :func:`outsized_updates` finds the training replies whose
L2 norm exceeds ``robust.max_update_ratio`` times a reference (the larger of the other
replies' lower median norm and the norm of what the client was sent), a default defence against
one client's huge but finite update (1e30) that honest rounds never reach.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import TypeGuard

import numpy as np

from fedtune.protocol.compression import IDX, SHAPE, VAL, wire_decode
from fedtune.protocol.messages import Message


@dataclass(frozen=True)
class ArraySpec:
    """What one array of a reply must be: its shape and dtype (numpy name)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    compressible: bool = True  # may arrive top-k encoded (float updates through the upload codec)

    @classmethod
    def like(cls, array: np.ndarray, compressible: bool = True) -> ArraySpec:
        """The spec of ``array``'s shape and dtype; ``compressible`` if asked and it is a float array."""
        array = np.asarray(array)
        return cls(tuple(int(s) for s in array.shape), array.dtype.name, compressible and array.dtype.kind == "f")


def spec_like(arrays: Mapping[str, np.ndarray]) -> dict[str, ArraySpec]:
    """The spec of a reply with the same names, shapes and dtypes as ``arrays``."""
    return {name: ArraySpec.like(a) for name, a in arrays.items()}


def _check_topk(name: str, arrays: Mapping[str, np.ndarray], spec: ArraySpec) -> str | None:
    idx, val, shape = (np.asarray(arrays.get(name + s)) if name + s in arrays else None for s in (IDX, VAL, SHAPE))
    if idx is None or val is None or shape is None:
        return f"array {name!r}: incomplete top-k triple"
    if shape.ndim != 1 or shape.dtype.kind not in "iu" or tuple(int(s) for s in shape) != spec.shape:
        return f"array {name!r}: top-k shape {shape.tolist()} where {list(spec.shape)} was expected"
    size = int(np.prod(spec.shape, dtype=np.int64))
    if idx.ndim != 1 or idx.dtype.kind not in "iu" or val.shape != idx.shape or val.dtype.kind != "f":
        return f"array {name!r}: top-k needs 1-D integer indices and as many float values"
    if idx.size > size or (idx.size and (idx.min() < 0 or idx.max() >= size)) or len(np.unique(idx)) != idx.size:
        return f"array {name!r}: top-k indices outside its {size} entries or repeated"
    if not np.isfinite(val).all():
        return f"array {name!r}: non-finite values"
    return None


def check_arrays(arrays: Mapping[str, np.ndarray], spec: Mapping[str, ArraySpec] | None) -> str | None:
    """Why ``arrays`` (a reply's) do not match ``spec``, or None when they do. ``spec`` None:
    only the values are checked (finite floats). Arrays sent in a narrower wire dtype
    (:func:`~fedtune.protocol.compression.wire_encode`) are checked as the float32 they decode to."""
    arrays = wire_decode(arrays)
    if spec is None:
        for name, a in arrays.items():
            if np.asarray(a).dtype.kind == "f" and not np.isfinite(a).all():
                return f"array {name!r}: non-finite values"
        return None
    seen: set[str] = set()
    for name, want in spec.items():
        if name in arrays:
            a = np.asarray(arrays[name])
            if tuple(a.shape) != want.shape:
                return f"array {name!r}: shape {list(a.shape)} where {list(want.shape)} was expected"
            if a.dtype.name != want.dtype:
                return f"array {name!r}: dtype {a.dtype} where {want.dtype} was expected"
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                return f"array {name!r}: non-finite values"
            seen.add(name)
        elif want.compressible and name + IDX in arrays:
            reason = _check_topk(name, arrays, want)
            if reason:
                return reason
            seen.update(name + s for s in (IDX, VAL, SHAPE))
        else:
            return f"array {name!r} missing"
    extra = sorted(set(arrays) - seen)
    if extra:
        return f"unexpected arrays {extra[:3]}"
    return None


@dataclass(frozen=True)
class MetaField:
    """What one metadata value of a reply must be: ``kind`` int, float (an int is accepted), str,
    bool, dict or list; numbers finite (inside a dict or list too, unless ``finite`` is False) and
    within [low, high] (None: unbounded); ``required``: present."""

    kind: type
    low: float | None = None
    high: float | None = None
    required: bool = False
    finite: bool = True  # a mapping or list whose numbers may be inf / NaN by design says False

    def with_high(self, high: float | None) -> MetaField:
        """This field with the upper bound ``high`` (None: unbounded)."""
        return MetaField(self.kind, self.low, high, self.required, self.finite)


#: The metadata every method's replies share (by convention): the client's data size (the FedAvg
#: weight; its upper bound is what the server knows of that client), local steps, and metrics.
COMMON_META: dict[str, MetaField] = {
    "num_examples": MetaField(int, low=1),
    "steps": MetaField(int, low=0),
    "train_loss": MetaField(float),
    "loss": MetaField(float),
    "accuracy": MetaField(float, low=0.0, high=1.0),
    "peak_bytes": MetaField(int, low=0),  # the client's measured peak memory (a budgeted client)
}


def _is_number(value: object) -> TypeGuard[Real]:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_value(key: str, value: object, want: MetaField) -> str | None:
    if want.kind is int:
        if not isinstance(value, Integral) or isinstance(value, bool):
            return f"metadata {key!r}: {type(value).__name__} {value!r:.40} where an integer was expected"
    elif want.kind is float:
        if not _is_number(value):
            return f"metadata {key!r}: {type(value).__name__} {value!r:.40} where a number was expected"
    elif not isinstance(value, want.kind):
        return f"metadata {key!r}: {type(value).__name__} where {want.kind.__name__} was expected"
    if not _is_number(value):
        return None if not want.finite or _finite_everywhere(value) else f"metadata {key!r}: non-finite value"
    if _is_number(value):
        if not math.isfinite(float(value)):
            return f"metadata {key!r}: non-finite value {value!r}"
        if want.low is not None and value < want.low:
            return f"metadata {key!r}: {value!r} below its minimum {want.low:g}"
        if want.high is not None and not value <= want.high:  # value is finite: ">" (numbers.Real types only < and <=)
            return f"metadata {key!r}: {value!r} above its maximum {want.high:g}"
    return None


def _finite_everywhere(value: object) -> bool:
    if _is_number(value):
        return math.isfinite(float(value))
    if isinstance(value, (list, tuple)):
        return all(_finite_everywhere(v) for v in value)
    if isinstance(value, Mapping):
        return all(_finite_everywhere(v) for v in value.values())
    return True


def check_meta(meta: object, spec: Mapping[str, MetaField]) -> str | None:
    """Why a reply's metadata ``meta`` does not match ``spec``, or None. Never raises."""
    if not isinstance(meta, Mapping):
        return f"metadata is a {type(meta).__name__}, not a mapping"
    for key, want in spec.items():
        if key in meta:
            reason = _check_value(key, meta[key], want)
            if reason:
                return reason
        elif want.required:
            return f"metadata {key!r} missing"
    for key, value in meta.items():
        if not isinstance(key, str):
            return f"metadata key {key!r:.40} is not a string"
        if key not in spec and not _finite_everywhere(value):
            return f"metadata {key!r}: non-finite value"
    return None


def _norm(arrays: Mapping[str, np.ndarray]) -> float:
    """The L2 norm over every float array of ``arrays`` (wire-encoded ones decoded), in float64."""
    return _norm_and_size(arrays)[0]


def _norm_and_size(arrays: Mapping[str, np.ndarray]) -> tuple[float, int]:
    """(the L2 norm in float64, the number of values) over every float array of ``arrays``
    (wire-encoded ones decoded; a top-k array counts its dense size, its ``.topk_shape``, which
    :func:`check_arrays` holds to the expected shape)."""
    total, size = 0.0, 0
    decoded = wire_decode(arrays)
    for name, a in decoded.items():
        a = np.asarray(a)
        if a.dtype.kind == "f":
            total += float(np.sum(np.square(a, dtype=np.float64)))
            shape = decoded.get(name.removesuffix(VAL) + SHAPE) if name.endswith(VAL) else None
            size += a.size if shape is None else int(np.prod(shape, dtype=np.int64))
    return math.sqrt(total), size


def beyond_bound(replies: Mapping[int, Message], bound: Callable[[int], float]) -> dict[int, str]:
    """Client id -> reason for each training reply of ``replies`` whose L2 norm exceeds ``bound(d)``,
    d the number of float values it holds (its arrays already checked against what the server
    expects): the local-DP screen of uploads beyond what a clipped and noised one can be."""
    out = {}
    for cid, reply in replies.items():
        norm, size = _norm_and_size(reply.arrays)
        limit = bound(size)
        if norm > limit:
            out[cid] = (
                f"update norm {norm:.3g} exceeds {limit:.4g}, the most a clipped and noised upload of {size} values "
                "reaches (local DP)"
            )
    return out


def outsized_updates(replies: Mapping[int, Message], sent: Mapping[int, Message], ratio: float) -> dict[int, str]:
    """Client id -> reason for each training reply (a Message) whose norm exceeds ``ratio`` times
    its reference: the larger of the lower median of the *other* replies' norms (0 for a lone
    reply; a huge reply cannot raise its own reference, nor, among two, the other's) and the norm
    of the message ``sent`` to that client (the global state it trained from). A zero reference
    rejects nothing."""
    norms = {cid: _norm(reply.arrays) for cid, reply in replies.items()}
    out = {}
    for cid, norm in norms.items():
        others = sorted(v for c, v in norms.items() if c != cid)
        median = others[(len(others) - 1) // 2] if others else 0.0
        reference = max(median, _norm(sent[cid].arrays))
        if reference > 0 and norm > ratio * reference:
            out[cid] = (
                f"update norm {norm:.3g} exceeds robust.max_update_ratio = {ratio:g} times its "
                f"reference {reference:.3g}"
            )
    return out
