"""The BoMM cloud's aligner (eq. (9)): the global prototype set (the parties' same-class
prototypes, standardized like every row, plus the rows of the pairs grown into it), and the
accepted cross-party pairs of unaligned rows with the prototype set's growth."""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations
from typing import Any

import numpy as np

from fedtune.methods.bomm.alignment import PrototypeSet, align_parties
from fedtune.methods.bomm.common import Standardizer
from fedtune.methods.bomm.pool import Pool


def prototype_set(
    uploads: dict[int, dict[str, np.ndarray]],
    grown: np.ndarray,
    num_parties: int,
    pool: Pool,
    st: Standardizer,
    zc: np.ndarray,
    mc: np.ndarray,
) -> PrototypeSet:
    """Seeds (the parties' same-class prototypes, standardized with ``st``, paired) plus the grown
    pairs' rows (``grown``: (party k, row of k, party w, row of w) per grown prototype)."""
    seeds = PrototypeSet.seed(
        {k: (st.apply(u["prototypes"], u["proto_counts"] > 0), u["proto_counts"]) for k, u in uploads.items()},
        num_parties,
    )
    where = {(int(k), int(i)): r for r, (k, i) in enumerate(zip(pool.party, pool.local))}
    items = []
    for k, i, w, j in grown:
        rk, rw = where.get((int(k), int(i))), where.get((int(w), int(j)))
        if rk is None or rw is None:
            continue
        label = pool.label[rk] if pool.label[rk] >= 0 else pool.label[rw]
        items.append((int(k), zc[rk], mc[rk], int(w), zc[rw], mc[rw], int(label)))
    return seeds.with_pairs(items)


def align_rows(
    pool: Pool,
    zc: np.ndarray,
    mc: np.ndarray,
    protos: PrototypeSet,
    parties: list[int],
    grown: np.ndarray,
    options: Any,
    truth: Callable[[Pool], np.ndarray] | None = None,
) -> tuple[list[tuple[int, int]], np.ndarray, dict[str, float]]:
    """(accepted cross-party pairs of unaligned rows as pool indices, most similar first; ``grown``
    with up to ``grow_per_round`` of them added while the set holds fewer than ``n_global``; the
    round's alignment metrics). A pair of two labeled rows with different labels is never accepted.
    ``truth``: the rows' true labels, for the diagnostic pair accuracy only."""
    o = options
    inverse = np.unique(pool.sid, return_inverse=True)[1]
    unaligned = np.bincount(inverse)[inverse] == 1  # ids only one row holds
    accepted: list[tuple[int, int, float]] = []
    rejected = 0
    for k, w in combinations(parties, 2):
        uk = np.flatnonzero(unaligned & (pool.party == k))
        uw = np.flatnonzero(unaligned & (pool.party == w))
        for i, j, sim in align_parties(
            zc[uk], mc[uk], zc[uw], mc[uw], protos, k, w, o.alignment_vector, o.sinkhorn_reg
        ):
            a, b = int(uk[i]), int(uw[j])
            if pool.label[a] >= 0 and pool.label[b] >= 0 and pool.label[a] != pool.label[b]:
                rejected += 1
                continue
            accepted.append((a, b, sim))
    accepted.sort(key=lambda p: -p[2])
    # growth of the prototype set, most similar pairs first, each row in one grown prototype
    budget = min(o.grow_per_round, max(0, o.n_global - len(protos)))
    used = {(int(k), int(i)) for k, i, _, _ in grown} | {(int(w), int(j)) for _, _, w, j in grown}
    new = []
    for a, b, _ in accepted:
        if len(new) >= budget:
            break
        ka, kb = (int(pool.party[a]), int(pool.local[a])), (int(pool.party[b]), int(pool.local[b]))
        if ka in used or kb in used:
            continue
        used |= {ka, kb}
        new.append([*ka, *kb])
    if new:
        grown = np.concatenate([grown, np.asarray(new, dtype=np.int64)])
    metrics = {
        "aligned_pairs": float(len(accepted)),
        "rejected_pairs": float(rejected),
        "prototypes": float(len(protos) + len(new)),
    }
    if truth is not None and accepted:
        labels = truth(pool)
        metrics["diag_pair_accuracy"] = float(np.mean([labels[a] == labels[b] for a, b, _ in accepted]))
    return [(a, b) for a, b, _ in accepted], grown, metrics
