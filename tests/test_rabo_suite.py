"""The RABO benchmark suite's plan (no training): each experiment runs the configuration its report
describes, shared runs are one configuration in one folder, the methods get equal update budgets,
and the cost model gives an estimate for every run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "rabo" / "run_suite.py"


@pytest.fixture(scope="module")
def suite():
    return load_script(SUITE, "rabo_run_suite")


@pytest.fixture(scope="module")
def plan(suite, tmp_path_factory):
    return suite.build_suite_plan(suite.Scale(), [0, 1, 2], tmp_path_factory.mktemp("rabo-suite"))


def test_table3_ten_clients_are_table2_runs(plan):
    ten = [s for s in plan["table3"] if s.labels["clients"] == 10]
    assert ten and all(s.shared and s.owner == "table2" for s in ten)
    keys = [s.key for specs in plan.values() for s in specs if not s.shared]
    assert len(keys) == len(set(keys))
    fifty = next(s for s in plan["table3"] if s.labels["clients"] == 50)
    fed = fifty.config.federation
    assert fed.num_clients == 50 and fed.sample_size() == 10 and len(fed.profiles) == 50
    assert Counter(p.capacity for p in fed.profiles) == {c: 10 for c in (1.0, 0.5, 0.25, 0.125, 0.0625)}


def test_methods_get_equal_update_budgets(plan, suite):
    """Few-shot: 60 backbone updates per client (bilevel: one per round; single-level: rounds x
    local steps). Loss tuning: 600 model updates (bilevel: T per round)."""
    for spec in plan["table2"]:
        c = spec.config
        updates = c.rounds if spec.labels["method"] in suite.BILEVEL else c.rounds * c.train.local_steps
        assert updates == 60, spec.name
    for spec in plan["fig5"]:
        c = spec.config
        per_round = c.options["inner_steps"] if spec.labels["method"] in suite.BILEVEL else c.train.local_steps
        assert c.rounds * per_round == 600, spec.name
        assert c.task.options["imbalance_ratio"] == 100.0


def test_scaled_down_budget_stays_equal_across_methods(suite, tmp_path):
    """``--updates 30``: every few-shot method makes 30 backbone updates per client."""
    scale = suite.Scale(settings=("w5s1",), updates=30)
    plan = suite.build_suite_plan(scale, [0], tmp_path)
    for spec in plan["table2"]:
        c = spec.config
        updates = c.rounds if spec.labels["method"] in suite.BILEVEL else c.rounds * c.train.local_steps
        assert updates == 30, spec.name


def test_fig3_segments_set_the_minimum_coverage(plan, suite):
    for cstar, segments in suite.SEGMENTS.items():
        assert min(Counter(segments).values()) == cstar and len(segments) == 10
    for spec in plan["fig3"]:
        c = spec.config
        assert c.options["masks"] == "segment" and c.options["segments"] == suite.SEGMENTS[spec.labels["cstar"]]
        assert c.federation.profiles[0].capacity == 0.25 and c.task.options["k_shot"] == 5


def test_fig4_counts_flops_of_the_bilevel_methods(plan):
    assert {s.labels["method"] for s in plan["fig4"]} == {"rabo", "rafbo", "fedmbo"}
    assert all(s.config.options["count_flops"] for s in plan["fig4"])


def test_every_run_has_an_estimate_and_quick_is_small(suite, tmp_path):
    quick = suite.build_suite_plan(suite.quick_scale(), [0], tmp_path)
    for p in (quick,):
        for specs in p.values():
            for s in specs:
                assert suite.estimate_s(s.config) > 0
    assert all(s.config.rounds == 2 for specs in quick.values() for s in specs if s.experiment != "fig4")
