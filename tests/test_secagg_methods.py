"""Secure aggregation (SecAgg+ on Flower, fedtune.engines.flower.secagg) for every method whose
server step is a weighted sum (fedtune.methods.base.aggregation.Aggregation.secure_sum): HeteroLoRA's
zero-padded mean (its updates or its modules; with ``padding = "coverage"`` the per-rank coverage
weights summed securely beside them), FSLoRA's eq. (5) over the clients' scattered uploads,
FedPETuning's and the proxy methods' (FedOT, FedPFT without its alignment) FedAvg, with local DP
and with central DP (clients clip, the server noises the secure sum) where the method has it. For
each: the server's secure sum is sum_i w_i v_i of the vectors the
clients masked, within its stated quantization error, and the global state after the round is the
plain (embedded) run's within that error over the weights. Methods and options whose aggregation
needs each update refuse in one line.

Through Flower's ServerApp and ClientApps on the in-process Grid of tests/test_flower.py (the Ray
runtime's SecAgg+ run is tests/test_secagg.py's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError, load_config
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.serverapp import serve
from fedtune.methods import get_method
from fedtune.methods.base.privacy import quantization_margin
from fedtune.protocol.client import Client
from fedtune.protocol.strategy import SECURE_WEIGHT
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import METHOD_TINY, TINY
from tests.test_flower import LoopbackGrid, task_identity  # noqa: F401 - fixture

C, T = 0.5, 2**24  # quantization step 2C/T = 6e-8
SECURE = [
    "secure_aggregation.enabled=true",
    f"secure_aggregation.clipping_range={C}",
    f"secure_aggregation.quantization_range={T}",
    'engine="flower-sim"',
]
SAME_NOISE = "privacy.insecure_reproducible_noise=true"  # tests only: the secure and plain runs draw alike
LOCAL_DP = ['privacy.mode="local"', "privacy.clip=0.05", "privacy.noise_multiplier=0.01", SAME_NOISE]
#: central DP under SecAgg+: each client clips before masking, the server noises the secure sum
CENTRAL_DP = ['privacy.mode="central"', "privacy.clip=0.05", "privacy.noise_multiplier=0.01", SAME_NOISE]
#: 3 clients, all sampled; global rank r = 4; HeteroLoRA's r_i = 4, 2, 1 (rank indices 0..3 covered
#: by 3, 2, 1, 1 clients); FSLoRA's k_i = 4, 2, 1
PROFILES = {
    "heterolora": "federation.profiles=[{rank=4},{rank=2},{rank=1}]",
    "fslora": "federation.profiles=[{sketch_ratio=1.0},{sketch_ratio=0.5},{sketch_ratio=0.25}]",
}
CASES = {
    "heterolora": ("heterolora",),
    "heterolora-coverage": ("heterolora", 'options.padding="coverage"'),
    "heterolora-modules-coverage": ("heterolora", 'options.aggregate="modules"', 'options.padding="coverage"'),
    "heterolora-local-dp": ("heterolora", *LOCAL_DP),
    "heterolora-central-dp": ("heterolora", *CENTRAL_DP),
    "fslora-central-dp": ("fslora", *CENTRAL_DP),
    "fslora": ("fslora",),
    "fedpetuning": ("fedpetuning",),
    "fedot": ("fedot",),
    "fedpft": ("fedpft", "options.distill_during=false"),
}


def _config(tmp_path: Path, method: str, *extra: str):
    return load_config(
        None,
        [
            *TINY,
            f"method={method}",
            "model.lora_rank=4",
            "federation.num_clients=3",
            "federation.clients_per_round=3",
            "rounds=1",
            "seed=5",
            *([PROFILES[method]] if method in PROFILES else []),
            *METHOD_TINY.get(method, ()),
            f"output_dir={tmp_path}",
            *extra,
        ],
    )


@pytest.fixture
def seen(monkeypatch):
    """What the clients hand to the SecAgg+ mod, {(round, cid): (v_i, w_i)} (w_i: the weight the
    request asked for, before the mod quantizes it), and what the strategies' secure aggregation
    receives, [(round, SecureSum)]."""
    out = {"vectors": {}, "sums": []}
    secure_reply = Client.secure_reply

    def recording_reply(self, message, reply):
        vector = secure_reply(self, message, reply)
        weight = reply.meta["num_examples"] if message.meta[SECURE_WEIGHT] == "examples" else 1
        out["vectors"][int(message.meta["round"]), self.cid] = (dict(vector.arrays), float(weight))
        return vector

    monkeypatch.setattr(Client, "secure_reply", recording_reply)
    out["patch"] = monkeypatch
    return out


def _record_sums(seen: dict, method: str) -> None:
    strategy = get_method(method).strategy
    secure = strategy.aggregate_secure_fit

    def recording(self, rnd, replies, total):
        assert all(m.arrays == {} for m in replies.values())  # the strategy never sees an update
        seen["sums"].append((rnd, total))
        return secure(self, rnd, replies, total)

    seen["patch"].setattr(strategy, "aggregate_secure_fit", recording)


def _global(summary: dict) -> dict[str, np.ndarray]:
    return load_state(Path(summary["run_dir"]) / "checkpoint.npz")["global"]


def _initial(config) -> dict[str, np.ndarray]:
    strategy = RunContext(resolve_run(config)).strategy()
    strategy.initialize()
    return {k: np.array(v) for k, v in strategy.global_arrays.items()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("task_identity")
def test_secure_aggregation_gives_the_plain_aggregate_within_the_quantization_error(tmp_path, seen, case):
    """(1) The secure sum is sum_i w_i v_i of the vectors the clients masked, coordinate by
    coordinate within its stated error k (2C/T) W (w_i as the mod quantizes it); (2) the global
    state after the round is the plain run's (the method's own aggregate_fit on the clients'
    updates) within error / (smallest denominator) -- under central DP also SecAgg+'s clip margin mu
    (the secure run's clients clip to C - mu, the plain run's server to C) -- with ``padding = "coverage"`` also the
    coverage weights' error, E/C, over it; (3) that bound is far below the round's change, so a
    wrong divisor, a lost padding weight or a misplaced rank would be outside."""
    method, *extra = CASES[case]
    _record_sums(seen, method)
    config = _config(tmp_path / "secure", method, *SECURE, *extra)
    summary = serve(LoopbackGrid(make_client_app(config), 3), config, timeout=60)
    ((rnd, total),) = seen["sums"]
    assert total.clients == [0, 1, 2]

    # (1) the sum of what the clients masked
    W = max(w for _, w in seen["vectors"].values())
    weights = {cid: round(w * T / W) * W / T for (_, cid), (_, w) in seen["vectors"].items()}
    assert total.weight == pytest.approx(sum(weights.values()), rel=1e-12)
    assert total.error == pytest.approx(3 * 2 * C / T * W)
    deviation = 0.0
    for name, value in total.arrays.items():
        exact = sum(weights[c] * seen["vectors"][rnd, c][0][name].astype(np.float64) for c in weights)
        assert np.max(np.abs(value - exact)) <= total.error, name
        deviation = max(deviation, float(np.max(np.abs(value - exact))))
    assert deviation > 0  # quantized: not the plain sum passed through
    if 'privacy.mode="central"' in extra:  # the trusted-for-noise server gets only clipped vectors
        for vector, _ in seen["vectors"].values():
            assert np.sqrt(sum(np.sum(np.square(v, dtype=np.float64)) for v in vector.values())) <= 0.05 * (1 + 1e-5)

    # (2) the plain run's global state
    want = _global(run_experiment(_config(tmp_path / "plain", method, *extra)))
    got = _global(summary)
    denominator = 3 if "privacy.mode" in " ".join(extra) else total.weight  # local DP: the fixed m
    bound = total.error / denominator
    if 'privacy.mode="central"' in extra:  # the secure run's clients clip to C - mu (SecAgg+'s margin), the plain to C
        step = config.secure_aggregation.step(config.federation.num_clients)
        bound += quantization_margin(step, sum(np.size(v) for v in want.values()), 0.05)
    if 'options.padding="coverage"' in extra:  # rank index 3 is covered by one client of weight 1
        biggest = max(float(np.max(np.abs(v))) for v in want.values())
        bound = (total.error + biggest * total.error / C) / (1 - total.error / C)
    diffs = {k: float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) for k in want}
    assert max(diffs.values()) <= bound + 1e-6, diffs

    # (3) the bound separates: the round moved the global state by far more
    initial = _initial(_config(tmp_path / "initial", method, *extra))
    moved = max(float(np.max(np.abs(want[k].astype(np.float64) - initial[k]))) for k in want)
    assert moved > 50 * (bound + 1e-6)


def test_heterolora_coverage_sums_each_rank_indexs_weight(tmp_path, seen, task_identity):  # noqa: F811
    """``padding = "coverage"``: the coverage entries of the sum are C sum_i w_i 1[j < r_i] (uniform
    weights, r_i = 4, 2, 1: C x (3, 2, 1, 1)), computed here from the profiles alone."""
    _record_sums(seen, "heterolora")
    config = _config(tmp_path, "heterolora", *SECURE, 'options.padding="coverage"')
    serve(LoopbackGrid(make_client_app(config), 3), config, timeout=60)
    ((_, total),) = seen["sums"]
    np.testing.assert_allclose(total.arrays["secure/covered"], C * np.array([3, 2, 1, 1]), atol=total.error)


@pytest.mark.parametrize(
    ("method", "extra", "message"),
    [
        ("flexlora", (), "secure_aggregation.enabled: method 'flexlora' does not support it"),
        ("fedstacklora", (), "secure_aggregation.enabled: method 'fedstacklora' does not support it"),
        ("local", (), "secure_aggregation.enabled: method 'local' does not support it"),
        (
            "heterolora",
            ('options.weighting="sparsity"',),
            "options.weighting: 'sparsity' is not with secure_aggregation.enabled",
        ),
        ("heterolora", ("options.self_pruning=true",), "options.self_pruning: not with secure_aggregation.enabled"),
        ("fedpft", (), "options.distill_during: not with secure_aggregation.enabled"),
    ],
)
def test_an_aggregation_that_needs_each_update_refuses_secure_aggregation_in_one_line(tmp_path, method, extra, message):
    with pytest.raises(ConfigError) as err:
        resolve_run(_config(tmp_path, method, *SECURE, *extra))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
