"""Issue 27's two causal-LM benchmark tables on :mod:`fedtune.harness`, written to
``benchmarks/results/<name>/{results.json, README.md, <name>.png}``:

- ``table52`` (``benchmarks/results/commonsense-table52/``): the counterpart of FSLoRA's Table 5.2
  (Fang et al. 2025, Section 5.1) at CPU scale: FSLoRA (global rank r = 64, sketching ratios k_i / r
  drawn per device from {0.125, 0.25, 0.5, 0.75}) against HeteroLoRA, FlexLoRA and FedStackLoRA
  with heterogeneous ranks r_i = k_i from the same draw, FedIT at the smallest rank (0.125 r = 8,
  every device affords it) as a reference, and the untuned model; per-set accuracy (options ranked
  by log-likelihood, ``acc``), the average over the sets, client compute seconds (the paper's
  "GPU hours"). Every run is ``configs/benchmarks/commonsense-suite.toml`` (= the recipe
  ``configs/commonsense-fslora.toml``'s data, model and schedule) plus the method's overlay of
  ``configs/benchmarks/fslora-suite-overlays.toml``.
- ``dolly`` (``benchmarks/results/dolly-fedit/``): FedIT / Shepherd's setting (10 clients, FedIT's
  own split, ``configs/benchmarks/dolly-suite.toml`` = ``configs/dolly.toml``'s): FedIT against
  each client alone (``local``: the mean over the clients of their own adapters' scores) and the
  untuned model; ROUGE-L of the greedy answers and the response-token loss on FedIT's 80-record
  global test set.

Each method runs at its own learning rate: with ``--lr-grid`` the ``sweep`` experiment runs every
(benchmark, method) at each rate on ``--sweep-seed``; the rate with the best mean of the run's last
:data:`LAST` evaluations (commonsense: the set-average accuracy; Dolly: the lowest response loss,
since ROUGE-L barely moves at this scale, configs/dolly.toml) is its choice, and the tables run it on
``--seeds``. Without a grid every method runs at the suite recipe's rate. A table cell is the mean
+- sample std over seeds of each run's mean of its last :data:`LAST` evaluations. The untuned rows
evaluate the base model once with the same task code and test subset (cached in
``<out>/untuned-<benchmark>.json``). A run with a ``summary.json`` of the same config is skipped, so
an interrupted suite resumes.

Final evaluation (the ``final_`` columns): once a table52 run has finished, its final adapter is
scored again on a larger fixed subset of each set's evaluation split, ``--final-per-set`` questions
(default :data:`FINAL_PER_SET`; 0: every question) drawn with seed 0 as ``task.test_per_set`` draws
(the whole split where it is smaller; a draw of its own, which need not contain the in-training
subset), by :func:`fedtune.trained.evaluate.evaluate` (``fedtune eval``'s
code: the task's own evaluation), and saved as the run's ``final_eval.json`` with the limit and the
run's config key, so it is not recomputed; the untuned base is scored the same way
(``<out>/untuned-table52-final.json``). The table states the sizes and the binomial SE. Dolly's
final columns are the final round's evaluation: it already scores the final adapter on FedIT's whole
80-record test set.

The plan (``--plan`` prints each stage's estimate and the total: the sweep, then the tables, then
the final and untuned evaluations, each scheduled over ``--workers``; the cost model is
:data:`STEP_S`, :data:`EVAL_S`, :data:`LOSS_EVAL_S`, :data:`SETUP_S`) is scaled down to about 4 h
on 2 workers (``--plan`` of this command on 2026-11-25: ~256 min = the sweep's 14 runs ~66 min, the
tables' 21 runs ~143 min, 18 final and untuned evaluations ~48 min; at load about 2, a busier
machine takes longer); the full plan, a 3-point grid with every Dolly evaluation generating for
every ``local`` client and no final evaluation, was about 32 h of one core at the old cost model
(about 12.5 h of one core, 6.3 h on 2 workers, at this one):

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data .venv/bin/python benchmarks/llm/llm_tables.py \\
        --lr-grid 1e-3,3e-3 --seeds 1,2,3 --workers 2

What is cut, beyond the recipes' own scale (their headers; the FSLoRA paper's 750 rounds of
LLaMA-3.2-3B on eight sets, FedIT's LLaMA-7B):

- a 2-point learning-rate grid, {1e-3, 3e-3}, swept on one seed (0): 1e-3 is both recipes' rate,
  3e-3 asks whether the short schedules (18 steps per commonsense client) want a larger one; the
  paper's 3e-4 (for 750 rounds x 20 steps) is left out;
- Dolly ``local`` evaluates at the final round only (``eval_every = 4``; every one of its 10
  clients generates the 80 answers at each evaluation, 10x FedIT's cost), so its cell is that one
  evaluation while FedIT's is the mean of rounds 2 and 4; the ``final_`` columns compare both at
  round 4;
- the Dolly sweep runs generate nothing (``task.generate = false``) and score the response loss on
  a seed-0 half of the test set (:data:`DOLLY_SWEEP_TEST` = 40 records): they choose by that loss;
- the final evaluation scores :data:`FINAL_PER_SET` = 300 questions per set, not the issue's 1,000
  (binomial SE of a two-set average about 2 points instead of 1.1; 1,000 per set adds about 1.6 h
  to the plan, ``--final-per-set 1000``);
- every client is still evaluated (the engine evaluates all clients at an evaluation round; fewer
  clients would need an option of the ``local`` method), and Dolly answers keep the recipe's 48 new
  tokens (measured: 32 tokens cost the same CPU time per answer; the forward passes over the
  prompts and the response loss dominate).

    ... --plan | --report-only | --quick | --final-per-set N | --only table52,dolly | --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from llm_tables_experiments import (
    BENCHES,
    EXPERIMENTS,
    FINAL_PER_SET,
    QUICK_FINAL_PER_SET,
    QUICK_RESULTS,
    REPO,
    TABLES,
    build,
    final_jobs,
    run_cost,
    run_final_evaluations,
    total_lines,
    untuned,
    untuned_final,
)
from llm_tables_reports import scale_note, write_report

from fedtune import harness


def final_limit(args) -> int | None:
    """``--final-per-set`` (0: every question), by default :data:`FINAL_PER_SET` (``--quick``:
    :data:`QUICK_FINAL_PER_SET`)."""
    if args.final_per_set is None:
        return QUICK_FINAL_PER_SET if args.quick else FINAL_PER_SET
    return args.final_per_set or None


@harness.suite_main
def main(argv: list[str] | None = None) -> int:
    p = harness.suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="1,2,3", workers=2, budget_minutes=240)
    harness.add_sweep_options(p, EXPERIMENTS, "every method of each table")
    p.add_argument(
        "--final-per-set",
        type=int,
        default=None,
        help=f"questions per set of each table52 run's final evaluation, a seed-0 subset (0: every question; "
        f"default {FINAL_PER_SET}, --quick {QUICK_FINAL_PER_SET})",
    )
    args = p.parse_args(argv)
    selected, seeds = harness.parse_selection(args, EXPERIMENTS)
    sweep, selected = harness.sweep_selection(args, selected, TABLES)
    if args.final_per_set is not None and args.final_per_set < 0:
        raise harness.SuiteError(
            f"--final-per-set: expected a count >= 0 (0: every question), got {args.final_per_set}"
        )
    tables = [t for t in TABLES if t in selected] or TABLES
    out = {t: harness.output_dir(args, BENCHES[t].results, QUICK_RESULTS / BENCHES[t].name) for t in tables}
    if args.out is not None:
        out = {t: args.out.resolve() / BENCHES[t].name for t in tables}
    harness.offline_data("commonsense/dolly15k")
    harness.biased_seed_warning(sweep, seeds, selected, TABLES)
    command = harness.suite_command("benchmarks/llm/llm_tables.py", argv)
    limit = final_limit(args)
    failed: list[str] = []

    def stage(experiments: list[str]) -> int:
        plans = build(tables, seeds, sweep, args.quick, out)
        plan = {"sweep": [s for t in tables for s in plans[t][0]["sweep"]]}
        plan.update({t: plans[t][1][t] for t in tables})
        costs = {s.key: run_cost(s) for s in harness.distinct_runs(plan, experiments)}
        notes = total_lines(plans, tables, limit, args.quick, out, args.workers, args.budget_minutes)

        def write_reports() -> list[Path]:
            written = []
            for t in tables:
                if t in experiments or "sweep" in experiments:
                    base = untuned(t, BENCHES[t].recipe, args.quick, out[t])
                    if not args.report_only:
                        failed.extend(
                            run_final_evaluations(
                                final_jobs(t, plans[t][1][t], limit, args.quick, out[t]), args.workers
                            )
                        )
                    base_final = untuned_final(t, limit, args.quick, out[t])
                    written += write_report(
                        t, plans, seeds, sweep, base, out[t], command, scale_note(t), base_final, limit
                    )
            return written

        return harness.run_suite(plan, experiments, args, costs, write_reports, root=REPO, notes=notes)

    rc = harness.sweep_first(stage, [e for e in selected if e in EXPERIMENTS], args)
    if failed:
        print("failed final evaluations (rerun the command to retry them):\n  " + "\n  ".join(failed))
    return max(rc, 1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
