"""What crosses between the round loop and the clients: the :class:`Transport` an engine gives
the round loop (:class:`SecureTransport` under secure aggregation), one client's :class:`Delivery`,
and :func:`answer`, which serves a request on the client side as every engine does.

Fault injection for tests and benchmarks: profile fields ``failure_prob`` (a client fails a
request with that probability, drawn from (seed, round, client, attempt)), ``delay_s`` (it
waits that long before answering) and ``attack`` (a hostile client: every floating array of its
training reply sign-flipped, or scaled by ``attack_scale``; clients reply with updates, so this
is the update; or, ``"metadata"``, the metadata of every reply replaced by ``attack_metadata``,
whatever it is), applied on the client side by :func:`answer`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SECURE_LAYOUT, SecureSum

TRAIN, EVALUATE = "train", "evaluate"  # transport kinds; any other kind is a Strategy phase


class InjectedFailure(RuntimeError):
    """A failure injected by the client's profile (``failure_prob``)."""


def answer(client: Client, kind: str, message: Message, seed: int, rnd: int, attempt: int = 0) -> Message:
    """Serve one request ``message`` of exchange ``kind`` on ``client``'s side, as every engine
    does: the profile's injected delay and failure first (drawn from ``seed``, ``rnd`` and
    ``attempt``), then ``fit`` ("train"), ``evaluate``, or the named phase. Under secure
    aggregation (the request names a ``secure_layout``) a training reply's arrays become the vector
    the client masks (:meth:`Client.secure_reply`)."""
    profile = client.profile
    if profile.delay_s:
        time.sleep(profile.delay_s)
    if (
        profile.failure_prob
        and np.random.default_rng([seed, rnd, client.cid, attempt, 0xFA11]).random() < profile.failure_prob
    ):
        raise InjectedFailure(f"injected failure (failure_prob {profile.failure_prob})")
    if kind == TRAIN:
        if profile.memory_gib is not None or profile.gradient_checkpointing:  # measured; planned checkpointing
            from fedtune.planning.planner import metered_fit

            reply = metered_fit(client, message)
        else:
            reply = client.fit(message)
        reply = (
            attacked(reply, profile.attack, profile.attack_scale, profile.attack_metadata) if profile.attack else reply
        )
        return client.secure_reply(message, reply) if SECURE_LAYOUT in message.meta else reply
    if kind == EVALUATE:
        reply = client.evaluate(message)
    elif profile.memory_gib is not None:  # a phase of the round's training (RABO's hypergradient): measured too
        from fedtune.planning.planner import metered_fit

        reply = metered_fit(client, message, partial(client.phase, kind))
    else:
        reply = client.phase(kind, message)
    return attacked(reply, "metadata", 0.0, profile.attack_metadata) if profile.attack == "metadata" else reply


def attacked(reply: Message, attack: str, scale: float, metadata: Any = None) -> Message:
    """``reply`` with every floating array sign-flipped (``attack`` ``"sign-flip"``) or times
    ``scale`` (``"scale"``), integer arrays (top-k indices) and the metadata as they are; or
    (``"metadata"``) its arrays as they are and ``metadata`` as its metadata."""
    if attack == "metadata":
        return Message(reply.arrays, metadata)  # hostile: any value, a mapping or not
    factor = -1.0 if attack == "sign-flip" else scale
    arrays = {
        k: (v * factor).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v for k, v in reply.arrays.items()
    }
    return Message(arrays, reply.meta)


@dataclass
class Delivery:
    """One client's answer to one message, as the transport saw it."""

    reply: Message | None  # None when the client failed or never answered
    down: int  # bytes sent to the client
    up: int = 0  # bytes it sent back
    seconds: float = 0.0  # its compute time
    sender: int | None = None  # the client id the reply claims
    round: int | None = None  # the round the reply claims
    error: str | None = None  # why there is no reply
    masked: bool = False  # the reply's arrays crossed masked (secure aggregation): only its meta is checked here


class Transport(Protocol):
    """What an engine gives the round loop: ``transport(kind, rnd, messages, attempt)`` delivers
    ``messages`` (client id -> Message) as ``kind`` ("train", "evaluate" or a Strategy phase name)
    and returns client id -> Delivery for every message, in the order of ``messages``
    (aggregation sums in that order)."""

    def __call__(self, kind: str, rnd: int, messages: dict[int, Message], attempt: int) -> dict[int, Delivery]:
        """One exchange's deliveries (see the class docstring)."""
        ...


@runtime_checkable
class SecureTransport(Transport, Protocol):
    """A transport that masks the training replies (secure aggregation,
    :mod:`fedtune.engines.flower.secagg`): its training deliveries carry metadata only
    (``Delivery.masked``), and the round aggregates the sum of the valid ones' updates
    (:meth:`Strategy.aggregate_secure_fit`), which :meth:`unmask` rebuilds."""

    def unmask(
        self, rnd: int, attempt: int, client_ids: list[int], sent: dict[int, Message]
    ) -> tuple[SecureSum | None, dict[int, Delivery]]:
        """The sum of the masked updates of ``client_ids`` (None when it cannot be rebuilt) and
        the unmask exchange's deliveries, for round ``rnd``'s ``attempt`` whose requests were
        ``sent``."""
        ...
