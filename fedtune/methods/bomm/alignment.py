"""Prototypes and global prototype-guided alignment (GPGA), BoMM Section 4.2, eq. (9).

Shapes: a party's representations are ``x`` (n, M, D) with a modality mask ``xmask`` (n, M)
(M modalities, D features each; an absent modality's entries are ignored, whatever they hold).

**Class prototypes** (:func:`class_prototypes`): party k's p_k^c is a weighted average of its
*labeled* rows of class c, per modality, over the rows holding that modality (weights 1 unless
given: Bien & Tibshirani's prototypes reduced to a class mean); the counts travel with them.

**Global prototype set** O = {o^m}, m = 1..N_global (:class:`PrototypeSet`). A global prototype is an
*aligned item*: one component per party, o^m_k (M, D) with a mask, in party k's own representation
space. The seeds pair same-class prototypes across parties, o^c = (p_1^c, ..., p_K^c) ("pair
same-class prototypes across parties as initial aligned data"); a newly aligned pair (row i of party
k, row j of party w) joins O as o = (x_i^k at k, x_j^w at w) until |O| = N_global.

**Cost vectors, "OT distance"** (:func:`cost_matrix`): the ground cost of the optimal-transport
problem between party k's unaligned rows and the global prototypes,
M^k_im = 1 - cos(x_i^k, o^m_k), computed with POT (``ot.dist``, cosine metric) per modality and
averaged over the modalities both the row and the component hold (NaN when they share none).
The relationship vector of row i is its row M_i^k of that matrix (``vector = "cost"``, eq. (9) as
written), or, with ``vector = "plan"``, its row of the entropic OT *plan* between the party's rows
(uniform mass) and the prototypes (uniform mass), ``ot.sinkhorn`` on M^k, scaled so that each row
sums to 1: the "similarity distribution" of the paper's abstract. That plan is the only transport
plan BoMM computes; the default (and the paper's eq. (9)) uses the cost rows.

**Matching** (:func:`match`, eq. (9)): j* = argmax_j cos(M_i^k, M_j^w), over the prototypes that
have components at both parties (a missing cost entry counts as 1, the cost of an orthogonal
pair). Eq. (9) gives every row a best partner; a pair is *accepted* when the choice is mutual
(i is also the argmax for j over party k's rows), so that a row is matched at most once per other
party. Pairs are ranked by their similarity (most similar first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Vector = Literal["cost", "plan"]


def class_prototypes(
    x: np.ndarray, xmask: np.ndarray, labels: np.ndarray, num_classes: int, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(prototypes (C, M, D), counts (C, M)): per class c and modality m, the ``weights``-weighted
    mean of x[i, m] over the labeled rows (``labels >= 0``) of class c that hold modality m; zeros
    and count 0 where none does. ``counts`` is the number of rows averaged."""
    x = np.asarray(x, dtype=np.float64)
    n, m, d = x.shape
    w = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    protos = np.zeros((num_classes, m, d))
    counts = np.zeros((num_classes, m))
    for c in range(num_classes):
        rows = labels == c
        for mod in range(m):
            sel = rows & xmask[:, mod]
            if sel.any():
                protos[c, mod] = np.average(x[sel, mod], axis=0, weights=w[sel])
                counts[c, mod] = sel.sum()
    return protos.astype(np.float32), counts.astype(np.float32)


