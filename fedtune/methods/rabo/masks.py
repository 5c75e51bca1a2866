"""Sub-models of a network for resource-adaptive training (RABO and its sub-model baselines): which
entries of each tensor a client trains (its mask m, RABO eqs. (3)-(4): x_q^i = x_q (.) m_{q,x}^i),
and the parameter-wise aggregation over the clients that covered each entry (RABO eqs. (6) and
(8); HeteroFL, FedRolex and FIARSE aggregate the same way).

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

**Capacity.** A client of capacity beta (``profile.capacity``, HeteroFL's "model rate") keeps
exactly :func:`units_kept` = ceil(beta * n) units of every group of n units (HeteroFL's and
FedRolex's code; at least 1): a width ratio, so a hidden conv layer keeps about beta^2 of its
weights.

**Masks.** :func:`choose_units` is the mask policy M(., R_i) of RABO eq. (3) and the baselines'
extraction rules, group by group: ``full`` (FedMBO: everything), ``static`` (HeteroFL: the first
k), ``rolling`` (FedRolex: k consecutive units from (round - 1) mod n, wrapping), ``importance``
(RABO: the k units of largest weight norm in the current global model, so masks change between
rounds as the weights do), ``segment`` (RABO Fig. 3: contiguous segments of k units assigned to
clients, to set the minimum coverage). :func:`submodel_of` turns the chosen units into a
:class:`SubModel`: a boolean mask per tensor and, being structured, the sorted kept indices per
dimension, so that the C order of the masked entries is the C order of the sliced sub-tensor.
FIARSE's unstructured masks are element masks (:func:`magnitude_masks`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

Policy = Literal["full", "static", "rolling", "importance", "segment"]
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
def unit_importance(group: UnitGroup, weights: Mapping[str, np.ndarray]) -> np.ndarray:
    """L2 norm of each unit's entries over the group's members found in ``weights`` (the
    parameters: running statistics are not weights), (size,) float64."""
    total = np.zeros(group.size)
    for m in group.members:
        if m.tensor not in weights:
            continue
        a = np.asarray(weights[m.tensor], dtype=np.float64)
        per_index = (np.moveaxis(a, m.dim, 0).reshape(a.shape[m.dim], -1) ** 2).sum(1)
        total += per_index.reshape(group.size, m.repeat).sum(1)
    return np.sqrt(total)


def choose_units(
    policy: Policy,
    group: UnitGroup,
    capacity: float,
    rnd: int,
    cid: int,
    weights: Mapping[str, np.ndarray] | None = None,
    segments: Sequence[int] | None = None,
) -> np.ndarray:
    """Sorted unit indices client ``cid`` keeps of ``group`` in round ``rnd`` (rounds count from 1)."""
    n = group.size
    if group.name == CLIENT_SLOT:
        return np.array([cid], dtype=np.int64)
    if policy == "full":
        return np.arange(n)
    k = units_kept(capacity, n)
    if policy == "static":
        return np.arange(k)
    if policy == "rolling":  # FedRolex eq. (4): the window advances by one unit per round
        return np.sort((((rnd - 1) % n) + np.arange(k)) % n)
    if policy == "importance":
        if weights is None:
            raise ValueError("importance masks need the current weights")
        order = np.argsort(-unit_importance(group, weights), kind="stable")
        return np.sort(order[:k])
    if policy == "segment":
        count = math.ceil(n / k)
        seg = (segments[cid] if segments is not None else cid) % count
        return np.arange(seg * k, seg * k + k) if seg * k + k <= n else np.arange(n - k, n)
    raise ValueError(f"unknown mask policy {policy!r}")


# -- sub-models -------------------------------------------------------------------------------------
@dataclass
class SubModel:
    """A client's mask per tensor (bool, full shape); structured masks also keep the sorted kept
    indices per dimension (``index[name][d]`` None: the whole dimension) and the kept units."""

    masks: dict[str, np.ndarray]
    index: dict[str, tuple[np.ndarray | None, ...]] | None = None
    units: dict[str, np.ndarray] = field(default_factory=dict)

    def sub_shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` in the sliced sub-model (structured masks only)."""
        return tuple(len(i) if i is not None else s for i, s in zip(self.index[name], self.masks[name].shape))

    def kept(self, name: str) -> int:
        return int(self.masks[name].sum())


def submodel_of(structure: Structure, units: Mapping[str, np.ndarray]) -> SubModel:
    """The structured sub-model keeping ``units[group]`` of every group (a group absent: all)."""
    index: dict[str, list[np.ndarray | None]] = {n: [None] * len(s) for n, s in structure.shapes.items()}
    kept_units = {}
    for g in structure.groups:
        kept = kept_units[g.name] = np.sort(np.asarray(units.get(g.name, np.arange(g.size)), dtype=np.int64))
        for m in g.members:
            idx = (kept[:, None] * m.repeat + np.arange(m.repeat)).ravel()
            prev = index[m.tensor][m.dim]
            index[m.tensor][m.dim] = idx if prev is None else np.intersect1d(prev, idx)
    masks = {}
    for name, shape in structure.shapes.items():
        mask = np.ones(shape, dtype=bool)
        for d, idx in enumerate(index[name]):
            if idx is not None:
                keep = np.zeros(shape[d], dtype=bool)
                keep[idx] = True
                mask &= keep.reshape([-1 if i == d else 1 for i in range(len(shape))])
        masks[name] = mask
    return SubModel(masks, {n: tuple(v) for n, v in index.items()}, kept_units)


