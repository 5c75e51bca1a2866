"""benchmarks/llm/llm_tables.py (issue 27's two causal-LM tables): every planned run resolves and is its
recipe plus the method's overlay; the Dolly sweep picks the lowest response loss, the commonsense one
the highest accuracy; a table cell is the mean +- sample std over seeds of each run's mean of its last
two evaluations, computed by hand here from written run folders; the cost model's arithmetic."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tomli_w

from fedtune import harness
from fedtune.harness import Sweep
from tests.conftest import assert_every_planned_run_resolves, suite_fixture

suite = suite_fixture("llm/llm_tables.py", "llm_tables")


def out_dirs(tmp_path):
    return {"table52": tmp_path / "t52", "dolly": tmp_path / "dolly"}


def finish(spec, rounds: list[dict], compute_s: float = 100.0) -> None:
    """The run folder ``run_experiment`` would leave (config.toml, metrics.jsonl, summary.json)."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / "config.toml").write_text(tomli_w.dumps(spec.config.model_dump(mode="json", exclude_none=True)))
    (spec.run_dir / "metrics.jsonl").write_text("".join(json.dumps({"bytes_up": 1, **r}) + "\n" for r in rounds))
    summary = {
        "name": spec.name,
        "rounds": len(rounds),
        "final_accuracy": rounds[-1].get("accuracy"),
        "total_bytes_up": len(rounds),
        "total_compute_s": compute_s,
        "wall_s": 1.0,
    }
    (spec.run_dir / "summary.json").write_text(json.dumps(summary))


def test_every_planned_run_resolves_and_is_the_recipe_plus_its_method(suite, tmp_path):
    plans = suite.build(suite.TABLES, [1, 2, 3], Sweep((1e-3, 3e-3)), False, out_dirs(tmp_path))
    runs = {"sweep": [s for t in suite.TABLES for s in plans[t][0]["sweep"]]}
    assert assert_every_planned_run_resolves(runs) == 2 * (5 + 2)
    plans = suite.build(suite.TABLES, [1, 2, 3], None, False, out_dirs(tmp_path))
    assert assert_every_planned_run_resolves({t: plans[t][1][t] for t in suite.TABLES}) == 3 * (5 + 2)
    for spec in plans["table52"][1]["table52"]:
        c = spec.config
        assert c.method == spec.labels["method"] and c.data.name == "commonsense"
        if c.method == "fedit":  # the smallest rank, 0.125 r: every device affords it
            assert (c.model.lora_rank, c.model.lora_alpha, c.federation.profile_choices) == (8, 16.0, None)
        else:
            assert c.model.lora_rank == 64
            assert c.federation.profile_choices == {"sketch_ratio": [0.125, 0.25, 0.5, 0.75]}
    for spec in plans["dolly"][1]["dolly"]:
        c = spec.config
        assert (c.data.name, c.data.client_column, c.federation.num_clients) == ("dolly", "fedit_client", 10)
        assert c.federation.profiles is None  # every FedIT client online (the recipe's held-out one is not)


def test_dolly_sweep_picks_the_lowest_loss_and_commonsense_the_highest_accuracy(suite, tmp_path):
    plans = suite.build(suite.TABLES, [1], Sweep((1e-3, 3e-3)), False, out_dirs(tmp_path))
    for spec in plans["dolly"][0]["sweep"]:  # 3e-3: the lower loss, the higher ROUGE-L too
        low = spec.labels["lr"] == 3e-3
        finish(spec, [{"round": r, "loss": 2.0 if low else 2.5, "rouge_l": 0.1} for r in (2, 4)])
    for spec in plans["table52"][0]["sweep"]:  # 1e-3: the higher accuracy
        acc = 0.5 if spec.labels["lr"] == 1e-3 else 0.4
        finish(spec, [{"round": r, "accuracy": acc} for r in (3, 6)])
    plans = suite.build(suite.TABLES, [1], Sweep((1e-3, 3e-3)), False, out_dirs(tmp_path))
    assert {m: c.setting["lr"] for m, c in plans["dolly"][2].items()} == {"fedit": 3e-3, "local": 3e-3}
    assert {c.setting["lr"] for c in plans["table52"][2].values()} == {1e-3}
    assert {s.config.train.lr for s in plans["table52"][1]["table52"]} == {1e-3}


