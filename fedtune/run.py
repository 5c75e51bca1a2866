"""One run end to end: resolve the config, run the engine, write the run folder.

``runs/<name>/`` holds ``config.toml`` (the resolved config: ``fedtune run`` it to repeat the run;
``run_config.json``: the same as read, which ``--resume`` compares with), ``label_histograms.json``,
``plan.json`` (clients with budgets: each one's planned setting and predicted costs),
``metrics.jsonl`` (one line per round, flushed as it ends), ``checkpoint.npz`` (rewritten atomically
after every round: the round, the strategy's state and the engine's), the method's final artifacts
(LoRA methods: ``adapter/``, PEFT ``save_pretrained``) and ``summary.json``. :class:`RunFolder`
writes them; :mod:`fedtune.resume` checks a resume.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedtune.checkpoint import save_state
from fedtune.config import ConfigError, RunConfig
from fedtune.engines.embedded import EmbeddedEngine
from fedtune.engines.rounds import Engine, RoundRecord, RunHalted
from fedtune.process import setup_process
from fedtune.resume import (  # noqa: F401 - ROUND_KEY and read_metrics: imported from here too
    ENGINE_KEY,
    INPUTS_KEY,
    ROUND_KEY,
    RUN_CONFIG,
    check_fingerprints,
    check_unchanged,
    read_metrics,
    restore,
    resumable_keys,
    resumed_lines,
)
from fedtune.run_folder import check_free, check_unlocked, claimed, create, write_text, writing
from fedtune.runtime import ResolvedRun, RunContext, as_resolved
from fedtune.tracking import Trackers, check_installed

_resumable_keys = resumable_keys  # its earlier name (tests/test_privacy_resume.py)


def _toml(config: RunConfig) -> str:
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


def _interrupt_flag():
    """A flag set by the first Ctrl-C (SIGINT) while a run is in progress: the run stops after
    the current round's checkpoint. A second Ctrl-C interrupts at once. Returns (is_set,
    restore) where ``restore()`` puts the previous handler back."""
    import signal
    import threading

    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop.is_set, lambda: None
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, handler)
    return stop.is_set, lambda: signal.signal(signal.SIGINT, previous)


def environment() -> dict:
    """Where a run ran, for ``summary.json``: timings and, at the last bits, numerics depend on it
    (a benchmark folder may hold runs from more than one machine)."""
    import os
    import platform
    from importlib.metadata import version

    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def _summary(
    config: RunConfig, lines: list[dict], server: RunContext, run_dir: Path, wall_s: float, engine: str
) -> dict:
    """``summary.json`` from the run's ``metrics.jsonl`` lines (all rounds, resumed ones too)."""
    evaluated = [line["accuracy"] for line in lines if line.get("accuracy") is not None]
    return {
        "name": config.run_name,
        "method": config.method,
        "task": config.task.kind,
        "data": config.data.name,
        "rounds": config.rounds,
        "seed": config.seed,
        "final_accuracy": lines[-1].get("accuracy"),
        "best_accuracy": max(evaluated) if evaluated else None,
        "final_loss": lines[-1].get("loss"),
        "majority_accuracy": server.task.majority_rate(),
        "reference_name": server.task.reference_name,
        "test_examples": len(server.task.test),
        **({} if config.privacy.mode != "none" else _totals(lines, wall_s)),
        "run_dir": str(run_dir),
        "engine": engine,
        "environment": environment(),
    }


def _totals(lines: list[dict], wall_s: float) -> dict:
    """The run's bytes, compute, drops and wall time (a DP run releases none of them)."""
    return {
        "total_bytes_up": sum(line["bytes_up"] for line in lines),
        "total_bytes_down": sum(line["bytes_down"] for line in lines),
        "total_compute_s": sum(line["compute_s"] for line in lines),
        "dropped": sum(len(line.get("dropped", {})) for line in lines),
        "wall_s": wall_s,
    }


def _operator(note: str) -> None:
    """A line for the operator's console (stderr), never the run folder: what a DP run may not
    write but its operator must know."""
    print(f"warning: {note}", file=sys.stderr, flush=True)


