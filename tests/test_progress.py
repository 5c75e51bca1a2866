"""The run's live display (fedtune.progress.RoundPrinter): on a terminal a spinner names the step
under way (loading, then each round) and is gone once a line or the summary is printed; on a pipe
or a file (CI, tests, logs) there is no spinner at all, only the lines."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from fedtune.engines.rounds import RoundRecord
from fedtune.progress import RoundPrinter


def _printer(tiny_config, terminal: bool) -> tuple[RoundPrinter, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200)
    return RoundPrinter(console, tiny_config("rounds=2")), out


def test_on_a_terminal_a_spinner_names_each_step_until_its_line(tiny_config):
    printer, _ = _printer(tiny_config, terminal=True)
    printer.begin()
    assert printer.status is not None and "loading the model" in str(printer.status.status)
    printer.start(SimpleNamespace(config=printer.config))
    assert "next round" in str(printer.status.status)
    printer(RoundRecord(1, [0, 1], {"train_loss": 0.5, "accuracy": 0.5}))
    assert "round 2/2" in str(printer.status.status)
    printer(RoundRecord(2, [0, 1], {"train_loss": 0.4, "accuracy": 0.6}))
    assert printer.status is None  # the last round: nothing more under way


def test_off_a_terminal_there_is_no_spinner_only_the_lines(tiny_config):
    printer, out = _printer(tiny_config, terminal=False)
    printer.begin()
    printer.start(SimpleNamespace(config=printer.config))
    printer(RoundRecord(1, [0, 1], {"train_loss": 0.5, "accuracy": 0.5}))
    assert printer.status is None
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("round   1/2")


def test_a_round_line_says_the_eta_of_the_whole_run_but_not_under_dp(tiny_config):
    """The ETA is the mean round this process ran times the rounds left; a DP round's line
    releases no timing, so it has none. Control: the same record without DP shows it."""
    out = io.StringIO()
    printer = RoundPrinter(Console(file=out, width=200), tiny_config("rounds=4"))
    printer(RoundRecord(1, [0], {"accuracy": 0.5}, wall_s=10.0))
    printer(RoundRecord(2, [0], {"accuracy": 0.5}, wall_s=30.0))
    printer(RoundRecord(4, [0], {"accuracy": 0.5}, wall_s=30.0))
    private = RoundRecord(3, [0], {"accuracy": 0.5, "epsilon": 1.0}, wall_s=10.0, private=True)
    printer(private)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("ETA 30s") and lines[1].endswith("ETA 40s")  # 3 x 10 s; 2 x mean(10, 30)
    assert "ETA" not in lines[2]  # the last round
    assert "ETA" not in lines[3] and "epsilon 1" in lines[3]
