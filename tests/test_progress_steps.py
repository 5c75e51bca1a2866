"""Progress of long steps (fedtune.steps, fedtune.progress.StepDisplay): ``fedtune eval`` of a run
whose base is 4-bit shows loading the base, quantizing its layers and scoring (questions, rate,
ETA) as bars on a real terminal (a pty), as plain lines in a pipe, and nothing with --quiet."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fedtune import progress, steps
from fedtune.cli import app
from fedtune.run import run_experiment
from tests.conftest import tiny

runner = CliRunner()
ESC = "\x1b["  # a terminal's control sequences: what a bar redraws itself with


@pytest.fixture(scope="module")
def four_bit_run(tmp_path_factory) -> Path:
    """A one-round FedIT run of tiny-llama on a 4-bit NF4 base (bitsandbytes' CPU path)."""
    tmp = tmp_path_factory.mktemp("four-bit")
    config = tiny(tmp, "fedit", "causal-lm", "model.quantization=4bit", "rounds=1", "name=four-bit")
    return Path(run_experiment(config)["run_dir"])


def _in_a_pty(args: list[str]) -> str:
    """What ``args`` writes to a pseudo-terminal (its stdout and stderr)."""
    main, child = pty.openpty()
    env = {**os.environ, "COLUMNS": "160"}
    env.pop(progress.TERMINAL_ENV, None)
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=child, stderr=child, env=env)
    os.close(child)
    out = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        out.append(data)
    os.close(main)
    assert proc.wait(timeout=600) == 0, b"".join(out)[-3000:]
    return b"".join(out).decode(errors="replace")


def test_eval_of_a_4bit_run_shows_bars_on_a_terminal_and_plain_lines_in_a_pipe(four_bit_run, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_MIN_S", 0.0)  # the tiny model's steps are short: every one closes
    args = ["eval", str(four_bit_run), "--tasks", "arc_easy", "--limit", "6"]
    shown = _in_a_pty([sys.executable, "-m", "fedtune.cli", *args, "--out", str(tmp_path / "tty.json")])
    for what in ("preparing the base tiny-llama (4-bit NF4)", "quantizing", "scoring arc_easy", "/6 questions"):
        assert what in shown, what
    assert ESC in shown and "done, 6 questions" not in shown  # bars, not the plain lines

    piped = runner.invoke(app, [*args, "--out", str(tmp_path / "pipe.json")])
    assert piped.exit_code == 0, piped.output
    lines = piped.output.splitlines()
    assert any(line.startswith("preparing the base tiny-llama (4-bit NF4): done in") for line in lines)
    assert any(line.startswith("quantizing") and "layers to 4-bit NF4: done," in line for line in lines)
    assert any(line.startswith("scoring arc_easy: done, 6 questions in") for line in lines)
    assert ESC not in piped.output

    monkeypatch.setenv(progress.QUIET_ENV, "")  # --quiet sets it for the process: restored after the test
    quiet = runner.invoke(app, ["--quiet", *args, "--out", str(tmp_path / "quiet.json")])
    assert quiet.exit_code == 0 and "done" not in quiet.output and "arc_easy" in quiet.output  # the results remain


def test_off_a_terminal_a_long_step_prints_its_progress_with_rate_and_eta(monkeypatch):
    """A progress line every PLAIN_EVERY_S seconds (here: every advance), then the closing line."""
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "PLAIN_MIN_S", 0.0)
    monkeypatch.delenv(progress.TERMINAL_ENV, raising=False)
    out = io.StringIO()
    with steps.showing(progress.StepDisplay(Console(file=out, width=200))):
        with steps.step("tokenizing 4 texts", total=4, unit="texts") as advance:
            advance(1)
            steps.advance(1)  # the innermost step, from code that does not hold it
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("tokenizing 4 texts: 1/4 texts, ") and "/s, ETA " in lines[0]
    assert lines[1].startswith("tokenizing 4 texts: 2/4 texts, ")
    assert lines[2].startswith("tokenizing 4 texts: done, 2 texts in ")


def test_a_library_user_sees_nothing_and_in_chunks_tokenizes_as_one_call():
    calls = []

    def call(part):
        calls.append(len(part))
        return [x * 2 for x in part]

    items = list(range(2 * steps.CHUNK + 5))
    assert steps.in_chunks(items, call, "doubling", "numbers") == [x * 2 for x in items]
    assert calls == [steps.CHUNK, steps.CHUNK, 5]
    assert steps.in_chunks([1, 2], call, "doubling", "numbers") == [2, 4] and calls[-1] == 2


def test_a_step_that_fails_leaves_no_done_line_only_the_error(monkeypatch):
    """A load that raises is not "done": off a terminal its closing line is left out (the one-line
    error follows); the step is closed all the same, so the next one is the innermost."""
    monkeypatch.setattr(progress, "PLAIN_MIN_S", 0.0)
    monkeypatch.delenv(progress.TERMINAL_ENV, raising=False)
    out = io.StringIO()
    with steps.showing(progress.StepDisplay(Console(file=out, width=200))):
        with pytest.raises(OSError), steps.step("loading /no/such/model"):
            raise OSError("no such model")
        with steps.step("planning 2 clients"):
            pass
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[0]]
    assert out.getvalue().startswith("planning 2 clients: done in ")


def test_off_a_terminal_a_short_step_leaves_no_line_and_a_long_one_closes(monkeypatch):
    """A log hears of long steps only: one under PLAIN_MIN_S (a tiny model's load) prints nothing,
    one that lasted longer its closing line."""
    monkeypatch.delenv(progress.TERMINAL_ENV, raising=False)
    monkeypatch.setattr(progress.time, "monotonic", lambda: 100.0)  # "now", when each step ends
    out = io.StringIO()
    display = progress.StepDisplay(Console(file=out, width=200))
    display.ended(steps.Step("loading tiny-bert", started=100.0 - 0.9 * progress.PLAIN_MIN_S))
    assert out.getvalue() == ""
    display.ended(steps.Step("loading a 3B base", started=100.0 - 1.1 * progress.PLAIN_MIN_S))
    assert out.getvalue().startswith("loading a 3B base: done in ")
