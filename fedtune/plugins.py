"""Methods, task kinds and combiners from the user's own package, found without editing fedtune.

Two ways, all registering through the same :func:`fedtune.registry.register` /
:func:`fedtune.tasks.register_task` / :func:`fedtune.methods.base.robust.register_combiner` as
fedtune's own:

- an entry point: a distribution declares ``[project.entry-points."fedtune.methods"] NAME =
  "my_pkg.method"`` (or ``"fedtune.tasks"``, ``"fedtune.combiners"``); importing the module
  registers it. They are imported when a name is not one of fedtune's, and by ``fedtune methods
  -v`` / ``fedtune tasks`` / ``fedtune combiners``.
- a reference in the config: ``method = "my_pkg.method:NAME"`` (``task.kind``,
  ``robust.aggregation`` likewise) imports ``my_pkg.method`` and looks ``NAME`` up.

A module that fails to import stops with one line naming it. This module imports nothing of
fedtune at load: ``fedtune methods`` lists the entry points without pydantic or torch.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points

METHODS, TASKS, COMBINERS = "fedtune.methods", "fedtune.tasks", "fedtune.combiners"  # the entry-point groups


def declared(group: str) -> list[EntryPoint]:
    """The entry points of ``group`` the installed distributions declare (nothing imported)."""
    return sorted(entry_points(group=group), key=lambda ep: ep.name)


def source(ep: EntryPoint) -> str:
    """Where an entry point comes from: ``module (distribution version)``."""
    dist = ep.dist
    return f"{ep.module} ({dist.name} {dist.version})" if dist is not None else ep.module


def _error(message: str) -> Exception:
    from fedtune.config import ConfigError

    return ConfigError(message)


def _import(module: str, what: str) -> None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's code: any failure is one line
        raise _error(f"{what}: cannot import {module!r} ({type(exc).__name__}: {exc})") from None


def load_declared(group: str, field: str = "") -> None:
    """Import every module the entry points of ``group`` name (each registers what it declares);
    ``field``: the config key a failure's line starts with, if any."""
    for ep in declared(group):
        _import(ep.module, f"{field}: " * bool(field) + f"entry point {ep.name!r} of {group}")


def resolve_reference(name: str, what: str) -> str:
    """``name`` as registered: ``"my_pkg.module:NAME"`` imports ``my_pkg.module`` and gives ``NAME``;
    a plain name is returned as it is."""
    if ":" not in name:
        return name
    module, _, registered = name.partition(":")
    if not module or not registered:
        raise _error(f"{what}: {name!r} is not module:NAME")
    _import(module, what)
    return registered
