"""benchmarks/budgets/three_classes.py (issue 41, item 5): its arms give the device classes
different settings, on the quick scale (tiny-bert; RABO's Conv4 with 2 rounds), without training."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fedtune.config import load_config
from fedtune.planning.planner import GIB, plan_budgets

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "budgets" / "three_classes.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("three_classes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method, small, top", [("heterolora", 2, 32), ("fslora", 0.0625, 1.0)])  # quick: r = 32
def test_the_three_arms_give_the_classes_different_settings(bench, method, small, top):
    knob = {"heterolora": "rank", "fslora": "sketch_ratio"}[method]
    base = [*bench.QUICK, *bench.METHODS[method]]
    profiles, settings = bench.arm_profiles(method, base)
    planned = plan_budgets(bench.context(method, base, profiles["planned"]))
    by_class = {bench.class_of(c.cid): getattr(p, knob) for c, p in zip(planned.clients, planned.profiles)}
    assert by_class["phone"] == small < by_class["laptop"] < by_class["workstation"] == top
    assert not planned.excluded
    assert {p[knob] for p in profiles["smallest"]} == {small}
    dropped = [p["device_class"] for p in profiles["drop"] if p.get("failure_prob") == 1.0]
    assert set(dropped) == {"phone", "laptop"} and all(p[knob] == top for p in profiles["drop"])
    assert settings["drop"]["phone"] == "dropped" and settings["planned"] != settings["smallest"]


@pytest.mark.parametrize("method", ["heterolora", "fslora"])
def test_the_compressed_arm_lets_the_planner_keep_the_rank_and_compress_the_upload(bench, method):
    knob = {"heterolora": "rank", "fslora": "sketch_ratio"}[method]
    base = [*bench.QUICK, *bench.METHODS[method]]
    profiles, settings = bench.arm_profiles(method, base)
    assert all("wire_dtype" not in p for p in profiles["compressed"])
    assert {p["wire_dtype"] for p in profiles["planned"]} == {"float32"}
    strip = [{k: v for k, v in p.items() if k != "wire_dtype"} for p in profiles["planned"]]
    assert profiles["compressed"] == strip
    planned = plan_budgets(bench.context(method, base, profiles["planned"]))
    compressed = plan_budgets(bench.context(method, base, profiles["compressed"]))
    assert not compressed.excluded
    for cid in (0, 1):  # the phone and the laptop are bandwidth-limited: a larger setting, top-k on the wire
        assert getattr(compressed.profiles[cid], knob) > getattr(planned.profiles[cid], knob)
        assert compressed.profiles[cid].upload_topk is not None and planned.profiles[cid].upload_topk is None
        assert "top-k" in settings["compressed"][bench.class_of(cid)]
    assert compressed.clients[2].setting == planned.clients[2].setting  # the workstation fits uncompressed


def test_rabo_arms_give_the_classes_capacities_from_their_memory(bench):
    base = [*bench.METHODS["rabo"], *bench.QUICK_RABO]
    profiles, settings = bench.arm_profiles("rabo", base)
    assert set(profiles) == {"planned", "smallest", "drop"} == set(settings)
    assert all("wire_dtype" not in p and "capacity" not in p for p in profiles["planned"])
    plan = plan_budgets(bench.context("rabo", base, profiles["planned"]))
    by_class = {bench.class_of(c.cid): p.capacity for c, p in zip(plan.clients, plan.profiles)}
    assert by_class == {"phone": 0.25, "laptop": 0.5, "workstation": 1.0} and not plan.excluded
    budget = {p["device_class"]: p["memory_gib"] * GIB for p in profiles["planned"]}
    assert all(c.peak_bytes <= budget[bench.class_of(c.cid)] for c in plan.clients)
    assert {p["capacity"] for p in profiles["smallest"]} == {0.25}
    dropped = [p["device_class"] for p in profiles["drop"] if p.get("failure_prob") == 1.0]
    assert set(dropped) == {"phone", "laptop"} and all(p["capacity"] == 1.0 for p in profiles["drop"])
    assert settings["planned"] == {"phone": "capacity 0.25", "laptop": "capacity 0.5", "workstation": "capacity 1"}
    assert settings["drop"]["laptop"] == "dropped" and settings["smallest"]["workstation"] == "capacity 0.25"


def test_specs_list_every_method_arm_and_seed(bench):
    runs, settings = bench.specs([0, 1], quick=True)
    assert len(runs) == sum(len(bench.METHOD_ARMS[m]) for m in bench.METHODS) * 2
    assert {r.labels["arm"] for r in runs if r.labels["method"] == "rabo"} == {"planned", "smallest", "drop"}
    rabo = next(r for r in runs if r.labels["method"] == "rabo")
    config = load_config(bench.RECIPES["omniglot"], rabo.overrides)  # the quick scale over RABO's
    assert (config.rounds, config.task.eval_episodes, config.federation.num_clients) == (2, 20, 6)
    assert [r.labels["seed"] for r in runs] == sorted(r.labels["seed"] for r in runs)  # seed by seed
    assert set(settings) == set(bench.METHODS)


def test_class_costs_average_the_measured_client_rounds_and_count_the_dropped(bench, monkeypatch):
    line = {
        "clients": [0, 1, 2, 3],
        "dropped": {"1": "injected failure (failure_prob 1.0)", "3": "simulated out-of-memory: ..."},
        "client_peak_bytes": {"0": GIB, "3": 3 * GIB, "2": GIB},
        "client_compute_s": {"0": 1.0, "1": 0.0, "2": 5.0, "3": 3.0},
        "client_bytes_up": {"0": 1_000_000, "1": 0, "2": 4_000_000, "3": 3_000_000},
    }
    monkeypatch.setattr(bench, "load_rounds", lambda spec: [line, line])
    costs = bench.class_costs(None)  # clients 0 and 3: phones (3 over its memory); 1: laptop; 2: workstation
    phone = {"trained": 4, "dropped": 2, "peak_gib": 2.0, "peak_gib_max": 3.0, "compute_s": 2.0, "mb_up": 2.0}
    assert costs["phone"] == phone
    assert costs["laptop"]["trained"] == 0 and costs["laptop"]["dropped"] == 2 and costs["laptop"]["peak_gib"] is None
    assert costs["workstation"]["mb_up"] == 4.0
