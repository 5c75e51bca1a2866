"""References for the privacy tests that share no code with fedtune's accountant."""

from __future__ import annotations

import math

from scipy import optimize
from scipy.stats import norm


def gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of a Gaussian mechanism whose neighbours' outputs differ by
    ``mu`` standard deviations (mu-GDP; Balle and Wang 2018, Theorem 8: delta(eps) =
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)), solved numerically. T compositions of one
    Gaussian of shift mu are one Gaussian of shift sqrt(T) mu."""

    def gap(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return float(optimize.brentq(gap, 0.0, 200.0, xtol=1e-12))
