"""Shared pieces of the heterogeneous-rank LoRA baselines (HeteroLoRA, FlexLoRA, FedStackLoRA).

Client i trains a rank-r_i adapter, r_i = ``client_rank(profile, r)`` <= r (the global rank).
PEFT computes ``W0 + s B A`` with ``s = alpha / rank``; the helpers below take that scale
explicitly wherever a product ``s_i B_i A_i`` is formed, so aggregation is exact in W space.

Array names follow :mod:`fedtune.models.lora`: ``<path>.lora_A.weight`` (r, n),
``<path>.lora_B.weight`` (m, r); every other array (the classifier head) is a "head" array,
averaged FedAvg-style by all three methods.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from fedtune.protocol.messages import Message
from fedtune.methods.lora_common import LoraClient

LORA_A, LORA_B = ".lora_A.", ".lora_B."


# -- names ------------------------------------------------------------------------------------
def is_lora_a(name: str) -> bool:
    return LORA_A in name


def is_lora_b(name: str) -> bool:
    return LORA_B in name


def is_head(name: str) -> bool:
    return not (is_lora_a(name) or is_lora_b(name))


def module_path(name: str) -> str:
    """``bert...query.lora_A.weight`` -> ``bert...query`` (the adapted module)."""
    for tag in (LORA_A, LORA_B):
        if tag in name:
            return name[: name.index(tag)]
    raise ValueError(f"{name!r} is not a LoRA array")


def a_name(path: str) -> str:
    return f"{path}.lora_A.weight"


def b_name(path: str) -> str:
    return f"{path}.lora_B.weight"


def lora_paths(names) -> list[str]:
    """Adapted module paths, in the order of their ``lora_A`` arrays."""
    return [module_path(n) for n in names if is_lora_a(n)]


def head_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in arrays.items() if is_head(k)}


def array_rank(arrays: Mapping[str, np.ndarray]) -> int:
    """Rank of an adapter given as arrays (rows of its first ``lora_A``)."""
    return int(next(v.shape[0] for k, v in arrays.items() if is_lora_a(k)))


def lora_scale(alpha: float, rank: int) -> float:
    """PEFT's scaling ``alpha / rank``."""
    return float(alpha) / int(rank)


# -- rank truncation / zero padding (HeteroLoRA) -----------------------------------------------
def truncate_rank(arrays: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """B[:, :rank] (m, rank) and A[:rank, :] (rank, n) of every pair; head arrays unchanged."""
    out = {}
    for k, v in arrays.items():
        if is_lora_a(k):
            out[k] = np.ascontiguousarray(v[:rank, :])
        elif is_lora_b(k):
            out[k] = np.ascontiguousarray(v[:, :rank])
        else:
            out[k] = v
    return out


def pad_rank(name: str, x: np.ndarray, rank: int) -> np.ndarray:
    """Zero-pad a ``lora_A`` (rows) or ``lora_B`` (columns) array to ``rank``; head: unchanged."""
    if is_lora_a(name):
        out = np.zeros((rank, x.shape[1]), dtype=np.float64)
        out[: x.shape[0]] = x
    elif is_lora_b(name):
        out = np.zeros((x.shape[0], rank), dtype=np.float64)
        out[:, : x.shape[1]] = x
    else:
        out = np.asarray(x, dtype=np.float64)
    return out


def zero_pad_average(
    updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rank: int, coverage: bool = False
) -> dict[str, np.ndarray]:
    """HeteroLoRA aggregation: zero-pad every client's update to ``rank`` and average.

    ``coverage=False`` (HeteroLoRA): ``sum_i w_i pad(u_i) / sum_i w_i`` over all clients that
    replied, so a client of rank r_i < j counts as a zero for rank index j (this is what zero
    padding means, and why it shrinks the high-rank components). ``coverage=True``: each rank
    index is averaged only over the clients whose rank covers it (parameter-wise averaging);
    an index nobody covered gets a zero update.
    """
    w = np.asarray(list(weights), dtype=np.float64)
    out = {}
    for key in updates[0]:
        num = sum(wi * pad_rank(key, u[key], rank) for wi, u in zip(w, updates))
        if coverage:
            den = sum(wi * pad_rank(key, np.ones_like(u[key]), rank) for wi, u in zip(w, updates))
            mean = np.divide(num, den, out=np.zeros_like(num), where=den > 0)
        else:
            mean = num / w.sum()
        out[key] = mean.astype(np.float32)
    return out


# -- products, SVD and stacking (FlexLoRA, FedStackLoRA) ---------------------------------------
def weighted_product_sum(
    adapters: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], scales: Sequence[float]
) -> dict[str, np.ndarray]:
    """Delta W = sum_i p_i s_i B_i A_i per adapted module (float64, (m, n)), p_i = w_i / sum w.

    The FlexLoRA server's aggregate (Bai et al. 2024): full-size products, so clients of
    different ranks add up exactly."""
    p = np.asarray(list(weights), dtype=np.float64)
    p = p / p.sum()
    out: dict[str, np.ndarray] = {}
    for path in lora_paths(adapters[0]):
        total = None
        for pi, si, ad in zip(p, scales, adapters):
            term = (pi * si) * (ad[b_name(path)].astype(np.float64) @ ad[a_name(path)].astype(np.float64))
            total = term if total is None else total + term
        out[path] = total
    return out


