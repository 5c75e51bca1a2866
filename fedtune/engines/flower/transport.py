"""The server side's transport over a Flower Grid: node discovery, batched exchanges (bundles per
node), replies put back in the order of configure_fit, and the per-exchange timing file."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid

from fedtune.engines.flower.budgets import BUDGET, SETTING
from fedtune.engines.flower.codec import (
    AS_WEIGHTS,
    ATTEMPT,
    BUNDLE,
    CLIENTS,
    CLIPPING_NORM,
    COMPUTE_S,
    PHASE,
    POLL_MAX_S,
    POLL_S,
    RECORD,
    ROUND,
    TIMES,
    FlowerClientError,
    compact_bundle,
    expand_bundle,
    format_clients,
    pack,
    unpack,
)
from fedtune.engines.flower.packing import pack_arrays
from fedtune.engines.flower.runtime_api import pull_replies
from fedtune.engines.flower.standby import Standby
from fedtune.engines.flower.worker import SHARED
from fedtune.engines.rounds import Delivery
from fedtune.protocol.messages import Message


# -- server side ---------------------------------------------------------------------------------
def exchange(
    grid: Grid,
    messages: list[FlowerMessage],
    timeout: float | None,
    poll_s: float = POLL_S,
    pulled_at: dict[str, float] | None = None,
    standby: Standby | None = None,
) -> tuple[list[str], list[FlowerMessage]]:
    """Push ``messages`` through ``grid`` and pull their replies until all arrived or ``timeout``
    seconds passed (Grid's public push, :func:`.runtime_api.pull_replies`), ``poll_s`` seconds
    after the push or a reply, the wait growing 1.5-fold to :data:`.codec.POLL_MAX_S` while none
    arrives (Flower's ``send_and_receive`` waits 3 s between pulls; each pull costs the server's
    process time, which a node trained in that process lacks: docs/flower.md). Returns the pushed
    message ids (in order) and the replies; ``pulled_at`` receives each reply's arrival time (epoch
    s) by the id of the message it answers; ``standby`` (a deployment's) is told which nodes get
    requests, and which answered them and how late at most: since the last pull that missed the
    reply began (on a loaded machine the pulls themselves run late: a reply seen 0.85 s after the
    node sent it) (:class:`.standby.Standby`). A server that shares its base with a node it serves
    in place lends it the base's turn meanwhile (:data:`.worker.SHARED`)."""
    with SHARED.lent():
        return _exchange(grid, messages, timeout, poll_s, pulled_at, standby)


def _exchange(
    grid: Grid,
    messages: list[FlowerMessage],
    timeout: float | None,
    poll_s: float,
    pulled_at: dict[str, float] | None,
    standby: Standby | None,
) -> tuple[list[str], list[FlowerMessage]]:
    nodes = [m.metadata.dst_node_id for m in messages]
    if standby is not None:
        standby.sending(nodes)
    ids = list(grid.push_messages(messages))
    node_of = dict(zip(ids, nodes))
    if standby is not None:
        standby.sent([n for i, n in zip(ids, nodes) if i], refused=[n for i, n in zip(ids, nodes) if not i])
    pending = set(ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[FlowerMessage] = []
    wait = poll_s  # the next sleep
    missed = time.monotonic()  # a reply found now reached the SuperLink after this: the last pull that missed it
    while pending:
        asked = time.monotonic()
        got = pull_replies(grid, pending)
        wait = poll_s if got else min(max(poll_s, POLL_MAX_S), wait * 1.5)
        if pulled_at is not None:
            now = time.time()
            pulled_at.update((reply.metadata.reply_to_message_id, now) for reply in got)
        if standby is not None:
            seen = time.monotonic()
            for reply in got:
                standby.replied(node_of[reply.metadata.reply_to_message_id], now=seen, late=seen - missed)
        missed = asked
        replies.extend(got)
        pending.difference_update(reply.metadata.reply_to_message_id for reply in got)
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(wait)
    return ids, replies


def discover_nodes(
    grid: Grid,
    num_clients: int,
    timeout: float | None = None,
    reports: dict[int, tuple[str, Any]] | None = None,
    standby: Standby | None = None,
) -> dict[int, int]:
    """Client id -> Flower node id, from the client ids each connected node of ``grid`` reports;
    asks new nodes as they connect until every client id 0..N-1 (N: ``num_clients``) has one (or
    ``timeout`` seconds). ``reports`` receives, for each client of a node that states a budget, (the
    node's label, its report as received: :mod:`fedtune.engines.flower.budgets`); ``standby`` (a
    deployment's) keeps the nodes asked awake for the first round (:func:`exchange`)."""
    start = time.monotonic()
    asked: set[int] = set()
    node_of: dict[int, int] = {}
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            asked.update(new)
            hello = [
                FlowerMessage(RecordDict({RECORD: ConfigRecord({})}), dst_node_id=n, message_type="query", group_id="0")
                for n in new
            ]
            left = None if timeout is None else max(1.0, timeout - (time.monotonic() - start))
            for reply in exchange(grid, hello, left, standby=standby)[1]:
                nid = reply.metadata.src_node_id
                if reply.has_error():
                    raise FlowerClientError(None, nid, 0, "query", reply.error.reason)
                played: Mapping[str, Any] = reply.content[RECORD]  # what the node reports: checked below
                for pid in played[CLIENTS]:
                    if not 0 <= pid < num_clients:
                        raise RuntimeError(
                            f"Flower node {nid} plays client {pid}; "
                            f"expected 0..{num_clients - 1} (federation.num_clients)"
                        )
                    if pid in node_of:
                        raise RuntimeError(f"client {pid} is played by two Flower nodes ({node_of[pid]} and {nid})")
                    node_of[pid] = nid
                    if reports is not None and BUDGET in played:  # checked by the plan, not here
                        reports[pid] = (f"Flower node {nid}", played[BUDGET])
        if len(node_of) == num_clients:
            return node_of
        if timeout is not None and time.monotonic() - start > timeout:
            missing = format_clients(set(range(num_clients)) - node_of.keys())
            raise TimeoutError(
                f"{len(asked)} Flower nodes connected after {timeout:.0f} s; none plays clients {missing}"
            )
        time.sleep(0.2)


def _expand(reply: FlowerMessage, target_of: Mapping[str, list[int]]) -> str | None:
    """A bundle ``reply`` (to a request of ``target_of`` that carried several clients) expanded in place
    (:func:`.codec.expand_bundle`): None, or why it does not decode (each of its clients a drop)."""
    carried = target_of.get(reply.metadata.reply_to_message_id)
    if carried is None or len(carried) < 2 or reply.has_error():
        return None
    try:
        reply.content = expand_bundle(reply.content)
    except Exception as exc:  # noqa: BLE001 - a reply that does not even decode is a drop
        return f"undecodable reply ({exc})"
    return None


class GridTransport:
    """Send a round's messages through a Flower Grid in one batch and collect the replies; a
    client that fails (an error reply) or does not answer within ``timeout`` seconds is a failed
    :class:`~fedtune.engines.rounds.Delivery` (dropped by the round loop). ``request_config``
    entries go into every training request's ConfigRecord (``clipping_norm`` for Flower's
    clipping mods, which also sets ``update-as-weights``; see the module docstring). ``bundle``:
    a node's clients of one exchange travel in one Flower message. ``grid``: the ServerApp's;
    ``node_of``: client id -> node id (:func:`discover_nodes`); ``timing_path``: the timing file
    (:data:`~fedtune.engines.flower.codec.TIMING_FILE`; None: none kept)."""

    def __init__(
        self,
        grid: Grid,
        node_of: dict[int, int],
        timeout: float | None = None,
        request_config: Mapping[str, Any] | None = None,
        timing_path: Path | None = None,
        bundle: bool = True,
    ) -> None:
        self.grid, self.node_of, self.timeout, self.timing_path, self.bundle = (
            grid,
            node_of,
            timeout,
            timing_path,
            bundle,
        )
        self.request_config = dict(request_config or {})
        self.standby: Standby | None = None  # a deployment's (FlowerEngine sets it)
        if CLIPPING_NORM in self.request_config:
            self.request_config[AS_WEIGHTS] = True
        self.settings: dict[int, str] = {}  # client id -> its planned setting, sent with each request (budgets.py)

    def setting(self, cid: int) -> dict[str, str]:
        """The transport scalar carrying client ``cid``'s planned setting, if its node states its budget."""
        return {SETTING: self.settings[cid]} if cid in self.settings else {}

    def __call__(self, kind: str, rnd: int, messages: dict[int, Message], attempt: int = 0) -> dict[int, Delivery]:
        if not messages:
            return {}
        extra = self.request_config if kind == "train" else {}
        wire = kind if kind in ("train", "evaluate") else "train"  # Flower's message types
        if wire != kind:
            extra = {PHASE: kind}
        by_node: dict[int, list[int]] = {}
        for cid in messages:
            by_node.setdefault(self.node_of[cid], []).append(cid)
        out, targets, down, records = [], [], {}, {}
        for nid, cids in by_node.items():
            # a node playing several of this exchange's clients gets them in one bundle (one
            # ClientApp process), unless a mod needs one ArrayRecord per message (clipping)
            groups = [cids] if self.bundle and len(cids) > 1 and CLIPPING_NORM not in extra else [[cid] for cid in cids]
            for group in groups:
                content = RecordDict()
                for cid in group:
                    message = messages[cid]
                    if id(message) not in records:  # a Message broadcast to many clients is converted once
                        records[id(message)] = pack_arrays(message.arrays)
                    suffix = f"-{cid}" if len(group) > 1 else ""
                    scalars = {ROUND: rnd, ATTEMPT: attempt, **extra, **self.setting(cid)}
                    _, down[cid] = pack(message, cid, records[id(message)], suffix, content, **scalars)
                if len(group) > 1:
                    content[BUNDLE] = ConfigRecord({CLIENTS: group})
                    content = compact_bundle(content)
                out.append(FlowerMessage(content, dst_node_id=nid, message_type=wire, group_id=str(rnd)))
                targets.append(group)
        pushed = time.time()
        pulled_at: dict[str, float] = {}
        ids, replies = exchange(self.grid, out, self.timeout, pulled_at=pulled_at, standby=self.standby)
        target_of = dict(zip(ids, targets))  # request id -> the client ids it carried
        undecodable = {id(r): e for r in replies if (e := _expand(r, target_of)) is not None}
        decoded = [r for r in replies if id(r) not in undecodable]
        self._log_timing(kind, rnd, attempt, pushed, decoded, target_of, pulled_at)
        received: dict[int, Delivery] = {}
        for reply in replies:
            carried = target_of.get(reply.metadata.reply_to_message_id)
            if carried is None:
                continue  # not a reply to this batch: ignore
            if id(reply) in undecodable:
                received.update((cid, Delivery(None, down[cid], error=undecodable[id(reply)])) for cid in carried)
                continue
            for cid in carried:
                received[cid] = self._delivery(
                    reply, cid, "" if len(carried) == 1 else f"-{cid}", messages[cid], down[cid], extra
                )
        # in configure order: aggregation sums in dict order, as the embedded engine does
        return {
            cid: received.get(cid) or Delivery(None, down[cid], error=f"no reply within {self.timeout} s")
            for cid in messages
        }

    @staticmethod
    def _delivery(
        reply: FlowerMessage, cid: int, suffix: str, sent: Message, down: int, extra: Mapping[str, Any]
    ) -> Delivery:
        """Client ``cid``'s answer in ``reply`` (its records suffixed with ``suffix`` in a bundle)."""
        if reply.has_error():
            return Delivery(None, down, error=f"client error: {reply.error.reason}")
        bundle: Mapping[str, Any] = reply.content[BUNDLE] if suffix and BUNDLE in reply.content else {}
        if f"error{suffix}" in bundle:
            return Delivery(None, down, error=f"client error: {bundle[f'error{suffix}']}")
        try:
            sender, message, up = unpack(reply.content, suffix)
            if extra.get(AS_WEIGHTS):  # received + clipped update -> the (clipped) update
                message = Message({k: v - sent.arrays[k] for k, v in message.arrays.items()}, message.meta)
            record: Mapping[str, Any] = reply.content[RECORD + suffix]
            seconds = _finite(record.get(COMPUTE_S, 0.0))
            if seconds < 0:  # (a NaN, refused above, would slip past every ``seconds > deadline``)
                raise ValueError(f"{COMPUTE_S} = {seconds} is negative")
            return Delivery(message, down, up, seconds, sender, int(record.get(ROUND, -1)))
        except Exception as exc:  # noqa: BLE001 - a reply that does not even decode is a drop
            return Delivery(None, down, error=f"undecodable reply ({exc})")

    def _log_timing(
        self,
        kind: str,
        rnd: int,
        attempt: int,
        pushed: float,
        replies: list[FlowerMessage],
        target_of: dict[str, list[int]],
        pulled_at: dict[str, float],
    ) -> None:
        """One :data:`TIMING_FILE` line: per Flower message (its client ids joined by "+"), the
        seconds from the push to the ClientApp process's start (node pick-up, SuperExec poll,
        spawn), from there to the handler (``flwr-clientapp`` start-up), in the handler
        (``compute_s``: of it in the Client calls), and from the handler's end to the server's
        pull (push back, polls). Same-machine clocks: meaningful on a loopback deployment."""
        if self.timing_path is None:
            return
        messages = {}
        for reply in replies:
            group = target_of.get(reply.metadata.reply_to_message_id)
            if group is None or reply.has_error():
                continue
            head: Mapping[str, Any] | None = reply.content.config_records.get(BUNDLE if len(group) > 1 else RECORD)
            if head is None or not all(key in head for key in TIMES):
                continue
            records: list[Mapping[str, Any] | None] = [
                reply.content.config_records.get(RECORD + (f"-{c}" if len(group) > 1 else "")) for c in group
            ]
            try:  # a peer's: a time that is not a finite number leaves its message out of the file, not a crash
                t_process, t_enter, t_exit = (_finite(head[key]) for key in TIMES)
                compute = sum(_finite(r.get(COMPUTE_S, 0.0)) for r in records if r is not None)
            except (TypeError, ValueError):
                continue
            messages["+".join(map(str, group))] = {
                "dispatch_s": round(t_process - pushed, 4),
                "startup_s": round(t_enter - t_process, 4),
                "handler_s": round(t_exit - t_enter, 4),
                "compute_s": round(compute, 4),
                "return_s": round(pulled_at.get(reply.metadata.reply_to_message_id, t_exit) - t_exit, 4),
            }
        line = {
            "kind": kind,
            "round": rnd,
            "attempt": attempt,
            "wall_s": round(time.time() - pushed, 4),
            "clients": messages,
        }
        with open(self.timing_path, "a") as sink:
            sink.write(json.dumps(line) + "\n")


def _finite(value: Any) -> float:
    """``value`` (a peer's timing field) as a finite float; ValueError or TypeError otherwise."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not finite")
    return number
