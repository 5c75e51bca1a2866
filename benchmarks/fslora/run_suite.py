"""CPU-scale counterparts of the FSLoRA paper's experiments (Fang et al. 2025, Section 5 and
Appendix C) on MiniLM, written to ``benchmarks/results/fslora/``.

Experiments (each a list of named runs on :mod:`fedtune.harness`; a run is the recipe
``configs/benchmarks/fslora-suite.toml`` plus overlays from ``fslora-suite-overlays.toml`` plus
the experiment's own settings):

- ``table51``: Table 5.1. FedIT (uniform rank = the smallest k_i, see below), FSLoRA, HeteroLoRA,
  FlexLoRA, FedStackLoRA on SST-2 and AG News: final accuracy mean +- std over seeds, MB uploaded,
  client compute seconds. Global rank r = 64, k_i / r drawn per device from {0.125, 0.25, 0.5, 0.75}
  (the baselines use r_i = k_i from the same draw).
- ``fig3``: FSLoRA with (k/r = 0.5) vs without (k/r = 1) sketching at an equal per-device upload
  budget: the sketched run gets R rounds, the unsketched one R/2, for r in {16, 64}.
- ``fig4b``: global rank r in {8, 16, 32, 64, 128} at a fixed k = 8 (k/r = 8/r; r = 8 is k/r = 1,
  the paper's Figure 6 reference point).
- ``fig4c``: k/r in {0.125, 0.25, 0.5, 1} at r = 64.
- ``fig7``: top-k upload compression (``federation.upload_topk``) with k/r in {0.125, 0.25, 0.5, 1},
  accuracy vs per-device upload MB, with fig4c's uncompressed runs as the reference.
- ``horizon``: not in the paper. Table 5.1's FedIT and FSLoRA runs on SST-2, continued to 3 R rounds,
  to test whether FSLoRA's gap to FedIT at R rounds is a short-run effect (the first R rounds are
  the very same computation as Table 5.1's runs, which the report checks).
- ``alpha``: not in the paper, which does not state lora_alpha. Table 5.1 (SST-2) and Figure 4(b)
  again with a fixed lora_alpha = 16 instead of 2 r. With 2 r, a device training k of r ranks
  scales its update by (alpha / r)(r / k) = 2 r / k, so the r = 64 methods train with up to 8x
  FedIT's (r = 8) scale and fig4b's scale grows with r; with a fixed alpha it is alpha / k for all.

The figures run on SST-2 only; Table 5.1 on SST-2 and AG News. Every set is split over 20 devices
with Dirichlet(0.5) label skew. Identical configs are run once and shared between experiments
(e.g. fig4b's r = 64 point is fig4c's k/r = 0.125 point). A run whose ``summary.json`` exists is
skipped, so an interrupted suite resumes where it stopped. Runs go to a pool of ``--workers``
processes (default 2, one torch thread each).

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data \\
        .venv/bin/python benchmarks/fslora/run_suite.py [--only table51,fig3] [--seeds 0,1] [--quick]
    ... --plan           # the runs and the time estimate, nothing run
    ... --calibrate      # measure step / evaluation / per-run costs here first (a few minutes)
    ... --report-only    # rewrite the markdown and plots from the run folders that exist

``--quick`` is a smoke test (tiny-bert, 2 rounds, a few hundred examples) written to
``benchmarks/results/_scratch/fslora-quick/`` (git-ignored).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from fslora_suite_costs import calibrate_here, load_calibration, run_costs, test_size
from fslora_suite_experiments import EXPERIMENTS, QUICK_RESULTS, REPO, RESULTS, Scale, build_suite_plan, quick_scale
from fslora_suite_figures import write_reports

from fedtune import harness

# -- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    p = harness.suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS)
    p.add_argument("--calibrate", action="store_true", help="measure step/eval/setup costs here first (a few minutes)")
    p.add_argument("--rounds", type=int, default=None, help="override R (rounds)")
    p.add_argument("--local-steps", type=int, default=None, help="override H (local steps)")
    p.add_argument("--clients-per-round", type=int, default=None, help="override devices sampled per round")
    p.add_argument("--eval-every", type=int, default=None, help="override the evaluation interval (rounds)")
    p.add_argument("--topk", type=float, default=None, help="fig7's federation.upload_topk (default 0.5)")
    return p.parse_args(argv)


def scale_from_args(args) -> Scale:
    """The scale a command line asks for: ``--quick``'s overlay, then the R/H/... overrides."""
    options = {
        "rounds": args.rounds,
        "train.local_steps": args.local_steps,
        "federation.clients_per_round": args.clients_per_round,
        "eval_every": args.eval_every,
    }
    scale = quick_scale() if args.quick else Scale()
    scale = replace(
        scale,
        overrides=scale.overrides
        + tuple(harness.assignments({key: value for key, value in options.items() if value is not None})),
    )
    return scale if args.topk is None else replace(scale, topk=args.topk)


@harness.suite_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected, seeds, out, command, _ = harness.suite_start(
        args, argv, __file__, EXPERIMENTS, RESULTS, QUICK_RESULTS, "sst2/agnews"
    )
    scale = scale_from_args(args)
    plan = build_suite_plan(scale, seeds, out)

    if args.calibrate and not args.report_only:
        print(f"calibrating {scale.base.model.name} with one torch thread ...", flush=True)
        calibrate_here(scale, out)
    calibration, source = load_calibration(out)
    if scale.base.model.name not in calibration:
        source += f"; no {scale.base.model.name} entry, minilm costs used (an overestimate for tiny-bert)"
    runs = harness.distinct_runs(plan, selected)
    costs = {s.key: harness.estimate_s(s.config, run_costs(s.config, calibration), test_size(s.config)) for s in runs}
    model_cal = calibration.get(scale.base.model.name, {})
    steps = ", ".join(f"{d} {v['step_s']:.3f} s" for d, v in model_cal.items() if isinstance(v, dict) and "step_s" in v)
    evals = ", ".join(
        f"{d} {model_cal[d]['eval_s_per_example'] * n:.1f} s ({n} examples)"
        for d in sorted(set(scale.table_data) | set(scale.fig_data))
        if isinstance(model_cal.get(d), dict)
        for n in [test_size(scale.config(d))]
    )
    calibration_note = (
        f"Cost model ({source}): one local step (batch {scale.base.train.batch_size}, max_length "
        f"{scale.base.data.max_length}, one thread) {steps or 'uncalibrated'}; one evaluation pass "
        f"{evals or 'uncalibrated'}. Estimated suite time with {args.workers} workers: "
        f"{harness.estimate_minutes(runs, costs, args.workers):.0f} min."
    )
    base = scale.base
    print(
        f"FSLoRA suite: {', '.join(selected)}; seeds {seeds}; model {base.model.name}; R={base.rounds}, "
        f"H={base.train.local_steps}, {base.federation.clients_per_round}/{base.federation.num_clients} devices "
        f"per round -> {out}"
    )
    return harness.run_suite(
        plan,
        selected,
        args,
        costs,
        lambda: write_reports(plan, selected, scale, seeds, out, command, calibration_note),
        root=REPO,
        notes=[f"calibration: {source}; {steps}"],
    )


if __name__ == "__main__":
    sys.exit(main())
