"""The benchmark harness: plan sharing, resume, statistics, cost model, report cells, the worker
pool and the standard command line. No training: run folders are written by hand."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import tomli_w

from fedtune.config import load_config
from fedtune.harness import (
    Choice,
    Costs,
    RunSpec,
    SuiteError,
    Sweep,
    accuracy_cell,
    add_sweep_options,
    assignments,
    biased_seed_warning,
    build_plan,
    choice_text,
    choose,
    choose_from,
    distinct_runs,
    estimate_s,
    eval_rounds,
    evaluations,
    imap_unordered,
    load_rounds,
    makespan,
    mean_curve,
    mean_of_last,
    mean_std,
    parse_selection,
    read_overlays,
    run_state,
    runs_section,
    suite_command,
    suite_files,
    suite_main,
    suite_parser,
    sweep_first,
    sweep_note,
    sweep_sections,
    sweep_selection,
    toml_value,
    unfinished,
    upload_cell,
)
from fedtune.report import table_lines

RECIPE = """
rounds = 4
[data]
name = "sst2"
[model]
name = "tiny-bert"
[federation]
num_clients = 4
"""

OVERLAYS = """
[fedit]
method = "fedit"
options = { weighting = "examples" }

[quick]
rounds = 2
[quick.train]
local_steps = 2
"""


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE)
    return path


def two_experiments() -> dict[str, list[RunSpec]]:
    """``ranks`` at ranks 4 and 8; ``seeds`` at rank 8 for seeds 0 and 1: ``seeds``' seed-0 run is
    ``ranks``' r8 run."""
    return {
        "ranks": [RunSpec(f"r{r}", [f"model.lora_rank={r}"], {"rank": r}) for r in (4, 8)],
        "seeds": [RunSpec(f"s{s}", ["model.lora_rank=8", f"seed={s}"], {"seed": s}) for s in (0, 1)],
    }


