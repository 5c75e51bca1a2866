"""The RABO benchmark suite's plan (no training): each experiment runs the configuration its report
describes, shared runs are one configuration in one folder, the methods get equal update budgets,
and the cost model gives an estimate for every run."""

from __future__ import annotations

from collections import Counter

import pytest

from fedtune import harness
from tests.conftest import assert_every_planned_run_resolves, suite_fixture

suite = suite_fixture("rabo/run_suite.py", "rabo")


@pytest.fixture(scope="module")
def plan(suite, tmp_path_factory):
    return suite.build_suite_plan(suite.Scale(), [0, 1, 2], tmp_path_factory.mktemp("rabo-suite"))


def test_every_planned_run_resolves(plan):
    assert assert_every_planned_run_resolves(plan) > 10


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


def test_a_factor_sweep_scales_each_methods_own_step_size_and_the_tables_use_the_choice(suite, tmp_path):
    from dataclasses import replace

    from tests.test_harness import finish

    scale = replace(suite.Scale(), settings=("w5s1",), updates=30, sweep=harness.Sweep((0.3, 1.0, 3.0), 3))
    plan = suite.build_suite_plan(scale, [0, 1, 2], tmp_path)
    unswept = suite.build_suite_plan(replace(scale, sweep=None), [0, 1, 2], tmp_path)
    base = {s.labels["method"]: s.config for s in unswept["table2"] if s.labels["seed"] == 0}
    for s in harness.with_labels(plan["sweep"], problem="few-shot"):
        m, f, c = s.labels["method"], s.labels["factor"], s.config
        assert (s.labels["setting"], c.seed) == ("w5s1", 3)
        if m in suite.BILEVEL:  # the outer step scales; the inner problem and the AdamW rate do not
            assert c.options["outer_lr"] == pytest.approx(f * base[m].options["outer_lr"])
            assert c.options["inner_lr"] == base[m].options["inner_lr"] and c.train.lr == base[m].train.lr
        else:
            assert c.train.lr == pytest.approx(f * base[m].train.lr)
            assert c.options == base[m].options
    assert plan["table2"] == [] and plan["table3"] == []  # every method waits for its sweep
    assert [s.key for s in plan["fig3"]] == [s.key for s in unswept["fig3"]]  # not swept
    runs = {(s.labels["method"], s.labels["factor"]): s for s in harness.with_labels(plan["sweep"], problem="few-shot")}
    # Bilevel runs evaluate every 5 rounds (one update each), FedAvg every round of 10 updates: the
    # figure is the mean of the last 3 evaluations at 10, 20, 30 updates
    every5 = (5, 10, 15, 20, 25, 30)
    finish(runs[("rabo", 0.3)], [0.2, 0.2, 0.9, 0.2, 0.9, 0.3], rounds_evaluated=every5)  # 0.233: best off-budget
    finish(runs[("rabo", 1.0)], [0.2, 0.5, 0.2, 0.5, 0.2, 0.5], rounds_evaluated=every5)  # 0.5: chosen
    finish(runs[("rabo", 3.0)], [0.2, 0.3, 0.2, 0.3, 0.2, 0.6], rounds_evaluated=every5)  # 0.4: best final point
    for f, accs in ((0.3, [0.3, 0.3, 0.3]), (1.0, [0.3, 0.4, 0.4]), (3.0, [0.3, 0.5, 0.6])):
        finish(runs[("fedavg", f)], accs)
    choices = suite.choices_of(plan["sweep"])
    assert choices["rabo"].setting == {"factor": 1.0} and choices["rabo"].score == pytest.approx(0.5)
    assert choices["fedavg"].setting == {"factor": 3.0} and choices["fedavg"].at_edge("factor") == "largest"
    plan = suite.build_suite_plan(scale, [0, 1, 2], tmp_path)
    table = {(s.labels["method"], s.labels["seed"]): s for s in plan["table2"]}
    assert set(table) == {(m, seed) for m in ("rabo", "fedavg") for seed in (0, 1, 2)}
    for seed in (0, 1, 2):  # factor 1: the unswept suite's very run; factor 3: the scaled rate on every seed
        assert table[("rabo", seed)].key == next(
            s.key for s in unswept["table2"] if (s.labels["method"], s.labels["seed"]) == ("rabo", seed)
        )
        assert table[("fedavg", seed)].config.train.lr == pytest.approx(3 * base["fedavg"].train.lr)
    assert {(s.labels["method"], s.labels["clients"]) for s in plan["table3"]} == {("rabo", n) for n in scale.clients}
    text = suite.report_sweep(plan["sweep"], scale, "head", tmp_path)
    assert (
        "| RABO (`options.outer_lr` x 1 = 0.05) | 23.33 | **50.00** | 40.00 | factor 1 by 10.00 points over factor 3 |"
        in text
    )
    assert "(the grid's largest factor: a rate beyond it might do better)" in text


