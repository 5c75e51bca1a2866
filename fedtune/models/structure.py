"""Unit groups of a network, for resource-adaptive training (RABO, HeteroFL, FedRolex, FIARSE)
and the bilevel problems that say how their tensors are pruned.

**Structure.** A :class:`Structure` lists the *unit groups* of a network: a group is a set of units
(the output channels of a conv, the neurons of a hidden linear layer) and the tensor dimensions
that one unit owns in every tensor it touches: the unit's filter (conv weight dim 0, its bias and
batch-norm entries) and its input columns in the next layer (conv weight dim 1, or ``repeat``
consecutive columns of a linear layer after a flatten: channel c owns columns c*r .. c*r+r-1).
Pruning a unit removes all of them, so the sub-model is a smaller network of the same kind
(HeteroFL's and FedRolex's ``split_model``; RABO's "structured pruning", channel level).

- :func:`structure_of` derives it for the sequential conv nets of this package (the few-shot
  Conv4 ``FewShotNet`` and the image task's ``SmallConvNet``: their modules in registration order
  are the data flow). Such a structure is ``physical``: a client runs its sub-model as smaller
  tensors (:func:`expand`, :func:`materialize`), so its compute shrinks with its capacity.
- Any other model gets a *fallback*: one group per hidden ``Linear`` / ``Conv`` layer (not the
  task's head modules) whose units are its output rows (weight dim 0 and bias); input columns are
  not pruned (without the data-flow graph the consumer of a row is unknown). The sub-model then
  runs as the full-size network with the pruned entries zero (eq. (4) read literally, x (.) m): it
  saves communication, not compute.

**Capacity.** A client of capacity beta keeps :func:`units_kept` = ceil(beta * n) units of a
group of n units (at least 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn

CLIENT_SLOT = "client"  # a group whose only kept unit is the client's own id (per-client tensors)


def units_kept(capacity: float, n: int) -> int:
    """k = ceil(capacity * n) units of a group of n (at least 1, at most n)."""
    if not 0 < capacity <= 1:
        raise ValueError(f"capacity must be in (0, 1], got {capacity}")
    return max(1, min(n, math.ceil(round(capacity * n, 9))))


@dataclass(frozen=True)
class Member:
    """Dimension ``dim`` of tensor ``tensor`` belongs to a group: unit u owns the indices
    u*repeat .. u*repeat+repeat-1 of that dimension."""

    tensor: str
    dim: int
    repeat: int = 1


@dataclass(frozen=True)
class UnitGroup:
    name: str
    size: int  # units
    members: tuple[Member, ...]


@dataclass
class Structure:
    """Unit groups over named tensors (``shapes``: every tensor in the sub-model's scope)."""

    groups: list[UnitGroup]
    shapes: dict[str, tuple[int, ...]]
    physical: bool  # sub-models run as smaller tensors (see the module docstring)

    def restricted(self, names: Iterable[str]) -> Structure:
        """The same groups over the tensors ``names`` only (groups left without members dropped)."""
        keep = set(names)
        groups = []
        for g in self.groups:
            members = tuple(m for m in g.members if m.tensor in keep)
            if members:
                groups.append(UnitGroup(g.name, g.size, members))
        return Structure(groups, {k: v for k, v in self.shapes.items() if k in keep}, self.physical)

    def extended(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        members: Mapping[str, Sequence[Member]],
        sizes: Mapping[str, int] | None = None,
    ) -> Structure:
        """More tensors (``shapes``), with extra ``members`` for existing groups or new ones (a new
        group needs its size in ``sizes``)."""
        by_name = {g.name: g for g in self.groups}
        for name, extra in members.items():
            if name in by_name:
                g = by_name[name]
                by_name[name] = UnitGroup(name, g.size, g.members + tuple(extra))
            else:
                by_name[name] = UnitGroup(name, int((sizes or {})[name]), tuple(extra))
        return Structure(
            list(by_name.values()), {**self.shapes, **{k: tuple(v) for k, v in shapes.items()}}, self.physical
        )


# -- the structure of a model ----------------------------------------------------------------------
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)
_CONVS = (nn.Conv1d, nn.Conv2d)


def _is_chain(model: nn.Module) -> bool:
    from fedtune.models.fewshot import FewShotNet
    from fedtune.models.vision import SmallConvNet

    return isinstance(model, (FewShotNet, SmallConvNet))


def structure_of(model: nn.Module, head_modules: Sequence[str] = ()) -> Structure:
    """The unit groups of ``model``'s parameters and floating buffers (module docstring): the
    channel chain of the package's sequential conv nets, else the row fallback."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if b.is_floating_point()})
    return _chain_structure(model, shapes) if _is_chain(model) else _row_structure(model, shapes, head_modules)


def _chain_structure(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> Structure:
    """Channels of every conv (with its batch norm and the next layer's input columns) and neurons
    of every hidden linear layer, in registration order; the outputs of the last layer (the
    classes) are never pruned."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, (*_CONVS, nn.Linear, *_NORMS))]
    last = max(i for i, (_, m) in enumerate(layers) if isinstance(m, (nn.Linear, *_CONVS)))
    groups: list[UnitGroup] = []
    current: list[Member] | None = None  # the group whose units are the current features
    size = 0
    for i, (name, module) in enumerate(layers):
        prefix = f"{name}." if name else ""
        if isinstance(module, _NORMS):
            if current is None:
                raise ValueError(f"{name}: a norm layer before any conv or linear layer")
            current += [
                Member(prefix + t, 0) for t in ("weight", "bias", "running_mean", "running_var") if prefix + t in shapes
            ]
            continue
        fan_in = module.in_channels if isinstance(module, _CONVS) else module.in_features
        if current is not None:
            if fan_in % size:
                raise ValueError(f"structure_of: {name} takes {fan_in} inputs from a layer of {size} units")
            current.append(Member(prefix + "weight", 1, fan_in // size))
            groups.append(UnitGroup(f"g{len(groups)}", size, tuple(current)))
            current = None
        if i != last:
            size = module.out_channels if isinstance(module, _CONVS) else module.out_features
            current = [Member(prefix + "weight", 0)] + ([Member(prefix + "bias", 0)] if module.bias is not None else [])
    return Structure(groups, shapes, physical=True)


def _row_structure(model: nn.Module, shapes: dict[str, tuple[int, ...]], head_modules: Sequence[str]) -> Structure:
    """Fallback: the output rows of every hidden Linear / Conv layer (not under a head module)."""
    heads = tuple(head_modules)
    groups = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, *_CONVS)) or any(name == h or name.startswith(h + ".") for h in heads):
            continue
        weight = f"{name}.weight"
        if weight not in shapes:
            continue
        members = [Member(weight, 0)] + ([Member(f"{name}.bias", 0)] if f"{name}.bias" in shapes else [])
        groups.append(UnitGroup(name, shapes[weight][0], tuple(members)))
    return Structure(groups, shapes, physical=False)


# -- choosing units: the mask policy --------------------------------------------------------------
