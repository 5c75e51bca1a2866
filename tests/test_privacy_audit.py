"""The empirical privacy audit (fedtune.privacy_audit), a cheap version of the benchmark's: with
the mechanism on, its lower bound on epsilon stays below the accountant's epsilon, whether the
auditor scores the released state or first subtracts the noise it regenerates from the public seed;
with the noise made reproducible from the config (issue 37's bug) or disabled, the bound lands far
above it. 300 runs of each neighbouring federation through the real round loop and DP strategy,
10 clients all sampled, 1 round, z = 5 (about a second each)."""

from __future__ import annotations

import numpy as np
import pytest

from fedtune.config import load_config
from fedtune.methods.base.privacy import CentralGaussian
from fedtune.privacy_audit import audit, epsilon_lower_bound

BASE = [
    "model.name=tiny-bert",
    "federation.num_clients=10",
    "federation.clients_per_round=10",
    "rounds=1",
    'privacy.mode="central"',
    "privacy.clip=1.0",
    "privacy.noise_multiplier=5",
]
TRIALS = 300


def _audit(*extra: str, attack: str = "released") -> dict:
    return audit(load_config(None, [*BASE, *extra]), TRIALS, dim=500, attack=attack)


@pytest.mark.parametrize("attack", ["released", "regenerate"])
def test_with_secret_noise_the_lower_bound_stays_below_the_reported_epsilon(attack):
    result = _audit(attack=attack)
    assert result["reported_epsilon"] == result["accountant_epsilon"] > 1.0
    assert result["epsilon_lower_bound"] < result["reported_epsilon"]
    assert result["false_negatives"] + result["false_positives"] > 0.2 * TRIALS  # the noise hides the canary


def test_noise_regenerable_from_the_config_gives_a_bound_far_above_the_accountants_epsilon():
    """The outsider regenerates the reproducible noise from config.toml's seed, subtracts it and
    tells the neighbours apart every time: the bound is over twice what the accountant claims for
    this z, so the audit catches issue 37's bug (the run itself now reports epsilon = inf)."""
    result = _audit("privacy.insecure_reproducible_noise=true", attack="regenerate")
    assert result["false_negatives"] == result["false_positives"] == 0
    assert result["epsilon_lower_bound"] > 2 * result["accountant_epsilon"]
    assert result["reported_epsilon"] == float("inf")


def test_disabled_noise_gives_a_bound_far_above_the_accountants_epsilon(monkeypatch):
    monkeypatch.setattr(CentralGaussian, "noise_std", lambda self: 0.0)
    result = _audit()
    assert result["epsilon_lower_bound"] > 2 * result["accountant_epsilon"]


def test_the_bound_is_the_clopper_pearson_form_of_fpr_plus_exp_eps_fnr():
    """Hand case: 0 errors in 300 trials each gives upper rates 1 - 0.025^(1/300) and the bound
    log((1 - delta - FPR) / FNR); half errors give 0."""
    separated = epsilon_lower_bound(np.ones(300), -np.ones(300), delta=1e-5)
    rate = 1 - 0.025 ** (1 / 300)
    assert separated["fnr_upper"] == pytest.approx(rate, rel=1e-9)
    assert separated["epsilon_lower_bound"] == pytest.approx(np.log((1 - 1e-5 - rate) / rate), rel=1e-9)
    mixed = epsilon_lower_bound(np.r_[np.ones(150), -np.ones(150)], np.r_[np.ones(150), -np.ones(150)], 1e-5)
    assert mixed["epsilon_lower_bound"] == 0.0


def test_the_bound_takes_the_better_of_the_test_and_its_swap_when_the_errors_are_one_sided():
    """Half the runs with the canary score above 0, none without it: FNR is high and FPR is 0, so
    the evidence is P(no positive score | without) against P(no positive score | with), the bound
    log((1 - delta - FNR) / FPR) (about 2.4 here), not log((1 - delta - FPR) / FNR) (about 0.5).
    The Clopper-Pearson upper rates come from inverting the binomial CDF (scipy's binom, not the
    beta quantile the audit uses): 0 of 100 at 0.975 is 1 - 0.025^(1/100)."""
    from scipy import optimize
    from scipy.stats import binom

    n, delta = 100, 1e-5
    positive = np.r_[np.ones(50), -np.ones(50)]
    result = epsilon_lower_bound(positive, -np.ones(n), delta=delta)
    fnr = optimize.brentq(lambda p: binom.cdf(50, n, p) - 0.025, 0.5, 1.0, xtol=1e-14)
    fpr = 1 - 0.025 ** (1 / n)
    assert (result["false_negatives"], result["false_positives"]) == (50, 0)
    assert result["fnr_upper"] == pytest.approx(fnr, rel=1e-6) and result["fpr_upper"] == pytest.approx(fpr, rel=1e-9)
    assert result["epsilon_lower_bound"] == pytest.approx(np.log((1 - delta - fnr) / fpr), rel=1e-6)


def test_with_a_sampled_federation_the_outsider_abstains_where_the_seeds_sample_lacks_the_canary():
    """q = 1/4, 2 rounds: under reproducible noise the outsider also regenerates each run's sample,
    leaves out the runs whose sample never held client 0 (about (3/4)^2 of them) and tells the rest
    apart every time; without the abstention those runs would be coin flips."""
    from fedtune.privacy_audit import seed_sample_holds_canary

    sampled = ["federation.num_clients=20", "federation.clients_per_round=5", "rounds=2"]
    config = load_config(None, [*BASE, *sampled, "privacy.insecure_reproducible_noise=true"])
    kept = sum(seed_sample_holds_canary(config.model_copy(update={"seed": t})) for t in range(200))
    assert 0.3 < kept / 200 < 0.6  # 1 - (3/4)^2 = 0.44
    result = audit(config, 200, dim=500, attack="regenerate")
    assert result["trials_each"] == kept and result["false_negatives"] == result["false_positives"] == 0
