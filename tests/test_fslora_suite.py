"""The FSLoRA benchmark suite's plan and reports: shared runs, the horizon and alpha runs, the
recipe it builds from, and a report over hand-written run folders.

Only configs are built here (no training): the suite's numbers are trustworthy only if each
experiment runs the configuration its report says, and a run shared between experiments is the
same configuration in both.
"""

from __future__ import annotations

import json

import pytest
import tomli_w

from tests.conftest import assert_every_planned_run_resolves, suite_fixture

suite = suite_fixture("fslora/run_suite.py", "fslora_suite")


@pytest.fixture(scope="module")
def plan(suite, tmp_path_factory):
    scale = suite.Scale(overrides=("rounds=20", "eval_every=10"))
    return scale, suite.build_suite_plan(scale, [0, 1], tmp_path_factory.mktemp("suite"))


def test_every_planned_run_resolves(plan):
    assert assert_every_planned_run_resolves(plan[1]) > 10


def test_shared_runs_are_one_config_in_the_owner_folder(plan):
    scale, plan = plan
    by_name = {(s.experiment, s.name): s for specs in plan.values() for s in specs}
    owner = by_name[("fig4b", "r64-k8-sst2-s0")]  # fig4b comes first in EXPERIMENTS: it owns the run
    ratio = by_name[("fig4c", "ratio0.125-sst2-s0")]
    assert not owner.shared and ratio.shared and ratio.owner == "fig4b"
    assert ratio.key == owner.key and ratio.run_dir == owner.run_dir
    r16 = by_name[("fig4b", "r16-k8-sst2-s1")]
    assert r16.owner == "fig3" and r16.run_dir.name == "r16-sketch0.5-sst2-s1"
    keys = [s.key for specs in plan.values() for s in specs if not s.shared]
    assert len(keys) == len(set(keys))  # every distinct config runs once


def test_runs_are_the_recipe_plus_their_overlays(suite, plan):
    from fedtune.config import load_config

    scale, plan = plan
    recipe = load_config(suite.RECIPE)
    for spec in (s for specs in plan.values() for s in specs):
        c = spec.config
        assert (c.train.lr, c.train.batch_size, c.model.lora_dropout, c.data.alpha) == (1e-3, 16, 0.1, 0.5)
        assert (c.model.name, c.federation.num_clients, c.train.local_steps) == (
            recipe.model.name,
            recipe.federation.num_clients,
            recipe.train.local_steps,
        )
        assert c.eval_every == 10 and c.method == spec.labels["method"]
        assert c.options == load_config(None, suite.OVERLAYS[c.method]).options
        assert c.model.lora_alpha == (spec.labels["alpha"] or 2 * c.model.lora_rank)
    agnews = next(s for s in plan["table51"] if s.labels["data"] == "agnews").config
    assert agnews.data.max_train_samples is None and agnews.data.max_test_samples == 2000


def test_quick_and_command_line_options_override_the_recipe(suite):
    scale = suite.scale_from_args(suite.parse_args(["--quick", "--rounds", "3", "--topk", "0.25"]))
    base = scale.base
    assert (base.model.name, base.rounds, base.train.local_steps, base.federation.clients_per_round) == (
        "tiny-bert",
        3,
        2,
        4,
    )
    assert scale.config("agnews").data.max_test_samples == 100 and scale.topk == 0.25
    assert suite.scale_from_args(suite.parse_args([])).base.rounds == 24


def test_horizon_is_table51_with_more_rounds(plan):
    scale, plan = plan
    table = {(s.labels["method"], s.labels["data"], s.labels["seed"]): s for s in plan["table51"]}
    assert {s.labels["method"] for s in plan["horizon"]} == set(scale.horizon_methods)
    for spec in plan["horizon"]:
        ref = table[(spec.labels["method"], spec.labels["data"], spec.labels["seed"])]
        assert not spec.shared and spec.key != ref.key
        assert spec.config.rounds == scale.horizon_factor * ref.config.rounds == 60
        strip = {"name", "output_dir", "rounds"}
        assert spec.config.model_dump(exclude=strip) == ref.config.model_dump(exclude=strip)