def test_a_cell_is_the_seed_mean_and_std_of_each_runs_last_two_evaluations(suite, tmp_path):
    out = out_dirs(tmp_path)
    plans = suite.build(["table52"], [1, 2, 3], None, False, out)
    runs = plans["table52"][1]["table52"]
    evals = {1: (0.30, 0.50, 0.60), 2: (0.10, 0.40, 0.50)}  # rounds 2, 4, 6: the last two count
    for spec in runs:
        if spec.labels["method"] == "fslora" and spec.labels["seed"] in evals:
            a = evals[spec.labels["seed"]]
            finish(
                spec,
                [{"round": r, "accuracy": x, "acc_arc_easy": x + 0.1, "loss": 1.0} for r, x in zip((2, 4, 6), a)],
                compute_s=50.0 * spec.labels["seed"],
            )
    base = {"accuracy": 0.3, "acc_arc_easy": 0.4, "loss": 5.0, "test_examples": 200}
    out["table52"].mkdir(parents=True, exist_ok=True)
    (out["table52"] / "untuned-table52.json").write_text(json.dumps(base))
    written = suite.write_report("table52", plans, [1, 2, 3], None, base, out["table52"], "cmd", "scale")
    assert all(p.exists() for p in written)
    rows = {r["method"]: r for r in json.loads((out["table52"] / "results.json").read_text())["rows"]}
    means = [0.55, 0.45]  # (0.5 + 0.6) / 2, (0.4 + 0.5) / 2
    assert rows["fslora"]["seeds"] == 2 and rows["fslora"]["compute_s"] == pytest.approx(75.0)
    assert rows["fslora"]["accuracy"] == pytest.approx([0.5, math.sqrt(2 * 0.05**2)])
    assert rows["fslora"]["acc_arc_easy"][0] == pytest.approx(sum(means) / 2 + 0.1)
    assert rows["untuned"]["accuracy"] == [0.3, 0.0] and rows["heterolora"]["seeds"] == 0
    readme = (out["table52"] / "README.md").read_text()
    assert readme.startswith("# commonsense-table52: PARTIAL") and "50.0 ± 7.1" in readme and "pending" in readme
    assert "ordering (fslora first): not comparable yet" in readme
    assert "ordering (fslora first, final evaluation): not comparable yet" in readme
    rows = [{"method": m, "accuracy": [v, 0.0]} for m, v in (("untuned", 0.3), ("fslora", 0.5), ("fedit", 0.6))]
    assert "does NOT reproduce (fedit first" in suite.ordering_line("table52", rows)
    rows[2]["accuracy"] = [0.4, 0.0]
    assert ": reproduces (fslora - fedit = +10.0 points" in suite.ordering_line("table52", rows)


