r"""One benchmark harness for every paper's suite: plan, resume, worker pool, statistics, reports.

A suite is a short module that says which runs each experiment needs and what its reports say;
the harness does the rest:

- :mod:`~fedtune.harness.plan`: :class:`RunSpec` (a named run = the suite's recipe TOML plus
  ``key=value`` overrides, resolved with :func:`fedtune.config.load_config`), :func:`read_overlays`
  (named groups of overrides kept in ``configs/``), :func:`build_plan` (identical configs across
  experiments run once, in ``out/runs/<first experiment>/<name>``);
- :mod:`~fedtune.harness.runs`: resume (a run with a ``summary.json`` of the very same config is
  ``done`` and skipped) and reading finished runs back;
- :mod:`~fedtune.harness.pool`: spawned workers with one torch thread each; a run cut short (a
  killed or interrupted suite) continues from its last checkpointed round;
- :mod:`~fedtune.harness.choice`: per-group selection of a setting (each method at its own best
  learning rate): the argmax of a score over a finished grid of runs;
- :mod:`~fedtune.harness.cost`: a per-run cost model and the ``--plan`` time estimate;
- :mod:`~fedtune.harness.stats`: mean and sample std over seeds, the mean of a run's last N
  evaluations, seed-averaged curves, whether a result is clearly above a reference rate;
- :mod:`~fedtune.harness.report`: markdown cells and tables over specs, one plotting context;
- :mod:`~fedtune.harness.cli`: the standard command line (``--only``, ``--seeds``, ``--quick``,
  ``--workers``, ``--plan``, ``--report-only``, ``--out``) and the steps every suite takes.

Example, a whole suite in one file, ``benchmarks/mysuite/run_suite.py`` (a full one,
``benchmarks/fslora/run_suite.py``, keeps its experiments and reports in modules beside it:
``fslora_suite_experiments.py``, ...)::

    import sys
    from pathlib import Path

    from fedtune import harness

    REPO = Path(__file__).resolve().parents[2]
    # configs/benchmarks/mysuite.toml (what every run shares), its overlays ([quick], [fedit], ...),
    # benchmarks/results/mysuite/ and --quick's benchmarks/results/_scratch/mysuite-quick/
    RECIPE, OVERLAYS, RESULTS, QUICK_RESULTS = harness.suite_files(REPO, "mysuite", "mysuite")
    EXPERIMENTS = ["ranks"]
    RANKS = (4, 8, 16)

    def ranks(seeds, scale):  # FedIT at three LoRA ranks
        return [harness.RunSpec(f"r{r}-s{seed}", [*scale, *OVERLAYS["fedit"], f"seed={seed}", f"model.lora_rank={r}"],
                                {"rank": r, "seed": seed})
                for seed in seeds for r in RANKS]

    @harness.suite_main  # a bad option: its one line, exit status 2
    def main(argv=None):
        args = harness.suite_parser("FedIT over LoRA ranks", EXPERIMENTS).parse_args(argv)
        selected, seeds, out, command, _ = harness.suite_start(
            args, argv, __file__, EXPERIMENTS, RESULTS, QUICK_RESULTS, "sst2")
        plan = harness.build_plan({"ranks": ranks(seeds, OVERLAYS["quick"] if args.quick else [])}, RECIPE, out)

        def write_reports():
            rows = [[str(r), harness.accuracy_cell(harness.with_labels(plan["ranks"], rank=r))] for r in RANKS]
            lines = ["# FedIT over LoRA ranks", "", *harness.produced_by(command)]
            lines += [*harness.table_lines(["r", "final acc (%)"], rows), ""]
            out.mkdir(parents=True, exist_ok=True)
            (out / "ranks.md").write_text("\n".join(lines) + "\n" + harness.runs_section(plan["ranks"], out))
            return [out / "ranks.md"]

        costs = {s.key: 60.0 for s in plan["ranks"]}  # seconds per run; or harness.estimate_s(config, Costs(...), n)
        return harness.run_suite(plan, selected, args, costs, write_reports, root=REPO)

    if __name__ == "__main__":
        sys.exit(main())

Name the data set and the model in the recipe: ``run_experiment`` writes the config with the
task's defaults filled in, and resume compares that with the planned config.

Workers call :func:`fedtune.launch.launch` (each run on the engine its config names); the harness
imports nothing else from the engines.
"""

from fedtune.harness.choice import (
    Choice,
    Sweep,
    choice_text,
    choose,
    choose_from,
    setting_text,
    sweep_note,
    sweep_sections,
)
from fedtune.harness.cli import (
    Start,
    SuiteError,
    add_sweep_options,
    biased_seed_warning,
    estimate_minutes,
    offline_data,
    output_dir,
    parse_grid,
    parse_selection,
    print_plan,
    run_suite,
    suite_command,
    suite_main,
    suite_parser,
    suite_start,
    sweep_first,
    sweep_selection,
)
from fedtune.harness.cost import Costs, Probe, calibrate, estimate_s, eval_rounds, makespan, probe
from fedtune.harness.plan import (
    Plan,
    RunSpec,
    SuiteFiles,
    assignments,
    build_plan,
    config_key,
    distinct_runs,
    read_overlays,
    suite_files,
    toml_value,
    with_labels,
)
from fedtune.harness.pool import imap_unordered, run_config, run_specs, setup_worker
from fedtune.harness.report import (
    accuracy_cell,
    averaged_curve,
    curve,
    figure,
    final_accuracy,
    finish_axes,
    mean_text,
    per_device_mb,
    percent,
    plot_curve,
    produced_by,
    pyplot,
    run_accuracy,
    runs_section,
    table_lines,
    upload_cell,
)
from fedtune.harness.runs import load_finished, load_rounds, load_summary, run_state, unfinished
from fedtune.harness.stats import (
    MIN_MARGIN,
    Curve,
    Z,
    clearly_above,
    evaluations,
    mean,
    mean_curve,
    mean_of_last,
    mean_std,
)

__all__ = [
    "SuiteError",
    "add_sweep_options",
    "biased_seed_warning",
    "estimate_minutes",
    "offline_data",
    "output_dir",
    "parse_grid",
    "parse_selection",
    "print_plan",
    "run_suite",
    "suite_command",
    "suite_main",
    "Start",
    "suite_start",
    "suite_parser",
    "sweep_first",
    "sweep_selection",
    "Choice",
    "Sweep",
    "choice_text",
    "choose",
    "choose_from",
    "setting_text",
    "sweep_note",
    "sweep_sections",
    "Costs",
    "Probe",
    "calibrate",
    "estimate_s",
    "eval_rounds",
    "makespan",
    "probe",
    "Plan",
    "RunSpec",
    "assignments",
    "build_plan",
    "config_key",
    "distinct_runs",
    "read_overlays",
    "SuiteFiles",
    "suite_files",
    "toml_value",
    "with_labels",
    "imap_unordered",
    "run_config",
    "run_specs",
    "setup_worker",
    "accuracy_cell",
    "averaged_curve",
    "curve",
    "figure",
    "final_accuracy",
    "finish_axes",
    "plot_curve",
    "mean_text",
    "per_device_mb",
    "percent",
    "produced_by",
    "pyplot",
    "run_accuracy",
    "runs_section",
    "table_lines",
    "upload_cell",
    "load_finished",
    "load_rounds",
    "load_summary",
    "run_state",
    "unfinished",
    "MIN_MARGIN",
    "Z",
    "Curve",
    "clearly_above",
    "evaluations",
    "mean",
    "mean_curve",
    "mean_of_last",
    "mean_std",
]
