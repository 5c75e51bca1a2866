"""The README's two commands: ``make run`` runs every time, and ``make`` installs what
``requirements.lock`` pins, every package included."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.config import load_config
from fedtune.run_folder import RunFolderTaken
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"


def make_dry_run(target: str) -> list[str]:
    """The commands ``make <target>`` runs (the venv taken as built), one list of words each."""
    done = subprocess.run(
        ["make", "-s", "-n", "-o", "venv", "-o", ".venv/.installed", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [shlex.split(line) for line in done.stdout.splitlines() if line.strip()]


def test_make_run_runs_a_second_time_and_moves_the_first_run_aside(tmp_path):
    """The Makefile's ``fedtune run`` command, on the tiny model, twice: both runs finish, the
    first one's folder moved aside to ``<name>.old-1``."""
    (command,) = make_dry_run("run")
    assert Path(command[0]).name == "fedtune"
    args = [*command[1:], *(a for t in [*TINY, f"output_dir={tmp_path}"] for a in ("--set", t))]
    for _ in range(2):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["default", "default.old-1"]
    assert (tmp_path / "default.old-1" / "summary.json").is_file()


def test_a_taken_run_folder_is_refused_before_any_data_or_model_is_read(tmp_path, monkeypatch):
    import fedtune.run

    config = load_config(None, [*TINY, f"output_dir={tmp_path}", "name=taken"])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.toml").write_text("")

    def read(*args, **kwargs):
        raise AssertionError("data and model read before the run folder was checked")

    monkeypatch.setattr(fedtune.run, "RunContext", read)
    with pytest.raises(RunFolderTaken, match="holds an earlier run"):
        fedtune.run.run_experiment(config)


def locked() -> dict[str, str]:
    """``requirements.lock``'s packages: canonical name -> version."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"requirements.lock: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lock_pins_every_package_the_makefile_and_pyproject_name():
    """Every dependency of pyproject.toml (and of the extras the Makefile installs: test, tracking,
    docs) and every package the Makefile installs without its dependencies has one version in the
    lock, within what they allow; torch is its CPU build and flwr 1.41.0."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    makefile = (ROOT / "Makefile").read_text()
    nodeps = re.search(r"^NODEPS := (.*?[^\\])\n", makefile, re.S | re.M).group(1).replace("\\\n", " ").split()
    pins = locked()
    extras = [x for extra in ("test", "tracking", "docs") for x in project["optional-dependencies"][extra]]
    for line in [*project["dependencies"], *extras, *nodeps]:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"requirements.lock has no {name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{line} vs {pins[name]}"
    assert pins["torch"] == "2.13.0+cpu" and pins["flwr"] == "1.41.0"
    assert len(nodeps) == 7 and pins["bitsandbytes"] == "0.50.2"


def test_the_install_passes_the_lock_to_every_pip_install_and_checks_the_venv_against_it(tmp_path):
    """The venv's recipe: each ``pip install`` constrained by the lock, then ``make check-lock``,
    which passes on a venv whose ``pip freeze`` is the lock and fails on one missing a package."""
    recipe = subprocess.run(
        ["make", "-s", "-n", "-B", ".venv/.installed"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    installs = [line for line in recipe if "pip install" in line]
    assert len(installs) == 4 and all("-c requirements.lock" in line for line in installs)
    assert any("check-lock" in line for line in recipe)
    pip = tmp_path / "venv" / "bin" / "pip"
    pip.parent.mkdir(parents=True)
    results = []
    for freeze in (f"grep -v '^#' {LOCK}", f"grep -v '^#' {LOCK} | sed 1d"):
        pip.write_text(f"#!/bin/sh\n{freeze}\n")
        pip.chmod(0o755)
        check = ["make", "-s", "check-lock", f"VENV={pip.parent.parent}"]
        results.append(subprocess.run(check, cwd=ROOT, capture_output=True, text=True))
    same, departs = results
    assert same.returncode == 0, same.stdout + same.stderr
    assert departs.returncode != 0 and "differs from requirements.lock" in departs.stdout


def test_make_lint_type_checks_after_ruff_and_ci_runs_it():
    """``make lint`` runs mypy (configured by pyproject.toml's ``[tool.mypy]``) after ruff's two
    checks, then builds the docs site with every warning an error, and CI's script runs ``make lint``."""
    commands = make_dry_run("lint")
    assert [Path(command[0]).name for command in commands[:3]] == ["ruff", "ruff", "mypy"]
    assert commands[3][0] == "NO_MKDOCS_2_WARNING=1" and Path(commands[3][1]).name == "mkdocs"
    assert commands[3][2:4] == ["build", "--strict"]
    assert "make lint" in (ROOT / ".ci" / "run").read_text().splitlines()
