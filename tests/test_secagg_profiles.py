"""The privacy paths with mixed per-client profiles (regression matrix for a report, not reproduced,
of SecAgg+ with FSLoRA and mixed sketch ratios failing a reply on "dtype float64 where float32 was
expected"): FSLoRA (sketch ratios 1, 0.5, 0.25) and HeteroLoRA (ranks 4, 2, 1) x secure
aggregation off (embedded engine) / on (SecAgg+ over Flower's apps on the in-process Grid of
tests/test_flower.py) x ``privacy.mode`` none / central / local, and the same with the planner
choosing the profiles from device classes. Each run: every sampled client's update reaches the
aggregate in both rounds (none dropped; under SecAgg+ the sum is every client's), the global
adapter keeps the model's float32 and is finite, and it moved."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.serverapp import serve
from fedtune.methods import get_method
from fedtune.methods.base.privacy import mechanism
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from tests.test_flower import LoopbackGrid, task_identity  # noqa: F401 - fixture
from tests.test_secagg_methods import _initial

SAME_NOISE = "privacy.insecure_reproducible_noise=true"  # tests only: no accountant run
DP = {
    "none": (),
    "central": ('privacy.mode="central"', "privacy.clip=0.05", "privacy.noise_multiplier=0.5", SAME_NOISE),
    "local": ('privacy.mode="local"', "privacy.clip=0.05", "privacy.noise_multiplier=0.5", SAME_NOISE),
}
PROFILES = {
    "fslora": "federation.profiles=[{sketch_ratio=1.0},{sketch_ratio=0.5},{sketch_ratio=0.25}]",
    "heterolora": "federation.profiles=[{rank=4},{rank=2},{rank=1}]",
}
#: an upload budget the planner meets with a smaller rank / sketch (SecAgg+: no upload codec) or the codec
PLANNED = (
    'federation.device_classes=[{name="small", share=0.4, bandwidth_mb=0.002}, {name="big", share=0.6}]',
    "seed=4",
)
SECURE = ("secure_aggregation.enabled=true", 'engine="flower-sim"')
#: 3 clients, all sampled (under DP: Poisson rate 1), 2 rounds
SMALL = ("model.lora_rank=4", "federation.num_clients=3", "federation.clients_per_round=3")


def _aggregated(monkeypatch, method: str) -> list[list[int]]:
    """The clients whose updates each round's aggregation summed, recorded as the strategy sees them."""
    strategy, seen = get_method(method).strategy, []
    plain, secure = strategy.aggregate_fit, strategy.aggregate_secure_fit

    def plain_fit(self, rnd, replies):
        seen.append(sorted(replies))
        return plain(self, rnd, replies)

    def secure_fit(self, rnd, replies, total):
        seen.append(total.clients)
        return secure(self, rnd, replies, total)

    monkeypatch.setattr(strategy, "aggregate_fit", plain_fit)
    monkeypatch.setattr(strategy, "aggregate_secure_fit", secure_fit)
    return seen


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("profiles", ["stated", "planned"])
@pytest.mark.parametrize("dp", list(DP))
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secagg"])
@pytest.mark.parametrize("method", list(PROFILES))
def test_mixed_profiles_aggregate_every_client_under_each_privacy_path(
    tiny_config, monkeypatch, method, secure, dp, profiles
):
    chosen = (PROFILES[method],) if profiles == "stated" else PLANNED
    config = tiny_config(f"method={method}", *SMALL, *chosen, *DP[dp], *(SECURE if secure else ()))
    seen = _aggregated(monkeypatch, method)
    summary = serve(LoopbackGrid(make_client_app(config), 3), config, timeout=60) if secure else run_experiment(config)
    assert seen == [[0, 1, 2], [0, 1, 2]]
    if profiles == "planned":  # the planner gave the small client a smaller rank / sketch than the others
        plan = json.loads((Path(summary["run_dir"]) / "plan.json").read_text())["clients"]
        assert len({c["setting"] for c in plan}) > 1 and not any(c["excluded"] for c in plan), plan
    state = load_state(Path(summary["run_dir"]) / "checkpoint.npz")["global"]
    initial = _initial(config)
    assert {str(v.dtype) for v in state.values()} == {"float32"}
    assert all(np.isfinite(v).all() for v in state.values())
    assert max(float(np.max(np.abs(state[k] - initial[k]))) for k in initial) > 0
    if dp != "none":
        assert (
            summary["privacy"]["mode"] == {"central": "central+secagg" if secure else "central", "local": "local"}[dp]
        )