def svd_factors(delta: np.ndarray, rank: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """FlexLoRA redistribution: the truncated SVD U_r S_r V_r^T of ``delta`` (m, n) as a rank-r
    LoRA pair with ``scale * B @ A = U_r S_r V_r^T``: B = U_r S_r / scale (m, r), A = V_r^T (r, n).

    By Eckart-Young this is the best rank-r approximation of ``delta`` (exact when r >= its
    rank). A rank above min(m, n) is zero-padded."""
    u, s, vt = np.linalg.svd(np.asarray(delta, dtype=np.float64), full_matrices=False)
    return svd_factors_from(u, s, vt, rank, scale)


def svd_factors_from(u: np.ndarray, s: np.ndarray, vt: np.ndarray, rank: int, scale: float):
    """:func:`svd_factors` from a precomputed (possibly truncated) SVD."""
    k = min(rank, len(s))
    b = np.zeros((u.shape[0], rank), dtype=np.float32)
    a = np.zeros((rank, vt.shape[1]), dtype=np.float32)
    b[:, :k] = u[:, :k] * (s[:k] / scale)
    a[:k] = vt[:k]
    return b, a


def stack_factors(
    adapters: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], scales: Sequence[float]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """FLoRA stacking (Wang et al. 2024): per module, B_stack = [B_1 ... B_N] (m, sum r_i) and
    A_stack = [p_1 s_1 A_1; ...; p_N s_N A_N] (sum r_i, n), so that
    B_stack A_stack = sum_i p_i s_i B_i A_i exactly (each client's PEFT scale folded in)."""
    p = np.asarray(list(weights), dtype=np.float64)
    p = p / p.sum()
    out = {}
    for path in lora_paths(adapters[0]):
        b = np.concatenate([ad[b_name(path)].astype(np.float64) for ad in adapters], axis=1)
        a = np.concatenate(
            [(pi * si) * ad[a_name(path)].astype(np.float64) for pi, si, ad in zip(p, scales, adapters)], axis=0
        )
        out[path] = (b, a)
    return out


def fresh_lora_a(name: str, shape: tuple[int, int], seed: int, rnd: int, cid: int) -> np.ndarray:
    """A freshly initialized ``lora_A`` (r, n) for client ``cid`` in round ``rnd``: PEFT's
    default (kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(n), 1/sqrt(n))), drawn from
    (seed, round, client, name) alone, so the server can regenerate it from the config."""
    rng = np.random.default_rng([int(seed), int(rnd), int(cid), zlib.crc32(name.encode())])
    bound = 1.0 / np.sqrt(shape[1])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


# -- reversible merge of a dense Delta W into the shared base model (FedStackLoRA) -------------
def _base_weight(workspace, path: str) -> torch.Tensor:
    module = workspace.base.get_submodule(path)
    get_base = getattr(module, "get_base_layer", None)
    return (get_base() if get_base is not None else module).weight


@contextmanager
def merged_into_base(workspace, deltas: Mapping[str, np.ndarray]) -> Iterator[None]:
    """Run the body with ``W0 + Delta W`` in the workspace's frozen base layers; restore W0.

    ``deltas`` maps a module path to its (m, n) Delta W. The base weights are copied before
    and copied back afterwards (also on error), so the restore is exact: the next client, or
    the server's evaluation in the same process, sees W0 untouched."""
    saved: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for path, delta in deltas.items():
                weight = _base_weight(workspace, path)
                d = torch.as_tensor(np.asarray(delta), dtype=weight.dtype)
                if d.shape != weight.shape and d.T.shape == weight.shape:  # fan_in_fan_out layers
                    d = d.T
                saved[path] = weight.detach().clone()
                weight.add_(d)
        yield
    finally:
        with torch.no_grad():
            for path, original in saved.items():
                _base_weight(workspace, path).copy_(original)


# -- the client of HeteroLoRA and FlexLoRA ------------------------------------------------------
class RankedAdapterClient(LoraClient):
    """Trains the received adapter at the rank (and optional alpha) the server names in
    ``meta``; uploads its update (trained minus received, same shapes as received)."""

    def fit(self, message: Message) -> Message:
        received = message.arrays
        rank = int(message.meta["rank"])
        trained, result = self.train_adapter(received, message.meta["round"], rank, message.meta.get("alpha"))
        return self.upload({k: trained[k] - received[k] for k in trained}, result)
