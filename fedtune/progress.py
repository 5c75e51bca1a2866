"""Live display: a run's line per round (round, clients, losses, accuracy, MB up/down, the ETA
of the whole run) and the long steps of any command (:class:`StepDisplay` of :mod:`fedtune.steps`:
loading and preparing a base, tokenizing, scoring, export, plan)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.status import Status
from rich.table import Table
from rich.text import Text

from fedtune.config import RunConfig
from fedtune.engines.rounds import RoundRecord
from fedtune.steps import Step

MB = 1e6
TERMINAL_ENV = "FEDTUNE_TERMINAL"  # "1": show steps as on a terminal whatever the output is; "0": plain lines
QUIET_ENV = "FEDTUNE_QUIET"  # set by `fedtune --quiet`: no step display and no spinner
PLAIN_EVERY_S = 10.0  # off a terminal: a long step's progress line at most this often
PLAIN_MIN_S = 2.0  # off a terminal: a step shorter than this (loading a tiny model) leaves no line


def duration(seconds: float) -> str:
    """``seconds`` as ``1h02m``, ``3m05s`` or ``42s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _count(done: float, total: float | None, unit: str, speed: float | None) -> str:
    """``120/500 questions, 14.2/s, ETA 28s`` (what is known of it)."""
    text = f"{done:,.0f}" + ("" if total is None else f"/{total:,.0f}") + (f" {unit}" if unit else "")
    if speed:
        text += f", {speed:.3g}/s"
        if total is not None and total > done:
            text += f", ETA {duration((total - done) / speed)}"
    return text


class _CountColumn(ProgressColumn):
    """Done / total, unit, rate and ETA of a step's task."""

    def render(self, task: Task) -> Text:
        return Text(_count(task.completed, task.total, task.fields.get("unit", ""), task.speed))


class StepDisplay:
    """Shows the steps of :mod:`fedtune.steps` (a :class:`~fedtune.steps.Sink`). On a terminal (or
    with ``FEDTUNE_TERMINAL=1``): a bar per open step (what, done / total, rate, ETA, elapsed),
    gone once it ends. Elsewhere (a pipe, a file, CI): plain lines, one when a step of at least
    :data:`PLAIN_MIN_S` ends (what, how many, in how long) and, while a long one runs, one every
    :data:`PLAIN_EVERY_S` seconds with its progress; a step that failed leaves no closing line (its
    error follows). ``before_live``: called before the bars take the terminal (the run's spinner stops)."""

    def __init__(self, console: Console, before_live: Callable[[], None] = lambda: None) -> None:
        forced = os.environ.get(TERMINAL_ENV)
        self.terminal = console.is_terminal if forced is None else forced == "1"
        self.console = Console(file=console.file, force_terminal=True) if forced == "1" else console
        self.before_live = before_live
        self.progress: Progress | None = None

    def started(self, step: Step) -> None:
        """A bar (terminal), or the clock of the step's plain lines."""
        if not self.terminal:
            return
        if self.progress is None:
            self.before_live()
            self.progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), _CountColumn(), TimeElapsedColumn(),
                console=self.console, transient=True,
            )  # fmt: skip
            self.progress.start()
        step.handle = self.progress.add_task(step.description, total=step.total, unit=step.unit)

    def advanced(self, step: Step) -> None:
        """The bar moves; off a terminal, a progress line when the last is old enough."""
        if self.progress is not None and self.terminal:
            self.progress.update(step.handle, completed=step.completed)  # type: ignore[arg-type]
            return
        now = time.monotonic()
        if now - step.shown >= PLAIN_EVERY_S:
            step.shown, step.reported = now, True
            speed = step.completed / (now - step.started) if now > step.started else None
            self._line(f"{step.description}: {_count(step.completed, step.total, step.unit, speed)}")

    def ended(self, step: Step) -> None:
        """The bar goes (the display with the last one); off a terminal, the step's closing line."""
        if self.progress is not None and self.terminal:
            self.progress.remove_task(step.handle)  # type: ignore[arg-type]
            if not self.progress.tasks:
                self.progress.stop()
                self.progress = None
            return
        if step.failed:  # the error that follows says what happened
            return
        if time.monotonic() - step.started < PLAIN_MIN_S and not step.reported:
            return  # not a long step: a log need not hear of it
        done = f", {step.completed:,.0f} {step.unit}" if step.unit else ""
        self._line(f"{step.description}: done{done} in {time.monotonic() - step.started:.1f} s")

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)


def quiet() -> bool:
    """Whether ``fedtune --quiet`` asked for no progress display."""
    return bool(os.environ.get(QUIET_ENV))


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}%"


