"""Serving one client request in this process, with the run's model and data built once per process
and kept warm (a node's executor, :mod:`.executor`, serves every message of its node this way)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from fedtune.config import RunConfig
from fedtune.engines.flower.budgets import node_client
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
    (:func:`~fedtune.engines.flower.budgets.node_client`)."""
    context = _process_context(config, threads)
    client = context.client(cid, state) if budget is None else node_client(context, cid, state, budget)
    start = time.perf_counter()
    reply = answer(client, kind, request, config.seed, rnd, attempt)
    return reply, client.state, time.perf_counter() - start
