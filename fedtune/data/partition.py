"""Partitioners: split a labelled pool over clients, deterministically under a seed.

``data.partition`` chooses one:

- ``iid``: a seeded shuffle cut into near-equal shards.
- ``dirichlet`` (per class, the common FL benchmark form): for each class c, the clients' shares
  p_c ~ Dir(alpha 1) split that class's examples; client sizes follow from the draws.
- ``dirichlet-client`` (per client, Hsu et al. 2019, as in FedPFT): client i's label
  distribution q_i ~ Dir(alpha p), p the pool's class frequencies, and its size set separately
  (near-equal sizes, the pool divided by the number of clients); examples are drawn without
  replacement, a class that runs out is dropped from the remaining draws (q_i renormalized).
- ``shards`` (pathological, McMahan et al. 2017): the pool sorted by label is cut into
  ``num_clients * data.shards_per_client`` equal shards and each client gets
  ``shards_per_client`` of them at random, so most clients see at most that many classes.
- ``column``: the data's own assignment, a column of client ids named by ``data.client_column``
  (FedIT's Dolly split: ``fedit_client``); the run must have as many clients as the column has ids.

Every client gets at least ``MIN_PER_CLIENT`` examples or the partitioner says in one line why it
cannot (:class:`~fedtune.config.ConfigError` naming the field). All of them work at 1,000 clients
and beyond as long as the pool holds ``MIN_PER_CLIENT`` examples per client.
"""

from __future__ import annotations

import numpy as np

from fedtune.config import ConfigError, DataConfig

MIN_PER_CLIENT = 2
_REDRAWS = 100


def _check_pool(num_examples: int, num_clients: int) -> None:
    if num_examples < num_clients * MIN_PER_CLIENT:
        raise ConfigError(
            f"federation.num_clients: {num_clients} clients need at least {num_clients * MIN_PER_CLIENT} "
            f"training examples ({MIN_PER_CLIENT} each), the pool has {num_examples}"
        )


