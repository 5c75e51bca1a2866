"""The FSLoRA benchmark suite's plan: shared runs, the horizon runs, its statistics helpers.

Only configs are built here (no training): the suite's numbers are trustworthy only if each
experiment runs the configuration its report says, and a run shared between experiments is the
same configuration in both.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "fslora" / "run_suite.py"


@pytest.fixture(scope="module")
def suite():
    spec = importlib.util.spec_from_file_location("fslora_run_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plan(suite, tmp_path_factory):
    scale = suite.Scale(rounds=20, eval_every=10)
    return scale, suite.build_plan(scale, [0, 1], tmp_path_factory.mktemp("suite"))


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
    refs = {(s.labels["method"], s.labels["seed"], s.labels.get("ratio")): s
            for s in plan["table51"] + plan["fig4b"] if s.labels["data"] == "sst2"}
    strip = {"name", "output_dir", "model"}
    for spec in plan["alpha"]:
        assert spec.config.model.lora_alpha == scale.fixed_alpha == 16
        ref = refs[(spec.labels["method"], spec.labels["seed"], spec.labels.get("ratio"))]
        assert spec.config.model_dump(exclude=strip) == ref.config.model_dump(exclude=strip)
        assert spec.config.model.lora_rank == ref.config.model.lora_rank
        # FedIT (r = 8) and fig4b's r = 8 already use alpha = 2 r = 16: the very same runs
        assert spec.shared == (ref.config.model.lora_alpha == 16)
        assert spec.shared == (spec.config.model.lora_rank == 8)


def test_fedit_rank_is_the_smallest_device_rank(suite, plan):
    from fedtune.federation.profiles import build_profiles

    scale, plan = plan
    for spec in plan["table51"]:
        if spec.labels["method"] != "fedit":
            continue
        ratios = [p.sketch_ratio for p in build_profiles(20, None, {"sketch_ratio": suite.HETERO_RATIOS},
                                                          spec.labels["seed"])]
        assert spec.config.model.lora_rank == round(min(ratios) * scale.rank)
        assert spec.config.model.lora_alpha == 2 * spec.config.model.lora_rank


def test_mean_std_is_sample_std_and_makespan_is_lpt(suite):
    m, s = suite.mean_std([1.0, 2.0, 4.0])
    assert m == pytest.approx(7 / 3)
    assert s == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert suite.mean_std([3.0]) == (3.0, 0.0) and suite.mean_std([]) == (None, None)
    assert suite.makespan([5, 4, 3, 3, 3], 2) == 10  # longest first: {5, 3} = 8 and {4, 3, 3} = 10
