"""Client-level DP (DP-FedAvg, fedtune.methods.base.privacy): the clipped, noised, fixed-denominator
aggregate through the real Strategy.aggregate_fit, the noise's standard deviation, the accountant
against dp-accounting, the budget stop, refusals and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from fedtune.config import ConfigError, load_config
from fedtune.methods.base.privacy import NOISE_STREAM, Privacy, calibrate, default_delta
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY, tiny

KIND = "text-classification"
C, Z = 0.5, 1.3
# 4 clients, 3 sampled per round (q = 3/4): m = 3 is the fixed denominator
CENTRAL = ['privacy.mode="central"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
SAMPLED = ["federation.clients_per_round=3"]


def _config(tmp_path, *extra):
    return load_config(None, [*TINY, f"output_dir={tmp_path / 'runs'}", *SAMPLED, *extra])


def _updates(global_arrays, seed=7):
    """Two updates shaped like the global adapter: one of norm 10C, one of norm C/2."""
    rng = np.random.default_rng(seed)
    out = []
    for target in (10 * C, C / 2):
        u = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in global_arrays.items()}
        norm = np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in u.values()))
        out.append({k: (v * (target / norm)).astype(np.float32) for k, v in u.items()})
    return out


def test_central_aggregate_is_the_clipped_sum_plus_one_noise_draw_over_the_fixed_denominator(tmp_path):
    """(a)+(b): the real aggregate_fit gives theta + (clip(u1) + clip(u2) + xi) / m with m = 3 (a
    third sampled client dropped), xi the one seeded draw; the update of norm 10C counts with norm
    C. Fails when clipping is skipped or comes after the noise, when the denominator is the 2
    replies, when the weights are the clients' example counts, or when noise is drawn per client."""
    config = _config(tmp_path, *CENTRAL, "seed=11")
    strategy = RunContext(config).strategy()
    strategy.initialize()
    before = {k: v.copy() for k, v in strategy.global_arrays.items()}
    strategy.configure_fit(1, [0, 1, 3])
    u1, u2 = _updates(before)
    replies = {0: Message(u1, {"num_examples": 90, "train_loss": 0.5}), 3: Message(u2, {"num_examples": 10})}
    metrics = strategy.aggregate_fit(1, replies)

    norm1 = np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in u1.values()))
    assert norm1 == pytest.approx(10 * C, rel=1e-5)
    rng = np.random.default_rng([11, 1, NOISE_STREAM])
    noise = {k: rng.normal(0.0, Z * C, size=before[k].shape) for k in sorted(before)}
    for k in before:
        expected = before[k] + (u1[k].astype(np.float64) * (C / norm1) + u2[k] + noise[k]) / 3
        np.testing.assert_allclose(strategy.global_arrays[k], expected, rtol=1e-5, atol=1e-6)
    clipped_norm = np.sqrt(
        sum(float(np.sum(np.square((strategy.global_arrays[k] - before[k]) * 3 - noise[k] - u2[k]))) for k in before)
    )
    assert clipped_norm == pytest.approx(C, rel=1e-3)  # the 10C update entered with norm C
    assert metrics["epsilon"] == pytest.approx(strategy.privacy.epsilon(1)) and metrics["epsilon"] > 0


