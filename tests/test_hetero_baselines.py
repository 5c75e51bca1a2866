"""Tests for the heterogeneous-rank baselines: HeteroLoRA (and HetLoRA's options), FlexLoRA,
FedStackLoRA (FLoRA), including one unfaithful variant of each that a test driving the real
Client.fit / Strategy.aggregate_fit catches.

Prepare / Execute / Assert, on hand-made matrices and on the tiny 2-layer BERT (hidden 32).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.checkpoint import load_state, save_state
from fedtune.config import load_config
from fedtune.methods.base.lora_arrays import (
    a_name,
    b_name,
    fresh_lora_a,
    lora_paths,
    stack_factors,
    svd_factors,
    weighted_product_sum,
    zero_pad_average,
)
from fedtune.methods.base.ranked import merged_into_base
from fedtune.methods.fedstacklora import DENSE, STACK_B, split_downlink
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import random_global

ROOT = Path(__file__).resolve().parents[1]
ALPHA = 16.0
RANK = 8
TINY = [
    "data=sst2",
    "model.name=tiny-bert",
    f"model.lora_rank={RANK}",
    f"model.lora_alpha={ALPHA}",
    "rounds=2",
    "federation.num_clients=3",
    "train.local_steps=1",
    "train.batch_size=8",
    "data.max_train_samples=60",
    "data.max_test_samples=32",
    "data.max_length=16",
]
RANKS = [2, 4, 8]  # heterogeneous r_i for clients 0, 1, 2
PROFILES = "federation.profiles=[{rank=2},{rank=4},{rank=8}]"


def tiny(method: str, *extra: str, tmp_path: Path | None = None):
    out = [f"output_dir={tmp_path}"] if tmp_path is not None else []
    return load_config(None, [f"method={method}", *TINY, *out, *extra])


def random_adapter(rng, rank: int, m: int = 10, n: int = 8, path: str = "layer.q") -> dict[str, np.ndarray]:
    return {b_name(path): rng.normal(size=(m, rank)), a_name(path): rng.normal(size=(rank, n))}


def fake_replies(strategy, messages: dict[int, Message], rng, examples=(30, 10, 20)):
    """Replies whose 'trained' adapters are random: (trained arrays, reply updates)."""
    trained, replies = {}, {}
    for cid, msg in messages.items():
        t = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in msg.arrays.items()}
        trained[cid] = t
        replies[cid] = Message({k: t[k] - msg.arrays[k] for k in t}, {"num_examples": examples[cid], "train_loss": 1.0})
    return trained, replies


# -- HeteroLoRA -------------------------------------------------------------------------------
def test_zero_pad_average_hand_computed():
    # Prepare: global rank 3; client 0 has rank 1, client 1 rank 3, uniform weights
    u0 = {
        "m.lora_B.weight": np.array([[2.0], [4.0]]),
        "m.lora_A.weight": np.array([[6.0, 8.0]]),
        "classifier.bias": np.array([1.0, 3.0]),
    }
    u1 = {
        "m.lora_B.weight": np.array([[2.0, 2.0, 2.0], [0.0, 0.0, 4.0]]),
        "m.lora_A.weight": np.array([[2.0, 0.0], [4.0, 4.0], [0.0, 2.0]]),
        "classifier.bias": np.array([3.0, 5.0]),
    }
    # Execute
    zeros = zero_pad_average([u0, u1], [1.0, 1.0], rank=3)
    cover = zero_pad_average([u0, u1], [1.0, 1.0], rank=3, coverage=True)
    # Assert: padded zeros count (divide by 2 everywhere)
    np.testing.assert_allclose(zeros["m.lora_B.weight"], [[2.0, 1.0, 1.0], [2.0, 0.0, 2.0]])
    np.testing.assert_allclose(zeros["m.lora_A.weight"], [[4.0, 4.0], [2.0, 2.0], [0.0, 1.0]])
    np.testing.assert_allclose(zeros["classifier.bias"], [2.0, 4.0])
    # coverage: ranks 2..3 are averaged over client 1 alone
    np.testing.assert_allclose(cover["m.lora_B.weight"], [[2.0, 2.0, 2.0], [2.0, 0.0, 4.0]])
    np.testing.assert_allclose(cover["m.lora_A.weight"], [[4.0, 4.0], [4.0, 4.0], [0.0, 2.0]])
    # weighted: client 0 weight 3, client 1 weight 1
    w = zero_pad_average([u0, u1], [3.0, 1.0], rank=3)
    np.testing.assert_allclose(w["m.lora_B.weight"][:, 1:], [[0.5, 0.5], [0.0, 1.0]])


def test_heterolora_sends_truncations_and_pads_updates():
    # Prepare
    ctx = RunContext(resolve_run(tiny("heterolora", PROFILES, "options.scaling=global")))
    strategy = ctx.strategy()
    strategy.initialize()
    g0 = {k: v.copy() for k, v in strategy.global_arrays.items()}
    # Execute
    messages = strategy.configure_fit(1, [0, 1, 2])
    _, replies = fake_replies(strategy, messages, np.random.default_rng(0))
    strategy.aggregate_fit(1, replies)
    # Assert: truncation B[:, :r_i], A[:r_i], alpha_i = alpha r_i / r ("global" scaling)
    path = lora_paths(g0)[0]
    for cid, r_i in enumerate(RANKS):
        msg = messages[cid]
        assert msg.meta["rank"] == r_i
        assert msg.meta.get("alpha") == (None if r_i == RANK else ALPHA * r_i / RANK)
        np.testing.assert_array_equal(msg.arrays[b_name(path)], g0[b_name(path)][:, :r_i])
        np.testing.assert_array_equal(msg.arrays[a_name(path)], g0[a_name(path)][:r_i])
    # rank index 5 is covered by client 2 only: its update counts 1/3 (uniform, zero padding)
    new_a = strategy.global_arrays[a_name(path)]
    np.testing.assert_allclose(new_a[5] - g0[a_name(path)][5], replies[2].arrays[a_name(path)][5] / 3, atol=1e-6)
    # rank index 0 is covered by all three
    mean0 = sum(replies[c].arrays[a_name(path)][0] for c in range(3)) / 3
    np.testing.assert_allclose(new_a[0] - g0[a_name(path)][0], mean0, atol=1e-6)


# -- FlexLoRA ---------------------------------------------------------------------------------
def test_svd_factors_exact_when_rank_suffices():
    # Prepare: Delta W = sum_i p_i (alpha/r_i) B_i A_i has rank <= 1 + 2 = 3
    rng = np.random.default_rng(1)
    adapters = [random_adapter(rng, 1), random_adapter(rng, 2)]
    scales = [ALPHA / 1, ALPHA / 2]
    delta = weighted_product_sum(adapters, [3.0, 1.0], scales)["layer.q"]
    expected = 0.75 * scales[0] * adapters[0]["layer.q.lora_B.weight"] @ adapters[0]["layer.q.lora_A.weight"]
    expected += 0.25 * scales[1] * adapters[1]["layer.q.lora_B.weight"] @ adapters[1]["layer.q.lora_A.weight"]
    np.testing.assert_allclose(delta, expected, rtol=1e-12)
    for rank in (3, 4, 8):
        # Execute
        scale = ALPHA / rank
        b, a = svd_factors(delta, rank, scale)
        # Assert: shapes (m, r), (r, n) and s B A reproduces Delta W
        assert b.shape == (10, rank) and a.shape == (rank, 8)
        np.testing.assert_allclose(scale * b.astype(np.float64) @ a, delta, atol=1e-5 * np.abs(delta).max())


def test_svd_factors_is_best_low_rank_approximation():
    # Prepare: rank(Delta W) = 3 + 4 = 7 > r_i = 2
    rng = np.random.default_rng(2)
    adapters = [random_adapter(rng, 3), random_adapter(rng, 4)]
    delta = weighted_product_sum(adapters, [1.0, 1.0], [ALPHA / 3, ALPHA / 4])["layer.q"]
    sigma = np.linalg.svd(delta, compute_uv=False)
    # Execute
    scale = ALPHA / 2
    b, a = svd_factors(delta, 2, scale)
    error = delta - scale * b.astype(np.float64) @ a.astype(np.float64)
    # Assert: Eckart-Young, the error is exactly the tail of the spectrum
    assert np.linalg.norm(error, "fro") == pytest.approx(math.sqrt((sigma[2:] ** 2).sum()), rel=1e-5)
    assert np.linalg.norm(error, 2) == pytest.approx(sigma[2], rel=1e-5)
    other = random_adapter(rng, 2)  # any other rank-2 matrix does worse
    worse = delta - other["layer.q.lora_B.weight"] @ other["layer.q.lora_A.weight"]
    assert np.linalg.norm(worse, "fro") > np.linalg.norm(error, "fro")


def test_an_svd_that_gesdd_cannot_converge_on_falls_back_to_gesvd(monkeypatch):
    """numpy's gesdd stopped FlexLoRA's round 2 on a finite 576 x 576 Delta W (SVD did not
    converge; gesvd decomposes it): the fallback's factors are the same truncated SVD."""
    from fedtune.methods.base import lora_arrays

    rng = np.random.default_rng(3)
    delta = weighted_product_sum([random_adapter(rng, 3), random_adapter(rng, 4)], [1.0, 1.0], [1.0, 1.0])["layer.q"]
    want = svd_factors(delta, 2, ALPHA / 2)
    gesdd = np.linalg.svd
    monkeypatch.setattr(np.linalg, "svd", lambda *a, **k: (_ for _ in ()).throw(np.linalg.LinAlgError("no")))
    got = lora_arrays.svd_factors(delta, 2, ALPHA / 2)
    product = [(ALPHA / 2) * b.astype(np.float64) @ a.astype(np.float64) for b, a in (want, got)]
    np.testing.assert_allclose(product[1], product[0], atol=1e-6 * np.abs(delta).max())
    sigma = gesdd(delta, compute_uv=False)
    assert np.linalg.norm(delta - product[1], 2) == pytest.approx(sigma[2], rel=1e-5)


