"""Experiment trackers (``[logging] to``): what each store holds, read back with its own library's
reader (tests/trackers_read.py), on a real run: every round, the config, the summary, the plan;
under DP only the mechanism's release; resume logs no step twice; a missing package is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.engines.record import RoundRecord
from fedtune.run import run_experiment
from tests import trackers_read
from tests.conftest import TINY, one_line_config_error, tiny
from tests.test_privacy_adversary import SUMMARY_KEYS

ALL = 'logging.to=["tensorboard", "mlflow", "wandb"]'
runner = CliRunner()


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    """No W&B key or mode from the environment: ``wandb_mode = "auto"`` runs offline."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stores(run_dir: Path, uri: str | None = None) -> dict[str, trackers_read.Store]:
    uri = uri or f"sqlite:///{run_dir / 'mlflow.db'}"
    return {
        "tensorboard": trackers_read.tensorboard(run_dir),
        "mlflow": trackers_read.mlflow(uri)[run_dir.name],
        "wandb": trackers_read.wandb_offline(run_dir),
    }


def test_every_tracker_holds_each_round_once_the_config_and_summary_and_resume_logs_no_step_twice(tiny_config):
    """A 2-round run with all three trackers, then ``fedtune run --resume`` to 3 rounds after a
    simulated crash between TensorBoard's and MLflow's writes of round 2 and ``trackers.json``'s
    (it says round 1 for both): each store holds rounds 1, 2, 3 once each with metrics.jsonl's accuracy, a
    per-client figure (the control of the DP test below), the config and the summary; MLflow
    keeps the adapter and the report files, never the checkpoint."""
    run_dir = Path(run_experiment(tiny_config(ALL, "name=tracked"))["run_dir"])
    state = json.loads((run_dir / "trackers.json").read_text())
    assert {name: entry["logged"] for name, entry in state.items()} == {"tensorboard": 2, "mlflow": 2, "wandb": 2}
    for name in ("tensorboard", "mlflow"):  # round 2 in the stores, not in trackers.json, when the process died
        state[name]["logged"] = 1
    state["tensorboard"]["state"]["next"] = 2
    (run_dir / "trackers.json").write_text(json.dumps(state))

    result = runner.invoke(app, ["run", "--resume", str(run_dir), "--set", "rounds=3"])
    assert result.exit_code == 0, result.output

    lines = _lines(run_dir)
    accuracy = {line["round"]: line["accuracy"] for line in lines}
    summary = json.loads((run_dir / "summary.json").read_text())
    for name, store in _stores(run_dir).items():
        assert store.steps("accuracy") == [1, 2, 3], name  # each round once, in order
        assert store.values("accuracy") == pytest.approx(accuracy, abs=1e-6), name
        assert store.steps("client_bytes_up/0") == [1, 2, 3], name
        assert store.config["method"] == "fedit" and store.config["model.name"] == "tiny-bert", name
        assert float(store.config["data.max_train_samples"]) == 200, name
        final = store.summary.get("summary/final_accuracy") or store.metrics["summary/final_accuracy"][-1][1]
        assert final == pytest.approx(summary["final_accuracy"], abs=1e-6), name
    tb = trackers_read.tensorboard(run_dir)
    assert 'method = "fedit"' in tb.texts["config"] and '"final_accuracy"' in tb.texts["summary"]
    artifacts = _stores(run_dir)["mlflow"].artifacts
    assert {"model/adapter/adapter_model.safetensors", "report/summary.json", "report/metrics.jsonl"} <= set(artifacts)
    assert not [a for a in artifacts if "checkpoint" in a]


