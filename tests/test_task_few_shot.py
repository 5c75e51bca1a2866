"""The few-shot task: Omniglot decoding, alphabet partition, episodes, the two heads, a tiny run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError, load_config
from fedtune.data.omniglot import DRAWINGS, load_background, load_runs
from fedtune.data.text import data_dir
from fedtune.models.fewshot import episode_cross_entropy, fit_head, linear_logits, prototype_head
from fedtune.tasks import build_task, resolve_config
from fedtune.tasks.few_shot import FewShot, sample_episodes

FAST = ["task.kind=few-shot", "method=fedavg", "task.filters=8", "task.eval_episodes=20"]


def make_task(*overrides: str) -> FewShot:
    return build_task(resolve_config(load_config(None, [*FAST, *overrides])))


@pytest.fixture(scope="module")
def task() -> FewShot:
    return make_task()


def root() -> Path:
    return data_dir(load_config(None, []).data)


# -- data ------------------------------------------------------------------------------------
def test_background_is_deduplicated_to_8_alphabets_242_characters_20_drawings():
    bg = load_background(root(), 28)
    assert bg.alphabet_names == [
        "Balinese",
        "Early_Aramaic",
        "Greek",
        "Japanese_(katakana)",
        "Korean",
        "Latin",
        "Sanskrit",
        "Tagalog",
    ]
    assert len(bg.characters) == len(set(bg.characters)) == 242
    assert bg.characters.count("Greek/character01") == 1  # in both archives, kept once
    assert bg.images.shape == (242 * DRAWINGS, 28, 28) and bg.images.dtype == np.uint8
    for c in range(242):
        assert sorted(bg.drawings[bg.labels == c]) == list(range(DRAWINGS))
    ink = bg.images.mean() / 255
    assert 0.02 < ink < 0.2  # strokes are 1 on a 0 background, not the inverse


def test_official_runs_are_20_way_1_shot():
    runs = load_runs(root(), 28)
    assert len(runs) == 20
    for run in runs:
        assert run.support.shape == run.query.shape == (20, 28, 28)
        assert sorted(run.labels) == list(range(20))  # each support character queried once


def test_missing_omniglot_files_stop_with_one_line_naming_the_directory(tmp_path):
    t = make_task(f"data.data_dir={tmp_path}")
    with pytest.raises(
        ConfigError, match=r"^data\.data_dir: Omniglot file\(s\) .*small1\.zip.* not found in .*FEDTUNE_DATA_DIR"
    ) as exc:
        t.train
    assert "\n" not in str(exc.value) and str(tmp_path) in str(exc.value)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["task.k_shot=5", "task.q_query=16"], r"^task\.q_query: k_shot \+ q_query must be at most 20"),
        (["task.test_alphabets=['Klingon']"], r"^task\.test_alphabets: unknown alphabet"),
        (["data.max_train_samples=100"], r"^data\.max_train_samples: not used"),
        (["model.name=resnet12"], r"^model\.name: "),
        (["model.finetune=head"], r"^model\.finetune: "),
    ],
)
def test_bad_options_stop_with_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_task(*overrides).train


# -- partition -------------------------------------------------------------------------------
def _alphabets_of(t: FewShot, part: np.ndarray) -> set[str]:
    return {t.train.class_characters[c].split("/")[0] for c in np.unique(t.train.labels[part])}


@pytest.mark.parametrize("clients", [4, 6, 10])
def test_held_out_alphabets_never_reach_a_client_and_every_image_goes_to_one(task, clients):
    parts = task.partition(clients, seed=0)
    assert len(parts) == clients
    everything = np.concatenate(parts)
    assert np.array_equal(np.sort(everything), np.arange(len(task.train)))  # each image once
    held_out = set(task.opts.test_alphabets)
    assert held_out == {"Balinese", "Tagalog"} and held_out.isdisjoint(task.train.alphabets)
    for part in parts:
        assert held_out.isdisjoint(_alphabets_of(task, part))
        assert len(np.unique(task.train.labels[part])) >= task.opts.n_way


def test_few_clients_get_whole_alphabets(task):
    parts = task.partition(4, seed=0)
    owners: dict[str, int] = {}
    for cid, part in enumerate(parts):
        for a in _alphabets_of(task, part):
            assert owners.setdefault(a, cid) == cid  # an alphabet belongs to one client only
    for part in parts:  # ... in full: all its characters, all their drawings
        alphabets = _alphabets_of(task, part)
        mine = [i for i, c in enumerate(task.train.class_characters) if c.split("/")[0] in alphabets]
        assert np.array_equal(np.unique(task.train.labels[part]), mine)
        assert len(part) == DRAWINGS * len(mine)


def test_many_clients_get_contiguous_characters_of_one_alphabet(task):
    parts = task.partition(10, seed=0)
    for part in parts:
        classes = np.unique(task.train.labels[part])
        assert len(_alphabets_of(task, part)) == 1
        assert np.array_equal(classes, np.arange(classes[0], classes[-1] + 1))  # contiguous
    sizes = sorted(len(np.unique(task.train.labels[p])) for p in parts)
    assert sizes[0] >= 13 and sizes[-1] <= 24  # the largest alphabets got the extra clients


def test_too_many_clients_for_n_way_stop_with_one_line():
    t = make_task("task.n_way=20")
    with pytest.raises(ConfigError, match=r"^federation\.num_clients: 10 clients .* 20-way episodes need 20"):
        t.partition(10, seed=0)
    rotated = make_task("task.n_way=20", "task.rotations=true")  # 4x the classes: feasible
    parts = rotated.partition(10, seed=0)
    for part in parts:
        classes = np.unique(rotated.train.labels[part])
        assert len(classes) >= 20 and len(classes) % 4 == 0  # rotations stay with their character
        assert np.array_equal(np.unique(classes // 4, return_counts=True)[1], np.full(len(classes) // 4, 4))


# -- episodes --------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k, q", [(5, 1, 5), (20, 5, 15)])
def test_episodes_have_n_classes_of_k_plus_q_disjoint_drawings(n, k, q):
    t = make_task(f"task.n_way={n}", f"task.k_shot={k}", f"task.q_query={q}", "task.rotations=true")
    pool = t.partition(4, seed=0)[0]
    batch = next(t.train_batches(pool, 3, 1, np.random.default_rng(0)))
    ds = t.train
    assert batch.support.shape == (3, n * k, 1, 28, 28) and batch.query.shape == (3, n * q, 1, 28, 28)
    for e in range(3):
        assert len(set(batch.classes[e])) == n and set(batch.classes[e]) <= set(ds.labels[pool])
        assert torch.equal(batch.support_labels[e], torch.arange(n).repeat_interleave(k))
        assert torch.equal(batch.query_labels[e], torch.arange(n).repeat_interleave(q))
        s_idx, q_idx = batch.support_idx[e].reshape(n, k), batch.query_idx[e].reshape(n, q)
        for j, c in enumerate(batch.classes[e]):
            assert (ds.labels[s_idx[j]] == c).all() and (ds.labels[q_idx[j]] == c).all()
            assert set(ds.drawings[s_idx[j]]).isdisjoint(ds.drawings[q_idx[j]])
            assert len(set(ds.drawings[s_idx[j]]) | set(ds.drawings[q_idx[j]])) == k + q
        pixels = torch.from_numpy(ds.images[batch.support_idx[e]]).float() / 255
        assert torch.equal(batch.support[e, :, 0], pixels)


def test_episodes_are_fixed_by_the_seed(task):
    pool = task.partition(4, seed=0)[1]
    a, b, c = (list(task.train_batches(pool, 2, 3, np.random.default_rng(s))) for s in (7, 7, 8))
    assert all(
        np.array_equal(x.support_idx, y.support_idx) and np.array_equal(x.query_idx, y.query_idx) for x, y in zip(a, b)
    )
    assert not all(np.array_equal(x.support_idx, y.support_idx) for x, y in zip(a, c))


def test_evaluation_episodes_are_held_out_and_the_same_for_every_run_seed(task):
    other = make_task("seed=3")
    for x, y in zip(task.eval_episodes, other.eval_episodes):
        assert np.array_equal(x, y)
    classes, support, query = task.eval_episodes
    assert classes.shape == (20, 5) and support.shape == (20, 5) and query.shape == (20, 5 * 19)  # 20 - K queries
    assert {task.test.class_characters[c].split("/")[0] for c in np.unique(classes)} <= {"Balinese", "Tagalog"}


def test_sample_episodes_refuses_a_pool_with_too_few_classes(task):
    pool = np.flatnonzero(task.train.labels < 3)
    with pytest.raises(ConfigError, match=r"^task\.n_way: 5-way episodes"):
        sample_episodes(task.train.labels, pool, 5, 1, 5, 1, np.random.default_rng(0))


# -- heads -----------------------------------------------------------------------------------
def test_prototype_head_is_the_negative_squared_distance_to_class_means():
    # class 0: (1, 0) and (3, 0) -> c0 = (2, 0); class 1: (0, 2) -> c1 = (0, 2); query q = (2, 1)
    emb = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]]])
    weight, bias = prototype_head(emb, torch.tensor([[0, 0, 1]]), 2)
    assert torch.equal(weight, torch.tensor([[[4.0, 0.0], [0.0, 4.0]]])) and torch.equal(
        bias, torch.tensor([[-4.0, -4.0]])
    )
    # -||q - c0||^2 = -1, -||q - c1||^2 = -5; plus ||q||^2 = 5: logits (4, 0)
    assert torch.equal(linear_logits(torch.tensor([[[2.0, 1.0]]]), (weight, bias)), torch.tensor([[[4.0, 0.0]]]))
    # random case: logits + ||q||^2 offset = -squared distances, per query
    g = torch.Generator().manual_seed(0)
    emb, q = torch.randn(3, 10, 6, generator=g), torch.randn(3, 7, 6, generator=g)
    labels = torch.arange(5).repeat(2).expand(3, -1)
    logits = linear_logits(q, prototype_head(emb, labels, 5))
    protos = torch.stack([emb[:, labels[0] == k].mean(1) for k in range(5)], 1)
    dist = torch.cdist(q, protos) ** 2
    assert torch.allclose(logits - (q**2).sum(-1, keepdim=True), -dist, atol=1e-5)


def _real_episodes(task, count=4):
    model = task.build_model(0)
    batch = next(task.train_batches(np.arange(len(task.train)), count, 1, np.random.default_rng(0)))
    model.train()
    return model, batch


def test_fitted_head_lowers_the_support_loss_episode_by_episode(task):
    model, batch = _real_episodes(task)
    with torch.no_grad():
        emb_s, _ = task.embed_episodes(model, batch)
    labels = batch.support_labels

    def support_loss(steps, lr=0.1):
        return episode_cross_entropy(linear_logits(emb_s, fit_head(emb_s, labels, 5, steps, lr)), labels)

    zero, one, ten = support_loss(0), support_loss(1), support_loss(10)
    assert torch.allclose(zero, torch.full((4,), math.log(5)))  # zero head: uniform
    assert (one < zero).all() and (ten < one).all()
    assert support_loss(200, lr=1.0).max() < 0.1 * math.log(5)  # 1-shot support sets are separable
    # each episode is fitted on its own: fitting the batch = fitting each episode alone
    alone = torch.cat([fit_head(emb_s[e : e + 1], labels[e : e + 1], 5, 10, 0.1)[0] for e in range(4)])
    assert torch.allclose(fit_head(emb_s, labels, 5, 10, 0.1)[0], alone, atol=1e-6)


def test_fitted_loss_trains_the_backbone_through_the_unrolled_fit():
    t = make_task("task.head=fitted", "task.head_steps=3", "task.head_lr=0.5")
    model, batch = _real_episodes(t, 2)
    t.loss(model, batch).backward()
    unrolled = model.backbone[0][0].weight.grad.clone()
    assert unrolled.abs().sum() > 0
    assert model.head.weight.grad is None  # the shared head is not part of this loss
    # the same loss with the fitted head cut from the graph (only the query path trains): differs
    model.zero_grad()
    emb_s, emb_q = t.embed_episodes(model, batch)
    head = fit_head(emb_s, batch.support_labels, 5, 3, 0.5)
    detached = episode_cross_entropy(linear_logits(emb_q, head), batch.query_labels).mean()
    assert torch.allclose(detached, t.loss(model, batch), atol=1e-5)  # same value ...
    detached.backward()
    assert not torch.allclose(model.backbone[0][0].weight.grad, unrolled, rtol=1e-3)  # ... other gradient


def test_support_and_query_loss_use_the_shared_head_by_default(task):
    model, batch = _real_episodes(task, 2)
    model.eval()
    with torch.no_grad():
        logits = model(batch.support.flatten(0, 1)).view(2, 5, 5)
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.support_labels.flatten())
        assert torch.allclose(task.support_loss(model, batch), expected, atol=1e-6)
        emb_s, emb_q = task.embed_episodes(model, batch)
        head = prototype_head(emb_s, batch.support_labels, 5)
        assert torch.allclose(task.query_loss(model, batch, head), task.loss(model, batch), atol=1e-5)


def test_loss_is_protonet_query_cross_entropy(task):
    model, batch = _real_episodes(task, 2)
    emb_s, emb_q = task.embed_episodes(model, batch)
    protos = emb_s.view(2, 5, 1, -1).mean(2)  # K = 1, class-major
    logits = -(torch.cdist(emb_q, protos) ** 2)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.query_labels.flatten())
    assert torch.allclose(task.loss(model, batch), expected, atol=1e-4)


def test_majority_rate_is_chance_and_evaluate_reports_an_interval(task):
    assert task.majority_rate() == pytest.approx(1 / 5)
    metrics = task.evaluate(task.build_model(0), 256)
    assert set(metrics) == {"accuracy", "accuracy_ci95", "loss", "oneshot20_accuracy"}
    assert 0 < metrics["accuracy_ci95"] < 0.2 and 0 <= metrics["oneshot20_accuracy"] <= 1
    assert task.evaluate(task.build_model(0), 7) == pytest.approx(metrics, abs=1e-6)  # batch size does not matter


def test_parameter_groups_split_backbone_and_head(task):
    names = [n for n, _ in task.build_model(0).named_parameters()]
    groups = task.parameter_groups(names)
    assert groups["head"] == ["head.weight", "head.bias"]
    assert groups["backbone"] and all(n.startswith("backbone.") for n in groups["backbone"])


# -- a tiny run ------------------------------------------------------------------------------
def test_fedavg_run_on_few_shot_writes_its_run_folder(tmp_path):
    from fedtune.run import run_experiment

    cfg = load_config(
        None,
        [
            "task.kind=few-shot",
            "method=fedavg",
            *FewShot.test_overrides,
            "federation.num_clients=3",
            "rounds=2",
            f"output_dir={tmp_path}",
            "name=fs",
        ],
    )
    summary = run_experiment(cfg)
    run_dir = tmp_path / "fs"
    for name in (
        "config.toml",
        "metrics.jsonl",
        "summary.json",
        "label_histograms.json",
        "checkpoint.npz",
        "model.safetensors",
    ):
        assert (run_dir / name).is_file(), name
    assert summary["task"] == "few-shot" and summary["data"] == "omniglot"
    assert summary["majority_accuracy"] == pytest.approx(0.2) and 0 <= summary["final_accuracy"] <= 1
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2 and "oneshot20_accuracy" in rounds[-1]
    hist = json.loads((run_dir / "label_histograms.json").read_text())
    assert len(hist["label_names"]) == 201 and sum(map(sum, hist["clients"])) == 201 * DRAWINGS
