"""The privacy-utility benchmark where DP costs little (benchmarks/privacy/scale.py): its plan sweeps
each arm's rate on seed 0 and then runs FedAvg on MiniLM's head over 1,000 clients, 100 per round,
at each arm's own rate (epsilon 3 and 1 at epsilon 8's), central DP at the clip one AdamW step
cannot exceed (checked on a real client's upload); the report's rows, paired by seed, come from
hand-written run folders (no training)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.conftest import assert_every_planned_run_resolves, suite_fixture
from tests.test_harness import finish

suite = suite_fixture("privacy/scale.py")


def finish_sweep(suite, plan, best: dict[float, float]) -> None:
    """Every sweep run finished; each arm's best rate ``best[epsilon]`` scores 0.7, the others 0.6."""
    for spec in plan["sweep"]:
        acc = 0.7 if spec.labels["lr"] == best[spec.labels["epsilon"]] else 0.6
        finish(spec, [0.5, acc, acc, acc], rounds_evaluated=[6, 8, 10, 12])  # the sweep stops at round 12


def planned(suite, tmp_path, epsilon: float, lr: float, quick: bool, *extra: str):
    """One run of the suite (``extra``: overrides after its own), resolved into ``tmp_path``."""
    spec = suite.spec(epsilon, lr, 1, quick)
    spec.overrides += extra
    return suite.harness.build_plan({"x": [spec]}, suite.RECIPE, tmp_path)["x"][0]


def test_the_sweep_runs_first_then_each_arm_at_its_own_rate_and_the_low_epsilons_at_epsilon_8s(
    suite, tmp_path, monkeypatch
):
    from fedtune.methods.base import accounting

    monkeypatch.setattr(accounting, "calibrate", lambda *args: 1.0)  # calibration: test_the_regime...
    plan, chosen = suite.build([1, 2, 3], False, tmp_path)
    assert len(plan["sweep"]) == 2 * len(suite.LR_GRID) and plan["main"] == plan["low"] == []
    assert chosen == {math.inf: None, 8.0: None} and {s.labels["seed"] for s in plan["sweep"]} == {0}
    finish_sweep(suite, plan, {math.inf: 0.05, 8.0: 0.03})
    plan, chosen = suite.build([1, 2, 3], False, tmp_path)
    assert {e: c.setting["lr"] for e, c in chosen.items()} == {math.inf: 0.05, 8.0: 0.03}
    assert assert_every_planned_run_resolves(plan) == 2 * len(suite.LR_GRID) + 12
    # seed by seed: no DP and epsilon 8 pair up; then epsilon 3 and 1 at epsilon 8's rate
    assert [s.name for s in plan["main"]][:2] == ["epsinf-lr0.05-s1", "eps8-lr0.03-s1"]
    assert {(s.labels["epsilon"], s.labels["lr"]) for s in plan["low"]} == {(3.0, 0.03), (1.0, 0.03)}
    for spec in plan["sweep"] + plan["main"] + plan["low"]:
        c = spec.config
        assert (c.method, c.data.name, c.model.name, c.model.finetune, c.seed) == (
            "fedavg",
            "sst2",
            "minilm",
            "head",
            spec.labels["seed"],
        )
        assert (c.federation.num_clients, c.federation.sample_size(), c.options["weighting"]) == (1000, 100, "uniform")
        assert (c.data.max_train_samples, c.data.max_test_samples) == (20000, None)  # the full test set
        rounds = suite.SWEEP_ROUNDS if spec in plan["sweep"] else 20  # the sweep stops at round 12
        assert (c.rounds, c.eval_every, c.train.local_steps, c.train.batch_size) == (rounds, 2, 1, 8)
        assert (c.server.optimizer, c.server.resolved_lr(), c.server.momentum) == ("sgd", 1.0, 0.9)
        assert (c.train.optimizer, c.train.weight_decay, c.train.lr) == ("adamw", 0.0, spec.labels["lr"])
        if math.isinf(spec.labels["epsilon"]):
            assert c.privacy.mode == "none"
        else:
            p = c.privacy
            assert (p.mode, p.epsilon, p.adaptive_clip) == ("central", spec.labels["epsilon"], False)
            assert p.clip == pytest.approx(spec.labels["lr"] * math.sqrt(770))
            assert (p.delta, p.accountant, p.adjacency, p.per_layer) == (None, "pld", "replace-one", False)


