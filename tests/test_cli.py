"""The command line: methods, run (including its errors), report."""

import json
import os

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from tests.conftest import TINY

runner = CliRunner()


def test_methods_lists_one_line_per_method():
    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0
    names = [line.split()[0] for line in result.output.strip().splitlines()]
    assert {"fedit", "local"} <= set(names)


def test_methods_verbose_prints_each_methods_deviations_and_none_for_one_without():
    """``MethodOptions.deviations`` is every options class's (empty unless a method states some)."""
    result = runner.invoke(app, ["methods", "--verbose"])
    assert result.exit_code == 0, result.output
    per_method: dict[str, list[str]] = {}
    for line in result.output.splitlines():
        if line and not line.startswith(" "):
            lines = per_method.setdefault(line.split()[0], [])
        elif "deviation:" in line:
            lines.append(line)
    assert {"fslora", "local"} <= set(per_method)
    assert per_method["fslora"] and per_method["local"] == []


def test_invalid_value_exits_2_with_one_line_naming_the_key():
    result = runner.invoke(app, ["run", "--set", "data.alpha=0"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "data.alpha" in lines[0] and "Traceback" not in result.output


def test_missing_dataset_names_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = runner.invoke(
        app,
        ["run", "--set", "data=sst2", "--set", f"data.data_dir={tmp_path}", *sum((["--set", t] for t in TINY[2:]), [])],
    )
    assert result.exit_code == 2
    assert str(tmp_path) in result.output and "stanfordnlp/sst2" in result.output


def test_run_then_report(tmp_path):
    sets = sum((["--set", t] for t in TINY), []) + ["--set", f"output_dir={tmp_path}", "--set", "name=cli"]
    result = runner.invoke(app, ["run", *sets])
    assert result.exit_code == 0, result.output
    assert "round   2/2" in result.output and "majority-class rate" in result.output
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["rounds"] == 2
    report = runner.invoke(app, ["report", str(tmp_path / "cli"), "--out", str(tmp_path / "rep")])
    assert report.exit_code == 0 and "| cli |" in report.output
    assert (tmp_path / "rep" / "accuracy_vs_mb_up.png").exists()


def test_every_engine_a_config_may_name_has_a_launcher(monkeypatch):
    """fedtune.launch.ENGINES covers RunConfig.engine's choices, and launch() calls the named one
    with the resolved run and the run's callbacks (the CLI's one entry point)."""
    from typing import get_args

    from fedtune import launch as launch_module
    from fedtune.config import RunConfig, load_config

    assert set(launch_module.ENGINES) == set(get_args(RunConfig.model_fields["engine"].annotation))
    seen = []
    for engine in launch_module.ENGINES:
        monkeypatch.setitem(launch_module.ENGINES, engine, lambda run, **kw: seen.append((run.config.engine, kw)) or {})
        launch_module.launch(load_config(None, [f'engine="{engine}"']), on_round=print, resume=True)
    expected = {"on_round": print, "on_start": None, "resume": True, "overwrite": False}
    assert seen == [(e, expected) for e in launch_module.ENGINES]


def test_an_unexpected_error_is_one_line_and_short_frames_with_no_locals_and_no_secrets(tmp_path):
    """A bug (here: open_run raising) while a local holds a Hugging Face token and HF_TOKEN is in
    the message: one line naming the error, then at most a few frames; neither token, nor any local
    variable, is printed; exit 1. (Typer's default printed every local, the token included.)"""
    import subprocess
    import sys

    script = """
import sys
import fedtune.trained.loader as loader

def open_run(path):
    import os
    token = "hf_LocalSecretToken123456789012345678"
    config = {"huggingface": token, "padding": "x" * 5000}
    raise RuntimeError("the hub refused " + os.environ["HF_TOKEN"])

loader.open_run = open_run
from fedtune.cli import main
sys.argv = ["fedtune", "export", "somewhere"]
main()
"""
    env = {**os.environ, "HF_TOKEN": "hf_EnvironmentToken4567890123456789012", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "hf_LocalSecretToken123456789012345678" not in out and "hf_EnvironmentToken4567890123456789012" not in out, (
        out
    )
    assert "padding" not in out and "xxxxx" not in out, out  # no locals
    lines = out.strip().splitlines()
    assert lines[0] == "error: unexpected RuntimeError: the hub refused [redacted] (a fedtune bug; its last frames:)"
    assert len(lines) <= 19 and 'File "<string>"' in out and "click" not in out, out  # six frames at most


def test_a_one_line_error_redacts_tokens_too(monkeypatch):
    """A FedtuneError whose message carries a token (a hub error quoting a request) prints it redacted."""
    from fedtune.cli import redact
    from fedtune.config import ConfigError

    monkeypatch.setenv("MY_SERVICE_TOKEN", "s3cr3t-value-42")

    def open_run(path):
        raise ConfigError("--push-to-hub me/x: 401 for hf_AbCdEf1234567890123456789012345678 and s3cr3t-value-42")

    monkeypatch.setattr("fedtune.trained.loader.open_run", open_run)
    result = runner.invoke(app, ["export", "somewhere"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --push-to-hub me/x: 401 for [redacted] and [redacted]", result.output
    assert redact("pip install hf_transfer") == "pip install hf_transfer"


def test_a_short_secret_is_redacted_where_it_stands_alone(monkeypatch):
    """``API_KEY=k3y55`` (under 6 characters: printed before) is redacted where it stands alone,
    not inside a longer word or number; a switch (``USE_AUTH_TOKEN=true``) and a value of two
    characters are not secrets, so "true" and "42" stay readable."""
    from fedtune.cli import redact

    monkeypatch.setenv("API_KEY", "k3y55")
    monkeypatch.setenv("USE_AUTH_TOKEN", "true")
    monkeypatch.setenv("DB_PASSWORD", "42")
    text = "refused k3y55 at /srv/k3y55/x (round 42: true); kept: ak3y55 k3y556"
    assert redact(text) == "refused [redacted] at /srv/[redacted]/x (round 42: true); kept: ak3y55 k3y556"


def test_plan_shows_no_library_bars_or_warnings(tmp_path, monkeypatch):
    """``fedtune plan`` of FedOT (it loads the base, a packaged pretrained model): fedtune's table
    alone, no "Loading weights" bar (before: one per load) unless --verbose."""
    from transformers.utils import logging as hf_logging

    from fedtune.process import VERBOSE_ENV

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    hf_logging.enable_progress_bar()  # as in a fresh process (another test may have quieted this one)
    hf_logging.set_verbosity_warning()
    try:
        sets = ["method=fedot", "data.max_train_samples=200", "data.max_test_samples=50", "federation.num_clients=2"]
        sets += ["federation.clients_per_round=2"]
        sets += ["federation.profiles=[{memory_gib=4}]", "options.distill_steps=1", "options.distill_samples=8"]
        result = runner.invoke(app, ["plan", "configs/fedot.toml", *[a for s in sets for a in ("--set", s)]])
        assert result.exit_code == 0, result.output
        assert "Loading weights" not in result.output and "it/s" not in result.output, result.output
        assert result.output.splitlines()[0].split()[:2] == ["client", "class"], result.output
    finally:
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def test_without_a_network_the_hub_fails_at_once_without_retry_lines(tmp_path):
    """A hub model name with no network (the hub's host does not resolve) and no HF_HUB_OFFLINE:
    fedtune's process set-up turns the hub libraries offline, so the load fails in a second with
    no retry lines (before: 5 retries over 23 s, 11 log lines, then the error)."""
    import subprocess
    import sys

    script = """
import time
from fedtune.process import setup_process
setup_process()
from fedtune.config import ConfigError
from fedtune.models.loading import load_classifier
from transformers import AutoConfig, AutoModelForSequenceClassification  # imported before the clock starts
start = time.perf_counter()
try:
    load_classifier("fedtune-tests/no-such-model", 2, 0)
except ConfigError as exc:
    print(f"{time.perf_counter() - start:.2f}", exc)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="https://hub.invalid", HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    seconds, line = done.stdout.strip().split(" ", 1)
    assert done.returncode == 0 and "Retrying" not in done.stderr, done.stderr
    assert line.startswith("model.name: cannot load 'fedtune-tests/no-such-model' (offline: hub.invalid does not"), line
    assert float(seconds) < 5, seconds  # the retries alone took 23 s


@pytest.mark.parametrize(
    ("name", "secret"),
    [("MY_API_KEY", True), ("OPENAI_KEY", True), ("hf_token", True), ("my_api_key", True), ("Db_Password", True),
     ("aws_secret_access_key", True), ("RUN_LABEL", False)],
)  # fmt: skip
def test_secret_named_variables_are_redacted_whatever_their_case(monkeypatch, name, secret):
    """A one-line error quoting the value of a variable named like a secret (``*KEY*``, ``*TOKEN*``,
    ``*SECRET*``, ``*PASSWORD*``, in any case: shells and .env files use lower case too) prints it
    redacted; an ordinary variable's value is printed as it is."""
    from fedtune.config import ConfigError

    value = "v4lue-0f-" + name.lower()
    monkeypatch.setenv(name, value)

    def open_run(path):
        raise ConfigError(f"--push-to-hub me/x: refused with {value}")

    monkeypatch.setattr("fedtune.trained.loader.open_run", open_run)
    result = runner.invoke(app, ["export", "somewhere"])
    assert result.exit_code == 2
    shown = "[redacted]" if secret else value
    assert result.output.strip() == f"error: --push-to-hub me/x: refused with {shown}", result.output
