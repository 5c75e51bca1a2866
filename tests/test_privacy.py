"""Client-level DP (fedtune.methods.base.privacy): the clipped, noised, fixed-denominator aggregate
through the real Strategy.aggregate_fit (read with the server's secret, as an insider), the noise's
standard deviation, the secret Poisson sample, the accountant against dp-accounting, the budget
stop, refusals and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError, load_config
from fedtune.methods.base import accounting
from fedtune.methods.base.privacy import NOISE, UPLOAD, clip, generator, mechanism, privacy_params
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY, tiny
from tests.dp_reference import gaussian_epsilon

KIND = "text-classification"
C, Z = 0.5, 1.3
# 4 clients, q = 3/4: m = 3 is the fixed denominator
CENTRAL = ['privacy.mode="central"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
LOCAL = ['privacy.mode="local"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
SAMPLED = ["federation.clients_per_round=3"]
NR = dp_accounting.NeighboringRelation


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
    """The real aggregate_fit gives theta + (clip(u1) + clip(u2) + xi) / m with m = 3 (a third
    sampled client dropped), xi the one draw from the server's secret (read from its state: an
    insider's view); the update of norm 10C counts with norm C; the metrics are epsilon alone (no
    train loss). Fails when clipping is skipped or comes after the noise, when the denominator is
    the 2 replies, when the weights are the clients' example counts, or when noise is drawn per
    client."""
    strategy = RunContext(resolve_run(_config(tmp_path, *CENTRAL, "seed=11"))).strategy()
    strategy.initialize()
    before = {k: v.copy() for k, v in strategy.global_arrays.items()}
    strategy.configure_fit(1, [0, 1, 3])
    u1, u2 = _updates(before)
    replies = {0: Message(u1, {"num_examples": 90, "train_loss": 0.5}), 3: Message(u2, {"num_examples": 10})}
    metrics = strategy.aggregate_fit(1, replies)

    norm1 = np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in u1.values()))
    assert norm1 == pytest.approx(10 * C, rel=1e-5)
    secret = strategy.state_dict()["privacy_secret"]
    rng = generator(secret, NOISE, 1)
    noise = {k: rng.normal(0.0, Z * C, size=before[k].shape) for k in sorted(before)}
    for k in before:
        expected = before[k] + (u1[k].astype(np.float64) * (C / norm1) + u2[k] + noise[k]) / 3
        np.testing.assert_allclose(strategy.global_arrays[k], expected, rtol=1e-5, atol=1e-6)
    clipped_norm = np.sqrt(
        sum(float(np.sum(np.square((strategy.global_arrays[k] - before[k]) * 3 - noise[k] - u2[k]))) for k in before)
    )
    assert clipped_norm == pytest.approx(C, rel=1e-3)  # the 10C update entered with norm C
    assert metrics == {"epsilon": pytest.approx(strategy.aggregation.privacy.epsilon(1))} and metrics["epsilon"] > 0


@pytest.mark.parametrize("server", ["sgd", "adam"])
def test_the_noised_mean_goes_through_the_server_optimizer(tmp_path, server):
    """DP-FedAvg with a server step (McMahan et al.'s server learning rate; FedAdam): the real
    aggregate_fit's new state is the server optimizer applied to Delta = (clip(u1) + u2 + xi) / m,
    by hand: SGD at lr 0.5 gives theta + 0.5 Delta; FedAdam's first step (bias-corrected moments
    Delta and Delta^2, no weight decay) gives theta + 0.5 Delta / (|Delta| + 1e-8).
    Adding the noised mean as it is (the server step skipped) is off by a half of Delta."""
    extra = ["server.lr=0.5", f'server.optimizer="{server}"']
    strategy = RunContext(resolve_run(_config(tmp_path, *CENTRAL, *extra))).strategy()
    strategy.initialize()
    before = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    strategy.configure_fit(1, [0, 1, 3])
    u1, u2 = _updates(strategy.global_arrays)
    strategy.aggregate_fit(1, {0: Message(u1, {"num_examples": 9}), 3: Message(u2, {"num_examples": 1})})
    norm1 = np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in u1.values()))
    rng = generator(strategy.aggregation.privacy.secret, NOISE, 1)
    noise = {k: rng.normal(0.0, Z * C, size=before[k].shape) for k in sorted(before)}
    for k in before:
        delta = (u1[k].astype(np.float64) * (C / norm1) + u2[k] + noise[k]) / 3
        if server == "sgd":
            expected = before[k] + 0.5 * delta
        else:
            expected = before[k] + 0.5 * delta / (np.abs(delta) + 1e-8)
        np.testing.assert_allclose(strategy.global_arrays[k], expected, rtol=1e-5, atol=1e-6)


def test_a_round_nobody_replied_to_still_releases_its_noise_and_counts(tmp_path):
    """A Poisson sample may be empty or every client may drop: the round's release is xi / m alone
    (the state moves), and it is accounted. Returning early (no move, no count) would make whether
    a round is released depend on who replied."""
    strategy = RunContext(resolve_run(_config(tmp_path, *CENTRAL))).strategy()
    strategy.initialize()
    before = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    strategy.configure_fit(1, [])
    metrics = strategy.aggregate_fit(1, {})
    rng = generator(strategy.aggregation.privacy.secret, NOISE, 1)
    for k in sorted(before):
        expected = before[k] + rng.normal(0, Z * C, before[k].shape) / 3
        np.testing.assert_allclose(strategy.global_arrays[k], expected, rtol=1e-5, atol=1e-7)
    private = strategy.aggregation.privacy
    assert private.releases[0] == 1 and metrics["epsilon"] == pytest.approx(private.epsilon(1))


def test_noise_std_is_zC_over_m_centrally_and_zC_per_client_locally(tmp_path):
    """Empirical std over 3 x 20000 draws (relative standard error 0.3 %) within 2 %: the central
    aggregate's noise is z C / m, a local upload's z C; noise per client in central mode (sqrt(2) z
    C / m with two replies) or dividing by the replies (z C / 2) would be far outside. A local
    client's second upload draws fresh noise (a second upload in a round never reuses it)."""
    zeros = {"a": np.zeros((100, 200), np.float32), "b": np.zeros(20000, np.float32)}
    central = mechanism(_config(tmp_path, *CENTRAL))
    drawn = np.concatenate(
        [np.concatenate([v.ravel() for v in central.aggregate([zeros, zeros], r, zeros).values()]) for r in (1, 2, 3)]
    )
    assert np.std(drawn) == pytest.approx(Z * C / 3, rel=0.02)
    assert abs(np.mean(drawn)) < 4 * Z * C / 3 / np.sqrt(drawn.size)
    local = privacy_params(_config(tmp_path, *LOCAL))
    state: dict = {}
    first, second = (local.kind.client_release(local, zeros, state, 0, 1) for _ in range(2))
    uploads = np.concatenate([v.ravel() for u in (first, second) for v in u.values()])
    assert np.std(uploads) == pytest.approx(Z * C, rel=0.02)
    assert abs(np.corrcoef(first["b"], second["b"])[0, 1]) < 0.05 and state["dp_uploads"].tolist() == [1, 1]
    rng = generator(state["dp_secret"], UPLOAD, 1, 1)  # the client's own secret, round 1, its second upload
    expected = {k: rng.normal(0, Z * C, np.shape(zeros[k])) for k in sorted(zeros)}
    np.testing.assert_allclose(second["a"], expected["a"], rtol=1e-6, atol=1e-7)
    # a local upload is clipped before its noise: an update of norm 10C enters with norm C
    big = {"a": np.full((100, 200), 10 * C / np.sqrt(20000), np.float32)}
    fixed = {"dp_secret": np.array([1, 2, 3, 4], np.uint32)}
    shifted = (
        local.kind.client_release(local, big, dict(fixed), 0, 1)["a"]
        - local.kind.client_release(local, {"a": np.zeros((100, 200), np.float32)}, dict(fixed), 0, 1)["a"]
    )
    assert np.linalg.norm(shifted) == pytest.approx(C, rel=1e-4)


