"""What a method sees of its process: the context protocols a Strategy and a Client are built on.

The engines build one :class:`fedtune.runtime.RunContext` per process (the config, the method's
options, the task with its cached data and base model) and hand it to every strategy and client of
that process; a method reads it only through these protocols, so each attribute it reads has a type
and a reader can see all it may touch. :class:`ClientContext` is what a client reads (the run's
config and resolved parts, the task, the shared LoRA workspace, the base model, the seeded
partition); :class:`ServerContext` adds what only the server knows of every client (the planned
profiles, the bound on a reply's ``num_examples``). The budget planner's own, wider view
(:class:`fedtune.planning.spec.PlanningContext`: the model's skeleton, the nodes' reports, the
priced knob) extends :class:`ServerContext`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel

from fedtune.protocol.profiles import ClientProfile

if TYPE_CHECKING:
    import torch

    from fedtune.config import RunConfig
    from fedtune.models.lora import LoraWorkspace
    from fedtune.tasks.base import Task


class ResolvedView(Protocol):
    """What a method reads of the resolved run (:class:`fedtune.runtime.ResolvedRun`)."""

    @property
    def run_dir(self) -> Path:
        """The run folder (a method's own artifacts, such as FedPFT's proxy, go there)."""
        ...

    @property
    def profiles(self) -> tuple[ClientProfile, ...]:
        """Each client's profile as the config states it (before the budget plan)."""
        ...

    @property
    def aggregation(self) -> object:
        """The server's aggregation plan (:class:`fedtune.methods.base.aggregation.AggregationPlan`, a
        layer above this one: :func:`fedtune.methods.base.aggregation.planned` reads it typed)."""
        ...


class PlanView(Protocol):
    """What a client's measured fit reads of its method's plan (:class:`fedtune.planning.spec.PlanSpec`)."""

    @property
    def peak(self) -> str:
        """How the client's measured peak is made (:data:`fedtune.planning.spec.PeakMode`)."""
        ...


class MethodView(Protocol):
    """What a process reads of its run's method (:class:`fedtune.registry.MethodSpec`)."""

    @property
    def name(self) -> str:
        """The method's registered name."""
        ...

    @property
    def honours(self) -> frozenset[str]:
        """The cross-method options it honours (:data:`fedtune.registry.CROSS_METHOD_OPTIONS`)."""
        ...

    @property
    def plan(self) -> PlanView | None:
        """Its budget plan (None: client budgets are not planned for it)."""
        ...


class ClientContext(Protocol):
    """What a client reads of its process's run context (:class:`fedtune.runtime.RunContext`, or the
    same seen with a base of the client's own format)."""

    @property
    def config(self) -> RunConfig:
        """The run's resolved config."""
        ...

    @property
    def options(self) -> BaseModel:
        """The method's own options (its registered :class:`fedtune.registry.MethodOptions` class;
        a method declares ``options`` as that class)."""
        ...

    @property
    def run(self) -> ResolvedView:
        """The resolved run."""
        ...

    @property
    def method(self) -> MethodView:
        """The run's method."""
        ...

    @property
    def task(self) -> Task:
        """The task: its data (prepared once per process), model builder, loss and metrics."""
        ...

    @property
    def workspace(self) -> LoraWorkspace:
        """The base model with LoRA adapters by rank (LoRA methods), shared by the process."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """The task's base model, for methods that train it directly (no LoRA)."""
        ...

    @property
    def partitions(self) -> list[np.ndarray]:
        """Client id -> indices into the task's training pool (seeded)."""
        ...


class ServerContext(ClientContext, Protocol):
    """What a strategy reads of its process's run context: a client's view and what the server
    knows of every client."""

    @property
    def profiles(self) -> list[ClientProfile]:
        """Each client's profile, with the planned knob where clients state budgets."""
        ...

    def example_bound(self, kind: str, cid: int) -> int:
        """The most examples client ``cid`` can stand for in a reply of ``kind`` ("train",
        "evaluate" or a phase)."""
        ...


OptionsT = TypeVar("OptionsT", bound=BaseModel)


def options_as(context: ClientContext, cls: type[OptionsT]) -> OptionsT:
    """``context``'s method options as ``cls``, the class the method registered (what a helper
    object of the method reads them as); TypeError when they are another class's."""
    options = context.options
    if not isinstance(options, cls):
        raise TypeError(f"the run's method options are {type(options).__name__}, not {cls.__name__}")
    return options
