"""The privacy-utility benchmark where DP can work (benchmarks/privacy/scale.py): its plan resolves
to FedIT on 1,000 clients with 50 per round, rank-1 LoRA and uniform weights, central DP with
adaptive clipping at each declared epsilon (the default delta) or none; the regime's noise / C is
about 1.2 at epsilon 8; the report's rows come from hand-written run folders (no training)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.conftest import assert_every_planned_run_resolves, suite_fixture
from tests.test_harness import finish

suite = suite_fixture("privacy/scale.py")


def test_every_planned_run_resolves_with_the_privacy_settings_it_declares(suite, tmp_path, monkeypatch):
    from fedtune.methods.base import accounting

    monkeypatch.setattr(accounting, "calibrate", lambda *args: 1.0)  # calibration: test_the_regime...
    plan = suite.build([1, 2, 3], False, tmp_path)
    assert assert_every_planned_run_resolves(plan) == 12
    # no DP and epsilon 8 first, seed by seed; then epsilon 3 and 1
    assert [s.name for s in plan["main"]][:2] == ["epsinf-s1", "eps8-s1"]
    assert {s.labels["epsilon"] for s in plan["low"]} == {3.0, 1.0}
    for spec in plan["main"] + plan["low"]:
        c = spec.config
        assert (c.method, c.data.name, c.model.name, c.seed) == ("fedit", "sst2", "minilm", spec.labels["seed"])
        assert (c.federation.num_clients, c.federation.sample_size(), c.options["weighting"]) == (1000, 50, "uniform")
        assert (c.model.lora_rank, c.model.target_modules, c.data.max_train_samples) == (1, ["query", "value"], 20000)
        assert (c.rounds, c.eval_every, c.train.local_steps, c.train.batch_size, c.train.threads) == (16, 4, 1, 8, 1)
        if math.isinf(spec.labels["epsilon"]):
            assert c.privacy.mode == "none"
        else:
            p = c.privacy
            assert (p.mode, p.epsilon, p.adaptive_clip, p.clip) == ("central", spec.labels["epsilon"], True, 1.0)
            assert (p.delta, p.accountant, p.adjacency) == (None, "pld", "replace-one")


def test_the_regime_has_noise_about_the_clip_at_epsilon_8(suite, tmp_path):
    """d from the strategy the config builds (rank-1 query/value pairs of MiniLM's 6 layers and the
    head), z calibrated by the real accountant: z_Delta sqrt(d) / m = 1.21 at epsilon 8 (m = 10 suite: 38)."""
    from fedtune.methods.base.privacy import mechanism

    spec = next(s for s in suite.build([1], False, tmp_path)["main"] if s.labels["epsilon"] == 8.0)
    d = suite.noised_coordinates(spec, from_config=True)
    assert d == 6 * 2 * (384 + 384) + 384 * 2 + 2
    mech = mechanism(spec.config)
    assert mech.delta == 1e-6 and mech.rate == pytest.approx(0.05)
    assert suite.noise_to_clip(mech.z_update, d, 50) == pytest.approx(1.21, abs=0.01)


def test_the_report_gives_each_epsilon_its_mean_of_the_last_two_evaluations_and_noise_to_clip(suite, tmp_path):
    from fedtune.checkpoint import save_state

    plan = suite.build([1, 2], False, tmp_path)
    runs = {(s.labels["epsilon"], s.labels["seed"]): s for s in plan["main"] + plan["low"]}
    for (epsilon, seed), spec in runs.items():
        if epsilon == 1.0:
            continue  # pending
        acc = {math.inf: 0.8, 8.0: 0.7, 3.0: 0.6}[epsilon] + 0.02 * seed
        finish(spec, [0.5, acc - 0.02, acc], rounds_evaluated=[10, 20, 30])
        save_state(spec.run_dir / "checkpoint.npz", {"global": {"a": np.zeros((300,)), "b": np.ones((10, 10))}})
        summary = json.loads((spec.run_dir / "summary.json").read_text())
        summary["majority_accuracy"] = 0.52
        if not math.isinf(epsilon):  # what a DP run's summary holds: no bytes, no wall time
            del summary["total_bytes_up"], summary["wall_s"]
            summary["privacy"] = {
                "epsilon": epsilon * 0.99,
                "delta": 1e-6,
                "noise_multiplier": 1.5,
                "update_noise_multiplier": 2.0,
                "final_clip": 0.5 + 0.1 * seed,
            }
        (spec.run_dir / "summary.json").write_text(json.dumps(summary))
    suite.report(plan, tmp_path, "python benchmarks/privacy/scale.py")
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["epsilon"]: r for r in result["rows"]}
    assert result["majority_rate"] == pytest.approx(52.0) and list(rows) == [None, 8.0, 3.0, 1.0]
    # seeds 1, 2: last-2 means 81, 83 (no DP); 61, 63 (epsilon 3)
    assert rows[None]["accuracy_mean"] == pytest.approx(82.0) and rows[None]["noise_to_clip"] is None
    assert rows[3.0]["accuracy_mean"] == pytest.approx(62.0)
    assert rows[3.0]["accuracy_std"] == pytest.approx(np.std([61, 63], ddof=1))
    # noise / C = z_Delta sqrt(d) / m = 2 sqrt(400) / 50
    assert (rows[8.0]["d_noised"], rows[8.0]["noise_to_clip"]) == (400, pytest.approx(0.8))
    assert rows[8.0]["final_clip_mean"] == pytest.approx(0.65)
    assert rows[1.0]["accuracy_mean"] is None and rows[1.0]["finished"] == 0
    # each evaluated round's mean over the seeds: 50; 80, 82; 82, 84
    assert rows[None]["curve"] == {"10": pytest.approx(50.0), "20": pytest.approx(81.0), "30": pytest.approx(83.0)}
    assert rows[1.0]["curve"] == {}
    text = (tmp_path / "README.md").read_text()
    assert "| 3 | 1e-06 | 1.500 | 2.000 | 1 → 0.650 | 0.80 | 62.00 ± 1.41 (n=2) | 52.00 |" in text
    assert "| 1 | – | – | – | 1 → – | – | pending |" in text
    assert "| ∞ (no DP) | 50.00 | 81.00 | 83.00 |" in text and "| 1 | – | – | – |\n" in text
