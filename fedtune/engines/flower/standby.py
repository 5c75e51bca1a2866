"""Keeping a deployment's SuperNodes from Flower's 3 s idle sleep between rounds.

A Flower 1.41 SuperNode asks the SuperLink for one message, waits for its reply, sends it and asks
again at once; only when it finds no message does it sleep 3 s (a constant, not an option). It
finds none right after each reply: the server has not yet pulled that reply, aggregated and pushed
the next request. So every round's request waited up to 3 s for its node.

The ServerApp keeps a cheap *standby* message (``query.standby``, empty content, answered at once
by the node's ClientApp) queued for every node whose next request is not there yet:

- with each request it pushes a standby right behind it, so the node, having replied, takes that
  instead of sleeping;
- a node answering a standby holds it for Flower's reply poll (0.5 s) and then asks again; the next
  standby is pushed :data:`LEAD_S` s after the previous reply reached the server, while the node
  is still busy with the one before, unless the node's next request went out first.

A request so waits at most for the standby in progress (0.5 s), not 3 s. The cost is the standby
traffic of an idle node (about 2 small messages a second) while the server works between rounds
or waits for other nodes; only the nodes of the latest exchange are kept awake (with partial
participation the others sleep, and a node sampled again after sleeping pays Flower's wait once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from flwr.app import Message as FlowerMessage
from flwr.app import RecordDict

from fedtune.engines.flower.runtime_api import pull_replies

STANDBY = "query.standby"  # the message type of a standby (a query: every ClientApp routes it)
LEAD_S = 0.3  # a standby is pushed this long after the reply of the one before it (< the 0.5 s hold)
PERIOD_S = 0.05  # seconds between two pulls of standby replies


class Standby:
    """Standby messages for the nodes of ``grid`` (a background thread between :meth:`start` and
    :meth:`stop`, pulling standby replies every ``period_s`` s; a standby goes out ``lead_s`` s
    after the reply before it); the round loop calls :meth:`sent` after pushing requests to nodes
    and :meth:`replied` when a node's reply to a request arrives."""

    def __init__(self, grid: Any, lead_s: float = LEAD_S, period_s: float = PERIOD_S) -> None:
        self.grid, self.lead_s, self.period_s = grid, lead_s, period_s
        self.lock = threading.Lock()
        self.queued: dict[str, int] = {}  # standby message id -> its node
        self.busy: dict[int, int] = {}  # node -> its requests outstanding
        self.due: dict[int, float] = {}  # node -> when its next standby goes out (monotonic s)
        self.followed: set[int] = set()  # the nodes of the latest exchange: the ones kept awake
        self.pushed = 0  # standbys pushed so far
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> Standby:
        """Start the background thread (idempotent)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, daemon=True, name="fedtune-standby")
            self.thread.start()
        return self

    def stop(self) -> None:
        """Stop pushing standbys (those queued are answered or dropped with the run)."""
        self.done.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _push(self, nodes: Iterable[int]) -> None:
        """Push one standby to each of ``nodes`` (caller holds the lock)."""
        nodes = list(nodes)
        if not nodes:
            return
        out = [FlowerMessage(RecordDict(), dst_node_id=n, message_type=STANDBY, group_id="standby") for n in nodes]
        for node, msg_id in zip(nodes, self.grid.push_messages(out)):
            if msg_id:
                self.queued[msg_id] = node
                self.pushed += 1

    def sent(self, nodes: Iterable[int]) -> None:
        """Requests went out to ``nodes`` (a node once per request), the nodes now kept awake: queue
        a standby behind each node's, so a node that replies finds it instead of an empty queue."""
        nodes = list(nodes)
        with self.lock:
            self.followed = set(nodes)
            self.due = {n: t for n, t in self.due.items() if n in self.followed}
            for node in nodes:
                self.busy[node] = self.busy.get(node, 0) + 1
                self.due.pop(node, None)
            self._push(sorted(self.followed))

    def replied(self, node: int, now: float | None = None) -> None:
        """``node`` answered a request (at ``now``, monotonic s); having answered them all it holds
        the standby queued behind them, and the next one is due :attr:`lead_s` s later."""
        with self.lock:
            left = self.busy.get(node, 0) - 1
            if left > 0:
                self.busy[node] = left
                return
            self.busy.pop(node, None)
            self.due[node] = (time.monotonic() if now is None else now) + self.lead_s

    def tick(self, now: float | None = None) -> None:
        """Pull the standby replies that arrived and push the standbys due by ``now`` (monotonic s):
        a node that answered one holds the next, queued (the one after is due :attr:`lead_s` s
        later), or found none and sleeps (one goes out at once)."""
        with self.lock:
            pending = list(self.queued)
        got = pull_replies(self.grid, pending) if pending else []
        now = time.monotonic() if now is None else now
        with self.lock:
            for reply in got:
                node = self.queued.pop(reply.metadata.reply_to_message_id, None)
                if node is not None and node in self.followed and node not in self.busy:
                    waiting = sum(1 for n in self.queued.values() if n == node)
                    self.due[node] = now + self.lead_s if waiting else now
            if self.done.is_set():
                return
            ready = [n for n, t in self.due.items() if t <= now and n not in self.busy]
            for node in ready:
                del self.due[node]
            self._push(ready)

    def _loop(self) -> None:
        while not self.done.wait(self.period_s):
            self.tick()
