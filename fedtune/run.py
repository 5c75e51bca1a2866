"""One run end to end: resolve the config, run the engine, write the run folder.

``runs/<name>/`` holds ``config.toml`` (the resolved config: ``fedtune run`` it to repeat the run;
``run_config.json``: the same as read, which ``--resume`` compares with), ``label_histograms.json``,
``plan.json`` (clients with budgets: each one's planned setting and predicted costs),
``metrics.jsonl`` (one line per round, flushed as it ends), ``checkpoint.npz`` (rewritten atomically
after every round: the round, the strategy's state and the engine's), the method's final artifacts
(LoRA methods: ``adapter/``, PEFT ``save_pretrained``) and ``summary.json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedtune.checkpoint import load_state, save_state
from fedtune.config import ConfigError, RunConfig, flat_keys
from fedtune.engines.embedded import EmbeddedEngine
from fedtune.engines.rounds import Engine, RoundRecord, RunHalted
from fedtune.process import setup_process
from fedtune.run_folder import check_free, check_unlocked, claimed, create, write_text, writing
from fedtune.runtime import ResolvedRun, RunContext, as_resolved
from fedtune.tracking import Trackers, check_installed


def _toml(config: RunConfig) -> str:
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


ROUND_KEY, ENGINE_KEY = "_round", "_engine"  # checkpoint.npz: the strategy's state plus these two
INPUTS_KEY = "_inputs"  # and, under DP, the keyed fingerprints of its inputs (fedtune.fingerprint)
RUN_CONFIG = "run_config.json"  # the config the run started with, as fedtune read it (resume compares)
MAY_CHANGE_ON_RESUME = {"rounds", "output_dir", "name", "train.threads"}
MAY_CHANGE_PREFIXES = ("logging.",)  # where the metrics also go: a tracker added on resume gets every round


def check_unchanged(config: RunConfig, started_with: Path) -> None:
    """Refuse to resume with a config other than the one the run started with (config.toml edited,
    or a --set), naming the keys that differ, or without ``run_config.json`` to compare with;
    ``rounds`` may be raised (and the folder moved), and the trackers (``logging``) changed."""
    if not started_with.is_file():
        raise ConfigError(
            f"--resume: {str(started_with)!r} is missing, so the config cannot be checked against the one "
            "the run started with; start a new run instead"
        )
    try:
        before = flat_keys(json.loads(started_with.read_text()))
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        raise ConfigError(f"--resume: {str(started_with)!r} cannot be read ({exc})") from None
    now = flat_keys(config.model_dump(mode="json"))
    changed = sorted(
        k
        for k in before.keys() | now.keys()
        if before.get(k) != now.get(k) and k not in MAY_CHANGE_ON_RESUME and not k.startswith(MAY_CHANGE_PREFIXES)
    )
    if changed:
        raise ConfigError(
            f"--resume: the config differs from the one the run started with in {', '.join(changed)}; "
            "only rounds may change (start a new run under another name for the rest)"
        )


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


def _restore(checkpoint: Path, strategy, engine: Engine | None, rounds: int) -> tuple[int, dict | None]:
    """Load ``checkpoint`` into ``strategy`` and ``engine`` (None: its state is checked only); the
    round it holds and its record of the inputs' fingerprints (DP; None without). A checkpoint
    that does not fit this run (another model or rank, an edited method option, a damaged
    ``_round``, a non-finite array, more rounds done than ``rounds``, a DP release at another
    noise multiplier) stops with one line, before anything is written. Called on a freshly
    initialized strategy: its state is what this run would build."""
    state = load_state(checkpoint)
    where = f"--resume: {str(checkpoint)!r}"
    inputs = state.pop(INPUTS_KEY, None)
    done = state.pop(ROUND_KEY, None)
    if type(done) is not int or done < 1:
        raise ConfigError(f"{where}: {ROUND_KEY} = {done!r}, expected the last completed round (1 or more)")
    if done > rounds:
        raise ConfigError(f"--resume: rounds = {rounds} but {done} rounds are done; rounds may only be raised")
    engine_state = state.pop(ENGINE_KEY, {})
    _check_fits(strategy.state_dict(), state, where)
    _check_fits({}, engine_state, f"{where} {ENGINE_KEY}")
    try:
        if engine is not None:
            engine.load_state_dict(engine_state)
        strategy.load_state_dict(state)
    except ConfigError:  # already the one line (a DP release at another z)
        raise
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise ConfigError(
            f"--resume: {str(checkpoint)!r} does not fit this run's config.toml (was it edited? "
            f"{type(exc).__name__}: {exc})"
        ) from None
    return done, inputs if isinstance(inputs, dict) else None


def _check_inputs(checkpoint: Path, recorded: dict | None, digests: dict) -> None:
    """A DP resume sees the inputs its checkpoint fingerprinted (:mod:`fedtune.fingerprint`), else
    one line naming what changed: resuming would replay the run's secret noise on other inputs."""
    from fedtune.fingerprint import changed_inputs

    where = f"--resume: {str(checkpoint)!r}"
    if recorded is None:
        raise ConfigError(
            f"{where} is a DP checkpoint without a fingerprint of its inputs (written before fedtune checked them), "
            "so a resume could replay its secret noise on other data: start a new run"
        )
    try:
        changed = changed_inputs(recorded, digests)
    except ValueError as exc:
        raise ConfigError(f"{where}: {INPUTS_KEY} is damaged ({exc})") from None
    if changed:
        raise ConfigError(
            f"--resume: this DP run's inputs changed since its checkpoint: {'; '.join(changed)}. Resuming would "
            "replay its secret noise on other inputs (the two releases' difference is noise-free): start a new run"
        )