def finish(
    spec: RunSpec, accuracies: list[float | None], bytes_up: int = 1_000_000, rounds_evaluated: list[int] | None = None
) -> None:
    """Write the run folder ``run_experiment`` would leave (config.toml, metrics.jsonl, summary.json),
    the accuracies at rounds 1, 2, ... (or at ``rounds_evaluated``)."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / "config.toml").write_text(tomli_w.dumps(spec.config.model_dump(mode="json", exclude_none=True)))
    numbers = rounds_evaluated or range(1, len(accuracies) + 1)
    rounds = [{"round": r, "accuracy": a, "bytes_up": bytes_up} for r, a in zip(numbers, accuracies)]
    (spec.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = {
        "name": spec.name,
        "rounds": len(rounds),
        "final_accuracy": accuracies[-1],
        "total_bytes_up": bytes_up * len(rounds),
        "wall_s": 12.0,
    }
    (spec.run_dir / "summary.json").write_text(json.dumps(summary))


# -- per-group selection ------------------------------------------------------------------------


def test_a_group_is_chosen_only_when_its_whole_grid_is_finished_by_the_mean_of_its_last_evaluations(recipe, tmp_path):
    grid = (3e-4, 1e-3, 3e-3)
    plan = build_plan(
        {"sweep": [RunSpec(f"lr{lr:g}", [f"train.lr={lr}"], {"lr": lr}) for lr in reversed(grid)]},
        recipe,
        tmp_path / "out",
    )
    by_lr = {s.labels["lr"]: s for s in plan["sweep"]}
    setting, score = (lambda s: {"lr": s.labels["lr"]}), (lambda s: mean_of_last(load_rounds(s), 2))
    finish(by_lr[3e-4], [0.5, 0.9, 0.6])  # the best single point, but a last-2 mean of 0.75
    finish(by_lr[1e-3], [0.7, 0.8, 0.8])  # last-2 mean 0.8: the choice
    assert choose(plan["sweep"], setting, score) is None  # 3e-3 not finished
    finish(by_lr[3e-3], [0.7, 0.2, 0.3])
    choice = choose(plan["sweep"], setting, score)
    assert choice.setting == {"lr": 1e-3} and choice.score == pytest.approx(0.8)
    assert [s for s, _ in choice.scores] == [{"lr": lr} for lr in grid]  # grid order, whatever the plan's order
    assert choice.runner_up == ({"lr": 3e-4}, pytest.approx(0.75)) and choice.margin == pytest.approx(5.0)
    assert choice.at_edge() is None
    assert choice_text(choice, 0.5) == "lr 0.001 by 5.00 points over lr 0.0003"
    assert choose([], setting, score) is None
    other = build_plan(
        {"sweep": [RunSpec(f"b{lr:g}", [f"train.lr={lr}", "seed=1"], {"lr": lr}) for lr in grid]},
        recipe,
        tmp_path / "out",
    )["sweep"]
    finish(other[0], [None, None])  # finished, never evaluated; the others unfinished
    lines = sweep_sections(
        {"sst2": {"A": plan["sweep"], "B": other}}, {"sst2": {"A": choice, "B": None}}, score, tmp_path / "sweep.png"
    )
    assert "| A | 75.00 | **80.00** | 25.00 | lr 0.001 by 5.00 points over lr 0.0003 |" in lines
    assert "| B | – | pending | pending | waiting for the sweep |" in lines
    finish(other[1], [None])
    finish(other[2], [None])
    lines = sweep_sections({"sst2": {"B": other}}, {"sst2": {"B": None}}, score, tmp_path / "sweep.png")
    assert "| B | – | – | – | no grid point has a score |" in lines and (tmp_path / "sweep.png").exists()
    assert sweep_note({"A": plan["sweep"], "B": other}, {"A": choice, "B": None}, "methods") == (
        "0 methods wait for their sweep; 1 finished it without a score (no evaluation counted; no table runs): B"
    )
    (other[2].run_dir / "summary.json").unlink()
    assert sweep_note({"A": plan["sweep"], "B": other}, {"A": choice}, "methods") == "1 methods wait for their sweep: B"


def test_choice_text_warns_at_the_grid_edge_and_when_nothing_learned():
    edge = choose_from([({"lr": 1e-3}, 0.6), ({"lr": 3e-3}, 0.7)])
    assert edge.at_edge() == "largest"
    assert choice_text(edge, 0.5).endswith("(the grid's largest lr: a rate beyond it might do better)")
    assert "no grid point learned" in choice_text(edge, 0.69, "majority-answer rate")
    assert "majority-answer rate" in choice_text(edge, 0.69, "majority-answer rate")
    assert choice_text(None) == "waiting for the sweep"
    two = Choice({"lr": 1e-3, "server_lr": 3e-3}, 0.8, [({"lr": 1e-3, "server_lr": 3e-3}, 0.8)])
    assert choice_text(two) == "lr 0.001, server lr 0.003" and two.at_edge() is None and two.margin is None


# -- plan ---------------------------------------------------------------------------------------


def test_identical_configs_are_one_run_in_the_first_experiments_folder(recipe, tmp_path):
    plan = build_plan(two_experiments(), recipe, tmp_path / "out")
    (_, r8), (s0, s1) = plan["ranks"], plan["seeds"]
    assert [s.experiment for s in plan["seeds"]] == ["seeds", "seeds"]
    assert not r8.shared and s0.shared and s0.owner == "ranks"
    assert s0.key == r8.key and s0.config is r8.config and s0.run_dir == tmp_path / "out" / "runs" / "ranks" / "r8"
    assert s1.run_dir == tmp_path / "out" / "runs" / "seeds" / "s1" and not s1.shared
    assert r8.config.name == "r8" and r8.config.output_dir == str(tmp_path / "out" / "runs" / "ranks")
    assert r8.config.rounds == 4 and r8.config.model.lora_rank == 8  # the recipe plus the overrides
    assert [s.name for s in distinct_runs(plan, ["ranks", "seeds"])] == ["r4", "r8", "s1"]
    assert [s.name for s in distinct_runs(plan, ["seeds"])] == ["s0", "s1"]  # s0 still in ranks' folder


def test_config_key_ignores_only_name_and_folder(recipe, tmp_path):
    a = build_plan({"x": [RunSpec("a", [])]}, recipe, tmp_path / "one")["x"][0]
    b = build_plan({"y": [RunSpec("b", [])]}, recipe, tmp_path / "two")["y"][0]
    c = build_plan({"x": [RunSpec("a", ["train.lr=0.001"])]}, recipe, tmp_path / "one")["x"][0]
    assert a.key == b.key != c.key


def test_overlays_are_overrides_that_merge_into_the_recipe(recipe, tmp_path):
    path = tmp_path / "overlays.toml"
    path.write_text(OVERLAYS)
    overlays = read_overlays(path)
    assert overlays["fedit"] == ['method="fedit"', 'options.weighting="examples"']
    assert overlays["quick"] == ["rounds=2", "train.local_steps=2"]
    config = load_config(recipe, [*overlays["fedit"], *overlays["quick"]])
    assert (config.method, config.options, config.rounds) == ("fedit", {"weighting": "examples"}, 2)
    assert config.train.local_steps == 2 and config.train.batch_size == 16  # merged, not replaced
    assert config.data.name == "sst2"


def test_toml_values_parse_back_to_the_same_value(recipe):
    values = {
        "model.target_modules": ["query", "value"],
        "train.lr": 1e-3,
        "train.group_by_length": False,
        "federation.profile_choices": {"sketch_ratio": [0.125, 0.5]},
        "data.name": 'a "quoted" name',
    }
    config = load_config(recipe, assignments(values))
    assert config.model.target_modules == ["query", "value"] and config.train.lr == 1e-3
    assert config.train.group_by_length is False and config.data.name == 'a "quoted" name'
    assert config.federation.profile_choices == {"sketch_ratio": [0.125, 0.5]}
    assert toml_value([{"sketch_ratio": 0.5}]) == "[{sketch_ratio = 0.5}]"


# -- resume -------------------------------------------------------------------------------------


def test_resume_skips_runs_whose_summary_is_of_the_same_config(recipe, tmp_path):
    plan = build_plan(two_experiments(), recipe, tmp_path)
    r4, r8 = plan["ranks"]
    s0, s1 = plan["seeds"]
    assert {run_state(s) for s in (r4, r8, s0, s1)} == {"todo"}
    finish(r8, [0.5, 0.6])
    assert run_state(r8) == run_state(s0) == "done"  # the shared run is done for both experiments
    assert unfinished(distinct_runs(plan, ["ranks", "seeds"])) == [r4, s1]
    finish(r4, [0.5])
    (r4.run_dir / "config.toml").write_text(tomli_w.dumps(r8.config.model_dump(mode="json", exclude_none=True)))
    assert run_state(r4) == "stale"  # a finished run of another config under this name: rerun
    (r8.run_dir / "summary.json").write_text('{"name": "r8", "final_acc')  # cut short by a kill
    assert run_state(r8) == "todo" and load_rounds(r8) == []


def test_a_spec_build_plan_has_not_planned_is_an_error_not_a_run_to_do(recipe, tmp_path):
    """An unplanned spec has no folder: its state is an error naming it (never "todo", which
    would run it), and its config is one too; once planned, both are the plan's."""
    spec = RunSpec("r", ["model.lora_rank=4"])
    with pytest.raises(RuntimeError, match="^run 'r': not planned"):
        run_state(spec)
    with pytest.raises(RuntimeError, match="^run 'r': not planned"):
        spec.resolved
    planned = build_plan(two_experiments(), recipe, tmp_path)["ranks"][0]
    assert (planned.folder, planned.resolved) == (planned.run_dir, planned.config) and run_state(planned) == "todo"


