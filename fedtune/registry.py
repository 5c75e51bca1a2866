"""Method registry: name -> (Strategy class, Client class, options Config class, what it needs).

A method module registers itself with :func:`register`; the engines look methods up by name
(:func:`fedtune.methods.get_method`, which first imports every module and package of
:mod:`fedtune.methods` except :mod:`fedtune.methods.base`, what several methods share) and never
branch on it. A method is what registers; a name registered twice is an error naming both modules.
A method names the task capabilities it needs (``requires``: for example ``"lora"``, a model with
LoRA targets); it runs on every task kind that offers them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from fedtune.config import ConfigError, RunConfig
from fedtune.config.legacy import moved_key, note_moved
from fedtune.errors import FedtuneError
from fedtune.planning.spec import PlanSpec
from fedtune.protocol.client import Client
from fedtune.protocol.strategy import Strategy
from fedtune.tasks import get_task_class, list_tasks
from fedtune.tasks.base import Task


class MethodOptions(BaseModel):
    """Base for a method's own options (the ``[options]`` table of a recipe)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite
    #: where the method departs from its paper (option or behaviour -> one line; ``fedtune methods --verbose``)
    deviations: ClassVar[dict[str, str]] = {}

    def privacy_refusal(self) -> str | None:
        """For a method that honours ``privacy.mode``: one line naming the option of these whose
        setting has no DP form, else None (a rule of :data:`fedtune.config.RULES`)."""
        return None

    def secure_refusal(self) -> str | None:
        """For a method that honours ``secure_aggregation.enabled``: one line naming the option
        of these whose setting makes the server step more than a weighted sum (a rule of
        :data:`fedtune.config.RULES`), else None."""
        return None

    def config_refusal(self, config: RunConfig) -> str | None:
        """One line naming the setting of ``config`` (or of these options) the method cannot run
        with, from the config alone, else None: a rule of :data:`fedtune.config.RULES`, refused at
        resolve, before any model loads."""
        return None


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its Strategy, Client and options classes, a one-line description, the
    task capabilities it requires, the module that registered it, the cross-method options it honours
    and its plan (:class:`~fedtune.planning.spec.PlanSpec`: the knob client budgets set and its cost
    model; None: client budgets are not planned for it)."""

    name: str
    strategy: type[Strategy]
    client: type[Client]
    options: type[MethodOptions]
    description: str
    requires: frozenset[str] = frozenset()
    module: str = ""  # the module that registered it
    honours: frozenset[str] = frozenset()  # the CROSS_METHOD_OPTIONS it supports
    plan: PlanSpec | None = None

    def missing(self, capabilities: frozenset[str]) -> frozenset[str]:
        """What the method needs that ``capabilities`` lacks."""
        return self.requires - capabilities

    def supports(self, kind: str) -> bool:
        """Whether the method runs on task ``kind`` (with some model of it)."""
        return not self.missing(get_task_class(kind).capabilities)

    def supported_tasks(self) -> list[str]:
        """The registered task kinds this method runs on."""
        return [t.kind for t in list_tasks() if not self.missing(t.capabilities)]

    def supports_config(self, config: RunConfig) -> bool:
        """Whether the method runs on ``config``'s task with ``config``'s model."""
        return not self.missing(get_task_class(config.task.kind).capabilities_for(config))

    def check(self, task_class: type[Task], config: RunConfig | None = None) -> None:
        """Stop with one line when the method cannot run on ``task_class`` or, given ``config`` (a
        config of that task), on ``config``'s model of it."""
        need = self.missing(task_class.capabilities)
        if need:
            raise ConfigError(
                f"method {self.name!r} does not support task {task_class.kind!r} "
                f"(it needs: {', '.join(sorted(need))}); "
                f"its tasks are {', '.join(self.supported_tasks()) or 'none'}"
            )
        if config is None:
            return
        need = self.missing(task_class.capabilities_for(config))
        if need:
            raise ConfigError(
                f"method {self.name!r} does not support model {config.model.name!r} of task {task_class.kind!r} "
                f"(it needs: {', '.join(sorted(need))})"
            )

    def check_options(self, config: RunConfig) -> None:
        """Stop with one line when ``config`` sets a cross-method option the method does not honour
        (:data:`CROSS_METHOD_OPTIONS`): never accepted and silently ignored."""
        for option, in_use in CROSS_METHOD_OPTIONS.items():
            if in_use(config) and option not in self.honours:
                honoured = ", ".join(sorted(self.honours)) or "none"
                raise ConfigError(
                    f"{option}: method {self.name!r} does not support it (its cross-method options: {honoured})"
                )

    def check_task(self, kind: str) -> None:
        """Stop with one line when the method cannot run on task ``kind`` (any model)."""
        self.check(get_task_class(kind))

    def check_config(self, config: RunConfig) -> None:
        """Stop with one line when the method cannot run on ``config``'s task and model."""
        self.check(get_task_class(config.task.kind), config)


