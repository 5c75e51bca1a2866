"""Message: named arrays plus small JSON-able metadata, with one wire encoding.

Wire format (little-endian)::

    b"FTM1" | uint32 header_len | header (UTF-8 JSON) | array bytes, concatenated in header order

The header holds ``meta`` and, per array, its name, dtype and shape. The encoded length,
``len(message.encode())``, is the one number the engines account as bytes on the wire, so
what is reported is exactly what a transport would carry.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAGIC = b"FTM1"
_PREFIX = struct.Struct("<4sI")


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch here
        value = value.detach().cpu().numpy()
    array = np.asarray(value, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray would not)
    if array.dtype == object:
        raise TypeError("Message arrays must have a numeric dtype, got object")
    return array


@dataclass
class Message:
    """Named arrays plus JSON-able metadata: the only thing a server and a client exchange."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arrays = {str(k): _as_numpy(v) for k, v in self.arrays.items()}

    # -- encoding ---------------------------------------------------------------------------
    def _header(self) -> bytes:
        specs = [[name, a.dtype.str, list(a.shape)] for name, a in self.arrays.items()]
        return json.dumps({"meta": self.meta, "arrays": specs}, separators=(",", ":")).encode()

    def encode(self) -> bytes:
        """Serialize to bytes (the wire form)."""
        header = self._header()
        parts = [_PREFIX.pack(MAGIC, len(header)), header]
        parts.extend(a.tobytes() for a in self.arrays.values())
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Message:
        """Inverse of :meth:`encode`, from the bytes ``data``; arrays are fresh copies (nothing shared
        with the sender)."""
        view = memoryview(data)
        if len(view) < _PREFIX.size:
            raise ValueError("message too short to hold a header")
        magic, header_len = _PREFIX.unpack_from(view, 0)
        if magic != MAGIC:
            raise ValueError(f"not a fedtune message (magic {magic!r})")
        offset = _PREFIX.size
        header = json.loads(bytes(view[offset : offset + header_len]))
        offset += header_len
        arrays = {}
        for name, dtype, shape in header["arrays"]:
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            arrays[name] = np.frombuffer(view, dtype=dt, count=count, offset=offset).reshape(shape).copy()
            offset += count * dt.itemsize
        if offset != len(view):
            raise ValueError(f"message has {len(view) - offset} trailing bytes")
        return cls(arrays, header["meta"])

    # -- accounting -------------------------------------------------------------------------
    @property
    def payload_nbytes(self) -> int:
        """Bytes of array data alone."""
        return sum(a.nbytes for a in self.arrays.values())

    @property
    def header_nbytes(self) -> int:
        """Bytes of framing: magic, length prefix and JSON header."""
        return _PREFIX.size + len(self._header())

    @property
    def nbytes(self) -> int:
        """Encoded length in bytes; equals ``len(self.encode())`` without building the buffer."""
        return self.header_nbytes + self.payload_nbytes

    def __repr__(self) -> str:
        names = ", ".join(f"{k}{list(v.shape)}" for k, v in self.arrays.items())
        return f"Message(arrays=[{names}], meta={self.meta}, nbytes={self.nbytes})"
