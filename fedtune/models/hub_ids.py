"""Base models by the name a user elsewhere can load: fedtune's model names <-> hub ids.

A saved adapter records its base by the name another machine resolves (PEFT's
``base_model_name_or_path``, the model card's ``base_model``): a model fedtune ships in a package
by its Hugging Face hub id (:data:`HUB_IDS`; add a row for each packaged model), a hub name as
the user gave it, a local folder by its absolute path. Models built in code from the seed
(``tiny-llama``, ``tiny-bert``) exist on no hub and keep their fedtune name (``fedtune export``
writes such a base into the exported folder). :func:`fedtune_name` maps a hub id back to the
packaged copy on this machine (fedtune's loaders read it from the package, offline).
"""

from __future__ import annotations

from pathlib import Path

#: fedtune model name -> the hub id of the model its package holds
HUB_IDS: dict[str, str] = {
    "smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma3-270m": "google/gemma-3-270m",
    "minilm": "sentence-transformers/all-MiniLM-L6-v2",
}
#: models built in code from the seed (tests): no hub id, no files
BUILT_IN_CODE = frozenset({"tiny-llama", "tiny-bert"})


def hub_id(name: str) -> str:
    """The name that ``model.name`` = ``name`` is recorded by: its hub id when fedtune packages
    it, the absolute path of an existing local folder or file, else ``name`` as given."""
    if name in HUB_IDS:
        return HUB_IDS[name]
    path = Path(name).expanduser()
    if name not in BUILT_IN_CODE and path.exists():
        return str(path.resolve())
    return name


def fedtune_name(name: str) -> str:
    """The ``model.name`` fedtune loads ``name`` (a hub id or a fedtune name) by: the packaged
    model for a hub id of :data:`HUB_IDS`, else ``name`` itself."""
    return next((short for short, hub in HUB_IDS.items() if hub == name), name)


def is_portable(recorded: str) -> bool:
    """Whether another machine can resolve a recorded base name (a hub id, not a model built in
    code or a path on this machine)."""
    return recorded not in BUILT_IN_CODE and not Path(recorded).is_absolute()
