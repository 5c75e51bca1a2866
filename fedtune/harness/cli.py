"""The standard command line of a suite and the steps every suite takes.

``suite_parser`` gives every suite the same options (``--only``, ``--seeds``, ``--quick``,
``--workers``, ``--budget-minutes``, ``--plan``, ``--report-only``, ``--out``); a suite adds its
own with ``parser.add_argument``, and a per-method learning-rate sweep with ``add_sweep_options``
(``--lr-grid``, ``--sweep-seed``), ``sweep_selection`` and ``sweep_first``. ``run_suite`` then
lists the plan with each run's state and estimate, stops there for ``--plan``, runs what is
unfinished in the worker pool (unless ``--report-only``) and writes the reports.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from fedtune.errors import FedtuneError
from fedtune.harness.choice import Sweep
from fedtune.harness.cost import makespan
from fedtune.harness.plan import Plan, RunSpec, distinct_runs
from fedtune.harness.pool import run_specs
from fedtune.harness.runs import run_state, unfinished


class SuiteError(FedtuneError, ValueError):
    """A bad command line for a suite; the message is one line."""


def suite_parser(
    description: str, experiments: Sequence[str], *, seeds: str = "0,1", workers: int = 2, budget_minutes: float = 120.0
) -> argparse.ArgumentParser:
    """An argument parser with the options every suite has (defaults: all ``experiments``, ``seeds``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(experiments), help=f"comma-separated subset of {','.join(experiments)}")
    p.add_argument("--seeds", default=seeds, help=f"comma-separated seeds (default {seeds})")
    p.add_argument("--quick", action="store_true", help="smoke test: a tiny model, a few rounds, a scratch folder")
    p.add_argument(
        "--workers", type=int, default=workers, help=f"parallel runs, one torch thread each (default {workers})"
    )
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=budget_minutes,
        help="time budget the up-front estimate is checked against (warns when exceeded)",
    )
    p.add_argument("--plan", action="store_true", help="print the runs and the estimate, run nothing")
    p.add_argument("--report-only", action="store_true", help="only rewrite the markdown and plots")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: the suite's results folder)")
    return p


def parse_selection(args: argparse.Namespace, experiments: Sequence[str]) -> tuple[list[str], list[int]]:
    """``--only`` (in the suite's experiment order) and ``--seeds`` as lists; :class:`SuiteError` if bad."""
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise SuiteError(f"--seeds: comma-separated integers expected, got {args.seeds!r}") from None
    selected = [e.strip() for e in args.only.split(",") if e.strip()]
    unknown = [e for e in selected if e not in experiments]
    if unknown:
        raise SuiteError(f"--only: unknown {unknown} (expected {list(experiments)})")
    if not seeds:
        raise SuiteError("--seeds: none given")
    return [e for e in experiments if e in selected], seeds


def output_dir(args: argparse.Namespace, results: Path, quick_results: Path) -> Path:
    """``--out``, else the suite's results folder (its scratch folder with ``--quick``), absolute."""
    return (args.out or (quick_results if args.quick else results)).resolve()


