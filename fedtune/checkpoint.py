"""Checkpoints: a strategy's state (nested dicts of arrays and JSON values) as one ``.npz``,
written atomically (a temporary file renamed over the old one), and read back exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fedtune.errors import FedtuneError


class CheckpointError(FedtuneError):
    """A checkpoint that cannot be read (truncated, corrupted, not a fedtune checkpoint)."""


def save_state(path: Path, state: dict, private: bool = False) -> None:
    """A strategy state (nested dicts of arrays and JSON values) as one .npz, written atomically;
    ``private``: readable by its owner only from its first byte (it holds a secret)."""
    flat: dict[str, np.ndarray] = {}
    plain: dict = {}

    def walk(node, prefix, out_plain):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}/", out_plain.setdefault(key, {}))
            elif isinstance(value, np.ndarray):
                flat[f"{prefix}{key}"] = value
            else:
                out_plain[key] = value

    walk(state, "", plain)
    tmp = path.with_suffix(".tmp.npz")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666), "wb") as out:
        json_bytes = np.frombuffer(json.dumps(plain).encode(), dtype=np.uint8)
        np.savez(out, __json__=json_bytes, **flat)  # type: ignore[arg-type]  # the stub checks **arrays as allow_pickle
    tmp.replace(path)


def load_state(path: Path) -> dict:
    """Inverse of :func:`save_state`; a file that is not one (truncated, corrupted, another
    format) raises :class:`CheckpointError` naming it. Nothing is unpickled."""
    try:
        return _read_state(path)
    except Exception as exc:  # noqa: BLE001 - zipfile, numpy and json raise several kinds on a damaged file
        raise CheckpointError(f"checkpoint {str(path)!r}: unreadable ({type(exc).__name__}: {exc})") from None


def _read_state(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        state = json.loads(bytes(z["__json__"]).decode())
        for key in z.files:
            if key == "__json__":
                continue
            node = state
            *parents, leaf = key.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = z[key]
    return state
