"""Report helpers over planned runs, built on :mod:`fedtune.report`.

Cells render a group of specs (usually one configuration over several seeds): ``pending`` or
``–`` until a run is finished, ``mean ± sample std`` of percentages, ``(n=…)`` when only some of
the group's runs are finished. Plots use :func:`fedtune.report.figure`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedtune.harness import stats
from fedtune.harness.plan import RunSpec
from fedtune.harness.runs import load_rounds, load_summary
from fedtune.report import figure, pyplot, table_lines

__all__ = [
    "figure",
    "pyplot",
    "table_lines",
    "percent",
    "mean_text",
    "per_device_mb",
    "curve",
    "averaged_curve",
    "run_accuracy",
    "final_accuracy",
    "accuracy_cell",
    "upload_cell",
    "runs_section",
]


def produced_by(command: str) -> list[str]:
    """The lines of a report that give the command which produced it (a bash block)."""
    return ["Produced by", "", "```bash", command, "```", ""]


def percent(values: Sequence[float | None]) -> str:
    """``mean ± std`` of the values in percent (``.2f``; None values skipped), or ``pending``."""
    m, s = stats.mean_std([100 * v for v in values if v is not None])
    return "pending" if m is None else f"{m:.2f} ± {s:.2f}"


def mean_text(values: Sequence[float | None], spec: str = ".2f") -> str:
    """The mean of the values that are not None, formatted with ``spec``, or ``–``."""
    m = stats.mean(values)
    return "–" if m is None else format(m, spec)


def per_device_mb(spec: RunSpec, summary: dict[str, Any]) -> float | None:
    """Megabytes the run uploaded per client (all clients' bytes / number of clients); None for a
    DP run, which releases no bytes."""
    if "total_bytes_up" not in summary:
        return None
    return summary["total_bytes_up"] / 1e6 / spec.resolved.federation.num_clients


def curve(spec: RunSpec, metric: str = "accuracy") -> stats.Curve:
    """The finished run's ``(round, cumulative MB up per client, metric)`` at its evaluated rounds."""
    return stats.evaluations(load_rounds(spec), metric, spec.resolved.federation.num_clients)


def averaged_curve(specs: Sequence[RunSpec], metric: str = "accuracy") -> stats.Curve:
    """The seed average of the finished runs' curves, over the rounds all of them evaluated."""
    return stats.mean_curve([curve(s, metric) for s in specs])


def plot_curve(ax: Any, specs: Sequence[RunSpec], *style: str, metric: str = "accuracy", upload: bool = False, **kw):
    """Plot the seed-averaged ``metric`` curve of ``specs`` in % (:func:`averaged_curve`) on ``ax``
    against the round, or with ``upload`` the MB uploaded per device, dots marked (``kw`` passes to
    ``ax.plot``); whether any run has finished."""
    pts = averaged_curve(specs, metric)
    if pts:
        x = [p[1] if upload else p[0] for p in pts]
        ax.plot(x, [100 * p[2] for p in pts], *style, **{"marker": "o", "ms": 3, **kw})
    return bool(pts)


def finish_axes(ax: Any, fontsize: int = 7, **labels: Any) -> None:
    """``ax.set(**labels)`` (title, axis labels, scales), a light grid, and a legend of size
    ``fontsize`` when anything on ``ax`` is labelled."""
    ax.set(**labels)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=fontsize)


def run_accuracy(spec: RunSpec, last: int | None = None) -> float | None:
    """The finished run's final accuracy, or with ``last`` the mean of its last ``last`` evaluations
    (:func:`~fedtune.harness.stats.mean_of_last`); None while unfinished."""
    if last is not None:
        return stats.mean_of_last(load_rounds(spec), last)
    summary = load_summary(spec)
    return summary.get("final_accuracy") if summary else None


def final_accuracy(specs: Sequence[RunSpec], last: int | None = None) -> tuple[float | None, float | None, int]:
    """Mean and sample std over the finished runs of their :func:`run_accuracy` in percent, and how
    many runs have one."""
    accs = [100 * a for a in (run_accuracy(s, last) for s in specs) if a is not None]
    m, s = stats.mean_std(accs)
    return m, s, len(accs)


def accuracy_cell(specs: Sequence[RunSpec], last: int | None = None) -> str:
    """:func:`percent` over the group of each run's final accuracy (or the mean of its last ``last``
    evaluations), ``(n=…)`` if only some runs are finished, or ``pending``."""
    values = [run_accuracy(s, last) for s in specs]
    n = sum(v is not None for v in values)
    return percent(values) + (f" (n={n})" if 0 < n < len(specs) else "")


def upload_cell(specs: Sequence[RunSpec]) -> str:
    """Mean MB uploaded per client over the group's finished runs (``.3f``), or ``–``."""
    return mean_text([per_device_mb(s, x) for s in specs if (x := load_summary(s))], ".3f")


def runs_section(specs: Sequence[RunSpec], out: Path) -> str:
    """``## Runs``: one row per spec with its folder (relative to ``out``), final accuracy, rounds,
    MB up per client and wall seconds; ``pending`` for unfinished runs."""
    rows = []
    for spec in specs:
        s = load_summary(spec)
        folder = os.path.relpath(spec.folder, out)
        shared = f" (shared with {spec.owner})" if spec.shared else ""
        if s is None:
            rows.append([spec.name, f"`{folder}`{shared}", "pending", str(spec.resolved.rounds), "–", "–"])
            continue
        acc = "–" if s.get("final_accuracy") is None else f"{100 * s['final_accuracy']:.2f}"
        rows.append(
            [
                spec.name,
                f"`{folder}`{shared}",
                acc,
                str(s["rounds"]),
                mean_text([per_device_mb(spec, s)], ".3f"),
                mean_text([s.get("wall_s")], ".0f"),
            ]
        )
    columns = ["run", "folder", "final acc (%)", "rounds", "MB up / device", "wall s"]
    return "\n".join(["## Runs", "", *table_lines(columns, rows)]) + "\n"
