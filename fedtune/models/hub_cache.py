"""Make a packaged model's hub id resolve offline, here, for plain transformers / PEFT code.

transformers and huggingface_hub have no table of local names for hub ids; offline
(``HF_HUB_OFFLINE=1``), ``from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` reads the hub
cache (``$HF_HUB_CACHE``, by default ``$HF_HOME/hub``): ``models--<org>--<name>/refs/main`` names a
snapshot, ``snapshots/<revision>/`` holds its files. :func:`link_packaged` writes such an entry
for a model fedtune packages, from the packaged copy: MiniLM's package holds a Hugging Face
folder, linked file by file (no copy); SmolLM2's and Gemma-3-270M's hold a GGUF file, which
transformers reads only when told its name, so their snapshot holds the model as fedtune loads it
(de-quantized to float32, ``model.safetensors``: about 540 MB for SmolLM2, 1.1 GB for Gemma) and
its tokenizer. Then
``AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` works as on a machine with a network,
on the same weights the run trained on (the hub's own files are SmolLM2's bfloat16 originals,
which the Q4_1 GGUF approximates: elsewhere the base differs from the run's by that much).

An entry that fedtune did not write (a real download) is never touched: it is the better copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from fedtune.config import ConfigError
from fedtune.models.hub_ids import HUB_IDS, fedtune_name

MARKER = ".fedtune-packaged"  # in a snapshot fedtune wrote: what it was made from


def cache_dir() -> Path:
    """The hub cache that transformers reads (``HF_HUB_CACHE``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def revision_of(hub: str) -> str:
    """The snapshot name of the entry for ``hub`` (40 hex digits, as a commit's)."""
    return hashlib.sha1(f"fedtune-packaged {hub}".encode()).hexdigest()


def _write_minilm(snapshot: Path) -> str:
    from fedtune.models.loading import resolve_model_path

    source = Path(resolve_model_path("minilm"))
    for path in source.rglob("*"):
        if path.is_file():
            target = snapshot / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path, target)
    return f"links to {source}"


def _write_gguf_lm(name: str, snapshot: Path) -> str:
    """The packaged GGUF language model ``name`` (SmolLM2, Gemma-3-270M) as fedtune loads it."""
    import torch

    from fedtune.models import prefix_lm as plm

    plm.saveable(plm.build_language_model(name, 0, torch.float32)).save_pretrained(snapshot)
    plm.load_lm_tokenizer(name).save_pretrained(snapshot)
    source = plm.gguf_source(name)
    if source is None:
        raise ValueError(f"{name!r} is not a packaged GGUF model")
    return f"{source['gguf_file']} of {source['pretrained_model_name_or_path']}, de-quantized to float32"


WRITERS: dict[str, Callable[[Path], str]] = {
    "minilm": _write_minilm,
    "smollm2": partial(_write_gguf_lm, "smollm2"),
    "gemma3-270m": partial(_write_gguf_lm, "gemma3-270m"),
}


def link_packaged(hub: str, root: Path | None = None) -> Path | None:
    """Make hub id ``hub`` resolve offline to fedtune's packaged copy (see the module
    docstring); the snapshot folder, or None when ``hub`` is no packaged model's id or the cache
    already holds another entry for it (a real download: left as it is)."""
    name = fedtune_name(hub)
    if HUB_IDS.get(name) != hub or name not in WRITERS:
        return None
    repo = (root or cache_dir()) / f"models--{hub.replace('/', '--')}"
    revision = revision_of(hub)
    snapshot = repo / "snapshots" / revision
    ref = repo / "refs" / "main"
    if ref.is_file() and ref.read_text().strip() != revision:
        return None  # not ours
    if (snapshot / MARKER).is_file():
        return snapshot
    (repo / "snapshots").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=repo / "snapshots", prefix=".tmp-"))
    try:
        source = WRITERS[name](tmp)
        (tmp / MARKER).write_text(f"written by fedtune from the packaged model {name!r}: {source}\n")
        if snapshot.exists():
            shutil.rmtree(snapshot)
        tmp.rename(snapshot)
    except OSError as exc:
        raise ConfigError(f"hub cache {str(repo)!r}: cannot write the entry for {hub} ({exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(revision)
    return snapshot