@pytest.mark.usefixtures("task_identity")
def test_a_poisson_sample_below_the_configured_threshold_is_still_summed(tiny_config, monkeypatch):
    """Under DP the round's clients are a Poisson sample (here 2 of 5 at rate 4/5, seed 2): the
    default threshold is a majority of that round's shares (2), not of the expected sample's (3),
    which no 2-client round reaches (each client's setup failed, the round released noise alone)."""
    config = tiny_config(
        "method=fedit",
        "federation.num_clients=5",
        "federation.clients_per_round=4",
        "rounds=1",
        "seed=2",
        *SECURE,
        *DP["central"],
    )
    assert mechanism(config).sample(1) == [1, 4]
    seen = _aggregated(monkeypatch, "fedit")
    serve(LoopbackGrid(make_client_app(config), 5), config, timeout=60)
    assert seen == [[1, 4]]


@pytest.mark.usefixtures("task_identity")
def test_a_poisson_sample_above_the_expected_one_does_not_wrap_the_secure_sum(tiny_config, monkeypatch):
    """The config keeps m T below M for the expected m = 2; under DP the round's Poisson sample
    (seed 10: 4 of 5 at rate 2/5) is larger, and 4 T summed wrapped around M (the sum off by 2.0,
    its stated error 7.6e-6): the round quantizes with a T that its 4 clients keep below M."""
    T, M = 2**19 - 1, 2**20
    config = tiny_config(
        "method=fedit",
        "federation.num_clients=5",
        "federation.clients_per_round=2",
        "rounds=1",
        "seed=10",
        *SECURE,
        "secure_aggregation.clipping_range=0.5",
        f"secure_aggregation.quantization_range={T}",
        f"secure_aggregation.modulus_range={M}",
        *DP["central"],
    )
    assert mechanism(config).sample(1) == [0, 1, 2, 3]
    vectors, sums = {}, []
    secure_reply, secure_fit = Client.secure_reply, get_method("fedit").strategy.aggregate_secure_fit

    def recording_reply(self, message, reply):
        vectors[self.cid] = secure_reply(self, message, reply).arrays
        return Message(vectors[self.cid], reply.meta)

    def recording_fit(self, rnd, replies, total):
        sums.append(total)
        return secure_fit(self, rnd, replies, total)

    monkeypatch.setattr(Client, "secure_reply", recording_reply)
    monkeypatch.setattr(get_method("fedit").strategy, "aggregate_secure_fit", recording_fit)
    serve(LoopbackGrid(make_client_app(config), 5), config, timeout=60)
    (total,) = sums
    assert total.clients == [0, 1, 2, 3] and total.error == pytest.approx(4 * 2 * 0.5 / ((M - 1) // 4))
    for name, value in total.arrays.items():
        exact = sum(vectors[c][name].astype(np.float64) for c in total.clients)
        assert np.max(np.abs(value - exact)) <= total.error, name


@pytest.mark.usefixtures("task_identity")
def test_a_private_secure_round_left_with_one_client_after_the_plan_excludes_asks_none(tiny_config, monkeypatch):
    """Seed 4 samples clients 0 and 3 under DP; the plan excludes client 0 (no setting fits its
    memory). One client's masked sum is its update in the clear, so the round asks neither
    (noise alone): the two-client rule counts the clients left after the plan's exclusions."""
    config = tiny_config(
        "method=fedit",
        "federation.num_clients=4",
        "federation.clients_per_round=2",
        "rounds=1",
        "seed=4",
        "federation.profiles=[{memory_gib=1e-6},{},{},{}]",
        *SECURE,
        *DP["central"],
    )
    assert mechanism(config).sample(1) == [0, 3]
    strategy, asked = get_method("fedit").strategy, []
    configure = strategy.configure_fit
    monkeypatch.setattr(
        strategy, "configure_fit", lambda self, rnd, clients: asked.append(clients) or configure(self, rnd, clients)
    )
    summary = serve(LoopbackGrid(make_client_app(config), 4), config, timeout=60)
    plan = json.loads((Path(summary["run_dir"]) / "plan.json").read_text())["clients"]
    assert [bool(c["excluded"]) for c in plan] == [True, False, False, False]
    assert asked == [[]]