def test_flexlora_server_rebuilds_pairs_and_redistributes_svd():
    # Prepare
    ctx = RunContext(resolve_run(tiny("flexlora", PROFILES)))
    strategy = ctx.strategy()
    strategy.initialize()
    messages = strategy.configure_fit(1, [0, 1, 2])
    assert [messages[c].arrays[a_name(lora_paths(messages[c].arrays)[0])].shape[0] for c in range(3)] == RANKS
    trained, replies = fake_replies(strategy, messages, np.random.default_rng(3))
    # Execute
    strategy.aggregate_fit(1, replies)
    nxt = strategy.configure_fit(2, [0, 1, 2])
    # Assert: Delta W = sum_i p_i (alpha/r_i) B_i A_i with p = data sizes (30, 10, 20) / 60
    p = np.array([30, 10, 20]) / 60
    for path in lora_paths(trained[0]):
        expected = sum(
            p[c] * ALPHA / RANKS[c] * trained[c][b_name(path)].astype(np.float64) @ trained[c][a_name(path)]
            for c in range(3)
        )
        np.testing.assert_allclose(strategy.delta[path], expected, atol=1e-4)
        for c, r_i in enumerate(RANKS):  # each client: the best rank-r_i approximation
            b, a = nxt[c].arrays[b_name(path)], nxt[c].arrays[a_name(path)]
            assert b.shape == (32, r_i) and a.shape == (r_i, 32)
            rb, ra = svd_factors(expected, r_i, ALPHA / r_i)
            np.testing.assert_allclose(
                ALPHA / r_i * b.astype(np.float64) @ a, ALPHA / r_i * rb.astype(np.float64) @ ra, atol=1e-4
            )
    head = sum(p[c] * trained[c]["classifier.weight"] for c in range(3))
    np.testing.assert_allclose(nxt[0].arrays["classifier.weight"], head, atol=1e-5)
    # the checkpoint round trip gives the same messages
    fresh = RunContext(resolve_run(tiny("flexlora", PROFILES))).strategy()
    fresh.load_state_dict(strategy.state_dict())
    again = fresh.configure_fit(2, [0, 1, 2])
    for c in range(3):
        for k in nxt[c].arrays:
            np.testing.assert_allclose(again[c].arrays[k], nxt[c].arrays[k], atol=1e-5)


