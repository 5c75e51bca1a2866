"""Sub-models of a network for resource-adaptive training (RABO and its sub-model baselines): which
entries of each tensor a client trains (its mask m, RABO eqs. (3)-(4): x_q^i = x_q (.) m_{q,x}^i),
and the parameter-wise aggregation over the clients that covered each entry (RABO eqs. (6) and
(8); HeteroFL, FedRolex and FIARSE aggregate the same way).

The model's unit groups (:class:`~fedtune.models.structure.Structure`,
:func:`~fedtune.models.structure.structure_of`) are in :mod:`fedtune.models.structure`.

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

from fedtune.models.structure import CLIENT_SLOT, Structure, UnitGroup, units_kept

Policy = Literal["full", "static", "rolling", "importance", "segment"]


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
        if self.index is None:
            raise ValueError(f"{name}: an unstructured mask has no sub-model shape")
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
        for d, kept_idx in enumerate(index[name]):
            if kept_idx is not None:
                keep = np.zeros(shape[d], dtype=bool)
                keep[kept_idx] = True
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


def expand(
    values: Mapping[str, np.ndarray], sub: SubModel, physical: bool, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The tensors a client computes with, from flat values at the mask: the sliced sub-tensors
    (``physical``) or full-size tensors with the pruned entries zero (x (.) m), on ``device`` (the
    model's; built on the host, then moved)."""
    out = {}
    for n, array in values.items():
        v = torch.as_tensor(np.asarray(array, dtype=np.float32))
        if physical:
            out[n] = v.reshape(sub.sub_shape(n)).clone()
        else:
            full = torch.zeros(sub.masks[n].shape)
            full[torch.from_numpy(sub.masks[n])] = v
            out[n] = full
        if device is not None:
            out[n] = out[n].to(device)
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
