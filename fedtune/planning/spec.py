"""What a method registers for the planner (:class:`PlanSpec`): the profile field a planned client
varies and the method's cost model, which builds the run's :class:`Knob` (its ladder and each
setting's price). The method declares it next to its code (``register(..., plan=...)``);
:mod:`fedtune.planning.planner` searches any method's knob the same way and names no method."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from fedtune.protocol.context import MethodView, ServerContext
from fedtune.protocol.profiles import ClientProfile

if TYPE_CHECKING:
    import torch


@dataclass
class Knob:
    """What a method lets a client vary: its ladder (largest first), the value a profile states
    (None: unstated), each (value, gradient checkpointing, base format)'s (prediction, upload
    values), the setting's label, the profile field's value for a ladder value, and the
    checkpointing variants and base formats, (quantization, dtype), to try (the run's first; None:
    the knob prices one base); ``unstated``: what a client that states no value trains at (None:
    the ladder's first)."""

    ladder: list
    stated: Callable[[ClientProfile], Any]
    cost: Callable[[Any, bool, tuple[str, str] | None], tuple]
    label: Callable[[Any], str]
    value: Callable[[Any], Any] = lambda v: v
    variants: tuple[bool, ...] = (False,)
    formats: tuple[tuple[str, str] | None, ...] = (None,)
    speed_note: str = ""
    unstated: Any = None


#: how a client's measured peak is made (:func:`fedtune.planning.planner.metered_fit`): ``"base"`` the
#: frozen base it holds + its fit's growth (LoRA); ``"growth"`` the growth alone (a sub-model built inside
#: the fit); ``"reported"`` the reply's own ``peak_mem_bytes`` where it sends one (a proxy client)
PeakMode = Literal["base", "growth", "reported"]


@dataclass(frozen=True)
class PlanSpec:
    """A method's plan: ``knob``, the :class:`~fedtune.protocol.profiles.ClientProfile` field the
    planner sets (None: every client trains the same setting, planned or excluded); ``price``, the
    method's cost model: the run's context -> its :class:`Knob` and a note the plan prints (what the
    plan leaves out of the profiles, or ""); ``peak``: how a client's measured peak is made
    (:data:`PeakMode`)."""

    knob: str | None
    price: Callable[[PlanningContext], tuple[Knob, str]]
    peak: PeakMode = "base"


class PlannedMethod(MethodView, Protocol):
    """What the planner reads of the run's method: its plan, as registered."""

    @property
    def plan(self) -> PlanSpec | None:
        """Its :class:`PlanSpec` (None: client budgets are not planned for it)."""
        ...


class DroppedReports(Protocol):
    """What the planner reads of the nodes' reports (:class:`fedtune.planning.node_report.Reports`)."""

    @property
    def dropped(self) -> dict[int, str]:
        """Client id -> why its node's report was dropped."""
        ...


class PlanningContext(ServerContext, Protocol):
    """What the budget planner and a method's cost model read of the run's context
    (:class:`fedtune.runtime.RunContext`): the server's view, the model's meta-device skeleton, each
    client's budget as its node reports it, and the run's priced knob."""

    @property
    def method(self) -> PlannedMethod:
        """The run's method, with its plan."""
        ...

    @property
    def skeleton(self) -> torch.nn.Module:
        """The task's model on the meta device (shapes, no weights)."""
        ...

    @property
    def budgeted_profiles(self) -> list[ClientProfile]:
        """The config's profiles with each client's budget as its node reports it."""
        ...

    @property
    def reports(self) -> DroppedReports:
        """The nodes' reports the plan reads."""
        ...

    @property
    def pricing(self) -> tuple[str | None, Knob, str]:
        """The run's knob (None: none), its priced :class:`Knob` and the plan's note, built once
        (:func:`fedtune.planning.planner.price_run`)."""
        ...

    def base_format(self, profile: ClientProfile) -> tuple[str, str]:
        """(quantization, dtype) of the base ``profile``'s client trains on."""
        ...