def test_noise_std_is_zC_over_m_centrally_and_zC_per_client_locally(tmp_path):
    """(c): empirical std over 3 x 20000 draws (relative standard error 0.3 %) within 2 %: the
    central aggregate's noise is z C / m, a local upload's z C; noise per client in central mode
    (sqrt(2) z C / m with two replies) or dividing by the replies (z C / 2) would be far outside."""
    zeros = {"a": np.zeros((100, 200), np.float32), "b": np.zeros(20000, np.float32)}
    central = Privacy(_config(tmp_path, *CENTRAL))
    drawn = np.concatenate(
        [np.concatenate([v.ravel() for v in central.aggregate([zeros, zeros], rnd).values()]) for rnd in (1, 2, 3)]
    )
    assert np.std(drawn) == pytest.approx(Z * C / 3, rel=0.02)
    assert abs(np.mean(drawn)) < 4 * Z * C / 3 / np.sqrt(drawn.size)
    local = Privacy(_config(tmp_path, 'privacy.mode="local"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"))
    uploads = np.concatenate([np.concatenate([v.ravel() for v in local.release(zeros, 1, c).values()]) for c in (0, 1)])
    assert np.std(uploads) == pytest.approx(Z * C, rel=0.02)
    # a local upload is clipped before its noise: an update of norm 10C enters with norm C
    big = {"a": np.full((100, 200), 10 * C / np.sqrt(20000), np.float32)}
    shifted = local.release(big, 1, 0)["a"] - local.release({"a": np.zeros((100, 200), np.float32)}, 1, 0)["a"]
    assert np.linalg.norm(shifted) == pytest.approx(C, rel=1e-4)


def test_per_layer_clipping_bounds_each_array_by_C_over_sqrt_L(tmp_path):
    from fedtune.methods.base.privacy import clip

    update = {"a": np.full(4, 10.0), "b": np.full(9, 0.01)}
    out = clip(update, 1.0, per_layer=True)
    assert np.linalg.norm(out["a"]) == pytest.approx(1 / np.sqrt(2)) and np.allclose(out["b"], 0.01)


def test_the_accountant_is_dp_accountings_own_computation(tmp_path):
    """(d): replace-one neighbours, N = 4, m = 3 sampled without replacement, multiplier z/2 (the sum's
    replace-one sensitivity is 2C); delta 1/N^1.1; epsilon grows with rounds; the calibrated z lands at
    or below a target epsilon and 1 % less noise would exceed it."""
    p = Privacy(_config(tmp_path, *CENTRAL))
    assert p.delta == pytest.approx(4**-1.1) and default_delta(100) == pytest.approx(100**-1.1)
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(4, 3, dp_accounting.GaussianDpEvent(Z / 2)), 5)
    assert p.epsilon(5) == pytest.approx(accountant.get_epsilon(4**-1.1), rel=1e-12)
    eps = [p.epsilon(t) for t in (1, 2, 5, 20)]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    # local: a plain Gaussian per upload, against the classical RDP bound T a / (2 s^2) + log(1/delta) / (a-1)
    local = Privacy(_config(tmp_path, 'privacy.mode="local"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"))
    sigma, delta, steps = Z / 2, 4**-1.1, 3
    classical = min(steps * a / (2 * sigma**2) + np.log(1 / delta) / (a - 1) for a in np.linspace(1.01, 64, 20000))
    assert 0.7 * classical < local.epsilon(steps) <= classical
    z = calibrate("local", 100, 10, 50, 1e-5, 3.0)
    from fedtune.methods.base.privacy import rdp_epsilon

    assert rdp_epsilon("local", 100, 10, z, 50, 1e-5) <= 3.0 < rdp_epsilon("local", 100, 10, z * 0.99, 50, 1e-5)
    target = Privacy(_config(tmp_path, 'privacy.mode="central"', f"privacy.clip={C}", "privacy.epsilon=40", "rounds=3"))
    assert target.epsilon(3) <= 40


def test_the_budget_stops_the_run_before_the_round_that_would_exceed_it(tmp_path):
    """(e): a budget between epsilon(1) and epsilon(2): round 1 runs, the run stops with one line
    before round 2; every line carries epsilon; summary.json holds (epsilon, delta) and the accountant."""
    config = tiny(tmp_path, "fedit", KIND, *CENTRAL, "rounds=3")
    probe = Privacy(config)
    budget = (probe.epsilon(1) + probe.epsilon(2)) / 2
    summary = run_experiment(tiny(tmp_path, "fedit", KIND, *CENTRAL, f"privacy.epsilon_budget={budget}", "rounds=3"))
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1]
    assert lines[0]["epsilon"] == pytest.approx(summary["privacy"]["epsilon"]) == pytest.approx(probe.epsilon(1))
    assert (
        summary["stopped"].startswith("privacy.epsilon_budget: stopped before round 2")
        and "\n" not in summary["stopped"]
    )
    assert summary["privacy"]["epsilon"] <= budget and summary["privacy"]["delta"] == pytest.approx(
        config.federation.num_clients**-1.1
    )
    assert "dp_accounting" in summary["privacy"]["accountant"]
    saved = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert saved["privacy"] == summary["privacy"] and saved["stopped"] == summary["stopped"]


def test_local_dp_runs_and_counts_each_clients_rounds(tmp_path):
    summary = run_experiment(
        tiny(tmp_path, "fedavg", KIND, 'privacy.mode="local"', f"privacy.clip={C}", "privacy.noise_multiplier=2")
    )
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    p = Privacy(
        tiny(tmp_path, "fedavg", KIND, 'privacy.mode="local"', f"privacy.clip={C}", "privacy.noise_multiplier=2")
    )
    most = max(sum(c in x["clients"] for x in lines) for c in range(4))
    assert summary["privacy"]["epsilon"] == pytest.approx(p.epsilon(most)) and lines[-1]["epsilon"] == pytest.approx(
        p.epsilon(most)
    )


def test_a_method_without_a_dp_form_refuses_privacy_in_one_line(tmp_path):
    """(f)"""
    with pytest.raises(ConfigError, match=r"^privacy.mode: method 'flexlora' does not support it"):
        resolve_run(tiny(tmp_path, "flexlora", KIND, *CENTRAL))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (['privacy.mode="central"', "privacy.noise_multiplier=1"], "privacy.clip: required"),
        (['privacy.mode="local"', "privacy.clip=1"], "privacy.noise_multiplier: required"),
        ([*CENTRAL, "privacy.epsilon=3"], "privacy: give privacy.noise_multiplier or privacy.epsilon"),
        (["privacy.clip=1"], 'privacy.clip: applies to privacy.mode = "central" or "local"'),
        ([*CENTRAL, 'federation.aggregation="median"'], "federation.aggregation: not with privacy.mode"),
        ([*CENTRAL, "federation.clip_update_norm=1"], "federation.clip_update_norm: not with privacy.mode"),
        ([*CENTRAL, 'options.weighting="examples"'], 'options.weighting: "examples" is not DP'),
        ([*CENTRAL, "privacy.epsilon_budget=1e-6"], "privacy.epsilon_budget: 1e-06 is below the epsilon of one round"),
    ],
)
def test_bad_privacy_options_stop_with_one_line(tmp_path, extra, message):
    """(g)"""
    with pytest.raises(ConfigError) as err:
        resolve_run(_config(tmp_path, *extra))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
