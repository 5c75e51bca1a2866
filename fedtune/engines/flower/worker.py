"""Serving one client request in this process, with the run's model and data built once per process
and kept warm (a node's executor, :mod:`.executor`, serves every message of its node this way)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from fedtune.config import RunConfig
from fedtune.engines.flower.budgets import node_client
from fedtune.engines.flower.codec import sends_compute_s
from fedtune.engines.rounds import answer
from fedtune.process import setup_process
from fedtune.protocol.messages import Message

if TYPE_CHECKING:
    from fedtune.runtime import RunContext

State = dict[str, np.ndarray]  # a client's persistent state (Client.state)

_CONTEXTS: dict[str, RunContext] = {}  # config JSON -> RunContext, one per process (a Ray actor, an executor)
_CONTEXTS_LOCK = threading.Lock()


def _process_context(config: RunConfig, threads: int | None = None) -> RunContext:
    """This process's RunContext for ``config`` (resolved and built once per process: it caches the
    model and the data); ``train.threads``, else ``threads``, torch threads."""
    from fedtune.runtime import RunContext, resolve_run

    key = config.model_dump_json()
    with _CONTEXTS_LOCK:
        if key not in _CONTEXTS:
            setup_process(config.train.threads or threads)
            _CONTEXTS[key] = RunContext(resolve_run(config))
        return _CONTEXTS[key]


def serve_request(
    config: RunConfig,
    kind: str,
    cid: int,
    request: Message,
    state: State,
    rnd: int,
    attempt: int,
    threads: int | None = None,
    budget: str | None = None,
) -> tuple[Message, State, float]:
    """Serve one ``kind`` request of round ``rnd`` (try ``attempt``) of the run ``config`` as client
    ``cid`` with its ``state``, in this process (``threads``: torch threads, a config's
    ``train.threads`` first): (reply, the client's new state, seconds of the Client call), through
    :func:`~fedtune.engines.rounds.answer` (fault injection, then ``fit`` or ``evaluate``), timed as
    the embedded engine times it. ``budget``: the node's own budget and the request's setting
    (:func:`~fedtune.engines.flower.budgets.node_client`). Where the reply carries no seconds (local
    DP, SecAgg+), a call slower than the round's or the client's deadline raises
    :class:`DeadlineMissed` instead (the client's state of that call is not kept)."""
    context = _process_context(config, threads)
    client = context.client(cid, state) if budget is None else node_client(context, cid, state, budget)
    start = time.perf_counter()
    reply = answer(client, kind, request, config.seed, rnd, attempt)
    seconds = time.perf_counter() - start
    if not sends_compute_s(config):  # the server cannot time this client (local DP, SecAgg+): the node does
        limits = [s for s in (config.federation.round_timeout_s, client.profile.deadline_s) if s]
        if limits and seconds > min(limits):
            raise DeadlineMissed(f"missed its {min(limits):g} s deadline")  # the seconds stay on the node
    return reply, client.state, seconds


class DeadlineMissed(RuntimeError):
    """A client slower than ``federation.round_timeout_s`` or its ``deadline_s``, found by its own
    node where the reply carries no seconds (:func:`~fedtune.engines.flower.codec.sends_compute_s`):
    the request fails, so the server drops the client as the embedded engine does, without learning
    how long it took."""
