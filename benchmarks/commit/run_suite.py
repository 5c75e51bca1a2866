"""CPU-scale counterparts of the CoMMIT paper's experiments (Sections 4 and 7: Table 1, Figures 3-6),
written to ``benchmarks/results/commit/``.

Every run is the recipe ``configs/benchmarks/commit-suite.toml`` (centralized: one party, one optimizer,
120 steps of batch 8; SmolLM2-135M-Instruct with LoRA as T, a projector as S) plus a modality overlay
(``configs/benchmarks/commit-suite-overlays.toml``: ``image`` Fashion-MNIST "What item of clothing is
this?" / "Describe the picture." over a frozen MobileNetV2; ``audio`` FSDD "Which digit is spoken?" /
"Describe the recording." over fixed log-mel features) and the trainer (``options.trainer``).
Identical configs run once and are shared between experiments. Experiments:

- ``sweep`` (with ``--lr-grid``): each (modality, trainer) of Table 1 on the grid's learning rates
  (``train.lr``: both components' base rate; CoMMIT's alpha = 2 x lr) on ``--sweep-seed``; the rate
  with the highest mean of the run's last 3 evaluations (exact match) is chosen for that (modality,
  trainer), and ``table1`` / ``fig45`` then run it on ``--seeds`` (written to
  ``benchmarks/results/commit-swept/``; a group whose sweep is unfinished has no table runs yet).
- ``table1``: Table 1. Constant LR, Feature CD, Language CD, CoMMIT-CLR and CoMMIT on both modalities:
  exact match over all questions, exact match of the short-answer question (the paper's QA accuracy),
  and ROUGE-L (its captioning metric: the describe answers run to several words).
- ``fig45``: Figures 4 and 5. Training-loss curves (per step, mean over seeds) of Constant LR,
  CoMMIT-CLR and CoMMIT, image (Fig. 4) and audio (Fig. 5); Table 1's runs.
- ``fig6``: Figure 6. kappa_t curves of Synced (Constant) LR, Language LR up, Vision LR up, CoMMIT-CLR and
  CoMMIT, and the standard deviation of kappa_t over the steps of each run.
- ``fig3``: Figure 3 (Section 4.2). Normalized gradient norms ||G^S|| / ||theta_S||, ||G^T|| / ||theta_T||
  and the training loss of Synced LR, Language LR up and Vision LR up; Figure 6's runs.
- ``federated``: the federated mode (not in the paper): FedAvg of S and T over 4 clients each holding
  one question type, 2 per round, 5 rounds x 12 local steps; Constant LR, CoMMIT-CLR and CoMMIT, image.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data .venv/bin/python benchmarks/commit/run_suite.py
    ... --plan           # the runs and the time estimate, nothing run
    ... --quick          # smoke test: tiny-llama, 64 examples, 6 steps, to benchmarks/results/_scratch/commit-quick/
    ... --report-only    # rewrite the markdown and plots from the run folders that exist
    ... --steps 40 --test-samples 100 --modalities image --only table1   # a scaled-down slice
    ... --lr-grid 3e-4,1e-3,3e-3 --seeds 1,2,3 --only table1,fig45 --steps 80 --evals 4   # per-trainer rates

``--steps`` / ``--test-samples`` scale every run (centralized: ``train.local_steps``; federated: the
same client steps spread over its 5 rounds x 2 clients); ``--lr`` sets every run's base rate
(a rate sweep: one ``--out`` folder per rate); ``--evals N`` splits a centralized run's
steps into N rounds with one optimizer throughout (``options.carry_optimizer``) and an evaluation
after each, and the tables report the mean of the last (up to) 3 evaluations instead of the single
final one; ``--modalities`` runs only those modalities' runs (the reports keep the others' cells
as "pending").
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from commit_experiments import (
    EXPERIMENTS,
    MODALITIES,
    QUICK_RESULTS,
    RECIPE,
    REPO,
    RESULTS,
    SWEPT,
    SWEPT_RESULTS,
    TABLE1,
    Scale,
    build_suite_plan,
    choices_of,
    restrict,
    run_cost,
)
from commit_figures import report_federated, report_fig3, report_fig6, report_fig45
from commit_tables import report_sweep, report_table1, setup_section

from fedtune import harness
from fedtune.config import load_config


def parse_args(argv=None):
    parser = harness.suite_parser(
        "CoMMIT suite (Table 1, Figures 3-6, federated mode)", EXPERIMENTS, seeds="0,1,2", budget_minutes=240.0
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the recipe's 120)")
    parser.add_argument("--test-samples", type=int, default=None, help="test questions (default: the recipe's 200)")
    parser.add_argument(
        "--evals",
        type=int,
        default=None,
        help="centralized runs: evaluations, one per round of steps/evals steps with one optimizer "
        "throughout (default: one, at the end); cells: the mean of the last 3",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="every run's base learning rate train.lr (default: the recipe's; CoMMIT's alpha "
        "follows as 2 x lr); for a rate sweep, one --out folder per rate",
    )
    parser.add_argument(
        "--modalities", default=",".join(MODALITIES), help="comma-separated subset of image,audio to run"
    )
    harness.add_sweep_options(
        parser,
        EXPERIMENTS,
        "each (modality, trainer) of Table 1 (for table1 / fig45; results to benchmarks/results/commit-swept/)",
    )
    return parser.parse_args(argv)


def selection(args) -> tuple[Scale, list[str]]:
    """The scale and the modalities to run; :class:`SuiteError` naming the option when bad."""
    modalities = [m.strip() for m in args.modalities.split(",") if m.strip()]
    unknown = [m for m in modalities if m not in MODALITIES]
    if unknown or not modalities:
        raise harness.SuiteError(f"--modalities: expected a subset of {MODALITIES}, got {args.modalities!r}")
    for name in ("steps", "test_samples", "evals"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise harness.SuiteError(f"--{name.replace('_', '-')}: expected a positive number, got {value}")
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise harness.SuiteError(f"--lr: expected a positive number, got {args.lr}")
    scale = Scale(args.quick, args.steps, args.test_samples, args.evals, args.lr)
    if args.evals is not None and scale.centralized_steps(modalities[0]) % args.evals:
        raise harness.SuiteError(
            f"--evals: expected a divisor of the {scale.centralized_steps(modalities[0])} steps per "
            f"run, got {args.evals}"
        )
    return scale, modalities


# -- cost model ------------------------------------------------------------------------------
# Seconds of one step of SmolLM2 (batch 8) by trainer, measured here with one thread under the shared
def write_reports(plan, selected, seeds, out: Path, command: str, sweep: harness.Sweep | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    head = setup_section(plan, seeds, command, sweep)
    swept = {"sweep": report_sweep, "table1": report_table1}  # the writers that say which rates were chosen
    writers = {**swept, "fig45": report_fig45, "fig6": report_fig6, "fig3": report_fig3, "federated": report_federated}
    written = []
    for exp in selected:
        path = out / f"{exp}.md"
        extra = (sweep,) if exp in swept else ()
        path.write_text(writers[exp](plan[exp], head, out, *extra))
        written += [path] + ([out / f"{exp}.png"] if (out / f"{exp}.png").exists() else [])
    return written


@harness.suite_main
def main(argv=None) -> int:
    args = parse_args(argv)
    scale, modalities = selection(args)
    selected, seeds, out, command, sweep = harness.suite_start(
        args, argv, __file__, EXPERIMENTS, RESULTS, QUICK_RESULTS, "Fashion-MNIST and FSDD", SWEPT, SWEPT_RESULTS
    )
    base = load_config(RECIPE, scale.overrides(modalities[0]))
    print(
        f"CoMMIT suite: {', '.join(selected)}; modalities {', '.join(modalities)}; seeds {seeds}"
        + (f"; {sweep}" if sweep else "")
        + f"; model {base.model.name}; {base.rounds} x {base.train.local_steps} steps of batch "
        f"{base.train.batch_size} per centralized run -> {out}"
    )

    def stage(experiments: list[str]) -> int:
        plan = build_suite_plan(seeds, scale, out, sweep)
        to_run = restrict(plan, modalities)
        runs = harness.distinct_runs(to_run, experiments)
        costs = {s.key: run_cost(s.config) for s in runs}
        notes = [
            f"cost model: per-trainer step seconds measured on this machine "
            f"(~{harness.estimate_minutes(runs, costs, 1):.0f} min of one core for the selection)"
        ]
        if sweep:
            choices = choices_of(plan["sweep"])
            groups = {
                f"{m}/{t}": harness.with_labels(plan["sweep"], modality=m, trainer=t)
                for m in modalities
                for t in TABLE1
            }
            notes.append(
                harness.sweep_note(
                    groups,
                    {f"{m}/{t}": choices.get((m, t)) for m in modalities for t in TABLE1},
                    "(modality, trainer) groups",
                )
            )
        return harness.run_suite(
            to_run,
            experiments,
            args,
            costs,
            lambda: write_reports(plan, experiments, seeds, out, command, sweep),
            root=REPO,
            notes=notes,
        )

    return harness.sweep_first(stage, selected, args)  # table1 / fig45 are planned from the sweep's finished runs


if __name__ == "__main__":
    sys.exit(main())
