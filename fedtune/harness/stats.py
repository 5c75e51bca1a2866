"""Statistics over runs and seeds: pure functions of numbers and ``metrics.jsonl`` rounds.

A run's rounds are the objects of its ``metrics.jsonl`` (``round``, ``accuracy`` where evaluated,
``bytes_up``, ...). Suites report the mean and sample spread over seeds, and (for noisy runs)
the mean of the last few evaluations instead of the one final point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Curve = list[tuple[int, float, float]]  # (round, cumulative MB uploaded per client, metric)

#: clearly above: mean of the last evaluations >= reference + max(MIN_MARGIN, Z * binomial SE)
MIN_MARGIN = 0.02
Z = 3.0


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof = 1; 0 for one value; ``(None, None)`` for none)."""
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def evaluations(rounds: Sequence[dict[str, Any]], metric: str = "accuracy", num_clients: int = 1) -> Curve:
    """``(round, cumulative MB uploaded / num_clients, metric)`` at each round that has ``metric``."""
    total, points = 0, []
    for r in rounds:
        total += r.get("bytes_up") or 0
        if r.get(metric) is not None:
            points.append((r["round"], total / 1e6 / num_clients, r[metric]))
    return points


def mean_of_last(rounds: Sequence[dict[str, Any]], n: int, metric: str = "accuracy") -> float | None:
    """Mean of ``metric`` over the run's last ``n`` evaluations (fewer if it has fewer; None if none):
    less noisy than the final point alone."""
    if n < 1:
        raise ValueError(f"mean_of_last: n must be at least 1, got {n}")
    return mean([p[2] for p in evaluations(rounds, metric)[-n:]])


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """Seed-averaged curve over the rounds that every non-empty curve evaluated."""
    curves = [c for c in curves if c]
    if not curves:
        return []
    rounds = sorted(set.intersection(*[{p[0] for p in c} for c in curves]))
    out = []
    for rnd in rounds:
        pts = [next(p for p in c if p[0] == rnd) for c in curves]
        out.append((rnd, sum(p[1] for p in pts) / len(pts), sum(p[2] for p in pts) / len(pts)))
    return out


def clearly_above(
    mean_last: float | None, final: float | None, reference: float | None, test_examples: int | None
) -> tuple[bool | None, float | None]:
    """(clearly above the reference?, the margin it needed). Clearly above: the mean of the last
    evaluations beats the reference by at least max(MIN_MARGIN, Z standard errors of an accuracy
    at the reference rate on the test set: Z sqrt(p (1 - p) / n)), and the final evaluation alone is
    above the reference (a run that collapsed at the end is not). None: no result yet."""
    if mean_last is None or final is None or reference is None:
        return None, None
    n = max(1, int(test_examples or 1))
    margin = max(MIN_MARGIN, Z * math.sqrt(reference * (1 - reference) / n))
    return bool(mean_last - reference >= margin and final > reference), margin
