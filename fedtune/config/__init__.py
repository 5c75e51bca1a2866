"""Typed run configuration: TOML recipes, ``key=value`` overrides, one-line errors.

A recipe is a TOML file whose tables mirror :class:`RunConfig`. A section given as a plain
string means its ``name`` (``data = "sst2"`` is ``[data] name = "sst2"``), so
``fedtune run --set method=fedit --set data=sst2`` works.

One module per part: :mod:`~fedtune.config.base` (the error, what sections share),
:mod:`~fedtune.config.sections` (task, data, model, train), :mod:`~fedtune.config.federation`
(``[federation]``, ``[placement]``), :mod:`~fedtune.config.aggregation` (``[server]``, ``[robust]``,
``[secure_aggregation]``), :mod:`~fedtune.config.legacy` (the keys from before ``[federation]``'s split),
:mod:`~fedtune.config.privacy`, :mod:`~fedtune.config.tracking` (``[logging]``),
:mod:`~fedtune.config.run_config` (the whole run and
:data:`~fedtune.config.run_config.RULES`, the rules across sections) and
:mod:`~fedtune.config.loading` (recipes and overrides).
"""

from fedtune.config.aggregation import RobustConfig, SecureAggregationConfig, ServerConfig
from fedtune.config.base import DEVICE, RUN_NAME, ConfigError, Section
from fedtune.config.federation import FederationConfig, PlacementConfig
from fedtune.config.legacy import KeyMovedWarning
from fedtune.config.loading import (
    SHORTHAND,
    apply_override,
    flat_keys,
    load_config,
    parse_value,
    validate_options,
    validated,
)
from fedtune.config.privacy import ADAPTIVE_CLIP_KEYS, PrivacyConfig
from fedtune.config.run_config import RULES, MethodRefusals, Rule, RunConfig, check_rules
from fedtune.config.sections import DataConfig, ModelConfig, TaskConfig, TrainConfig
from fedtune.config.tracking import LoggingConfig

__all__ = [
    "ADAPTIVE_CLIP_KEYS",
    "DEVICE",
    "RULES",
    "RUN_NAME",
    "SHORTHAND",
    "ConfigError",
    "DataConfig",
    "FederationConfig",
    "KeyMovedWarning",
    "LoggingConfig",
    "MethodRefusals",
    "ModelConfig",
    "PlacementConfig",
    "PrivacyConfig",
    "RobustConfig",
    "Rule",
    "RunConfig",
    "SecureAggregationConfig",
    "ServerConfig",
    "Section",
    "TaskConfig",
    "TrainConfig",
    "apply_override",
    "check_rules",
    "flat_keys",
    "load_config",
    "parse_value",
    "validate_options",
    "validated",
]
