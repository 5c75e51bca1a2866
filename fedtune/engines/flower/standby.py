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

The lead is a margin (0.5 - 0.3 s) that a loaded machine can eat: a server whose pull of the reply
and push of the next standby take longer leaves the node an empty queue. So it is measured, not
trusted: a standby pushed to an idle node whose reply comes back later than its queue ahead of it
and a hold allow (:func:`slept`) shows the node slept; the lead then shrinks by :data:`LEAD_STEP_S`,
down to 0 (the next standby goes out as soon as the reply before it arrives), and after that every
node kept awake gets one spare standby more queued, behind its requests too (up to
:data:`MOST_QUEUED` outstanding per node), so a reply the server pulls up to a hold late still
leaves one in the queue. Standby replies are pulled by their own message ids only,
so however late they come no request's reply is taken or duplicated.

The node's hold of a standby is Flower's reply poll only if the reply misses the SuperNode's first
check, made as soon as it has confirmed the message (0.03-0.36 s after taking it, seen on a loaded
2-core machine); an executor fast enough to beat that check made holds of 0.1 s, shorter than any
server can follow, and the node slept 3 s. So a node's executor answers a standby no sooner than
:data:`REPLY_AFTER_S` after claiming it (:func:`hold_reply`): the node holds each for one reply poll.
Its next message can then come no sooner than that poll sees the reply (0.2-0.3 s later), so the
executor claims its next task :data:`CLAIM_AFTER_S` after a standby: every claim is an HTTP request
the SuperNode serves, and a node between requests answers about two standbys a second.

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
HOLD_S = 0.5  # how long a SuperNode holds a message it answered (Flower 1.41's reply poll)
LEAD_STEP_S = 0.1  # how much the lead shrinks on each sign that a node slept
MOST_QUEUED = 3  # the most standbys outstanding for one node (held and queued)
REPLY_AFTER_S = 0.3  # a node's executor answers a standby no sooner than this after claiming it
CLAIM_AFTER_S = 0.15  # ... and claims its next task no sooner than this after answering it


def slept(waited: float, outstanding: int) -> bool:
    """Whether a standby whose reply came ``waited`` s after its push, pushed with ``outstanding``
    standbys (itself included) outstanding for an idle node, shows that the node found its queue
    empty and slept: longer than the holds of those ahead of it and its own, plus one hold of slack
    (Flower's idle sleep is 3 s)."""
    return waited > HOLD_S * (outstanding + 1)


def hold_reply(claimed: float, stop: threading.Event | None = None) -> None:
    """Wait until :data:`REPLY_AFTER_S` s after ``claimed`` (monotonic s: when the node's executor
    claimed a standby) before its reply is pushed, or until ``stop`` is set: the SuperNode's first
    reply check has passed by then, so it holds the standby one full reply poll (:data:`HOLD_S`)."""
    left = claimed + REPLY_AFTER_S - time.monotonic()
    if left > 0:
        (time.sleep if stop is None else stop.wait)(left)