def test_a_dp_runs_trackers_hold_only_the_released_line_and_the_public_plan(tmp_path, monkeypatch):
    """Under DP each tracker stores the numbers of the metrics.jsonl line and nothing else per
    round: the line is the one record the run wrote (a marker added to it reaches every store, so
    the trackers do not re-derive it from the round), and no store holds a per-client field
    (bytes, steps, peaks, drops, the sample): the control is the test above, whose stores hold
    ``client_bytes_up/0``. The plan (made from the config) is logged; MLflow's artifacts hold no
    checkpoint (the mechanism's secret) and no label histograms. MLflow here is a folder store."""
    to_json = RoundRecord.to_json
    monkeypatch.setattr(RoundRecord, "to_json", lambda self: {**to_json(self), "released_marker": 7.0})
    budgets = "federation.profiles=[{memory_gib=8},{memory_gib=8},{memory_gib=8},{memory_gib=8}]"
    dp = ['privacy.mode="central"', "privacy.clip=1.0", "privacy.noise_multiplier=1.0"]
    folder = tmp_path / "mlruns"
    config = tiny(
        tmp_path, "fedit", "text-classification", "federation.num_clients=4", "name=dp", ALL, *dp, budgets,
        f"logging.mlflow_uri={json.dumps(str(folder))}",
    )  # fmt: skip
    run_dir = Path(run_experiment(config)["run_dir"])
    lines = _lines(run_dir)
    released = {k for line in lines for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert released == {"round", "accuracy", "loss", "epsilon", "released_marker"}
    for name, store in _stores(run_dir, folder.as_uri()).items():
        per_round = {k for k in store.metrics if not k.startswith(("summary/", "plan/"))}
        assert per_round == released - {"round"}, name
        assert store.steps("released_marker") == [1, 2], name
        everything = set(store.metrics) | set(store.summary)
        summary = {k.split("/")[1] for k in everything if k.startswith("summary/")}
        assert summary <= SUMMARY_KEYS and "final_accuracy" in summary, name  # no totals of bytes or time
        assert {f"plan/client_{c}/peak_bytes" for c in range(4)} <= everything, name
    artifacts = _stores(run_dir, folder.as_uri())["mlflow"].artifacts
    assert "report/metrics.jsonl" in artifacts and not [a for a in artifacts if "checkpoint" in a or "label" in a]


def test_a_missing_tracker_package_is_one_line_and_nothing_is_written(tmp_path, monkeypatch):
    """``logging.to`` naming a tracker whose package is not installed stops ``fedtune run`` with
    exit 2 and one line naming the extra, before the run folder exists."""
    import fedtune.tracking

    monkeypatch.setitem(fedtune.tracking.PACKAGES, "wandb", ("fedtune_no_such_package", "wandb"))
    sets = [f"--set={x}" for x in TINY] + [f"--set=output_dir={tmp_path}", '--set=logging.to=["wandb"]']
    result = runner.invoke(app, ["run", *sets])
    assert result.exit_code == 2, result.output
    assert result.output.strip().count("\n") == 0 and "fedtune[tracking]" in result.output
    assert not list(tmp_path.iterdir())


def test_logging_keys_are_checked():
    from fedtune.config import load_config

    assert "logging.to" in one_line_config_error(lambda: load_config(None, ['logging.to=["comet"]']))
    assert "named twice" in one_line_config_error(lambda: load_config(None, ['logging.to=["wandb", "wandb"]']))


class Broken:
    """A tracker that fails on its first round."""

    name = "tensorboard"

    def __init__(self, config, run_dir, state):
        pass

    def state(self):
        return {}

    def start(self, params, config_text):
        pass

    def log(self, step, values):
        raise OSError("the disk is full")


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_run_goes_on(tiny_config, monkeypatch, caplog):
    import fedtune.tracking

    monkeypatch.setitem(fedtune.tracking.TRACKERS, "tensorboard", "tests.test_tracking:Broken")
    summary = run_experiment(tiny_config('logging.to=["tensorboard"]'))
    assert [line["round"] for line in _lines(Path(summary["run_dir"]))] == [1, 2]
    assert "logging.to tensorboard: round 1 failed (OSError: the disk is full)" in caplog.text