def _drops(rec: RoundRecord) -> str:
    """`` dropped 2 (client 3: why; client 5: why)`` when clients were dropped this round."""
    if not rec.dropped:
        return ""
    shown = "; ".join(f"client {cid}: {why}" for cid, why in list(rec.dropped.items())[:3])
    more = f"; +{len(rec.dropped) - 3} more" if len(rec.dropped) > 3 else ""
    return f"  dropped {len(rec.dropped)} ({shown}{more})"


class RoundPrinter:
    """Prints one line per round as it ends (with the ETA of the whole run: the mean round this
    process ran times the rounds left; not under DP, whose lines release no timing), and a final
    summary; on a terminal, a spinner names the step under way between them (loading the data and
    model, the round being trained and evaluated), gone once the step ends."""

    def __init__(self, console: Console, config: RunConfig) -> None:
        self.console = console
        self.config = config
        self.up = self.down = 0
        self.seconds: list[float] = []  # the wall time of each round this process ran (the run's ETA)
        self.status: Status | None = None

    def working(self, what: str | None) -> None:
        """Show ``what`` beside a spinner until the next line (None: nothing); terminals only."""
        if self.status is not None:
            self.status.stop()
            self.status = None
        if what is not None and self.console.is_terminal and not quiet():
            self.status = self.console.status(what)
            self.status.start()

    def begin(self) -> None:
        """Before the run: its data and model are being read."""
        self.working("reading the data and loading the model")

    def _next(self, done: int | None) -> None:
        """The spinner for the round after ``done`` (None: the first this process runs)."""
        rounds = self.config.rounds
        if done is None:
            self.working("training and evaluating the next round")
        else:
            self.working(f"round {done + 1}/{rounds}: training and evaluating" if done < rounds else None)

    def start(self, context) -> None:
        self.working(None)
        c = self.config = context.config  # resolved: the task's default data and model named
        self.console.print(
            f"[bold]{c.run_name}[/]: method {c.method}, task {c.task.kind}, data {c.data.name}, model {c.model.name}, "
            f"{c.federation.num_clients} clients ({c.federation.sample_size()} per round), {c.rounds} rounds",
            soft_wrap=True,
        )
        self._next(None)

    def __call__(self, rec: RoundRecord) -> None:
        self.working(None)
        self._line(rec)
        self._next(rec.round)

    def _line(self, rec: RoundRecord) -> None:
        m = rec.metrics
        if rec.private:  # only what the privacy mechanism releases (RoundRecord.to_json): no timing, no ETA
            clip = f"  clip {m['clip']:.4g}" if m.get("clip") is not None else ""
            self.console.print(
                f"round {rec.round:>3}/{self.config.rounds}  acc {_pct(m.get('accuracy'))}  "
                f"epsilon {m['epsilon']:.4g}{clip}",
                highlight=False,
                soft_wrap=True,
            )
            return
        self.up += sum(rec.client_bytes_up.values())
        self.down += sum(rec.client_bytes_down.values())
        self.seconds.append(rec.wall_s)
        left = self.config.rounds - rec.round
        eta = f"  ETA {duration(left * sum(self.seconds) / len(self.seconds))}" if left > 0 else ""
        loss = m.get("train_loss")
        self.console.print(
            f"round {rec.round:>3}/{self.config.rounds}  clients {len(rec.clients):>3}  "
            f"train loss {'–' if loss is None else f'{loss:.4f}'}  acc {_pct(m.get('accuracy'))}  "
            f"up {self.up / MB:8.3f} MB  down {self.down / MB:8.3f} MB  {rec.wall_s:6.1f}s{eta}"
            + (f"  epsilon {m['epsilon']:.4g}" if m.get("epsilon") is not None else "")  # privacy.mode: spent so far
            + _drops(rec),
            highlight=False,
            soft_wrap=True,
        )

    def finish(self, summary: dict) -> None:
        self.working(None)
        table = Table()  # the folder on its own line: a title wraps at the table's width, cutting the path
        columns = {
            "final accuracy": _pct(summary["final_accuracy"]),
            summary.get("reference_name", "majority-class rate"): _pct(summary["majority_accuracy"]),
        }
        if "privacy" in summary:  # a DP run releases no bytes or timings
            p = summary["privacy"]
            columns.update(
                {"epsilon": f"{p['epsilon']:.4g}", "delta": f"{p['delta']:.3g}", "adjacency": p["adjacency"]}
            )
        else:
            columns.update(
                {
                    "MB up": f"{summary['total_bytes_up'] / MB:.3f}",
                    "MB down": f"{summary['total_bytes_down'] / MB:.3f}",
                    "wall s": f"{summary['wall_s']:.1f}",
                }
            )
        for col in columns:
            table.add_column(col, justify="right")
        table.add_row(*columns.values())
        out = Console()
        out.print(f"run folder: {summary['run_dir']}", markup=False, highlight=False, soft_wrap=True)
        out.print(table)