def _resumable_keys(config: RunConfig) -> dict:
    """The resolved config's flat keys that a resume may not change (a DP run fingerprints them)."""
    return {k: v for k, v in flat_keys(config.model_dump(mode="json")).items() if k not in MAY_CHANGE_ON_RESUME}


def _operator(note: str) -> None:
    """A line for the operator's console (stderr), never the run folder: what a DP run may not
    write but its operator must know."""
    print(f"warning: {note}", file=sys.stderr, flush=True)


def _check_fits(built: dict, stored: dict, where: str, path: str = "") -> None:
    """``stored`` (a checkpoint's state) holds the arrays of ``built`` (what this run builds) by the
    same names, shapes (but where the built one is empty: a record that grows) and dtypes, and the
    same ``rank``; every stored float array is finite."""
    for key, value in stored.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "fc" and not np.isfinite(value).all():
            raise ConfigError(f"{where}: {path}{key} holds NaN or inf; the checkpoint is damaged")
    names = {k for k, v in built.items() if isinstance(v, np.ndarray)}
    stored_names = {k for k, v in stored.items() if isinstance(v, np.ndarray)}
    if names and names != stored_names:
        odd = sorted(names ^ stored_names)[:3]
        raise ConfigError(f"{where}: arrays under {path or '/'} differ from this run's ({', '.join(odd)}, ...)")
    for key, value in built.items():
        have = stored.get(key)
        grows = isinstance(value, np.ndarray) and value.size == 0  # a record that fills as rounds go
        if isinstance(value, np.ndarray) and (have.dtype != value.dtype or (have.shape != value.shape and not grows)):
            raise ConfigError(
                f"{where}: {path}{key} is {have.dtype}{list(have.shape)}, this run builds "
                f"{value.dtype}{list(value.shape)} (another model, rank or option)"
            )
        if isinstance(value, dict) and value and not isinstance(have, dict):
            raise ConfigError(f"{where}: {path}{key} is missing; this run builds it")
        if key == "rank" and have != value:
            raise ConfigError(f"{where}: {path}rank = {have!r}, this run's is {value!r}")
    for key, value in stored.items():
        if isinstance(value, dict):
            _check_fits(built.get(key) if isinstance(built.get(key), dict) else {}, value, where, f"{path}{key}/")