@dataclass
class PrototypeSet:
    """The global prototype set O: components (N, K, M, D), their mask (N, K, M), and each
    prototype's class where known (-1 for a grown pair of unlabeled rows)."""

    comp: np.ndarray
    mask: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def seed(cls, prototypes: dict[int, tuple[np.ndarray, np.ndarray]], num_parties: int) -> PrototypeSet:
        """One global prototype per class that at least two parties hold (any modality): the
        parties' same-class prototypes paired, o^c_k = p_k^c. ``prototypes``: party -> (protos,
        counts) of :func:`class_prototypes`."""
        some = next(iter(prototypes.values()))[0]
        num_classes, m, d = some.shape
        comp = np.zeros((num_classes, num_parties, m, d), dtype=np.float32)
        mask = np.zeros((num_classes, num_parties, m), dtype=bool)
        for k, (protos, counts) in prototypes.items():
            comp[:, k] = protos
            mask[:, k] = counts > 0
        keep = mask.any(axis=2).sum(axis=1) >= 2
        return cls(comp[keep], mask[keep], np.flatnonzero(keep).astype(np.int64))

    def with_pairs(
        self, items: list[tuple[int, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray, int]]
    ) -> PrototypeSet:
        """O plus one prototype per aligned pair ``(k, x_k (M, D), mask_k (M,), w, x_w, mask_w, label)``."""
        if not items:
            return self
        n, k_all, m, d = len(items), self.comp.shape[1], self.comp.shape[2], self.comp.shape[3]
        comp = np.zeros((n, k_all, m, d), dtype=np.float32)
        mask = np.zeros((n, k_all, m), dtype=bool)
        labels = np.full(n, -1, dtype=np.int64)
        for t, (k, xk, mk, w, xw, mw, label) in enumerate(items):
            comp[t, k], mask[t, k], comp[t, w], mask[t, w], labels[t] = xk, mk, xw, mw, label
        return PrototypeSet(
            np.concatenate([self.comp, comp]), np.concatenate([self.mask, mask]), np.concatenate([self.labels, labels])
        )

    def mapped(self, fn) -> PrototypeSet:
        """The same prototypes with every component mapped by ``fn(x (n, M, D), mask (n, M)) ->
        (n, M, E)`` (into another representation space)."""
        n, k, m = self.mask.shape
        comp = fn(self.comp.reshape(n * k, m, -1), self.mask.reshape(n * k, m))
        return PrototypeSet(np.asarray(comp, np.float32).reshape(n, k, m, -1), self.mask.copy(), self.labels.copy())

    def subset(self, idx: np.ndarray) -> PrototypeSet:
        return PrototypeSet(self.comp[idx], self.mask[idx], self.labels[idx])

    def shared(self, k: int, w: int) -> np.ndarray:
        """Indices of the prototypes with a component at both party k and party w."""
        return np.flatnonzero(self.mask[:, k].any(axis=1) & self.mask[:, w].any(axis=1))

    def target(self, idx: np.ndarray, modality: int) -> tuple[np.ndarray, np.ndarray]:
        """(values (len(idx), D), has (len(idx),)): each prototype's ``modality`` averaged over the
        parties' components that hold it (the shared-space reading used for completion targets)."""
        comp, mask = self.comp[idx, :, modality], self.mask[idx, :, modality]  # (n, K, D), (n, K)
        has = mask.any(axis=1)
        total = (comp * mask[..., None]).sum(axis=1)
        return total / np.maximum(mask.sum(axis=1), 1)[:, None], has


def cost_matrix(x: np.ndarray, xmask: np.ndarray, comp: np.ndarray, cmask: np.ndarray) -> np.ndarray:
    """(n, N) ground costs M_im = 1 - cos(x_i, o^m), per modality with POT's ``ot.dist`` (cosine
    metric), averaged over the modalities both row i and component m hold; NaN where they share none.
    ``x`` (n, M, D), ``xmask`` (n, M); ``comp`` (N, M, D), ``cmask`` (N, M): one party's components."""
    import ot

    n, m = xmask.shape
    total = np.zeros((n, len(comp)))
    weight = np.zeros((n, len(comp)))
    for mod in range(m):
        rows, cols = np.flatnonzero(xmask[:, mod]), np.flatnonzero(cmask[:, mod])
        if len(rows) == 0 or len(cols) == 0:
            continue
        a, b = np.asarray(x[rows, mod], np.float64), np.asarray(comp[cols, mod], np.float64)
        cost = ot.dist(a, b, metric="cosine")  # 1 - cos, (len(rows), len(cols))
        cost = np.nan_to_num(cost, nan=1.0)  # a zero vector: as far as an orthogonal one
        total[np.ix_(rows, cols)] += cost
        weight[np.ix_(rows, cols)] += 1.0
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(weight > 0, total / np.maximum(weight, 1), np.nan)


