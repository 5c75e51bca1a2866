"""The BoMM cloud's aligner, the part that enlarges the aligned set (chosen by a method's
registration, :meth:`~fedtune.methods.bomm.cloud.BommCloud.assemble`):

- :class:`NoAlignment` (the baselines): the aligned set is the parties' aligned ids;
- :class:`PrototypeAlignment` (BoMM): global prototype-guided alignment (eq. (9)) and label
  transfer along the newly aligned pairs.

Eq. (9)'s pieces: the global prototype set (the parties' same-class prototypes, standardized like
every row, plus the rows of the pairs grown into it), and the accepted cross-party pairs of
unaligned rows with the prototype set's growth."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np

from fedtune.methods.bomm.alignment import PrototypeSet, align_parties, class_prototypes
from fedtune.methods.bomm.backbone import FEATURE_DIM
from fedtune.methods.bomm.common import Standardizer
from fedtune.methods.bomm.pool import CloudRound, M, Pool
from fedtune.protocol.validation import ArraySpec

Complete = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


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
    truth: np.ndarray | None = None,
) -> tuple[list[tuple[int, int]], np.ndarray, dict[str, float]]:
    """(accepted cross-party pairs of unaligned rows as pool indices, most similar first; ``grown``
    with up to ``grow_per_round`` of them added while the set holds fewer than ``n_global``; the
    round's alignment metrics). A pair of two labeled rows with different labels is never accepted.
    ``truth``: the pool rows' true labels, for the diagnostic pair accuracy only."""
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
        metrics["diag_pair_accuracy"] = float(np.mean([truth[a] == truth[b] for a, b, _ in accepted]))
    return [(a, b) for a, b, _ in accepted], grown, metrics


@dataclass(frozen=True)
class Aligned:
    """An aligner's round, for the cloud to apply: the accepted cross-party pairs of pool rows, the
    prototype set (None without alignment), the grown pairs (the cloud's ``grown``, now) and the
    round's metrics."""

    pairs: list[tuple[int, int]]
    protos: PrototypeSet | None
    grown: np.ndarray
    metrics: dict[str, float]


class NoAlignment:
    """No alignment (the baselines): samples are the parties' aligned ids; no label crosses."""

    name = "no alignment"

    def upload_spec(self, num_labels: int) -> dict[str, ArraySpec]:
        """What a party's upload carries besides its rows (its class prototypes, for eq. (9))."""
        return {}

    def upload(
        self, features: Callable[[], np.ndarray], masks: np.ndarray, labels: np.ndarray, num_labels: int
    ) -> dict[str, np.ndarray]:
        """A party's arrays of :meth:`upload_spec`, from all its rows' phi-representations
        (``features()``, computed only when needed), masks and labels (-1: unlabeled)."""
        return {}

    def align(self, r: CloudRound, grown: np.ndarray, options, num_parties: int, complete: Complete | None) -> Aligned:
        """The round's alignment of the pool's rows, given the pairs ``grown`` so far, the run's
        ``options`` and ``complete`` (the trained generator's completion of (z, mask), else None)."""
        return Aligned([], None, grown, {})

    def transfer_labels(
        self, r: CloudRound, samples: list[np.ndarray], options
    ) -> tuple[dict[int, dict[str, np.ndarray]], dict[str, float]]:
        """(per uploading party, the labels its unlabeled rows receive (``label_rows``,
        ``label_values``); the metrics)."""
        return {}, {}


class PrototypeAlignment(NoAlignment):
    """BoMM: global prototype-guided alignment (eq. (9)) on the unaligned rows, completed by the
    generator first (``complete_before_align``, once it has trained) and compared in the alignment
    space (:meth:`~fedtune.methods.bomm.cloud.BommCloud.alignment_space`); up to
    ``grow_per_round`` of the accepted pairs join the prototype set until it holds ``n_global``.
    With ``label_transfer``, a party's unlabeled rows take the label of their enlarged sample's
    labeled views."""

    name = "prototype alignment"

    def upload_spec(self, num_labels: int) -> dict[str, ArraySpec]:
        return {
            "prototypes": ArraySpec((num_labels, M, FEATURE_DIM), "float32", False),
            "proto_counts": ArraySpec((num_labels, M), "float32", False),
        }

    def upload(
        self, features: Callable[[], np.ndarray], masks: np.ndarray, labels: np.ndarray, num_labels: int
    ) -> dict[str, np.ndarray]:
        protos, counts = class_prototypes(features(), masks, labels, num_labels)
        return {"prototypes": protos, "proto_counts": counts}

    def align(self, r: CloudRound, grown: np.ndarray, options, num_parties: int, complete: Complete | None) -> Aligned:
        pool, o = r.pool, options
        zc, mc = complete(r.z, pool.mask)[:2] if o.complete_before_align and complete is not None else (r.z, pool.mask)
        protos = prototype_set(r.uploads, grown, num_parties, pool, r.st, zc, mc)
        pairs, grown, metrics = align_rows(
            pool, r.space(zc, mc), mc, protos.mapped(r.space), r.parties, grown, o, r.truth
        )
        return Aligned(pairs, protos, grown, metrics)

    def transfer_labels(
        self, r: CloudRound, samples: list[np.ndarray], options
    ) -> tuple[dict[int, dict[str, np.ndarray]], dict[str, float]]:
        """``transferred_labels`` counts the rows given a label (``diag_transferred_accuracy``: the
        share that is right, with ``diagnostics``)."""
        if not options.label_transfer:
            return {}, {}
        pool = r.pool
        given = np.full(len(pool), -1, dtype=np.int64)
        for rows in samples:
            known = pool.label[rows][pool.label[rows] >= 0]
            if len(known):
                given[rows[pool.label[rows] < 0]] = known[0]
        out = {}
        for k in r.parties:
            rows = np.flatnonzero((pool.party == k) & (given >= 0))
            out[k] = {"label_rows": pool.local[rows], "label_values": given[rows]}
        rows = np.flatnonzero(given >= 0)
        metrics = {"transferred_labels": float(len(rows))}
        if r.truth is not None and len(rows):
            metrics["diag_transferred_accuracy"] = float(np.mean(r.truth[rows] == given[rows]))
        return out, metrics
