"""benchmarks/budgets/three_classes.py (issue 41, item 5): its three arms give the device classes
different settings, on the quick scale (tiny-bert), without training."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fedtune.planning.planner import GIB, plan_budgets

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "budgets" / "three_classes.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("three_classes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method, small, top", [("heterolora", 4, 64), ("fslora", 0.0625, 1.0)])
def test_the_three_arms_give_the_classes_different_settings(bench, method, small, top):
    knob = {"heterolora": "rank", "fslora": "sketch_ratio"}[method]
    base = [*bench.QUICK, *bench.METHODS[method]]
    profiles, settings = bench.arm_profiles(method, base)
    planned = plan_budgets(bench.context(base, profiles["planned"]))
    by_class = {bench.class_of(c.cid): getattr(p, knob) for c, p in zip(planned.clients, planned.profiles)}
    assert by_class["phone"] == small < by_class["laptop"] < by_class["workstation"] == top
    assert not planned.excluded
    assert {p[knob] for p in profiles["smallest"]} == {small}
    dropped = [p["device_class"] for p in profiles["drop"] if p.get("failure_prob") == 1.0]
    assert set(dropped) == {"phone", "laptop"} and all(p[knob] == top for p in profiles["drop"])
    assert settings["drop"]["phone"] == "dropped" and settings["planned"] != settings["smallest"]


def test_specs_list_every_method_arm_and_seed(bench):
    runs, settings = bench.specs([0, 1], quick=True)
    assert len(runs) == len(bench.METHODS) * len(bench.ARMS) * 2
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