def test_per_layer_clipping_bounds_each_array_by_C_over_sqrt_L(tmp_path):
    update = {"a": np.full(4, 10.0), "b": np.full(9, 0.01)}
    out = clip(update, 1.0, per_layer=True)
    assert np.linalg.norm(out["a"]) == pytest.approx(1 / np.sqrt(2)) and np.allclose(out["b"], 0.01)


@pytest.mark.parametrize("mode", [CENTRAL, LOCAL], ids=["central", "local"])
def test_the_sample_is_a_secret_poisson_draw_of_rate_m_over_n(tmp_path, mode):
    """Each client joins with probability q = m/N independently (sizes vary around m), the draw
    depends on the server's secret, not on the seed: two mechanisms of one config sample differently,
    and the engine's seeded draw is not what a DP round uses. Local DP too: its accountant's rate is
    1 (no amplification), but the server still asks about m clients a round, not all N."""
    from fedtune.engines.rounds import sample_clients

    config = _config(tmp_path, *mode, "federation.num_clients=40", "federation.clients_per_round=10")
    one, two = mechanism(config), mechanism(config)
    samples = [one.sample(r) for r in range(1, 401)]
    sizes = np.array([len(s) for s in samples])
    assert sizes.mean() == pytest.approx(10, abs=0.6) and sizes.std() == pytest.approx(
        np.sqrt(40 * 0.25 * 0.75), rel=0.2
    )
    # an empty sample (probability 0.75^40 a round) is an empty int array, not numpy's float64 default
    freq = np.bincount(np.concatenate([np.asarray(s, dtype=np.int64) for s in samples]), minlength=40) / 400
    assert np.all(np.abs(freq - 0.25) < 5 * np.sqrt(0.25 * 0.75 / 400))
    assert sum(one.sample(r) == two.sample(r) for r in range(1, 21)) == 0
    assert sum(one.sample(r) == sample_clients(40, 10, config.seed, r) for r in range(1, 21)) == 0


