"""CPU-scale counterparts of the RABO paper's experiments (Li et al., "Distributed Bilevel
Optimization with Dual Pruning for Resource-limited Clients", Sec. V), written to
``benchmarks/results/rabo/``.

Experiments (named runs on :mod:`fedtune.harness`; a few-shot run is
``configs/benchmarks/rabo-suite.toml`` + its N-way K-shot and method overlays from
``rabo-suite-overlays.toml`` + the experiment's settings; a loss-tuning run starts from
``rabo-losstune-suite.toml``):

- ``sweep`` (with ``--lr-factors``): each method on 5-way 1-shot at every multiple of its own step
  size (the bilevel methods' outer step ``options.outer_lr``, the single-level methods' AdamW
  ``train.lr``) on ``--sweep-seed`` (default 3, outside the table seeds); the multiple with the
  highest Table II figure (mean of the last 3 evaluations at multiples of 10 updates) is that
  method's choice, which Table II (every column) and Table III then run. Factor 1 is the recipe's
  rate, so its table runs are the unswept suite's. The swept protocol writes its reports to the
  same ``benchmarks/results/rabo/`` (replacing the unswept ``table2.md`` / ``table3.md``; each
  says which protocol it reports) so that factor-1 runs are not run twice. Figure 5's loss-tuning
  problem has its own sweep on the same seed over ``--lt-factors`` (default 0.1, 0.3, 1, 3, 10,
  30), scored by the mean of the last 3 evaluations' balanced accuracy: there a factor scales every
  step size the method takes (bilevel: the VS-loss step ``options.outer_lr`` and the model step
  ``options.inner_lr`` together; single-level: ``train.lr``).
- ``table2``: Table II. RABO, RAFBO, full-model bilevel (FedMBO style), FedAvg, Static (HeteroFL),
  FedRolex, FIARSE on Omniglot 5-way / 20-way, 1-shot / 5-shot; capacities two clients each of
  {1, 1/2, 1/4, 1/8, 1/16} (FedMBO and FedAvg: full model). Accuracy on held-out alphabets.
- ``fig4``: Figure 4. Client computation (FLOPs counted by torch, per client and round, short
  runs with ``options.count_flops``) and communication (bytes up + down per client and round, from
  Table II's 5-way 1-shot runs) of RABO and RAFBO against the full-model bilevel baseline.
- ``fig3``: Figure 3. Every client at capacity 1/4 on contiguous segments of every layer assigned
  so that the least-covered segment has C_x^* = 1 or 2 clients, 5-way 5-shot.
- ``table3``: Table III. RABO and RAFBO with 10, 20, 30, 50 clients (10 sampled per round beyond
  10), 5-way 1-shot and 5-shot, the same capacity mix.
- ``fig5``: Figure 5. VS-loss tuning on long-tailed Fashion-MNIST (all clients at capacity 1/2):
  the three bilevel methods against the single-level ones (plain cross-entropy, no tuning); with
  ``--lr-factors``, each method at its factor chosen by the loss-tuning sweep.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/rabo/run_suite.py \
        [--only table2] [--seeds 0,1,2]
    ... --plan          # the runs and the time estimate, nothing run
    ... --quick         # smoke test into benchmarks/results/_scratch/rabo-quick/
    ... --report-only   # rewrite the markdown and plots from the run folders that exist
    ... --settings w5s1,w5s5   # only these N-way K-shot columns of Table II
    ... --updates 30    # 30 backbone updates per client instead of 60 (every method's rounds alike)
    ... --methods rabo,fedmbo   # only these methods' runs
    ... --lr-factors 0.3,1,3 --only table2 --settings w5s1 --updates 30   # each method at its own rate
    ... --lr-factors 0.3,1,3,10,30,100 --lt-factors 0.1,0.3,1,3,10,30 --only fig5   # Figure 5 at its own rates

Identical configs are run once and shared (Table III's 10-client runs are Table II's).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from rabo_experiments import (
    EXPERIMENTS,
    LT_FACTORS,
    METHODS,
    QUICK_RESULTS,
    REPO,
    RESULTS,
    SETTINGS,
    SWEEP_SETTING,
    SWEPT,
    Scale,
    build_suite_plan,
    choices_of,
    estimate_s,
    quick_scale,
)
from rabo_figures import write_reports

from fedtune import harness


@harness.suite_main
def main(argv: list[str] | None = None) -> int:
    parser = harness.suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="0,1,2")
    harness.add_sweep_options(
        parser,
        EXPERIMENTS,
        f"each method's own step size on {SETTINGS[SWEEP_SETTING]} (for table2, table3; --lt-factors: fig5)",
        factors=True,
        sweep_seed=3,
    )
    parser.add_argument(
        "--lt-factors",
        default=LT_FACTORS,
        help=f"with --lr-factors: the multiples swept on Figure 5's loss-tuning problem (default {LT_FACTORS})",
    )
    parser.add_argument(
        "--updates",
        type=int,
        default=None,
        help="few-shot backbone updates per client (default 60; a multiple of 10): scales every method's rounds alike",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"run only these methods (comma-separated subset of {','.join(METHODS)}); the others' "
        "cells read 'pending'",
    )
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"Table II's N-way K-shot columns to run (comma-separated subset of {','.join(SETTINGS)})",
    )
    args = parser.parse_args(argv)
    selected, seeds, out, command, sweep = harness.suite_start(
        args, argv, __file__, EXPERIMENTS, RESULTS, QUICK_RESULTS, "omniglot", SWEPT
    )
    lt_grid = harness.parse_grid(args.lt_factors, "--lt-factors", "multiples of each method's own rates")
    settings = tuple(s for s in args.settings.split(",") if s)
    unknown = [s for s in settings if s not in SETTINGS]
    if args.updates is not None and (args.updates < 10 or args.updates % 10):
        raise harness.SuiteError(f"--updates: a multiple of 10 expected, got {args.updates}")
    methods = [m for m in args.methods.split(",") if m]
    if not methods or set(methods) - set(METHODS):
        raise harness.SuiteError(
            f"--methods: unknown {', '.join(sorted(set(methods) - set(METHODS))) or '(none given)'}; "
            f"expected a subset of {','.join(METHODS)}"
        )
    if unknown or not settings:
        raise harness.SuiteError(
            f"--settings: unknown {', '.join(unknown) or '(none given)'}; expected a subset of {','.join(SETTINGS)}"
        )
    scale = quick_scale() if args.quick else Scale()
    scale = replace(scale, settings=settings, updates=args.updates, sweep=sweep, lt_grid=lt_grid)
    print(
        f"RABO suite: {', '.join(selected)}; seeds {seeds}"
        + (
            f"; step-size factors {', '.join(f'{f:g}' for f in sweep.grid)} (loss tuning: "
            f"{', '.join(f'{f:g}' for f in lt_grid)}) swept on seed {sweep.seed}"
            if sweep
            else ""
        )
        + f" -> {out}"
    )

    def stage(experiments: list[str]) -> int:
        plan = build_suite_plan(scale, seeds, out)
        plan = {e: [s for s in specs if s.labels["method"] in methods] for e, specs in plan.items()}
        runs = harness.distinct_runs(plan, experiments)
        costs = {s.key: estimate_s(s.config) for s in runs}
        estimate = (
            f"Estimated time of the selection (built-in cost model, {args.workers} workers): "
            f"{harness.estimate_minutes(runs, costs, args.workers):.0f} min."
        )
        notes = ["cost model: built-in per-method constants (benchmarks/rabo/run_suite.py)"]
        for problem in ("few-shot", "loss-tuning") if sweep else ():
            swept = harness.with_labels(plan["sweep"], problem=problem)
            notes.append(
                f"{problem}: "
                + harness.sweep_note(
                    {m: harness.with_labels(swept, method=m) for m in methods}, choices_of(swept, problem), "methods"
                )
            )
        return harness.run_suite(
            plan,
            experiments,
            args,
            costs,
            lambda: write_reports(plan, experiments, scale, seeds, out, command, estimate),
            root=REPO,
            notes=notes,
        )

    return harness.sweep_first(stage, selected, args)  # tables II and III are planned from the sweep's finished runs


if __name__ == "__main__":
    sys.exit(main())