# -- statistics ---------------------------------------------------------------------------------


def test_mean_std_is_the_sample_std():
    m, s = mean_std([1.0, 2.0, 4.0])
    assert m == pytest.approx(7 / 3)
    assert s == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert mean_std([3.0]) == (3.0, 0.0) and mean_std([]) == (None, None)


def test_mean_of_last_n_evaluations_skips_rounds_without_one():
    rounds = [
        {"round": 1, "accuracy": 0.5},
        {"round": 2, "accuracy": None},
        {"round": 3, "accuracy": 0.7},
        {"round": 4},
        {"round": 5, "accuracy": 0.9},
    ]
    assert mean_of_last(rounds, 1) == 0.9  # the final point
    assert mean_of_last(rounds, 2) == pytest.approx(0.8)
    assert mean_of_last(rounds, 10) == pytest.approx(0.7)  # all three there are
    assert mean_of_last([{"round": 1, "loss": 0.3}], 3) is None
    assert mean_of_last([{"round": 1, "loss": 0.3}, {"round": 2, "loss": 0.1}], 2, metric="loss") == pytest.approx(0.2)
    with pytest.raises(ValueError):
        mean_of_last(rounds, 0)


def test_curves_accumulate_upload_and_average_over_common_rounds():
    a = [{"round": 1, "accuracy": None, "bytes_up": 2_000_000}, {"round": 2, "accuracy": 0.6, "bytes_up": 2_000_000}]
    assert evaluations(a, num_clients=2) == [(2, 2.0, 0.6)]
    b = [(2, 4.0, 0.8), (3, 6.0, 0.9)]
    assert mean_curve([evaluations(a, num_clients=2), b, []]) == [(2, 3.0, pytest.approx(0.7))]
    assert mean_curve([[], []]) == []