def test_alpha_runs_change_only_lora_alpha(plan):
    scale, plan = plan
    refs = {
        (s.labels["method"], s.labels["seed"], s.labels.get("ratio")): s
        for s in plan["table51"] + plan["fig4b"]
        if s.labels["data"] == "sst2"
    }
    strip = {"name", "output_dir", "model"}
    for spec in plan["alpha"]:
        assert spec.config.model.lora_alpha == scale.fixed_alpha == 16
        ref = refs[(spec.labels["method"], spec.labels["seed"], spec.labels.get("ratio"))]
        assert spec.config.model_dump(exclude=strip) == ref.config.model_dump(exclude=strip)
        assert spec.config.model.lora_rank == ref.config.model.lora_rank
        # FedIT (r = 8) and fig4b's r = 8 already use alpha = 2 r = 16: the very same runs
        assert spec.shared == (ref.config.model.lora_alpha == 16)
        assert spec.shared == (spec.config.model.lora_rank == 8)


def test_fedit_rank_is_the_smallest_device_rank(plan):
    from fedtune.protocol.profiles import build_profiles

    scale, plan = plan
    assert scale.hetero_ratios == [0.125, 0.25, 0.5, 0.75]
    for spec in plan["table51"]:
        if spec.labels["method"] != "fedit":
            assert spec.config.federation.profile_choices == {"sketch_ratio": scale.hetero_ratios}
            continue
        ratios = [
            p.sketch_ratio for p in build_profiles(20, None, {"sketch_ratio": scale.hetero_ratios}, spec.labels["seed"])
        ]
        assert spec.config.model.lora_rank == round(min(ratios) * scale.rank)
        assert spec.config.model.lora_alpha == 2 * spec.config.model.lora_rank
        assert spec.config.federation.profile_choices is None


def test_fig4c_report_from_run_folders(suite, tmp_path):
    """Two of fig4c's four configs finished for both seeds, one for one seed, one not at all."""
    scale = suite.quick_scale()
    plan = suite.build_suite_plan(scale, [0, 1], tmp_path)
    accuracy = {(0.125, 0): 0.5, (0.125, 1): 0.75, (0.25, 0): 0.625, (0.5, 0): 0.5, (0.5, 1): 0.5}
    for spec in plan["fig4c"]:
        acc = accuracy.get((spec.labels["ratio"], spec.labels["seed"]))
        if acc is None:
            continue
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        (spec.run_dir / "config.toml").write_text(tomli_w.dumps(spec.config.model_dump(mode="json", exclude_none=True)))
        (spec.run_dir / "metrics.jsonl").write_text(json.dumps({"round": 2, "accuracy": acc, "bytes_up": 400}) + "\n")
        (spec.run_dir / "summary.json").write_text(
            json.dumps({"rounds": 2, "final_accuracy": acc, "total_bytes_up": 400_000, "wall_s": 3.0})
        )
    suite.write_reports(plan, ["fig4c"], scale, [0, 1], tmp_path, "the command", "the cost note")
    text = (tmp_path / "fig4c.md").read_text()
    assert "| 0.125 | 8 | 62.50 ± 17.68 | 0.020 |" in text
    assert "| 0.25 | 16 | 62.50 ± 0.00 (n=1) | 0.020 |" in text
    assert "| 0.5 | 32 | 50.00 ± 0.00 | 0.020 |" in text
    assert "| 1 | 64 | pending | – |" in text
    assert "| ratio0.125-sst2-s0 | `runs/fig4b/r64-k8-sst2-s0` (shared with fig4b) | 50.00 | 2 | 0.020 | 3 |" in text
    assert "the command" in text and "the cost note" in text and "`tiny-bert`" in text
    assert (tmp_path / "fig4c.png").read_bytes()[:4] == b"\x89PNG"
