"""benchmarks/budgets/three_classes.py and causal_lm.py (issue 41, item 5): their arms give the
device classes different settings, on the quick scales (tiny-bert, RABO's Conv4 with 2 rounds,
tiny-llama; causal_lm.py's own SmolLM2 scale too, slow), without training; the per-class costs,
predictions and held-out loss they report."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedtune.config import load_config
from fedtune.planning.planner import GIB, plan_budgets
from tests.conftest import load_script

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks" / "budgets"
SIZES = [("heterolora", 4, 64), ("fslora", 0.0625, 1.0)]  # at r = 64
QUICK_SIZES = [("heterolora", 2, 32), ("fslora", 0.0625, 1.0)]  # three_classes --quick: r = 32
CAUSAL_QUICK_SIZES = [("heterolora", 1, 16), ("fslora", 0.0625, 1.0)]  # causal_lm --quick: r = 16 (tiny-llama's most)


@pytest.fixture(scope="module")
def bench():
    return load_script(FOLDER / "three_classes.py", "three_classes")


@pytest.fixture(scope="module")
def causal():
    return load_script(FOLDER / "causal_lm.py", "causal_lm")


@pytest.fixture(scope="module")
def table():
    return load_script(FOLDER / "class_table.py", "class_table")


def check_arms(bench, method, small, top, base, suite, pin=False):
    """The planned arm gives phone < laptop < workstation (``small`` and ``top`` at the ends), the
    smallest arm ``small`` everywhere, the drop arm ``top`` and drops the phones and laptops."""
    knob = {"heterolora": "rank", "fslora": "sketch_ratio"}[method]
    profiles, settings = bench.arm_profiles(method, base, suite, pin)
    planned = plan_budgets(bench.context(base, profiles["planned"], suite.recipe(method)))
    by_class = {bench.class_of(c.cid): getattr(p, knob) for c, p in zip(planned.clients, planned.profiles)}
    assert by_class["phone"] == small < by_class["laptop"] < by_class["workstation"] == top
    assert not planned.excluded
    assert {p[knob] for p in profiles["smallest"]} == {small}
    dropped = [p["device_class"] for p in profiles["drop"] if p.get("failure_prob") == 1.0]
    assert set(dropped) == {"phone", "laptop"} and all(p[knob] == top for p in profiles["drop"])
    assert settings["drop"]["phone"] == "dropped" and settings["planned"] != settings["smallest"]


@pytest.mark.parametrize("method, small, top", QUICK_SIZES)
def test_the_three_arms_give_the_classes_different_settings(bench, method, small, top):
    check_arms(bench, method, small, top, [*bench.QUICK, *bench.METHODS[method]], bench.AGNEWS)


@pytest.mark.parametrize(
    "quick, method, small, top",
    [(True, *s) for s in CAUSAL_QUICK_SIZES] + [pytest.param(False, *s, marks=pytest.mark.slow) for s in SIZES],
)
def test_the_causal_lm_arms_give_the_classes_different_settings(causal, method, small, top, quick):
    """On tiny-llama, and (slow) on the benchmark's own SmolLM2-135M at its scale."""
    base = [*(causal.QUICK if quick else []), *causal.tc.METHODS[method]]
    check_arms(causal.tc, method, small, top, base, causal.SUITE, pin=not quick)


def test_the_causal_lm_plan_has_one_experiment_per_method_on_its_recipe(causal, tmp_path):
    plan, settings = causal.SUITE.plan([0, 1], True, tmp_path)
    assert list(plan) == ["heterolora", "fslora"] == list(settings)
    for method, specs in plan.items():
        assert {(s.labels["arm"], s.labels["seed"]) for s in specs} == {
            (a, k) for a in causal.tc.ARMS[:3] for k in (0, 1)
        }
        assert {s.config.method for s in specs} == {method}
        assert {s.config.task.kind for s in specs} == {"causal-lm"} and {s.config.data.name for s in specs} == {
            "commonsense"
        }
        assert all(s.run_dir.parent == tmp_path / "runs" / method for s in specs)


@pytest.mark.parametrize("method", ["heterolora", "fslora"])
def test_the_compressed_arm_lets_the_planner_keep_the_rank_and_compress_the_upload(bench, method):
    knob = {"heterolora": "rank", "fslora": "sketch_ratio"}[method]
    base = [*bench.QUICK, *bench.METHODS[method]]
    profiles, settings = bench.arm_profiles(method, base)
    assert all("wire_dtype" not in p for p in profiles["compressed"])
    assert {p["wire_dtype"] for p in profiles["planned"]} == {"float32"}
    strip = [{k: v for k, v in p.items() if k != "wire_dtype"} for p in profiles["planned"]]
    assert profiles["compressed"] == strip
    planned = plan_budgets(bench.context(base, profiles["planned"], bench.RECIPE))
    compressed = plan_budgets(bench.context(base, profiles["compressed"], bench.RECIPE))
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
    plan = plan_budgets(bench.context(base, profiles["planned"], bench.RECIPES["omniglot"]))
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