def test_a_curve_is_plotted_in_percent_against_the_round_or_the_upload_once_a_run_has_finished(recipe, tmp_path):
    from fedtune.harness import finish_axes, plot_curve, pyplot

    plan = build_plan({"seeds": two_experiments()["seeds"]}, recipe, tmp_path)["seeds"]
    fig, ax = pyplot().subplots()
    assert plot_curve(ax, plan, label="none") is False and ax.get_lines() == []
    finish_axes(ax, title="t", xlabel="round")
    assert ax.get_legend() is None and ax.get_title() == "t"  # nothing labelled: no legend
    for spec, accuracies in zip(plan, ([0.5, 0.7], [0.7, 0.9])):
        finish(spec, accuracies, bytes_up=2_000_000)
    assert plot_curve(ax, plan, "--", label="rounds") and plot_curve(ax, plan, upload=True, label="MB")
    (by_round, by_upload) = ax.get_lines()
    assert list(by_round.get_xdata()) == [1, 2] and list(by_round.get_ydata()) == pytest.approx([60.0, 80.0])
    assert by_round.get_linestyle() == "--" and by_round.get_marker() == "o"
    assert list(by_upload.get_ydata()) == pytest.approx([60.0, 80.0]) and by_upload.get_xdata()[0] > 0
    finish_axes(ax, 9)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rounds", "MB"]
    pyplot().close(fig)


# -- cost model ---------------------------------------------------------------------------------


def test_estimate_and_lpt_makespan(recipe):
    config = load_config(recipe, ["rounds=5", "eval_every=2", "federation.clients_per_round=2", "train.local_steps=3"])
    assert eval_rounds(5, 2) == 3  # rounds 2, 4 and the last
    costs = Costs(step_s=1.0, eval_s_per_example=0.01, run_setup_s=7.0, client_overhead_s=0.5)
    assert estimate_s(config, costs, test_examples=100) == pytest.approx(7 + 5 * 2 * (3 * 1.0 + 0.5) + 3 * 100 * 0.01)
    assert makespan([5, 4, 3, 3, 3], 2) == 10  # longest first: {5, 3} = 8 and {4, 3, 3} = 10
    assert makespan([], 2) == 0.0


# -- report cells -------------------------------------------------------------------------------


def test_cells_and_runs_section_show_pending_runs(recipe, tmp_path):
    plan = build_plan(two_experiments(), recipe, tmp_path)
    s0, s1 = plan["seeds"]
    assert accuracy_cell([s0, s1]) == "pending" and upload_cell([s0, s1]) == "–"
    finish(s0, [0.5, 0.75])
    assert accuracy_cell([s0, s1]) == "75.00 ± 0.00 (n=1)"
    assert upload_cell([s0, s1]) == "0.500"  # 2 MB over 4 clients
    finish(s1, [0.25, 0.25])
    assert accuracy_cell([s0, s1]) == f"50.00 ± {math.sqrt(2 * 25**2):.2f}"
    assert accuracy_cell([s0, s1], last=2) == f"43.75 ± {math.sqrt(2 * 18.75**2):.2f}"  # (62.5, 25) over seeds
    (s1.run_dir / "summary.json").unlink()
    section = runs_section([s0, s1], tmp_path)
    assert "| s0 | `runs/ranks/r8` (shared with ranks) | 75.00 | 2 | 0.500 | 12 |" in section
    assert "| s1 | `runs/seeds/s1` | pending | 4 | – | – |" in section
    # a DP run's summary releases no bytes or wall time: its row shows neither, and nothing breaks
    summary = json.loads((s0.run_dir / "summary.json").read_text())
    for key in ("total_bytes_up", "wall_s"):
        summary.pop(key)
    (s0.run_dir / "summary.json").write_text(json.dumps(summary))
    assert upload_cell([s0]) == "–"
    assert "| s0 | `runs/ranks/r8` (shared with ranks) | 75.00 | 2 | – | – |" in runs_section([s0], tmp_path)


