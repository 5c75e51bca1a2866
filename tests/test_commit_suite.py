"""The CoMMIT benchmark suite's plan and reports (configs only, no training): each experiment runs the
configuration its report names (the recipe plus a modality overlay plus the trainer), shared runs are
one config in the owner's folder, the scale options reach every run, and the reports render before
any run has finished."""

from __future__ import annotations

import pytest

from fedtune import harness
from tests.conftest import assert_every_planned_run_resolves, suite_fixture

suite = suite_fixture("commit/run_suite.py", "commit")


@pytest.fixture(scope="module")
def plan(suite, tmp_path_factory):
    return suite.build_suite_plan([0, 1, 2], suite.Scale(), tmp_path_factory.mktemp("suite"))


def test_every_planned_run_resolves(plan):
    assert assert_every_planned_run_resolves(plan) > 10


def test_every_run_is_the_recipe_plus_its_modality_and_trainer(suite, plan):
    from fedtune.config import load_config

    recipe = load_config(suite.RECIPE)
    data = {"image": "fashion-mnist", "audio": "fsdd"}
    for spec in (s for specs in plan.values() for s in specs):
        c, labels = spec.config, spec.labels
        assert c.method == "commit" and c.seed == labels["seed"] and c.options["trainer"] == labels["trainer"]
        assert c.data.name == data[labels["modality"]] and c.task.kind == "instruction"
        assert (c.model.name, c.train.lr, c.train.batch_size, c.model.lora_rank) == (
            recipe.model.name,
            recipe.train.lr,
            recipe.train.batch_size,
            recipe.model.lora_rank,
        )
        assert c.options["n_kappa"] == recipe.options["n_kappa"] and c.options["l_lr"] == recipe.options["l_lr"]
        assert c.task.options["questions"][-1] == "describe"  # the several-word answers (ROUGE-L)
        if labels["federated"]:
            assert (c.federation.num_clients, c.rounds, c.task.options["partition_by"]) == (4, 5, "question")
        else:  # centralized: one party, one optimizer throughout
            assert (c.federation.num_clients, c.rounds, c.train.local_steps) == (1, 1, recipe.train.local_steps)


def test_the_experiments_cover_the_papers_trainers(suite, plan):
    def trainers(exp):
        return {s.labels["trainer"] for s in plan[exp]}

    assert trainers("table1") == {"constant", "feature-cd", "language-cd", "commit-clr", "commit"}
    assert trainers("fig6") == {"constant", "language-lr-up", "vision-lr-up", "commit-clr", "commit"}
    assert trainers("fig3") == {"constant", "language-lr-up", "vision-lr-up"}
    assert {s.labels["modality"] for s in plan["table1"]} == {"image", "audio"} and len(plan["table1"]) == 2 * 5 * 3
    assert all(s.labels["federated"] for s in plan["federated"]) and not any(
        s.labels["federated"] for s in plan["table1"]
    )


def test_shared_runs_are_one_config_in_the_owner_folder(plan):
    by_name = {(s.experiment, s.name): s for specs in plan.values() for s in specs}
    owner = by_name[("table1", "image-constant-seed0")]
    for exp in ("fig45", "fig6", "fig3"):
        shared = by_name[(exp, "image-constant-seed0")]
        assert (
            shared.shared and shared.owner == "table1" and shared.key == owner.key and shared.run_dir == owner.run_dir
        )
    assert by_name[("fig3", "audio-vision-lr-up-seed1")].owner == "fig6"
    keys = [s.key for specs in plan.values() for s in specs if not s.shared]
    assert len(keys) == len(set(keys))  # every distinct config runs once


def test_scale_options_reach_every_run_and_bad_ones_name_the_option(suite, tmp_path):
    args = suite.parse_args(["--steps", "40", "--test-samples", "100", "--modalities", "image"])
    scale, modalities = suite.selection(args)
    plan = suite.build_suite_plan([0], scale, tmp_path)
    for spec in (s for specs in plan.values() for s in specs):
        c = spec.config
        assert c.data.max_test_samples == 100
        assert c.train.local_steps == (4 if spec.labels["federated"] else 40)  # 40 client steps over 5 rounds x 2
    restricted = suite.restrict(plan, modalities)
    assert {s.labels["modality"] for specs in restricted.values() for s in specs} == {"image"}
    assert len(restricted["table1"]) == 5
    for bad, option in ((["--modalities", "video"], "--modalities"), (["--steps", "0"], "--steps")):
        with pytest.raises(harness.SuiteError, match=f"^{option}:"):
            suite.selection(suite.parse_args(bad))