#: Options outside a method's own ``[options]`` that change what its server or clients do: a method
#: declares those it honours (``register(..., supports=...)``); any other one, set to anything but
#: its default, stops the run with one line naming the method and the option.
CROSS_METHOD_OPTIONS: dict[str, Callable[[RunConfig], bool]] = {
    "server.optimizer": lambda config: not config.server.plain_step(),
    "federation.upload_topk": lambda config: config.federation.upload_topk is not None,
    "robust.aggregation": lambda config: config.robust.aggregation != "mean",
    "robust.clip_update_norm": lambda config: config.robust.clip_update_norm is not None,
    "robust.max_client_weight": lambda config: config.robust.max_client_weight is not None,
    "federation.wire_dtype": lambda config: config.federation.wire_dtype != "float32",
    "model.dtype": lambda config: config.model.dtype != "float32",
    "model.quantization": lambda config: config.model.quantization != "none",
    "train.gradient_checkpointing": lambda config: config.train.gradient_checkpointing,
    "device": lambda config: _accelerated(config.device),
    "privacy.mode": lambda config: config.privacy.mode != "none",
    "secure_aggregation.enabled": lambda config: config.secure_aggregation.enabled,
}


def _current_name(option: str, method: str) -> str:
    """``option`` (a cross-method option ``method`` declares) under its name since ``[federation]``'s
    split: an old one (``federation.aggregation``) noted and mapped (:mod:`fedtune.config.legacy`)."""
    new = moved_key(option)
    if new != option:
        note_moved(option, new, f"register({method!r}, supports=...)")
    return new


def _accelerated(device: str) -> bool:
    """Whether ``device`` puts models on an accelerator here (``auto`` on a CPU-only machine does not)."""
    from fedtune.models.precision import resolve_device

    return resolve_device(device).type != "cpu"


_METHODS: dict[str, MethodSpec] = {}


class DuplicateMethodError(FedtuneError):
    """Two modules registered the same method name."""


def register(
    name: str,
    strategy: type[Strategy],
    client: type[Client],
    options: type[MethodOptions] = MethodOptions,
    description: str = "",
    requires: tuple[str, ...] = (),
    supports: tuple[str, ...] = (),
    plan: PlanSpec | None = None,
) -> MethodSpec:
    """Register a method under ``name``: its ``strategy``, ``client`` and ``options`` classes, a
    one-line ``description`` (default: the first line of the strategy's docstring); ``requires``: the
    task capabilities it needs (``("lora",)`` for a LoRA method); ``supports``: the
    :data:`CROSS_METHOD_OPTIONS` it honours; ``plan``: its knob and cost model for client budgets
    (:class:`~fedtune.planning.spec.PlanSpec`). A name that is already registered raises
    :class:`DuplicateMethodError`."""
    supports = tuple(_current_name(option, name) for option in supports)
    unknown = set(supports) - set(CROSS_METHOD_OPTIONS)
    if unknown:
        raise ValueError(f"register({name!r}): unknown cross-method options {sorted(unknown)}")
    module = sys._getframe(1).f_globals.get("__name__", "?")
    if name in _METHODS:
        raise DuplicateMethodError(f"method {name!r} is registered twice: by {_METHODS[name].module} and by {module}")
    doc = description or (strategy.__doc__ or "").strip().split("\n")[0]
    spec = MethodSpec(name, strategy, client, options, doc, frozenset(requires), module, frozenset(supports), plan)
    _METHODS[name] = spec
    return spec