# -- FedStackLoRA -----------------------------------------------------------------------------
def test_stack_factors_product_is_weighted_sum():
    # Prepare
    rng = np.random.default_rng(4)
    adapters = [random_adapter(rng, r) for r in (1, 2, 4)]
    weights, scales = [1.0, 2.0, 5.0], [ALPHA / r for r in (1, 2, 4)]
    # Execute
    b, a = stack_factors(adapters, weights, scales)["layer.q"]
    # Assert
    assert b.shape == (10, 7) and a.shape == (7, 8)
    expected = weighted_product_sum(adapters, weights, scales)["layer.q"]
    np.testing.assert_allclose(b @ a, expected, rtol=1e-12, atol=1e-12)


def test_fedstacklora_server_stacks_and_merges_exactly():
    # Prepare
    ctx = RunContext(resolve_run(tiny("fedstacklora", PROFILES, "options.transport=stacks")))
    strategy = ctx.strategy()
    strategy.initialize()
    rng = np.random.default_rng(5)
    expected: dict[str, np.ndarray] = {}
    p = np.array([30, 10, 20]) / 60
    for rnd in (1, 2):
        messages = strategy.configure_fit(rnd, [0, 1, 2])
        replies, pairs = {}, {}
        for cid, msg in messages.items():
            r_i = msg.meta["rank"]
            assert r_i == RANKS[cid]
            update = {}
            for path in strategy.paths:  # a client's trained pair and its upload
                b, a = rng.normal(size=(32, r_i)), rng.normal(size=(r_i, 32))
                init = fresh_lora_a(a_name(path), (r_i, 32), ctx.config.seed, rnd, cid)
                update[b_name(path)], update[a_name(path)] = b.astype(np.float32), (a - init).astype(np.float32)
                pairs[cid, path] = (update[b_name(path)].astype(np.float64), init + update[a_name(path)])
            update.update({k: np.zeros_like(v) for k, v in strategy.head.items()})
            replies[cid] = Message(update, {"num_examples": [30, 10, 20][cid]})
        # Execute
        metrics = strategy.aggregate_fit(rnd, replies)
        # Assert: merged Delta W += B_stack A_stack = sum_i p_i (alpha/r_i) B_i A_i
        assert metrics["stacked_rank"] == sum(RANKS)
        for path in strategy.paths:
            expected[path] = expected.get(path, 0) + sum(
                p[c] * ALPHA / RANKS[c] * pairs[c, path][0] @ pairs[c, path][1] for c in range(3)
            )
            np.testing.assert_allclose(strategy.merged[path], expected[path], rtol=1e-5, atol=1e-5)
    # the "stacks" transport carries all past rounds: rank 2 * sum r_i; its product is the merge
    msg = strategy.configure_fit(3, [0])[0]
    path = strategy.paths[0]
    assert msg.arrays[path + STACK_B].shape == (32, 2 * sum(RANKS))
    head, deltas = split_downlink(msg.arrays)
    assert set(head) == set(strategy.head)
    np.testing.assert_allclose(deltas[path], expected[path], rtol=1e-4, atol=1e-4)
    strategy.options = strategy.options.model_copy(update={"transport": "dense"})
    dense = strategy.configure_fit(3, [0])[0]
    assert dense.arrays[path + DENSE].shape == (32, 32) and path + STACK_B not in dense.arrays


