"""Summarise fedtune run folders (``summary.json`` + ``metrics.jsonl``) as a markdown table and plots;
a budgeted run (``plan.json``) also gets its clients' predicted against measured costs.

The building blocks are shared with the benchmark suites (:mod:`fedtune.harness`): :func:`load_run`
reads a run folder, :func:`table_lines` writes any markdown table, and :func:`figure` is the one
plotting context (Agg backend, ``tight_layout``, 120 dpi, always closed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from fedtune.errors import FedtuneError
from fedtune.output_files import check_free, write_output

__all__ = [
    "ReportError",
    "RunRecord",
    "load_run",
    "table_lines",
    "markdown_table",
    "cumulative_mb_up",
    "pyplot",
    "figure",
    "plot_runs",
    "make_report",
]

_EXPECTED = "expected a fedtune run folder"
_COLUMNS = [
    "Run",
    "Method",
    "Data",
    "Rounds",
    "Final acc (%)",
    "Best acc (%)",
    "Majority acc (%)",
    "Final loss",
    "MB up",
    "MB down",
    "Wall s",
]


class ReportError(FedtuneError, ValueError):
    """An unreadable run folder; the message is one line naming the file."""


@dataclass
class RunRecord:
    """One run: its ``summary.json`` object and its per-round ``metrics.jsonl`` objects."""

    path: Path
    summary: dict[str, Any]
    rounds: list[dict[str, Any]]

    @property
    def name(self) -> str:
        return str(self.summary.get("name") or self.path.name)


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise ReportError(f"{path}: file not found ({_EXPECTED})")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ReportError(f"{path}: not UTF-8 text ({_EXPECTED})") from None
    except OSError as exc:
        raise ReportError(f"{path}: cannot be read ({exc.strerror}; {_EXPECTED})") from None


#: the numbers the table and plots read: a summary's and a round's (None or absent: not measured)
SUMMARY_NUMBERS = (
    "rounds",
    "best_accuracy",
    "final_accuracy",
    "majority_accuracy",
    "final_loss",
    "total_bytes_up",
    "total_bytes_down",
    "wall_s",
)
ROUND_NUMBERS = ("accuracy", "loss", "bytes_up")


def _check_numbers(value: dict[str, Any], keys: Sequence[str], where: str) -> dict[str, Any]:
    """``value`` once each of ``keys`` it holds is a number or null; else :class:`ReportError`."""
    for key in keys:
        x = value.get(key)
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise ReportError(f"{where}: {key} is {x!r} (expected a number)")
    return value


def _check_round(value: dict[str, Any], where: str) -> dict[str, Any]:
    rnd = value.get("round")
    if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 1:
        raise ReportError(f"{where}: round is {rnd!r} (expected a round number, 1 or more)")
    return _check_numbers(value, ROUND_NUMBERS, where)


def _parse_object(text: str, where: str, expected: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}; expected {expected})") from None
    if not isinstance(value, dict):
        raise ReportError(f"{where}: got {type(value).__name__} (expected {expected})")
    return value


def load_run(run_dir: Path) -> RunRecord:
    """Load ``run_dir/summary.json`` and ``run_dir/metrics.jsonl``; raise :class:`ReportError` if unreadable."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: folder not found ({_EXPECTED})")
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    summary = _parse_object(_read_text(summary_path), str(summary_path), "a JSON object")
    _check_numbers(summary, SUMMARY_NUMBERS, str(summary_path))
    rounds = [
        _check_round(_parse_object(line, where, "one JSON object per round"), where)
        for n, line in enumerate(_read_text(metrics_path).splitlines(), start=1)
        if line.strip() and (where := f"{metrics_path}, line {n}")
    ]
    return RunRecord(run_dir, summary, rounds)


def _accuracies(run: RunRecord) -> list[float]:
    return [r["accuracy"] for r in run.rounds if r.get("accuracy") is not None]


def _fmt(value: Any, spec: str = "", scale: float = 1) -> str:
    return "–" if value is None else format(value * scale, spec)


def table_lines(columns: Sequence[str], rows: Sequence[Sequence[str]] = ()) -> list[str]:
    """The lines of a GitHub markdown table: the header, the ``---`` separator, one line per row."""
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def markdown_table(runs: list[RunRecord]) -> str:
    """A GitHub markdown table with one row per run; missing values render as ``–``."""
    rows = []
    for run in runs:
        s = run.summary
        best = s.get("best_accuracy", max(_accuracies(run), default=None))
        cells = [
            run.name.replace("|", "\\|"),
            str(s.get("method") or "–"),
            str(s.get("data") or "–"),
            _fmt(s.get("rounds")),
            _fmt(s.get("final_accuracy"), ".2f", 100),
            _fmt(best, ".2f", 100),
            _fmt(s.get("majority_accuracy"), ".2f", 100),
            _fmt(s.get("final_loss"), ".4f"),
            _fmt(s.get("total_bytes_up"), ".3f", 1e-6),
            _fmt(s.get("total_bytes_down"), ".3f", 1e-6),
            _fmt(s.get("wall_s"), ".1f"),
        ]
        rows.append(cells)
    return "\n".join(table_lines(_COLUMNS, rows)) + "\n"


