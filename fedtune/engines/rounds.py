"""The round loop every engine runs (:func:`drive_rounds`): seeded client sampling, a
Strategy's configure / aggregate calls, and per-round records with the bytes that crossed.
An engine supplies only a :data:`Transport` that delivers a round's Messages to clients.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy


def sample_clients(num_clients: int, sample_size: int, seed: int, rnd: int) -> list[int]:
    """Clients of round ``rnd``: uniform without replacement, from (seed, round) alone."""
    if sample_size >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, rnd, 0x5A])
    return sorted(int(c) for c in rng.choice(num_clients, size=sample_size, replace=False))


@dataclass
class RoundRecord:
    round: int
    clients: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    client_bytes_up: dict[int, int] = field(default_factory=dict)
    client_bytes_down: dict[int, int] = field(default_factory=dict)
    client_steps: dict[int, int] = field(default_factory=dict)
    client_compute_s: dict[int, float] = field(default_factory=dict)
    eval_bytes: int = 0
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line for this round."""
        return {
            "round": self.round,
            "accuracy": self.metrics.get("accuracy"),
            "loss": self.metrics.get("loss"),
            "bytes_up": sum(self.client_bytes_up.values()),
            "bytes_down": sum(self.client_bytes_down.values()),
            "eval_bytes": self.eval_bytes,
            "wall_s": self.wall_s,
            "compute_s": sum(self.client_compute_s.values()),
            "clients": self.clients,
            **{k: v for k, v in self.metrics.items() if k not in ("accuracy", "loss")},
            "client_bytes_up": {str(k): v for k, v in self.client_bytes_up.items()},
            "client_bytes_down": {str(k): v for k, v in self.client_bytes_down.items()},
            "client_steps": {str(k): v for k, v in self.client_steps.items()},
            "client_compute_s": {str(k): round(v, 4) for k, v in self.client_compute_s.items()},
        }


#: ``transport(kind, rnd, messages)`` delivers ``messages`` (client id -> Message) as ``kind``
#: ("train" or "evaluate") and returns client id -> (reply, bytes down, bytes up, client seconds),
#: in the order of ``messages`` (aggregation sums in that order).
Transport = Callable[[str, int, dict[int, Message]], dict[int, tuple[Message, int, int, float]]]


def drive_rounds(
    strategy: Strategy,
    transport: Transport,
    num_clients: int,
    sample_size: int,
    rounds: int,
    seed: int,
    eval_every: int = 1,
    on_round: Callable[[RoundRecord], None] | None = None,
    start_round: int = 1,
) -> list[RoundRecord]:
    """Rounds ``start_round..rounds`` of ``strategy``, messages delivered by ``transport`` (the
    embedded engine's :func:`~fedtune.engines.embedded.local_transport`, or Flower's grid): one loop for every engine."""
    history = []
    for rnd in range(start_round, rounds + 1):
        start = time.perf_counter()
        record = RoundRecord(rnd, sample_clients(num_clients, sample_size, seed, rnd))
        replies = {}
        fit_messages = strategy.configure_fit(rnd, record.clients)
        for cid, (reply, down, up, seconds) in transport("train", rnd, fit_messages).items():
            replies[cid] = reply
            record.client_bytes_down[cid], record.client_bytes_up[cid] = down, up
            record.client_steps[cid] = int(reply.meta.get("steps", 0))
            record.client_compute_s[cid] = seconds
        record.metrics.update(strategy.aggregate_fit(rnd, replies))
        if rnd % eval_every == 0 or rnd == rounds:
            record.metrics.update(strategy.evaluate(rnd))
            eval_messages = strategy.configure_evaluate(rnd, list(range(num_clients)))
            eval_replies = {}
            for cid, (reply, down, up, _) in transport("evaluate", rnd, eval_messages).items():
                eval_replies[cid] = reply
                record.eval_bytes += down + up
            if eval_replies:
                record.metrics.update(strategy.aggregate_evaluate(rnd, eval_replies))
        record.wall_s = time.perf_counter() - start
        history.append(record)
        if on_round is not None:
            on_round(record)
    return history