def base_weights(ws) -> dict[str, torch.Tensor]:
    """Every frozen base tensor of the shared model (not the adapters nor their head copies)."""
    return {
        n: p.detach().clone() for n, p in ws.model.named_parameters() if "lora_" not in n and "modules_to_save" not in n
    }


def test_merged_into_base_adds_then_restores_even_on_error():
    # Prepare
    ctx = RunContext(resolve_run(tiny("fedstacklora")))
    ws = ctx.workspace
    ws.activate(RANK)
    path = lora_paths(ws.state(RANK))[0]
    weight = ws.base.get_submodule(path).get_base_layer().weight
    before = base_weights(ws)
    delta = np.random.default_rng(6).normal(size=tuple(weight.shape)).astype(np.float32)
    w0 = weight.detach().clone()
    # Execute / Assert: inside, W0 + Delta W; after (even after an error), W0 bit for bit
    with pytest.raises(RuntimeError):
        with merged_into_base(ws, {path: delta}):
            torch.testing.assert_close(weight.detach(), w0 + torch.as_tensor(delta))
            raise RuntimeError("boom")
    after = base_weights(ws)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fedstacklora_client_trains_on_merged_base_and_restores_it():
    # Prepare: a server with a non-zero merged Delta W; the clients' own process
    config = tiny("fedstacklora", PROFILES)
    server = RunContext(resolve_run(config)).strategy()
    server.initialize()
    rng = np.random.default_rng(7)
    server.merged = {p: rng.normal(scale=0.5, size=(32, 32)) for p in server.paths}
    with_delta = server.configure_fit(2, [1])[1]
    server.merged = {}
    without = server.configure_fit(2, [1])[1]
    clients = RunContext(resolve_run(config))
    clients.workspace.activate(RANK)
    before = base_weights(clients.workspace)
    # Execute
    up_with = clients.client(1).fit(Message.decode(with_delta.encode()))
    up_without = clients.client(1).fit(Message.decode(without.encode()))
    # Assert: the base is restored exactly; the merged Delta W did change the training
    after = base_weights(clients.workspace)
    assert all(torch.equal(before[k], after[k]) for k in before)
    path = server.paths[0]
    assert up_with.arrays[b_name(path)].shape == (32, 4)
    assert not np.allclose(up_with.arrays[b_name(path)], up_without.arrays[b_name(path)])
    assert with_delta.nbytes > without.nbytes + 4 * 32 * 32 * len(server.paths)  # dense download accounted


