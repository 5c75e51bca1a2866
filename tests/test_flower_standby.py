"""Standby messages on a loaded machine (fedtune/engines/flower/standby.py): a server that pulls a
standby's reply and pushes the next one later than the lead's margin allows leaves an idle node an
empty queue (Flower's 3 s sleep). The standby pump measures that and adapts; no request's reply is
lost or duplicated on the way. Driven on a simulated clock: a SuperNode holds each message 0.5 s,
a request 1 s, and its replies reach the server ``delay`` s late."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, RecordDict
from flwr.app import Message as FlowerMessage

from fedtune.engines.flower import standby
from fedtune.engines.flower.standby import STANDBY, Standby
from tests.test_flower import task_identity  # noqa: F401 - fixture
from tests.test_flower_executor import QueueGrid, _request

NODE = 7


def _run_idle_node(pump: Standby, grid: QueueGrid, seconds: float, delay: float, requests_at=()) -> dict:
    """One SuperNode on a 10 ms clock: it takes a message, holds it (a standby 0.5 s, a request 1 s),
    answers and asks again at once; an empty queue sends it to sleep 3 s. The server ticks the pump
    every 50 ms, sees each reply ``delay`` s after it was sent, and pushes a request at each of
    ``requests_at``. Returns the times the node found its queue empty, and per request id the
    replies the request side pulled and the standby replies left unpulled."""
    held, until, asleep, visible = None, 0.0, 0.0, []
    empties, requests, pulled = [], {}, {}
    todo = sorted(requests_at)
    for step in range(int(seconds * 100)):
        now = step / 100
        if todo and now >= todo[0]:
            todo.pop(0)
            message = FlowerMessage(RecordDict(), dst_node_id=NODE, message_type="train", group_id="1")
            pump.sending([NODE])
            (msg_id,) = grid.push_messages([message])
            pump.sent([NODE])
            requests[msg_id], pulled[msg_id] = now, []
        for item in [v for v in visible if v[0] <= now]:  # a reply reaches the SuperLink
            visible.remove(item)
            grid.answer(item[1])
        for msg_id in pulled:  # the request side pulls its own replies only
            got = grid.pull_messages([msg_id])
            pulled[msg_id] += got
            if got:
                pump.replied(NODE, now=now)
        if held is not None and now >= until:
            visible.append((now + delay, held))
            held = None
        elif held is None and now >= asleep:
            held = grid.take(NODE)
            if held is None:
                empties.append(now)
                asleep = now + 3.0
            else:
                until = now + (0.5 if held.metadata.message_type == STANDBY else 1.0)
        if step % 5 == 0:
            pump.tick(now=now)
    pump.tick(now=seconds)  # the replies that reached the SuperLink in the last 50 ms
    return {"empties": empties, "pulled": pulled, "left": [m for m in grid.replies if m not in pulled]}


@pytest.mark.parametrize(("delay", "adapts"), [(0.35, True), (0.8, True), (0.35, False)])
def test_standby_adapts_to_a_slow_server_and_loses_no_reply(task_identity, monkeypatch, delay, adapts):  # noqa: F811
    """0.35 s late: more than the lead's 0.2 s margin (the lead shrinks); 0.8 s: more than a hold
    (a spare standby is queued too)."""
    if not adapts:  # control: a pump that trusts its margin keeps sending the node to sleep
        monkeypatch.setattr(standby, "slept", lambda waited, outstanding: False)
    grid = QueueGrid()
    pump = Standby(grid, lead_s=0.3)
    seen = _run_idle_node(pump, grid, seconds=40, delay=delay, requests_at=(0.0, 15.0, 25.0, 33.0))
    late = [t for t in seen["empties"] if t > 12]
    if adapts:
        assert seen["empties"] and late == []  # it slept at first, then never again
        assert pump.slept >= 1 and pump.lead_s < 0.3 and (delay < 0.5 or pump.spares == 1)
    else:
        assert len(late) >= 3
    # every request answered once, its reply pulled once by the request side; the pump took none
    assert all(len(replies) == 1 for replies in seen["pulled"].values()) and len(seen["pulled"]) == 4
    for msg_id, replies in seen["pulled"].items():
        assert replies[0].metadata.reply_to_message_id == msg_id
    assert not set(pump.queued) & set(seen["pulled"])
    # every standby reply that reached the SuperLink was pulled by the pump: none left behind
    assert seen["left"] == []


def test_standby_on_a_prompt_server_keeps_its_lead(task_identity):  # noqa: F811
    """A server that pulls at once never sees a node sleep: the lead and the queue stay as they were."""
    grid = QueueGrid()
    pump = Standby(grid, lead_s=0.3)
    seen = _run_idle_node(pump, grid, seconds=20, delay=0.0, requests_at=(0.0, 10.0))
    assert seen["empties"] == [] and pump.slept == 0 and pump.lead_s == 0.3


class CountingGrid(QueueGrid):
    """A QueueGrid that records each pull's message ids."""

    def __init__(self) -> None:
        super().__init__()
        self.pulls: list[list[str]] = []

    def pull_messages(self, ids):
        self.pulls.append(list(ids))
        return super().pull_messages(ids)


