"""benchmarks/llm_tables.py (issue 27's two causal-LM tables): every planned run resolves and is its
recipe plus the method's overlay; the Dolly sweep picks the lowest response loss, the commonsense one
the highest accuracy; a table cell is the mean +- sample std over seeds of each run's mean of its last
two evaluations, computed by hand here from written run folders; the cost model's arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import tomli_w

from fedtune.harness import Sweep
from tests.conftest import assert_every_planned_run_resolves, load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "llm_tables.py"


@pytest.fixture(scope="module")
def suite():
    return load_script(SCRIPT, "llm_tables")


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
    assert "ordering: not comparable yet" in readme
    rows = [{"method": m, "accuracy": [v, 0.0]} for m, v in (("untuned", 0.3), ("fslora", 0.5), ("fedit", 0.6))]
    assert "does NOT reproduce (fedit first)" in suite.ordering_line("table52", rows)
    rows[2]["accuracy"] = [0.4, 0.0]
    assert "reproduces" in suite.ordering_line("table52", rows)


def test_cost_model_counts_steps_and_evaluated_questions(suite, tmp_path):
    plans = suite.build(suite.TABLES, [1], None, False, out_dirs(tmp_path))
    fs = next(s for s in plans["table52"][1]["table52"] if s.labels["method"] == "fslora")
    c = fs.config
    steps = c.rounds * c.federation.clients_per_round * c.train.local_steps
    questions = c.task.options["test_per_set"] * len(c.task.options["sets"])
    evaluations = c.rounds // c.eval_every
    assert suite.run_cost(fs) == pytest.approx(
        steps * suite.STEP_S["table52"] + evaluations * questions * suite.EVAL_S["table52"]
    )
    local = next(s for s in plans["dolly"][1]["dolly"] if s.labels["method"] == "local")
    lc = local.config
    assert suite.run_cost(local) == pytest.approx(
        lc.rounds * 3 * lc.train.local_steps * suite.STEP_S["dolly"]
        + (lc.rounds // lc.eval_every) * 80 * suite.EVAL_S["dolly"] * 10  # every client's adapter
    )