def test_the_papers_ordering_counts_a_gap_only_beyond_twice_the_noise_of_a_difference(suite):
    """noise = sqrt(sd_a^2 / S_a + sd_b^2 / S_b + se_a^2 + se_b^2): 3 seeds of sd 3 points and an
    SE of 2 points per row give sqrt(2 * 9 / 3 + 2 * 4) = 3.74 points, so a 6-point lead is not
    distinguishable; without the SE (2.45) or without the seed spread (2.83) it would count, with
    sd instead of sd / sqrt(S) the noise would read 5.1."""
    rows = [
        {"method": "untuned", "seeds": 0, "accuracy": [0.30, 0.0]},
        {"method": "fslora", "seeds": 3, "accuracy": [0.52, 0.03]},
        {"method": "fedit", "seeds": 3, "accuracy": [0.46, 0.03]},
        {"method": "flexlora", "seeds": 3, "accuracy": [0.40, 0.01]},
    ]
    line = suite.ordering_line("table52", rows, se=lambda r: 0.02)
    assert "not distinguishable (fslora - fedit = +6.0 points, noise of the difference 3.7" in line
    assert ": reproduces (fslora - fedit = +6.0 points, noise of the difference 2.4" in suite.ordering_line(
        "table52", rows
    )
    rows[1]["accuracy"] = [0.40, 0.03]  # fedit leads by 6: within the noise, no claim either way
    assert "not distinguishable (fslora - fedit = -6.0 points" in suite.ordering_line(
        "table52", rows, se=lambda r: 0.02
    )
    rows[1]["accuracy"] = [0.30, 0.03]  # fedit leads by 16 > 2 x 3.7
    assert "does NOT reproduce (fedit first; fslora - fedit = -16.0" in suite.ordering_line(
        "table52", rows, se=lambda r: 0.02
    )
    one_seed = [{**r, "seeds": 1} for r in rows]  # one seed's sd (0 by mean_std) is no spread estimate
    assert "noise of the difference 2.8" in suite.ordering_line("table52", one_seed, se=lambda r: 0.02)
    dolly = [
        {"method": "untuned", "seeds": 0, "rouge_l": [0.20, 0.0]},
        {"method": "fedit", "seeds": 3, "rouge_l": [0.25, 0.01]},
        {"method": "local", "seeds": 3, "rouge_l": [0.21, 0.01]},
    ]
    assert ": reproduces (fedit - local = +4.0 points, noise of the difference 0.8 (seed spread only" in (
        suite.ordering_line("dolly", dolly)
    )
    for row, loss in zip(dolly, (2.86, 2.49, 2.67)):
        row["loss"] = [loss, 0.0 if row["seeds"] == 0 else 0.015]
    line = suite.ordering_line("dolly", dolly, "loss", lower=True)  # the lower loss leads
    assert ": reproduces (fedit - local = -0.180, noise of the difference 0.012 (seed spread only" in line
    dolly[2]["loss"] = [2.48, 0.015]
    assert ": not distinguishable (fedit - local = +0.010" in suite.ordering_line("dolly", dolly, "loss", lower=True)
    dolly[2]["loss"] = [2.40, 0.015]
    line = suite.ordering_line("dolly", dolly, "loss", lower=True)
    assert ": does NOT reproduce (local first; fedit - local = +0.090, noise of the difference 0.012" in line
    final = [{**r, "final_accuracy": [None, None]} for r in rows]
    assert "final evaluation): not comparable yet" in suite.ordering_line(
        "table52", final, "final_accuracy", lambda r: 0.02, "final evaluation"
    )


def test_cost_model_counts_steps_and_evaluated_questions(suite, tmp_path):
    plans = suite.build(suite.TABLES, [1], Sweep((1e-3, 3e-3)), False, out_dirs(tmp_path))
    fs = next(s for s in plans["table52"][3] if s.labels["method"] == "fslora")  # waiting for the sweep
    c = fs.config
    steps = c.rounds * c.federation.clients_per_round * c.train.local_steps
    questions = c.task.options["test_per_set"] * len(c.task.options["sets"])
    evaluations = c.rounds // c.eval_every
    assert suite.run_cost(fs) == pytest.approx(
        suite.SETUP_S + steps * suite.STEP_S["table52"] + evaluations * questions * suite.EVAL_S["table52"]
    )
    local = next(s for s in plans["dolly"][3] if s.labels["method"] == "local")
    lc = local.config
    assert (lc.rounds, lc.eval_every) == (suite.DOLLY_ROUNDS, suite.DOLLY_ROUNDS)  # local: the final round only
    dolly_steps = lc.rounds * 3 * lc.train.local_steps * suite.STEP_S["dolly"]
    assert suite.run_cost(local) == pytest.approx(
        suite.SETUP_S + dolly_steps + 1 * 80 * suite.EVAL_S["dolly"] * 10  # every client's adapter, once
    )
    swept = next(s for s in plans["dolly"][0]["sweep"] if s.labels["method"] == "local")
    assert swept.config.task.options["generate"] is False  # the sweep chooses by the loss: nothing generated
    assert swept.config.data.max_test_samples == suite.DOLLY_SWEEP_TEST == 40  # a seed-0 half of the 80
    assert suite.run_cost(swept) == pytest.approx(suite.SETUP_S + dolly_steps + 40 * suite.LOSS_EVAL_S * 10)
    fedit = next(s for s in plans["dolly"][3] if s.labels["method"] == "fedit")
    assert fedit.config.eval_every == 2 and fedit.config.task.options.get("generate", True)