def test_standby_pulls_only_where_a_reply_can_be(task_identity):  # noqa: F811
    """Every pull is a request to the SuperLink that costs the server's process time (a node trained
    in that process slowed by up to ~40 % at 20 pulls a second): a busy node's standbys wait behind
    its request, and a node that just answered one holds the next at least HOLD_S, so neither is
    pulled; the node that answered its request is pulled at once."""
    grid = CountingGrid()
    pump = Standby(grid, lead_s=0.3)
    pump.sending([NODE])
    grid.push_messages([FlowerMessage(RecordDict(), dst_node_id=NODE, message_type="train", group_id="1")])
    pump.sent([NODE])
    for step in range(20):  # the node trains 1 s: nothing to pull
        pump.tick(now=step * 0.05)
    assert grid.pulls == []
    grid.take(NODE)  # the request, answered
    pump.replied(NODE, now=1.0)
    first = grid.take(NODE)  # the standby behind it, held, answered
    pump.tick(now=1.0)
    assert len(grid.pulls) == 1  # the node is idle: its standby's reply may be there
    grid.answer(first)
    pump.tick(now=1.05)  # pulled; the node took the next standby after the pull at 1.0 missed this reply,
    pulls = len(grid.pulls)  # and holds it at least HOLD_S
    quiet_until = 1.0 + standby.HOLD_S - 2 * pump.period_s
    for t in (1.1, 1.2, 1.3, quiet_until - 0.01):
        pump.tick(now=t)
    assert len(grid.pulls) == pulls, "pulled within the hold of the node's next standby"
    pump.tick(now=quiet_until)
    assert len(grid.pulls) == pulls + 1


def test_exchange_pulls_back_off_while_no_reply_arrives_and_not_beyond_the_cap(monkeypatch, task_identity):  # noqa: F811
    """The server pulls replies 0.05 s after its push, the wait growing 1.5-fold to POLL_MAX_S while
    none arrives (a fixed 0.05 s took a node trained in the server's process up to ~40 % longer)."""
    from fedtune.engines.flower import codec, transport

    grid = QueueGrid()
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 12:  # the node answers after 12 empty pulls
            grid.answer(grid.take(NODE))

    monkeypatch.setattr(transport.time, "sleep", sleep)
    message = FlowerMessage(RecordDict(), dst_node_id=NODE, message_type="train", group_id="1")
    ids, replies = transport.exchange(grid, [message], timeout=None)
    assert len(replies) == 1 and replies[0].metadata.reply_to_message_id == ids[0]
    assert waits[0] == pytest.approx(codec.POLL_S * 1.5) and max(waits) == codec.POLL_MAX_S
    assert all(b >= a for a, b in zip(waits, waits[1:]))