def test_evals_split_a_centralized_run_into_evaluated_rounds_with_one_optimizer(suite, tmp_path):
    scale, _ = suite.selection(suite.parse_args(["--steps", "40", "--evals", "4"]))
    plan = suite.build_suite_plan([0], scale, tmp_path)
    for spec in (s for specs in plan.values() for s in specs):
        c = spec.config
        if spec.labels["federated"]:  # --evals leaves the federated runs alone
            assert (c.rounds, c.train.local_steps, c.options.get("carry_optimizer", False)) == (5, 4, False)
        else:
            assert (c.rounds, c.train.local_steps, c.eval_every, c.options["carry_optimizer"]) == (4, 10, 1, True)
    with pytest.raises(harness.SuiteError, match="^--evals: expected a divisor of the 40 steps per run, got 3$"):
        suite.selection(suite.parse_args(["--steps", "40", "--evals", "3"]))


def test_lr_sets_every_runs_base_rate(suite, tmp_path):
    scale, _ = suite.selection(suite.parse_args(["--lr", "3e-4"]))
    plan = suite.build_suite_plan([0], scale, tmp_path)
    assert {s.config.train.lr for specs in plan.values() for s in specs} == {3e-4}
    for bad in ("0", "-1", "nan"):
        with pytest.raises(harness.SuiteError, match="^--lr: expected a positive number"):
            suite.selection(suite.parse_args(["--lr", bad]))


def test_a_cell_is_the_mean_of_the_last_three_evaluations(suite, tmp_path):
    from tests.test_harness import finish

    scale, _ = suite.selection(suite.parse_args(["--quick", "--evals", "2"]))
    spec = suite.build_suite_plan([0], scale, tmp_path)["table1"][0]
    finish(spec, [0.1, None, 0.2, 0.3, 0.7])  # rounds 1-5, round 2 not evaluated
    assert suite.run_metric(spec, "accuracy") == pytest.approx(0.4)  # (0.2 + 0.3 + 0.7) / 3, not 0.7
    assert suite.metric_cell([spec], "accuracy") == "40.00 ± 0.00"


def test_quick_scale_and_reports_render_before_any_run(suite, tmp_path):
    scale, _ = suite.selection(suite.parse_args(["--quick"]))
    plan = suite.build_suite_plan([0], scale, tmp_path)
    assert all(s.config.model.name == "tiny-llama" for specs in plan.values() for s in specs)
    written = suite.write_reports(plan, suite.EXPERIMENTS, [0], tmp_path, "cmd")
    text = (tmp_path / "table1.md").read_text()
    assert "pending" in text and "| CoMMIT |" in text and "| Feature CD |" in text
    assert all(p.exists() for p in written)


