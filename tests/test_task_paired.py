"""paired-multimodal: the pairing, the parties' structure (aligned / labeled / masks per
scenario), the fusion model with a modality missing, and a tiny fedavg run."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError, DataConfig
from fedtune.data.audio import load_fsdd
from fedtune.data.images import load_image_set
from fedtune.data.paired import (
    AUDIO,
    IMAGE,
    affected_parties,
    build_paired_test,
    build_paired_train,
    draw_masks,
    missing_modality,
)
from fedtune.models.multimodal import FusionClassifier
from fedtune.tasks.paired_multimodal import PairedMultimodal

DATA = Path(os.environ["FEDTUNE_DATA_DIR"])
PAIRED_TASK = ["task.kind=paired-multimodal", *PairedMultimodal.test_overrides]


@pytest.fixture
def paired_config(tmp_path):
    """A tiny paired-multimodal RunConfig (conftest's paired_config caps data.max_train_samples,
    which this task refuses: its counts size the pool)."""
    from fedtune.config import load_config

    def make(*overrides: str):
        return load_config(
            None,
            [
                *PAIRED_TASK,
                "federation.num_clients=2",
                "rounds=2",
                "train.local_steps=4",
                "train.batch_size=8",
                f"output_dir={tmp_path / 'runs'}",
                *overrides,
            ],
        )

    return make


@pytest.fixture(scope="module")
def sources():
    images = load_image_set(DataConfig(name="digits"))
    audio = load_fsdd(DATA)
    return images, audio


def build(sources, parties=2, aligned=100, unaligned=300, labeled_fraction=0.5, delta=0.5, scenario=1, seed=0):
    (images, _), (audio, _) = sources
    return build_paired_train(images, audio, parties, aligned, unaligned, labeled_fraction, delta, scenario, seed)


# -- pairing -----------------------------------------------------------------------------------
def test_every_row_pairs_an_image_and_a_recording_of_its_own_digit(sources):
    (images, images_test), (audio, audio_test) = sources
    for ds in (
        build(sources),
        build(sources, parties=3, scenario=3, seed=5),
        build_paired_test(images_test, audio_test),
    ):
        assert np.array_equal(ds.images.labels[ds.image_index], ds.labels)
        assert np.array_equal(ds.audio.labels[ds.audio_index], ds.labels)
    test = build_paired_test(images_test, audio_test)
    per_digit = np.minimum(np.bincount(images_test.labels, minlength=10), np.bincount(audio_test.labels, minlength=10))
    assert len(test) == per_digit.sum() and test.masks.all() and (test.party == -1).all()


def test_pairing_is_deterministic_under_the_seed_and_changes_with_it(sources):
    a, b, c = build(sources, seed=1), build(sources, seed=1), build(sources, seed=2)
    for field in ("sample_ids", "party", "labels", "masks", "aligned", "labeled", "image_index", "audio_index"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert not np.array_equal(a.audio_index, c.audio_index) and not np.array_equal(a.image_index, c.image_index)


def test_no_recording_is_used_twice_and_aligned_rows_share_the_image_only(sources):
    ds = build(sources, parties=3, aligned=60, unaligned=100)
    assert len(set(ds.audio_index.tolist())) == len(ds)
    for sid in np.unique(ds.sample_ids[ds.aligned]):
        rows = np.flatnonzero(ds.sample_ids == sid)
        assert len(set(ds.image_index[rows].tolist())) == 1  # the same image at every party
        assert len(set(ds.audio_index[rows].tolist())) == 3  # each party its own recording
    images_of_unaligned = ds.image_index[~ds.aligned]
    assert len(set(images_of_unaligned.tolist())) == len(images_of_unaligned)


def test_ids_are_class_balanced(sources):
    ds = build(sources, aligned=100, unaligned=300)  # 700 ids over 10 digits
    first = np.unique(ds.sample_ids, return_index=True)[1]
    assert np.bincount(ds.labels[first], minlength=10).tolist() == [70] * 10


# -- the parties' structure --------------------------------------------------------------------
@pytest.mark.parametrize("parties", [2, 3])
def test_aligned_ids_are_exactly_the_ids_held_by_more_than_one_party(sources, parties):
    ds = build(sources, parties=parties, aligned=40, unaligned=120)
    holders = Counter(ds.sample_ids.tolist())
    shared = {sid for sid, n in holders.items() if n > 1}
    assert shared == set(ds.sample_ids[ds.aligned].tolist()) and len(shared) == 40
    assert all(holders[sid] == parties for sid in shared)  # held by every party
    for p in ds.parties():
        assert len(p.rows) == 40 + 120 and p.aligned.sum() == 40
        assert set(p.sample_ids[p.aligned].tolist()) == shared
        assert np.array_equal(ds.party[p.rows], np.full(len(p.rows), p.party))
        np.testing.assert_array_equal(p.masks, ds.masks[p.rows])
    unaligned = [set(p.sample_ids[~p.aligned].tolist()) for p in ds.parties()]
    assert all(not (a & b) for i, a in enumerate(unaligned) for b in unaligned[i + 1 :])


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_labeled_fraction_is_honoured_in_every_party(sources, fraction):
    ds = build(sources, aligned=30, unaligned=133, labeled_fraction=fraction)
    for p in ds.parties():
        assert p.labeled.sum() == round(fraction * len(p.rows))


def test_masks_follow_delta_and_the_scenario_on_many_rows():
    """Missing rate within 4 standard errors of delta (n = 20,000 rows per affected party:
    tolerance 4 sqrt(delta (1 - delta) / n) = 0.013 at delta = 0.3)."""
    n, delta, k = 20_000, 0.3, 3
    party = np.repeat(np.arange(k), n)
    tol = 4 * np.sqrt(delta * (1 - delta) / n)
    for scenario in (0, 1, 2, 3):
        masks = draw_masks(party, scenario, delta, k, np.random.default_rng(scenario))
        column = missing_modality(scenario)
        assert masks.any(axis=1).all()  # never both modalities missing
        for p in range(k):
            missing = ~masks[party == p]
            expected = delta if p in affected_parties(scenario, k) else 0.0
            for m in (IMAGE, AUDIO):
                rate = missing[:, m].mean()
                if m == column:
                    assert abs(rate - expected) <= tol, (scenario, p, m, rate)
                else:
                    assert rate == 0.0
    assert missing_modality(1) == missing_modality(2) == AUDIO and missing_modality(3) == IMAGE
    assert affected_parties(2, 3) == [1, 2] and affected_parties(1, 3) == [0, 1, 2] and affected_parties(0, 3) == []


def test_masks_in_a_built_pool_follow_the_scenario_and_grow_with_delta(sources):
    tol = 4 * np.sqrt(0.5 * 0.5 / 400)  # 400 rows per party
    s2 = build(sources, aligned=100, unaligned=300, delta=0.5, scenario=2)
    p0, p1 = s2.parties()
    assert p0.masks.all()  # party 0 complete in scenario 2
    assert p1.masks[:, IMAGE].all() and abs((~p1.masks[:, AUDIO]).mean() - 0.5) <= tol
    s3 = build(sources, aligned=100, unaligned=300, delta=0.5, scenario=3)
    assert s3.masks[:, AUDIO].all() and abs((~s3.masks[:, IMAGE]).mean() - 0.5) <= tol / np.sqrt(2)
    low, high = build(sources, delta=0.2), build(sources, delta=0.6)
    assert np.array_equal(low.audio_index, high.audio_index) and np.array_equal(low.labeled, high.labeled)
    assert np.all(high.masks[:, AUDIO] <= low.masks[:, AUDIO])  # missing at 0.2 => missing at 0.6
    assert (~build(sources, delta=0.0).masks).sum() == 0 and (~build(sources, delta=1.0).masks[:, AUDIO]).all()


def test_impossible_sizes_and_bad_options_are_one_line_config_errors(sources, paired_config):
    with pytest.raises(ConfigError, match=r"^task.unaligned: .* images of class"):
        build(sources, aligned=200, unaligned=1000)
    with pytest.raises(ConfigError, match=r"^task.delta"):
        build(sources, delta=1.5)
    from fedtune.runtime import RunContext, resolve_run

    for override, pattern in [
        ("data.name=fashion-mnist", "^data.name: paired-multimodal pairs spoken digits"),
        ("data.max_train_samples=50", "^data.max_train_samples: paired-multimodal sizes"),
        ("task.scenario=4", "^task.scenario"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            RunContext(resolve_run(paired_config("method=fedavg", override))).task.train
    with pytest.raises(ConfigError, match="^method 'fedit' does not support task 'paired-multimodal'"):
        RunContext(resolve_run(paired_config("method=fedit")))


# -- model, task, run --------------------------------------------------------------------------
def test_the_fusion_model_runs_with_either_modality_missing_and_ignores_the_absent_one():
    torch.manual_seed(0)
    model = FusionClassifier(10, image_channels=1, embed_dim=16).eval()
    image, audio = torch.randn(6, 1, 8, 8), torch.randn(6, 40, 32)
    mask = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 1]], dtype=torch.bool)
    logits = model(image, audio, mask)
    assert logits.shape == (6, 10) and torch.isfinite(logits).all()
    noisy_audio, noisy_image = audio.clone(), image.clone()
    noisy_audio[~mask[:, 1]] = 100.0
    noisy_image[~mask[:, 0]] = -100.0
    torch.testing.assert_close(model(noisy_image, noisy_audio, mask), logits)  # absent inputs never read
    # a present modality does matter, and image-only rows equal the image encoder alone through the head
    assert not torch.allclose(model(image, audio + 1.0, mask)[mask[:, 1]], logits[mask[:, 1]])
    emb = model.encoders["image"](image[1:2])
    torch.testing.assert_close(logits[1:2], model.classifier(emb))
    # no gradient reaches the audio encoder from a batch without audio
    model.train()
    model(image, audio, torch.tensor([[1, 0]] * 6, dtype=torch.bool)).sum().backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.encoders["audio"].parameters())


def test_partition_is_the_parties_rows_and_batches_use_labeled_rows_only(paired_config):
    from fedtune.runtime import RunContext, resolve_run

    ctx = RunContext(resolve_run(paired_config("method=fedavg", "task.scenario=3")))
    task, pool = ctx.task, ctx.task.train
    parts = ctx.partitions
    assert [len(p) for p in parts] == [32, 32] and all(np.all(pool.party[p] == k) for k, p in enumerate(parts))
    drawn = []
    batch = task.batch
    task.batch = lambda ds, tensors, rows: (drawn.append(np.asarray(rows)), batch(ds, tensors, rows))[1]
    for inputs, _ in task.train_batches(parts[1], 4, 10, np.random.default_rng(0)):
        assert inputs["image"].shape[1:] == (1, 8, 8) and inputs["audio"].shape[1:] == (40, 32)
        absent = ~inputs["mask"][:, IMAGE]
        assert (inputs["image"][absent] == 0).all()  # the missing image is zero-filled
    labeled = parts[1][pool.labeled[parts[1]]]
    assert len(labeled) == 16 and set(np.concatenate(drawn).tolist()) == set(labeled.tolist())
    with pytest.raises(ConfigError, match="^federation.num_clients: the pool was built for 2 parties"):
        task.partition(3, 0)


def test_a_tiny_fedavg_run_reports_complete_and_single_modality_accuracy(paired_config):
    from fedtune.run import run_experiment

    summary = run_experiment(paired_config("method=fedavg"))
    assert summary["task"] == "paired-multimodal" and summary["test_examples"] == 40
    import json

    last = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[-1])
    assert {"accuracy", "loss", "accuracy_image_only", "accuracy_audio_only"} <= last.keys()


def test_the_loss_adds_each_present_modality_classified_alone(paired_config):
    from fedtune.runtime import RunContext, resolve_run

    ctx = RunContext(resolve_run(paired_config("method=fedavg", "task.unimodal_weight=0.25")))
    task = ctx.task
    model = ctx.model.eval()  # no dropout: the hand computation below sees the same logits
    inputs, labels = next(iter(task.train_batches(ctx.partitions[0], 8, 1, np.random.default_rng(1))))
    inputs["mask"][0] = torch.tensor([True, False])  # make sure both kinds of row are present
    fused, single = model.all_logits(**inputs)
    torch.testing.assert_close(fused, model(**inputs))
    terms = [
        torch.nn.functional.cross_entropy(single[i, m : m + 1], labels[i : i + 1])
        for i in range(len(labels))
        for m in (0, 1)
        if inputs["mask"][i, m]
    ]
    expected = torch.nn.functional.cross_entropy(fused, labels) + 0.25 * torch.stack(terms).mean()
    torch.testing.assert_close(task.loss(model, (inputs, labels)), expected)
    task.options = task.options.model_copy(update={"unimodal_weight": 0.0})
    torch.testing.assert_close(task.loss(model, (inputs, labels)), torch.nn.functional.cross_entropy(fused, labels))
