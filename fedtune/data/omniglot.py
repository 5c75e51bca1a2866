"""Omniglot (Lake et al. 2015) from ``<data_dir>/omniglot/``: the background images and the 20
official one-shot runs, decoded once per process.

- ``images_background_small1.zip`` and ``images_background_small2.zip``: the two "small" background
  sets of Lake et al. Greek and Latin are in both archives with identical files; characters are
  deduplicated by ``alphabet/character`` (the first archive's copy is kept), which leaves
  8 alphabets, 242 characters and 20 drawings (one per drawer) of each: 4,840 images.
- ``all_runs.zip``: the 20 official 20-way 1-shot classification runs (``runNN/training/classKK.png``
  the 20 support images, ``runNN/test/itemKK.png`` the 20 queries, ``class_labels.txt`` which
  support image each query belongs to). Their characters come from the evaluation alphabets, so
  they share no character with the background set.

Every 105x105 binary PNG is converted to grey, resized to ``size x size`` with PIL's Lanczos filter
(28x28 is the usual few-shot size, as in the MAML and ProtoNet code) and stored as ink, uint8 with
255 = stroke, 0 = paper (:func:`as_tensor` scales it to [0, 1]). Decoding all 5,640 images takes
about a second, so the cache is per process (keyed by directory and size) and nothing is written
to disk. Data only: no model code.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from fedtune.config import ConfigError

BACKGROUND_ZIPS = ("images_background_small1.zip", "images_background_small2.zip")
RUNS_ZIP = "all_runs.zip"
DRAWINGS = 20  # drawings (drawers) per character
RUN_WAYS = 20  # the official runs are 20-way 1-shot, 20 queries each


@dataclass(frozen=True)
class OmniglotImages:
    """Decoded characters: image m is drawing ``drawings[m]`` of character ``labels[m]``."""

    images: np.ndarray  # (M, S, S) uint8 ink
    labels: np.ndarray  # (M,) int64 character id, in (alphabet, character) order
    drawings: np.ndarray  # (M,) int64 drawer index 0..19 (from the file name NNNN_DD.png)
    characters: tuple[str, ...]  # character id -> "Alphabet/characterNN"
    alphabets: tuple[str, ...]  # character id -> its alphabet

    @property
    def alphabet_names(self) -> list[str]:
        return sorted(set(self.alphabets))


@dataclass(frozen=True)
class OneShotRun:
    """One official 20-way 1-shot run: query j shows the character of ``support[labels[j]]``."""

    support: np.ndarray  # (20, S, S) uint8 ink, training/class01..class20
    query: np.ndarray  # (20, S, S) uint8 ink, test/item01..item20
    labels: np.ndarray  # (20,) int64 in 0..19


def as_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 ink ``(..., S, S)`` -> float32 ``(..., 1, S, S)`` in [0, 1] (strokes 1)."""
    return torch.from_numpy(images).unsqueeze(-3).float().div_(255.0)


def _decode(data: bytes, size: int) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        grey = im.convert("L").resize((size, size), Image.Resampling.LANCZOS)
        return 255 - np.asarray(grey, dtype=np.uint8)


def _require(root: Path, names: tuple[str, ...]) -> list[Path]:
    paths = [root / "omniglot" / n for n in names]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(
            f"data.data_dir: Omniglot file(s) {', '.join(missing)} not found in {root / 'omniglot'} "
            "(set data.data_dir or FEDTUNE_DATA_DIR to the folder that holds omniglot/)"
        )
    return paths


@lru_cache(maxsize=4)
def load_background(root: Path, size: int = 28) -> OmniglotImages:
    """The deduplicated background characters of ``root/omniglot`` at ``size x size`` (cached)."""
    files: dict[tuple[str, str], dict[int, bytes]] = {}
    for path in _require(Path(root), BACKGROUND_ZIPS):
        with zipfile.ZipFile(path) as zf:
            seen_here: set[tuple[str, str]] = set()
            for name in sorted(zf.namelist()):
                parts = name.split("/")  # images_background_smallN/Alphabet/characterNN/NNNN_DD.png
                if len(parts) != 4 or not parts[3].endswith(".png"):
                    continue
                key = (parts[1], parts[2])
                if key in files and key not in seen_here:  # the same character in an earlier archive
                    continue
                seen_here.add(key)
                drawing = int(parts[3].rsplit("_", 1)[1].removesuffix(".png")) - 1
                files.setdefault(key, {})[drawing] = zf.read(name)
    if not files:
        raise ConfigError(f"data.data_dir: no Omniglot images in {Path(root) / 'omniglot'}")
    images, labels, drawings = [], [], []
    keys = sorted(files)
    for cid, key in enumerate(keys):
        for drawing, data in sorted(files[key].items()):
            images.append(_decode(data, size))
            labels.append(cid)
            drawings.append(drawing)
    return OmniglotImages(
        images=np.stack(images),
        labels=np.asarray(labels, dtype=np.int64),
        drawings=np.asarray(drawings, dtype=np.int64),
        characters=tuple(f"{a}/{c}" for a, c in keys),
        alphabets=tuple(a for a, _ in keys),
    )


@lru_cache(maxsize=4)
def load_runs(root: Path, size: int = 28) -> tuple[OneShotRun, ...]:
    """The 20 official 20-way 1-shot runs of ``root/omniglot/all_runs.zip`` (cached)."""
    (path,) = _require(Path(root), (RUNS_ZIP,))
    runs = []
    with zipfile.ZipFile(path) as zf:
        run_names = sorted({n.split("/")[0] for n in zf.namelist() if n.startswith("run")})
        for run in run_names:
            support_names = [f"{run}/training/class{k:02d}.png" for k in range(1, RUN_WAYS + 1)]
            pairs = [line.split() for line in zf.read(f"{run}/class_labels.txt").decode().splitlines() if line.strip()]
            index = {n: k for k, n in enumerate(support_names)}
            runs.append(
                OneShotRun(
                    support=np.stack([_decode(zf.read(n), size) for n in support_names]),
                    query=np.stack([_decode(zf.read(q), size) for q, _ in pairs]),
                    labels=np.asarray([index[s] for _, s in pairs], dtype=np.int64),
                )
            )
    return tuple(runs)