def cumulative_mb_up(rounds: list[dict[str, Any]]) -> list[float]:
    """Megabytes uploaded up to and including each round (one value per round)."""
    total, out = 0, []
    for r in rounds:
        total += r.get("bytes_up") or 0
        out.append(total / 1e6)
    return out


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(path: Any, *args: Any, metadata: dict | None = None, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(*args, **kwargs)`` as ``(fig, axes)``; on leaving the block without an error
    the figure is laid out tightly and saved to ``path`` (a file or a binary buffer: PNG) at 120 dpi,
    with the image's ``metadata``. It is closed either way."""
    plt = pyplot()
    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=120, format="png", metadata=metadata)
    finally:
        plt.close(fig)


PNG_MARK = "fedtune report"  # the PNG's Software text: a plot fedtune may replace


def _our_plot(path: Path) -> bool:
    with path.open("rb") as f:
        return PNG_MARK.encode() in f.read(4096)


def _our_report(path: Path) -> bool:
    header = table_lines(_COLUMNS)[0].encode()
    with path.open("rb") as f:
        return f.read(len(header)) == header


def plot_runs(runs: list[RunRecord], out_dir: Path) -> list[Path]:
    """Write ``accuracy_vs_round.png`` and ``accuracy_vs_mb_up.png`` into ``out_dir``; return their
    paths (:func:`~fedtune.output_files.write_output`: never over a file fedtune did not write)."""
    import io

    out_dir = Path(out_dir)
    specs = [
        ("accuracy_vs_round.png", "Round", "Accuracy vs round", lambda run: [r.get("round") for r in run.rounds]),
        (
            "accuracy_vs_mb_up.png",
            "Cumulative MB uploaded",
            "Accuracy vs upload",
            lambda run: cumulative_mb_up(run.rounds),
        ),
    ]
    for filename, *_ in specs:
        check_free(out_dir / filename, _our_plot, "--out")
    paths = []
    for filename, xlabel, title, xs_of in specs:
        image = io.BytesIO()
        with figure(image, figsize=(6, 4), metadata={"Software": PNG_MARK}) as (fig, ax):
            for run in runs:
                pts = [(x, r["accuracy"]) for x, r in zip(xs_of(run), run.rounds) if r.get("accuracy") is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=run.name)
            ax.set(title=title, xlabel=xlabel, ylabel="Accuracy")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        write_output(out_dir / filename, image.getvalue(), _our_plot, "--out")
        paths.append(out_dir / filename)
    return paths


def make_report(run_dirs: list[Path], out_dir: Path | None = None) -> tuple[str, list[Path]]:
    """Load runs, write ``report.md`` and the plots to ``out_dir`` (default: first run's parent),
    replacing only files an earlier report wrote there (else one line, nothing written)."""
    if not run_dirs:
        raise ReportError("no run folders given (expected at least one fedtune run folder)")
    runs = [load_run(Path(d)) for d in run_dirs]
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dirs[0]).parent
    if out_dir.exists() and not out_dir.is_dir():
        raise ReportError(f"--out {str(out_dir)!r}: exists and is not a folder; name a folder")
    markdown = markdown_table(runs)
    report = out_dir / "report.md"
    check_free(report, _our_report, "--out")
    paths = plot_runs(runs, out_dir)
    markdown += _budget_sections(runs, out_dir, paths)
    write_output(report, markdown.encode("utf-8"), _our_report, "--out")
    return markdown, [report, *paths]


def _budget_sections(runs: list[RunRecord], out_dir: Path, paths: list[Path]) -> str:
    """For each budgeted run (a ``plan.json``): its predicted-against-measured tables, and its plot
    ``budgets_<run>.png`` appended to ``paths``."""
    import io

    text = ""
    for run in runs:
        rows = client_rows(run.path, run.rounds)
        if rows is None:
            continue
        text += budget_markdown(run.name, rows)
        path = out_dir / f"budgets_{run.path.name}.png"
        check_free(path, _our_plot, "--out")
        image = io.BytesIO()
        plot_budgets(rows, image, f"{run.name}: predicted against measured per client")
        write_output(path, image.getvalue(), _our_plot, "--out")
        paths.append(path)
    return text