def relationship_vectors(cost: np.ndarray, vector: Vector = "cost", reg: float = 0.05) -> np.ndarray:
    """Each row's relationship vector to the prototypes: its cost row (``"cost"``, eq. (9)), or its
    row of the entropic OT plan between the rows and the prototypes, both with uniform mass, scaled
    to sum to 1 (``"plan"``; ``ot.sinkhorn`` in the log domain, entropic weight ``reg``). Missing
    costs count as 1."""
    filled = np.nan_to_num(cost, nan=1.0)
    if vector == "cost":
        return filled
    if vector != "plan":
        raise ValueError(f"alignment vector must be 'cost' or 'plan', got {vector!r}")
    import ot

    n, big_n = filled.shape
    if n == 0 or big_n == 0:
        return filled
    plan = ot.sinkhorn(
        np.full(n, 1.0 / n), np.full(big_n, 1.0 / big_n), filled, reg, method="sinkhorn_log", numItermax=2000
    )
    return plan * n


def _unit_rows(v: np.ndarray) -> np.ndarray:
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def match(vec_k: np.ndarray, vec_w: np.ndarray) -> list[tuple[int, int, float]]:
    """Eq. (9) between two parties' relationship vectors (over the same prototypes): for each row
    i of party k, j* = argmax_j cos(vec_k[i], vec_w[j]); the pairs (i, j*, similarity) where the
    choice is mutual, most similar first."""
    if len(vec_k) == 0 or len(vec_w) == 0:
        return []
    sim = _unit_rows(vec_k) @ _unit_rows(vec_w).T  # (n_k, n_w)
    best_j = sim.argmax(axis=1)
    best_i = sim.argmax(axis=0)
    pairs = [(int(i), int(j), float(sim[i, j])) for i, j in enumerate(best_j) if best_i[j] == i]
    return sorted(pairs, key=lambda p: -p[2])


def align_parties(
    xk: np.ndarray,
    mk: np.ndarray,
    xw: np.ndarray,
    mw: np.ndarray,
    protos: PrototypeSet,
    k: int,
    w: int,
    vector: Vector = "cost",
    reg: float = 0.05,
) -> list[tuple[int, int, float]]:
    """Accepted pairs (row of party k, row of party w, similarity) between two parties' rows:
    cost vectors to the prototypes both parties hold (:func:`cost_matrix`), relationship vectors
    (:func:`relationship_vectors`), eq. (9) (:func:`match`). No pairs without shared prototypes."""
    idx = protos.shared(k, w)
    if len(idx) == 0:
        return []
    ck = cost_matrix(xk, mk, protos.comp[idx, k], protos.mask[idx, k])
    cw = cost_matrix(xw, mw, protos.comp[idx, w], protos.mask[idx, w])
    return match(relationship_vectors(ck, vector, reg), relationship_vectors(cw, vector, reg))


def nearest_prototype(x: np.ndarray, xmask: np.ndarray, protos: PrototypeSet, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(index (n,), cosine similarity (n,)) of each row's closest global prototype o_i among those
    with a component at party k, by the cost on the modalities both hold; index -1 (similarity 0)
    where none is comparable."""
    idx = np.flatnonzero(protos.mask[:, k].any(axis=1))
    n = len(x)
    if len(idx) == 0 or n == 0:
        return np.full(n, -1, dtype=np.int64), np.zeros(n)
    cost = cost_matrix(x, xmask, protos.comp[idx, k], protos.mask[idx, k])
    filled = np.where(np.isnan(cost), np.inf, cost)
    best = filled.argmin(axis=1)
    ok = np.isfinite(filled[np.arange(n), best])
    return np.where(ok, idx[best], -1), np.where(ok, 1.0 - filled[np.arange(n), best], 0.0)


def pair_similarity(x: np.ndarray, xmask: np.ndarray, protos: PrototypeSet, idx: np.ndarray, k: int) -> np.ndarray:
    """(n,) 1 - M_{i, idx[i]}: the cosine of row i to prototype ``idx[i]``'s party-k component,
    averaged over the modalities both hold (0 where idx is -1 or they share none)."""
    ok = np.asarray(idx) >= 0
    safe = np.where(ok, idx, 0)
    comp, shared = protos.comp[safe, k], xmask & protos.mask[safe, k] & ok[:, None]  # (n, M, D), (n, M)
    den = np.linalg.norm(x, axis=-1) * np.linalg.norm(comp, axis=-1)
    cos = np.where(den > 0, (x * comp).sum(-1) / np.maximum(den, 1e-12), 0.0)
    count = shared.sum(axis=1)
    return np.where(count > 0, (cos * shared).sum(axis=1) / np.maximum(count, 1), 0.0)
