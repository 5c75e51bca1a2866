"""Partitioners: split a labelled pool over clients, deterministically under a seed."""

from __future__ import annotations

import numpy as np

MIN_PER_CLIENT = 2


def iid_partition(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle and cut into ``num_clients`` near-equal shards."""
    order = np.random.default_rng([seed, 1]).permutation(num_examples)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Label skew: for each class c, client shares p_c ~ Dir(alpha * 1); smaller alpha, more skew.

    Redraws (up to 100 times, same seeded stream) until every client holds at least
    ``MIN_PER_CLIENT`` examples, the usual practice of FL benchmark code.
    """
    if len(labels) < num_clients * MIN_PER_CLIENT:
        raise ValueError(
            f"federation.num_clients: {num_clients} clients need at least {num_clients * MIN_PER_CLIENT} "
            f"training examples, the pool has {len(labels)}"
        )
    rng = np.random.default_rng([seed, 2])
    classes = np.unique(labels)
    for _ in range(100):
        shards: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for shard, part in zip(shards, np.split(idx, cuts)):
                shard.extend(part.tolist())
        if min(len(s) for s in shards) >= MIN_PER_CLIENT:
            break
    else:
        raise ValueError(f"data.alpha: could not give each of {num_clients} clients {MIN_PER_CLIENT} examples")
    return [np.sort(np.array(s, dtype=np.int64)) for s in shards]


def partition(labels: np.ndarray, num_clients: int, scheme: str, alpha: float, seed: int) -> list[np.ndarray]:
    if scheme == "iid":
        return iid_partition(len(labels), num_clients, seed)
    if scheme == "dirichlet":
        return dirichlet_partition(labels, num_clients, alpha, seed)
    raise ValueError(f"data.partition: expected 'iid' or 'dirichlet', got {scheme!r}")


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> list[list[int]]:
    """Per-client label counts, ``[client][class]``."""
    return [np.bincount(labels[p], minlength=num_classes).tolist() for p in parts]