def test_the_accountant_is_dp_accountings_pld_of_the_poisson_subsampled_gaussian(tmp_path):
    """Replace-one (default) and add/remove adjacency, each dp-accounting's PLD accountant of
    PoissonSampled(q, Gaussian(z)) composed per round; local: a Gaussian per upload (q = 1, equal
    to a multiplier z/2 under add/remove); delta min(1/N^2, 1e-5); epsilon grows with rounds;
    "rdp" is its RDP accountant (looser)."""
    p = mechanism(_config(tmp_path, *CENTRAL))
    assert p.delta == 1e-5 == accounting.default_delta(4) and accounting.default_delta(1000) == 1e-6
    for adjacency, relation in (("replace-one", NR.REPLACE_ONE), ("add-remove", NR.ADD_OR_REMOVE_ONE)):
        q = mechanism(_config(tmp_path, *CENTRAL, f'privacy.adjacency="{adjacency}"'))
        ref = PLDAccountant(relation, value_discretization_interval=accounting.DISCRETIZATION)
        ref.compose(dp_accounting.PoissonSampledDpEvent(0.75, dp_accounting.GaussianDpEvent(Z)), 5)
        assert q.epsilon(5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    assert mechanism(_config(tmp_path, *CENTRAL, 'privacy.adjacency="add-remove"')).epsilon(5) < p.epsilon(5)
    eps = [p.epsilon(t) for t in (1, 2, 5, 20)]
    assert eps == sorted(eps) and eps[0] < eps[-1]
    local = mechanism(_config(tmp_path, *LOCAL))
    ref = PLDAccountant(NR.ADD_OR_REMOVE_ONE, value_discretization_interval=accounting.DISCRETIZATION)
    ref.compose(dp_accounting.GaussianDpEvent(Z / 2), 3)
    assert local.epsilon(3) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-3)
    rdp = mechanism(_config(tmp_path, *CENTRAL, 'privacy.accountant="rdp"', 'privacy.adjacency="add-remove"'))
    ref = RdpAccountant(neighboring_relation=NR.ADD_OR_REMOVE_ONE)
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.75, dp_accounting.GaussianDpEvent(Z)), 5)
    assert rdp.epsilon(5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)
    pld = mechanism(_config(tmp_path, *CENTRAL, 'privacy.adjacency="add-remove"'))
    assert pld.epsilon(5) < rdp.epsilon(5)