def test_a_reported_seed_cannot_be_the_sweep_seed(suite, capsys):
    assert suite.main(["--seeds", "0,1", "--plan"]) == 2
    assert capsys.readouterr().out.strip().splitlines()[-1] == "--seeds: 0 is the sweep seed (its runs chose the rates)"


def test_the_regime_has_noise_a_fifth_of_the_clip_at_epsilon_8(suite, tmp_path):
    """d: the head's arrays of the strategy the quick config builds (2 x hidden + 2), and MiniLM's
    hidden size from its own config (building MiniLM's federation takes a minute); z calibrated by
    the real accountant: z sqrt(d) / m = 0.792 sqrt(770) / 100 = 0.22 at epsilon 8."""
    from privacy_experiments import noised_coordinates
    from transformers import AutoConfig

    from fedtune.methods.base.privacy import mechanism
    from fedtune.models.loading import resolve_model_path

    tiny = planned(suite, tmp_path, math.inf, 0.03, True)  # the same arrays as under DP, uncalibrated
    assert noised_coordinates(tiny, from_config=True) == suite.HEAD_D["tiny-bert"] == 2 * 32 + 2
    assert suite.HEAD_D["minilm"] == 2 * AutoConfig.from_pretrained(resolve_model_path("minilm")).hidden_size + 2
    mech = mechanism(planned(suite, tmp_path, 8.0, 0.03, False).config)
    assert mech.delta == 1e-6 and mech.rate == pytest.approx(0.1) and mech.z == pytest.approx(0.792, abs=1e-3)
    assert suite.noise_to_clip(mech.z, 770, 100) == pytest.approx(0.22, abs=0.005)


def test_the_clip_is_the_norm_of_a_real_clients_one_adamw_step_so_the_server_clip_leaves_it_whole(suite, tmp_path):
    """A client's upload (Client.fit on the quick model's head, one AdamW step) has norm lr sqrt(d) to
    within 1e-4: the clip C = lr sqrt(d) neither shortens it (the server's clip returns it unchanged)
    nor exceeds it. Control: a clip from another d (the rank-1 LoRA's 9,986) would be 11x the norm."""
    from fedtune.runtime import RunContext, resolve_run

    context = RunContext(resolve_run(planned(suite, tmp_path, 8.0, 0.03, True).config))
    strategy = context.strategy()
    strategy.initialize()
    reply = context.client(0).fit(strategy.configure_fit(1, [0])[0])
    update = {k: np.asarray(v, np.float64) for k, v in reply.arrays.items()}
    assert set(update) == {"classifier.weight", "classifier.bias"}  # the head alone travels
    norm = math.sqrt(sum(float((v**2).sum()) for v in update.values()))
    C = suite.clip_for(0.03, "tiny-bert")
    assert C == strategy.aggregation.privacy.C == pytest.approx(0.03 * math.sqrt(66))
    assert 0.9999 * C <= norm <= C
    clipped = strategy.aggregation.privacy.server_clip(update)
    assert all(np.array_equal(clipped[k], update[k]) for k in update)
    assert norm < 0.1 * 0.03 * math.sqrt(9986)  # control: a clip from the wrong d would waste 11x the noise