def test_plan_prints_the_total_of_sweep_tables_and_final_evaluations(suite, tmp_path, capsys):
    args = ["--plan", "--lr-grid", "1e-3,3e-3", "--seeds", "1,2,3", "--workers", "2", "--out", str(tmp_path)]
    assert suite.main(args) == 0
    text = capsys.readouterr().out
    total = next(line for line in text.splitlines() if line.startswith("total still to do"))
    plans = suite.build(suite.TABLES, [1, 2, 3], Sweep((1e-3, 3e-3)), False, out_dirs(tmp_path))
    sweep = [s for t in suite.TABLES for s in plans[t][0]["sweep"]]
    waiting = [s for t in suite.TABLES for s in plans[t][3]]
    assert (len(sweep), len(waiting)) == (2 * 7, 3 * 7)
    final = suite.final_cost("table52", suite.FINAL_PER_SET, False)
    assert final == pytest.approx(suite.SETUP_S + 2 * suite.FINAL_PER_SET * suite.EVAL_S["table52"])  # ARC: > 500
    untuned = [suite.SETUP_S + 200 * suite.EVAL_S["table52"], suite.SETUP_S + 80 * suite.EVAL_S["dolly"]]
    minutes = [
        harness.makespan([suite.run_cost(s) for s in sweep], 2) / 60,
        harness.makespan([suite.run_cost(s) for s in waiting], 2) / 60,
        harness.makespan([final] * 16 + untuned, 2) / 60,  # 15 table runs and the untuned base; two untuned rows
    ]
    assert f"~{sum(minutes):.0f} min" in total and "14 runs" in total and "21 runs" in total
    assert "18 final and untuned evaluations" in total and f"~{minutes[2]:.0f} min" in total