def test_table_lines():
    assert table_lines(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]


# -- worker pool --------------------------------------------------------------------------------


def torch_threads(job: int) -> tuple[int, int, int]:
    """A trivial job: its number, its worker's process id and torch thread count (a negative job fails)."""
    import torch

    if job < 0:
        raise ValueError(f"job {job} fails")
    return job, os.getpid(), torch.get_num_threads()


def test_pool_runs_jobs_in_spawned_workers_with_one_thread():
    results = {item: (result, error) for item, result, error in imap_unordered(torch_threads, [1, -1, 2], workers=2)}
    assert sorted(results) == [-1, 1, 2]
    for job in (1, 2):
        (number, pid, threads), error = results[job]
        assert error is None and number == job and pid != os.getpid() and threads == 1
    result, error = results[-1]
    assert result is None and "ValueError: job -1 fails" in error  # reported, and the others still ran


def test_a_run_cut_short_continues_from_its_checkpoint_and_ends_as_an_uninterrupted_one(recipe, tmp_path):
    from fedtune.harness.pool import resumable, run_config
    from fedtune.run import run_experiment
    from fedtune.run_folder import RunFolderTaken

    quick = ["rounds=3", "train.local_steps=1", "data.max_train_samples=64", "data.max_test_samples=32"]
    plan = build_plan({"a": [RunSpec("cut", quick)]}, recipe, tmp_path / "a")
    plan.update(build_plan({"b": [RunSpec("whole", quick)]}, recipe, tmp_path / "b"))
    cut, whole = plan["a"][0], plan["b"][0]
    assert cut.key == whole.key and cut.run_dir != whole.run_dir
    assert not resumable(cut.config)

    def kill_after_round_2(record):
        if record.round == 2:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        run_experiment(cut.config, on_round=kill_after_round_2)
    assert run_state(cut) == "todo" and resumable(cut.config)
    first_two = (cut.run_dir / "metrics.jsonl").read_text().splitlines()
    summary, _ = run_config(cut.config)  # the pool's job: continues at round 3
    text = (cut.run_dir / "metrics.jsonl").read_text().splitlines()
    assert text[:2] == first_two and [json.loads(x)["round"] for x in text] == [1, 2, 3]  # rounds 1-2 not rerun
    run_experiment(whole.config)  # the same run, uninterrupted, in another folder
    again = (whole.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["accuracy"] for x in text] == [json.loads(x)["accuracy"] for x in again]
    assert summary["final_loss"] == json.loads((whole.run_dir / "summary.json").read_text())["final_loss"]
    other = cut.config.model_dump(mode="json", exclude_none=True) | {"seed": 9}
    (cut.run_dir / "config.toml").write_text(tomli_w.dumps(other))
    assert not resumable(cut.config)  # another config's checkpoint: start afresh
    # a run of another config under the same name, killed before its first round ends, leaves no
    # checkpoint behind: the finished run's checkpoint must not pass for its progress
    seed9 = build_plan({"a": [RunSpec("cut", [*quick, "seed=9"])]}, recipe, tmp_path / "a")["a"][0]

    def killed_before_round_1(context):
        raise RuntimeError("killed")

    with pytest.raises(RunFolderTaken):  # never over the earlier run's files
        run_experiment(seed9.config, on_start=killed_before_round_1)
    with pytest.raises(RuntimeError, match="killed"):  # as the pool runs it: the earlier run moved aside
        run_experiment(seed9.config, on_start=killed_before_round_1, overwrite=True)
    assert not (cut.run_dir / "checkpoint.npz").exists() and not (cut.run_dir / "summary.json").exists()
    assert not resumable(seed9.config) and run_state(seed9) == "todo"
    aside = cut.run_dir.with_name("cut.old-1")  # nothing lost
    assert (aside / "checkpoint.npz").is_file() and json.loads((aside / "summary.json").read_text()) == summary


def sleep_or_return(job: int) -> int:
    if job:
        time.sleep(60)
    return job


