"""What can be decided before training is decided before the run folder is claimed: a budget on a
method without a planner, a budget plan that leaves no round able to aggregate, a privacy budget
that would stop the run before round 1 are one line and exit 2, with no folder left (so the
corrected command is never refused as "holds an earlier run"), on every engine. A bool or a string
where a number is expected is refused anywhere in the config. A run killed before its first round
completed: --resume and a fresh run agree that --overwrite is the way."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.config import ConfigError, RunConfig, load_config
from fedtune.launch import launch
from tests.conftest import TINY, output_lines

runner = CliRunner()

#: case -> (overrides, what the one line says)
BEFORE_TRAINING = {
    "budget without a planner": (
        ["method=fedavg", "federation.profiles=[{memory_gib=4}]"],
        "method 'fedavg' has no planner",
    ),
    "memory excludes every client": (["federation.profiles=[{memory_gib=0.0001}]"], "excludes 4 of 4 clients"),
    "bandwidth excludes every client": (["federation.profiles=[{bandwidth_mb=1e-9}]"], "excludes 4 of 4 clients"),
    "deadline excludes every client": (["federation.profiles=[{deadline_s=1e-9}]"], "excludes 4 of 4 clients"),
    "too few left for min_replies": (
        [
            "federation.profiles=[{memory_gib=0.0001}, {}, {memory_gib=0.0001}, {memory_gib=0.0001}]",
            "federation.min_replies=2",
        ],
        "excludes 3 of 4 clients, leaving 1 (federation.min_replies = 2)",
    ),
    "privacy budget below one round": (
        ["privacy.mode=central", "privacy.clip=1", "privacy.noise_multiplier=0.5", "privacy.epsilon_budget=0.01"],
        "privacy.epsilon_budget: 0.01 is below the epsilon of one round",
    ),
}


@pytest.mark.parametrize("case", list(BEFORE_TRAINING))
def test_a_run_that_cannot_train_is_refused_before_its_folder_exists(tmp_path, case):
    sets, expected = BEFORE_TRAINING[case]
    out = tmp_path / "runs"
    args = [a for s in [*TINY, f"output_dir={out}", "rounds=1", *sets] for a in ("--set", s)]
    result = runner.invoke(app, ["run", *args])
    lines = output_lines(result.output)
    assert result.exit_code == 2 and len(lines) == 1 and expected in lines[-1], result.output
    assert not out.exists()  # no folder: the corrected command is not "an earlier run"


@pytest.mark.parametrize("engine", ["flower-sim", "flower"])
def test_on_flower_the_plan_is_refused_before_any_process_starts_or_folder_exists(tmp_path, engine, monkeypatch):
    """The Flower launchers check the plan before they claim the folder (and before an earlier run
    would be moved aside by --overwrite); the engine itself is never reached."""
    from fedtune.engines.flower import deployment, simulation

    def never(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr(simulation, "run_flower_simulation", never)
    monkeypatch.setattr(deployment, "run_flower_deployment", never)
    out = tmp_path / "runs"
    earlier = out / "fedit-tweets-s0"
    earlier.mkdir(parents=True)
    (earlier / "config.toml").write_text("an earlier run")
    config = load_config(
        None, [*TINY, f"output_dir={out}", f"engine={engine}", *BEFORE_TRAINING["memory excludes every client"][0]]
    )
    with pytest.raises(ConfigError, match="excludes 4 of 4 clients"):
        launch(config, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["fedit-tweets-s0"]  # not moved aside
    assert (earlier / "config.toml").read_text() == "an earlier run"


# -- a bool or a string is not a number, anywhere in the config ----------------------------------
def _numeric_fields(model: type[BaseModel], prefix: str = ""):
    """(dotted key, annotation) of every int or float field of ``model``, nested sections included."""
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _numeric_fields(ann, f"{prefix}{name}.")
        elif ann in (int, float, int | None, float | None):
            yield f"{prefix}{name}"


@pytest.mark.parametrize("value", ["true", '"1"'])
def test_a_bool_or_a_string_where_a_number_is_expected_is_refused_everywhere(value):
    """Every numeric key of the config, of a client profile (a list, drawn choices, device classes)
    and of every method's and task kind's options: ``true`` is not 1 and ``"1"`` is not 1
    (pydantic's lax mode took both), one line naming the key."""
    from fedtune.config import parse_value, validate_options
    from fedtune.methods import list_methods
    from fedtune.protocol.profiles import ClientProfile
    from fedtune.tasks import list_tasks

    assignments = [f"{key}={value}" for key in _numeric_fields(RunConfig)]
    assignments += [f"federation.profiles=[{{{key}={value}}}]" for key in _numeric_fields(ClientProfile)]
    assignments += [f"federation.profile_choices={{{key}=[{value}]}}" for key in _numeric_fields(ClientProfile)]
    assignments += [f"federation.device_classes=[{{name='a', share=1, speed={value}}}]"]
    for assignment in assignments:
        with pytest.raises(ConfigError) as refused:
            load_config(None, [assignment])
        line = str(refused.value)
        assert "\n" not in line and ("number" in line or "integer" in line), (assignment, line)
    options = [(spec.options, key, "options.") for spec in list_methods() for key in _numeric_fields(spec.options)]
    options += [(cls.Options, key, "task.") for cls in list_tasks() for key in _numeric_fields(cls.Options)]
    for cls, key, prefix in options:  # what resolve_run validates a method's and a task's options with
        with pytest.raises(ConfigError, match=f"^{prefix}{key}: Input should be a valid (number|integer)"):
            validate_options({key: parse_value(value)}, cls, prefix.rstrip("."))
    assert len(assignments) + len(options) > 80
    adam = ["server.optimizer=adam", "server.lr=0.1", "server.betas=[0.9, 0.99]"]
    assert load_config(None, ["train.lr=1", *adam]).train.lr == 1.0  # an int is a number; a list of two betas


# -- a run killed before its first round completed ------------------------------------------------
def test_a_folder_with_no_completed_round_names_overwrite_on_resume_and_on_a_fresh_run(tmp_path, monkeypatch):
    """The folder a run killed before round 1 leaves (config.toml, run_config.json, histograms, an
    empty metrics.jsonl, no checkpoint): --resume and the fresh run both say --overwrite, and
    --overwrite runs (before: --resume said "run it again without --resume", which was refused)."""
    from fedtune.engines.embedded import EmbeddedEngine

    out = tmp_path / "runs"
    args = [a for s in [*TINY, f"output_dir={out}", "rounds=1"] for a in ("--set", s)]

    def killed(self, *a, **kw):
        raise KeyboardInterrupt  # the kill, after the folder's first files

    with monkeypatch.context() as patch:
        patch.setattr(EmbeddedEngine, "run", killed)
        with pytest.raises(KeyboardInterrupt):
            from fedtune.run import run_experiment

            run_experiment(load_config(None, [*TINY, f"output_dir={out}", "rounds=1"]))
    run_dir = out / "fedit-tweets-s0"
    assert (run_dir / "config.toml").is_file() and not (run_dir / "checkpoint.npz").exists()
    resumed = runner.invoke(app, ["run", "--resume", str(run_dir)])
    fresh = runner.invoke(app, ["run", *args])
    for result in (resumed, fresh):
        line = result.output.strip()
        assert result.exit_code == 2 and "\n" not in line, result.output
        assert "no round" in line and "--overwrite" in line and "continue it with --resume" not in line, line
    overwritten = runner.invoke(app, ["run", *args, "--overwrite"])
    assert overwritten.exit_code == 0, overwritten.output
    assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (out / "fedit-tweets-s0.old-1" / "config.toml").is_file()