def test_local_dp_gets_no_amplification_by_sampling_even_at_m_much_below_n(tmp_path):
    """m = 10 of N = 100: the server knows whom it asked, so a local upload is a plain Gaussian
    (multiplier z/2 under add/remove); accounting it at q = m/N would report far less."""
    local = mechanism(_config(tmp_path, *LOCAL, "federation.num_clients=100", "federation.clients_per_round=10"))
    ref = PLDAccountant(NR.ADD_OR_REMOVE_ONE, value_discretization_interval=accounting.DISCRETIZATION)
    ref.compose(dp_accounting.GaussianDpEvent(Z / 2), 20)
    assert local.rate == 1.0 and local.epsilon(20) == pytest.approx(ref.get_epsilon(local.delta), rel=1e-3)
    assert local.epsilon(20) > 2 * accounting.epsilon("pld", "replace-one", 0.1, Z, 20, local.delta)


def test_a_local_epsilon_target_calibrates_z_for_a_gaussian_per_upload_not_for_sampling(tmp_path):
    """``privacy.epsilon`` in local mode: every upload is a Gaussian (q = 1) whose sum moves by 2C
    between neighbours (replace-one), so after ``rounds`` uploads of one client the mechanism is
    a Gaussian of shift 2 sqrt(rounds) / z standard deviations. Its exact epsilon (Balle and Wang's
    formula) at the calibrated z is within the target, and 1 % less noise exceeds it. Calibrating
    at the central rate q = m/N = 0.1 (amplification the server, who knows whom it asked, does not
    give) yields a z about 5x too small: an exact epsilon far above the target."""
    rounds, target = 5, 4.0
    extra = ["federation.num_clients=100", "federation.clients_per_round=10", f"rounds={rounds}"]
    params = privacy_params(
        _config(tmp_path, 'privacy.mode="local"', f"privacy.clip={C}", f"privacy.epsilon={target}", *extra)
    )
    assert params is not None and params.sample_size == 10
    exact = gaussian_epsilon(2 * np.sqrt(rounds) / params.z, params.delta)
    assert target * 0.97 <= exact <= target, (params.z, exact)
    assert gaussian_epsilon(2 * np.sqrt(rounds) / (0.99 * params.z), params.delta) > target


def test_calibration_lands_at_or_below_the_target_and_less_noise_exceeds_it():
    for acc, adj, q, steps in (
        ("pld", "replace-one", 0.1, 30),
        ("pld", "add-remove", 0.5, 5),
        ("rdp", "add-remove", 0.1, 30),
    ):
        z = accounting.calibrate(acc, adj, q, steps, 1e-5, 3.0)
        assert accounting.epsilon(acc, adj, q, z, steps, 1e-5) <= 3.0
        assert accounting.epsilon(acc, adj, q, z * 0.99, steps, 1e-5) > 3.0


def test_the_budget_stops_the_run_before_the_round_that_would_exceed_it(tmp_path):
    """A budget between epsilon(1) and epsilon(2): round 1 runs, the run stops with one line
    before round 2; every line carries epsilon; summary.json holds (epsilon, delta), the
    adjacency and the accountant."""
    config = tiny(tmp_path, "fedit", KIND, *CENTRAL, "rounds=3")
    probe = mechanism(config)
    budget = (probe.epsilon(1) + probe.epsilon(2)) / 2
    summary = run_experiment(tiny(tmp_path, "fedit", KIND, *CENTRAL, f"privacy.epsilon_budget={budget}", "rounds=3"))
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1]
    assert lines[0]["epsilon"] == pytest.approx(summary["privacy"]["epsilon"]) == pytest.approx(probe.epsilon(1))
    assert (
        summary["stopped"].startswith("privacy.epsilon_budget: stopped before round 2")
        and "\n" not in summary["stopped"]
    )
    assert summary["privacy"]["epsilon"] <= budget and summary["privacy"]["delta"] == 1e-5
    assert summary["privacy"]["adjacency"] == "replace-one" and "PLDAccountant" in summary["privacy"]["accountant"]
    saved = json.loads((Path(summary["run_dir"]) / "summary.json").read_text())
    assert saved["privacy"] == summary["privacy"] and saved["stopped"] == summary["stopped"]


