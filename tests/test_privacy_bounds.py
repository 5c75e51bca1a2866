"""What bounds a DP run beyond its mechanism: the server's bound on a local-DP upload (a hostile
x1000 or x1e30 upload is dropped), a public plan.json priced from public shapes only, the operator
told (on stderr, never in the run folder) when no client contributed, and the privacy settings
that guarantee nothing refused in one line, nothing written. Each test has a control that shows it
can fail."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedtune.checkpoint import load_state
from fedtune.cli import app
from fedtune.methods.base.privacy import LocalGaussian
from fedtune.run import run_experiment
from fedtune.runtime import resolve_run
from tests.conftest import TINY, one_line_config_error, tiny
from tests.test_privacy_resume import text_data

KIND = "text-classification"
C, Z = 0.05, 0.8
LOCAL = ['privacy.mode="local"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
CENTRAL = ['privacy.mode="central"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
SAME_NOISE = "privacy.insecure_reproducible_noise=true"
EVERY = "federation.clients_per_round=3"  # q = 1: every client is asked every round


def _global(run_dir: Path) -> dict[str, np.ndarray]:
    return load_state(run_dir / "checkpoint.npz")["global"]


def _run(tmp_path: Path, name: str, *extra: str, seen: list | None = None) -> Path:
    config = tiny(tmp_path, "fedit", KIND, EVERY, "rounds=1", f"name={name}", *extra)
    summary = run_experiment(config, on_round=None if seen is None else seen.append)
    return Path(summary["run_dir"])


def test_a_hostile_local_dp_upload_is_dropped_as_a_failed_client_would_be(tmp_path, capsys, monkeypatch):
    """Local DP, client 0 scales its noised upload x1000 and client 1 x1e30 (profile attack =
    "scale"): the server drops both (the reason in the private record, a note on stderr, nothing in
    the run folder), never honest client 2, and the state is bit-identical to the one where clients
    0 and 1 failed (a dropped upload is a zero update). Control: without the bound the x1000
    upload lands (the state moves far from the failed-clients one)."""
    failed = _global(
        _run(tmp_path, "failed", *LOCAL, SAME_NOISE, "federation.profiles=[" + "{failure_prob=1.0}," * 2 + "{}]")
    )
    attack = 'federation.profiles=[{attack="scale",attack_scale=1000},{attack="scale",attack_scale=1e30},{}]'
    seen: list = []
    run_dir = _run(tmp_path, "attacked", *LOCAL, SAME_NOISE, attack, seen=seen)
    assert sorted(seen[0].dropped) == [0, 1]
    assert all(why.startswith("update norm") and "(local DP)" in why for why in seen[0].dropped.values())
    err = capsys.readouterr().err
    assert "round 1: client 0's upload dropped: update norm" in err and "client 1's upload dropped" in err
    assert "update norm" not in "".join(p.read_text() for p in run_dir.glob("*.json*"))
    for k, v in _global(run_dir).items():
        np.testing.assert_array_equal(v, failed[k], err_msg=k)

    monkeypatch.setattr(LocalGaussian, "upload_bound", staticmethod(lambda params, d: float("inf")))
    landed = _global(
        _run(tmp_path, "landed", *LOCAL, SAME_NOISE, 'federation.profiles=[{attack="scale",attack_scale=1000},{},{}]')
    )
    moved = sum(float(np.sum((landed[k].astype(np.float64) - failed[k]) ** 2)) for k in failed)
    assert moved > 1e3


def _public(run_dir: Path) -> dict:
    """A DP run folder's public files less the mechanism's outputs (the state, its evaluation) and
    the run's name: config, plan.json byte for byte, each line's round and epsilon, the summary."""
    skip = {"accuracy", "loss", "final_accuracy", "best_accuracy", "final_loss", "name", "run_dir", "environment"}
    config = [x for x in (run_dir / "config.toml").read_text().splitlines() if not x.startswith("name = ")]
    read = json.loads((run_dir / "run_config.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    files = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}
    return {
        "files": sorted(f for f in files if not f.startswith("adapter/")),
        "config": config,
        "run_config": {k: v for k, v in read.items() if k != "name"},
        "plan": (run_dir / "plan.json").read_bytes(),
        "lines": [{k: v for k, v in x.items() if k not in skip} for x in lines],
        "summary": {k: v for k, v in summary.items() if k not in skip},
    }


def test_two_budgeted_dp_runs_differing_in_one_training_row_write_the_same_public_files(tmp_path):
    """Two central-DP runs with memory budgets (client 2's fits no setting) whose data differ in one
    training row only, 4 words or 60 (the longest row: what the planner prices without DP): every
    public file is the same apart from the mechanism's outputs, plan.json byte for byte (priced
    at data.max_length), its exclusion reason included. Control: the same pair without DP writes
    two different plan.json (each client's predicted peak follows the longest row)."""
    budgets = "federation.profiles=[{memory_gib=8},{memory_gib=8},{memory_gib=1e-6}]"
    long_row = " ".join(["word"] * 60)

    def pair(name: str, *extra: str) -> tuple[Path, Path]:
        runs = []
        for i, row in enumerate(("four words row here", long_row)):
            data = text_data(tmp_path / "data", last_row=row)
            runs.append(_run(tmp_path, f"{name}-{i}", *data, budgets, *extra))
        return runs[0], runs[1]

    short, long = pair("dp", *CENTRAL)
    assert "excluded by the plan" in json.loads((short / "plan.json").read_text())["clients"][2]["excluded"]
    assert _public(short) == _public(long)
    plain_short, plain_long = pair("plain")
    assert (plain_short / "plan.json").read_bytes() != (plain_long / "plan.json").read_bytes()


def test_a_dp_run_no_client_contributed_to_says_so_on_stderr_only(tmp_path, capsys):
    """Every client fails every round: the run ends (its releases are noise alone) and stderr says
    that no client's update reached the aggregate; no file of the run folder says it. A budget
    nobody fits is refused before anything is written. Control: an honest DP run warns of nothing."""
    failing = "federation.profiles=[{failure_prob=1.0},{failure_prob=1.0},{failure_prob=1.0}]"
    run_dir = _run(tmp_path, "failing", *CENTRAL, failing)
    err = capsys.readouterr().err
    assert "warning: no client's update reached this DP run's aggregate in its 1 round(s) here" in err
    assert "noise alone" not in "".join(p.read_text() for p in run_dir.glob("*.json*"))
    _run(tmp_path, "honest", *CENTRAL)
    assert "warning" not in capsys.readouterr().err

    nobody = "federation.profiles=[{memory_gib=1e-6},{memory_gib=1e-6},{memory_gib=1e-6}]"
    config = tiny(tmp_path, "fedit", KIND, *CENTRAL, nobody, "name=nobody")
    message = one_line_config_error(lambda: run_experiment(config))
    assert message.startswith("federation: the budget plan excludes 3 of 3 clients")
    assert not (tmp_path / "nobody").exists()


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["privacy.delta=0.5"], "privacy.delta: 0.5 is not below 1/num_clients = 0.25"),
        (["privacy.delta=0.25"], "privacy.delta: 0.25 is not below 1/num_clients = 0.25"),
        (["privacy.noise_multiplier=1e-12"], "privacy.noise_multiplier"),
        (["robust.max_update_ratio=10"], "robust.max_update_ratio: not with privacy.mode"),
    ],
)
def test_a_privacy_setting_that_guarantees_nothing_is_one_line_exit_2_nothing_written(tmp_path, extra, key):
    """The CLI refuses a vacuous delta (at least 1/N), a noise multiplier dp-accounting cannot
    price (1e-12 failed in round 1 inside it and left a folder), and an outsized-update screen that
    DP would silently ignore; one line, exit 2, no run folder. Control: delta 0.2 < 1/4 and the
    screen without DP resolve."""
    sets = [*TINY, *CENTRAL, *extra, f"output_dir={tmp_path}", "name=refused"]
    result = CliRunner().invoke(app, ["run", *sum((["--set", s] for s in sets), [])])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], result.output
    assert not (tmp_path / "refused").exists()
    resolve_run(tiny(tmp_path, "fedit", KIND, *CENTRAL, "federation.num_clients=4", "privacy.delta=0.2"))
    resolve_run(tiny(tmp_path, "fedit", KIND, "robust.max_update_ratio=10"))
