"""The methods, by name. Each module or package here (one per method family) registers its methods
with :func:`fedtune.registry.register`; :func:`get_method` and :func:`list_methods` import them all
first. :mod:`fedtune.methods.base` holds what several methods share and is never scanned: only
modules that register are methods.
"""

from __future__ import annotations

import importlib
import pkgutil

from fedtune.config import ConfigError
from fedtune.registry import _METHODS, MethodSpec

SHARED_PACKAGES = frozenset({"base"})  # fedtune.methods.<these>: shared bases, never scanned for methods


def _load_builtin_methods() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name not in SHARED_PACKAGES:
            importlib.import_module(f"{__name__}.{info.name}")


def get_method(name: str) -> MethodSpec:
    _load_builtin_methods()
    if name not in _METHODS:
        raise ConfigError(f"method: unknown method {name!r}; expected one of {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def list_methods() -> list[MethodSpec]:
    _load_builtin_methods()
    return [_METHODS[k] for k in sorted(_METHODS)]
