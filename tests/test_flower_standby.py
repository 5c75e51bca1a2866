"""Standby messages on a loaded machine (fedtune/engines/flower/standby.py): a server that pulls a
standby's reply and pushes the next one later than the lead's margin allows leaves an idle node an
empty queue (Flower's 3 s sleep). The standby pump measures that and adapts; no request's reply is
lost or duplicated on the way. Driven on a simulated clock: a SuperNode holds each message 0.5 s,
a request 1 s, and its replies reach the server ``delay`` s late."""

from __future__ import annotations

import pytest
from flwr.app import Message as FlowerMessage
from flwr.app import RecordDict

from fedtune.engines.flower import standby
from fedtune.engines.flower.standby import STANDBY, Standby
from tests.test_flower import task_identity  # noqa: F401 - fixture
from tests.test_flower_executor import QueueGrid

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
