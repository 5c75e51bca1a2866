"""Image + caption classification sets of the BoMM paper (Section 5.1, Appendix A), for users with
the data: MS COCO and CUB-200-2011 with Reed et al.'s captions, from their official files, and any
captioned image set on the Hugging Face hub.

- :func:`load_coco`: ``annotations/instances_<split>.json`` and ``annotations/captions_<split>.json``
  (the official 2017 annotation zip) and the images under ``<split>/``; each image's class is the
  category with the most annotated instances in it (ties: the smaller category id), the paper's
  rule ("the category with the highest number of target objects present"); its captions are COCO's
  (at least five).
- :func:`load_cub`: the official ``CUB_200_2011`` folder (``images.txt``, ``classes.txt``,
  ``image_class_labels.txt``, ``train_test_split.txt``) and Reed et al.'s ``text_c10/<class>/<image>.txt``
  (ten captions per image).
- :func:`load_hub_captions`: ``datasets.load_dataset(name)`` with image, caption(s) and label columns.

Each returns a :class:`CaptionedImages`. Nothing here is downloaded in tests: they build tiny sets in
code. No task serves these sets yet (an image + text paired task would); their representations
would come from :class:`~fedtune.methods.bomm.dual_encoder.DualEncoder`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedtune.config import ConfigError


@dataclass
class CaptionedImages:
    """Images (paths, PIL images or arrays), their captions, and a class per image."""

    images: list[Any]
    captions: list[list[str]]
    labels: np.ndarray
    label_names: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, i: int):
        """Image ``i`` as an RGB PIL image (opened from its path when it is one)."""
        from PIL import Image

        im = self.images[i]
        if isinstance(im, (str, Path)):
            with Image.open(im) as opened:
                return opened.convert("RGB")
        return im.convert("RGB") if hasattr(im, "convert") else Image.fromarray(np.asarray(im)).convert("RGB")


def majority_category(annotations: list[dict]) -> dict[int, int]:
    """image id -> the category with the most instance annotations in it (ties: smaller id)."""
    counts: dict[int, Counter] = {}
    for ann in annotations:
        counts.setdefault(int(ann["image_id"]), Counter())[int(ann["category_id"])] += 1
    return {img: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for img, c in counts.items()}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: not found (the official COCO annotation files are expected)")
    return json.loads(path.read_text(encoding="utf-8"))


def load_coco(root: str | Path, split: str = "train2017") -> CaptionedImages:
    """COCO images of ``split`` that have both an instance and a caption, labeled by their majority
    category (classes: the categories that occur, in id order)."""
    root = Path(root)
    instances = _read_json(root / "annotations" / f"instances_{split}.json")
    captions = _read_json(root / "annotations" / f"captions_{split}.json")
    label_of = majority_category(instances["annotations"])
    texts: dict[int, list[str]] = {}
    for ann in captions["annotations"]:
        texts.setdefault(int(ann["image_id"]), []).append(str(ann["caption"]).strip())
    names = {int(c["id"]): c["name"] for c in instances["categories"]}
    used = sorted({label_of[i] for i in label_of if i in texts})
    index = {cat: k for k, cat in enumerate(used)}
    images, caps, labels = [], [], []
    for img in sorted(instances["images"], key=lambda x: int(x["id"])):
        i = int(img["id"])
        if i in label_of and i in texts:
            images.append(root / split / img["file_name"])
            caps.append(texts[i])
            labels.append(index[label_of[i]])
    return CaptionedImages(images, caps, np.asarray(labels, dtype=np.int64), [names[c] for c in used])


def _table(path: Path) -> list[list[str]]:
    if not path.is_file():
        raise ConfigError(f"{path}: not found (the official CUB_200_2011 folder is expected)")
    return [line.split() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_cub(root: str | Path, captions_root: str | Path, split: str = "train") -> CaptionedImages:
    """CUB-200-2011 images of ``split`` ("train" or "test", the official split) with Reed et al.'s
    captions (``captions_root/text_c10/<class folder>/<image name>.txt``); classes 0..199."""
    root, captions_root = Path(root), Path(captions_root)
    if split not in ("train", "test"):
        raise ConfigError(f"split: expected 'train' or 'test', got {split!r}")
    paths = {int(i): p for i, p in _table(root / "images.txt")}
    label = {int(i): int(c) - 1 for i, c in _table(root / "image_class_labels.txt")}
    is_train = {int(i): t == "1" for i, t in _table(root / "train_test_split.txt")}
    names = [n.split(".", 1)[-1] for _, n in sorted(_table(root / "classes.txt"), key=lambda r: int(r[0]))]
    images, caps, labels = [], [], []
    for i in sorted(paths):
        if is_train[i] != (split == "train"):
            continue
        text = captions_root / "text_c10" / Path(paths[i]).with_suffix(".txt")
        if not text.is_file():
            raise ConfigError(f"{text}: not found (Reed et al.'s text_c10 captions are expected)")
        images.append(root / "images" / paths[i])
        caps.append([line.strip() for line in text.read_text(encoding="utf-8").splitlines() if line.strip()])
        labels.append(label[i])
    return CaptionedImages(images, caps, np.asarray(labels, dtype=np.int64), names)


def load_hub_captions(
    name: str,
    split: str = "train",
    image_column: str = "image",
    caption_column: str = "caption",
    label_column: str = "label",
    config: str | None = None,
) -> CaptionedImages:
    """A captioned image set from the hub (``datasets.load_dataset(name, config, split=split)``); a
    caption column holding one string or a list of them; labels as the set's class names when the
    column is a ClassLabel, else the sorted distinct values."""
    import datasets

    ds = datasets.load_dataset(name, config, split=split)
    missing = [c for c in (image_column, caption_column, label_column) if c not in ds.column_names]
    if missing:
        raise ConfigError(f"data.name {name!r}: no column {missing[0]!r} (columns: {', '.join(ds.column_names)})")
    feature = ds.features[label_column]
    raw = list(ds[label_column])
    if hasattr(feature, "names"):
        names, labels = list(feature.names), np.asarray(raw, dtype=np.int64)
    else:
        names = sorted({str(v) for v in raw})
        labels = np.asarray([names.index(str(v)) for v in raw], dtype=np.int64)
    caps = [[c] if isinstance(c, str) else [str(x) for x in c] for c in ds[caption_column]]
    return CaptionedImages(list(ds[image_column]), caps, labels, names)
