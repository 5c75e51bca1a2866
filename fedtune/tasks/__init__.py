"""Task kinds by name: each module of this package registers its :class:`~fedtune.tasks.base.Task`
(with :func:`~fedtune.tasks.base.register_task`); this package finds the modules and looks kinds up.

fedtune tasks                      # the kinds, one line each
fedtune run --set task=image-classification --set method=fedavg
"""

from __future__ import annotations

import importlib
import pkgutil

from fedtune.config import ConfigError, DataConfig, ModelConfig, RunConfig, validate_options
from fedtune.plugins import TASKS, load_declared, resolve_reference
from fedtune.tasks.base import _TASKS, Task, TaskOptions, register_task


def _load_builtin_tasks() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


def get_task_class(kind: str) -> type[Task]:
    """The task kind ``kind``: fedtune's own, one an installed package declares (entry point group
    ``fedtune.tasks``), or ``"my_pkg.module:KIND"`` (:mod:`fedtune.plugins`)."""
    _load_builtin_tasks()
    key = resolve_reference(kind, "task.kind")
    if key not in _TASKS:
        load_declared(TASKS)
    if key not in _TASKS:
        raise ConfigError(f"task.kind: unknown task {kind!r}; expected one of {', '.join(sorted(_TASKS))}")
    return _TASKS[key]


def list_tasks(plugins: bool = False) -> list[type[Task]]:
    """fedtune's own task kinds (``plugins``: and those the installed packages declare), by kind."""
    _load_builtin_tasks()
    if plugins:
        load_declared(TASKS)
    return [_TASKS[k] for k in sorted(_TASKS)]


def resolve_config(config: RunConfig) -> RunConfig:
    """``config`` with the task's defaults filled in where the recipe left them out
    (``data.name``, ``model.name``), so the run folder's config.toml names everything."""
    task = get_task_class(config.task.kind)
    updates: dict[str, DataConfig | ModelConfig] = {}
    for section, current in (("data", config.data), ("model", config.model)):
        value = task.defaults.get(f"{section}.name")
        if current.name is None and value is not None:
            updates[section] = current.model_copy(update={"name": value})
    return config.model_copy(update=updates) if updates else config


def build_task(config: RunConfig) -> Task:
    """The Task of ``config`` (resolved), its options checked (errors name ``task.<field>``)."""
    cls = get_task_class(config.task.kind)
    return cls(config, validate_options(config.task.options, cls.Options, prefix="task"))


__all__ = ["Task", "TaskOptions", "build_task", "get_task_class", "list_tasks", "register_task", "resolve_config"]
