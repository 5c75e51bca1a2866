"""benchmarks/recipes/recipes.py: the recipes as runs (flattened recipes rebuild the very config, resume
recognises a finished run), the clearly-above rule, and the table over hand-made run folders (no
training)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import tomli_w

from fedtune import harness
from tests.conftest import suite_fixture

ROOT = Path(__file__).resolve().parents[1]


rb = suite_fixture("recipes/recipes.py", "recipes", name="rb")


def finish(spec, accuracies: list[float], reference: float, test_examples: int, every: int = 1) -> None:
    """The run folder ``run_experiment`` would leave (its config.toml is the resolved config)."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / "config.toml").write_text(tomli_w.dumps(spec.config.model_dump(mode="json", exclude_none=True)))
    rounds = [{"round": every * (i + 1), "accuracy": a, "bytes_up": 10} for i, a in enumerate(accuracies)]
    (spec.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = {
        "name": spec.name,
        "rounds": len(rounds),
        "final_accuracy": accuracies[-1],
        "majority_accuracy": reference,
        "reference_name": "majority-class rate",
        "test_examples": test_examples,
        "total_bytes_up": 10,
        "wall_s": 3.0,
    }
    (spec.run_dir / "summary.json").write_text(json.dumps(summary))


def test_clearly_above_rule(rb):
    # binary, 872 test sentences: 3 standard errors at p = 0.5 is 5.08 points
    margin = 3 * math.sqrt(0.25 / 872)
    assert harness.clearly_above(0.5 + margin + 1e-6, 0.60, 0.5, 872) == (True, pytest.approx(margin))
    assert harness.clearly_above(0.5 + margin - 1e-3, 0.60, 0.5, 872)[0] is False
    # a large test set: the 2-point floor applies
    assert harness.clearly_above(0.265, 0.27, 0.25, 100_000) == (False, 0.02)
    assert harness.clearly_above(0.271, 0.27, 0.25, 100_000) == (True, 0.02)
    # well above on average but collapsed to the reference at the end: not clearly above
    assert harness.clearly_above(0.80, 0.5092, 0.5092, 872)[0] is False
    # few-shot: chance 1/5
    assert harness.clearly_above(0.30, 0.31, 0.2, 3000)[0] is True
    assert harness.clearly_above(None, 0.5, 0.5, 872) == (None, None)


def test_every_recipe_flattens_to_its_own_config(rb):
    from fedtune.config import load_config
    from fedtune.tasks import resolve_config

    checked = 0
    for path in rb.recipes():  # every recipe loads (tests/test_recipes.py): a failure here fails the test
        written = resolve_config(load_config(path))
        rebuilt = load_config(None, rb.recipe_overrides(path))
        assert rebuilt.model_dump(exclude={"name"}) == written.model_dump(exclude={"name"}), path.name
        checked += 1
    assert checked == len(rb.recipes())
    assert all(p.parent == ROOT / "configs" for p in rb.recipes())  # configs/benchmarks/ is not read


def recipe_dir(tmp_path: Path) -> list[Path]:
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(ROOT / "configs" / "fedit.toml", configs / "fedit.toml")  # sst2: two similar sets
    shutil.copy(ROOT / "configs" / "few-shot.toml", configs / "few-shot.toml")  # no similar set
    # a recipe that leaves the data set and model to the task (tweets, minilm)
    (configs / "bare.toml").write_text('method = "fedit"\nrounds = 4\n[train]\nlocal_steps = 2\n')
    return sorted(configs.glob("*.toml"))


def test_plan_names_the_resolved_data_and_model_and_resumes(rb, tmp_path):
    from fedtune.harness import run_state

    paths = recipe_dir(tmp_path)
    plan = rb.build_recipes_plan(paths, rb.Options(), tmp_path / "out")
    own = {s.labels["recipe"]: s for s in plan["own"]}
    assert own["bare.toml"].config.data.name == "tweets" and own["bare.toml"].config.model.name == "minilm"
    assert own["fedit.toml"].config.rounds == 20  # as written
    assert sorted(s.name for s in plan["similar"]) == [
        "bare-on-agnews",
        "bare-on-sst2",
        "fedit-on-agnews",
        "fedit-on-tweets",
    ]
    sim = next(s for s in plan["similar"] if s.name == "fedit-on-tweets").config
    written = own["fedit.toml"].config
    assert sim.data.name == "tweets" and sim.data.max_test_samples == 2000
    assert sim.model_dump(exclude={"data", "name", "output_dir"}) == written.model_dump(
        exclude={"data", "name", "output_dir"}
    )  # only the data set changes
    finish(own["bare.toml"], [0.5, 0.6], 0.42, 2000)
    assert run_state(own["bare.toml"]) == "done"
    # short rounds and --set apply to every run; --quick caps data only where the task takes it
    short = rb.build_recipes_plan(paths, rb.Options(rounds=3, extra=tuple(rb.QUICK), quick=True), tmp_path / "q")
    configs = {s.labels["recipe"]: s.config for s in short["own"]}
    assert all(c.rounds == 3 for c in configs.values())  # an explicit --rounds wins over --quick
    capped = rb.build_recipes_plan(paths, rb.Options(rounds=10), tmp_path / "r")
    assert {s.labels["recipe"]: s.config.rounds for s in capped["own"]} == {
        "bare.toml": 4,
        "fedit.toml": 10,
        "few-shot.toml": 10,
    }  # a cap: bare.toml is written with 4
    assert (
        configs["fedit.toml"].data.max_train_samples == 200 and configs["few-shot.toml"].data.max_train_samples is None
    )
    cheap = rb.build_recipes_plan(paths, rb.Options(), tmp_path / "c", similar_max_minutes=0.0)
    assert cheap["similar"] == []


def test_table_over_hand_made_runs(rb, tmp_path):
    paths = recipe_dir(tmp_path)
    out = tmp_path / "out"
    options = rb.Options(rounds=6)
    plan = rb.build_recipes_plan(paths, options, out / "recipes")
    own = {s.labels["recipe"]: s for s in plan["own"]}
    sim = {s.name: s for s in plan["similar"]}
    finish(own["fedit.toml"], [0.55, 0.70, 0.78, 0.80, 0.81, 0.79], 0.5092, 872)  # clearly above
    finish(own["few-shot.toml"], [0.21, 0.22, 0.21], 0.2, 3000, every=2)  # +1.3 points: not clearly
    finish(sim["fedit-on-tweets"], [0.40, 0.45, 0.52, 0.58, 0.60, 0.61], 0.42, 2000)
    rows = {r["spec"].labels["recipe"]: r for r in rb.table_rows(plan)}
    fedit = rows["fedit.toml"]["own"]
    assert fedit["mean_last"] == pytest.approx((0.80 + 0.81 + 0.79) / 3) and fedit["clearly_above"] is True
    assert rows["few-shot.toml"]["own"]["clearly_above"] is False
    assert rows["bare.toml"]["own"]["done"] is False
    written = rb.write_reports(plan, out, "cmd", options, ["own", "similar"])
    md = (out / "recipes.md").read_text()
    assert "**Changed from the recipes:** `rounds=6`" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| fedit.toml"))
    assert "6 / 20" in line and "80.00" in line and "**yes**" in line and "tweets<br>agnews" in line
    assert "pending" in line  # fedit on agnews has not run
    assert "no similar set" in next(ln for ln in md.splitlines() if ln.startswith("| few-shot.toml"))
    assert "Own data: 1 of 2 finished recipes clearly above" in md and "`few-shot.toml`" in md
    data = json.loads((out / "recipes.json").read_text())
    by_run = {r["run"]: r for r in data["runs"]}
    assert by_run["fedit"]["clearly_above"] is True and by_run["few-shot"]["clearly_above"] is False
    assert by_run["fedit-on-tweets"]["own_data"] is False and by_run["bare"]["finished"] is False
    assert all(p.exists() for p in written)


def test_a_subset_command_reports_every_recipe(rb):
    """``--recipes X --only own`` runs X's own run only, but the report it writes still has a row
    (and the similar-data columns) for every recipe: it must not shrink the table to X."""
    assert rb.main(["--quick", "--report-only", "--recipes", "local", "--only", "own"]) == 0
    report = (rb.QUICK_RESULTS / "recipes.md").read_text()
    assert all(f"| {p.name} |" in report for p in rb.recipes()) and "similar data" in report
