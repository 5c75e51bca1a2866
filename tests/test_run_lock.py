"""A run folder in use is locked: a second process that would write it (a fresh run with
--overwrite, a --resume) is refused in one line naming the owner's PID, before anything is read or
changed, on every engine; a lock whose owner died is taken over; a process under an ancestor's lock
(a Flower deployment's ServerApp under the ``fedtune run`` that started it) works under it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.config import load_config
from fedtune.run_folder import LOCK_FILE, RunFolderInUse, check_unlocked, locked
from tests.conftest import TINY
from tests.test_bad_input import digest

runner = CliRunner()

HOLD = """
import sys, time
from pathlib import Path
from fedtune.run_folder import locked
with locked(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process holding ``run_dir``'s lock (its first line once it holds it)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-round tiny run (copied by each test)."""
    out = tmp_path_factory.mktemp("lock")
    args = [a for s in [*TINY, "rounds=1", f"output_dir={out}", "name=done"] for a in ("--set", s)]
    assert runner.invoke(app, ["run", *args]).exit_code == 0
    return out / "done"


def test_a_second_process_on_a_folder_in_use_is_refused_naming_the_owner_on_every_engine(finished, tmp_path):
    import shutil

    from fedtune.launch import launch

    run_dir = Path(shutil.copytree(finished, tmp_path / "done"))
    holder = _holder(run_dir)
    before = digest(run_dir)
    try:
        sets = [a for s in [*TINY, "rounds=2", f"output_dir={tmp_path}", "name=done"] for a in ("--set", s)]
        for args in (["--resume", str(run_dir), "--set", "rounds=2"], [*sets, "--overwrite"]):
            result = runner.invoke(app, ["run", *args])
            line = result.output.strip()
            assert result.exit_code == 2 and "\n" not in line, result.output
            assert f"is in use by process {holder.pid}" in line and str(run_dir) in line, line
        for engine in ("embedded", "flower-sim", "flower"):  # refused before any engine starts
            config = load_config(None, [*TINY, "rounds=2", f"output_dir={tmp_path}", "name=done", f"engine={engine}"])
            for resume, overwrite in ((True, False), (False, True)):
                with pytest.raises(RunFolderInUse, match=f"in use by process {holder.pid}"):
                    launch(config, resume=resume, overwrite=overwrite)
        assert digest(run_dir) == before and sorted(p.name for p in tmp_path.iterdir()) == ["done"]
    finally:
        holder.kill()
        holder.wait()
    assert (run_dir / LOCK_FILE).read_text().strip() == str(holder.pid)  # stale now: its owner was killed
    result = runner.invoke(app, ["run", "--resume", str(run_dir), "--set", "rounds=2"])  # takes the lock over
    assert result.exit_code == 0, result.output
    assert not (run_dir / LOCK_FILE).exists()  # released at the end


def test_a_lock_is_taken_over_from_a_dead_owner_and_covers_the_owners_descendants(tmp_path):
    run_dir = tmp_path / "new" / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir.mkdir(parents=True)
    (run_dir / LOCK_FILE).write_text(f"{dead.pid}\n")
    check_unlocked(run_dir)  # a file without a live owner holds nothing
    with locked(run_dir):
        assert (run_dir / LOCK_FILE).read_text().strip() == str(os.getpid())
        child = "import sys; from pathlib import Path; from fedtune.run_folder import locked\n"
        child += "with locked(Path(sys.argv[1])): print('inside')"
        done = subprocess.run([sys.executable, "-c", child, str(run_dir)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "inside", done.stderr  # a descendant works under it
        with locked(run_dir):  # and so does this process again (the Flower simulation's ServerApp)
            pass
        assert (run_dir / LOCK_FILE).is_file()
    assert not (run_dir / LOCK_FILE).exists()
    fresh = tmp_path / "made" / "here"
    with locked(fresh):
        assert fresh.is_dir()
    assert not (tmp_path / "made").exists()  # folders made for the lock alone are removed again
