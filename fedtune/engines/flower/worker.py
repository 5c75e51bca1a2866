"""Serving one client request in this process, with the run's model and data built once per process
and kept warm (a node's executor, :mod:`.executor`, serves every message of its node this way).

A node served by a thread of the server's own process (:class:`~.executor.NodeThread`, the loopback
deployment's first node) trains on the server's base, as the embedded engine's clients do: one
base in the process, not two. :data:`SHARED` holds the server's context and whose turn it is to use
that base: the server's from its run's start to its end, but while it waits for replies
(:func:`~.transport.exchange` lends it), the node's while it serves a request. So a straggler still
training after the server stopped waiting for it never overlaps the server's evaluation or saving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import numpy as np

from fedtune.config import RunConfig
from fedtune.engines.flower.budgets import node_client
from fedtune.engines.flower.codec import sends_compute_s
from fedtune.engines.rounds import answer
from fedtune.process import release_free_memory, setup_process
from fedtune.protocol.messages import Message

if TYPE_CHECKING:
    from fedtune.runtime import RunContext

State = dict[str, np.ndarray]  # a client's persistent state (Client.state)

_CONTEXTS: dict[str, RunContext] = {}  # config JSON -> RunContext, one per process (a Ray actor, an executor)
_CONTEXTS_LOCK = threading.Lock()
_IN_PLACE = threading.local()  # .contexts (config JSON -> RunContext) in a thread serving a node in place


class SharedBase:
    """The server's context (:attr:`server`, set by the server while it runs) whose base a node
    served in place shares, and the turn to use that base (see the module docstring)."""

    def __init__(self) -> None:
        self.server: RunContext | None = None
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread holding the turn

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn (waiting for it) within the block."""
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    @contextmanager
    def lent(self) -> Iterator[None]:
        """Give up the turn within the block if this thread holds it (the server, waiting for replies),
        and take it back after; a no-op in a thread that does not hold it."""
        mine = self._holder == threading.get_ident()
        if mine:
            self._holder = None
            self._lock.release()
        try:
            yield
        finally:
            if mine:
                self._lock.acquire()
                self._holder = threading.get_ident()


SHARED = SharedBase()


@contextmanager
def serving_in_place() -> Iterator[None]:
    """Mark the calling thread, within the block, as one serving a node in the server's process: its
    requests run on contexts of its own that share the server's base, each in its turn
    (:class:`SharedBase`)."""
    _IN_PLACE.contexts = {}
    try:
        yield
    finally:
        del _IN_PLACE.contexts


def _in_place_context(config: RunConfig, contexts: dict[str, RunContext]) -> RunContext:
    """The context of a thread serving a node in place for ``config``: built once, sharing the
    server's base (:attr:`SharedBase.server`) when the server runs the same resolved run, as the
    embedded engine's clients do, and its task (the data, loaded once); torch threads as the
    server's (the process's)."""
    from fedtune.runtime import RunContext, resolve_run

    key = config.model_dump_json()
    if key not in contexts:
        run, server = resolve_run(config), SHARED.server
        shares = server if server is not None and server.config == run.config else None
        contexts[key] = RunContext(run, shares_base=shares)
        if shares is not None:  # and the server's task: one copy of the data, used in turn
            contexts[key].task = shares.task
    return contexts[key]


def _process_context(config: RunConfig, threads: int | None = None) -> RunContext:
    """This process's RunContext for ``config`` (resolved and built once per process: it caches the
    model and the data); ``train.threads``, else ``threads``, torch threads. In a thread serving a
    node in place (:func:`serving_in_place`): that thread's (:func:`_in_place_context`)."""
    from fedtune.runtime import RunContext, resolve_run

    in_place = getattr(_IN_PLACE, "contexts", None)
    if in_place is not None:
        return _in_place_context(config, in_place)
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
    release_free_memory()  # the last client's freed pages go back before this one trains, as embedded
    with SHARED.turn() if hasattr(_IN_PLACE, "contexts") else nullcontext():  # in place: the base's turn
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