def test_final_evaluation_scores_the_final_adapter_on_the_larger_subset(suite, tmp_path):
    """A table run's final evaluation is the task's evaluation of its final adapter on a seed-0
    subset of ``limit`` questions of each set's full evaluation split (drawn here by hand), saved
    next to the run and not recomputed; the untuned row scores the bare base the same way."""
    from fedtune.config import load_config
    from fedtune.run import run_experiment
    from fedtune.trained.loader import evaluation_task, open_run, prepared_base

    out = out_dirs(tmp_path)
    plans = suite.build(["table52"], [1], None, True, out)  # --quick: tiny-llama, 4 questions per set in training
    runs = [s for s in plans["table52"][1]["table52"] if s.labels["method"] == "fslora"]
    run_experiment(runs[0].config)
    limit = 6
    jobs = suite.final_jobs("table52", plans["table52"][1]["table52"], limit, True, out["table52"])
    assert [j[0].label for j in jobs] == ["untuned", str(runs[0].run_dir)]  # the other methods did not run
    assert suite.run_final_evaluations(jobs, 1) == []
    saved = json.loads((runs[0].run_dir / suite.FINAL_EVAL).read_text())
    base_saved = json.loads((out["table52"] / "untuned-table52-final.json").read_text())

    def direct(model_of, config) -> dict[str, dict]:
        """Each set: its full evaluation split, a seed-0 draw of ``limit`` questions, the task's evaluate."""
        scores = {}
        for name in ("arc_easy", "arc_challenge"):
            tree = config.model_dump(mode="json")
            tree["task"].update(sets=[name], test_per_set=None)
            task = evaluation_task(type(config).model_validate(tree))
            train, full = task.data
            idx = np.sort(np.random.default_rng(0).choice(len(full), size=limit, replace=False))
            task.__dict__["data"] = (train, full.subset(idx))
            scores[name] = task.evaluate(model_of(task), config.train.eval_batch_size)
        return scores

    run = open_run(runs[0].run_dir)
    bench = suite.BENCHES["table52"]  # the untuned row: the recipe's config (tiny-llama's weights follow its seed)
    base_config = load_config(bench.recipe, list(bench.quick))
    for result, scores in ((saved, direct(run.model, run.config)), (base_saved, direct(prepared_base, base_config))):
        for name, metrics in scores.items():
            row = result["sets"][name]
            assert row["n"] == limit, (result["target"], name)
            got, want = (row["acc"], row["loss"]), (metrics["acc"], metrics["loss"])
            assert got == pytest.approx(want), (result["target"], name)
        assert result["average"]["acc"] == pytest.approx(np.mean([m["acc"] for m in scores.values()]))
    assert abs(saved["sets"]["arc_easy"]["loss"] - base_saved["sets"]["arc_easy"]["loss"]) > 1e-4  # the adapter acts
    # at the in-training subset's size it is the run's own final evaluation (the final adapter, not another)
    last = [json.loads(x) for x in (runs[0].run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    own = suite.run_final_evaluations(suite.final_jobs("table52", runs, 4, True, out["table52"])[1:], 1)
    assert own == []
    at4 = json.loads((runs[0].run_dir / suite.FINAL_EVAL).read_text())
    assert at4["average"]["acc"] == pytest.approx(last["accuracy"]) and at4["limit"] == 4
    for name in ("arc_easy", "arc_challenge"):
        assert at4["metrics"][name]["loss"] == pytest.approx(last[f"loss_{name}"], abs=1e-5)
    # saved: not recomputed at the same limit; another limit or another run's config is redone
    (runs[0].run_dir / suite.FINAL_EVAL).write_text(json.dumps(saved))
    assert suite.final_jobs("table52", runs, limit, True, out["table52"]) == []
    assert len(suite.final_jobs("table52", runs, limit + 1, True, out["table52"])) == 2
    (runs[0].run_dir / suite.FINAL_EVAL).write_text(json.dumps({**saved, "config_key": "another"}))
    assert [j[0].label for j in suite.final_jobs("table52", runs, limit, True, out["table52"])] == [
        str(runs[0].run_dir)
    ]
    # the report: the final columns are the saved values, final_se the binomial SE of the average
    (runs[0].run_dir / suite.FINAL_EVAL).write_text(json.dumps(saved))
    base = {"accuracy": 0.3, "acc_arc_easy": 0.4, "loss": 5.0, "test_examples": 8}
    suite.write_report("table52", plans, [1], None, base, out["table52"], "cmd", "scale", base_saved, limit)
    rows = {r["method"]: r for r in json.loads((out["table52"] / "results.json").read_text())["rows"]}
    fs = rows["fslora"]
    assert fs["final_accuracy"] == [pytest.approx(saved["average"]["acc"]), 0.0]
    assert fs["final_acc_arc_challenge"][0] == pytest.approx(saved["sets"]["arc_challenge"]["acc"])
    p = [saved["sets"][s]["acc"] for s in ("arc_easy", "arc_challenge")]
    assert fs["final_se"][0] == pytest.approx(math.sqrt(sum(x * (1 - x) / limit for x in p)) / 2)
    assert rows["untuned"]["final_accuracy"][0] == pytest.approx(base_saved["average"]["acc"])
    assert rows["heterolora"]["final_accuracy"] == [None, None]
    readme = (out["table52"] / "README.md").read_text()
    assert f"at most {limit} questions per set" in readme and f"arc_easy {limit}, arc_challenge {limit}" in readme


def test_dolly_final_columns_are_the_final_rounds_evaluation_on_the_whole_test_set(suite, tmp_path):
    out = out_dirs(tmp_path)
    plans = suite.build(["dolly"], [1, 2], None, False, out)
    for spec in plans["dolly"][1]["dolly"]:
        seed = spec.labels["seed"]
        if spec.labels["method"] == "fedit":  # rounds 2 and 4
            rounds = [{"round": 2, "rouge_l": 0.10, "loss": 2.5}]
            rounds.append({"round": 4, "rouge_l": 0.20 + seed / 100, "loss": 2.0})
        else:  # local evaluates at round 4 only
            rounds = [{"round": 2}, {"round": 4, "rouge_l": 0.05 * seed, "loss": 3.0}]
        finish(spec, rounds)
    base = {"rouge_l": 0.15, "loss": 2.9, "accuracy": 0.15, "test_examples": 80}
    suite.write_report("dolly", plans, [1, 2], None, base, out["dolly"], "cmd", "scale")
    rows = {r["method"]: r for r in json.loads((out["dolly"] / "results.json").read_text())["rows"]}
    assert rows["fedit"]["rouge_l"][0] == pytest.approx((0.10 + 0.21 + 0.10 + 0.22) / 4)  # mean of the last two
    assert rows["fedit"]["final_rouge_l"] == [pytest.approx(0.215), pytest.approx(math.sqrt(2 * 0.005**2))]
    assert rows["local"]["final_rouge_l"][0] == pytest.approx(0.075) == rows["local"]["rouge_l"][0]
    assert rows["untuned"]["final_rouge_l"] == [0.15, 0.0] and rows["fedit"]["final_loss"][0] == pytest.approx(2.0)
    readme = (out["dolly"] / "README.md").read_text()
    assert "final_se" not in rows["fedit"] and "whole 80-record" in readme
    assert "(fedit first, response loss at the final round): reproduces (fedit - untuned = -0.900" in readme