def test_only_heterolora_smallest_arm_sets_the_global_rank_to_the_clients(bench):
    """Under HeteroLoRA's rank scaling a rank-2 client in a rank-32 global adapter would count
    16x weaker in the evaluated model than it trained; the smallest arm's global rank is theirs."""
    runs, _ = bench.specs([0], quick=True)
    rank = {
        (r.labels["method"], r.labels["arm"]): load_config(bench.RECIPE, r.overrides).model.lora_rank
        for r in runs
        if r.labels["method"] != "rabo"
    }
    assert rank.pop(("heterolora", "smallest")) == 2
    assert set(rank.values()) == {32}  # the other arms, and FSLoRA's smallest (its sketch of the r adapter)


def test_class_costs_average_the_measured_client_rounds_and_count_the_dropped(table, monkeypatch):
    line = {
        "clients": [0, 1, 2, 3],
        "dropped": {"1": "injected failure (failure_prob 1.0)", "3": "simulated out-of-memory: ..."},
        "client_peak_bytes": {"0": GIB, "3": 3 * GIB, "2": GIB},
        "client_compute_s": {"0": 1.0, "1": 0.0, "2": 5.0, "3": 3.0},
        "client_bytes_up": {"0": 1_000_000, "1": 0, "2": 4_000_000, "3": 3_000_000},
    }
    monkeypatch.setattr(table, "load_rounds", lambda spec: [line, line])
    costs = table.class_costs(None)  # clients 0 and 3: phones (3 over its memory); 1: laptop; 2: workstation
    phone = {"trained": 4, "dropped": 2, "peak_gib": 2.0, "peak_gib_max": 3.0, "compute_s": 2.0, "mb_up": 2.0}
    assert costs["phone"] == phone
    assert costs["laptop"]["trained"] == 0 and costs["laptop"]["dropped"] == 2 and costs["laptop"]["peak_gib"] is None
    assert costs["workstation"]["mb_up"] == 4.0


def test_class_predictions_average_each_class_prediction_from_the_runs_plan(table, tmp_path):
    clients = [
        {"cid": c, "device_class": table.class_of(c), "setting": "x", "peak_bytes": (c + 1) * GIB, "seconds": 2.0 * c}
        | {"upload_mb": 0.5 * c}
        for c in range(6)
    ]
    (tmp_path / "plan.json").write_text(json.dumps({"clients": clients}))
    preds = table.class_predictions(SimpleNamespace(run_dir=tmp_path))
    assert preds["laptop"] == {"peak_gib_pred": 3.5, "s_pred": 5.0, "mb_pred": 1.25}  # clients 1 and 4
    assert table.class_predictions(SimpleNamespace(run_dir=tmp_path / "none"))["phone"]["peak_gib_pred"] is None


def test_rows_give_the_mean_and_sample_std_of_each_runs_last_two_held_out_losses(table, monkeypatch):
    arms = {"heterolora": ("planned", "drop"), "rabo": ("smallest",)}
    runs = [SimpleNamespace(labels={"method": m, "arm": a}, n=n) for m in arms for a in arms[m] for n in (0, 1)]
    evals = {0: [3.0, 2.0, 1.0], 1: [5.0, 4.0, 3.0]}  # last two: 1.5 and 3.5

    def rounds(spec):
        return [{"round": r + 1, "loss": v, "accuracy": 0.5, "clients": []} for r, v in enumerate(evals[spec.n])]

    monkeypatch.setattr(table, "load_rounds", rounds)
    monkeypatch.setattr(table, "load_summary", lambda spec: {})
    monkeypatch.setattr(table, "final_accuracy", lambda specs, last: (50.0, 0.0, len(specs)))
    settings = {m: {a: dict.fromkeys(table.CLASSES, "x") for a in arms[m]} for m in arms}
    out = table.rows(runs, settings)
    assert [(r["method"], r["arm"]) for r in out] == [
        ("heterolora", "planned"),
        ("heterolora", "drop"),
        ("rabo", "smallest"),
    ]
    assert all(r["loss_mean"] == pytest.approx(2.5) and r["loss_std"] == pytest.approx(2**0.5) for r in out)


def test_the_full_scale_runs_state_the_pinned_class_budgets_and_quick_ones_derive_theirs(bench):
    """A device's budget is fixed: a refit of the memory model must not change the runs' configs
    (and void them); --quick's tiny-bert derives its own from the multiples (RABO's quick scale
    keeps the Conv4: the same values)."""
    for quick in (False, True):
        runs, _ = bench.specs([0], quick=quick)
        for r in runs:
            experiment = bench.EXPERIMENT[r.labels["method"]]
            if quick and experiment == "omniglot":
                continue
            config = load_config(bench.RECIPES[experiment], r.overrides)
            stated = {p.device_class: (p.memory_gib, p.bandwidth_mb) for p in config.federation.profiles}
            assert (stated == bench.PINNED[experiment]) is not quick, (quick, r.name, stated)
