"""Method registry: name -> (Strategy class, Client class, options Config class).

A method module registers itself with :func:`register`; the engines look methods up by name
and never branch on it.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from fedtune.config import ConfigError
from fedtune.federation.client import Client
from fedtune.federation.strategy import Strategy


class MethodOptions(BaseModel):
    """Base for a method's own options (the ``[options]`` table of a recipe)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    strategy: type[Strategy]
    client: type[Client]
    options: type[MethodOptions]
    description: str


_METHODS: dict[str, MethodSpec] = {}


def register(
    name: str,
    strategy: type[Strategy],
    client: type[Client],
    options: type[MethodOptions] = MethodOptions,
    description: str = "",
) -> MethodSpec:
    """Register a method under ``name`` (re-registering a name replaces it)."""
    spec = MethodSpec(name, strategy, client, options, description or (strategy.__doc__ or "").strip().split("\n")[0])
    _METHODS[name] = spec
    return spec


def _load_builtin_methods() -> None:
    import fedtune.methods as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{info.name}")


def get_method(name: str) -> MethodSpec:
    _load_builtin_methods()
    if name not in _METHODS:
        raise ConfigError(f"method: unknown method {name!r}; expected one of {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def list_methods() -> list[MethodSpec]:
    _load_builtin_methods()
    return [_METHODS[k] for k in sorted(_METHODS)]