# -- budgets: a budgeted run's plan (``plan.json``) against what its rounds measured ----------------
# Measured, per client over the rounds it trained in: its peak memory (the largest
# ``client_peak_bytes``; only clients with a ``memory_gib`` are measured), its seconds per round
# (the mean ``client_compute_s``) and its MB uploaded per round (the mean ``client_bytes_up``). A
# device class's row is the mean over its clients of each column that has a value.

GIB, MB = 2**30, 1e6  # fedtune.planning.planner's units

#: (label, plan.json key, metrics.jsonl key, scale to the shown unit, how per-round values combine)
QUANTITIES = (
    ("peak GiB", "peak_bytes", "client_peak_bytes", 1 / GIB, max),
    ("s/round", "seconds", "client_compute_s", 1.0, mean),
    ("MB up/round", "upload_mb", "client_bytes_up", 1 / MB, mean),
)


@dataclass
class ClientRow:
    cid: int
    device_class: str
    setting: str
    predicted: list[float]  # per QUANTITIES
    measured: list[float | None]
    rounds: int  # rounds it trained in
    dropped: int  # rounds it was dropped in


def client_rows(run_dir: Path, rounds: list[dict]) -> list[ClientRow] | None:
    """One row per planned client of the run in ``run_dir`` (None: the run has no ``plan.json``)."""
    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        return None
    try:
        planned = json.loads(path.read_text(encoding="utf-8"))["clients"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ReportError(f"{path}: expected the plan's JSON object with a 'clients' list ({exc})") from None
    out = []
    for c in planned:
        key = str(c["cid"])
        trained = [r for r in rounds if key in r.get("client_compute_s", {}) and key not in r.get("dropped", {})]
        measured = []
        for _, _, metric, scale, combine in QUANTITIES:
            values = [r[metric][key] * scale for r in trained if key in r.get(metric, {})]
            measured.append(combine(values) if values else None)
        predicted = [c["peak_bytes"] / GIB, c["seconds"], c["upload_mb"]]
        dropped = sum(key in r.get("dropped", {}) for r in rounds)
        out.append(
            ClientRow(c["cid"], c["device_class"] or "-", c["setting"], predicted, measured, len(trained), dropped)
        )
    return out


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def budget_markdown(name: str, rows: list[ClientRow]) -> str:
    """The per-client and per-class tables of predicted against measured."""
    pairs = [f"{label} {kind}" for label, *_ in QUANTITIES for kind in ("predicted", "measured")]
    per_client = [
        [str(r.cid), r.device_class, r.setting]
        + [_cell(v) for p, m in zip(r.predicted, r.measured) for v in (p, m)]
        + [f"{r.rounds} / {r.dropped}"]
        for r in rows
    ]
    per_class = []
    for cls in sorted({r.device_class for r in rows}):
        members = [r for r in rows if r.device_class == cls]
        cells = []
        for i in range(len(QUANTITIES)):
            seen = [m for r in members if (m := r.measured[i]) is not None]
            cells += [_cell(mean(r.predicted[i] for r in members)), _cell(mean(seen) if seen else None)]
        per_class.append([cls, str(len(members)), *cells])
    return "\n".join(
        [
            f"\n### {name}: budgets, predicted against measured",
            "",
            *table_lines(["client", "class", "setting", *pairs, "rounds trained / dropped"], per_client),
            "",
            *table_lines(["class", "clients", *pairs], per_class),
            "",
        ]
    )


def plot_budgets(rows: list[ClientRow], path, title: str) -> None:
    """Predicted against measured, one panel per quantity, a point per measured client, coloured by class."""
    with figure(path, 1, len(QUANTITIES), figsize=(12, 4), metadata={"Software": PNG_MARK}) as (fig, axes):
        classes = sorted({r.device_class for r in rows})
        for i, (ax, (label, *_)) in enumerate(zip(axes, QUANTITIES)):
            for cls in classes:
                pts = [
                    (r.predicted[i], r.measured[i]) for r in rows if r.device_class == cls and r.measured[i] is not None
                ]
                if pts:
                    ax.scatter(*zip(*pts), label=cls, s=18)
            top = max([v for r in rows for v in (r.predicted[i], r.measured[i]) if v is not None], default=1.0)
            ax.plot([0, top], [0, top], color="grey", linewidth=0.8, linestyle="--")
            ax.set(title=label, xlabel="predicted", ylabel="measured")
            ax.grid(alpha=0.3)
        if axes[0].get_legend_handles_labels()[0]:
            axes[0].legend()
        fig.suptitle(title)
