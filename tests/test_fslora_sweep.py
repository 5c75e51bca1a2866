"""The fair FSLoRA benchmark's plan (benchmarks/fslora/sweep.py): every method gets the same grid,
weighting and settings; each (method, family)'s rate is the argmax of its sweep runs' mean of the
last 3 evaluations; Table 5.1's runs use exactly the chosen rates; and the winners' path into the
recipes. Only configs and hand-written run folders (no training).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tomli_w

from fedtune import harness
from tests.conftest import assert_every_planned_run_resolves, suite_fixture

ROOT = Path(__file__).resolve().parents[1]


sweep = suite_fixture("fslora/sweep.py", "fslora_sweep", name="sweep")


@pytest.fixture(scope="module")
def built(sweep, tmp_path_factory):
    """The full-scale plan (nothing finished): sweep seed 0, table seeds 1-3."""
    scale = sweep.Scale()
    return scale, sweep.build_sweep_plan(scale, 0, [1, 2, 3], tmp_path_factory.mktemp("sweep"))


def finish(spec, accuracies: list[float], every: int = 2, bytes_up: int = 1_000_000) -> None:
    """The run folder ``run_experiment`` would leave, evaluated every ``every`` rounds."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    (spec.run_dir / "config.toml").write_text(tomli_w.dumps(spec.config.model_dump(mode="json", exclude_none=True)))
    rounds = [{"round": every * (i + 1), "accuracy": a, "bytes_up": bytes_up} for i, a in enumerate(accuracies)]
    (spec.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = {
        "name": spec.name,
        "rounds": len(rounds),
        "final_accuracy": accuracies[-1],
        "majority_accuracy": 0.5092,
        "test_examples": 872,
        "total_bytes_up": bytes_up * len(rounds),
        "total_bytes_down": 2 * bytes_up * len(rounds),
        "wall_s": 1.0,
    }
    (spec.run_dir / "summary.json").write_text(json.dumps(summary))


def test_every_planned_run_resolves(built):
    assert assert_every_planned_run_resolves(built[1]) > 10


def test_every_method_gets_the_same_grid_weighting_and_settings(sweep, built):
    scale, (plan, choices, waiting) = built
    runs = plan["sweep"]
    assert {(s.labels["row"], s.labels["family"]) for s in runs} == {(r, f) for r in sweep.ROWS for f in sweep.FAMILIES}
    shared = {
        (
            c.rounds,
            c.eval_every,
            c.train.local_steps,
            c.train.batch_size,
            c.federation.num_clients,
            c.federation.sample_size(),
            c.data.name,
            c.data.max_train_samples,
            c.data.alpha,
            c.model.name,
            c.model.lora_dropout,
            c.seed,
        )
        for c in (s.config for s in runs)
    }
    assert shared == {(30, 2, 5, 16, 10, 10, "sst2", 20000, 0.5, "minilm", 0.1, 0)}
    for family in sweep.FAMILIES:
        for row in sweep.ROWS:
            group = harness.with_labels(runs, row=row, family=family)
            lrs = sorted({s.config.train.lr for s in group})
            assert lrs == sorted(sweep.LR_GRID[family])  # the same client grid for every row
            if row == "fslora-sadam":
                assert {(s.config.train.lr, s.config.server.lr) for s in group} == {
                    (lr, slr) for lr in lrs for slr in sweep.SERVER_LR_GRID
                }
            else:
                assert len(group) == len(lrs)
    for spec in runs:
        c = spec.config
        assert c.options["weighting"] == "uniform"  # one client weighting: eq. (5)'s 1/N
        assert c.method == ("fslora" if spec.labels["row"] == "fslora-sadam" else spec.labels["row"])
        if spec.labels["family"] == "adamw":
            assert (c.train.optimizer, c.train.momentum) == ("adamw", 0.0)
        else:
            assert (c.train.optimizer, c.train.momentum) == ("sgd", 0.9)
        if spec.labels["row"] == "fslora-sadam":
            assert (c.server.optimizer, c.server.weight_decay) == ("adam", 0.01)
        else:
            assert (c.server.optimizer, c.server.lr) == ("sgd", None)
        if spec.labels["row"] == "fedit":
            assert c.model.lora_rank == sweep.fair_fedit_rank(scale, 0) and c.federation.profile_choices is None
        else:
            assert c.model.lora_rank == 64 and c.federation.profile_choices == {
                "sketch_ratio": [0.125, 0.25, 0.5, 0.75]
            }
        assert c.model.lora_alpha == 2 * c.model.lora_rank
    # nothing finished: no table runs yet, all of them waiting (rows x families x seeds)
    assert plan["table"] == [] and all(v is None for v in choices.values())
    assert len(waiting) == len(sweep.ROWS) * len(sweep.FAMILIES) * 3


def test_fedit_rank_is_min_k_of_the_seeds_draw(sweep):
    from fedtune.methods.base.lora import client_rank
    from fedtune.protocol.profiles import build_profiles

    scale = sweep.Scale()
    for seed in range(4):
        profiles = build_profiles(10, None, {"sketch_ratio": [0.125, 0.25, 0.5, 0.75]}, seed)
        assert sweep.fair_fedit_rank(scale, seed) == min(client_rank(p, 64) for p in profiles)


def test_the_chosen_rate_is_the_argmax_of_the_mean_of_the_last_3_evaluations(sweep, tmp_path):
    scale = sweep.Scale()
    out = tmp_path / "out"
    plan, _, _ = sweep.build_sweep_plan(scale, 0, [1, 2, 3], out)
    group = {s.labels["lr"]: s for s in harness.with_labels(plan["sweep"], row="heterolora", family="adamw")}
    # 3e-4: best final point (0.90) but last-3 mean 0.70; 1e-3: last-3 mean 0.7667 (chosen);
    # 3e-3: best single evaluation (0.95) early, then collapsed (last-3 mean 0.50)
    finish(group[3e-4], [0.55, 0.6, 0.6, 0.6, 0.9])
    finish(group[1e-3], [0.55, 0.6, 0.8, 0.8, 0.7])
    finish(group[3e-3], [0.95, 0.95, 0.5, 0.5, 0.5])
    finish(group[1e-2], [0.5] * 5)  # diverged
    plan, choices, waiting = sweep.build_sweep_plan(scale, 0, [1, 2, 3], out)
    choice = choices[("heterolora", "adamw")]
    assert choice.setting == {"lr": 1e-3}
    assert choice.score == pytest.approx((0.8 + 0.8 + 0.7) / 3)
    assert choice.runner_up[0] == {"lr": 3e-4} and choice.margin == pytest.approx(100 * (2.3 / 3 - 0.7))
    assert choice.at_edge() is None
    # Table 5.1 runs that group, and only that group, at the chosen rate on every table seed
    table = plan["table"]
    assert {(s.labels["row"], s.labels["family"]) for s in table} == {("heterolora", "adamw")}
    assert sorted(s.labels["seed"] for s in table) == [1, 2, 3]
    chosen = group[1e-3].config
    for spec in table:
        assert spec.config.train.lr == 1e-3 and spec.config.seed == spec.labels["seed"]
        same = spec.config.model_dump(exclude={"seed", "name", "output_dir"})
        assert same == chosen.model_dump(exclude={"seed", "name", "output_dir"})  # only the seed differs
    assert len(waiting) == (len(sweep.ROWS) * len(sweep.FAMILIES) - 1) * 3
    # a group with one unfinished sweep run is not chosen
    flex = harness.with_labels(plan["sweep"], row="flexlora", family="adamw")
    for spec, acc in zip(flex[:-1], (0.6, 0.7)):
        finish(spec, [acc] * 5)
    assert sweep.choose(plan["sweep"], "flexlora", "adamw") is None


def test_fedit_table_runs_use_each_seeds_own_min_k(sweep, tmp_path):
    scale = sweep.Scale()
    out = tmp_path / "out"
    plan, _, _ = sweep.build_sweep_plan(scale, 0, [1, 2, 3], out)
    runs = harness.with_labels(plan["sweep"], row="fedit", family="sgdm")
    for i, spec in enumerate(runs):  # accuracy rises with the rate: the largest wins
        finish(spec, [0.6 + 0.05 * i] * 4)
    plan, choices, _ = sweep.build_sweep_plan(scale, 0, [1, 2, 3], out)
    assert choices[("fedit", "sgdm")].setting == {"lr": max(sweep.LR_GRID["sgdm"])}
    assert choices[("fedit", "sgdm")].at_edge() == "largest"
    for spec in plan["table"]:
        assert spec.config.model.lora_rank == sweep.fair_fedit_rank(scale, spec.labels["seed"])
        assert (spec.config.train.optimizer, spec.config.train.momentum) == ("sgd", 0.9)


def test_ties_go_to_the_smaller_rate_and_a_run_without_evaluations_never_wins():
    from fedtune.harness import choose_from

    c = choose_from([({"lr": 3e-4}, 0.7), ({"lr": 1e-3}, 0.7), ({"lr": 3e-3}, None)])
    assert c.setting == {"lr": 3e-4} and c.margin == 0.0
    assert choose_from([({"lr": 3e-4}, None)]) is None
    nan = choose_from([({"lr": 3e-4}, float("nan")), ({"lr": 1e-3}, 0.51)])
    assert nan.setting == {"lr": 1e-3}


def test_reports_and_verdicts_over_hand_made_runs(sweep, tmp_path):
    scale = sweep.Scale()
    out = tmp_path / "out"
    plan, _, _ = sweep.build_sweep_plan(scale, 0, [1, 2], out)
    for row in ("fslora", "heterolora"):
        for spec in harness.with_labels(plan["sweep"], row=row, family="adamw"):
            finish(spec, [0.6 + spec.labels["lr"] if spec.labels["lr"] <= 3e-3 else 0.5] * 3)  # peak at 3e-3
    plan, choices, _ = sweep.build_sweep_plan(scale, 0, [1, 2], out)
    table = {(s.labels["row"], s.labels["seed"]): s for s in plan["table"]}
    finish(table["fslora", 1], [0.70, 0.72, 0.74])
    finish(table["fslora", 2], [0.76, 0.78, 0.80])
    finish(table["heterolora", 1], [0.66, 0.68, 0.70])
    finish(table["heterolora", 2], [0.72, 0.74, 0.76])
    p = sweep.paired(plan["table"], "adamw", "fslora", "heterolora")
    assert p["seeds"] == [1, 2] and p["diffs"] == pytest.approx([4.0, 4.0]) and p["upload_ratio"] == 1.0
    text = sweep.verdict("fslora", "heterolora", p)
    assert "**yes**" in text and "+4.00 ± 0.00" in text and "outside" in text
    written = sweep.write_reports(plan, choices, scale, 0, [1, 2], out, "cmd", "cost")
    assert all(path.exists() for path in written)
    report = (out / "table51.md").read_text()
    assert "fslora >= heterolora: **yes**" in report and "waiting for the sweep" in report
    assert "lr 0.003 by" in (out / "sweep.md").read_text()
    winners = json.loads((out / "winners.json").read_text())
    assert winners["families"]["adamw"]["fslora"]["train"] == {"optimizer": "adamw", "lr": 3e-3, "momentum": None}
    assert winners["families"]["adamw"]["fslora"]["table_mean"] == pytest.approx(0.75)


def test_quick_and_command_line_options(sweep):
    args = sweep.parse_args(["--quick", "--rounds", "6", "--local-steps", "3"])
    scale = sweep.scale_from_args(args)
    assert (scale.base.model.name, scale.base.rounds, scale.base.train.local_steps) == ("tiny-bert", 6, 3)
    assert sweep.parse_args([]).seeds == "1,2,3" and sweep.parse_args([]).sweep_seed == 0


# -- the winners as recipe values ---------------------------------------------------------------


def test_set_toml_values_keeps_comments_and_other_keys(sweep):
    text = (
        '# header\nmethod = "fslora"\n\n[train]\nlocal_steps = 20\nlr = 5e-4               # old\n'
        'optimizer = "sgd"\nmomentum = 0.9\n\n[federation]\nnum_clients = 20\n'
    )
    new = sweep.set_toml_values(text, "train", {"optimizer": "adamw", "lr": 3e-3, "momentum": None}, "from sweep")
    assert new.startswith("# header\n") and "local_steps = 20\n" in new and "momentum" not in new
    assert 'optimizer = "adamw"' in new and "lr = 0.003" in new and "# from sweep" in new
    assert "\nlr = 0.003                     # from sweep\n" in new  # aligned as the recipes' comments
    again = sweep.set_toml_values(new, "train", {"optimizer": "adamw", "lr": 3e-3, "momentum": None}, "from sweep")
    assert again == new  # a key that holds its value and comment is left as written
    hand = new.replace("lr = 0.003                     # from sweep", "lr = 3e-3  # from sweep")
    assert sweep.set_toml_values(hand, "train", {"lr": 3e-3}, "from sweep") == hand
    new = sweep.set_toml_values(new, "server", {"optimizer": "adam", "lr": 1e-3, "weight_decay": 0.01}, "x")
    c = sweep.load_config_text(new)
    assert (c.train.optimizer, c.train.lr, c.server.optimizer, c.server.lr) == (
        "adamw",
        3e-3,
        "adam",
        1e-3,
    )
    assert c.federation.num_clients == 20


def test_recipe_changes_from_winners(sweep, tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("fslora.toml", "fedit.toml", "default.toml", "local.toml"):
        shutil.copy(ROOT / "configs" / name, configs / name)

    def entry(train, fed=None, table=0.7, score=0.7):
        return {
            "train": train,
            "federation": fed or {"server_optimizer": None, "server_lr": None, "server_weight_decay": None},
            "sweep_score": score,
            "table_mean": table,
            "table_runs": 3,
            "table_seeds": 3,
        }

    sgd = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
    adamw = {"optimizer": "adamw", "lr": 3e-3, "momentum": None}
    results = {
        "families": {
            "adamw": {
                "fslora": entry(adamw, table=0.70),
                "fedit": entry(adamw, table=0.80),
                "fslora-sadam": entry(
                    {**adamw, "lr": 1e-3},
                    {"server_optimizer": "adam", "server_lr": 3e-3, "server_weight_decay": 0.01},
                    table=0.78,
                ),
            },
            "sgdm": {
                "fslora": entry(sgd, table=0.74),
                "fedit": entry(sgd, table=0.75),
                "fslora-sadam": entry(sgd, table=0.60),
            },
        }
    }
    changes = {c.recipe.name: c for c in sweep.recipe_changes(results, configs)}
    fs = changes["fslora.toml"]
    assert (fs.row, fs.family, fs.basis) == ("fslora-sadam", "adamw", "table")  # the best of both rows and families
    text = sweep.apply_change(fs)
    c = sweep.load_config_text(text)
    assert (
        c.train.optimizer,
        c.train.lr,
        c.server.optimizer,
        c.server.lr,
        c.server.weight_decay,
    ) == ("adamw", 1e-3, "adam", 3e-3, 0.01)
    assert c.model.lora_rank == 64 and c.options["weighting"] == "uniform"  # the rest as written
    fedit = changes["fedit.toml"]
    assert (fedit.row, fedit.family) == ("fedit", "adamw") and fedit.federation is None
    assert "transferred" in changes["default.toml"].note  # tweets, not the swept sst2
    assert changes["local.toml"].train is None and "not swept" in changes["local.toml"].basis
    report = sweep.recipe_changes_report(list(changes.values()))
    assert "fslora.toml" in report and "adam lr 0.003" in report
    # a recipe pinned to a rate measured on itself keeps it
    pinned = (
        (configs / "fedit.toml").read_text().replace("\nlr = ", "\nlr = 1e-3  # measured on this recipe\n# was: lr = ")
    )
    (configs / "fedit.toml").write_text(pinned)
    kept = {c.recipe.name: c for c in sweep.recipe_changes(results, configs)}["fedit.toml"]
    assert kept.train is None and "measured on this recipe" in kept.basis
    # unfinished tables: the sweep scores decide, and the basis says so
    results["families"]["sgdm"]["fslora"]["table_runs"] = 1
    results["families"]["sgdm"]["fslora"]["sweep_score"] = 0.9
    assert sweep.best_for_recipe("fslora", results) == ("fslora", "sgdm", "sweep")
