"""The privacy-utility benchmark's plan and report (benchmarks/privacy/run_suite.py): every run is
FedIT or FSLoRA (configs/fslora.toml's settings) on 100 clients with 10 per round and uniform
weights, central DP at its target epsilon (the default delta) or none; each (method, epsilon)'s clip
is the argmax of its sweep runs' mean of the last 2 evaluations and the table runs exactly that clip
on the table seeds; the report's cost of privacy is the same method's no-DP mean minus each
epsilon's. Only configs and hand-written run folders (no training)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedtune import harness
from fedtune.config import load_config
from tests.conftest import assert_every_planned_run_resolves, suite_fixture
from tests.test_harness import finish

ROOT = Path(__file__).resolve().parents[1]


suite = suite_fixture("privacy/run_suite.py", "privacy")


def test_every_planned_run_resolves_fedit_on_100_clients_10_per_round_at_its_epsilon(suite, tmp_path, monkeypatch):
    from fedtune.methods.base import accounting

    # resolving a run calibrates z for its epsilon (tests/test_privacy.py tests that; seconds an epsilon here)
    monkeypatch.setattr(accounting, "calibrate", lambda *args: 1.0)
    plan, choices, waiting = suite.build([1, 2, 3], 0, False, tmp_path)
    # FedIT's sweep and no-DP table runs; FSLoRA's (epsilon 8 only) likewise; secagg's two Flower runs
    assert assert_every_planned_run_resolves(plan) == 18 + 3 + 6 + 3 + 2
    assert [s.run_dir for s in plan["secagg"]] == [s.run_dir for s in suite.secagg_specs(False, tmp_path)]
    assert waiting == [("fedit", 1.0), ("fedit", 3.0), ("fedit", 8.0), ("fslora", 8.0)]
    assert all(c is None for c in choices.values())
    for spec in plan["sweep"] + plan["table"] + plan["fslora-sweep"] + plan["fslora-table"]:
        c = spec.config
        assert (c.method, c.data.name, c.model.name) == (spec.labels["method"], "sst2", "minilm")
        assert (c.federation.num_clients, c.federation.sample_size(), c.options["weighting"]) == (100, 10, "uniform")
        assert (c.rounds, c.train.local_steps, c.data.max_train_samples) == (30, 5, 20000)
        assert spec.name.startswith("fslora-") == (c.method == "fslora")
        if math.isinf(spec.labels["epsilon"]):
            assert c.privacy.mode == "none"
        else:
            assert c.privacy.mode == "central" and c.privacy.epsilon == spec.labels["epsilon"]
            assert c.privacy.clip == spec.labels["clip"] and c.privacy.delta is None  # the default
    assert {(s.labels["epsilon"], s.labels["clip"]) for s in plan["sweep"]} == {
        (e, c) for e in suite.EPSILONS for c in suite.CLIP_GRID
    }
    assert {(s.labels["epsilon"], s.labels["clip"]) for s in plan["fslora-sweep"]} == {
        (8.0, c) for c in suite.CLIP_GRID
    }


def test_fedit_runs_keep_their_names_and_overrides_and_the_default_selection_is_fedits(suite, tmp_path):
    """The lead's suite resumes by name and config: FedIT's runs are exactly the ones before the
    FSLoRA row, and a plain command selects only them."""
    plan, _, _ = suite.build([1, 2, 3], 0, False, tmp_path)
    run = {s.name: s for s in plan["sweep"] + plan["table"]}
    assert run["eps3-clip0.3-s0"].overrides == [
        'privacy.mode="central"',
        "privacy.epsilon=3.0",
        "privacy.clip=0.3",
        "seed=0",
    ]
    assert run["epsinf-s2"].overrides == ["seed=2"]
    assert [s.name for s in plan["table"]] == ["epsinf-s1", "epsinf-s2", "epsinf-s3"]
    assert plan["sweep"][0].run_dir == tmp_path / "runs" / "sweep" / "eps1-clip0.01-s0"
    assert suite.DEFAULT_ONLY == "sweep,table"


def test_the_fslora_row_runs_configs_fslora_toml_settings_on_the_suites_data_and_clients(suite, tmp_path):
    plan, _, _ = suite.build([1], 0, False, tmp_path)
    got = plan["fslora-table"][0].config
    want = load_config(ROOT / "configs" / "fslora.toml")
    fedit = plan["table"][0].config
    for section, keys in {
        "model": ["lora_rank", "lora_alpha", "lora_dropout", "target_modules"],
        "train": ["optimizer", "lr", "momentum", "batch_size", "local_steps"],
        "federation": ["profile_choices"],
        "server": ["optimizer", "lr", "weight_decay"],
    }.items():
        for key in keys:
            assert getattr(getattr(got, section), key) == getattr(getattr(want, section), key), f"{section}.{key}"
    from fedtune.methods.fslora import FSLoRAOptions

    assert FSLoRAOptions(**got.options) == FSLoRAOptions(**want.options)
    assert (got.data, got.rounds, got.eval_every) == (fedit.data, fedit.rounds, fedit.eval_every)
    assert (got.federation.num_clients, got.federation.clients_per_round) == (100, 10)


#: the hand-written runs' global arrays (d noised) and client uploads (bytes) by method
D = {"fedit": 400, "fslora": 900}
UP = {"fedit": (1608, 1608), "fslora": (800, 1200)}  # two clients' bytes in every round


def _finish(spec, accuracies, z=2.0):
    from fedtune.checkpoint import save_state

    finish(spec, accuracies, rounds_evaluated=[5 * (i + 1) for i in range(len(accuracies))])
    method = spec.labels["method"]
    save_state(spec.run_dir / "checkpoint.npz", {"global": {"a": np.zeros((D[method] - 100,)), "b": np.ones((10, 10))}})
    lines = [json.loads(x) for x in (spec.run_dir / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        line["client_bytes_up"] = dict(zip(("3", "7"), UP[method]))
    (spec.run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if spec.config.privacy.mode != "none":
        summary = json.loads((spec.run_dir / "summary.json").read_text())
        summary["privacy"] = {"epsilon": spec.labels["epsilon"], "delta": 100**-1.1, "noise_multiplier": z}
        (spec.run_dir / "summary.json").write_text(json.dumps(summary))


def test_each_epsilon_runs_the_table_at_its_swept_clip_and_the_report_gives_the_cost(suite, tmp_path):
    out = tmp_path / "out"
    plan, _, _ = suite.build([1, 2, 3], 0, False, out)
    sweep = {(s.labels["method"], s.labels["epsilon"], s.labels["clip"]): s for s in suite.sweep_runs(plan)}
    # epsilon 3: clip 0.3 has the best last-2 mean (0.70); clip 1 the best single (final) point
    for clip, accs in {
        0.01: [0.5, 0.5, 0.5],
        0.03: [0.5, 0.65, 0.65],
        0.1: [0.5, 0.6, 0.6],
        0.3: [0.5, 0.7, 0.7],
        1.0: [0.5, 0.5, 0.85],
        3.0: [0.6, 0.5, 0.5],
    }.items():
        _finish(sweep[("fedit", 3.0, clip)], accs)
    for clip in suite.CLIP_GRID[:-1]:  # epsilon 8: one sweep run unfinished
        _finish(sweep[("fedit", 8.0, clip)], [0.7, 0.7])
    # FSLoRA at epsilon 8: clip 1 best (0.65), its sweep complete although FedIT's epsilon 8 is not
    for clip, acc in zip(suite.CLIP_GRID, (0.5, 0.52, 0.55, 0.6, 0.65, 0.5)):
        _finish(sweep[("fslora", 8.0, clip)], [0.5, acc, acc])
    plan, choices, waiting = suite.build([1, 2, 3], 0, False, out)
    assert choices[("fedit", 3.0)].setting == {"clip": 0.3} and choices[("fedit", 3.0)].score == pytest.approx(0.7)
    assert choices[("fslora", 8.0)].setting == {"clip": 1.0}
    assert waiting == [("fedit", 1.0), ("fedit", 8.0)]
    table = plan["table"]
    assert sorted((s.labels["epsilon"], s.labels["seed"]) for s in table) == sorted(
        [(3.0, seed) for seed in (1, 2, 3)] + [(math.inf, seed) for seed in (1, 2, 3)]
    )
    for spec in table:
        if spec.labels["epsilon"] == 3.0:
            assert spec.config.privacy.clip == 0.3 and spec.config.seed == spec.labels["seed"]
    assert sorted(s.name for s in plan["fslora-table"]) == sorted(
        [f"fslora-eps8-clip1-s{seed}" for seed in (1, 2, 3)] + [f"fslora-epsinf-s{seed}" for seed in (1, 2, 3)]
    )
    assert all(s.config.method == "fslora" and s.config.privacy.clip in (None, 1.0) for s in plan["fslora-table"])
    # the table: no DP 80, 82, 84 (%); epsilon 3: 60, 70, 68 (each run's mean of its last 2 evaluations)
    runs = {(s.labels["method"], s.labels["epsilon"], s.labels["seed"]): s for s in suite.table_runs(plan)}
    for seed, (a, b) in zip((1, 2, 3), ((0.80, 0.80), (0.80, 0.84), (0.84, 0.84))):
        _finish(runs[("fedit", math.inf, seed)], [0.5, a, b])
    for seed, (a, b) in zip((1, 2, 3), ((0.60, 0.60), (0.70, 0.70), (0.66, 0.70))):
        _finish(runs[("fedit", 3.0, seed)], [0.5, a, b], z=3.5)
    # FSLoRA: no DP 76, 78, 80; epsilon 8: 50, 52, 54 (its cost against its own no-DP mean, 78)
    for seed, acc in zip((1, 2, 3), (0.76, 0.78, 0.80)):
        _finish(runs[("fslora", math.inf, seed)], [0.5, acc, acc])
    for seed, acc in zip((1, 2, 3), (0.50, 0.52, 0.54)):
        _finish(runs[("fslora", 8.0, seed)], [0.5, acc, acc], z=1.25)
    written = suite.report(plan, choices, out, "python benchmarks/privacy/run_suite.py")
    assert all(p.exists() for p in written)
    table_rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["method"], r["epsilon"]) for r in table_rows] == [
        ("fedit", None),
        ("fslora", None),
        ("fedit", 1.0),
        ("fedit", 3.0),
        ("fedit", 8.0),
        ("fslora", 8.0),
    ]
    rows = {(r["method"], r["epsilon"]): r for r in table_rows}
    no_dp, eps3 = rows[("fedit", None)], rows[("fedit", 3.0)]
    assert no_dp["accuracy_mean"] == pytest.approx(np.mean([80, 82, 84]))
    assert eps3["accuracy_mean"] == pytest.approx(np.mean([60, 70, 68]))
    assert eps3["accuracy_std"] == pytest.approx(np.std([60, 70, 68], ddof=1))
    assert eps3["cost_points"] == pytest.approx(82 - 66) and eps3["clip"] == 0.3
    assert eps3["noise_multiplier"] == 3.5 and eps3["delta"] == pytest.approx(100**-1.1)
    assert rows[("fedit", 1.0)]["accuracy_mean"] is None and rows[("fedit", 1.0)]["clip"] is None
    fslora8 = rows[("fslora", 8.0)]
    assert fslora8["cost_points"] == pytest.approx(78 - 52) and fslora8["clip"] == 1.0
    # noise / C = z sqrt(d) / m: 3.5 sqrt(400) / 10 = 7; 1.25 sqrt(900) / 10 = 3.75; d up = bytes / 4
    assert (eps3["d_noised"], eps3["noise_to_clip"], eps3["d_up_floats"]) == (400, pytest.approx(7.0), 402)
    assert (fslora8["d_noised"], fslora8["noise_to_clip"], fslora8["d_up_floats"]) == (900, pytest.approx(3.75), 250)
    assert no_dp["noise_to_clip"] is None and no_dp["d_noised"] == 400
    text = (out / "README.md").read_text()
    assert "| FedIT | 3 | 0.0063 | 0.3 | 3.500 | 400 | 402 | 7.0 | 66.00 ± 5.29 (n=3) | 16.00 |" in text
    assert "| FSLoRA | 8 | 0.0063 | 1 | 1.250 | 900 | 250 | 3.8 | 52.00 ± 2.00 (n=3) | 26.00 |" in text
    assert "| FSLoRA | 8 | 50.00 | 52.00 | 55.00 | 60.00 | 65.00 | 50.00 |" in text  # its clip sweep


def test_noise_to_clip_is_the_norm_of_the_central_noise_on_the_average_over_the_clip(suite, tiny_config):
    """z sqrt(d) / m against the real mechanism (central): 10 updates of norm
    5C in one direction are clipped to C each, so their average is C u exactly; what remains of the
    aggregate is the noise xi / m, whose norm over C must be z sqrt(d) / m (relative std of the norm
    1/sqrt(2d) = 0.5 % at d = 20,000: 3 % is 6 std)."""
    from fedtune.methods.base.privacy import mechanism

    assert suite.noise_to_clip(1.0, 74_498, 10) == pytest.approx(27.2943, abs=1e-4)  # by hand: 272.943 / 10
    z, C, d, m = 2.0, 0.5, 20_000, 10
    config = tiny_config(
        "federation.num_clients=100",
        f"federation.clients_per_round={m}",
        'privacy.mode="central"',
        f"privacy.clip={C}",
        f"privacy.noise_multiplier={z}",
        'options.weighting="uniform"',
    )
    u = np.random.default_rng(0).normal(size=d)
    u /= np.linalg.norm(u)
    updates = [{"x": 5 * C * u} for _ in range(m)]
    average = mechanism(config).aggregate(updates, 3, {"x": u})["x"].astype(np.float64)
    noise = np.linalg.norm(average - C * u) / C
    assert noise == pytest.approx(suite.noise_to_clip(z, d, m), rel=0.03)  # 2 sqrt(20,000) / 10 = 28.3


def test_a_plain_command_plans_fedits_part_only_and_secagg_is_its_own_stage(suite, tmp_path, capsys):
    assert suite.main(["--plan", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "sweep: 18 runs" in text and "table: 3 runs" in text
    assert "fslora" not in text and "secagg" not in text
    assert suite.main(["--plan", "--out", str(tmp_path), "--only", "fslora-sweep,fslora-table,secagg"]) == 0
    text = capsys.readouterr().out
    assert "fslora-sweep: 6 runs" in text and "fslora-table: 3 runs" in text and "secagg: 2 runs" in text
    assert "  sweep:" not in text


def test_the_secagg_stage_runs_one_round_of_the_suites_fedit_on_flower_with_and_without_secagg(suite, tmp_path):
    from fedtune.runtime import resolve_run

    plain, secure = suite.secagg_specs(False, tmp_path)
    fedit = suite.build([1], 0, False, tmp_path)[0]["table"][0].config  # the suite's FedIT without DP
    for spec in (plain, secure):
        c = resolve_run(spec.config).config
        assert (c.engine, c.rounds, c.federation.num_clients, c.federation.sample_size()) == ("flower-sim", 1, 10, 10)
        assert (c.method, c.model, c.train, c.privacy.mode) == ("fedit", fedit.model, fedit.train, "none")
        assert c.data.max_train_samples == 200 * 10 and c.options == fedit.options
    assert (plain.config.secure_aggregation.enabled, secure.config.secure_aggregation.enabled) == (False, True)
    assert plain.run_dir == tmp_path / "runs" / "secagg" / "plain"


def test_secagg_json_gives_each_ways_mb_per_client_their_ratio_and_the_adapters_distance(suite, tmp_path):
    from fedtune.checkpoint import save_state

    specs = suite.secagg_specs(False, tmp_path)
    assert suite.secagg_result(specs, "cmd") is None  # unfinished
    # plain: 3 clients up 100, 200, 300 kB (mean 0.2 MB), down 0.3 MB; SecAgg+ up 0.5 MB, down 0.45 MB
    ups = {"plain": (100_000, 200_000, 300_000), "secagg": (500_000, 400_000, 600_000)}
    downs = {"plain": (300_000,) * 3, "secagg": (450_000,) * 3}
    adapters = {"plain": np.zeros((4, 5)), "secagg": np.full((4, 5), 1e-6)}
    for spec in specs:
        finish(spec, [0.5])
        line = json.loads((spec.run_dir / "metrics.jsonl").read_text())
        line["client_bytes_up"] = dict(zip("123", ups[spec.name]))
        line["client_bytes_down"] = dict(zip("123", downs[spec.name]))
        (spec.run_dir / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        save_state(spec.run_dir / "checkpoint.npz", {"global": {"w": adapters[spec.name]}})
    result = suite.secagg_result(specs, "cmd")
    assert result["plain"]["mb_up_per_client"] == pytest.approx(0.2)
    assert result["secagg"]["mb_up_per_client"] == pytest.approx(0.5)
    assert (result["ratio_up"], result["ratio_down"]) == (pytest.approx(2.5), pytest.approx(1.5))
    assert result["max_abs_difference"] == pytest.approx(1e-6) and result["adapter_coordinates"] == 20
    assert result["quantization_bound"] == pytest.approx(2 * 8.0 / 2**22)
    assert result["secagg_options"]["num_shares"] == 10
    (tmp_path / "secagg.json").write_text(json.dumps(result))
    text = "\n".join(suite.secagg_lines(tmp_path))
    assert "| SecAgg+ | 0.5000 | 0.4500 |" in text and "2.50x up, 1.50x down" in text
    assert suite.secagg_lines(tmp_path / "none") == []


def test_d_without_a_checkpoint_counts_the_global_arrays_the_config_builds(suite, tiny_config):
    """tiny-bert (2 layers, hidden 32), FedIT at rank 4 on query and value, tweets' 3 classes: d = 2
    layers x 2 modules x (4 x 32 + 32 x 4) + the head (32 x 3 + 3) = 1,123."""
    config = tiny_config("model.lora_rank=4", 'model.target_modules=["query", "value"]')
    spec = harness.RunSpec("x", [], config=config, run_dir=Path(config.output_dir) / "x")
    assert suite.noised_coordinates(spec) is None
    assert suite.noised_coordinates(spec, from_config=True) == 2 * 2 * (4 * 32 + 32 * 4) + 32 * 3 + 3