def magnitude_masks(
    arrays: Mapping[str, np.ndarray], prunable: Sequence[str], k: int
) -> tuple[dict[str, np.ndarray], float]:
    """FIARSE's importance masks: over the ``prunable`` tensors together, the entries with
    |theta| >= tau, tau the k-th largest magnitude (ties at tau kept, as the reference's
    ``scores >= threshold``); other tensors whole. Returns (masks, tau)."""
    flat = np.concatenate([np.abs(np.asarray(arrays[n], dtype=np.float32)).ravel() for n in prunable])
    k = max(1, min(k, flat.size))
    tau = float(np.partition(flat, flat.size - k)[flat.size - k])
    masks = {
        n: (np.abs(np.asarray(a, dtype=np.float32)) >= tau) if n in prunable else np.ones(np.shape(a), bool)
        for n, a in arrays.items()
    }
    return masks, tau


# -- values between full tensors and a sub-model ------------------------------------------------------
def take(arrays: Mapping[str, np.ndarray], sub: SubModel, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Flat values of each tensor at its mask, C order (= the sliced sub-tensor, flattened)."""
    return {n: np.ascontiguousarray(np.asarray(arrays[n])[sub.masks[n]]) for n in (names or arrays)}


def expand(values: Mapping[str, np.ndarray], sub: SubModel, physical: bool) -> dict[str, torch.Tensor]:
    """The tensors a client computes with, from flat values at the mask: the sliced sub-tensors
    (``physical``) or full-size tensors with the pruned entries zero (x (.) m)."""
    out = {}
    for n, v in values.items():
        v = torch.as_tensor(np.asarray(v, dtype=np.float32))
        if physical:
            out[n] = v.reshape(sub.sub_shape(n)).clone()
        else:
            full = torch.zeros(sub.masks[n].shape)
            full[torch.from_numpy(sub.masks[n])] = v
            out[n] = full
    return out


def flatten_at(tensors: Mapping[str, torch.Tensor], sub: SubModel, physical: bool) -> dict[str, np.ndarray]:
    """Inverse of :func:`expand`: flat float32 values at the mask."""
    out = {}
    for n, t in tensors.items():
        a = t.detach().cpu().numpy()
        out[n] = np.ascontiguousarray(a.ravel() if physical else a[sub.masks[n]], dtype=np.float32)
    return out


def materialize(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """A copy of ``model`` whose named parameters / buffers are ``tensors`` (any shapes: a sliced
    sub-model of a chain runs with the module code unchanged); parameters stay parameters."""
    sub = copy.deepcopy(model)
    params = dict(sub.named_parameters())
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        module = sub.get_submodule(owner) if owner else sub
        if name in params:
            module._parameters[leaf] = nn.Parameter(t.detach().clone(), requires_grad=params[name].requires_grad)
        else:
            module._buffers[leaf] = t.detach().clone()
    return sub


# -- parameter-wise aggregation, RABO eqs. (6) and (8) -------------------------------------------------
def covered_update(
    old: Mapping[str, np.ndarray], contributions: Sequence[tuple[SubModel, Mapping[str, np.ndarray]]], scale: float
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """new^k = old^k + scale (1 / C^k) sum_{i in N^k} v_i^k for every entry k covered by C^k > 0
    clients (N^k: the clients whose mask holds k; v_i: client i's flat values at its mask);
    entries nobody covered keep their value (RABO Alg. 1 lines 12-20 and 25-33, eqs. (6), (8);
    HeteroFL's and FedRolex's ``combine``, FIARSE's ``tot_grad / tot_mask``). Returns (the new
    arrays, the coverage C^k of every entry of the tensors that had contributions)."""
    new, counts = {}, {}
    names = {n for _, values in contributions for n in values}
    for name, value in old.items():
        if name not in names:
            new[name] = np.array(value, copy=True)
            continue
        total = np.zeros(value.shape, dtype=np.float64)
        count = np.zeros(value.shape, dtype=np.int64)
        for sub, values in contributions:
            if name in values:
                mask = sub.masks[name]
                total[mask] += np.asarray(values[name], dtype=np.float64)
                count[mask] += 1
        out = np.array(value, dtype=np.float64, copy=True)
        hit = count > 0
        out[hit] += scale * total[hit] / count[hit]
        new[name] = out.astype(value.dtype)
        counts[name] = count
    return new, counts


def coverage_stats(counts: Mapping[str, np.ndarray]) -> tuple[int | None, float]:
    """(min_k C^k over the covered entries k, the fraction of entries covered): one round's
    minimum coverage (RABO Definition 3, eqs. (12)-(13), before the minimum over rounds)."""
    if not counts:
        return None, 0.0
    flat = np.concatenate([np.asarray(c).ravel() for c in counts.values()])
    covered = flat[flat > 0]
    return (int(covered.min()) if covered.size else None), float(covered.size / max(flat.size, 1))