def iid_partition(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle and cut into ``num_clients`` near-equal shards."""
    _check_pool(num_examples, num_clients)
    order = np.random.default_rng([seed, 1]).permutation(num_examples)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def _top_up(shards: list[list[int]], rng: np.random.Generator) -> None:
    """Move examples, one at a time, from the largest client to clients below ``MIN_PER_CLIENT``
    (a random example of the largest client): a small, deterministic repair that keeps the skew
    of every other client."""
    sizes = np.array([len(s) for s in shards])
    for small in np.flatnonzero(sizes < MIN_PER_CLIENT):
        while len(shards[small]) < MIN_PER_CLIENT:
            big = int(np.argmax([len(s) for s in shards]))
            shards[small].append(shards[big].pop(int(rng.integers(len(shards[big])))))


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Label skew per class: for each class c, client shares p_c ~ Dir(alpha * 1); smaller alpha,
    more skew.

    Redraws (up to 100 times, same seeded stream) until every client holds at least
    ``MIN_PER_CLIENT`` examples, the usual practice of FL benchmark code. When no draw does
    (many clients for the pool: 1,000 clients over 20,000 examples at alpha 0.5 never do), the
    last draw is repaired by :func:`_top_up`.
    """
    _check_pool(len(labels), num_clients)
    rng = np.random.default_rng([seed, 2])
    classes = np.unique(labels)
    for _ in range(_REDRAWS):
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
        _top_up(shards, rng)
    return [np.sort(np.array(s, dtype=np.int64)) for s in shards]


def client_dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Label skew per client (Hsu et al. 2019): q_i ~ Dir(alpha p), p the class frequencies of
    the pool; client i draws its near-equal share n_i of the pool from q_i without replacement."""
    _check_pool(len(labels), num_clients)
    rng = np.random.default_rng([seed, 3])
    classes, counts = np.unique(labels, return_counts=True)
    prior = counts / counts.sum()
    remaining = [list(rng.permutation(np.flatnonzero(labels == c))) for c in classes]
    left = counts.astype(np.int64).copy()
    sizes = [len(p) for p in np.array_split(np.arange(len(labels)), num_clients)]
    shards = []
    for size in sizes:
        q = rng.dirichlet(alpha * prior)
        take = np.zeros(len(classes), dtype=np.int64)
        need = size
        while need > 0:  # draw, cap at what is left, redraw the deficit over classes still available
            avail = left - take
            weights = np.where(avail > 0, q, 0.0)
            if weights.sum() <= 0:  # q puts no mass on what is left: fall back to the leftovers' sizes
                weights = avail.astype(np.float64)
            draw = rng.multinomial(need, weights / weights.sum())
            draw = np.minimum(draw, avail)
            take += draw
            need -= int(draw.sum())
        shard = []
        for c, n in enumerate(take):
            shard.extend(remaining[c][:n])
            del remaining[c][:n]
        left -= take
        shards.append(np.sort(np.array(shard, dtype=np.int64)))
    return shards


def shard_partition(labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """Pathological non-IID (McMahan et al. 2017): label-sorted pool in equal shards, each client
    gets ``shards_per_client`` shards drawn at random."""
    total = num_clients * shards_per_client
    if len(labels) < total * max(1, MIN_PER_CLIENT // shards_per_client):
        raise ConfigError(
            f"data.shards_per_client: {num_clients} clients x {shards_per_client} shards need at least "
            f"{total * max(1, MIN_PER_CLIENT // shards_per_client)} training examples, the pool has {len(labels)}"
        )
    rng = np.random.default_rng([seed, 4])
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, total)
    assignment = rng.permutation(total).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[j] for j in row])) for row in assignment]


def column_partition(values: np.ndarray, num_clients: int, column: str) -> list[np.ndarray]:
    """The data's own assignment: client i holds the examples whose ``column`` value is the i-th
    smallest distinct value (FedIT's Dolly split: ``fedit_client`` 0-9)."""
    ids = np.unique(values)
    if len(ids) != num_clients:
        raise ConfigError(
            f"federation.num_clients: data.client_column {column!r} assigns the pool to {len(ids)} clients, "
            f"the run has {num_clients}"
        )
    parts = [np.flatnonzero(values == v) for v in ids]
    small = next((i for i, p in enumerate(parts) if len(p) < MIN_PER_CLIENT), None)
    if small is not None:
        raise ConfigError(
            f"data.client_column: client {small} ({column} = {ids[small]}) holds {len(parts[small])} training "
            f"examples, fewer than {MIN_PER_CLIENT} (data.max_train_samples too small?)"
        )
    return parts


def partition(
    labels: np.ndarray,
    num_clients: int,
    cfg: DataConfig,
    seed: int,
    columns: dict[str, np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Client id -> indices into the pool, by ``cfg.partition``; ``columns``: the pool's further
    integer columns by name (``column`` partitions by ``cfg.client_column``)."""
    labels = np.asarray(labels)
    if cfg.partition == "column":
        column, columns = cfg.client_column, columns or {}
        if column is None:
            raise ConfigError("data.client_column: data.partition = 'column' needs the name of the client column")
        if column not in columns:
            have = ", ".join(sorted(columns)) or "none"
            raise ConfigError(f"data.client_column: data {cfg.name!r} has no column {column!r} (its columns: {have})")
        return column_partition(np.asarray(columns[column]), num_clients, column)
    if cfg.partition == "iid":
        return iid_partition(len(labels), num_clients, seed)
    if cfg.partition == "dirichlet":
        return dirichlet_partition(labels, num_clients, cfg.alpha, seed)
    if cfg.partition == "dirichlet-client":
        return client_dirichlet_partition(labels, num_clients, cfg.alpha, seed)
    if cfg.partition == "shards":
        return shard_partition(labels, num_clients, cfg.shards_per_client, seed)
    raise ConfigError(
        f"data.partition: expected iid, dirichlet, dirichlet-client, shards or column, got {cfg.partition!r}"
    )


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> list[list[int]]:
    """Per-client label counts, ``[client][class]``."""
    return [np.bincount(labels[p], minlength=num_classes).tolist() for p in parts]
