"""One home for LoRA array algebra: names, rank selections, products, SVD and stacking.

Adapter state travels as flat ``name -> array`` dicts (:mod:`fedtune.models.lora`): per adapted
module at ``<path>``, ``<path>.lora_A.weight`` A (r, n) and ``<path>.lora_B.weight`` B (m, r);
every other array (the task's head) is a *head* array. PEFT computes ``W0 + s B A`` with
``s = alpha / r`` (:func:`lora_scale`). A convolution's LoRA is A (r, c_in, kh, kw) and
B (c_out, r, 1, 1): rank selections index its rank axis as they do a matrix's, and products see
it as the matrices A (r, c_in kh kw) and B (c_out, r) (:func:`as_matrix`), so Delta W is
(c_out, c_in kh kw), reshaped onto the convolution's weight where it is applied.

Rank selections. Every heterogeneous-rank method moves between a rank-r adapter and a rank-k one
through an index set I of k ranks (int array into 0..r-1):

- :func:`take_ranks` gives B[:, I] (m, k) and A[I, :] (k, n): FSLoRA's active slices of a sketch
  S = (r/k) sum_{j in I} e_j e_j^T (Def. 3.1, I random), and HeteroLoRA / FlexLoRA truncation
  (I = :func:`leading` (k) = 0..k-1).
- :func:`put_ranks` is its inverse scatter into an (m, r) / (r, n) zero array: FSLoRA's rebuild of
  a sparse update before eq. (5) (zeros outside I), and HeteroLoRA's zero padding (I = 0..k-1).
- :func:`add_ranks` adds a weighted rank-k array into a rank-r accumulator in place (eq. (5)).

Products (W space). :func:`weighted_product_sum` (FlexLoRA's sum_i p_i s_i B_i A_i),
:func:`svd_factors` (its truncated-SVD redistribution), :func:`stack_factors` (FLoRA's stacking)
and :func:`fresh_lora_a` (a reproducible PEFT initialization of A).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

LORA_A, LORA_B = ".lora_A.", ".lora_B."
_A_SUFFIX = ".lora_A.weight"

Index = np.ndarray | Mapping[str, np.ndarray]  # one I for every pair, or lora_A name -> I


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
    return f"{path}{_A_SUFFIX}"


def b_name(path: str) -> str:
    return f"{path}.lora_B.weight"


def lora_paths(names: Iterable[str]) -> list[str]:
    """Adapted module paths, in the order of their ``lora_A`` arrays."""
    return [module_path(n) for n in names if is_lora_a(n)]


def lora_pairs(names: Iterable[str]) -> list[tuple[str, str]]:
    """``(lora_A name, lora_B name)`` of every adapted module, in order."""
    return [(a_name(p), b_name(p)) for p in lora_paths(names)]


def head_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in arrays.items() if is_head(k)}


def array_rank(arrays: Mapping[str, np.ndarray]) -> int:
    """Rank of an adapter given as arrays (rows of its first ``lora_A``)."""
    return int(next(v.shape[0] for k, v in arrays.items() if is_lora_a(k)))


def lora_scale(alpha: float, rank: int) -> float:
    """PEFT's scaling ``alpha / rank``."""
    return float(alpha) / int(rank)


# -- rank selections ---------------------------------------------------------------------------
def leading(k: int) -> np.ndarray:
    """The truncation index set I = 0..k-1."""
    return np.arange(int(k))


def _index_of(index: Index, name: str) -> np.ndarray:
    """The index set of the module that array ``name`` belongs to."""
    if isinstance(index, Mapping):
        return index[a_name(module_path(name))]
    return index


def take(name: str, x: np.ndarray, index: np.ndarray) -> np.ndarray:
    """A[I, :] (k, n) of a ``lora_A``, B[:, I] (m, k) of a ``lora_B`` (contiguous copies); a head
    array as is."""
    if is_lora_a(name):
        return np.ascontiguousarray(x[index, :])
    if is_lora_b(name):
        return np.ascontiguousarray(x[:, index])
    return x