def test_a_request_reply_seen_late_brings_the_next_standby_forward(task_identity):  # noqa: F811
    """The node takes the standby behind its request as soon as it pushed the reply and asks again
    a hold later; the next standby must be there by then. The server's pulls back off to 0.25 s
    while it waits, so a reply may be seen up to that late: the next standby is due ``lead_s``
    after the reply's earliest arrival, not after the pull that found it (seen sending an idle
    node of a 2-node deployment to Flower's 3 s sleep)."""
    grid = QueueGrid()
    pump = Standby(grid, lead_s=0.3)
    pump.sending([NODE])
    pump.sent([NODE])
    pump.replied(NODE, now=10.0, late=0.25)
    assert pump.due[NODE] == pytest.approx(10.05)
    pump.sending([NODE])
    pump.sent([NODE])
    pump.replied(NODE, now=20.0, late=0.4)  # later than the lead: at once
    assert pump.due[NODE] == pytest.approx(20.0)


def test_exchange_tells_the_standby_how_late_a_reply_may_be(monkeypatch, task_identity):  # noqa: F811
    """The ``late`` the exchange passes runs from the start of the last pull that missed the reply:
    the sleep before the pull that found it and that pull's own time too (each pull here takes
    0.3 s; on a loaded machine a reply was seen 0.85 s after the node sent it, far more than the
    sleep before the pull)."""
    from fedtune.engines.flower import transport

    clock, told, waits = [100.0], [], []

    class SlowGrid(QueueGrid):
        def pull_messages(self, ids):
            clock[0] += 0.3
            return super().pull_messages(ids)

    class Recorder:
        def sending(self, nodes):
            list(nodes)

        def sent(self, nodes, refused=()):
            list(nodes)

        def replied(self, node, now=None, late=0.0):
            told.append((now, late))

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock[0] += seconds
        if len(waits) == 6:
            grid.answer(grid.take(NODE))

    grid = SlowGrid()
    monkeypatch.setattr(transport.time, "sleep", sleep)
    monkeypatch.setattr(transport.time, "monotonic", lambda: clock[0])
    message = FlowerMessage(RecordDict(), dst_node_id=NODE, message_type="train", group_id="1")
    transport.exchange(grid, [message], timeout=None, standby=Recorder())
    assert told == [(pytest.approx(clock[0]), pytest.approx(0.3 + waits[-1] + 0.3))]


def _held_after_a_request(grid: QueueGrid, pump: Standby):
    """A request pushed, answered and its reply seen at 1.0; the node then holds the standby queued
    behind it, and the next one goes out at 1.3 (due ``lead_s`` after the reply). The held one."""
    _request(grid, pump, NODE)
    grid.answer(grid.take(NODE))
    pump.replied(NODE, now=1.0)
    held = grid.take(NODE)
    pump.tick(now=1.3)
    assert grid.queued(NODE) == [STANDBY]
    return held


def test_a_stale_standby_reply_does_not_postpone_the_standby_a_request_reply_made_due(task_identity):  # noqa: F811
    """A busy node's standby replies are pulled only after its request's reply: the one it answered
    before taking the request says nothing of its queue now. Seen on a 2-node deployment: those
    replies, pulled 0.11 s after the request's, reset the next standby to ``lead_s`` after them,
    past the node's next ask, and the node slept 3 s."""
    grid = QueueGrid()
    pump = Standby(grid, lead_s=0.3)
    held = _held_after_a_request(grid, pump)
    _request(grid, pump, NODE)  # the next request, behind the queued standby; a standby behind it
    grid.answer(held)
    grid.answer(grid.take(NODE))  # the standby queued before the request: answered, not pulled (busy)
    grid.answer(grid.take(NODE))  # the request
    pump.replied(NODE, now=5.0, late=0.25)  # due at 5.05
    assert grid.queued(NODE) == [STANDBY]  # behind the request: the node holds it from now
    grid.take(NODE)
    pump.tick(now=5.02)  # the two stale standby replies pulled now
    assert pump.due[NODE] == pytest.approx(5.05)
    pump.tick(now=5.05)
    assert grid.queued(NODE) == [STANDBY], "the next standby was postponed by a stale reply"