def test_an_abandoned_pool_stops_its_workers():
    import multiprocessing

    before = set(multiprocessing.active_children())  # children of other tests, if any, are not this pool's
    results = imap_unordered(sleep_or_return, [0, 1, 1], workers=2)
    assert next(results)[1] == 0
    results.close()  # what Ctrl-C in a suite does: the two sleeping (60 s) jobs must not run on
    deadline = time.perf_counter() + 20  # a loaded machine may take a moment to reap them
    while set(multiprocessing.active_children()) - before and time.perf_counter() < deadline:
        time.sleep(0.2)
    assert not set(multiprocessing.active_children()) - before


# -- command line -------------------------------------------------------------------------------


def test_standard_command_line():
    parser = suite_parser("a suite", ["a", "b", "c"])
    args = parser.parse_args(["--only", "c,a", "--seeds", "0,2", "--workers", "1", "--plan"])
    assert parse_selection(args, ["a", "b", "c"]) == (["a", "c"], [0, 2])  # in the suite's order
    assert args.workers == 1 and args.plan and not args.report_only and not args.quick
    with pytest.raises(SuiteError, match="unknown"):
        parse_selection(parser.parse_args(["--only", "d"]), ["a", "b", "c"])
    with pytest.raises(SuiteError, match="seeds"):
        parse_selection(parser.parse_args(["--seeds", ","]), ["a", "b", "c"])
    with pytest.raises(SuiteError, match="^--seeds: comma-separated integers expected, got '0,x'$"):
        parse_selection(parser.parse_args(["--seeds", "0,x"]), ["a", "b", "c"])
    command = suite_command("benchmarks/x/run_suite.py", ["--quick", "--report-only", "--only", "a b"])
    assert command.endswith(".venv/bin/python benchmarks/x/run_suite.py --quick --only 'a b'")


def test_a_suites_bad_option_prints_its_one_line_and_exits_2(capsys):
    @suite_main
    def main(argv=None):
        parse_selection(suite_parser("a suite", ["a", "b"]).parse_args(argv), ["a", "b"])
        return 0

    assert main(["--only", "b"]) == 0
    assert main(["--only", "c"]) == 2
    assert capsys.readouterr().out == "--only: unknown ['c'] (expected ['a', 'b'])\n"


def test_suite_files_are_named_after_the_suite(tmp_path):
    (tmp_path / "configs" / "benchmarks").mkdir(parents=True)
    (tmp_path / "configs" / "benchmarks" / "x-suite-overlays.toml").write_text("[quick]\nrounds = 2\n")
    recipe, overlays, results, quick = suite_files(tmp_path, "x-suite", "x")
    assert recipe == tmp_path / "configs" / "benchmarks" / "x-suite.toml" and overlays == {"quick": ["rounds=2"]}
    assert (results, quick) == (tmp_path / "benchmarks/results/x", tmp_path / "benchmarks/results/_scratch/x-quick")
    assert suite_files(tmp_path, "y", "y/z", "y-quick")[1:] == (
        {},  # no overlays file
        tmp_path / "benchmarks/results/y/z",
        tmp_path / "benchmarks/results/_scratch/y-quick",
    )


def test_the_sweep_runs_before_the_experiments_planned_from_it():
    parser = suite_parser("a suite", ["sweep", "table", "fig"])
    calls = []

    def stage(selection):
        calls.append(selection)
        return {"sweep": 1, "table": 0}.get(selection[0], 0)

    assert sweep_first(stage, ["sweep", "table", "fig"], parser.parse_args([])) == 1  # a failed sweep run shows
    assert calls == [["sweep"], ["table", "fig"]]
    for argv, selected in (
        (["--plan"], ["sweep", "table"]),
        (["--report-only"], ["sweep", "table"]),
        ([], ["table"]),
        ([], ["sweep"]),
    ):
        calls.clear()
        sweep_first(stage, selected, parser.parse_args(argv))
        assert calls == [selected]  # one plan: nothing runs, or nothing is planned from a sweep
    calls.clear()  # several sweeps (one per method): all of them first, then what is planned from them
    assert sweep_first(stage, ["table", "sweep", "fig", "sweep2"], parser.parse_args([]), ["sweep", "sweep2"]) == 1
    assert calls == [["sweep", "sweep2"], ["table", "fig"]]