def put(name: str, x: np.ndarray, index: np.ndarray, rank: int, dtype=None) -> np.ndarray:
    """Inverse of :func:`take`: a rank-``rank`` zero array with rows (A) or columns (B) ``index``
    set to ``x``; a head array as is (converted to ``dtype`` when given)."""
    dtype = x.dtype if dtype is None else dtype
    if is_lora_a(name):
        out = np.zeros((rank, *x.shape[1:]), dtype=dtype)
        out[index] = x
    elif is_lora_b(name):
        out = np.zeros((x.shape[0], rank, *x.shape[2:]), dtype=dtype)
        out[:, index] = x
    else:
        out = np.asarray(x, dtype=dtype)
    return out


def add_ranks(total: np.ndarray, name: str, x: np.ndarray, index: Index, weight: float) -> None:
    """``total += weight * put(x at I)`` in place, touching only the rows (A) / columns (B) I of
    ``name``'s module (``index``: one I, or one per ``lora_A`` name); a head array densely."""
    if is_lora_a(name):
        total[_index_of(index, name), :] += weight * x
    elif is_lora_b(name):
        total[:, _index_of(index, name)] += weight * x
    else:
        total += weight * x


def take_ranks(arrays: Mapping[str, np.ndarray], index: Index) -> dict[str, np.ndarray]:
    """The rank-k adapter of ranks I: B[:, I], A[I, :] of every pair (``index``: one I for all
    pairs, or one per ``lora_A`` name); head arrays unchanged."""
    return {k: (v if is_head(k) else take(k, v, _index_of(index, k))) for k, v in arrays.items()}


def truncate_rank(arrays: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """B[:, :rank], A[:rank, :] of every pair (:func:`take_ranks` with I = 0..rank-1)."""
    return take_ranks(arrays, leading(rank))


def pad_rank(name: str, x: np.ndarray, rank: int) -> np.ndarray:
    """Zero padding of a rank-k ``lora_A`` (rows) or ``lora_B`` (columns) to ``rank``, float64
    (:func:`put` with I = 0..k-1); a head array as float64."""
    k = x.shape[0] if is_lora_a(name) else x.shape[1] if is_lora_b(name) else 0
    return put(name, x, leading(k), rank, np.float64)


def zero_pad_average(
    updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], rank: int, coverage: bool = False
) -> dict[str, np.ndarray]:
    """Zero-pad every array to ``rank`` and average: ``sum_i w_i pad(u_i) / sum_i w_i``, so a
    rank-r_i array counts as zero on the rank indices j >= r_i (float64 sums, float32 result).

    ``coverage=True``: each rank index is averaged only over the arrays whose rank covers it
    (parameter-wise averaging); an index nobody covered gets zero."""
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


# -- products, SVD and stacking ------------------------------------------------------------------
def weights_sum_to_one(weights: Sequence[float]) -> np.ndarray:
    """p_i = w_i / sum_j w_j (float64)."""
    p = np.asarray(list(weights), dtype=np.float64)
    return p / p.sum()


def as_matrix(name: str, x: np.ndarray) -> np.ndarray:
    """A LoRA factor as a matrix: a convolution's A (r, c_in, kh, kw) as (r, c_in kh kw), its
    B (c_out, r, 1, 1) as (c_out, r); a linear layer's as it is."""
    if is_lora_a(name):
        return x.reshape(x.shape[0], -1)
    if is_lora_b(name):
        return x.reshape(x.shape[0], x.shape[1])
    return x


def pair_product(adapter: Mapping[str, np.ndarray], path: str) -> np.ndarray:
    """B A of the module at ``path`` (float64, (m, n); a convolution's n = c_in kh kw)."""
    b, a = as_matrix(b_name(path), adapter[b_name(path)]), as_matrix(a_name(path), adapter[a_name(path)])
    return b.astype(np.float64) @ a.astype(np.float64)


def weighted_product_sum(
    adapters: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], scales: Sequence[float]
) -> dict[str, np.ndarray]:
    """Delta W = sum_i p_i s_i B_i A_i per adapted module (float64, (m, n)), p_i = w_i / sum w.

    The FlexLoRA server's aggregate (Bai et al. 2024): full-size products, so clients of
    different ranks add up exactly."""
    p = weights_sum_to_one(weights)
    out: dict[str, np.ndarray] = {}
    for path in lora_paths(adapters[0]):
        terms = [(pi * si) * pair_product(ad, path) for pi, si, ad in zip(p, scales, adapters)]
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        out[path] = total
    return out


