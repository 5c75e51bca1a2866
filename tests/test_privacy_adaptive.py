"""Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021; privacy.adaptive_clip):
through the real aggregate_fit, C moves by exp(-eta (b - gamma)) with b the noised fraction of
unclipped updates, the update noise is z_Delta C with z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2, the
accountant's epsilon is central DP's at z, C converges to the target quantile of the norms, and C
is in the checkpoint (resume) and on every round's line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedtune.config import load_config
from fedtune.methods.base.privacy import COUNT, NOISE, generator, mechanism
from fedtune.protocol.messages import Message
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY

C0, Z = 0.5, 1.0
ADAPTIVE = [
    'privacy.mode="central"',
    f"privacy.clip={C0}",
    f"privacy.noise_multiplier={Z}",
    "privacy.adaptive_clip=true",
]


def _config(tmp_path, *extra):
    return load_config(None, [*TINY, f"output_dir={tmp_path}", "federation.clients_per_round=4", *ADAPTIVE, *extra])


def _scaled(like, norm, seed):
    rng = np.random.default_rng(seed)
    u = {k: rng.normal(size=v.shape) for k, v in like.items()}
    total = math.sqrt(sum(float(np.sum(v * v)) for v in u.values()))
    return {k: (v * norm / total).astype(np.float32) for k, v in u.items()}


def test_one_round_moves_the_clip_by_the_noised_unclipped_fraction_and_noises_with_z_delta(tmp_path):
    """Updates of norms 0.1, 0.2 (unclipped at C = 0.5) and 5.0 (clipped): b = (2 - 3/2 + xi_b) / 4
    + 1/2 with xi_b ~ N(0, sigma_b^2), sigma_b = 1.5; C' = C exp(-0.3 (b - 0.5)). The state
    moves by (sum clip_C(u_i) + xi) / m, xi ~ N(0, (z_Delta C)^2). Fails with the plain z on the
    update (the pair would cost more than z), with the count over the replies instead of m, with
    the new C used to clip this round's updates, or with an arithmetic update of C."""
    config = _config(tmp_path, "privacy.clipped_count_stddev=1.5", "privacy.clip_learning_rate=0.3")
    strategy = RunContext(resolve_run(config)).strategy()
    strategy.initialize()
    before = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    updates = [_scaled(before, n, s) for s, n in enumerate((0.1, 0.2, 5.0))]
    replies = {cid: Message(u, {"num_examples": 1}) for cid, u in enumerate(updates)}
    strategy.configure_fit(1, [0, 1, 2, 3])
    metrics = strategy.aggregate_fit(1, replies)
    p = strategy.aggregation.privacy
    z_delta = (Z**-2 - (2 * 1.5) ** -2) ** -0.5
    assert p.z_update == pytest.approx(z_delta)
    xi_b = generator(p.secret, COUNT, 1).normal(0.0, 1.5)
    b = (2 - 3 / 2 + xi_b) / 4 + 0.5
    assert p.C == pytest.approx(C0 * math.exp(-0.3 * (b - 0.5)), rel=1e-12) and metrics["clip"] == p.C
    rng = generator(p.secret, NOISE, 1)
    noise = {k: rng.normal(0, z_delta * C0, before[k].shape) for k in sorted(before)}
    big = updates[2]
    for k in before:
        clipped = big[k].astype(np.float64) * (C0 / 5.0)
        expected = before[k] + (updates[0][k] + updates[1][k] + clipped + noise[k]) / 4
        np.testing.assert_allclose(strategy.global_arrays[k], expected, rtol=1e-5, atol=1e-6)
    assert metrics["epsilon"] == pytest.approx(mechanism(_config(tmp_path)).epsilon(1))


def test_the_accountant_charges_the_pair_of_queries_as_one_gaussian_of_multiplier_z(tmp_path):
    adaptive = mechanism(_config(tmp_path))
    plain = mechanism(load_config(None, [*TINY, "federation.clients_per_round=4", *ADAPTIVE[:3]]))
    assert adaptive.epsilon(7) == plain.epsilon(7) and adaptive.z == plain.z == Z
    assert 1 / adaptive.z_update**2 + 1 / (2 * adaptive.sigma_b) ** 2 == pytest.approx(1 / Z**2)
    assert adaptive.sigma_b == Z  # the default max(m/20, z) at m = 4


def test_the_clip_converges_to_the_target_quantile_of_the_update_norms(tmp_path):
    """200 clients a round with norms uniform on [0, 2] (median 1, 0.8-quantile 1.6): from C = 0.05,
    after 150 rounds C is within 10 % of the target quantile."""
    for quantile, target in ((0.5, 1.0), (0.8, 1.6)):
        config = load_config(
            None,
            [
                "model.name=tiny-bert",
                "federation.num_clients=200",
                "federation.clients_per_round=200",
                'privacy.mode="central"',
                "privacy.clip=0.05",
                "privacy.noise_multiplier=1.0",
                "privacy.adaptive_clip=true",
                f"privacy.target_quantile={quantile}",
            ],
        )
        p = mechanism(config)
        rng = np.random.default_rng(0)
        like = {"w": np.zeros(3)}
        for rnd in range(1, 151):
            p.aggregate([{"w": np.array([n, 0.0, 0.0])} for n in rng.uniform(0, 2, 200)], rnd, like)
        assert p.C == pytest.approx(target, rel=0.1), quantile


def test_the_clip_is_checkpointed_and_restored(tmp_path):
    p = mechanism(_config(tmp_path))
    p.aggregate([{"w": np.ones(3)}], 1, {"w": np.zeros(3)})
    q = mechanism(_config(tmp_path))
    q.load_state_dict(p.state_dict())
    assert q.C == p.C != C0 and np.array_equal(q.secret, p.secret)
