"""The accountant (fedtune.methods.base.accounting) against computations that share none of its
code: Microsoft's prv-accountant for the Poisson-subsampled Gaussian under add/remove adjacency
(Gopi, Lee, Wutschitz 2021), and, for replace-one, the hockey-stick divergence of one round
integrated numerically. Within 1 % at the settings fedtune's benchmarks use."""

from __future__ import annotations

import math

import pytest
from scipy import integrate, optimize
from scipy.stats import norm

from fedtune.methods.base import accounting
from tests.dp_reference import gaussian_epsilon

prv = pytest.importorskip("prv_accountant")


@pytest.mark.parametrize(
    ("q", "z", "steps"),
    [(0.1, 1.398, 30), (0.1, 0.8, 30), (0.5, 2.0, 10), (0.1, 2.672, 30)],
)
def test_add_remove_epsilon_matches_the_prv_accountant_within_1_percent(q, z, steps):
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    delta = 1e-5
    reference = PRVAccountant(
        prvs=[PoissonSubsampledGaussianMechanism(noise_multiplier=z, sampling_probability=q)],
        max_self_compositions=[steps],
        eps_error=1e-2,
        delta_error=1e-10,
    )
    low, estimate, high = reference.compute_epsilon(delta=delta, num_self_compositions=[steps])
    ours = accounting.epsilon("pld", "add-remove", q, z, steps, delta)
    assert ours == pytest.approx(estimate, rel=0.01)
    assert ours >= low  # an upper bound on the true epsilon: never below the reference's lower one


def _replace_one_delta(eps: float, q: float, z: float) -> float:
    """delta(eps) of one round under replace-one: P = q N(1, z^2) + (1 - q) N(0, z^2) against
    Q = q N(-1, z^2) + (1 - q) N(0, z^2) (the clipped update +C against -C, in units of C),
    integral of max(0, P - e^eps Q)."""

    def gap(x: float) -> float:
        p = q * norm.pdf(x, 1, z) + (1 - q) * norm.pdf(x, 0, z)
        r = q * norm.pdf(x, -1, z) + (1 - q) * norm.pdf(x, 0, z)
        return max(0.0, p - math.exp(eps) * r)

    return integrate.quad(gap, -40 * z, 40 * z, limit=500, points=[-1, 0, 1])[0]


@pytest.mark.parametrize(("q", "z"), [(1.0, 1.0), (0.1, 0.5), (0.3, 1.0), (0.75, 1.3)])
def test_replace_one_epsilon_of_one_round_matches_the_integrated_divergence_within_1_percent(q, z):
    delta = 1e-5
    reference = optimize.brentq(lambda e: _replace_one_delta(e, q, z) - delta, 1e-6, 60, xtol=1e-9)
    ours = accounting.epsilon("pld", "replace-one", q, z, 1, delta)
    assert ours == pytest.approx(reference, rel=0.01)
    assert ours >= reference * (1 - 1e-4)  # pessimistic: not below the exact value (to the integration's error)


@pytest.mark.parametrize(("z", "steps"), [(1.0, 5), (4.0, 1)])
def test_rdp_of_a_local_upload_bounds_the_exact_gaussian_whose_sum_moves_by_2C(z, steps):
    """Local DP under replace-one with the RDP accountant: each upload is a Gaussian of std zC whose
    clipped update moves by up to 2C between neighbours (C against -C), so ``steps`` uploads are one
    Gaussian of shift 2 sqrt(steps) / z standard deviations. RDP is an upper bound on its exact
    epsilon (Balle and Wang's formula), loose by under 15 % here (measured: 6-9 %). A multiplier
    of z, not z/2 (a shift of C), reports about half the exact epsilon."""
    delta = 1e-5
    exact = gaussian_epsilon(2 * math.sqrt(steps) / z, delta)
    ours = accounting.epsilon("rdp", "replace-one", 1.0, z, steps, delta)
    assert exact <= ours <= 1.15 * exact, (exact, ours)


def test_rdp_is_an_upper_bound_on_pld_and_replace_one_costs_more_than_add_remove():
    for q, z, steps in ((0.1, 1.0, 30), (0.5, 2.0, 10)):
        pld = accounting.epsilon("pld", "add-remove", q, z, steps, 1e-5)
        assert pld < accounting.epsilon("rdp", "add-remove", q, z, steps, 1e-5)
        assert pld < accounting.epsilon("pld", "replace-one", q, z, steps, 1e-5)


@pytest.mark.parametrize(("q", "z", "steps"), [(1.0, 0.03, 2), (0.2, 0.03, 100), (1.0, 0.1, 2), (1.0, 0.3, 2)])
def test_a_large_epsilon_reported_from_the_coarse_grid_bounds_the_fine_one_within_1_percent(q, z, steps):
    """A tiny noise multiplier: the reported epsilon (coarse grid, seconds less) is within 1 % of
    the fine grid's (both upper bounds of the true epsilon; at z = 0.03, q = 1 the coarse one is
    0.04 below the fine one's 4846.54)."""
    fine = accounting.epsilon("pld", "replace-one", q, z, steps, 1e-5, grid=accounting.DISCRETIZATION)
    reported = accounting.epsilon("pld", "replace-one", q, z, steps, 1e-5)
    assert abs(reported - fine) <= 0.01 * fine, (fine, reported)


@pytest.mark.parametrize(("z", "grids"), [(0.01, [accounting.COARSE_DISCRETIZATION]), (1.0, None)])
def test_only_a_large_epsilon_skips_the_fine_grid(monkeypatch, z, grids):
    """z = 0.01 (epsilon about 4e4, minutes on the fine grid): the coarse grid alone; z = 1 (a usual
    epsilon): the fine grid's value, as before."""
    from dp_accounting.pld import PLDAccountant

    used = []

    class Recording(PLDAccountant):
        def __init__(self, relation, value_discretization_interval):
            used.append(value_discretization_interval)
            super().__init__(relation, value_discretization_interval=value_discretization_interval)

    monkeypatch.setattr("dp_accounting.pld.PLDAccountant", Recording)
    accounting.epsilon.cache_clear()  # computed before by another test: no accountant would be built
    reported = accounting.epsilon("pld", "replace-one", 1.0, z, 2, 1e-5)
    if grids is not None:
        assert used == grids
    else:
        assert used == [accounting.COARSE_DISCRETIZATION, accounting.DISCRETIZATION]
        assert reported == accounting.epsilon("pld", "replace-one", 1.0, z, 2, 1e-5, grid=accounting.DISCRETIZATION)
