"""A RunConfig from Flower's run config (``flwr run -c ...``), parsed once per process and config."""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from fedtune.config import ConfigError, RunConfig, apply_override, load_config, validated
from fedtune.engines.flower.codec import ENGINE_KEYS


def config_from_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """:func:`parse_run_config` of ``run_config``, once per process and run config: a ClientApp asks for every
    request, and a node serves many (the same RunConfig object comes back; nobody mutates it)."""
    return _parsed(tuple(sorted(run_config.items())))


@lru_cache(maxsize=8)
def _parsed(items: tuple[tuple[str, Any], ...]) -> RunConfig:
    return parse_run_config(dict(items))


def parse_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from Flower's run config ``run_config`` (``flwr run -c ...``): ``recipe`` (a TOML path, may be
    empty), ``overrides`` (``"rounds=3; data.name=sst2"``, as ``fedtune run --set``) and dotted
    ``fedtune.<key> = value`` entries (``fedtune.rounds = 3``), applied in that order. The
    ServerApp's own keys (:data:`ENGINE_KEYS`) are read by :func:`make_server_app`."""
    overrides = [part.strip() for part in str(run_config.get("overrides", "")).split(";") if part.strip()]
    for key, value in run_config.items():
        if key.startswith("fedtune."):
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            overrides.append(f"{key.removeprefix('fedtune.')}={text}")
        elif key not in ("recipe", "overrides", "config", *ENGINE_KEYS):
            raise ConfigError(
                f"Flower run config {key!r}: expected 'recipe', 'config', 'overrides', 'fedtune.<key>' "
                f"or one of {ENGINE_KEYS}"
            )
    if run_config.get("config"):  # a whole RunConfig as JSON: what fedtune submits (no path to share)
        if run_config.get("recipe"):
            raise ConfigError("Flower run config: give 'recipe' or 'config', not both")
        tree = json.loads(run_config["config"])
        for assignment in overrides:
            apply_override(tree, assignment)
        return validated(RunConfig, tree)
    return load_config(run_config.get("recipe") or None, overrides)
