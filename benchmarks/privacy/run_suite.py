"""The privacy-utility benchmark (issue 28, item 5): FedIT on SST-2 with MiniLM, 100 clients, 10
sampled per round (q = 0.1), client-level central DP (DP-FedAvg, ``fedtune.methods.base.privacy``) at
a target epsilon of 1, 3 and 8, and without DP (epsilon infinity), plus an FSLoRA row at epsilon 8
and without DP; written to ``benchmarks/results/privacy/`` (README.md, results.json,
accuracy_vs_epsilon.png).

The runs, the experiments and what is reported: ``privacy_experiments.py`` (the plan),
``privacy_report.py`` (the table and plot), ``privacy_secagg.py`` (SecAgg+'s byte overhead). Every
experiment, ``secagg``'s two Flower-simulation runs included, runs on the harness's worker pool.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/privacy/run_suite.py --plan
    ... --only sweep | --only table | (both: the table is planned once the sweep is done)
    ... --only fslora-sweep,fslora-table (FSLoRA's part, the same way)
    ... --only secagg (2 runs of one round, Ray; Flower's runtime dependency installation off)
    ... --report-only | --quick (tiny-bert, 2 rounds, 40 clients, a scratch folder)
"""

from __future__ import annotations

import os
import sys

import privacy_experiments as suite
from privacy_report import report
from privacy_secagg import write_secagg

from fedtune import harness


@harness.suite_main
def main(argv: list[str] | None = None) -> int:
    p = harness.suite_parser(__doc__.split("\n\n")[0], suite.EXPERIMENTS, seeds="1,2,3", budget_minutes=300.0)
    p.set_defaults(only=suite.DEFAULT_ONLY)
    p.add_argument(
        "--sweep-seed", type=int, default=suite.SWEEP_SEED, help=f"the seed that chooses each clip ({suite.SWEEP_SEED})"
    )
    args = p.parse_args(argv)
    selected, seeds, out, command, _ = harness.suite_start(
        args, argv, __file__, suite.EXPERIMENTS, suite.RESULTS, suite.QUICK_RESULTS, "sst2"
    )
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")  # the secagg runs' workers

    def stage(selection: list[str]) -> int:
        plan, choices, waiting = suite.build(seeds, args.sweep_seed, args.quick, out)
        notes = [
            f"{suite.METHODS[m][4]}: {sum(n == m for n, _ in waiting) * len(seeds)} runs wait for the sweep (epsilon "
            + (", ".join(f"{e:g}" for n, e in waiting if n == m) or "none")
            + ")"
            for m in suite.METHODS
            if suite.METHODS[m][4] in selection
        ]

        def reports():
            secagg = write_secagg(plan[suite.SECAGG], out, command) if suite.SECAGG in selection else []
            return [*secagg, *report(plan, choices, out, command)]

        return harness.run_suite(
            plan, selection, args, suite.costs(plan, args.quick), reports, root=suite.REPO, notes=notes
        )

    return harness.sweep_first(stage, selected, args, [suite.METHODS[m][3] for m in suite.METHODS])


if __name__ == "__main__":
    sys.exit(main())
