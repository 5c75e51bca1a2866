"""The quick commands and the quiet default: ``fedtune methods``, ``tasks`` and ``--help`` answer
without importing the methods, tasks or their libraries (fedtune.catalog); third-party warnings,
log lines and progress bars show only with ``fedtune --verbose``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fedtune import catalog
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "flwr", "bitsandbytes", "numpy")


def python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter importing this checkout, with ``env`` added."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    quieted = ("FEDTUNE_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")  # by earlier runs here
    environ = {k: v for k, v in os.environ.items() if k not in quieted}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**environ, "PYTHONPATH": path, **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_catalog_is_what_the_registries_hold():
    """catalog.json lists every registered method and task kind as the registries describe them:
    regenerate it with ``python -m fedtune.catalog`` after adding or renaming one."""
    assert catalog.read() == json.loads(json.dumps(catalog.build()))
    assert catalog.PATH.read_text() == catalog.text(catalog.build())


#: runs ``fedtune <argv[1:]>`` and prints which of the heavy libraries it imported
COMMAND = f"""
import sys
from fedtune.cli import app
try:
    app(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print("imported:", sorted(m for m in {HEAVY!r} if m in sys.modules))
"""


@pytest.mark.parametrize("command", [["methods"], ["tasks"], ["--help"], ["run", "--help"]])
def test_the_listing_commands_import_no_library(command):
    out = python(COMMAND, *command).stdout
    assert out.strip().splitlines()[-1] == "imported: []"
    if command[0] == "methods":
        assert [line.split()[0] for line in out.splitlines()[:-1]] == [name for name, _ in catalog.read()["methods"]]


#: imports bitsandbytes and transformers after fedtune's process set-up; prints what they let out
QUIET = """
import logging, sys
from fedtune.process import setup_process
if sys.argv[1] == "before":
    import transformers
setup_process()
import bitsandbytes
from transformers.utils import logging as hf_logging
bnb_warns = logging.getLogger("bitsandbytes.backends.cpu.ops").isEnabledFor(logging.WARNING)
print(bnb_warns, hf_logging.is_progress_bar_enabled())
"""


def test_the_libraries_are_quiet_unless_verbose():
    """After the process set-up, bitsandbytes logs no warning (its "Failed to load CPU
    gemm_4bit_forward" at import on an AVX512-BF16 CPU) and transformers shows no progress bar (its
    "Loading weights"), whether transformers was imported before or after; FEDTUNE_VERBOSE (set by
    ``fedtune --verbose``) leaves both on."""
    for when in ("before", "after"):
        quiet = python(QUIET, when)
        assert quiet.stdout.split() == ["False", "False"] and "gemm_4bit_forward" not in quiet.stderr
    assert python(QUIET, "after", FEDTUNE_VERBOSE="1").stdout.split() == ["True", "True"]


@pytest.mark.parametrize("verbose", [False, True])
def test_a_run_shows_the_libraries_warnings_only_when_verbose(tmp_path, monkeypatch, verbose):
    """A tiny run gives none of PEFT's UserWarnings (its "Could not find a config file" as the
    adapter is saved) unless ``fedtune --verbose``."""
    from typer.testing import CliRunner

    from fedtune.cli import app
    from fedtune.process import VERBOSE_ENV

    monkeypatch.setenv(VERBOSE_ENV, "")  # (absent again after the test, also where the run set it)
    monkeypatch.delenv(VERBOSE_ENV)
    args = ["run", *(a for t in [*TINY, "rounds=1", f"output_dir={tmp_path}"] for a in ("--set", t))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, ["--verbose", *args] if verbose else args)
    assert result.exit_code == 0, result.output
    assert (os.environ.get(VERBOSE_ENV) == "1") == verbose
    peft = [w for w in caught if issubclass(w.category, UserWarning) and "peft" in w.filename]
    assert bool(peft) == verbose
