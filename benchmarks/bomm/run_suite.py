"""CPU-scale counterparts of the BoMM paper's experiments (Section 5, Tables 1-3, Figure 3), written
to ``benchmarks/results/bomm/``.

Every run is the recipe ``configs/benchmarks/bomm-suite.toml`` (paired digit images + spoken digits,
two parties, the cloud on a frozen MobileNetV2) plus the experiment's settings; identical configs run
once and are shared between experiments. Experiments:

- ``table1``: Table 1. BoMM and the five baselines (LOCAL, MM-LOCAL, Vanilla, MM-AC, MM-UC) in
  scenarios 1 and 2 (audio, the paper's "text", missing with probability Delta = 0.5: at both parties;
  at party 1 only) with 0 and 200 aligned ids: P1 / P2 (parties 0 and 1's small models) and C (the
  cloud model) accuracy on the complete test pairs.
- ``table2``: Table 2. Scenario 3 (images missing at both parties), 0 aligned ids: accuracy and, in
  place of CLIPScore, the completions' mean cosine to the real representations (``gen_cosine``).
- ``table3``: Table 3. Ablations in scenario 2 with 0 aligned ids: w/o preference loss (L_G =
  gamma L_special), w/o special loss (gamma = 0), w/o scheduler as the paper runs it (mu = 0), plus
  every generation used (scheduler off).
- ``fig3``: Figure 3. (A) accuracy over rounds (Table 1's scenario-1, 0-aligned runs); (B) accuracy
  against the missing rate Delta (BoMM, MM-UC, LOCAL; scenario 1, 0 aligned) and against the
  scheduler threshold mu (BoMM).
- ``cost``: communication (MB up / down per party) and compute seconds (per party, and the cloud's)
  of every method, from Table 1's scenario-1 runs with 200 aligned ids (no extra runs).

Accuracies are the mean of each run's last ``LAST`` evaluations, then mean +- sample std over seeds.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data .venv/bin/python benchmarks/bomm/run_suite.py
    ... --plan           # the runs and the time estimate, nothing run
    ... --quick          # smoke test: digits, 40 rows per party, 2 rounds, to benchmarks/results/_scratch/bomm-quick/
    ... --report-only    # rewrite the markdown and plots from the run folders that exist
"""

from __future__ import annotations

import sys
from dataclasses import replace

from bomm_experiments import EXPERIMENTS, QUICK_RESULTS, REPO, RESULTS, Scale, build_suite_plan, quick_scale, run_cost
from bomm_figures import write_reports

from fedtune import harness


def parse_args(argv=None):
    p = harness.suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="0,1,2", budget_minutes=240.0)
    p.add_argument("--rounds", type=int, default=None, help="override the recipe's rounds")
    return p.parse_args(argv)


def scale_from_args(args) -> Scale:
    scale = quick_scale() if args.quick else Scale()
    if args.rounds is not None:
        scale = replace(scale, overrides=scale.overrides + (f"rounds={args.rounds}",))
    return scale


@harness.suite_main
def main(argv=None) -> int:
    args = parse_args(argv)
    selected, seeds, out, command, _ = harness.suite_start(
        args, argv, __file__, EXPERIMENTS, RESULTS, QUICK_RESULTS, "the FSDD recordings"
    )
    scale = scale_from_args(args)
    plan = build_suite_plan(scale, seeds, out)
    runs = harness.distinct_runs(plan, selected)
    costs = {s.key: run_cost(s.config) for s in runs}
    base = scale.base
    print(
        f"BoMM suite: {', '.join(selected)}; seeds {seeds}; data {base.data.name}; R={base.rounds}, "
        f"H={base.train.local_steps}, {base.federation.num_clients} parties -> {out}"
    )
    note = (
        "cost model: built-in per-run estimates measured on this machine "
        f"(~{harness.estimate_minutes(runs, costs, 1):.0f} min of one core for the selection)"
    )
    return harness.run_suite(
        plan,
        selected,
        args,
        costs,
        lambda: write_reports(plan, selected, scale, seeds, out, command),
        root=REPO,
        notes=[note],
    )


if __name__ == "__main__":
    sys.exit(main())