# -- end to end -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["heterolora", "flexlora", "fedstacklora"])
def test_two_rounds_end_to_end_with_heterogeneous_ranks(method, tmp_path):
    # Prepare
    config = tiny(method, "federation.profile_choices.sketch_ratio=[0.25, 0.5, 1.0]", tmp_path=tmp_path)
    ranks = sorted({round(p.sketch_ratio * RANK) for p in RunContext(resolve_run(config)).profiles})
    assert len(ranks) > 1
    # Execute
    summary = run_experiment(config)
    # Assert
    assert math.isfinite(summary["final_accuracy"]) and 0.0 <= summary["final_accuracy"] <= 1.0
    assert math.isfinite(summary["final_loss"])
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    state = load_state(run_dir / "checkpoint.npz")
    assert state["rank"] == RANK
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2 and all(r["bytes_up"] > 0 for r in rounds)
    if method == "fedstacklora":  # from round 2 on, the merged base is downloaded
        assert rounds[1]["bytes_down"] > rounds[0]["bytes_down"] + 3 * 4 * 32 * 32


def test_heterolora_equals_fedit_with_uniform_ranks(tmp_path):
    # Prepare: every client at rank r, uniform weights
    common = [f"federation.profiles=[{{rank={RANK}}}]", "options.weighting=uniform"]
    # Execute
    hetero = run_experiment(tiny("heterolora", *common, "name=h", tmp_path=tmp_path))
    fedit = run_experiment(tiny("fedit", *common, "name=f", tmp_path=tmp_path))
    # Assert
    assert hetero["final_accuracy"] == fedit["final_accuracy"]
    assert hetero["final_loss"] == pytest.approx(fedit["final_loss"], rel=1e-5)
    # (bytes up differ by a few header bytes: the JSON of the measured compute_s)
    assert hetero["total_bytes_down"] == fedit["total_bytes_down"]
    h, f = load_state(tmp_path / "h" / "checkpoint.npz"), load_state(tmp_path / "f" / "checkpoint.npz")
    for k in f["global"]:
        np.testing.assert_allclose(h["global"][k], f["global"][k], atol=1e-6)


