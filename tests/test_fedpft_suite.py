"""The FedPFT benchmark suite's plan (configs and hand-made run folders only, no training): every
experiment runs the configuration its report names, shared runs are one config, and with
``--lr-grid`` each (data set, method) runs the tables at the rate its sweep chose."""

from __future__ import annotations

from fedtune import harness
from tests.conftest import assert_every_planned_run_resolves, suite_fixture

suite = suite_fixture("fedpft/run_suite.py", "fedpft")


def test_every_planned_run_resolves(suite, tmp_path):
    sweep = harness.Sweep((1e-3, 2e-3), 0)
    plan = suite.build_suite_plan(suite.Scale(False, tmp_path, sweep), [1], tmp_path)
    # table2's model is a random ViT the suite writes to its scratch folder just before running it
    assert assert_every_planned_run_resolves({k: v for k, v in plan.items() if k != "table2"}) > 10


def test_without_a_grid_every_run_keeps_the_recipes_rate(suite, tmp_path):
    from fedtune.config import load_config

    plan = suite.build_suite_plan(suite.Scale(False, tmp_path), [0, 1, 2], tmp_path)
    assert plan["sweep"] == []
    assert {s.config.train.lr for specs in plan.values() for s in specs} == {load_config(suite.RECIPE).train.lr}
    assert len(plan["table1"]) == 2 * 3 * 3 and len(plan["table3"]) == 3 * 3 * 3
    keys = [s.key for specs in plan.values() for s in specs if not s.shared]
    assert len(keys) == len(set(keys))  # every distinct config runs once
    assert all(s.shared and s.owner == "table1" for s in plan["table4"] if s.labels["variant"] == "fedot")


def test_each_method_runs_the_tables_at_its_own_chosen_rate(suite, tmp_path):
    from fedtune.config import load_config
    from tests.test_harness import finish

    sweep = harness.Sweep((1e-3, 2e-3, 4e-3), 0)
    scale = suite.Scale(False, tmp_path, sweep)
    plan = suite.build_suite_plan(scale, [1, 2], tmp_path)
    runs = plan["sweep"]
    assert {(s.labels["data"], s.labels["method"], s.config.train.lr, s.config.seed) for s in runs} == {
        (d, m, lr, 0) for d in suite.TEXT for m in suite.METHODS for lr in sweep.grid
    }
    for exp in suite.SWEPT:
        assert plan[exp] == []  # every (data set, method) waits for its sweep
    assert {s.config.train.lr for s in plan["table2"]} == {load_config(suite.RECIPE).train.lr}  # not swept
    group = {s.labels["lr"]: s for s in harness.with_labels(runs, data="sst2", method="fedpft")}
    finish(group[1e-3], [0.5, 0.9, 0.6, 0.6])  # the best final point, but a last-3 mean of 0.7
    finish(group[2e-3], [0.6, 0.8, 0.8, 0.7])  # last-3 mean 0.767: chosen
    finish(group[4e-3], [0.95, 0.5, 0.5, 0.5])  # the best single evaluation, early
    plan = suite.build_suite_plan(scale, [1, 2], tmp_path)
    assert suite.choices_of(plan["sweep"])[("sst2", "fedpft")].setting == {"lr": 2e-3}
    assert {(s.labels["data"], s.labels["method"]) for s in plan["table1"]} == {("sst2", "fedpft")}
    assert {s.labels["seed"] for s in plan["table1"]} == {1, 2}
    assert len(plan["table3"]) == 3 * 2  # FedPFT at every alpha; FedOT and FedPETuning wait
    assert {s.labels["variant"] for s in plan["table4"]} == {"fedpft_n", "fedpft_b", "fedpft_d", "fedpft"}
    assert len(plan["table5"]) == 6 * 2
    chosen = group[2e-3].config.model_dump(exclude={"seed", "name", "output_dir"})
    for s in plan["table1"]:  # the chosen run's config on another seed
        assert s.config.model_dump(exclude={"seed", "name", "output_dir"}) == chosen
    assert {s.config.train.lr for exp in suite.SWEPT for s in plan[exp]} == {2e-3}
    written = suite.WRITERS["sweep"](plan["sweep"], scale, "head", tmp_path)
    assert "| FedPFT | 70.00 | **76.67** | 50.00 | lr 0.002 by 6.67 points over lr 0.001 |" in written
    assert "| FedOT | pending | pending | pending | waiting for the sweep |" in written
    table1 = suite.WRITERS["table1"](plan["table1"], scale, "head", tmp_path)
    assert "| FedPFT | 0.002 | pending | pending | waiting for the sweep |" in table1
