"""The methods, by name. Each module or package here (one per method family) registers its methods
with :func:`fedtune.registry.register`; :func:`get_method` and :func:`list_methods` import them all
first. :mod:`fedtune.methods.base` holds what several methods share and is never scanned: only
modules that register are methods.
"""

from __future__ import annotations

import importlib
import pkgutil

from fedtune.config import ConfigError
from fedtune.plugins import METHODS, load_declared, resolve_reference
from fedtune.registry import _METHODS, MethodSpec

SHARED_PACKAGES = frozenset({"base"})  # fedtune.methods.<these>: shared bases, never scanned for methods


def _load_builtin_methods() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name not in SHARED_PACKAGES:
            importlib.import_module(f"{__name__}.{info.name}")


def get_method(name: str) -> MethodSpec:
    """The method ``name``: fedtune's own, one an installed package declares (entry point group
    ``fedtune.methods``), or ``"my_pkg.module:NAME"`` (:mod:`fedtune.plugins`)."""
    _load_builtin_methods()
    key = resolve_reference(name, "method")
    if key not in _METHODS:
        load_declared(METHODS)
    if key not in _METHODS:
        raise ConfigError(f"method: unknown method {name!r}; expected one of {', '.join(sorted(_METHODS))}")
    return _METHODS[key]


def list_methods(plugins: bool = False) -> list[MethodSpec]:
    """fedtune's own methods (``plugins``: and those the installed packages declare), by name."""
    _load_builtin_methods()
    if plugins:
        load_declared(METHODS)
    return [_METHODS[k] for k in sorted(_METHODS)]
