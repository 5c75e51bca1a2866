"""Checkpoints: a strategy's state (nested dicts of arrays and JSON values) as one ``.npz``,
written atomically (a temporary file renamed over the old one), and read back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def save_state(path: Path, state: dict) -> None:
    """A strategy state (nested dicts of arrays and JSON values) as one .npz, written atomically."""
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
    np.savez(tmp, __json__=np.frombuffer(json.dumps(plain).encode(), dtype=np.uint8), **flat)
    tmp.replace(path)


def load_state(path: Path) -> dict:
    """Inverse of :func:`save_state`."""
    with np.load(path) as z:
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
