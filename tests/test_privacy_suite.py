"""The privacy-utility benchmark's plan and report (benchmarks/privacy/run_suite.py): every run is
FedIT on 100 clients with 10 per round and uniform weights, central DP at its target epsilon (the
default delta) or none; each epsilon's clip is the argmax of its sweep runs' mean of the last 2
evaluations and the table runs exactly that clip on the table seeds; the report's cost of privacy is
the no-DP mean minus each epsilon's. Only configs and hand-written run folders (no training)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import assert_every_planned_run_resolves, load_script
from tests.test_harness import finish

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "privacy" / "run_suite.py"


@pytest.fixture(scope="module")
def suite():
    return load_script(SUITE, "privacy_suite")


def test_every_planned_run_resolves_fedit_on_100_clients_10_per_round_at_its_epsilon(suite, tmp_path, monkeypatch):
    from fedtune.methods.base import privacy

    # resolving a run calibrates z for its epsilon (tests/test_privacy.py tests that; 20 s an epsilon here)
    monkeypatch.setattr(privacy, "calibrate", lambda *args: 1.0)
    plan, choices, waiting = suite.build([1, 2, 3], 0, False, tmp_path)
    assert assert_every_planned_run_resolves(plan) == 12 + 3  # the sweep; the no-DP table runs
    assert waiting == [1.0, 3.0, 8.0] and all(c is None for c in choices.values())
    for spec in plan["sweep"] + plan["table"]:
        c = spec.config
        assert (c.method, c.data.name, c.model.name) == ("fedit", "sst2", "minilm")
        assert (c.federation.num_clients, c.federation.sample_size(), c.options["weighting"]) == (100, 10, "uniform")
        if math.isinf(spec.labels["epsilon"]):
            assert c.privacy.mode == "none"
        else:
            assert c.privacy.mode == "central" and c.privacy.epsilon == spec.labels["epsilon"]
            assert c.privacy.clip == spec.labels["clip"] and c.privacy.delta is None  # default 1 / N^1.1
    assert {(s.labels["epsilon"], s.labels["clip"]) for s in plan["sweep"]} == {
        (e, c) for e in suite.EPSILONS for c in suite.CLIP_GRID
    }


def _finish(spec, accuracies, z=2.0):
    finish(spec, accuracies, rounds_evaluated=[5 * (i + 1) for i in range(len(accuracies))])
    if spec.config.privacy.mode != "none":
        summary = json.loads((spec.run_dir / "summary.json").read_text())
        summary["privacy"] = {"epsilon": spec.labels["epsilon"], "delta": 100**-1.1, "noise_multiplier": z}
        (spec.run_dir / "summary.json").write_text(json.dumps(summary))


def test_each_epsilon_runs_the_table_at_its_swept_clip_and_the_report_gives_the_cost(suite, tmp_path):
    out = tmp_path / "out"
    plan, _, _ = suite.build([1, 2, 3], 0, False, out)
    sweep = {(s.labels["epsilon"], s.labels["clip"]): s for s in plan["sweep"]}
    # epsilon 3: clip 0.3 has the best last-2 mean (0.70); clip 1 the best single (final) point
    for clip, accs in {0.1: [0.5, 0.6, 0.6], 0.3: [0.5, 0.7, 0.7], 1.0: [0.5, 0.5, 0.85], 3.0: [0.6, 0.5, 0.5]}.items():
        _finish(sweep[(3.0, clip)], accs)
    for clip in suite.CLIP_GRID[:-1]:  # epsilon 8: one sweep run unfinished
        _finish(sweep[(8.0, clip)], [0.7, 0.7])
    plan, choices, waiting = suite.build([1, 2, 3], 0, False, out)
    assert choices[3.0].setting == {"clip": 0.3} and choices[3.0].score == pytest.approx(0.7)
    assert waiting == [1.0, 8.0]
    table = plan["table"]
    assert sorted((s.labels["epsilon"], s.labels["seed"]) for s in table) == sorted(
        [(3.0, seed) for seed in (1, 2, 3)] + [(math.inf, seed) for seed in (1, 2, 3)]
    )
    for spec in table:
        if spec.labels["epsilon"] == 3.0:
            assert spec.config.privacy.clip == 0.3 and spec.config.seed == spec.labels["seed"]
    # the table: no DP 80, 82, 84 (%); epsilon 3: 60, 70, 68 (each run's mean of its last 2 evaluations)
    runs = {(s.labels["epsilon"], s.labels["seed"]): s for s in table}
    for seed, (a, b) in zip((1, 2, 3), ((0.80, 0.80), (0.80, 0.84), (0.84, 0.84))):
        _finish(runs[(math.inf, seed)], [0.5, a, b])
    for seed, (a, b) in zip((1, 2, 3), ((0.60, 0.60), (0.70, 0.70), (0.66, 0.70))):
        _finish(runs[(3.0, seed)], [0.5, a, b], z=3.5)
    written = suite.report(plan, choices, out, "python benchmarks/privacy/run_suite.py")
    assert all(p.exists() for p in written)
    rows = {r["epsilon"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    no_dp, eps3 = rows[None], rows[3.0]
    assert no_dp["accuracy_mean"] == pytest.approx(np.mean([80, 82, 84]))
    assert eps3["accuracy_mean"] == pytest.approx(np.mean([60, 70, 68]))
    assert eps3["accuracy_std"] == pytest.approx(np.std([60, 70, 68], ddof=1))
    assert eps3["cost_points"] == pytest.approx(82 - 66) and eps3["clip"] == 0.3
    assert eps3["noise_multiplier"] == 3.5 and eps3["delta"] == pytest.approx(100**-1.1)
    assert rows[1.0]["accuracy_mean"] is None and rows[1.0]["clip"] is None
    text = (out / "README.md").read_text()
    assert "| 3 | 0.0063 | 0.3 | 3.500 | 66.00 ± 5.29 (n=3) | 16.00 |" in text
