"""In-process delivery of requests to clients: :func:`exchange` (a message and its reply cross as
bytes, and the bytes accounted are the bytes that crossed) and :class:`LocalTransport` (a fresh
client per request, its persistent state kept between rounds). The embedded engine serves its
clients through it in the server's process (:mod:`fedtune.engines.embedded`), and each worker of
a device pool in its own (:mod:`fedtune.engines.device_pool`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from fedtune.engines.rounds import Delivery, answer
from fedtune.process import release_free_memory
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message


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


class LocalTransport:
    """In-process delivery: a fresh client per message, built by ``make_client(cid, state)``,
    where ``state`` is a copy of that client's persistent dict (see Client), kept here between
    rounds and updated only when the client answers; ``seed``: the run's (requests are served with
    it, :func:`~fedtune.engines.rounds.answer`). A client that raises is a failed
    :class:`~fedtune.engines.rounds.Delivery` (the round loop drops it), not a crash."""

    def __init__(self, make_client: Callable[[int, dict[str, np.ndarray]], Client], seed: int) -> None:
        self.make_client, self.seed = make_client, seed
        self.states: dict[int, dict[str, np.ndarray]] = {}

    def __call__(self, kind: str, rnd: int, messages: dict[int, Message], attempt: int = 0) -> dict[int, Delivery]:
        return {cid: self.deliver(kind, rnd, cid, message, attempt) for cid, message in messages.items()}

    def deliver(self, kind: str, rnd: int, cid: int, message: Message, attempt: int = 0) -> Delivery:
        """Client ``cid``'s answer to ``message``, a ``kind`` request of round ``rnd`` (try ``attempt``;
        its state kept only when it answers)."""
        release_free_memory()  # the last client's freed pages go back before this one trains
        client = self.make_client(cid, dict(self.states.get(cid, {})))
        try:
            reply, down, up, seconds = exchange(message, lambda m: answer(client, kind, m, self.seed, rnd, attempt))
        except Exception as exc:  # noqa: BLE001 - any client failure is a drop, named in the record
            return Delivery(None, message.nbytes, error=f"{type(exc).__name__}: {exc}")
        self.states[cid] = client.state
        return Delivery(reply, down, up, seconds, sender=cid, round=rnd)
