"""The BoMM benchmark suite's plan and reports (configs only, no training): each experiment runs the
configuration its report names, shared runs are one config, and the reports render before any run
has finished."""

from __future__ import annotations

import pytest

from tests.conftest import assert_every_planned_run_resolves, suite_fixture

suite = suite_fixture("bomm/run_suite.py", "bomm")


@pytest.fixture(scope="module")
def plan(suite, tmp_path_factory):
    scale = suite.Scale()
    return scale, suite.build_suite_plan(scale, [0, 1, 2], tmp_path_factory.mktemp("suite"))


def test_every_planned_run_resolves(plan):
    assert assert_every_planned_run_resolves(plan[1]) > 10


def test_every_run_is_the_recipe_plus_its_labels(suite, plan):
    scale, plan = plan
    recipe = scale.base
    for spec in (s for specs in plan.values() for s in specs):
        c, labels = spec.config, spec.labels
        assert c.method == labels["method"] and c.seed == labels["seed"]
        t = c.task.options
        assert (t["scenario"], t["aligned"], t["delta"]) == (labels["scenario"], labels["aligned"], labels["delta"])
        assert (c.data.name, c.rounds, c.train.local_steps, t["unaligned"], t["labeled_fraction"]) == (
            recipe.data.name,
            recipe.rounds,
            recipe.train.local_steps,
            1000,
            recipe.task.options["labeled_fraction"],
        )
        assert c.federation.num_clients == 2


def test_the_tables_cover_the_papers_grid(suite, plan):
    scale, plan = plan
    t1 = plan["table1"]
    assert {(s.labels["scenario"], s.labels["aligned"]) for s in t1} == {(1, 0), (1, 200), (2, 0), (2, 200)}
    assert {s.labels["method"] for s in t1} == set(suite.METHODS) and len(t1) == 4 * 6 * 3
    assert {s.labels["scenario"] for s in plan["table2"]} == {3}
    rows = {s.labels["row"]: s.config.options for s in plan["table3"] if s.labels["seed"] == 0}
    assert rows["w/o preference loss"]["prefer"] is False and rows["w/o special loss"]["gamma"] == 0.0
    assert (
        rows["w/o scheduler (mu = 0)"]["mu"] == 0.0 and rows["every generation (scheduler off)"]["scheduler"] is False
    )
    assert (
        rows["align on phi features"]["alignment_space"] == "phi"
        and rows["no label transfer"]["label_transfer"] is False
    )
    assert all(s.config.task.options["scenario"] == 2 and s.config.task.options["aligned"] == 0 for s in plan["table3"])


def test_shared_runs_are_one_config_in_the_owner_folder(plan):
    _, plan = plan
    by_name = {(s.experiment, s.name): s for specs in plan.values() for s in specs}
    owner = by_name[("table1", "bomm-s1-a0-d0.5-seed0")]
    for other in (("fig3", "bomm-s1-a0-d0.5-seed0"), ("fig3", "bomm-mu0.4-s1-a0-d0.5-seed0")):
        assert by_name[other].key == owner.key and by_name[other].run_dir == owner.run_dir and by_name[other].shared
    base = by_name[("table3", "bomm-s2-a0-d0.5-seed1")]
    assert base.owner == "table1"
    cost = [s for s in plan["cost"]]
    assert all(s.shared and s.owner == "table1" for s in cost)
    keys = [s.key for specs in plan.values() for s in specs if not s.shared]
    assert len(keys) == len(set(keys))


def test_quick_scale_and_reports_render_before_any_run(suite, tmp_path):
    args = suite.parse_args(["--quick", "--seeds", "0"])
    scale = suite.scale_from_args(args)
    assert scale.base.data.name == "digits" and scale.base.rounds == 2 and scale.aligned == (0, 8)
    plan = suite.build_suite_plan(scale, [0], tmp_path)
    written = suite.write_reports(plan, suite.EXPERIMENTS, scale, [0], tmp_path, "cmd")
    text = (tmp_path / "table1.md").read_text()
    assert "pending" in text and "| BoMM |" in text
    assert all(p.exists() for p in written)