def test_state_survives_save_and_load(tmp_path):
    # Prepare: a FedStackLoRA state after one aggregated round
    ctx = RunContext(resolve_run(tiny("fedstacklora", PROFILES)))
    strategy = ctx.strategy()
    strategy.initialize()
    strategy.merged = {p: np.full((32, 32), 0.25) for p in strategy.paths}
    # Execute
    save_state(tmp_path / "s.npz", strategy.state_dict())
    other = RunContext(resolve_run(tiny("fedstacklora", PROFILES))).strategy()
    other.load_state_dict(load_state(tmp_path / "s.npz"))
    # Assert
    assert other.merged.keys() == strategy.merged.keys()
    assert all(np.array_equal(other.merged[p], strategy.merged[p]) for p in strategy.paths)


@pytest.mark.parametrize("method", ["heterolora", "flexlora", "fedstacklora"])
def test_recipe_parses(method):
    config = load_config(ROOT / "configs" / f"{method}.toml")
    assert config.method == method and config.model.lora_rank == 64
    assert config.federation.num_clients == 20
    assert config.federation.profile_choices == {"sketch_ratio": [0.125, 0.25, 0.5, 0.75]}
    RunContext(resolve_run(config))  # options validate; profiles build


# -- unfaithful variants, through the real Client.fit and Strategy.aggregate_fit ---------------
def exchange_all(strategy, clients, rnd: int, cids=(0, 1, 2), after_fit=None) -> dict[int, Message]:
    """configure_fit, each client's fit on the decoded message (``after_fit(cid)`` right after),
    decoded replies."""
    messages = strategy.configure_fit(rnd, list(cids))
    replies = {}
    for cid in cids:
        replies[cid] = Message.decode(clients.client(cid).fit(Message.decode(messages[cid].encode())).encode())
        if after_fit is not None:
            after_fit(cid)
    return replies


@pytest.mark.parametrize("scaling", ["rank", "global"])
def test_heterolora_one_sgd_step_is_the_gradient_of_the_truncated_model_at_its_scale(scaling):
    """Ranks r_i = 2, 4, 8 of r = 8, one plain-SGD step of rate gamma. Client i's model is
    W0 + s_i B[:, :r_i] A[:r_i, :] with s_i = alpha / r_i ("rank") or alpha / r ("global", alpha_i =
    alpha r_i / r); with G = dL/dW there (autograd on a dense copy), its upload is
    Delta B = -gamma s_i G A[:r_i]^T, Delta A = -gamma s_i B[:, :r_i]^T G, and the server adds
    sum_i (1/3) pad_8(Delta_i). Fails on a client that trains at a scale other than the one the
    server names (for example one that ignores ``meta["alpha"]``)."""
    from tests.lora_reference import dense_gradients

    gamma = 20.0  # a large rate: the uploaded difference of float32 arrays must resolve the step
    config = tiny("heterolora", PROFILES, f"options.scaling={scaling}", "train.optimizer=sgd", f"train.lr={gamma}")
    strategy, clients = RunContext(resolve_run(config)).strategy(), RunContext(resolve_run(config))
    strategy.initialize()
    g0 = random_global(strategy, 8)
    paths = lora_paths(g0)
    head = {k: v for k, v in strategy.global_arrays.items() if k.startswith("classifier.")}
    replies = exchange_all(strategy, clients, 1)
    moved = {k: np.zeros_like(v) for k, v in g0.items()}
    for cid, r_i in enumerate(RANKS):
        s_i = ALPHA / r_i if scaling == "rank" else ALPHA / RANK
        b_i = {p: g0[b_name(p)][:, :r_i] for p in paths}
        a_i = {p: g0[a_name(p)][:r_i] for p in paths}
        G, g_head = dense_gradients(clients, cid, 1, {p: s_i * b_i[p] @ a_i[p] for p in paths}, head)
        for p in paths:
            step_b, step_a = -gamma * s_i * G[p] @ a_i[p].T, -gamma * s_i * b_i[p].T @ G[p]
            np.testing.assert_allclose(
                replies[cid].arrays[b_name(p)], step_b, rtol=1e-3, atol=1e-3 * np.abs(step_b).max()
            )
            np.testing.assert_allclose(
                replies[cid].arrays[a_name(p)], step_a, rtol=1e-3, atol=1e-3 * np.abs(step_a).max()
            )
            moved[b_name(p)][:, :r_i] += step_b / 3
            moved[a_name(p)][:r_i] += step_a / 3
        for k in head:
            moved[k] += -gamma * g_head[k] / 3
    strategy.aggregate_fit(1, replies)
    for k, v in strategy.global_arrays.items():
        np.testing.assert_allclose(v - g0[k], moved[k], rtol=1e-3, atol=1e-3 * np.abs(moved[k]).max() + 1e-9, err_msg=k)