def offline_data(reads: str) -> None:
    """Run the suite's models and data offline (``HF_HUB_OFFLINE=1`` unless set); warn when
    ``FEDTUNE_DATA_DIR``, where ``reads`` (for example "sst2/agnews") come from, is not set."""
    if not os.environ.get("FEDTUNE_DATA_DIR"):
        print(f"warning: FEDTUNE_DATA_DIR is not set ({reads} read from it)", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def suite_command(script: str, argv: Sequence[str] | None = None) -> str:
    """The command that runs the suite as invoked (``--report-only`` dropped), for its reports."""
    data_dir = shlex.quote(os.environ.get("FEDTUNE_DATA_DIR", "../shared/data"))
    args = sys.argv[1:] if argv is None else argv
    return (
        f"HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR={data_dir} .venv/bin/python {script} "
        + " ".join(shlex.quote(a) for a in args if a != "--report-only")
    ).strip()


def estimate_minutes(specs: Sequence[RunSpec], costs: dict[str, float], workers: int) -> float:
    """Minutes the specs take on ``workers`` free cores (``costs``: seconds by spec key)."""
    return makespan([costs[s.key] for s in specs], workers) / 60


def print_plan(plan: Plan, selected: Sequence[str], costs: dict[str, float]) -> None:
    """Each selected experiment's runs with their state (``[done]``, ``[stale]``, ``[todo]``), the
    folder of a shared run and the run's estimate."""
    for experiment in selected:
        print(f"  {experiment}: {len(plan[experiment])} runs")
        for spec in plan[experiment]:
            shared = f" = {spec.owner}/{spec.folder.name}" if spec.shared else ""
            print(f"    [{run_state(spec)}] {spec.name}{shared}  (~{costs[spec.key] / 60:.1f} min)")


def add_sweep_options(
    parser: argparse.ArgumentParser,
    experiments: Sequence[str],
    swept: str,
    *,
    factors: bool = False,
    sweep_seed: int = 0,
) -> None:
    """``--lr-grid`` (or, with ``factors``, ``--lr-factors``: multiples of each method's own rate, for
    suites whose methods tune different step sizes) and ``--sweep-seed`` (see :func:`sweep_selection`);
    the ``sweep`` experiment leaves ``--only``'s default (it comes with the grid). ``swept``: what
    the rates apply to."""
    option, values = (
        ("--lr-factors", "multiples of each method's own rate") if factors else ("--lr-grid", "learning rates")
    )
    parser.add_argument(
        option,
        dest="lr_grid",
        default=None,
        help=f"comma-separated {values}: sweep {swept} over them on --sweep-seed, then run the "
        "experiments planned from the sweep at each one's chosen rate",
    )
    parser.add_argument(
        "--sweep-seed",
        type=int,
        default=sweep_seed,
        help=f"the seed whose sweep runs choose the rates (default {sweep_seed})",
    )
    parser.set_defaults(only=",".join(e for e in experiments if e != "sweep"), sweep_option=(option, values))


def sweep_selection(
    args: argparse.Namespace, selected: Sequence[str], dependents: Sequence[str]
) -> tuple[Sweep | None, list[str]]:
    """The grid option as a :class:`~fedtune.harness.choice.Sweep` (None without it) and the
    experiments to run: ``sweep`` joins the ``dependents`` (those planned from its choices) when
    they are selected; :class:`SuiteError` naming the option when bad."""
    selected = list(selected)
    option, values = args.sweep_option  # add_sweep_options's default
    if args.lr_grid is None:
        if "sweep" in selected:
            raise SuiteError(f"--only sweep: needs {option} (the {values} to sweep)")
        return None, selected
    grid = parse_grid(args.lr_grid, option, values)
    if any(e in dependents for e in selected) and "sweep" not in selected:
        selected = ["sweep", *selected]
    return Sweep(grid, args.sweep_seed), selected


def parse_grid(text: str, option: str, values: str = "learning rates") -> tuple[float, ...]:
    """A comma-separated grid of positive numbers, ascending; :class:`SuiteError` naming ``option``
    when one is not a positive number or two print alike (run names carry each value as ``{:g}``)."""
    try:
        grid = tuple(sorted({float(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        grid = ()
    if not grid or not all(v > 0 and math.isfinite(v) for v in grid):
        raise SuiteError(f"{option}: expected comma-separated positive {values}, got {text!r}")
    if len({f"{v:g}" for v in grid}) < len(grid):
        raise SuiteError(f"{option}: values must differ in their first 6 significant digits, got {text!r}")
    return grid


def biased_seed_warning(
    sweep: Sweep | None, seeds: Sequence[int], selected: Sequence[str], dependents: Sequence[str]
) -> None:
    """Warn when a run of the chosen rates uses the seed that chose them (its figure is biased)."""
    if sweep and sweep.seed in seeds and any(e in dependents for e in selected):
        print(
            f"warning: the sweep seed {sweep.seed} is among --seeds: its run at the chosen rate is the run that "
            "chose it (a biased figure)",
            flush=True,
        )


def sweep_first(
    stage: Callable[[list[str]], int],
    selected: Sequence[str],
    args: argparse.Namespace,
    sweep: str | Sequence[str] = "sweep",
) -> int:
    """Run the ``selected`` experiments through ``stage`` (which plans and runs them); when they hold
    a ``sweep`` (one name, or several) and experiments planned from its choices, the sweeps run first
    and the rest is planned afterwards, from their finished runs (not for ``--plan`` or
    ``--report-only``). Returns the worse exit status."""
    sweeps = [sweep] if isinstance(sweep, str) else list(sweep)
    first, rest = [e for e in selected if e in sweeps], [e for e in selected if e not in sweeps]
    if first and rest and not (args.plan or args.report_only):
        return max(stage(first), stage(rest))
    return stage(list(selected))


class Start(NamedTuple):
    """What every suite starts from (:func:`suite_start`)."""

    selected: list[str]
    seeds: list[int]
    out: Path
    command: str
    sweep: Sweep | None


def suite_start(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    script: str,
    experiments: Sequence[str],
    results: Path,
    quick_results: Path,
    reads: str,
    swept: Sequence[str] | None = None,
    swept_results: Path | None = None,
) -> Start:
    """The steps every suite starts with: the selection and seeds (:func:`parse_selection`); with
    ``swept`` (the experiments planned from a sweep) the sweep (:func:`sweep_selection`, results to
    ``swept_results`` when given, :func:`biased_seed_warning`); the output folder; offline data
    (:func:`offline_data`, ``reads``); the reports' command line for ``script`` (the suite's
    ``__file__``, written as ``benchmarks/<suite>/<script>.py``)."""
    selected, seeds = parse_selection(args, experiments)
    sweep = None
    if swept is not None:
        sweep, selected = sweep_selection(args, selected, swept)
        biased_seed_warning(sweep, seeds, selected, swept)
    out = output_dir(args, swept_results if sweep and swept_results else results, quick_results)
    offline_data(reads)
    return Start(selected, seeds, out, suite_command("/".join(Path(script).resolve().parts[-3:]), argv), sweep)


def suite_main(main: Callable[..., int]) -> Callable[..., int]:
    """A suite's ``main(argv)`` whose bad options (:class:`SuiteError`, raised anywhere in it) print
    as their one line and exit with status 2."""

    @functools.wraps(main)
    def checked(argv: Sequence[str] | None = None) -> int:
        try:
            return main(argv)
        except SuiteError as exc:
            print(exc)
            return 2

    return checked


def run_suite(
    plan: Plan,
    selected: Sequence[str],
    args: argparse.Namespace,
    costs: dict[str, float],
    write_reports: Callable[[], list[Path]],
    *,
    root: Path,
    notes: Sequence[str] = (),
) -> int:
    """The standard steps once the suite has its plan: print it (``costs``: estimated seconds by spec
    key; ``notes``: extra lines, such as the cost model's source), stop for ``--plan``, run the
    unfinished runs in ``--workers`` processes (unless ``--report-only``), then ``write_reports()``
    (paths printed relative to ``root``). Returns the exit status, 0 or 1 when runs failed (they
    are listed; rerun the command to retry them); exits 130 on Ctrl-C."""
    runs = distinct_runs(plan, selected)
    pending = unfinished(runs)
    stale = [s for s in pending if run_state(s) == "stale"]
    print_plan(plan, selected, costs)
    print(
        f"{sum(len(plan[e]) for e in selected)} runs listed, {len(runs)} distinct configs, {len(pending)} to run"
        + (f" ({len(stale)} stale: finished with another config, will be overwritten)" if stale else "")
        + "."
    )
    for line in notes:
        print(line)
    estimate = estimate_minutes(pending, costs, args.workers)
    print(
        f"estimate: {estimate:.0f} min for the pending runs on {args.workers} workers with free cores; whole "
        f"selection {estimate_minutes(runs, costs, args.workers):.0f} min",
        flush=True,
    )
    if estimate > args.budget_minutes:
        print(f"warning: the estimate {estimate:.0f} min exceeds --budget-minutes {args.budget_minutes:g}", flush=True)
    if args.plan:
        return 0
    failures: list[str] = []
    if not args.report_only:
        start = time.perf_counter()
        failures, interrupted = run_specs(pending, costs, args.workers)
        print(
            f"runs {'stopped' if interrupted else 'finished'} after {(time.perf_counter() - start) / 60:.1f} min; "
            f"{len(failures)} failed",
            flush=True,
        )
        if interrupted:  # skip the pool's exit-time joins (they wait on the terminated workers)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
    written = write_reports()
    print("wrote " + ", ".join(os.path.relpath(p, root) for p in written if p.exists()))
    if failures:
        print("failed runs:\n  " + "\n  ".join(failures))
        return 1
    return 0