@dataclass
class RunInputs:
    """Every input of a run, read and checked before its folder is touched (:func:`_read_inputs`)."""

    strategy: Any  # initialized: the model loaded (on a resume, the checkpoint's state)
    histograms: dict  # the clients' label counts (the data read)
    run_files: dict[str, str]  # the task's run files, name -> text (the data partitioned)


class RunFolder:
    """The run folder of ``run`` (``runs/<name>/``, see the module docstring) for one run: refused
    before any input is read when another process holds it
    (:class:`~fedtune.run_folder.RunFolderInUse`) or, for a fresh run without ``overwrite``, it
    holds an earlier run (:class:`~fedtune.run_folder.RunFolderTaken`) (:meth:`refuse_early`); a
    resume checked (:meth:`check_resumable`, :meth:`restore`: :mod:`fedtune.resume`); claimed
    (locked, ``overwrite`` moving an earlier run aside) while the run writes it (:meth:`claimed`);
    its first files (:meth:`begin`), a metrics line and checkpoint per round (:meth:`record`:
    ``checkpoint.npz`` holds the strategy's state, ``_round`` and ``_engine``, the engine's) and the
    model and ``summary.json`` (:meth:`finish`). A failed write is one line naming the file and the
    rounds kept (:class:`~fedtune.run_folder.RunWriteError`)."""

    def __init__(self, run: ResolvedRun, resume: bool = False, overwrite: bool = False) -> None:
        self.config, self.path, self.resume, self.overwrite = run.config, run.run_dir, resume, overwrite
        self.checkpoint, self.metrics = self.path / "checkpoint.npz", self.path / "metrics.jsonl"
        self.private = self.config.privacy.mode != "none"
        self.lines: list[dict] = []  # every round's metrics line: the resumed ones, then this process's
        self.fingerprints: dict | None = None  # DP: the keyed fingerprints of the inputs, checkpointed
        self.start_round = 1  # the first round this process runs: the one after the checkpoint's
        self._sink: Any = None

    def refuse_early(self) -> None:
        """Refuse a folder another process holds, or (a fresh run, no ``overwrite``) that holds an
        earlier run: before any data or model is read, so a refusal costs nothing."""
        check_unlocked(self.path)
        if not (self.resume or self.overwrite):
            check_free(self.path)

    def check_resumable(self) -> None:
        """On a resume: a checkpoint to resume from, and the config the run started with."""
        if not self.resume:
            return
        if not self.checkpoint.is_file():
            raise ConfigError(
                f"--resume {str(self.path)!r}: no round has completed there (no checkpoint.npz), so there is "
                "nothing to resume: run it afresh without --resume and with --overwrite (moves this folder aside), "
                "or under another name"
            )
        check_unchanged(self.config, self.path / RUN_CONFIG)

    def restore(self, strategy, engine: Engine | None, digests: dict | None) -> None:
        """Fingerprint the inputs (DP: ``digests``, keyed afresh) and, on a resume, load the
        checkpoint into ``strategy`` and ``engine`` (None: checked only), check a DP run's inputs
        against its checkpoint's fingerprints and read the metrics lines up to it."""
        if digests is not None:
            from fedtune.fingerprint import fresh_key, keyed

            reproducible = self.config.seed if self.config.privacy.insecure_reproducible_noise else None
            self.fingerprints = keyed(digests, fresh_key(reproducible))
        if not self.resume:
            return
        done, self.fingerprints = restore(self.checkpoint, strategy, engine, self.config.rounds)
        if digests is not None:
            check_fingerprints(self.checkpoint, self.fingerprints, digests)
        self.lines = resumed_lines(self.metrics, done)
        self.start_round = done + 1

    @contextmanager
    def claimed(self) -> Iterator[None]:
        """The folder locked for the block (:func:`~fedtune.run_folder.claimed`: a fresh run's
        checked free, or with ``overwrite`` its earlier run moved aside)."""
        with claimed(self.path, self.resume, self.overwrite):
            yield

    def begin(self, inputs: RunInputs, server: RunContext) -> str | None:
        """Write the run's first files (every input is checked: the folder is touched from here on):
        a fresh run's config, the label histograms (not a DP run's), the budget plan and the task's
        run files. The plan's JSON, or None when none is written."""
        if not self.resume:
            create(
                self.path,
                {"config.toml": _toml(self.config), RUN_CONFIG: json.dumps(self.config.model_dump(mode="json"))},
            )
        if not self.private:  # per-client label counts: not released by a DP run
            write_text(self.path / "label_histograms.json", json.dumps(inputs.histograms))
        plan_text = None
        if server.plan is not None and not (self.private and server.reports.node):
            # under DP a plan from the nodes' own reports is not released: it names who reported what
            from fedtune.planning.planner import plan_json

            plan_text = plan_json(server.plan)
            write_text(self.path / "plan.json", plan_text)
        for name, text in inputs.run_files.items():
            write_text(self.path / name, text)
        return plan_text

    def kept(self, rnd: int) -> str:
        """What a failed write leaves after round ``rnd``, and the way on."""
        if rnd < 1:
            return "; no round completed"
        return f"; rounds 1-{rnd} are checkpointed: free space or fix the folder, then fedtune run --resume {self.path}"

    @contextmanager
    def metrics_open(self) -> Iterator[None]:
        """``metrics.jsonl`` open for :meth:`record` (a resume's: rewritten atomically with the lines
        up to the checkpoint, then appended to)."""
        if self.resume:
            tmp = self.metrics.with_suffix(".jsonl.tmp")
            with writing(tmp, self.kept(self.start_round - 1)):
                tmp.write_text("".join(json.dumps(x) + "\n" for x in self.lines))
                tmp.replace(self.metrics)
        with writing(self.metrics, self.kept(self.start_round - 1)):
            sink = self.metrics.open("a" if self.resume else "w")
        with sink:
            self._sink = sink
            yield

    def record(self, rec: RoundRecord, strategy, engine: Engine) -> dict:
        """Append round ``rec``'s metrics line (flushed) and rewrite the checkpoint atomically: the
        strategy's and engine's state, the round and (DP) the inputs' fingerprints. The line."""
        line = rec.to_json()
        self.lines.append(line)
        with writing(self.metrics, self.kept(rec.round - 1)):
            self._sink.write(json.dumps(line) + "\n")
            self._sink.flush()
        state = {**strategy.state_dict(), ROUND_KEY: rec.round, ENGINE_KEY: engine.state_dict()}
        if self.fingerprints is not None:
            state[INPUTS_KEY] = self.fingerprints
        with writing(self.checkpoint, self.kept(rec.round - 1)):
            save_state(self.checkpoint, state, private=self.private)  # DP: holds secrets
        return line

    def finish(self, strategy, server: RunContext, engine: str, stopped: str | None, started: float) -> dict:
        """Save the method's final artifacts and write ``summary.json`` (``started``: the run's
        ``time.perf_counter()`` at its start); the summary."""
        last = self.lines[-1]["round"] if self.lines else 0
        with writing(self.path, self.kept(last)):
            strategy.save(self.path)
        summary = _summary(self.config, self.lines, server, self.path, time.perf_counter() - started, engine)
        summary.update(strategy.summary())
        if stopped is not None:
            summary["stopped"] = stopped
        with writing(self.path / "summary.json", self.kept(last)):
            (self.path / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _read_inputs(folder: RunFolder, server: RunContext, engine: Engine | None) -> RunInputs:
    """Every input of the run read and checked, nothing written: the initialized strategy (the
    model loaded), the label histograms (the data read), the task's run files (the data
    partitioned; the budget plan checked), on a resume the config, the checkpoint (loaded into the
    strategy and ``engine``; None: checked only) and the metrics lines up to it, and under DP the
    keyed fingerprints of the inputs (a resume's checked against its checkpoint's). A bad input
    raises a one-line :class:`~fedtune.config.ConfigError`."""
    folder.check_resumable()
    strategy = server.strategy()
    strategy.initialize()  # loads the model: a bad model.name stops here, before any output
    histograms = {"label_names": server.task.label_names, "clients": server.histograms()}  # reads the data
    run_files = server.task.run_files()  # and partitions it: a bad file or partition stops here too
    if engine is not None:  # the budgets the nodes report (Flower: discovers the nodes), before the plan is read
        engine.prepare(server)
    server.check_plan()  # a budget plan that leaves no round able to aggregate stops here too
    digests = None
    if folder.private:  # every input of a release, before a checkpoint's state replaces it
        from fedtune.fingerprint import input_digests

        digests = input_digests(server, strategy, resumable_keys(folder.config))
    folder.restore(strategy, engine, digests)
    return RunInputs(strategy, histograms, run_files)


def check_inputs(run: ResolvedRun, resume: bool = False) -> None:
    """Read and check every input of ``run`` as :func:`run_experiment` does before it writes
    anything (the data read and partitioned, the model loaded, the budget plan; on ``resume`` the
    config against the run's, the checkpoint, its DP fingerprints and ``metrics.jsonl``), and write
    nothing: for a launcher whose run happens in another process (the Flower engines), so that a
    bad input stops in one line before any process starts or the run folder is touched."""
    _read_inputs(RunFolder(run, resume), RunContext(run), None)


@contextmanager
def _tracked(folder: RunFolder, plan_text: str | None) -> Iterator[Trackers]:
    """The trackers of ``logging.to`` for the block, started with the run's config, plan and the
    resumed lines; closed as failed when the block raises."""
    trackers = Trackers(folder.config, folder.path, folder.resume)  # they get what the run folder gets
    trackers.start(folder.config, _toml(folder.config), plan_text, folder.lines)
    try:
        yield trackers
    except BaseException:
        trackers.close(ok=False)
        raise
    trackers.close(ok=True)


def _run_rounds(
    folder: RunFolder, strategy, engine: Engine, trackers: Trackers, on_round: Callable[[RoundRecord], None] | None
) -> str | None:
    """Run the rounds after the checkpoint's on ``engine``, each recorded in ``folder``, then in the
    trackers, then given to ``on_round``; the first Ctrl-C stops after the current round. Why the
    run halted early (None: it did not); a halt before any round is a one-line ConfigError."""
    contributed = [0, 0]  # rounds this process ran, and of them those some client's update reached

    def record(rec: RoundRecord) -> None:
        for note in rec.notes:  # a private round's drops: the operator's console only
            _operator(f"round {rec.round}: {note}")
        contributed[0] += 1
        contributed[1] += bool(set(rec.clients) - set(rec.dropped))
        trackers.round(folder.record(rec, strategy, engine))  # the line written (DP: the release), checkpointed
        if on_round is not None:
            on_round(rec)

    stop_requested, restore_handler = _interrupt_flag()
    try:
        with folder.metrics_open():
            engine.run(strategy, record, folder.start_round, stop_requested)
    except RunHalted as halt:
        if not folder.lines:
            raise ConfigError(str(halt)) from None
        return str(halt)
    finally:
        restore_handler()  # Ctrl-C as before the run from here on
        if folder.private and contributed[0] and not contributed[1]:
            _operator(
                f"no client's update reached this DP run's aggregate in its {contributed[0]} round(s) here: every "
                "release was noise alone (every client failed or was dropped, or none was sampled)"
            )
    return None


def run_experiment(
    run: RunConfig | ResolvedRun,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[RunContext], None] | None = None,
    engine: Engine | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict:
    """Run ``run`` (resolved here unless it is) on ``engine`` (default: the
    :class:`~fedtune.engines.embedded.EmbeddedEngine`) into its :class:`RunFolder` and return the
    summary. Every input is read and checked before the folder is touched; a taken or locked folder
    is refused before any is read (``overwrite`` moves an earlier run aside); ``resume`` continues
    from the last checkpointed round, bit-identical to an uninterrupted run; Ctrl-C stops after the
    current round's checkpoint."""
    started = time.perf_counter()
    run = as_resolved(run)
    setup_process(run.config.train.threads)
    check_installed(run.config)  # a tracker's package: before anything is read or written
    folder = RunFolder(run, resume, overwrite)
    folder.refuse_early()
    server = RunContext(run)
    engine = engine or EmbeddedEngine(run, server)
    inputs = _read_inputs(folder, server, engine)
    with folder.claimed():
        plan_text = folder.begin(inputs, server)
        if on_start is not None:
            on_start(server)
        with _tracked(folder, plan_text) as trackers:
            stopped = _run_rounds(folder, inputs.strategy, engine, trackers, on_round)
            summary = folder.finish(inputs.strategy, server, engine.name, stopped, started)
            trackers.finish(summary)
    return summary