def test_flexlora_delta_w_is_replaced_each_round_by_the_clients_products():
    """Two real rounds: after each, Delta W = sum_i p_i (alpha/r_i) B_i A_i of the pairs the clients
    actually trained (what was sent plus the update), p_i by data size. Round 2's clients started
    from round 1's SVD, so their products already carry Delta W^1. Fails on a server that
    accumulates Delta W across rounds (Delta W^2 = Delta W^1 + sum_i ...)."""
    config = tiny("flexlora", PROFILES)
    strategy, clients = RunContext(resolve_run(config)).strategy(), RunContext(resolve_run(config))
    strategy.initialize()
    for rnd in (1, 2):
        sent = {cid: m.arrays for cid, m in strategy.configure_fit(rnd, [0, 1, 2]).items()}
        replies = exchange_all(strategy, clients, rnd)
        n = np.array([replies[c].meta["num_examples"] for c in range(3)], dtype=np.float64)
        p = n / n.sum()
        strategy.aggregate_fit(rnd, replies)
        for path in strategy.delta:
            expected = sum(
                p[c]
                * ALPHA
                / RANKS[c]
                * (sent[c][b_name(path)] + replies[c].arrays[b_name(path)]).astype(np.float64)
                @ (sent[c][a_name(path)] + replies[c].arrays[a_name(path)]).astype(np.float64)
                for c in range(3)
            )
            np.testing.assert_allclose(
                strategy.delta[path],
                expected,
                rtol=1e-5,
                atol=1e-6 * np.abs(expected).max(),
                err_msg=f"round {rnd} {path}",
            )


def test_fedstacklora_merges_the_pairs_the_clients_actually_trained():
    """Two real rounds: the merged Delta W grows each round by sum_i p_i (alpha/r_i) B_i A_i of the
    pairs left in each client's adapter after its fit (read from the client process's workspace),
    so the server's rebuild A_i = A_i^init + Delta A_i must use the initialization the client
    started from. Fails on a client whose fresh A is not the one the server regenerates (for
    example PEFT's own seeded init of the workspace adapter)."""
    config = tiny("fedstacklora", PROFILES)
    strategy, clients = RunContext(resolve_run(config)).strategy(), RunContext(resolve_run(config))
    strategy.initialize()
    expected: dict[str, np.ndarray] = {}
    for rnd in (1, 2):
        pairs = {}

        def snapshot(cid, pairs=pairs):
            pairs[cid] = clients.workspace.state(RANKS[cid])

        replies = exchange_all(strategy, clients, rnd, after_fit=snapshot)
        n = np.array([replies[c].meta["num_examples"] for c in range(3)], dtype=np.float64)
        p = n / n.sum()
        strategy.aggregate_fit(rnd, replies)
        for path in strategy.paths:
            expected[path] = expected.get(path, 0.0) + sum(
                p[c]
                * ALPHA
                / RANKS[c]
                * pairs[c][b_name(path)].astype(np.float64)
                @ pairs[c][a_name(path)].astype(np.float64)
                for c in range(3)
            )
            np.testing.assert_allclose(
                strategy.merged[path],
                expected[path],
                rtol=1e-5,
                atol=1e-6 * np.abs(expected[path]).max(),
                err_msg=f"round {rnd} {path}",
            )


