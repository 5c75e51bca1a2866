"""Embedded engine: every client in this process, sequential, deterministic under the run's seed.

Every message crosses as bytes (encode, then decode on the other side), so nothing is shared
between the server and a client, and the bytes accounted are the bytes that crossed. The
clients get a RunContext of their own (:func:`embedded_engine`): server and clients share
nothing but Messages.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from fedtune.config import RunConfig
from fedtune.engines.rounds import RoundRecord, Transport, drive_rounds
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy


def exchange(message: Message, handler: Callable[[Message], Message]) -> tuple[Message, int, int, float]:
    """Send ``message`` as bytes, run ``handler`` on the decoded copy; return the decoded reply,
    the bytes down and up, and the seconds the handler took (the client's compute)."""
    down = message.encode()
    received = Message.decode(down)
    start = time.perf_counter()
    reply = handler(received)
    seconds = time.perf_counter() - start
    up = reply.encode()
    return Message.decode(up), len(down), len(up), seconds


def local_transport(make_client: Callable[[int, dict], Any]) -> Transport:
    """In-process delivery: a fresh client per message, built by ``make_client(cid, state)``,
    where ``state`` is that client's persistent dict (see Client), kept here between rounds."""
    states: dict[int, dict] = {}

    def send(kind: str, rnd: int, messages: dict[int, Message]) -> dict[int, tuple[Message, int, int, float]]:
        out = {}
        for cid, message in messages.items():
            client = make_client(cid, states.setdefault(cid, {}))
            out[cid] = exchange(message, client.fit if kind == "train" else client.evaluate)
            states[cid] = client.state
        return out

    return send


def run_rounds(
    strategy: Strategy,
    make_client: Callable[[int, dict], Any],
    num_clients: int,
    sample_size: int,
    rounds: int,
    seed: int,
    eval_every: int = 1,
    on_round: Callable[[RoundRecord], None] | None = None,
    start_round: int = 1,
) -> list[RoundRecord]:
    """The embedded engine: :func:`drive_rounds` with in-process clients from ``make_client``."""
    return drive_rounds(
        strategy, local_transport(make_client), num_clients, sample_size, rounds, seed, eval_every, on_round, start_round
    )


def embedded_engine(config: RunConfig) -> Callable[[Strategy, Callable[[RoundRecord], None]], list[RoundRecord]]:
    """The engine :func:`fedtune.run.run_experiment` uses by default: ``engine(strategy, on_round)``
    runs every round with the clients in this process, on a RunContext of their own."""
    from fedtune.runtime import RunContext

    clients = RunContext(config)
    fed = config.federation

    def engine(strategy: Strategy, on_round: Callable[[RoundRecord], None]) -> list[RoundRecord]:
        return run_rounds(
            strategy, clients.client, fed.num_clients, fed.sample_size(), config.rounds, config.seed,
            config.eval_every, on_round,
        )

    return engine