def test_figure5_has_its_own_sweep_of_every_step_size_and_runs_each_methods_choice(suite, tmp_path):
    """The loss-tuning sweep scales the bilevel methods' outer (VS-loss) and inner (model) steps
    together and the single-level methods' AdamW rate; it is scored by the mean of the last 3
    evaluations, chooses only Figure 5's factors (never Table II's), and Figure 5 waits for it."""
    from dataclasses import replace

    from tests.test_harness import finish

    scale = replace(
        suite.Scale(), settings=("w5s1",), updates=30, sweep=harness.Sweep((1.0, 3.0), 3), lt_grid=(0.1, 0.3, 1.0)
    )
    plan = suite.build_suite_plan(scale, [0, 1, 2], tmp_path)
    unswept = suite.build_suite_plan(replace(scale, sweep=None), [0, 1, 2], tmp_path)
    base = {s.labels["method"]: s.config for s in unswept["fig5"] if s.labels["seed"] == 0}
    lt = harness.with_labels(plan["sweep"], problem="loss-tuning")
    assert len(lt) == 3 * len(suite.METHODS) and plan["fig5"] == []  # every method waits for its sweep
    for s in lt:
        m, f, c = s.labels["method"], s.labels["factor"], s.config
        assert c.seed == 3 and c.task.kind == "image-classification" and s.run_dir.parent.name == "sweep"
        if m in suite.BILEVEL:
            assert c.options["outer_lr"] == pytest.approx(f * base[m].options["outer_lr"])
            assert c.options["inner_lr"] == pytest.approx(f * base[m].options["inner_lr"])
            assert c.options["inner_steps"] == base[m].options["inner_steps"] and c.train.lr == base[m].train.lr
        else:
            assert c.train.lr == pytest.approx(f * base[m].train.lr) and c.options == base[m].options
    runs = {(s.labels["method"], s.labels["factor"]): s for s in lt}
    every10 = (10, 20, 30, 40, 50, 60)
    finish(runs[("rabo", 0.1)], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], rounds_evaluated=every10)  # last 3: 0.5, chosen
    finish(runs[("rabo", 0.3)], [0.1, 0.2, 0.3, 0.2, 0.2, 0.9], rounds_evaluated=every10)  # the best final point
    finish(runs[("rabo", 1.0)], [0.5, 0.7, 0.7, 0.4, 0.3, 0.2], rounds_evaluated=every10)  # peaks, falls back
    choices = suite.choices_of(plan["sweep"], "loss-tuning")
    assert choices["rabo"].setting == {"factor": 0.1} and choices["rabo"].score == pytest.approx(0.5)
    assert suite.choices_of(plan["sweep"], "few-shot").get("rabo") is None  # Table II's sweep is another one
    plan = suite.build_suite_plan(scale, [0, 1, 2], tmp_path)
    assert plan["table2"] == []
    fig5 = {s.labels["seed"]: s for s in plan["fig5"]}
    assert set(fig5) == {0, 1, 2} and {s.labels["method"] for s in plan["fig5"]} == {"rabo"}
    for seed, s in fig5.items():
        assert s.config.options["outer_lr"] == pytest.approx(0.1 * base["rabo"].options["outer_lr"])
        assert s.config.seed == seed and s.run_dir.parent.name == "fig5" and s.name == f"lt-rabo-s{seed}-x0.1"
    text = suite.report_sweep(plan["sweep"], scale, "head", tmp_path)
    assert "## loss tuning (Figure 5)" in text
    assert "| RABO (`options.outer_lr` x 1 = 0.1, `options.inner_lr` x 1 = 0.05) | **50.00** | 43.33 | 30.00 |" in text
    assert "| outer_lr 0.01, inner_lr 0.005 (x0.1) |" in suite.report_fig5(plan["fig5"], scale, "head", tmp_path)


def test_figure5_at_factor_one_is_the_unswept_run(suite, tmp_path):
    """A method whose loss-tuning choice is factor 1 reruns nothing: its Figure 5 runs are the
    unswept suite's folders and configs."""
    from dataclasses import replace

    from tests.test_harness import finish

    scale = replace(suite.Scale(), sweep=harness.Sweep((1.0,), 3), lt_grid=(0.3, 1.0))
    plan = suite.build_suite_plan(scale, [0, 1], tmp_path)
    for s in harness.with_labels(plan["sweep"], problem="loss-tuning", method="fedavg"):
        finish(s, [0.2, 0.6, 0.6] if s.labels["factor"] == 1.0 else [0.2, 0.3, 0.3])
    plan = suite.build_suite_plan(scale, [0, 1], tmp_path)
    unswept = suite.build_suite_plan(replace(scale, sweep=None), [0, 1], tmp_path)
    assert [(s.name, s.key, s.run_dir) for s in plan["fig5"]] == [
        (s.name, s.key, s.run_dir) for s in unswept["fig5"] if s.labels["method"] == "fedavg"
    ]