def test_with_a_rate_grid_each_trainer_runs_the_tables_at_its_own_chosen_rate(suite, tmp_path):
    from tests.test_harness import finish

    args = suite.parse_args(
        ["--lr-grid", "3e-3,3e-4,1e-3", "--only", "table1", "--seeds", "1,2", "--evals", "4", "--steps", "40"]
    )
    scale, _ = suite.selection(args)
    sweep, selected = harness.sweep_selection(args, ["table1"], suite.SWEPT)
    assert selected == ["sweep", "table1"] and sweep == harness.Sweep((3e-4, 1e-3, 3e-3), 0)
    plan = suite.build_suite_plan([1, 2], scale, tmp_path, sweep)
    runs = plan["sweep"]
    assert {(s.labels["modality"], s.labels["trainer"], s.config.train.lr, s.config.seed) for s in runs} == {
        (m, t, lr, 0) for m in suite.MODALITIES for t in suite.TABLE1 for lr in sweep.grid
    }
    assert all(s.labels["lr"] == s.config.train.lr and s.config.rounds == 4 for s in runs)
    assert plan["table1"] == [] and plan["fig45"] == []  # every group waits for its sweep
    waiting = {s.key: s.run_dir for s in plan["fig6"] + plan["fig3"]}
    assert {s.config.train.lr for s in plan["fig6"]} == {suite.load_config(suite.RECIPE).train.lr}  # not swept
    group = {s.labels["lr"]: s for s in harness.with_labels(runs, modality="image", trainer="commit")}
    finish(group[3e-4], [0.1, 0.5, 0.5, 0.5])  # the best final point, but a last-3 mean of 0.5
    finish(group[1e-3], [0.2, 0.6, 0.6, 0.4])  # last-3 mean 0.533: chosen
    finish(group[3e-3], [0.7, 0.3, 0.3, 0.3])  # the best single evaluation, early
    plan = suite.build_suite_plan([1, 2], scale, tmp_path, sweep)
    choice = suite.choices_of(plan["sweep"])[("image", "commit")]
    assert choice.setting == {"lr": 1e-3} and choice.score == pytest.approx(1.6 / 3)
    for exp in ("table1", "fig45"):
        assert {(s.labels["modality"], s.labels["trainer"], s.labels["seed"]) for s in plan[exp]} == {
            ("image", "commit", 1),
            ("image", "commit", 2),
        }
        for s in plan[exp]:  # the chosen run's config on another seed
            assert s.config.model_dump(exclude={"seed", "name", "output_dir"}) == group[1e-3].config.model_dump(
                exclude={"seed", "name", "output_dir"}
            )
    for s in plan["fig6"] + plan["fig3"]:  # a choice never moves a run of the unswept figures to another folder
        assert s.run_dir == waiting[s.key] and s.owner in ("fig6", "fig3")
    assert any(t.key == f.key for t in plan["table1"] for f in plan["fig6"])  # the chosen 1e-3 is fig6's rate
    written = suite.write_reports(plan, ["sweep", "table1"], [1, 2], tmp_path, "cmd", sweep)
    text = (tmp_path / "sweep.md").read_text()
    assert "| CoMMIT | 50.00 | **53.33** | 30.00 | lr 0.001 by 3.33 points over lr 0.0003" in text
    assert "| Constant LR | pending | pending | pending | waiting for the sweep |" in text
    assert "| CoMMIT | 0.001 | pending |" in (tmp_path / "table1.md").read_text()
    assert all(p.exists() for p in written)


def test_the_ordering_notes_say_whether_each_modality_learned_before_ranking_it(suite, tmp_path):
    import json

    from tests.test_harness import finish

    scale, _ = suite.selection(suite.parse_args(["--quick", "--evals", "3"]))
    plan = suite.build_suite_plan([0, 1], scale, tmp_path)
    curves = {
        "constant": [0.1, 0.25, 0.35],  # last-3 mean 0.233 = 0.1 + 0.133 >= 0.1 + margin 0.09
        "commit": [0.4, 0.3, 0.1],
    }  # last-3 mean 0.267, but collapsed to the rate at the end
    for s in plan["table1"]:
        m, t = s.labels["modality"], s.labels["trainer"]
        finish(s, curves.get(t, [0.1, 0.1, 0.1]) if m == "image" else [0.12, 0.11, 0.1])
        summary = json.loads((s.run_dir / "summary.json").read_text())
        (s.run_dir / "summary.json").write_text(json.dumps({**summary, "majority_accuracy": 0.1, "test_examples": 100}))
    image = suite.learned_note(plan["table1"], "image")
    assert "Constant LR 2/2" in image and "CoMMIT 0/2" in image and "Feature CD 0/2" in image
    assert "9.0 points" in image and "did not learn" not in image  # margin max(2, 3 sqrt(0.09 / 100)) points
    audio = suite.learned_note(plan["table1"], "audio")
    assert "Constant LR 0/2" in audio and "did not learn at this scale" in audio
    notes = "\n".join(suite.ordering_notes(plan["table1"]))
    assert notes.index(image) < notes.index("- image, exact match:") and audio in notes
    assert suite.learned_note(suite.build_suite_plan([0], scale, tmp_path / "empty")["table1"], "image") is None
