"""Fingerprints of what enters a DP run's releases, so that ``--resume`` never replays the run's
secret noise on other inputs.

A DP run's noise is a function of its secret and the round, so a resume stays bit-identical. Two
resumes of one checkpoint (a copy, a backup, a retry after a crash) that see different inputs (a
client's data file changed under the same path, another base under the same name) would release
two aggregates under the same noise, whose difference is noise-free: a difference attack. A DP run
therefore keeps, in its owner-only checkpoint, a keyed fingerprint (HMAC-SHA256 under a secret key
kept beside it) of every input of a release (:func:`input_digests`, :func:`keyed`):

* ``config``: the resolved config, less the keys a resume may change (``rounds``, the folder, threads);
* ``partition``: every client's example indices;
* ``clients``: each client's training examples (its partition of the pool), one row per client;
* ``test``: the server's test set (its evaluation is released);
* ``base``: the base weights the server's process loaded (frozen parameters and buffers) and the
  strategy's initial global arrays.

``--resume`` recomputes them under the stored key and refuses, in one line naming what changed,
before anything is written (:func:`changed_inputs`). Keyed, a fingerprint is no oracle about a
low-entropy data file even where it is copied (a plain hash of a guessable file confirms a
guess); the unkeyed digests live only in memory. What the server cannot see it cannot fingerprint:
the data a remote Flower node reads on its own machine (a loopback deployment's and a simulation's
clients read the server's files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

KEY = "key"  # the HMAC key, beside the fingerprints in the checkpoint
PARTS = ("config", "partition", "clients", "test", "base")
SIZE = 32  # bytes of a SHA-256 digest


def input_digests(context: Any, strategy: Any, config_keys: Mapping[str, Any]) -> dict[str, list[bytes]]:
    """SHA-256 digests of the run's inputs (module docstring): ``context`` a
    :class:`~fedtune.runtime.RunContext` whose task has read its data, ``strategy`` freshly
    initialized (its global arrays are the run's start), ``config_keys`` the resolved config's flat
    keys that may not change on resume. Each part is a list of digests (``clients``: one per client)."""
    memo: dict[int, tuple[Any, bytes]] = {}
    task, parts = context.task, context.partitions
    weights = [
        (name, t)
        for i, module in enumerate(context.loaded_bases())
        for name, t in [
            *((f"{i}/{n}", p) for n, p in module.named_parameters() if not p.requires_grad),
            *((f"{i}/{n}", b) for n, b in module.named_buffers()),
        ]
    ]
    return {
        "config": [digest(dict(config_keys), memo)],
        "partition": [digest(list(parts), memo)],
        "clients": [digest(task.train.subset(idx), memo) for idx in parts],
        "test": [digest(task.test, memo)],
        "base": [digest([weights, getattr(strategy, "global_arrays", None)], memo)],
    }


def fresh_key(reproducible_seed: int | None = None) -> np.ndarray:
    """A new HMAC key: 256 bits of OS entropy; with ``reproducible_seed`` (the test-only
    ``privacy.insecure_reproducible_noise``, whose noise derives from the seed too) derived from it,
    so that two engines' runs of one config keep equal checkpoints."""
    if reproducible_seed is not None:
        return np.frombuffer(hashlib.sha256(f"fedtune-inputs:{reproducible_seed}".encode()).digest(), np.uint8).copy()
    return np.frombuffer(secrets.token_bytes(SIZE), dtype=np.uint8).copy()


def keyed(digests: Mapping[str, list[bytes]], key: np.ndarray) -> dict[str, np.ndarray]:
    """The checkpoint's record: ``key`` and, per part, HMAC-SHA256(key, digest) as uint8 rows
    (``clients``: one row per client; every other part one row)."""
    raw = bytes(np.asarray(key, dtype=np.uint8))
    macs = {
        part: np.stack([np.frombuffer(hmac.new(raw, d, "sha256").digest(), np.uint8) for d in digests[part]])
        for part in PARTS
    }
    return {KEY: np.asarray(key, dtype=np.uint8).copy(), **macs}


def changed_inputs(recorded: Mapping[str, Any], digests: Mapping[str, list[bytes]]) -> list[str]:
    """What differs between the checkpoint's ``recorded`` fingerprints and today's ``digests``
    (keyed with the recorded key), named for a user: "the config", "the data of clients 0, 3", ...;
    ValueError on a record that is not :func:`keyed`'s."""
    key = recorded.get(KEY)
    if not isinstance(key, np.ndarray) or key.dtype != np.uint8 or key.shape != (SIZE,):
        raise ValueError(f"its {KEY} is not {SIZE} bytes")
    now = keyed(digests, key)
    changed = []
    for part in PARTS:
        have = recorded.get(part)
        if not isinstance(have, np.ndarray) or have.dtype != np.uint8 or have.ndim != 2 or have.shape[1] != SIZE:
            raise ValueError(f"its {part} is not rows of {SIZE} bytes")
        if part == "clients" and have.shape == now[part].shape:
            which = [str(c) for c in np.flatnonzero((have != now[part]).any(axis=1))]
            if which:
                shown = ", ".join(which[:5]) + (f" (and {len(which) - 5} more)" if len(which) > 5 else "")
                changed.append(f"the data of client{'s' if len(which) > 1 else ''} {shown}")
        elif not np.array_equal(have, now[part]):
            changed.append(
                {"clients": "the clients' data", "test": "the test set", "base": "the base model"}.get(
                    part, f"the {part}"
                )
            )
    return changed


def digest(obj: Any, memo: dict[int, tuple[Any, bytes]]) -> bytes:
    """SHA-256 of ``obj`` walked canonically: strings, bytes and numbers by value; arrays and tensors
    by dtype, shape and bytes; mappings by sorted key; sequences in order; dataclasses and other
    objects by class name and fields. An array, tensor or object met again (by identity: a subset
    sharing its source's media) is digested once per ``memo``."""
    h = hashlib.sha256()
    _feed(h, obj, memo)
    return h.digest()


def _feed(h: Any, obj: Any, memo: dict[int, tuple[Any, bytes]]) -> None:
    """Feed ``obj`` into the hash ``h`` (:func:`digest`)."""
    if isinstance(obj, (str, bytes)):
        data = obj.encode() if isinstance(obj, str) else obj
        h.update(b"s" if isinstance(obj, str) else b"b")
        h.update(len(data).to_bytes(8, "little") + data)
    elif obj is None or isinstance(obj, (bool, int, float)):
        h.update(f"p{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: repr(kv[0]))
        h.update(b"d" + len(items).to_bytes(8, "little"))
        for k, v in items:
            _feed(h, k, memo)
            _feed(h, v, memo)
    elif isinstance(obj, (list, tuple)):
        h.update(b"l" + len(obj).to_bytes(8, "little"))
        for v in obj:
            _feed(h, v, memo)
    else:
        h.update(b"m" + _node(obj, memo))


def _node(obj: Any, memo: dict[int, tuple[Any, bytes]]) -> bytes:
    """The digest of an array, tensor or object (memoized by identity; the object kept alive in
    ``memo`` so that its id is not reused)."""
    if id(obj) in memo:
        return memo[id(obj)][1]
    h = hashlib.sha256()
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"t{t.dtype}{tuple(t.shape)}".encode())
        if t.device.type != "meta":
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(obj, (np.ndarray, np.generic)):
        a = np.asarray(obj)
        h.update(f"a{a.dtype.str}{a.shape}".encode())
        if a.dtype.kind == "O":
            _feed(h, a.ravel().tolist(), memo)
        else:
            h.update(np.ascontiguousarray(a).data)
    elif dataclasses.is_dataclass(obj):
        h.update(type(obj).__qualname__.encode())
        _feed(h, {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, memo)
    elif hasattr(obj, "__dict__"):
        h.update(type(obj).__qualname__.encode())
        _feed(h, vars(obj), memo)
    else:
        raise TypeError(f"cannot fingerprint a {type(obj).__qualname__}")
    memo[id(obj)] = (obj, h.digest())
    return memo[id(obj)][1]