def test_the_report_pairs_each_seed_with_no_dp_and_shows_each_arms_chosen_rate(suite, tmp_path):
    plan, _ = suite.build([1, 2, 3], False, tmp_path)
    finish_sweep(suite, plan, {math.inf: 0.05, 8.0: 0.03})
    plan, chosen = suite.build([1, 2, 3], False, tmp_path)
    # last-3 means: no DP 80, 70, 75; epsilon 8 79, 69.5, 74 (paired -1, -0.5, -1: std 0.29, while the
    # unpaired stds are 5); epsilon 3 seeds 1 and 3 only; epsilon 1 pending
    acc = {math.inf: {1: 0.80, 2: 0.70, 3: 0.75}, 8.0: {1: 0.79, 2: 0.695, 3: 0.74}, 3.0: {1: 0.6, 3: 0.65}}
    for spec in plan["main"] + plan["low"]:
        a = acc.get(spec.labels["epsilon"], {}).get(spec.labels["seed"])
        if a is None:
            continue
        finish(spec, [0.5, a - 0.01, a, a + 0.01], rounds_evaluated=[14, 16, 18, 20])
        summary = json.loads((spec.run_dir / "summary.json").read_text())
        summary["majority_accuracy"] = 0.5092
        if not math.isinf(spec.labels["epsilon"]):
            del summary["total_bytes_up"], summary["wall_s"]
            summary["privacy"] = {"epsilon": spec.labels["epsilon"] * 0.99, "delta": 1e-6, "noise_multiplier": 2.0}
        (spec.run_dir / "summary.json").write_text(json.dumps(summary))
    suite.report(plan, chosen, tmp_path, "python benchmarks/privacy/scale.py")
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {r["epsilon"]: r for r in result["rows"]}
    assert list(rows) == [None, 8.0, 3.0, 1.0] and result["majority_rate"] == pytest.approx(50.92)
    assert rows[None]["accuracy_mean"] == pytest.approx(75.0) and rows[None]["minus_no_dp_mean"] is None
    assert rows[8.0]["minus_no_dp_per_seed"] == {
        "1": pytest.approx(-1),
        "2": pytest.approx(-0.5),
        "3": pytest.approx(-1),
    }
    assert rows[8.0]["minus_no_dp_mean"] == pytest.approx(-2.5 / 3)
    assert rows[8.0]["minus_no_dp_std"] == pytest.approx(np.std([-1, -0.5, -1], ddof=1))
    assert rows[3.0]["minus_no_dp_per_seed"] == {"1": pytest.approx(-20), "3": pytest.approx(-10)}
    assert (rows[3.0]["finished"], rows[1.0]["finished"], rows[1.0]["accuracy_mean"]) == (2, 0, None)
    assert (rows[8.0]["lr"], rows[None]["lr"], rows[3.0]["lr"]) == (0.03, 0.05, 0.03)
    # noise / C = z sqrt(d) / m = 2 sqrt(770) / 100
    assert rows[8.0]["noise_to_clip"] == pytest.approx(2 * math.sqrt(770) / 100)
    assert rows[8.0]["clip"] == pytest.approx(0.03 * math.sqrt(770)) and rows[None]["clip"] is None
    assert rows[None]["curve"] == {
        "14": 50.0,
        "16": pytest.approx(74.0),
        "18": pytest.approx(75.0),
        "20": pytest.approx(76.0),
    }
    assert result["sweep"]["8"] == {
        "rounds": 12,
        "noise_multiplier": None,  # the hand-written sweep runs have no privacy summary
        "scores": {"0.03": pytest.approx(70.0), "0.05": 60.0},
        "chosen_lr": 0.03,
    }
    text = (tmp_path / "README.md").read_text()
    assert (
        "| 8 | 1e-06 | 2.000 | 0.03 | 0.832 | 0.55 | 74.17 ± 4.75 (n=3) | -0.83 ± 0.29 | -1.00, -0.50, -1.00 |" in text
    )
    assert "| 1 | – | – | 0.03 | 0.832 | – | pending | pending | – |" in text
    # 4 sweep runs, 3 + 3 + 2 of the 12 table runs; the table's runs are 20 rounds, the sweep's 12
    assert "Status: 12 of 16 planned runs finished; an unfinished row says pending" in text
    assert "20 rounds (the sweep's 12) of 1 AdamW step" in text
    assert "| ∞ (no DP) | – | 60.00 | 70.00 | lr 0.05 by 10.00 points over lr 0.03" in text
