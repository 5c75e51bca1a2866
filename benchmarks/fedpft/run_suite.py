"""CPU-scale counterparts of the FedPFT paper's experiments (Peng et al., IJCAI 2024, Sec. 4 and
App. C-F), written to ``benchmarks/results/fedpft/``.

Experiments (named runs on :mod:`fedtune.harness`; a run is ``configs/benchmarks/fedpft-suite.toml``
plus overlays from ``fedpft-suite-overlays.toml`` plus the experiment's settings):

- ``sweep`` (with ``--lr-grid``): each method of Table 1 on SST-2 and AG News at every rate of the
  grid on ``--sweep-seed``; the rate with the highest mean of the run's last 3 evaluations (full-model
  accuracy) is that (data set, method)'s choice. Table 1 then runs each (data set, method) at its
  choice, and Tables 3-5 (SST-2) each method at its SST-2 choice (the ablations and the t / p
  settings at FedPFT's), on ``--seeds``; a run whose choice is not made yet waits. Written to
  ``benchmarks/results/fedpft-swept/``. Table 2 (the random ViT: costs, not accuracy) keeps the
  recipe's rate.
- ``table1``: Table 1. FedPETuning, FedOT, FedPFT on SST-2 and AG News with MiniLM, I.I.D.:
  full-model accuracy (adapter plugged back) and the proxy's, trainable and transmitted
  parameters, client compute seconds and peak client training memory.
- ``table2``: Table 2 (ViT). No pretrained ViT installs offline (``../shared/data/README.md``): the
  suite writes a *randomly initialised* 4-layer ViT (hidden 64, d_ff 256, 16x16 inputs, patches 4x4;
  ``benchmarks/results/_scratch/fedpft-models/vit-random-4l``, seed 0) and runs the three methods on
  scikit-learn's digits, distilling on Fashion-MNIST. It exercises the ViT layout (``mlp.fc1`` /
  ``mlp.fc2``) and compares costs; its accuracies say nothing about the paper's claim, whose premise
  (a pretrained model whose salient neurons and layer outputs carry knowledge) a random model lacks.
- ``table3``: Table 3. SST-2 with Dirichlet label skew alpha in {1, 5, 10}, the three methods.
- ``table4``: Table 4 (ablation, on SST-2 as the paper's App. F): FedOT, FedPFT_N (no
  distillation), FedPFT_B (before FL only), FedPFT_D (during FL only), FedPFT.
- ``table5``: Table 5 (on SST-2; the paper uses QNLI, not available offline): alignment interval
  t in {5, 10, 20} at p = 0.5, and p in {0.3, 0.5, 0.8} at t = 10.

Scale (what is cut): MiniLM (6 layers, d 384) for BERT-base; 100 clients as the paper but 5 sampled
per round (paper: 10; halved to fit the swept suite on 2 cores), 30 rounds of 8 local steps (paper:
500 rounds of one local epoch); 200 distillation
steps of 32 examples of the other text set (paper: 5 epochs of BookCorpus + Wikipedia); FedPFT
compresses the middle 4 of 6 layers (paper: 10 of 12), FedOT keeps 1 + 1 adapter layers and
drops the middle 4 to 2 (paper: 2 + 2, 8 to 3). Accuracy: mean of the last 3 evaluations
(rounds 20, 25, 30) per run, then mean ± sample std over 3 seeds. A proxy is distilled once per
data set and method (``distill_seed = 0``; ``<out>/proxy-cache``) and shared by the seeds and the
settings that do not change it (alpha, t, p). Runs go to ``--workers`` processes (one torch
thread each); a run with a ``summary.json`` of the same config is skipped (resume).

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data \\
        .venv/bin/python benchmarks/fedpft/run_suite.py [--only table1,table4] [--seeds 0,1,2] [--quick]
    ... --plan           # the runs and the time estimate, nothing run
    ... --report-only    # rewrite the markdown and plots from the run folders that exist
    ... --lr-grid 1e-3,2e-3,4e-3 --seeds 1,2,3 --only table1   # each method at its own rate

``--quick`` is a smoke test (tiny-bert / tiny-vit, 2 rounds, a few hundred examples, 5
distillation steps) written to ``benchmarks/results/_scratch/fedpft-quick/`` (git-ignored).
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedpft_ablations import WRITERS
from fedpft_experiments import (
    EXPERIMENTS,
    METHODS,
    QUICK_RESULTS,
    RECIPE,
    REPO,
    RESULTS,
    SWEPT,
    SWEPT_RESULTS,
    TEXT,
    Scale,
    build_suite_plan,
    choices_of,
    ensure_random_vit,
    plan_costs,
)
from fedpft_tables import head

from fedtune import harness
from fedtune.config import load_config


@harness.suite_main
def main(argv: list[str] | None = None) -> int:
    p = harness.suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="0,1,2", budget_minutes=600)
    harness.add_sweep_options(
        p,
        EXPERIMENTS,
        "each method of Table 1 on SST-2 and AG News (for tables 1, 3-5; results to benchmarks/results/fedpft-swept/)",
    )
    args = p.parse_args(argv)
    selected, seeds, out, command, sweep = harness.suite_start(
        args, argv, __file__, EXPERIMENTS, RESULTS, QUICK_RESULTS, "sst2/agnews", SWEPT, SWEPT_RESULTS
    )
    scale = Scale(args.quick, out, sweep)
    if "table2" in selected and not args.quick:
        ensure_random_vit()
    base = load_config(RECIPE, scale.overrides("sst2", "fedpft"))
    print(
        f"FedPFT suite: {', '.join(selected)}; seeds {seeds}"
        + (f"; {sweep}" if sweep else "")
        + f"; model {base.model.name}; R={base.rounds}, H={base.train.local_steps}, "
        f"{base.federation.sample_size()}/{base.federation.num_clients} clients per round -> {out}"
    )

    def stage(experiments: list[str]) -> int:
        plan = build_suite_plan(scale, seeds, out)
        runs = harness.distinct_runs(plan, experiments)
        costs = plan_costs(runs)
        note = (
            f"Cost model: per-step and evaluation costs measured by the FSLoRA suite's --calibrate on this VM "
            f"(MiniLM, one thread), plus the proxy methods' distillation, proxy evaluation, APoZ passes and "
            f"alignments. Estimated time of the selection with {args.workers} worker(s): "
            f"{harness.estimate_minutes(runs, costs, args.workers):.0f} min."
        )
        notes = [note]
        if sweep:
            choices = choices_of(plan["sweep"])
            groups = {f"{d}/{m}": harness.with_labels(plan["sweep"], data=d, method=m) for d in TEXT for m in METHODS}
            notes.append(
                harness.sweep_note(
                    groups,
                    {f"{d}/{m}": choices.get((d, m)) for d in TEXT for m in METHODS},
                    "(data set, method) groups",
                )
            )

        def write_reports() -> list[Path]:
            out.mkdir(parents=True, exist_ok=True)
            hd = head(scale, seeds, command, note)
            written = []
            for exp in experiments:
                path = out / f"{exp}.md"
                path.write_text(WRITERS[exp](plan[exp], scale, hd, out), encoding="utf-8")
                written += [path, out / f"{exp}.png"]
            return written

        return harness.run_suite(plan, experiments, args, costs, write_reports, root=REPO, notes=notes)

    return harness.sweep_first(stage, selected, args)  # tables 1, 3-5 are planned from the sweep's finished runs


if __name__ == "__main__":
    sys.exit(main())
