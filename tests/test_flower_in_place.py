"""A loopback deployment's first node served by a thread of the server's process, on the server's
base (fedtune/engines/flower/executor.py NodeThread, worker.py SharedBase): the node and the server
take turns on the one base, so a straggler still training after the server stopped waiting for it
never overlaps the server's own use of it (evaluation, saving). The real deployment that runs this
path end to end is tests/test_flower_executor.py's."""

from __future__ import annotations

import threading
import time

import pytest
from flwr.app import Message as FlowerMessage
from flwr.app import RecordDict

from fedtune.engines.flower import worker
from fedtune.engines.flower.transport import exchange
from fedtune.protocol.messages import Message
from tests.test_flower import task_identity  # noqa: F401 - fixture


class _Context:
    """A stand-in RunContext: its clients carry the state they were given."""

    def client(self, cid, state):
        return type("Client", (), {"state": state, "profile": None})()


def _serve_in_place(monkeypatch, answered: threading.Event) -> threading.Thread:
    """A thread serving one request as a node in place, its Client call recorded in ``answered``."""
    monkeypatch.setattr(worker, "_process_context", lambda config, threads=None: _Context())
    monkeypatch.setattr(worker, "answer", lambda client, kind, request, seed, rnd, attempt: answered.set() or request)
    monkeypatch.setattr(worker, "sends_compute_s", lambda config: True)
    config = type("Config", (), {"seed": 0})()

    def serve() -> None:
        with worker.serving_in_place():
            worker.serve_request(config, "train", 0, Message({}, {}), {}, 1, 0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_node_in_place_trains_only_in_its_turn_on_the_servers_base(monkeypatch):
    answered = threading.Event()
    with worker.SHARED.turn():  # the server evaluates, aggregates or saves
        thread = _serve_in_place(monkeypatch, answered)
        assert not answered.wait(0.5)  # the node's request waits: the base is the server's
        with worker.SHARED.lent():  # the server waits for replies
            assert answered.wait(5)
            thread.join(5)
        assert not thread.is_alive()
    # control: a thread not serving in place (a node's executor process) does not wait
    answered.clear()
    with worker.SHARED.turn():
        monkeypatch.setattr(worker, "serving_in_place", lambda: __import__("contextlib").nullcontext())
        thread = _serve_in_place(monkeypatch, answered)
        assert answered.wait(5)
    thread.join(5)


def test_a_node_frees_the_last_clients_pages_before_each_client_as_embedded(monkeypatch):
    """The embedded engine hands the heap's freed pages back before each client trains
    (``release_free_memory``, tests/test_scale.py); a node serving its clients one after another
    (a bundle) asks the same before each of them, before its Client call."""
    order = []
    monkeypatch.setattr(worker, "_process_context", lambda config, threads=None: _Context())
    monkeypatch.setattr(worker, "release_free_memory", lambda: order.append("release"))
    monkeypatch.setattr(
        worker, "answer", lambda client, kind, request, seed, rnd, attempt: order.append("fit") or request
    )
    monkeypatch.setattr(worker, "sends_compute_s", lambda config: True)
    config = type("Config", (), {"seed": 0})()
    for cid in (0, 1, 2):
        worker.serve_request(config, "train", cid, Message({}, {}), {}, 1, 0)
    assert order == ["release", "fit"] * 3


class _Grid:
    """A Grid whose one node answers each request from a thread of its own that must take the base's
    turn first (a node served in place): the reply exists only once the node had its turn."""

    def __init__(self) -> None:
        self.replies: dict[str, FlowerMessage] = {}

    def push_messages(self, messages):
        for i, m in enumerate(messages):
            m.metadata.__dict__["_message_id"] = f"m{i}"

            def node(message=m) -> None:
                with worker.SHARED.turn():
                    self.replies[message.metadata.message_id] = FlowerMessage(RecordDict(), reply_to=message)

            threading.Thread(target=node, daemon=True).start()
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


@pytest.mark.parametrize("lends", [True, False])
def test_the_server_lends_the_base_while_it_waits_for_replies(task_identity, monkeypatch, lends):  # noqa: F811
    if not lends:  # control: an exchange that keeps the turn never hears from a node in place
        monkeypatch.setattr(worker.SHARED, "lent", lambda: __import__("contextlib").nullcontext())
    request = FlowerMessage(RecordDict(), dst_node_id=1, message_type="train", group_id="1")
    with worker.SHARED.turn():
        start = time.monotonic()
        ids, replies = exchange(_Grid(), [request], timeout=1.5, poll_s=0.01)
        holds = worker.SHARED._holder == threading.get_ident()  # the turn is the server's again
    assert holds and len(ids) == 1
    if lends:
        assert len(replies) == 1 and time.monotonic() - start < 1.5
    else:
        assert replies == []
