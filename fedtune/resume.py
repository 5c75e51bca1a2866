"""Checking a resume before anything is written: the config is the one the run started with
(``run_config.json``), the checkpoint fits this run (:func:`restore`), a DP run's inputs are the ones
its checkpoint fingerprinted (:func:`check_fingerprints`), and ``metrics.jsonl`` holds each round up to
the checkpoint's once (:func:`read_metrics`). Each refusal is one :class:`~fedtune.config.ConfigError`
line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError, RunConfig, flat_keys
from fedtune.config.legacy import as_before_split, split_federation, without_added
from fedtune.engines.rounds import Engine

ROUND_KEY, ENGINE_KEY = "_round", "_engine"  # checkpoint.npz: the strategy's state plus these two
INPUTS_KEY = "_inputs"  # and, under DP, the keyed fingerprints of its inputs (fedtune.fingerprint)
RUN_CONFIG = "run_config.json"  # the config the run started with, as fedtune read it (resume compares)
MAY_CHANGE_ON_RESUME = {"rounds", "output_dir", "name", "train.threads"}
MAY_CHANGE_PREFIXES = ("logging.",)  # where the metrics also go: a tracker added on resume gets every round


def check_unchanged(config: RunConfig, started_with: Path) -> None:
    """Refuse to resume with a config other than the one the run started with (config.toml edited,
    or a --set), naming the keys that differ, or without ``run_config.json`` to compare with;
    ``rounds`` may be raised (and the folder moved), and the trackers (``logging``) changed. A
    ``run_config.json`` written before ``[federation]``'s split is read with its keys moved
    (:func:`~fedtune.config.legacy.split_federation`), and one written before a key was added
    (:data:`~fedtune.config.legacy.ADDED`) ran with that key's value then."""
    if not started_with.is_file():
        raise ConfigError(
            f"--resume: {str(started_with)!r} is missing, so the config cannot be checked against the one "
            "the run started with; start a new run instead"
        )
    try:
        before = without_added(flat_keys(split_federation(json.loads(started_with.read_text()), warn=False)))
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        raise ConfigError(f"--resume: {str(started_with)!r} cannot be read ({exc})") from None
    now = without_added(flat_keys(config.model_dump(mode="json")))
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


def restore(checkpoint: Path, strategy, engine: Engine | None, rounds: int) -> tuple[int, dict | None]:
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


def check_fingerprints(checkpoint: Path, recorded: dict | None, digests: dict) -> None:
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


def resumable_keys(config: RunConfig) -> dict:
    """The resolved config's flat keys that a resume may not change (a DP run fingerprints them),
    named as before ``[federation]``'s split (:func:`~fedtune.config.legacy.as_before_split`): a DP
    checkpoint written then fingerprinted those names, and its resume must see the same config; a key
    added since (:data:`~fedtune.config.legacy.ADDED`) is left out at the value such a run had."""
    flat = as_before_split(without_added(flat_keys(config.model_dump(mode="json"))))
    return {k: v for k, v in flat.items() if k not in MAY_CHANGE_ON_RESUME}


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
        if isinstance(value, np.ndarray) and isinstance(have, np.ndarray):  # have is one: the names matched
            grows = value.size == 0  # a record that fills as rounds go
            if have.dtype != value.dtype or (have.shape != value.shape and not grows):
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
            inner = built.get(key)
            _check_fits(inner if isinstance(inner, dict) else {}, value, where, f"{path}{key}/")


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


def resumed_lines(path: Path, done: int) -> list[dict]:
    """The lines of ``metrics.jsonl`` at ``path`` up to round ``done``, the checkpoint's (a round
    after it is redone): rounds 1 to ``done`` once each, else one line naming the file."""
    lines = [x for x in read_metrics(path) if x["round"] <= done]
    if [x["round"] for x in lines] != list(range(1, done + 1)):
        raise ConfigError(f"--resume: {str(path)!r} does not hold rounds 1-{done} once each, as the checkpoint does")
    return lines
