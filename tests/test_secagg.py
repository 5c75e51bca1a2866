"""Secure aggregation on Flower (fedtune.engines.flower.secagg): Flower's own secaggplus_mod on the
ClientApp, fedtune's SecAgg+ server stages. The server's aggregate is the exact weighted sum of the
clients' updates within the stated quantization error, it never sees an update, a dropped client's
masks are removed, local DP composes with it, and what cannot run refuses in one line.

Fast tests drive the real apps through the in-process Grid of tests/test_flower.py (the clients
record the updates they hand to the mod, so the exact sum is known); one test runs Flower's
simulation runtime (Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError, load_config
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.serverapp import serve
from fedtune.methods.base.averaging import BroadcastAverage, UpdateClient
from fedtune.run import run_experiment
from fedtune.runtime import resolve_run
from tests.conftest import TINY, tiny
from tests.test_flower import LoopbackGrid, client_1_fails_in_round_2, task_identity  # noqa: F401 - fixtures

KIND = "text-classification"
C, T = 0.5, 2**24  # quantization step 2C/T = 6e-8
SECURE = [
    "secure_aggregation.enabled=true",
    f"secure_aggregation.clipping_range={C}",
    f"secure_aggregation.quantization_range={T}",
]
ON_SIM = [*SECURE, 'engine="flower-sim"']  # SecAgg+ on the Flower simulation
ALL_THREE = ["federation.clients_per_round=3"]  # 3 of 3 sampled: 3 shares, threshold 2 (one may drop)


def _config(tmp_path: Path, *extra: str):
    return tiny(tmp_path, "fedit", KIND, *ALL_THREE, "seed=4", *extra)


@pytest.fixture
def seen(monkeypatch):
    """What the clients hand to the upload (before the mod masks it) and what the server's
    secure aggregation receives and does: {"updates": {(round, cid): (arrays, num_examples)},
    "sums": [(round, replies, total)], "steps": [the global arrays' change]}."""
    out = {"updates": {}, "sums": [], "steps": []}
    upload, secure = UpdateClient.upload, BroadcastAverage.aggregate_secure_fit

    def recording_upload(self, update, result, rnd=None, **meta):
        reply = upload(self, update, result, rnd=rnd, **meta)
        out["updates"][rnd, self.cid] = (dict(reply.arrays), result.num_examples)
        return reply

    def recording_secure(self, rnd, replies, total):
        before = {k: v.copy() for k, v in self.global_arrays.items()}
        out["sums"].append((rnd, dict(replies), total))
        metrics = secure(self, rnd, replies, total)
        out["steps"].append({k: self.global_arrays[k].astype(np.float64) - before[k] for k in before})
        return metrics

    monkeypatch.setattr(UpdateClient, "upload", recording_upload)
    monkeypatch.setattr(BroadcastAverage, "aggregate_secure_fit", recording_secure)
    return out


def _assert_exact_sums(seen: dict, config, weighted: bool = True) -> None:
    """Each round's secure sum is sum_i w_i Delta_i of the clients it names, coordinate by
    coordinate within its stated error k (2C/T) W, and that error is far below what a dropped
    client or a mistaken weight would change; the replies the strategy saw hold no arrays."""
    assert seen["sums"]
    for rnd, replies, total in seen["sums"]:
        assert all(m.arrays == {} for m in replies.values()) and sorted(replies) == total.clients
        claimed = {cid: (seen["updates"][rnd, cid][1] if weighted else 1) for cid in total.clients}
        W = max(_partition_sizes(config)) if weighted else 1  # the round's largest weight (all sampled)
        weights = {cid: round(n * T / W) * W / T for cid, n in claimed.items()}  # the mod quantizes w_i / W too
        assert total.weight == pytest.approx(sum(weights.values()), rel=1e-12)
        assert all(abs(weights[c] - claimed[c]) <= W / T for c in claimed)
        assert total.error == pytest.approx(len(total.clients) * 2 * C / T * W)
        deviation = 0.0
        for name, value in total.arrays.items():
            exact = sum(weights[c] * seen["updates"][rnd, c][0][name].astype(np.float64) for c in total.clients)
            assert np.max(np.abs(value - exact)) <= total.error, name
            deviation = max(deviation, np.max(np.abs(value - exact)))
        assert deviation > 0  # quantized: not the plain sum passed through
        # the bound is tight enough: leaving out any client moves some coordinate by more
        assert all(
            max(np.max(np.abs(weights[c] * seen["updates"][rnd, c][0][n])) for n in total.arrays) > 20 * total.error
            for c in total.clients
        )


@pytest.mark.usefixtures("task_identity")
def test_secure_sum_is_the_weighted_sum_within_the_quantization_error(tmp_path, seen):
    """FedIT (FedAvg weights: the clients' num_examples) over Flower's apps with SecAgg+: the
    server's sum is sum_i n_i Delta_i within k (2C/T) max n_i, the new global adapter is the
    plain run's theta + sum_i n_i Delta_i / sum_i n_i within error / sum n_i, and each client's
    upload bytes are its reply's metadata plus the SecAgg+ payload (the masked int64 vector:
    at least 8 bytes per coordinate; its float32 update never crossed)."""
    config = _config(tmp_path / "secure", *SECURE, "rounds=1", 'engine="flower-sim"')
    summary = serve(LoopbackGrid(make_client_app(config), 3), config, timeout=60)
    _assert_exact_sums(seen, config)
    ((_, _, total),) = seen["sums"]

    plain = run_experiment(_config(tmp_path / "plain", "rounds=1"))
    got = load_state(Path(summary["run_dir"]) / "checkpoint.npz")["global"]
    want = load_state(Path(plain["run_dir"]) / "checkpoint.npz")["global"]
    for name in want:
        assert np.max(np.abs(got[name] - want[name])) <= total.error / total.weight + 1e-6, name

    (line,) = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    (plain_line,) = [json.loads(x) for x in (Path(plain["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    coordinates = sum(np.size(v) for v in want.values())
    for cid in map(str, range(3)):
        assert line["client_bytes_up"][cid] >= 8 * (coordinates + 1)  # the masked int64 vector and its weight
        assert line["client_bytes_down"][cid] > plain_line["client_bytes_down"][cid]  # the request, keys, shares


@pytest.mark.usefixtures("task_identity", "client_1_fails_in_round_2")
def test_a_client_lost_after_sharing_its_keys_has_its_masks_removed(tmp_path, seen):
    """Client 1 shares its keys in round 2 and then fails to train: the server rebuilds its
    pairwise masks from its key's shares and the sum is exactly that of clients 0 and 2."""
    config = _config(tmp_path, *SECURE, 'engine="flower-sim"')
    summary = serve(LoopbackGrid(make_client_app(config), 3), config, timeout=60)
    _assert_exact_sums(seen, config)
    assert [t.clients for _, _, t in seen["sums"]] == [[0, 1, 2], [0, 2]]
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert "out of memory on purpose" in lines[1]["dropped"]["1"]


@pytest.mark.parametrize(
    ("stage", "corrupt", "reason"),
    [
        ("setup", {"pk1": 7}, "setup: malformed reply (TypeError"),
        ("collect_masked_vectors", {"masked_params": [b"junk"]}, "collect: malformed reply (ValueError"),
    ],
)
@pytest.mark.usefixtures("task_identity")
def test_a_malformed_secagg_reply_is_that_clients_drop(tmp_path, seen, stage, corrupt, reason):
    """Client 2's SecAgg+ reply is malformed (a public key that is no bytes; a masked vector that
    is no array): client 2 is dropped with the reason, never a crash, and the sum is exactly that
    of clients 0 and 1 (after its keys were shared, its masks are rebuilt and removed)."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    config = _config(tmp_path, *SECURE, "rounds=1", 'engine="flower-sim"')
    app = make_client_app(config)

    def hostile(message, context):
        record = message.content.config_records.get(RECORD_KEY_CONFIGS)
        at = record.get("stage") if record is not None else None
        reply = app(message, context)
        if at == stage and context.node_config["partition-id"] == 2:
            reply.content.config_records[RECORD_KEY_CONFIGS].update(corrupt)
        return reply

    summary = serve(LoopbackGrid(hostile, 3), config, timeout=60)
    _assert_exact_sums(seen, config)
    assert [t.clients for _, _, t in seen["sums"]] == [[0, 1]]
    (line,) = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert line["dropped"]["2"].startswith(reason)


@pytest.mark.usefixtures("task_identity", "client_1_fails_in_round_2")
def test_local_dp_with_secure_aggregation_divides_the_noised_sum_by_m(tmp_path, seen):
    """privacy.mode = "local" + SecAgg+: each client clips and noises, masks with weight 1; the
    server adds the masked sum over the fixed m = 3 (DP-FedAvg), also in round 2 where client 1
    fails after sharing its keys (2 summed, still / 3); epsilon and its record as the embedded
    run's (the same releases)."""
    dp = ['privacy.mode="local"', "privacy.clip=0.05", "privacy.noise_multiplier=0.01"]
    config = _config(tmp_path / "secure", *SECURE, *dp, 'engine="flower-sim"')
    summary = serve(LoopbackGrid(make_client_app(config), 3), config, timeout=60)
    _assert_exact_sums(seen, config, weighted=False)
    assert [t.clients for _, _, t in seen["sums"]] == [[0, 1, 2], [0, 2]]
    for (_, _, total), step in zip(seen["sums"], seen["steps"], strict=True):
        for name, value in total.arrays.items():
            np.testing.assert_allclose(step[name], value / 3, rtol=1e-5, atol=1e-7, err_msg=name)
    plain = run_experiment(_config(tmp_path / "plain", *dp))
    assert summary["privacy"] == plain["privacy"]


def test_secure_aggregation_on_the_flower_simulation_matches_plain_aggregation(tmp_path):
    """The acceptance run on Flower's simulation runtime (Ray, one virtual SuperNode per client,
    the mod in each ClientApp): FedIT's adapter after one round of SecAgg+ is the embedded plain
    run's within the quantization error over the weights, error / sum n_i; the error is far below
    the round's change (a dropped client or a missing division would be outside)."""
    ray = pytest.importorskip("ray")
    from fedtune.engines.flower.simulation import run_flower_simulation

    plain = run_experiment(_config(tmp_path / "plain", "rounds=1"))
    secure = run_flower_simulation(
        _config(tmp_path / "secure", *SECURE, "rounds=1", 'engine="flower-sim"'), timeout=600
    )
    assert not ray.is_initialized()
    got = load_state(Path(secure["run_dir"]) / "checkpoint.npz")["global"]
    want = load_state(Path(plain["run_dir"]) / "checkpoint.npz")["global"]
    config = _config(tmp_path)
    sizes = _partition_sizes(config)  # every client trains on its whole partition: n_i
    bound = 3 * 2 * C / T * max(sizes) / sum(sizes)
    diffs = [np.max(np.abs(got[k] - want[k])) for k in want]
    assert max(diffs) <= bound + 1e-6 and max(diffs) > 0
    moved = max(np.max(np.abs(want[k] - _initial(config)[k])) for k in want)
    assert moved > 50 * bound


def _partition_sizes(config) -> list[int]:
    from fedtune.runtime import RunContext

    context = RunContext(resolve_run(config))
    return [context.example_bound("train", cid) for cid in range(config.federation.num_clients)]


def _initial(config) -> dict:
    from fedtune.runtime import RunContext

    strategy = RunContext(resolve_run(config)).strategy()
    strategy.initialize()
    return strategy.global_arrays


def test_a_method_that_needs_each_update_refuses_secure_aggregation_in_one_line(tmp_path):
    for method in ("flexlora", "fedstacklora"):
        with pytest.raises(ConfigError) as err:
            resolve_run(tiny(tmp_path, method, KIND, *SECURE, 'engine="flower-sim"'))
        assert str(err.value).startswith(f"secure_aggregation.enabled: method '{method}' does not support it")
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([*SECURE], 'secure_aggregation.enabled: runs on engine = "flower-sim" or "flower"'),
        (["secure_aggregation.threshold=2"], "secure_aggregation.threshold: applies to secure_aggregation.enabled"),
        ([*ON_SIM, "federation.clients_per_round=1"], "secure_aggregation.enabled: needs at least 2"),
        (
            [*ON_SIM, "secure_aggregation.quantization_range=2147483648"],
            "secure_aggregation.quantization_range: 4 clients",
        ),
        (
            [*ON_SIM, "secure_aggregation.modulus_range=3000000000"],
            "secure_aggregation.modulus_range: expected a power of 2",
        ),
        ([*ON_SIM, "secure_aggregation.threshold=5"], "secure_aggregation.threshold: expected 2..num_shares = 4"),
        ([*ON_SIM, "secure_aggregation.num_shares=5"], "secure_aggregation.num_shares: expected at most the 4"),
        ([*ON_SIM, "federation.upload_topk=0.1"], "federation.upload_topk: not with secure_aggregation.enabled"),
        (
            [*ON_SIM, 'robust.aggregation="median"'],
            "robust.aggregation: not with secure_aggregation.enabled",
        ),
        (
            [*SECURE, 'engine="flower"', "placement.nodes=2"],
            "placement.nodes: secure aggregation needs one client per node",
        ),
        (
            [*ON_SIM, 'privacy.mode="central"', "privacy.clip=1", "privacy.noise_multiplier=1"]
            + ["privacy.adaptive_clip=true"],
            "privacy.adaptive_clip: not with secure_aggregation.enabled",
        ),
    ],
)
def test_bad_secure_aggregation_options_stop_with_one_line(tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        resolve_run(load_config(None, [*TINY, "method=fedit", f"output_dir={tmp_path}", *extra]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