def test_local_dp_counts_every_upload_of_each_client(tmp_path):
    """Local DP: a client's epsilon composes one Gaussian per round it was asked in (no
    amplification: the server knows its sample); the reported epsilon is the largest over clients.
    The sample comes from the engine's in-memory records (never written)."""
    config = tiny(tmp_path, "fedavg", KIND, *LOCAL, "rounds=3")
    asked: list[list[int]] = []
    summary = run_experiment(config, on_round=lambda rec: asked.append(rec.clients))
    counts = load_state(Path(summary["run_dir"]) / "checkpoint.npz")["privacy_releases"]
    expected = [sum(c in s for s in asked) for c in range(config.federation.num_clients)]
    assert counts.tolist() == expected
    assert summary["privacy"]["epsilon"] == pytest.approx(mechanism(config).epsilon(max(expected)))


def test_a_method_without_a_dp_form_refuses_privacy_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^privacy.mode: method 'flexlora' does not support it"):
        resolve_run(tiny(tmp_path, "flexlora", KIND, *CENTRAL))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (['privacy.mode="central"', "privacy.noise_multiplier=1"], "privacy.clip: required"),
        (['privacy.mode="local"', "privacy.clip=1"], "privacy.noise_multiplier: required"),
        ([*CENTRAL, "privacy.epsilon=3"], "privacy: give privacy.noise_multiplier or privacy.epsilon"),
        (["privacy.clip=1"], 'privacy.clip: applies to privacy.mode = "central" or "local"'),
        ([*CENTRAL, 'robust.aggregation="median"'], "robust.aggregation: not with privacy.mode"),
        ([*CENTRAL, "robust.clip_update_norm=1"], "robust.clip_update_norm: not with privacy.mode"),
        ([*CENTRAL, 'options.weighting="examples"'], 'options.weighting: "examples" is not DP'),
        ([*CENTRAL, "privacy.epsilon_budget=1e-6"], "privacy.epsilon_budget: 1e-06 is below the epsilon of one round"),
        ([*CENTRAL, "federation.min_replies=2"], "federation.min_replies: not with privacy.mode"),
        ([*CENTRAL, "federation.max_retries=0"], "federation.max_retries: not with privacy.mode"),
        ([*CENTRAL, 'privacy.accountant="rdp"'], 'privacy.accountant: "rdp" has no Poisson-subsampled'),
        ([*LOCAL, 'privacy.adjacency="add-remove"'], "privacy.adjacency: local DP protects each upload"),
        ([*LOCAL, "privacy.adaptive_clip=true"], "privacy.adaptive_clip: central only"),
        ([*CENTRAL, "privacy.target_quantile=0.7"], "privacy.target_quantile: applies to privacy.adaptive_clip"),
        ([*CENTRAL, "privacy.noise_multiplier=1e300"], "privacy.noise_multiplier"),
        (
            [
                'privacy.mode="central"',
                f"privacy.clip={C}",
                "privacy.epsilon=3",
                "privacy.insecure_reproducible_noise=true",
            ],
            "privacy.epsilon: not with privacy.insecure_reproducible_noise",
        ),
        (
            [*CENTRAL, "privacy.insecure_reproducible_noise=true", "privacy.epsilon_budget=3"],
            "privacy.epsilon_budget: not with privacy.insecure_reproducible_noise",
        ),
        (
            [*CENTRAL, "privacy.adaptive_clip=true", "privacy.clipped_count_stddev=0.5"],
            "privacy.clipped_count_stddev: sigma_b = 0.5 must exceed z / 2",
        ),
    ],
)
def test_bad_privacy_options_stop_with_one_line(tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        resolve_run(_config(tmp_path, *extra))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_reproducible_noise_is_marked_not_private_and_reports_infinite_epsilon(tmp_path):
    """The test-only switch: its noise is the seed's (two mechanisms agree), every report says
    epsilon = inf and names it as not private."""
    config = _config(tmp_path, *CENTRAL, "privacy.insecure_reproducible_noise=true")
    one, two = mechanism(config), mechanism(config)
    like = {"a": np.zeros(50)}
    np.testing.assert_array_equal(one.aggregate([], 1, like)["a"], two.aggregate([], 1, like)["a"])
    one.aggregated()
    assert one.spent() == float("inf") and "not_private" in one.report()