def test_the_nodes_asked_at_discovery_are_kept_awake_for_the_first_round(task_identity):  # noqa: F811
    """The first round's request would otherwise find each node asleep (Flower's 3 s idle sleep
    after the discovery query)."""
    from fedtune.engines.flower import codec, transport

    class Answering(QueueGrid):
        def get_node_ids(self):
            return [NODE]

        def pull_messages(self, ids):
            for m in list(self.queues.get(NODE, [])):
                if m.metadata.message_type == "query":
                    self.queues[NODE].remove(m)
                    self.replies[m.metadata.message_id] = FlowerMessage(
                        RecordDict({codec.RECORD: ConfigRecord({codec.CLIENTS: [0]})}), reply_to=m
                    )
            return super().pull_messages(ids)

    grid = Answering()
    pump = Standby(grid, lead_s=0.3)
    assert transport.discover_nodes(grid, 1, timeout=5, standby=pump) == {0: NODE}
    assert grid.queued(NODE) == [STANDBY] and NODE in pump.followed


def test_no_standby_goes_out_to_a_node_while_its_request_is_being_pushed(task_identity):  # noqa: F811
    """The next request is pushed right after the round's last reply, while that node's next standby
    falls due: pushed meanwhile, it landed behind the request beside the one queued there on
    purpose, and the node took both before its next request (a 2-node deployment's last node waited
    1.2-1.4 s every round). A node whose request the SuperLink refused is idle again."""
    grid = QueueGrid()
    pump = Standby(grid, lead_s=0.3)
    _request(grid, pump, NODE)
    grid.answer(grid.take(NODE))
    pump.replied(NODE, now=1.0)  # the round's last reply; the next standby due at 1.3
    grid.take(NODE)  # the standby behind the request, held
    pump.sending([NODE])  # the next round's request goes out from 1.25 ...
    pump.tick(now=1.35)  # ... while the standby thread runs
    grid.push_messages([FlowerMessage(RecordDict(), dst_node_id=NODE, message_type="train", group_id="2")])
    pump.sent([NODE])
    assert grid.queued(NODE) == ["train", STANDBY]
    pump.sending([NODE, 8])
    pump.sent([NODE], refused=[8])
    assert set(pump.busy) == {NODE} and 8 in pump.due


@pytest.mark.parametrize("seen_at", [1.6, 2.0])
def test_the_next_standby_is_due_a_lead_after_the_earliest_arrival_of_the_reply_before(task_identity, seen_at):  # noqa: F811
    """The node answers its standby at 1.55 and takes the next one queued; it asks again a hold
    later (2.05). The reply's earliest arrival is the last pull that missed it (1.5): the next
    standby is due a lead after that (1.8), whether the server sees the reply at once (1.6: not
    pushed sooner, where a request would wait behind it) or 0.45 s late (2.0: pushed at once, where
    a lead counted from the late pull came after the node's ask, seen on a loaded machine)."""
    grid = QueueGrid()
    pump = Standby(grid, lead_s=0.3)
    held = _held_after_a_request(grid, pump)
    for t in (1.4, 1.45, 1.5):
        pump.tick(now=t)  # the held one's reply not there yet
    grid.answer(held)  # at 1.55; the node takes the queued one
    grid.take(NODE)
    pump.tick(now=seen_at)
    if seen_at < 1.8:
        assert grid.queued(NODE) == [] and pump.due[NODE] == pytest.approx(1.8)
        pump.tick(now=1.8)
    assert grid.queued(NODE) == [STANDBY]


def test_a_run_that_ends_before_its_rounds_stops_its_standby_messages(tmp_path, task_identity):  # noqa: F811
    """The pump starts before the nodes' discovery; a run that ends there (no node came within the
    timeout) or before its first round must not leave it pushing standbys to a deployment that is
    shutting down."""
    import threading

    from flwr.superlink.grid import HttpGrid

    from fedtune.config import load_config
    from fedtune.engines.flower.serverapp import serve
    from tests.test_flower import TINY

    class NoNodes(HttpGrid):  # a deployment's Grid (standby messages on) that no node joins
        def __init__(self) -> None:
            pass

        def get_node_ids(self):
            return []

    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}", "name=no-nodes"])
    with pytest.raises(TimeoutError, match="none plays clients"):
        serve(NoNodes(), cfg, timeout=1)
    assert [t for t in threading.enumerate() if t.name == "fedtune-standby"] == []