class Standby:
    """Standby messages for the nodes of ``grid`` (a background thread between :meth:`start` and
    :meth:`stop`, pulling standby replies every ``period_s`` s; a standby goes out ``lead_s`` s
    after the reply before it); the round loop calls :meth:`sending` before it pushes requests to
    nodes, :meth:`sent` after, and :meth:`replied` when a node's reply to a request arrives."""

    def __init__(self, grid: Any, lead_s: float = LEAD_S, period_s: float = PERIOD_S) -> None:
        self.grid, self.lead_s, self.period_s = grid, lead_s, period_s
        self.lock = threading.Lock()
        self.queued: dict[str, int] = {}  # standby message id -> its node
        self.idle_pushes: dict[str, tuple[float, int]] = {}  # one pushed to an idle node -> (when, outstanding)
        self.slept = 0  # standby replies that showed a node had slept (:func:`slept`)
        self.spares = 0  # standbys queued per node beyond the usual one (raised when lead 0 is not enough)
        self.busy: dict[int, int] = {}  # node -> its requests outstanding
        self.due: dict[int, float] = {}  # node -> when its next standby goes out (monotonic s)
        self.followed: set[int] = set()  # the nodes of the latest exchange: the ones kept awake
        self.pushed = 0  # standbys pushed so far
        self.quiet: dict[int, float] = {}  # node -> until when no standby reply of it can arrive (monotonic s)
        self.since: dict[str, float] = {}  # standby id -> the earliest its reply may reach the SuperLink (monotonic s)
        self.stale: set[str] = set()  # standbys queued before their node's latest request (answered before it)
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

    def _push(self, nodes: Iterable[int], idle_at: float | None = None) -> None:
        """Push one standby to each of ``nodes`` (caller holds the lock); ``idle_at``: the nodes are
        idle, and this is when (monotonic s): their replies are measured (:func:`slept`)."""
        nodes = list(nodes)
        if not nodes:
            return
        out = [FlowerMessage(RecordDict(), dst_node_id=n, message_type=STANDBY, group_id="standby") for n in nodes]
        at = time.monotonic() if idle_at is None else idle_at
        for node, msg_id in zip(nodes, self.grid.push_messages(out)):
            if msg_id:
                self.queued[msg_id] = node
                self.since[msg_id] = at
                self.pushed += 1
                if idle_at is not None:
                    self.idle_pushes[msg_id] = (idle_at, sum(1 for n in self.queued.values() if n == node))

    def _measured(self, msg_id: str, node: int, now: float) -> None:
        """Adapt to the reply of standby ``msg_id`` of ``node`` arriving at ``now``: when it shows the
        node slept, shrink the lead, or at lead 0 queue one spare standby more (caller holds the lock)."""
        pushed = self.idle_pushes.pop(msg_id, None)
        if pushed is None or not slept(now - pushed[0], pushed[1]):
            return
        self.slept += 1
        if self.lead_s > 0:
            self.lead_s = max(0.0, self.lead_s - LEAD_STEP_S)
        elif self.spares < MOST_QUEUED - 2:
            self.spares += 1
            self._push([node], now)

    def sending(self, nodes: Iterable[int]) -> None:
        """Requests are about to be pushed to ``nodes`` (a node once per request), the nodes kept
        awake from now: they are busy, so no standby is pushed to them while the requests go out
        (one pushed meanwhile could land behind a request beside the one :meth:`sent` queues there,
        and cost the node a hold before its next request: seen on the round's last node)."""
        nodes = list(nodes)
        with self.lock:
            self.followed = set(nodes)
            self.due = {n: t for n, t in self.due.items() if n in self.followed}
            for node in nodes:
                self.busy[node] = self.busy.get(node, 0) + 1
                self.due.pop(node, None)
            self.stale.update(m for m, n in self.queued.items() if n in self.followed)
            self.idle_pushes = {m: v for m, v in self.idle_pushes.items() if self.queued.get(m) not in self.busy}

    def sent(self, nodes: Iterable[int], refused: Iterable[int] = ()) -> None:
        """The requests announced by :meth:`sending` went out to ``nodes`` (``refused``: the nodes
        whose request the SuperLink refused, idle again): queue a standby behind each node's, so a
        node that replies finds it instead of an empty queue."""
        for node in refused:
            self.replied(node)
        with self.lock:
            self._push(sorted(set(nodes)) * (1 + self.spares))

    def replied(self, node: int, now: float | None = None, late: float = 0.0) -> None:
        """``node``'s reply to a request was seen at ``now`` (monotonic s), having reached the
        SuperLink up to ``late`` s before (the wait before the pull that found it); having answered
        them all the node holds the standby queued behind them, and the next one is due
        :attr:`lead_s` s after the reply's earliest arrival (at once if that is past)."""
        with self.lock:
            left = self.busy.get(node, 0) - 1
            if left > 0:
                self.busy[node] = left
                return
            self.busy.pop(node, None)
            now = time.monotonic() if now is None else now
            self.due[node] = now + max(0.0, self.lead_s - late)
            for msg_id, n in self.queued.items():  # the node took the one behind the request then
                if n == node and msg_id not in self.stale:
                    self.since[msg_id] = now - late

    def tick(self, now: float | None = None) -> None:
        """Pull the standby replies that may have arrived and push the standbys due by ``now``
        (monotonic s). A node that answered a standby took the next one queued as it did, and asks
        again a hold later: the one after is due :attr:`lead_s` s after the reply's earliest arrival
        (the last pull that missed it; seen 0.5 s late on a loaded machine, where a lead counted from
        the pull that found it came after the node's ask); a node that found none sleeps (one goes
        out at once). A standby queued before its node's latest request was answered before it and
        tells nothing of the node now (:attr:`stale`): its reply is collected only, and postpones no
        standby due (seen postponing the one due after a request's reply past the node's ask).

        Pulled only where a reply can be there: not a busy node's (its standbys wait behind its
        request), nor a node's within a hold of the earliest arrival of its last standby reply (the
        SuperNode holds the next one at least :data:`HOLD_S`; less two periods of slack). Each pull
        is a request to the SuperLink and costs the server's process time, which a node trained in
        that process (and the server's own evaluation) then lacks (docs/flower.md)."""
        start = time.monotonic() if now is None else now
        with self.lock:
            pending = [m for m, n in self.queued.items() if n not in self.busy and self.quiet.get(n, 0.0) <= start]
        got = pull_replies(self.grid, pending) if pending else []
        now = time.monotonic() if now is None else now
        with self.lock:
            answered = {reply.metadata.reply_to_message_id for reply in got}
            for msg_id in pending:
                if msg_id not in answered and msg_id in self.queued:
                    self.since[msg_id] = max(start, self.since.get(msg_id, start))  # its reply comes later
            for msg_id in answered:
                node, since = self.queued.pop(msg_id, None), self.since.pop(msg_id, now)
                if node is None or msg_id in self.stale:
                    self.stale.discard(msg_id)
                    self.idle_pushes.pop(msg_id, None)
                    continue
                self.quiet[node] = since + HOLD_S - 2 * self.period_s
                if node in self.followed and node not in self.busy:
                    waiting = sum(1 for n in self.queued.values() if n == node)
                    due = since + self.lead_s if waiting > self.spares else now
                    self.due[node] = min(due, self.due.get(node, due))
                    if not self.done.is_set():
                        self._measured(msg_id, node, now)
                else:
                    self.idle_pushes.pop(msg_id, None)
            if self.done.is_set():
                return
            ready = [n for n, t in self.due.items() if t <= now and n not in self.busy]
            for node in ready:
                del self.due[node]
            self._push(ready, now)

    def _loop(self) -> None:
        while not self.done.wait(self.period_s):
            self.tick()