# -- HetLoRA (Cho et al. 2024): sparsity-weighted module aggregation, rank self-pruning ---------
def test_hetlora_sparsity_weighted_module_aggregation_hand_computed():
    """weighting = "sparsity", aggregate = "modules": p_i = ||S_i|| / Z with ||S_i||^2 = sum over
    modules of ||(alpha/r_i) B_i A_i||_F^2 of the trained pairs, and the new global adapter is
    sum_i p_i pad_8(theta_i) (rank indices j >= r_i get nothing from client i). Fails on weights
    computed from the uploaded updates instead of the trained modules."""
    ctx = RunContext(
        resolve_run(tiny("heterolora", PROFILES, "options.weighting=sparsity", "options.aggregate=modules"))
    )
    strategy = ctx.strategy()
    strategy.initialize()
    rng = np.random.default_rng(11)
    strategy.global_arrays = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in strategy.global_arrays.items()}
    messages = strategy.configure_fit(1, [0, 1, 2])
    trained, replies = fake_replies(strategy, messages, rng)
    strategy.aggregate_fit(1, replies)
    paths = lora_paths(trained[0])
    norms = np.array(
        [
            math.sqrt(
                sum(
                    np.sum((ALPHA / RANKS[c] * trained[c][b_name(p)].astype(np.float64) @ trained[c][a_name(p)]) ** 2)
                    for p in paths
                )
            )
            for c in range(3)
        ]
    )
    p_i = norms / norms.sum()
    for k, v in strategy.global_arrays.items():
        expected = np.zeros(v.shape)
        for c in range(3):
            t = trained[c][k].astype(np.float64)
            if k.endswith("lora_A.weight"):
                expected[: t.shape[0]] += p_i[c] * t
            elif k.endswith("lora_B.weight"):
                expected[:, : t.shape[1]] += p_i[c] * t
            else:
                expected += p_i[c] * t
        np.testing.assert_allclose(v, expected, rtol=1e-5, atol=1e-6, err_msg=k)
    assert np.any(strategy.global_arrays[a_name(paths[0])][4:] != 0)  # the rank-8 client covers 4..7
    assert abs(p_i.sum() - 1) < 1e-12 and len(set(np.round(p_i, 6))) == 3


def test_hetlora_self_pruning_drops_the_tail_when_its_norm_shrinks_and_the_server_keeps_the_rank():
    """self_pruning with gamma = 0.75: a rank-8 client penalizes lambda sum ||B[:, 6:]|| ||A[6:]||.
    From a global adapter with a non-zero tail and a large lambda, the tail's norm product shrinks,
    so the client uploads ranks 0..5 only; the server records rank 6 and sends rank 6 next round.
    The penalty is what shrinks it: without it (lambda = 0) the same step leaves a larger tail.
    From PEFT's initial adapter (B = 0, tail product 0) nothing can shrink: no pruning."""
    from fedtune.methods.heterolora import tail_norm_product

    opts = [
        "federation.profiles=[{rank=8}]",
        "federation.num_clients=1",
        "options.self_pruning=true",
        "options.prune_gamma=0.75",
        "train.optimizer=sgd",
        "train.lr=0.05",
    ]
    tails = {}
    for lam in (0.0, 5.0):
        config = tiny("heterolora", *opts, f"options.prune_lambda={lam}")
        strategy, clients = RunContext(resolve_run(config)).strategy(), RunContext(resolve_run(config))
        strategy.initialize()
        fresh = strategy.configure_fit(1, [0])[0]
        reply = clients.client(0).fit(Message.decode(fresh.encode()))
        assert reply.arrays[a_name(lora_paths(reply.arrays)[0])].shape[0] == 8  # B = 0: never pruned
        rng = np.random.default_rng(12)
        strategy.global_arrays = {
            k: (0.5 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in strategy.global_arrays.items()
        }
        start = tail_norm_product(strategy.global_arrays, 6)
        replies = exchange_all(strategy, clients, 2, cids=(0,))
        tails[lam] = tail_norm_product(clients.workspace.state(8), 6)
        strategy.aggregate_fit(2, replies)
        if lam:
            assert tails[lam] < start
            assert replies[0].arrays[a_name(lora_paths(replies[0].arrays)[0])].shape[0] == 6
            assert strategy.pruned == {0: 6}
            assert strategy.configure_fit(3, [0])[0].meta["rank"] == 6
            fresh = RunContext(resolve_run(config)).strategy()
            fresh.load_state_dict(strategy.state_dict())
            assert fresh.client_rank(0) == 6
    assert tails[5.0] < tails[0.0]
