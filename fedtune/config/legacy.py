"""The keys ``[federation]`` held before its split into ``[server]``, ``[robust]``, ``[placement]``
and ``[secure_aggregation]``: read for one more release, each mapped to its new place with a
one-line :class:`KeyMovedWarning` (once per key and process); a config that gives a key under both
names is refused. Run folders written before the split keep resuming: their ``run_config.json`` is
mapped the same way (silently), and a DP run's fingerprint of its config keys (:mod:`fedtune.resume`)
keeps the old names (:func:`as_before_split`)."""

from __future__ import annotations

import warnings
from typing import Any

from fedtune.config.base import ConfigError

#: ``federation.<old>`` -> (new section, new key)
MOVED: dict[str, tuple[str, str]] = {
    **{
        f"server_{k}": ("server", k)
        for k in ("optimizer", "lr", "momentum", "betas", "eps", "weight_decay", "bias_correction")
    },
    **{k: ("robust", k) for k in ("aggregation", "trim_fraction", "clip_update_norm", "max_client_weight")},
    "max_update_ratio": ("robust", "max_update_ratio"),
    **{k: ("placement", k) for k in ("client_devices", "gpus_per_client", "nodes")},
    "secure_aggregation": ("secure_aggregation", "enabled"),
    **{
        f"secagg_{k}": ("secure_aggregation", k)
        for k in ("clipping_range", "quantization_range", "modulus_range", "num_shares", "threshold")
    },
}
#: Keys added after run folders were written, with the value such a folder ran with: its
#: ``run_config.json`` lacks the key, and its DP checkpoint did not fingerprint it (:func:`without_added`).
ADDED: dict[str, Any] = {"server.momentum": 0.0}
_SEEN: dict[Any, Any] = {}  # the warnings registry that makes each note show once per process


class KeyMovedWarning(FutureWarning):
    """A config key read under its name from before ``[federation]`` was split."""


def moved_key(dotted: str) -> str:
    """``dotted`` (a ``--set`` key) under its new name: ``federation.server_lr`` -> ``server.lr``; any
    other key as it is."""
    section, _, key = dotted.partition(".")
    if section != "federation" or key not in MOVED:
        return dotted
    return ".".join(MOVED[key])


def note_moved(old: str, new: str, source: str) -> None:
    """Warn, once per process and key, that ``old`` (read from ``source``) is now ``new``."""
    warnings.warn_explicit(
        f"{old} is now {new} ({source}; the old key is read until the next release)",
        KeyMovedWarning,
        "fedtune",
        0,
        module="fedtune.config.legacy",
        registry=_SEEN,
    )


def split_federation(tree: dict[str, Any], source: str = "config", warn: bool = True) -> dict[str, Any]:
    """``tree`` (a config as read) with every old ``[federation]`` key moved to its new section
    (:data:`MOVED`), a new dict (``tree`` is left as it is); ``warn``: note each (:func:`note_moved`),
    naming ``source`` (where the tree was read).
    A key given under both names stops with one line naming both."""
    federation = tree.get("federation")
    if not isinstance(federation, dict) or not MOVED.keys() & federation.keys():
        return tree
    tree = {**tree, "federation": dict(federation)}
    for old in [k for k in federation if k in MOVED]:
        section, key = MOVED[old]
        target = tree.get(section, {})
        if isinstance(target, bool) and section == "secure_aggregation":  # `secure_aggregation = true`
            target = {"enabled": target}
        if not isinstance(target, dict):
            continue  # left where it is: validation names it
        if key in target:
            raise ConfigError(
                f"federation.{old} and {section}.{key}: both given ({source}); keep {section}.{key} "
                f"(federation.{old} is its old name)"
            )
        tree[section] = {**target, key: tree["federation"].pop(old)}
        if warn:
            note_moved(f"federation.{old}", f"{section}.{key}", source)
    return tree


def as_before_split(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` config keys (``{"server.lr": ...}``) under their names from before the split
    (``federation.server_lr``), so that what a DP checkpoint fingerprinted then matches now."""
    back = {".".join(new): f"federation.{old}" for old, new in MOVED.items()}
    return {back.get(k, k): v for k, v in flat.items()}


def without_added(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` config keys without those of :data:`ADDED` at the value a run folder written before
    them ran with: what such a folder's config and fingerprint hold."""
    return {k: v for k, v in flat.items() if not (k in ADDED and v == ADDED[k])}
