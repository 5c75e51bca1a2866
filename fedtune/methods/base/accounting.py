"""The privacy accountant of client-level DP (:mod:`fedtune.methods.base.privacy`): epsilon of a
run's releases at a delta, and the noise multiplier z calibrated to a target epsilon.

One release (a round's aggregate, central; one client's upload, local) is a Gaussian mechanism
on updates clipped to L2 norm C with noise std zC, on a secret Poisson sample that includes each of
the N clients with probability q (central; local: q = 1, the server knows whom it asked).

Adjacency (``privacy.adjacency``), the convention every report states:

* ``"replace-one"`` (default): one client's data replaced by any other; N is public. The sum moves
  by at most 2C: ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under dp-accounting's
  REPLACE_ONE, whose subsampled Gaussian is q N(+C) + (1-q) N(0) against q N(-C) + (1-q) N(0)
  (at q = 1 exactly a Gaussian of multiplier z/2 under add/remove).
* ``"add-remove"``: one client added or removed (Opacus's, TFF's and Flower's convention, so numbers
  compare with theirs): the sum moves by at most C, ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
  under ADD_OR_REMOVE_ONE.

Accountant (``privacy.accountant``): ``"pld"`` (default), dp-accounting's privacy-loss-distribution
accountant (Doroshenko et al. 2022; tight up to its pessimistic discretization of the privacy loss
in steps of 1e-3 nats, :data:`DISCRETIZATION`, an upper bound that agrees with 1e-4 to 4 digits
at this project's settings and is 10x faster), or
``"rdp"``, its Renyi accountant (Mironov 2017; an upper bound, looser by 1.1-1.5x in epsilon at
this project's settings). dp-accounting's RDP has no Poisson-subsampled Gaussian under REPLACE_ONE,
so ``"rdp"`` needs ``adjacency = "add-remove"`` (or local mode, whose q = 1 Gaussian of multiplier
z/2 it composes).
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache

ACCOUNTANTS = ("pld", "rdp")
DISCRETIZATION = 1e-3  # the PLD accountant's grid of privacy-loss values (nats), rounded pessimistically
#: a grid 100x coarser, whose epsilon :func:`epsilon` reports where it is within 1 % of the fine one's
COARSE_DISCRETIZATION = 0.1
ADJACENCIES = ("replace-one", "add-remove")


def describe(accountant: str, adjacency: str, mode: str) -> str:
    """One line naming the accountant, the adjacency and the event composed (``summary.json``)."""
    event = "Gaussian per upload (q = 1)" if mode == "local" else "Poisson-subsampled Gaussian per round"
    name = "PLDAccountant" if accountant == "pld" else "RdpAccountant"
    return f"dp_accounting {name}, {adjacency} adjacency, {event}"


@lru_cache(maxsize=4096)
def epsilon(
    accountant: str, adjacency: str, q: float, z: float, steps: int, delta: float, grid: float | None = None
) -> float:
    """Epsilon at ``delta`` after ``steps`` compositions of the Gaussian of multiplier ``z`` on a
    Poisson sample of rate ``q`` (see the module docstring; ``grid``: the PLD discretization, each
    an upper bound of the true epsilon, a coarser one a looser one). 0 for no step.

    Without ``grid`` (the epsilon a run reports) a PLD epsilon is first taken on
    :data:`COARSE_DISCRETIZATION`'s grid and reported as is where ``steps`` x that grid is at most
    1 % of it: pessimistic rounding raises each release's privacy loss by under one grid step, so
    the coarse bound exceeds the true epsilon (which the fine one also bounds) by under ``steps`` x
    grid; and the fine grid's points grow as 1/z^2 (z = 0.01: a minute and more for an epsilon of
    about 4e4). A usual epsilon (a few units) takes :data:`DISCRETIZATION`'s."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    if steps <= 0:
        return 0.0
    relation = dp_accounting.NeighboringRelation
    if accountant == "rdp":
        logging.getLogger("absl").setLevel(logging.ERROR)  # its orders that fail to converge are left out, loudly
        if adjacency == "replace-one":
            if q < 1:
                raise ValueError("the RDP accountant has no Poisson-subsampled Gaussian under replace-one adjacency")
            event = dp_accounting.GaussianDpEvent(z / 2.0)  # q = 1: replace-one moves the sum by 2C
        else:
            event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        tracker = RdpAccountant(neighboring_relation=relation.ADD_OR_REMOVE_ONE)
    else:
        if grid is None:  # a large epsilon first on the coarse grid (a tiny z: minutes on the fine one)
            coarse = epsilon(accountant, adjacency, q, z, steps, delta, COARSE_DISCRETIZATION)
            if steps * COARSE_DISCRETIZATION <= 0.01 * coarse:
                return coarse
            grid = DISCRETIZATION
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        rel = relation.REPLACE_ONE if adjacency == "replace-one" else relation.ADD_OR_REMOVE_ONE
        tracker = PLDAccountant(rel, value_discretization_interval=grid)
    tracker.compose(event, int(steps))
    return float(tracker.get_epsilon(delta))


def calibrate(accountant: str, adjacency: str, q: float, steps: int, delta: float, target: float) -> float:
    """The smallest noise multiplier z (to 0.1 %) whose epsilon after ``steps`` releases is at most
    ``target``; ValueError when no z up to 1e4 reaches it. Bisection on a 10x coarser PLD grid (an
    upper bound, 10x faster), then z raised by 0.1 % steps until the reported epsilon is within."""
    coarse = 10 * DISCRETIZATION

    def within(z: float, grid: float | None) -> bool:
        return epsilon(accountant, adjacency, q, z, steps, delta, grid) <= target

    lo, hi = 1e-2, 1e4
    if not within(hi, coarse):
        raise ValueError(f"{target:g} is not reachable in {steps} releases with any noise multiplier")
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if within(mid, coarse) else (mid, hi)
    while not within(hi, None):  # the reported epsilon (a large one: the coarse grid's, up to 1 % above)
        hi *= 1.001
    return hi


def default_delta(num_clients: int) -> float:
    """min(1/N^2, 1e-5): a client-level delta well below 1/N (a mechanism that publishes one random
    client's data whole is (0, 1/N)-DP)."""
    return min(float(num_clients) ** -2, 1e-5)