def thin_svd(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U, S, V^T) of ``matrix`` (m, n) in float64, ``full_matrices=False``: LAPACK's divide and
    conquer (gesdd, numpy's) and, where it does not converge, the QR iteration (gesvd, through
    SciPy). gesdd fails now and then on finite, well-scaled matrices: FlexLoRA's round 2 on
    SmolLM2 (configs/commonsense-fslora.toml's setting) stopped on a 576 x 576 Delta W with
    entries below 0.01 that gesvd decomposes."""
    matrix = np.asarray(matrix, dtype=np.float64)
    try:
        return np.linalg.svd(matrix, full_matrices=False)
    except np.linalg.LinAlgError:
        import scipy.linalg

        return scipy.linalg.svd(matrix, full_matrices=False, lapack_driver="gesvd")


def svd_factors(delta: np.ndarray, rank: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """FlexLoRA redistribution: the truncated SVD U_r S_r V_r^T of ``delta`` (m, n) as a rank-r
    LoRA pair with ``scale * B @ A = U_r S_r V_r^T``: B = U_r S_r / scale (m, r), A = V_r^T (r, n).

    By Eckart-Young this is the best rank-r approximation of ``delta`` (exact when r >= its
    rank). A rank above min(m, n) is zero-padded."""
    return svd_factors_from(*thin_svd(delta), rank, scale)


def svd_factors_from(u: np.ndarray, s: np.ndarray, vt: np.ndarray, rank: int, scale: float):
    """:func:`svd_factors` from a precomputed (possibly truncated) SVD."""
    k = min(rank, len(s))
    b = np.zeros((u.shape[0], rank), dtype=np.float32)
    a = np.zeros((rank, vt.shape[1]), dtype=np.float32)
    b[:, :k] = u[:, :k] * (s[:k] / scale)
    a[:k] = vt[:k]
    return b, a


def shaped_like(b: np.ndarray, a: np.ndarray, b_shape: tuple[int, ...], a_shape: tuple[int, ...]):
    """Matrix factors B (m, r), A (r, n) reshaped to an adapter's factor shapes of rank r
    (a convolution's (c_out, r, 1, 1) and (r, c_in, kh, kw)); ``*_shape`` give the trailing
    dimensions (their rank axis is replaced by r)."""
    r = b.shape[1]
    return b.reshape(b_shape[0], r, *b_shape[2:]), a.reshape(r, *a_shape[1:])


def stack_factors(
    adapters: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], scales: Sequence[float]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """FLoRA stacking (Wang et al. 2024): per module, B_stack = [B_1 ... B_N] (m, sum r_i) and
    A_stack = [p_1 s_1 A_1; ...; p_N s_N A_N] (sum r_i, n), so that
    B_stack A_stack = sum_i p_i s_i B_i A_i exactly (each client's PEFT scale folded in)."""
    p = weights_sum_to_one(weights)
    out = {}
    for path in lora_paths(adapters[0]):
        b = np.concatenate([as_matrix(b_name(path), ad[b_name(path)]).astype(np.float64) for ad in adapters], axis=1)
        a = np.concatenate(
            [
                (pi * si) * as_matrix(a_name(path), ad[a_name(path)]).astype(np.float64)
                for pi, si, ad in zip(p, scales, adapters)
            ],
            axis=0,
        )
        out[path] = (b, a)
    return out


def fresh_lora_a(name: str, shape: tuple[int, ...], seed: int, rnd: int, cid: int) -> np.ndarray:
    """A freshly initialized ``lora_A`` (r, n) (a convolution's (r, c_in, kh, kw)) for client
    ``cid`` in round ``rnd``: PEFT's default (kaiming-uniform with a = sqrt(5), i.e.
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = n or c_in kh kw), drawn from (seed, round, client,
    name) alone, so the server can regenerate it from the config."""
    rng = np.random.default_rng([int(seed), int(rnd), int(cid), zlib.crc32(name.encode())])
    bound = 1.0 / np.sqrt(int(np.prod(shape[1:])))
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)
