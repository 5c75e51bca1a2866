"""BoMM's loaders for users with a network, on tiny sets built in code (nothing downloaded): COCO
and CUB-200 with captions from their official file layouts, a captioned hub set, and a CLIP-style
dual encoder by name (``tiny-clip``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from fedtune.config import ConfigError
from fedtune.data.captions import load_coco, load_cub, load_hub_captions, majority_category
from fedtune.methods.bomm.dual_encoder import TINY_CLIP, DualEncoder


def _image(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((20, 24, 3), value, np.uint8)).save(path)


def instances(*pairs: tuple[int, int]) -> list[dict]:
    """COCO instance annotations, one per (image id, category id)."""
    return [{"image_id": i, "category_id": c} for i, c in pairs]


def test_majority_category_counts_instances_and_breaks_ties_by_id():
    anns = instances((1, 5), (1, 3), (1, 5), (2, 9), (2, 4))
    assert majority_category(anns) == {1: 5, 2: 4}


def test_coco_from_the_official_annotation_files(tmp_path):
    images = [{"id": 7, "file_name": "a.jpg"}, {"id": 3, "file_name": "b.jpg"}, {"id": 9, "file_name": "c.jpg"}]
    cats = [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}, {"id": 44, "name": "bottle"}]
    inst = instances((7, 18), (7, 18), (7, 1), (3, 1), (9, 44))
    caps = [
        {"image_id": 7, "caption": "two dogs and a man "},
        {"image_id": 7, "caption": "dogs"},
        {"image_id": 3, "caption": "a person"},
    ]  # image 9 has no caption: left out
    (tmp_path / "annotations").mkdir()
    (tmp_path / "annotations" / "instances_val2017.json").write_text(
        json.dumps({"images": images, "categories": cats, "annotations": inst})
    )
    (tmp_path / "annotations" / "captions_val2017.json").write_text(json.dumps({"annotations": caps}))
    for i, im in enumerate(images):
        _image(tmp_path / "val2017" / im["file_name"], 40 * i)
    ds = load_coco(tmp_path, "val2017")
    assert ds.label_names == ["person", "dog"] and list(ds.labels) == [0, 1]  # images 3 then 7
    assert ds.captions == [["a person"], ["two dogs and a man", "dogs"]]
    assert ds.image(1).size == (24, 20)
    with pytest.raises(ConfigError, match="instances_train2017"):
        load_coco(tmp_path, "train2017")


def test_cub_with_reed_captions_and_the_official_split(tmp_path):
    root, text = tmp_path / "CUB_200_2011", tmp_path / "cvpr2016_cub"
    root.mkdir()
    (root / "classes.txt").write_text("1 001.Black_footed_Albatross\n2 002.Laysan_Albatross\n")
    (root / "images.txt").write_text(
        "1 001.Black_footed_Albatross/x1.jpg\n2 002.Laysan_Albatross/y1.jpg\n3 002.Laysan_Albatross/y2.jpg\n"
    )
    (root / "image_class_labels.txt").write_text("1 1\n2 2\n3 2\n")
    (root / "train_test_split.txt").write_text("1 1\n2 0\n3 1\n")
    for rel in ("001.Black_footed_Albatross/x1", "002.Laysan_Albatross/y1", "002.Laysan_Albatross/y2"):
        _image(root / "images" / f"{rel}.jpg", 10)
        (text / "text_c10" / f"{rel}.txt").parent.mkdir(parents=True, exist_ok=True)
        (text / "text_c10" / f"{rel}.txt").write_text("a bird with a white belly\nthis bird is dark\n")
    train = load_cub(root, text, "train")
    assert list(train.labels) == [0, 1] and train.label_names[0] == "Black_footed_Albatross"
    assert train.captions[1] == ["a bird with a white belly", "this bird is dark"]
    assert len(load_cub(root, text, "test")) == 1


def test_hub_captions_through_datasets(monkeypatch):
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "img": [Image.fromarray(np.zeros((8, 8, 3), np.uint8)) for _ in range(3)],
            "sentences": [["a", "b"], ["c"], ["d"]],
            "species": ["wren", "crow", "wren"],
        }
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None: ds)
    out = load_hub_captions("someone/birds", image_column="img", caption_column="sentences", label_column="species")
    assert out.label_names == ["crow", "wren"] and list(out.labels) == [1, 0, 1] and out.captions[0] == ["a", "b"]
    with pytest.raises(ConfigError, match="no column 'caption'"):
        load_hub_captions("someone/birds", image_column="img")


def test_tiny_clip_embeds_images_and_captions_in_one_space():
    enc = DualEncoder(TINY_CLIP)
    images = [np.full((20, 24, 3), v, np.uint8) for v in (0, 128, 255)]
    a, b = enc.encode_images(images), enc.encode_texts(["a red bird", "a small bird on a fence", "x"])
    assert a.shape == b.shape == (3, enc.dim) and np.isfinite(a).all() and np.isfinite(b).all()
    # alone or in a padded batch of three: float32 kernels may round the two apart by ~1e-6 relative
    np.testing.assert_allclose(DualEncoder(TINY_CLIP).encode_texts(["a red bird"]), b[:1], rtol=1e-5, atol=1e-6)
