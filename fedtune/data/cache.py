"""On-disk cache of prepared arrays (tokenized text) and converted tokenizers, shared by every
process of a machine.

A Flower deployment starts a fresh ``flwr-clientapp`` process for every message, so whatever a
process prepares once (tokenizing a training pool: seconds for SST-2) would be redone per
message. :func:`cached_arrays` keeps such arrays on disk as ``.npy`` files and maps them back
read-only (``mmap_mode="r"``), so a later process pays a few milliseconds instead.

Layout: ``<root>/<kind>/<key>/`` holding ``key.json`` (the parts the key was computed from,
for a human), ``meta.json`` (small scalars beside the arrays) and one ``<name>.npy`` per array.
The key is the SHA-256 of the JSON of those parts, so any change in a part (the data, the
tokenizer, the length) is a different entry; nothing is ever invalidated in place. An entry is
written into a private temporary folder and renamed into place, so a reader never sees half
of one and two processes building the same entry at once are harmless (the first rename wins).

:func:`cached_tokenizer` keeps a tokenizer converted from a GGUF file (slow: seconds to minutes)
as its ``save_pretrained`` folder under ``<root>/tokenizers/<key>/``, written the same way.

The root is ``$FEDTUNE_CACHE_DIR`` (default ``~/.cache/fedtune``); ``FEDTUNE_CACHE_DIR=off``
turns caching off (every call builds). Delete the folder to reclaim the space.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CACHE_ENV = "FEDTUNE_CACHE_DIR"


def cache_root() -> Path | None:
    """The cache folder, or None when caching is off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None and value.strip().lower() in ("off", "0", "none", ""):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "fedtune"


def cache_key(parts: dict[str, Any]) -> str:
    """The entry name of ``parts`` (JSON-able): a hex SHA-256 prefix."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def digest_texts(texts: list[str], labels: np.ndarray | None = None) -> str:
    """A content digest of a list of strings (and their labels): part of a cache key."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    if labels is not None:
        arr = np.ascontiguousarray(labels)
        h.update(arr.dtype.str.encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def cached_arrays(
    kind: str, parts: dict[str, Any], build: Callable[[], tuple[dict[str, np.ndarray], dict[str, Any]]]
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, meta)`` of the entry ``kind``/``parts``: mapped read-only from disk when present,
    else ``build()`` and stored (arrays returned as built). A cache that cannot be written (a
    read-only disk) only costs the rebuild."""
    root = cache_root()
    if root is None:
        return build()
    folder = root / kind / cache_key(parts)
    if (folder / "meta.json").is_file():
        try:
            meta = json.loads((folder / "meta.json").read_text())
            arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r").view(np.ndarray) for name in meta["arrays"]}
            return arrays, meta["meta"]
        except (OSError, ValueError, KeyError):
            pass  # a damaged entry: rebuild (and replace it below)
    arrays, meta = build()

    def fill(tmp: Path) -> None:
        for name, value in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(value))
        (tmp / "meta.json").write_text(json.dumps({"arrays": list(arrays), "meta": meta}))

    _store(folder, parts, fill)
    return arrays, meta


def _store(folder: Path, parts: dict[str, Any], fill: Callable[[Path], Any]) -> None:
    """Write the entry ``folder``: ``fill`` a private temporary folder, add ``key.json``, rename it
    into place (replacing a damaged entry; a process that loses the race drops its copy). A
    cache that cannot be written (a read-only disk) is left as it is."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            fill(tmp)
            (tmp / "key.json").write_text(json.dumps(parts, sort_keys=True, indent=1, default=str))
            if folder.exists():  # damaged: replace
                shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; else a failed or lost write
    except OSError:
        pass


def cached_tokenizer(parts: dict[str, Any], load: Callable[[], Any]):
    """The tokenizer that ``load()`` gives, kept under ``<root>/tokenizers/<key of parts>`` (its
    ``save_pretrained`` folder) and read back from there by later calls: converting a GGUF
    file's tokenizer takes 25 s (SmolLM2) to 1-2 min (Gemma's 262k-token vocabulary) on one core,
    reading the saved one about a second. ``parts`` must identify the source (its file's path,
    size and modification time, the transformers version)."""
    from transformers import AutoTokenizer

    root = cache_root()
    if root is None:
        return load()
    folder = root / "tokenizers" / cache_key(parts)
    if (folder / "key.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError):
            pass  # a damaged entry: rebuild (and replace it below)
    tokenizer = load()
    _store(folder, parts, tokenizer.save_pretrained)
    return tokenizer