def read_metrics(path: Path, where: str = "--resume") -> list[dict]:
    """The rounds of ``metrics.jsonl`` (resume, export's model card); a missing or damaged file stops
    with one line naming it (``where``: what read it). A last line without its newline is a line
    whose write was cut short (a full disk, a kill): its round comes after the checkpoint's and is
    left out."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: {str(path)!r} cannot be read ({exc})") from None
    lines = []
    complete = text[: text.rfind("\n") + 1]
    for n, raw in enumerate(complete.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
            int(line["round"])
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ConfigError(
                f"{where}: {str(path)!r} line {n} is not a round's metrics line (the file is damaged: restore it, "
                "or remove that line)"
            ) from None
        lines.append(line)
    return lines


def _read_inputs(
    run: ResolvedRun, server: RunContext, engine: Engine | None, resume: bool
) -> tuple[Any, dict, dict[str, str], list[dict], dict | None]:
    """Every input of ``run`` read and checked, nothing written: the initialized strategy (the
    model loaded), the label histograms (the data read), the task's run files (the data
    partitioned; the budget plan checked), on ``resume`` the metrics lines up to the checkpoint,
    whose state is loaded into the strategy and ``engine`` (None: checked only), and under DP the
    keyed fingerprints of the inputs (a resume's checked against its checkpoint's). A bad input
    raises a one-line :class:`~fedtune.config.ConfigError`."""
    config, run_dir = run.config, run.run_dir
    checkpoint, metrics_path = run_dir / "checkpoint.npz", run_dir / "metrics.jsonl"
    if resume:
        if not checkpoint.is_file():
            raise ConfigError(
                f"--resume {str(run_dir)!r}: no round has completed there (no checkpoint.npz), so there is "
                "nothing to resume: run it afresh without --resume and with --overwrite (moves this folder aside), "
                "or under another name"
            )
        check_unchanged(config, run_dir / RUN_CONFIG)
    strategy = server.strategy()
    strategy.initialize()  # loads the model: a bad model.name stops here, before any output
    histograms = {"label_names": server.task.label_names, "clients": server.histograms()}  # reads the data
    run_files = server.task.run_files()  # and partitions it: a bad file or partition stops here too
    if engine is not None:  # the budgets the nodes report (Flower: discovers the nodes), before the plan is read
        engine.prepare(server)
    server.check_plan()  # a budget plan that leaves no round able to aggregate stops here too
    digests = None
    if config.privacy.mode != "none":  # every input of a release, before a checkpoint's state replaces it
        from fedtune.fingerprint import fresh_key, input_digests, keyed

        digests = input_digests(server, strategy, _resumable_keys(config))
    lines: list[dict] = []
    reproducible = config.seed if config.privacy.insecure_reproducible_noise else None
    inputs = None if digests is None else keyed(digests, fresh_key(reproducible))
    if resume:
        done, inputs = _restore(checkpoint, strategy, engine, config.rounds)
        if digests is not None:
            _check_inputs(checkpoint, inputs, digests)
        lines = [x for x in read_metrics(metrics_path) if x["round"] <= done]  # a round after it is redone
        if [x["round"] for x in lines] != list(range(1, done + 1)):
            raise ConfigError(
                f"--resume: {str(metrics_path)!r} does not hold rounds 1-{done} once each, as the checkpoint does"
            )
    return strategy, histograms, run_files, lines, inputs


def check_inputs(run: ResolvedRun, resume: bool = False) -> None:
    """Read and check every input of ``run`` as :func:`run_experiment` does before it writes
    anything (the data read and partitioned, the model loaded, the budget plan; on ``resume`` the
    config against the run's, the checkpoint, its DP fingerprints and ``metrics.jsonl``), and write
    nothing: for a launcher whose run happens in another process (the Flower engines), so that a
    bad input stops in one line before any process starts or the run folder is touched."""
    _read_inputs(run, RunContext(run), None, resume)


def run_experiment(
    run: RunConfig | ResolvedRun,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[RunContext], None] | None = None,
    engine: Engine | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict:
    """Run ``run`` (a resolved run, or a config resolved here) and return the summary (also in
    ``summary.json``). ``engine`` runs the rounds (default:
    :class:`~fedtune.engines.embedded.EmbeddedEngine`, clients in this process or spread over
    ``federation.client_devices``).

    After every round the metrics line is appended and ``checkpoint.npz`` is rewritten
    atomically: the strategy's state, plus the round (``_round``) and the engine's state
    (``_engine``: the embedded engine's client states). ``resume``
    continues a run folder from its last checkpointed round; the rounds are seeded by (seed,
    round, client) alone, so a resumed run ends bit-identical to an uninterrupted one. Ctrl-C
    stops after the current round's checkpoint (:class:`~fedtune.engines.rounds.RunInterrupted`).

    Every input is read and checked before the run folder is touched (the data, the model, the
    budget plan; a privacy budget below one round's epsilon at resolve time); a fresh run never writes
    into a folder holding an earlier run (:class:`~fedtune.run_folder.RunFolderTaken`, raised
    before any data or model is read), unless ``overwrite``, which moves that run aside; the folder
    is locked while the run writes it (:func:`~fedtune.run_folder.claimed`: a second process is
    refused, :class:`~fedtune.run_folder.RunFolderInUse`)."""
    start = time.perf_counter()
    run = as_resolved(run)
    config = run.config  # resolved: the task's defaults filled in
    setup_process(config.train.threads)
    check_installed(config)  # a tracker's package: before anything is read or written
    run_dir = run.run_dir
    check_unlocked(run_dir)  # before any data or model is read: a refusal costs nothing
    if not (resume or overwrite):
        check_free(run_dir)
    server = RunContext(run)
    checkpoint = run_dir / "checkpoint.npz"
    metrics_path = run_dir / "metrics.jsonl"
    engine = engine or EmbeddedEngine(run, server)
    strategy, histograms, run_files, lines, inputs = _read_inputs(run, server, engine, resume)
    start_round = len(lines) + 1
    private = config.privacy.mode != "none"
    with claimed(run_dir, resume, overwrite):  # locked while the run writes it
        if not resume:  # every input is checked: the folder is touched from here on
            create(run_dir, {"config.toml": _toml(config), RUN_CONFIG: json.dumps(config.model_dump(mode="json"))})
        if config.privacy.mode == "none":  # per-client label counts: not released by a DP run
            write_text(run_dir / "label_histograms.json", json.dumps(histograms))
        plan_text = None
        if server.plan is not None and not (private and server.reports.node):
            # under DP a plan from the nodes' own reports is not released: it names who reported what
            from fedtune.planning.planner import plan_json

            plan_text = plan_json(server.plan)
            write_text(run_dir / "plan.json", plan_text)
        for name, text in run_files.items():
            write_text(run_dir / name, text)
        if on_start is not None:
            on_start(server)

        def kept(rnd: int) -> str:  # what a failed write leaves, and the way on
            if rnd < 1:
                return "; no round completed"
            return (
                f"; rounds 1-{rnd} are checkpointed: free space or fix the folder, then fedtune run --resume {run_dir}"
            )

        trackers = Trackers(config, run_dir, resume)  # logging.to: they get what the run folder gets
        trackers.start(config, _toml(config), plan_text, lines)
        stopped = None
        contributed = [0, 0]  # rounds this process ran, and of them those some client's update reached
        stop_requested, restore = _interrupt_flag()
        try:
            if resume:  # the lines up to the checkpoint, written atomically, then appended to
                tmp = metrics_path.with_suffix(".jsonl.tmp")
                with writing(tmp, kept(start_round - 1)):
                    tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))
                    tmp.replace(metrics_path)
            with writing(metrics_path, kept(start_round - 1)):
                sink = metrics_path.open("a" if resume else "w")
            with sink:

                def record(rec: RoundRecord) -> None:
                    line = rec.to_json()
                    lines.append(line)
                    for note in rec.notes:  # a private round's drops: the operator's console only
                        _operator(f"round {rec.round}: {note}")
                    contributed[0] += 1
                    contributed[1] += bool(set(rec.clients) - set(rec.dropped))
                    with writing(metrics_path, kept(rec.round - 1)):
                        sink.write(json.dumps(line) + "\n")
                        sink.flush()
                    state = {**strategy.state_dict(), ROUND_KEY: rec.round, ENGINE_KEY: engine.state_dict()}
                    if inputs is not None:
                        state[INPUTS_KEY] = inputs
                    with writing(checkpoint, kept(rec.round - 1)):
                        save_state(checkpoint, state, private=config.privacy.mode != "none")  # DP: holds secrets
                    trackers.round(line)  # the line just written (under DP: the mechanism's release), checkpointed
                    if on_round is not None:
                        on_round(rec)

                try:
                    engine.run(strategy, record, start_round, stop_requested)
                except RunHalted as halt:
                    if not lines:
                        raise ConfigError(str(halt)) from None
                    stopped = str(halt)
            restore()  # Ctrl-C as before the run from here on
            last = lines[-1]["round"] if lines else 0
            with writing(run_dir, kept(last)):
                strategy.save(run_dir)
            summary = _summary(config, lines, server, run_dir, time.perf_counter() - start, engine.name)
            summary.update(strategy.summary())
            if stopped is not None:
                summary["stopped"] = stopped
            with writing(run_dir / "summary.json", kept(last)):
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            trackers.finish(summary)
        except BaseException:
            trackers.close(ok=False)
            raise
        finally:
            restore()
            if private and contributed[0] and not contributed[1]:
                _operator(
                    f"no client's update reached this DP run's aggregate in its {contributed[0]} round(s) here: every "
                    "release was noise alone (every client failed or was dropped, or none was sampled)"
                )
        trackers.close(ok=True)
        return summary
