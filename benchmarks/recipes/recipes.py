"""Do the recipes learn? Runs every recipe in ``configs/*.toml`` (not ``configs/benchmarks/``) as
written, on its own data and (where cheap) on similar data, and writes
``benchmarks/results/recipes.md`` and ``recipes.json`` (issue 13, item 6).

Experiments (named runs on :mod:`fedtune.harness`, resumable: a run whose ``summary.json`` holds the
very same config is skipped):

- ``own``: each recipe exactly as written (its data, model, method, rounds, seed), except for the
  options below, which the report states.
- ``similar``: the same recipe on a similar data set (:data:`SIMILAR`: a sentiment recipe on the
  other sentiment set and on AG News, an image recipe on digits as well as Fashion-MNIST), since a
  recipe is a promise on similar data too. Only the data set changes (plus a test subsample for
  the large test sets, named in the table).

Each row: recipe, task, method, rounds run (of the rounds written), final accuracy, the mean of the
last :data:`LAST` evaluations, the reference rate the task names (majority class; chance 1/N for
few-shot; majority answer for instruction tasks), and whether the run is **clearly above** it
(:func:`clearly_above`).

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/recipes/recipes.py --plan
    ... [--only own] [--recipes fslora,fedit] [--rounds 10] [--workers 2]
    ... --report-only              # rewrite recipes.md / recipes.json from the run folders
    ... --quick                    # smoke test: 2 rounds, 2 local steps, small data, scratch folder
    ... --set key=value            # an extra override on every run (stated in the report)

``--rounds`` shortens every recipe (the report says so); ``--quick`` writes to
``benchmarks/results/_scratch/recipes-quick/``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from recipes_report import write_reports
from recipes_runs import (
    EXPERIMENTS,
    QUICK,
    QUICK_RESULTS,
    REPO,
    RESULTS,
    SIMILAR_MAX_MINUTES,
    Options,
    build_recipes_plan,
    recipes,
    rough_cost_s,
)

from fedtune import harness
from fedtune.config import ConfigError


def parse_args(argv: list[str] | None = None):
    p = harness.suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="recipe", budget_minutes=240.0)
    p.add_argument("--recipes", default="", help="comma-separated recipe names (file stems) to run; default all")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="short-round override: cap every recipe's rounds at this (stated in the report)",
    )
    p.add_argument("--eval-every", type=int, default=None, help="evaluation interval override (stated)")
    p.add_argument(
        "--similar-max-minutes",
        type=float,
        default=SIMILAR_MAX_MINUTES,
        help="similar-data runs only for recipes estimated at most this long on one core "
        f"(default {SIMILAR_MAX_MINUTES:g}; 'inf' for all)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra override on every run (stated in the report); repeatable",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = [e for e in EXPERIMENTS if e in {x.strip() for x in args.only.split(",")}]
    unknown = [e for e in args.only.split(",") if e.strip() and e.strip() not in EXPERIMENTS]
    paths = recipes()
    wanted = [x.strip().removesuffix(".toml") for x in args.recipes.split(",") if x.strip()]
    missing = [w for w in wanted if w not in {p.stem for p in paths}]
    if unknown or missing or not selected:
        print(
            f"--only: unknown {unknown}"
            if unknown
            else f"--recipes: no configs/{missing[0]}.toml"
            if missing
            else "--only: nothing selected"
        )
        return 2
    if wanted:
        paths = [p for p in paths if p.stem in wanted]
    seeds = None if args.seeds.strip() in ("", "recipe") else tuple(int(s) for s in args.seeds.split(","))
    options = Options(
        args.rounds,
        args.eval_every,
        seeds,
        tuple([*(QUICK if args.quick else []), *args.sets]),
        args.similar_max_minutes,
        args.quick,
    )
    out = harness.output_dir(args, RESULTS, QUICK_RESULTS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        # the report covers every recipe and experiment; the command runs the --recipes subset of it
        whole = build_recipes_plan(recipes(), options, out / "recipes", options.similar_max_minutes)
    except (harness.SuiteError, ConfigError) as exc:
        print(exc)
        return 2
    names = {p.name for p in paths}
    plan = {e: [s for s in specs if s.labels["recipe"] in names] for e, specs in whole.items()}
    runs = harness.distinct_runs(plan, selected)
    costs = {s.key: rough_cost_s(s.config, _previous(s)) for s in runs}
    command = harness.suite_command("benchmarks/recipes/recipes.py", argv)
    print(f"recipes: {len(paths)} in configs/, experiments {', '.join(selected)} -> {out}")
    return harness.run_suite(
        plan,
        selected,
        args,
        costs,
        lambda: write_reports(whole, out, command, options, EXPERIMENTS),
        root=REPO,
        notes=["estimate: rough (a finished run's own time, else per-model step guesses)"],
    )


def _previous(spec: harness.RunSpec) -> dict[str, Any] | None:
    """The summary of an earlier run in the spec's folder (any config), for the cost estimate."""
    try:
        return json.loads((spec.run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