def test_a_pool_job_runs_its_config_on_the_engine_the_config_names(recipe, tmp_path, monkeypatch):
    from fedtune import launch
    from fedtune.harness.pool import run_config

    launched = []
    monkeypatch.setitem(launch.ENGINES, "flower-sim", lambda config, **kw: launched.append((config, kw)) or {})
    spec = build_plan({"e": [RunSpec("r", ['engine="flower-sim"'])]}, recipe, tmp_path)["e"][0]
    assert run_config(spec.config)[0] == {}
    [(run, options)] = launched  # the launcher gets the run resolved once
    assert run.config == spec.config
    assert options == {"on_round": None, "on_start": None, "resume": False, "overwrite": True}


def test_the_sweep_needs_a_grid_and_a_grid_needs_positive_rates(capsys):
    experiments = ["sweep", "table", "fig"]
    parser = suite_parser("a suite", experiments)
    add_sweep_options(parser, experiments, "each method")
    args = parser.parse_args([])
    assert parse_selection(args, experiments)[0] == ["table", "fig"]  # no sweep by default
    assert sweep_selection(args, ["table", "fig"], ["table"]) == (None, ["table", "fig"])
    with pytest.raises(SuiteError, match="^--only sweep: needs --lr-grid"):
        sweep_selection(parser.parse_args(["--only", "sweep"]), ["sweep"], ["table"])
    for bad in ("", "1e-3,x", "1e-3,0", "-1", "inf", "nan", "1e-3,1.0000001e-3"):
        with pytest.raises(
            SuiteError, match="^--lr-grid: (expected comma-separated positive learning rates|values must differ)"
        ):
            sweep_selection(parser.parse_args(["--lr-grid", bad]), ["table"], ["table"])
    factors = suite_parser("a suite", experiments)
    add_sweep_options(factors, experiments, "each method", factors=True, sweep_seed=3)
    assert sweep_selection(factors.parse_args(["--lr-factors", "1,0.3"]), ["table"], ["table"]) == (
        Sweep((0.3, 1.0), 3),
        ["sweep", "table"],
    )
    assert str(Sweep((3e-4, 1e-3), 3)) == "rates 0.0003, 0.001 swept on seed 3"  # the suites' plan line
    with pytest.raises(SuiteError, match="^--lr-factors: expected comma-separated positive multiples of each"):
        sweep_selection(factors.parse_args(["--lr-factors", "0"]), ["table"], ["table"])
    with pytest.raises(SuiteError, match="^--only sweep: needs --lr-factors"):
        sweep_selection(factors.parse_args(["--only", "sweep"]), ["sweep"], ["table"])
    args = parser.parse_args(["--lr-grid", "3e-3,1e-3,3e-3", "--sweep-seed", "4"])
    assert sweep_selection(args, ["table", "fig"], ["table"]) == (Sweep((1e-3, 3e-3), 4), ["sweep", "table", "fig"])
    assert sweep_selection(args, ["fig"], ["table"]) == (Sweep((1e-3, 3e-3), 4), ["fig"])  # nothing planned from it
    biased_seed_warning(Sweep((1e-3,), 4), [1, 2], ["table"], ["table"])
    assert capsys.readouterr().out == ""
    biased_seed_warning(Sweep((1e-3,), 4), [4, 5], ["table"], ["table"])
    assert "the sweep seed 4 is among --seeds" in capsys.readouterr().out


def test_each_finished_run_prints_its_final_accuracy_and_loss(monkeypatch, capsys):
    """A sweep that picks by the loss (Dolly's) shows the loss it picks by, not only an accuracy."""
    from types import SimpleNamespace

    from fedtune.harness import pool

    specs = [
        SimpleNamespace(key=name, owner="sweep", config=config, resolved=config, summary=summary)
        for name, summary in (("a", {"final_accuracy": 0.0, "final_loss": 2.6096}), ("b", {"final_accuracy": 0.5}))
        for config in [SimpleNamespace(name=name)]
    ]
    by_config = {id(s.config): s.summary for s in specs}
    monkeypatch.setattr(
        pool, "imap_unordered", lambda job, configs, workers: ((c, (by_config[id(c)], 3.0), None) for c in configs)
    )
    assert pool.run_specs(specs, {"a": 2.0, "b": 1.0}, workers=1) == ([], False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/2] sweep/a  acc 0.0000  loss 2.6096  3 s")
    assert out[1].startswith("[2/2] sweep/b  acc 0.5000  loss –  3 s")
