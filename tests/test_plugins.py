"""Methods and task kinds from the user's own package: ``fedtune new`` writes one, it runs from the
CLI on the embedded engine and on flower-sim (by ``"package.module:NAME"``), its generated test
(fedtune's contract checks, fedtune.testing) passes, and an installed package's entry point is
listed by ``fedtune methods`` (without importing it) and run by its plain name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.tasks import get_task_class
from fedtune.testing import TINY_RUN, check_task

runner = CliRunner()
TINY = [*get_task_class("text-classification").test_overrides, *TINY_RUN]


def _scaffold(tmp_path: Path, kind: str, name: str, monkeypatch) -> Path:
    result = runner.invoke(app, ["new", kind, name, "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    root = tmp_path / name.replace("-", "_")
    monkeypatch.syspath_prepend(str(root))  # importable here, and by Ray's workers (sys.path travels)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    return root


def _run(recipe: Path, *sets: str) -> dict:
    args = ["run", str(recipe), *(f"--set={s}" for s in [*TINY, *sets])]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = next(s.partition("=")[2] for s in sets if s.startswith("output_dir="))
    (folder,) = Path(out).iterdir()
    return json.loads((folder / "summary.json").read_text())


def test_a_method_made_by_fedtune_new_runs_from_the_cli_on_both_engines_and_its_test_passes(tmp_path, monkeypatch):
    root = _scaffold(tmp_path / "src", "method", "toy-avg", monkeypatch)
    assert {p.name for p in root.iterdir()} >= {"toy_avg", "pyproject.toml", "recipe.toml", "tests", "README.md"}
    again = runner.invoke(app, ["new", "method", "toy-avg", "--dir", str(tmp_path / "src")])
    assert again.exit_code == 2 and "exists" in again.output  # never over a folder that is there

    for engine in ("embedded", "flower-sim"):
        summary = _run(root / "recipe.toml", f"engine={engine}", f"output_dir={tmp_path / engine}")
        assert summary["method"] == "toy_avg.method:toy-avg" and summary["rounds"] == 2
        assert summary["engine"] == ("embedded" if engine == "embedded" else "flower")

    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert "2 passed" in tests.stdout


def test_a_task_made_by_fedtune_new_passes_the_contract_checks(tmp_path, monkeypatch):
    _scaffold(tmp_path, "task", "toy-text", monkeypatch)
    summary = check_task("toy_text.task:toy-text", tmp_path / "runs")
    assert summary["task"] == "toy_text.task:toy-text" and summary["final_accuracy"] is not None


def test_an_installed_packages_entry_point_is_listed_without_import_and_runs_by_name(tmp_path, monkeypatch):
    """The entry point as pip would install it: a ``.dist-info`` with ``entry_points.txt`` on sys.path."""
    _scaffold(tmp_path, "method", "ep-avg", monkeypatch)
    site = tmp_path / "site"
    info = site / "fedtune_ep_avg-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedtune-ep-avg\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[fedtune.methods]\nep-avg = ep_avg.method\n")
    monkeypatch.syspath_prepend(str(site))

    listed = runner.invoke(app, ["methods"])
    assert listed.exit_code == 0 and "ep-avg         (from ep_avg.method (fedtune-ep-avg 0.1.0))" in listed.output
    assert "ep_avg.method" not in sys.modules  # listed from the metadata alone
    verbose = runner.invoke(app, ["methods", "-v"])
    assert verbose.exit_code == 0, verbose.output
    block = verbose.output.split("ep-avg", 1)[1]
    assert "source: ep_avg.method (your package)" in block and "text-classification" in block
    summary = _run(tmp_path / "ep_avg" / "recipe.toml", "method=ep-avg", f"output_dir={tmp_path / 'runs'}")
    assert summary["method"] == "ep-avg" and summary["final_accuracy"] is not None


def test_a_reference_to_a_module_that_does_not_import_is_one_line(tmp_path):
    result = runner.invoke(app, ["run", "--set=method=no_such_package.method:mine", f"--set=output_dir={tmp_path}"])
    assert result.exit_code == 2 and "no_such_package.method" in result.output
    assert result.output.strip().count("\n") == 0 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["Bad", "1x", "import", "a_b"])
def test_fedtune_new_refuses_a_name_that_is_no_package(tmp_path, name):
    result = runner.invoke(app, ["new", "method", name, "--dir", str(tmp_path)])
    assert result.exit_code == 2 and not list(tmp_path.iterdir())
