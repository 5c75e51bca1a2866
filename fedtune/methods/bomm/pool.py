"""What the BoMM cloud holds: every party's uploaded rows as one pool, and the rows grouped into
samples (the same sample id, merged along aligned pairs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from fedtune.methods.bomm.backbone import FEATURE_DIM
from fedtune.methods.bomm.common import Standardizer
from fedtune.models.multimodal import MODALITY_NAMES

M = len(MODALITY_NAMES)
UPLOAD = ("rows", "sample_ids", "masks", "labels", "features")
PROTOTYPES = ("prototypes", "proto_counts")


@dataclass
class Pool:
    """Every row the cloud holds, parties' uploads concatenated: party, party-local position,
    sample id, modality mask (R, M), label (-1 unknown) and raw phi-representations (R, M, D)."""

    party: np.ndarray
    local: np.ndarray
    sid: np.ndarray
    mask: np.ndarray
    label: np.ndarray
    x: np.ndarray

    def __len__(self) -> int:
        return len(self.party)

    @classmethod
    def of(cls, uploads: dict[int, dict[str, np.ndarray]]) -> Pool:
        parties = sorted(uploads)
        if not parties:
            return cls(
                *(np.zeros(0, np.int64) for _ in range(3)),
                np.zeros((0, M), bool),
                np.zeros(0, np.int64),
                np.zeros((0, M, FEATURE_DIM), np.float32),
            )
        cat = lambda key: np.concatenate([np.asarray(uploads[k][key]) for k in parties])  # noqa: E731
        party = np.concatenate([np.full(len(uploads[k]["rows"]), k, np.int64) for k in parties])
        return cls(
            party,
            cat("rows").astype(np.int64),
            cat("sample_ids").astype(np.int64),
            cat("masks").astype(bool),
            cat("labels").astype(np.int64),
            cat("features").astype(np.float32),
        )


Space = Callable[[np.ndarray, np.ndarray], np.ndarray]  # f(z (n, M, D), mask (n, M)) -> (n, M, E)


@dataclass(frozen=True)
class CloudRound:
    """What the cloud's parts (aligner, completer) read of one round, never the cloud itself: the
    round, the run's seed, the parties' uploads and their pool, the standardization ``st`` and the
    standardized rows ``z``, the alignment ``space`` (eq. (9)'s representations) and, for
    diagnostics only (None without them), the pool rows' true labels."""

    rnd: int
    seed: int
    uploads: Mapping[int, Mapping[str, np.ndarray]]
    pool: Pool
    st: Standardizer
    z: np.ndarray
    space: Space
    truth: np.ndarray | None

    @property
    def parties(self) -> list[int]:
        """The uploading parties, ascending."""
        return sorted(self.uploads)


def union_samples(sid: np.ndarray, pairs: list[tuple[int, int]]) -> list[np.ndarray]:
    """Rows grouped into samples: the same sample id, merged along ``pairs`` (union-find); each
    sample's rows ascending, samples ordered by their first row."""
    parent = list(range(len(sid)))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    first: dict[int, int] = {}
    for r, s in enumerate(sid):
        s = int(s)
        if s in first:
            parent[find(r)] = find(first[s])
        else:
            first[s] = r
    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for r in range(len(sid)):
        groups.setdefault(find(r), []).append(r)
    return [np.asarray(g, dtype=np.int64) for _, g in sorted(groups.items())]
