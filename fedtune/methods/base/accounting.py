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

What a run released is its :class:`Ledger` (each release with its own z and q, kept in the
checkpoint); the epsilon a run reports is their composition (:func:`composed`), never re-derived
from today's config.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from functools import lru_cache

import numpy as np

from fedtune.config.privacy import MIN_NOISE_MULTIPLIER

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


Event = tuple[float, float, int]  # (q, z, n): n Gaussians of multiplier z on Poisson samples of rate q


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
    return _composed(accountant, adjacency, ((q, z, int(steps)),), delta, grid)


@lru_cache(maxsize=4096)
def composed(accountant: str, adjacency: str, events: tuple[Event, ...], delta: float) -> float:
    """Epsilon at ``delta`` of the composition of ``events`` (each (q, z, n): n releases of the
    Gaussian of multiplier z on a Poisson sample of rate q), as :func:`epsilon` reports it; events
    of one (q, z) are merged, so releases of one kind give exactly :func:`epsilon`'s number (the
    one :func:`calibrate` checks a target against)."""
    merged: dict[tuple[float, float], int] = {}
    for q, z, n in events:
        if n > 0:
            merged[(q, z)] = merged.get((q, z), 0) + int(n)
    if len(merged) <= 1:
        ((q, z), n), *_ = [*merged.items(), ((1.0, 1.0), 0)]
        return epsilon(accountant, adjacency, q, z, n, delta)
    return _composed(accountant, adjacency, tuple((q, z, n) for (q, z), n in sorted(merged.items())), delta, None)


def _composed(accountant: str, adjacency: str, events: tuple[Event, ...], delta: float, grid: float | None) -> float:
    """:func:`composed` on ``grid`` (None: the coarse grid where it is within 1 %, see :func:`epsilon`)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    events = tuple(e for e in events if e[2] > 0)
    if not events:
        return 0.0
    relation = dp_accounting.NeighboringRelation
    if accountant == "rdp":
        logging.getLogger("absl").setLevel(logging.ERROR)  # its orders that fail to converge are left out, loudly
        tracker = RdpAccountant(neighboring_relation=relation.ADD_OR_REMOVE_ONE)
        for q, z, n in events:
            if adjacency == "replace-one":
                if q < 1:
                    raise ValueError("the RDP accountant has no Poisson-sampled Gaussian under replace-one adjacency")
                tracker.compose(dp_accounting.GaussianDpEvent(z / 2.0), n)  # q = 1: replace-one moves the sum by 2C
            else:
                tracker.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
        return float(tracker.get_epsilon(delta))
    if grid is None:  # a large epsilon first on the coarse grid (a tiny z: minutes on the fine one)
        coarse = _composed(accountant, adjacency, events, delta, COARSE_DISCRETIZATION)
        if sum(n for _, _, n in events) * COARSE_DISCRETIZATION <= 0.01 * coarse:
            return coarse
        grid = DISCRETIZATION
    rel = relation.REPLACE_ONE if adjacency == "replace-one" else relation.ADD_OR_REMOVE_ONE
    tracker = PLDAccountant(rel, value_discretization_interval=grid)
    for q, z, n in events:
        tracker.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
    return float(tracker.get_epsilon(delta))


def calibrate(accountant: str, adjacency: str, q: float, steps: int, delta: float, target: float) -> float:
    """The smallest noise multiplier z (to 0.1 %) whose epsilon after ``steps`` releases is at most
    ``target``; ValueError when no z up to 1e4 reaches it. Bisection on a 10x coarser PLD grid (an
    upper bound, 10x faster), then z raised by 0.1 % steps until the reported epsilon is within."""
    coarse = 10 * DISCRETIZATION

    def within(z: float, grid: float | None) -> bool:
        return epsilon(accountant, adjacency, q, z, steps, delta, grid) <= target

    lo, hi = MIN_NOISE_MULTIPLIER, 1e4
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


class Ledger:
    """What a run's mechanism released, as the accountant composes it (:func:`composed`), never
    re-derived from today's config: one row per (z, q) it released at, ``[z, q, n_1, ..., n_S]``
    with each slot's releases at them (central: one slot, a round's aggregate; local: one per
    client, its uploads). Kept in the server's checkpoint, so a resume composes what was released."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.rows = np.zeros((0, 2 + slots))

    def record(self, z: float, q: float, slots: Iterable[int], times: int = 1) -> None:
        """``times`` releases at (``z``, ``q``) in each of ``slots`` (a slot may repeat)."""
        found = np.flatnonzero((self.rows[:, 0] == z) & (self.rows[:, 1] == q))
        if found.size == 0:
            self.rows = np.vstack([self.rows, np.concatenate([[z, q], np.zeros(self.slots)])])
        row = int(found[0]) if found.size else len(self.rows) - 1
        np.add.at(self.rows[row], 2 + np.asarray(list(slots), dtype=np.int64), times)

    @property
    def counts(self) -> np.ndarray:
        """(S,) int64: each slot's releases, whatever their z."""
        return self.rows[:, 2:].sum(axis=0).astype(np.int64)

    def released_at(self) -> list[tuple[float, float, int]]:
        """(z, q, the most releases of one slot) of every row that released something."""
        return [(float(r[0]), float(r[1]), int(r[2:].max())) for r in self.rows if r[2:].any()]

    def epsilon(self, accountant: str, adjacency: str, delta: float, then: tuple[float, float] | None = None) -> float:
        """The largest epsilon over slots of their releases, with one more at ``then`` = (z, q)
        in each (the next release, priced before it is made)."""
        worst = 0.0
        for counts in self._maximal():
            events = [(float(q), float(z), int(n)) for (z, q), n in zip(self.rows[:, :2], counts)]
            if then is not None:
                events.append((then[1], then[0], 1))
            worst = max(worst, composed(accountant, adjacency, tuple(events), delta))
        return worst

    def _maximal(self) -> list[np.ndarray]:
        """The slots' release vectors (one count per row) that no other slot's dominates: only
        they can give the largest epsilon."""
        if len(self.rows) == 0:
            return [np.zeros(0)]
        vectors = np.unique(self.rows[:, 2:].T, axis=0)
        return [v for v in vectors if not any((u >= v).all() and (u > v).any() for u in vectors)]

    def load(self, rows: np.ndarray) -> None:
        """Restore :attr:`rows` (a checkpoint's); ValueError naming what is wrong with them."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != 2 + self.slots or rows.dtype != np.float64:
            raise ValueError(f"float64 rows of {2 + self.slots} values expected, got {rows.dtype}{list(rows.shape)}")
        counts = rows[:, 2:]
        if not (np.isfinite(rows).all() and (rows[:, 0] > 0).all() and ((rows[:, 1] > 0) & (rows[:, 1] <= 1)).all()):
            raise ValueError("a row's z is not positive or its q not in (0, 1]")
        if (counts < 0).any() or (counts != np.round(counts)).any():
            raise ValueError("a release count is not a non-negative integer")
        self.rows = rows.copy()
