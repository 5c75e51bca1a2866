"""A fair benchmark of FSLoRA and the heterogeneous-rank LoRA baselines (issue 13, item 5): every
method at its own best learning rate, in two optimizer families, on SST-2 with MiniLM; written to
``benchmarks/results/fslora-sweep/``.

Two stages (experiments on :mod:`fedtune.harness`; a run is ``configs/benchmarks/fslora-sweep.toml``
plus overlays from ``fslora-sweep-overlays.toml`` plus the run's seed, rank and rates):

- ``sweep``: every row below x every optimizer family x the family's learning-rate grid
  (:data:`LR_GRID`), on one seed (``--sweep-seed``, default 0). Each (row, family) then gets its
  **chosen setting automatically**: the argmax, over the grid, of the run's mean of its last
  :data:`LAST` evaluations (:func:`choose`; ties go to the earlier grid point, the smaller rate).
- ``table``: Table 5.1 again: each (row, family) at its chosen setting on ``--seeds`` (default
  1, 2, 3: seeds other than the sweep seed, so the reported figure is not the maximum the
  selection picked). A (row, family) whose sweep runs are not all finished has no table runs yet
  (``--plan`` lists it as waiting, with its estimate).

Rows: ``fslora`` (eq. (5), plain server step), ``heterolora``, ``flexlora``, ``fedstacklora`` (the
compared methods: global rank r = 64, k_i / r drawn per device from {0.125, 0.25, 0.5, 0.75};
the baselines give device i the rank r_i = k_i), ``fslora-sadam`` (FSLoRA with the server-Adam
option, a labelled deviation: FedAdam with weight decay 0.01, as the published code; its server
learning rate is swept too, over :data:`SERVER_LR_GRID`, so it gets 3 times the grid points of the
other rows) and ``fedit`` (the reference row: FedIT at the uniform rank
r = min_i k_i of the seed's draw, the largest rank every device affords).

Families: ``adamw`` (AdamW) and ``sgdm`` (SGD with heavy-ball momentum 0.9, as the published GLUE
clients); their learning-rate grids are :data:`LR_GRID`. Both keep a fresh optimizer state
per client and round. Every method uses the same client weighting, p_i = 1/N over the clients that
replied (FSLoRA's eq. (5)), the same devices, data, seeds, rounds and evaluation.

Reported figure: the mean of a run's last 3 evaluations (every 2 rounds: rounds 26, 28, 30), then
mean +- sample std over the seeds; the seed-averaged curves are plotted. The report states whether
FSLoRA >= HeteroLoRA, FlexLoRA and FedStackLoRA at equal upload, with the paired per-seed
differences.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/fslora/sweep.py --plan
    ... --only sweep               # stage 1 (resumable: rerun the same command)
    ... --only table               # stage 2, at the rates stage 1 chose
    ...                            # both stages in one go (stage 2 planned when stage 1 is done)
    ... --report-only              # rewrite sweep.md, table51.md, winners.json and the plots
    ... --recipe-changes           # what the winners change in configs/*.toml (recipe-changes.md)
    ... --recipe-changes --apply-recipes   # write those changes into configs/*.toml

``--quick`` is a smoke test (tiny-bert, 4 rounds, a few hundred examples) written to
``benchmarks/results/_scratch/fslora-sweep-quick/`` (git-ignored).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from fslora_sweep_experiments import (
    BUDGET_MINUTES,
    DEFAULT_SEEDS,
    EXPERIMENTS,
    QUICK_RESULTS,
    REPO,
    RESULTS,
    SWEEP_SEED,
    Scale,
    build_sweep_plan,
    load_calibration,
    quick_scale,
    run_cost,
)
from fslora_sweep_recipes import apply_change, recipe_changes, recipe_changes_report
from fslora_sweep_table import winners, write_reports

from fedtune import harness

# -- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    p = harness.suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds=DEFAULT_SEEDS, budget_minutes=BUDGET_MINUTES)
    p.add_argument(
        "--sweep-seed", type=int, default=SWEEP_SEED, help=f"the seed that chooses the rates (default {SWEEP_SEED})"
    )
    p.add_argument("--rounds", type=int, default=None, help="override R (rounds)")
    p.add_argument("--local-steps", type=int, default=None, help="override H (local steps)")
    p.add_argument("--eval-every", type=int, default=None, help="override the evaluation interval (rounds)")
    p.add_argument(
        "--recipe-changes",
        action="store_true",
        help="write <out>/recipe-changes.md: what the winners change in configs/*.toml (runs nothing)",
    )
    p.add_argument("--apply-recipes", action="store_true", help="with --recipe-changes: write them into configs/*.toml")
    return p.parse_args(argv)


def scale_from_args(args) -> Scale:
    options = {"rounds": args.rounds, "train.local_steps": args.local_steps, "eval_every": args.eval_every}
    scale = quick_scale() if args.quick else Scale()
    return replace(
        scale,
        overrides=scale.overrides
        + tuple(harness.assignments({key: value for key, value in options.items() if value is not None})),
    )


@harness.suite_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = scale_from_args(args)
    selected, seeds, out, command, _ = harness.suite_start(
        args, argv, __file__, EXPERIMENTS, RESULTS, QUICK_RESULTS, "sst2"
    )
    calibration, source = load_calibration(out)
    if args.sweep_seed in seeds:
        print(
            f"warning: the sweep seed {args.sweep_seed} is among --seeds: its table run is the run that chose "
            "the rate (a biased figure)",
            flush=True,
        )

    if args.recipe_changes:
        plan, choices, _ = build_sweep_plan(scale, args.sweep_seed, seeds, out)
        changes = recipe_changes(winners(plan, choices, scale))
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe-changes.md").write_text(recipe_changes_report(changes), encoding="utf-8")
        print(recipe_changes_report(changes))
        if args.apply_recipes:
            for change in changes:
                if change.train is not None:
                    change.recipe.write_text(apply_change(change))
                    print(f"updated {os.path.relpath(change.recipe, REPO)}")
        return 0

    def stage(selection: list[str]) -> int:
        plan, choices, waiting = build_sweep_plan(scale, args.sweep_seed, seeds, out)
        runs = harness.distinct_runs(plan, EXPERIMENTS)
        costs = {s.key: run_cost(s.config, calibration) for s in runs}
        whole = [costs[s.key] for s in runs] + [run_cost(s.config, calibration) for s in waiting]
        base = scale.base
        cost_note = (
            f"Cost model ({source}): one local step {calibration['minilm']['sst2']['step_s']:.3f} s, one "
            f"evaluation {calibration['minilm']['sst2']['eval_s_per_example'] * 872:.1f} s (one free core). "
            f"Estimated whole benchmark ({len(runs) + len(waiting)} runs) on {args.workers} workers: "
            f"{harness.makespan(whole, args.workers) / 60:.0f} min."
        )
        groups = sorted({(s.labels["row"], s.labels["family"]) for s in waiting})
        notes = [
            f"calibration: {source}",
            f"table: {len(waiting)} runs of {len(groups)} (method, family) groups wait for their sweep "
            f"(~{harness.makespan([run_cost(s.config, calibration) for s in waiting], args.workers) / 60:.0f} min on "
            f"{args.workers} workers): {', '.join(f'{r}/{f}' for r, f in groups) or 'none'}",
            f"whole benchmark (sweep + table, done or not): ~{harness.makespan(whole, args.workers) / 60:.0f} min on "
            f"{args.workers} workers",
        ]
        print(
            f"fair FSLoRA benchmark: {', '.join(selection)}; sweep seed {args.sweep_seed}, table seeds {seeds}; "
            f"model {base.model.name}; R={base.rounds}, H={base.train.local_steps}, "
            f"{base.federation.sample_size()}/{base.federation.num_clients} devices per round -> {out}"
        )

        def reports() -> list[Path]:  # the choices as the runs just finished left them
            now, chosen, _ = build_sweep_plan(scale, args.sweep_seed, seeds, out)
            return write_reports(now, chosen, scale, args.sweep_seed, seeds, out, command, cost_note)

        return harness.run_suite(plan, selection, args, costs, reports, root=REPO, notes=notes)

    return harness.sweep_first(stage, selected, args)  # the table is planned from the sweep's finished runs


if __name__ == "__main__":
    sys.exit(main())
