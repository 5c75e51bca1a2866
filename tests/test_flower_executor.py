"""A deployment's fixed per-round cost is configured away: each node answers every message in one
long-lived executor (no ``flwr-clientapp`` process per message, no SuperExec), the loopback
deployment's ServerApp runs in fedtune's own process, and standby messages keep idle SuperNodes
from Flower's 3 s idle sleep (fedtune/engines/flower/executor.py, inprocess.py, standby.py).

The real deployment test counts the processes a 3-round run starts: none after round 1 (a
process per message would start some in every round); its control, on stock Flower, is slow."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict
from flwr.app import Message as FlowerMessage

from fedtune.checkpoint import load_state
from fedtune.engines.flower.standby import STANDBY, Standby
from fedtune.run import run_experiment
from tests.test_contract import flatten, tiny
from tests.test_flower import task_identity  # noqa: F401 - fixture
from tests.test_flower_contract import KIND, assert_same_state


class QueueGrid:
    """A Grid whose nodes take their messages in order (:meth:`take`) and answer them
    (:meth:`answer`); a standby's reply is pulled like any other."""

    def __init__(self) -> None:
        self.queues: dict[int, list[FlowerMessage]] = {}
        self.replies: dict[str, FlowerMessage] = {}
        self.count = 0

    def push_messages(self, messages):
        ids = []
        for m in messages:
            self.count += 1
            m.metadata.__dict__["_message_id"] = f"m{self.count}"
            self.queues.setdefault(m.metadata.dst_node_id, []).append(m)
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    def queued(self, node: int) -> list[str]:
        return [m.metadata.message_type for m in self.queues.get(node, [])]

    def take(self, node: int) -> FlowerMessage | None:
        """What a SuperNode asking for a message gets (None: it would sleep 3 s)."""
        queue = self.queues.get(node, [])
        return queue.pop(0) if queue else None

    def answer(self, message: FlowerMessage) -> None:
        self.replies[message.metadata.message_id] = FlowerMessage(RecordDict(), reply_to=message)


def _request(grid: QueueGrid, pump: Standby, node: int) -> None:
    pump.sending([node])
    grid.push_messages([FlowerMessage(RecordDict(), dst_node_id=node, message_type="train", group_id="1")])
    pump.sent([node])


def test_standby_keeps_an_idle_node_fed_one_message_at_a_time(task_identity):  # noqa: F811
    """Driven on a clock: a SuperNode holds a standby 0.5 s (Flower's reply poll) and asks again at
    once; it must never find its queue empty (a 3 s sleep), and a standby must not be queued ahead
    of a request pushed before the node's next ask is near."""
    grid, pump = QueueGrid(), Standby(QueueGrid(), lead_s=0.3)
    pump.grid = grid

    # t=0: a request goes out; a standby is queued right behind it
    _request(grid, pump, 7)
    assert grid.queued(7) == ["train", STANDBY]
    train = grid.take(7)
    pump.tick(now=0.5)  # while the node trains, nothing more is pushed
    assert grid.queued(7) == [STANDBY]
    # t=1: the node answers and takes the standby behind it: the next one is due 0.3 s later
    grid.answer(train)
    pump.replied(7, now=1.0)
    held = grid.take(7)
    assert held is not None and held.metadata.message_type == STANDBY
    pump.tick(now=1.2)
    assert grid.queued(7) == []  # a request pushed now would go first
    pump.tick(now=1.31)
    assert grid.queued(7) == [STANDBY]  # ... and now the next standby waits for the node's next ask
    # the node idles through standbys (ask, hold 0.5 s, answer, ask again): never an empty queue,
    # never more than one standby queued
    clock = 1.5
    for _ in range(4):
        grid.answer(held)
        pump.tick(now=clock + 0.01)
        held = grid.take(7)
        assert held is not None and held.metadata.message_type == STANDBY
        for step in (0.1, 0.2, 0.35, 0.45):
            pump.tick(now=clock + step)
            assert len(grid.queued(7)) <= 1
        assert grid.queued(7) == [STANDBY]
        clock += 0.5
    # a request pushed early in a hold goes out before the standby that was due
    grid.answer(held)
    pump.tick(now=clock + 0.01)
    held = grid.take(7)
    _request(grid, pump, 7)
    pump.tick(now=clock + 0.4)
    assert grid.queued(7) == ["train", STANDBY]
    assert pump.pushed == 7  # S1, S2, one per idle hold, the one behind the request


def test_standby_keeps_only_the_latest_exchanges_nodes_awake(task_identity):  # noqa: F811
    """With partial participation a node left out of the next exchange is let sleep."""
    grid, pump = QueueGrid(), Standby(QueueGrid(), lead_s=0.3)
    pump.grid = grid
    _request(grid, pump, 7)
    grid.answer(grid.take(7))
    pump.replied(7, now=1.0)
    grid.take(7)  # node 7 holds its standby; the next is due at 1.3 ...
    _request(grid, pump, 8)  # ... but the next exchange goes to node 8 only
    pump.tick(now=2.0)
    assert grid.queued(7) == [] and grid.queued(8) == ["train", STANDBY]
    grid.answer(grid.take(8))
    pump.replied(8, now=2.5)
    grid.take(8)
    pump.tick(now=2.9)
    assert grid.queued(7) == [] and grid.queued(8) == [STANDBY]


def test_standby_stops_with_its_thread(task_identity):  # noqa: F811
    grid = QueueGrid()
    pump = Standby(grid, lead_s=0.0, period_s=0.01).start()
    _request(grid, pump, 3)
    grid.answer(grid.take(3))
    pump.replied(3)
    time.sleep(0.3)
    pump.stop()
    assert pump.pushed >= 2
    pushed = pump.pushed
    grid.answer(grid.take(3))
    time.sleep(0.1)
    assert pump.pushed == pushed and pump.thread is None


def _serve_with(
    monkeypatch,
    app_ref: str,
    app,
    message_type: str = "train",
    pushed_at: list | None = None,
    beats: list | None = None,
):
    """:func:`executor.serve_task` on a claimed task of ``message_type`` whose FAB names
    ``app_ref``, fedtune's ClientApp replaced by ``app``, the Runtime API faked: (the reply it
    pushed, the (status, Context) of its task output); ``pushed_at`` receives the reply's push time
    (monotonic s), ``beats`` "start" and "stop" of the task's heartbeat sender."""
    import io
    import zipfile

    from flwr.app import Context
    from flwr.supernode.runtime import run_clientapp

    from fedtune.engines.flower import clientapp, executor, runtime_api

    fab = io.BytesIO()
    with zipfile.ZipFile(fab, "w") as z:
        z.writestr(
            "pyproject.toml",
            '[project]\nname = "x"\nversion = "1.0.0"\n[tool.flwr.app]\npublisher = "x"\n'
            f'[tool.flwr.app.components]\nserverapp = "x:server"\nclientapp = "{app_ref}"\n',
        )
    message = FlowerMessage(RecordDict(), dst_node_id=3, message_type=message_type, group_id="1")
    message.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=1, node_id=3, node_config={}, state=RecordDict(), run_config={})
    pushed, outputs = [], []

    class Closable:
        def close(self):
            pass

        def stop(self):
            if beats is not None:
                beats.append("stop")

    def heartbeat(client):
        if beats is not None:
            beats.append("start")
        return Closable()

    given = (message, context, None, type("Fab", (), {"content": fab.getvalue()}))
    monkeypatch.setattr(runtime_api, "runtime_client", lambda *a, **k: Closable())
    monkeypatch.setattr(runtime_api, "task_heartbeat", heartbeat)
    monkeypatch.setattr(runtime_api, "pull_task_input", lambda client, identify=True: given)

    def push_message(client, reply, ctx):
        pushed.append(reply)
        if pushed_at is not None:
            pushed_at.append(time.monotonic())

    monkeypatch.setattr(run_clientapp, "push_message", push_message)
    monkeypatch.setattr(run_clientapp, "push_task_output", lambda client, ctx, st, details: outputs.append((st, ctx)))
    monkeypatch.setattr(clientapp, "client_app", app)
    executor.serve_task("127.0.0.1:1", "token")
    (reply,) = pushed
    (output,) = outputs
    return reply, output, context


def test_the_executor_answers_each_task_in_place_and_a_failure_as_flower_does(monkeypatch, task_identity):  # noqa: F811
    ours = "fedtune.engines.flower.clientapp:client_app"

    def answer(message, context):
        context.state["seen"] = ConfigRecord({"n": 1})  # the app may change the node's state
        return FlowerMessage(RecordDict(), reply_to=message)

    reply, (status, ctx), context = _serve_with(monkeypatch, ours, answer)
    assert not reply.has_error() and status == "completed" and ctx is context  # the state goes back

    def fail(message, context):
        raise ValueError("bad luck")

    reply, (status, _), _ = _serve_with(monkeypatch, ours, fail)
    assert reply.has_error() and "bad luck" in reply.error.reason and status == "failed"

    # a task's heartbeat runs from its input's pull to its output's push; a standby (done within a
    # second, Flower's heartbeat deadline is a minute) sends none: one request fewer per standby
    beats = []
    _serve_with(monkeypatch, ours, answer, beats=beats)
    assert beats == ["start", "stop"]

    # a standby leaves the node's Context as it was: none pushed back
    beats = []
    reply, (status, ctx), _ = _serve_with(monkeypatch, ours, answer, message_type=STANDBY, beats=beats)
    assert status == "completed" and ctx is None and beats == []

    # fedtune's ClientApp only: a FAB naming another one is refused, the app never called
    called = []
    reply, (status, _), _ = _serve_with(monkeypatch, "other:client", lambda m, c: called.append(m))
    assert reply.has_error() and "runs fedtune.engines.flower.clientapp:client_app only" in reply.error.reason
    assert "other:client" in reply.error.reason and status == "failed" and called == []


@pytest.mark.parametrize("message_type", [STANDBY, "train"])
def test_the_executor_answers_a_standby_after_the_first_reply_check(monkeypatch, task_identity, message_type):  # noqa: F811
    """A SuperNode checks for the reply as soon as it has confirmed a message, then every 0.5 s: an
    executor that answered a standby before that first check made the node hold it 0.1 s and ask
    again before the server's next standby was there (Flower's 3 s sleep, seen on a 2-node
    deployment). A standby's reply waits until REPLY_AFTER_S after the claim; a request's does not."""
    from fedtune.engines.flower import standby

    ours, pushed_at = "fedtune.engines.flower.clientapp:client_app", []
    start = time.monotonic()
    answer = lambda message, context: FlowerMessage(RecordDict(), reply_to=message)  # noqa: E731
    reply, (status, _), _ = _serve_with(monkeypatch, ours, answer, message_type, pushed_at)
    took = pushed_at[0] - start
    if message_type == STANDBY:
        assert took >= standby.REPLY_AFTER_S
    else:
        assert took < standby.REPLY_AFTER_S / 2
    assert status == "completed" and not reply.has_error()


def test_the_executor_claims_its_next_task_a_while_after_a_standby(monkeypatch):
    """A SuperNode that took a standby sees its reply at its next reply check, 0.2-0.3 s after the
    executor answered: no task can come sooner, and each claim is an HTTP request the SuperNode
    serves. After a request, the next claim goes out at once."""
    from fedtune.engines.flower import executor, runtime_api
    from fedtune.engines.flower.standby import CLAIM_AFTER_S

    ended, claimed = {}, {}

    def claims(client, task_type, idle):
        for token in ("standby", "train", "last"):
            claimed[token] = time.monotonic()
            yield token

    def serve(address, token, identify=True, stop=None):
        ended[token] = time.monotonic()
        return token == "standby"

    monkeypatch.setattr(runtime_api, "claim_tasks", claims)
    monkeypatch.setattr(runtime_api, "runtime_client", lambda *a, **k: object())
    monkeypatch.setattr(executor, "serve_task", serve)
    executor.serve_tasks("127.0.0.1:1", b"secret")
    assert claimed["train"] - ended["standby"] >= CLAIM_AFTER_S
    assert claimed["last"] - ended["train"] < CLAIM_AFTER_S / 2


def test_the_executor_serves_the_next_task_after_one_it_could_not_complete(monkeypatch, capsys):
    """A task whose reply or output the SuperNode refuses (it dropped the task meanwhile) must not
    end the node's executor: the next task is still served, the failure said on stderr."""
    from fedtune.engines.flower import executor, runtime_api

    served = []

    def serve(address, token, identify=True, stop=None):
        served.append(token)
        if token == "t1":
            raise RuntimeError("task t1 is gone")

    monkeypatch.setattr(runtime_api, "claim_tasks", lambda client, task_type, idle: iter(["t1", "t2"]))
    monkeypatch.setattr(runtime_api, "runtime_client", lambda *a, **k: object())
    monkeypatch.setattr(executor, "serve_task", serve)
    executor.run_executor("127.0.0.1:1", b"secret")
    assert served == ["t1", "t2"] and runtime_api.task_claimed_at[0] is None
    assert "task not completed (RuntimeError: task t1 is gone)" in capsys.readouterr().err


def _closed_port() -> int:
    """A port of 127.0.0.1 nothing listens on (a SuperNode gone: every connection refused)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ends_after_stop(thread: threading.Thread, stop: threading.Event) -> None:
    """``thread`` (started) is still retrying its refused call after 1.5 s, as Flower retries a
    SuperNode not up yet, and ends within 5 s of ``stop`` being set."""
    thread.join(1.5)
    assert thread.is_alive(), "the call gave up before it was told to stop"
    stop.set()
    thread.join(5)
    assert not thread.is_alive(), "still retrying a SuperNode that is gone after being told to stop"


def test_a_runtime_call_to_a_supernode_gone_stops_retrying_once_told():
    """Flower's retry invoker retries a refused connection without end (waits growing to 20 s); a
    client given ``stop`` must give up once it is set, raising the connection's error."""
    import httpx
    from flwr.proto.runtime_pb2 import PullTaskInputRequest

    from fedtune.engines.flower import runtime_api

    stop, errors = threading.Event(), []
    client = runtime_api.runtime_client(f"127.0.0.1:{_closed_port()}", token="t", stop=stop)

    def call():
        try:
            client.PullTaskInput(PullTaskInputRequest())
        except Exception as exc:  # noqa: BLE001 - the error is the test's
            errors.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    _ends_after_stop(thread, stop)
    assert len(errors) == 1 and isinstance(errors[0], httpx.ConnectError)


@pytest.mark.parametrize("stage", ["claim", "task"])
def test_a_node_served_in_place_ends_when_stopped_after_its_supernode_went_away(monkeypatch, stage):
    """The loopback deployment's first node (:class:`NodeThread`, a thread of the ``fedtune run``
    process) was pulling a standby when the deployment stopped its SuperNode; its pull retried for
    ever, and the pull's worker threads, joined at interpreter exit, kept the finished run's process
    alive (seen: 6 minutes, until killed). Stopping the node must end it, whether it was claiming a
    task or serving one (``stage``: the task's own client, through serve_task)."""
    from fedtune.engines.flower import executor, runtime_api, worker

    if stage == "task":  # a task claimed just before the SuperNode went away
        monkeypatch.setattr(runtime_api, "claim_tasks", lambda client, task_type, idle: iter(["token"]))
    monkeypatch.setattr(worker, "serving_in_place", contextlib.nullcontext)
    node = executor.NodeThread(f"127.0.0.1:{_closed_port()}", b"secret")
    thread = threading.Thread(target=node._serve, daemon=True)  # noqa: SLF001 - the thread's own body
    thread.start()
    _ends_after_stop(thread, node.done)


# -- a real deployment -----------------------------------------------------------------------------
class Descendants:
    """Every process below this one, with when it was first seen (sampled every 50 ms: a
    ``flwr-clientapp`` lives seconds)."""

    def __init__(self) -> None:
        import psutil

        self.me, self.seen, self.done = psutil.Process(), {}, threading.Event()
        self.before = {p.pid for p in self.me.children(recursive=True)}
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import psutil

        while not self.done.wait(0.05):
            try:
                for p in self.me.children(recursive=True):
                    if p.pid not in self.before and p.pid not in self.seen:
                        self.seen[p.pid] = (time.time(), " ".join(p.cmdline()))
            except psutil.Error:
                pass

    def __enter__(self) -> Descendants:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def started_between(self, start: float, end: float) -> list[str]:
        return [cmd for t, cmd in self.seen.values() if start < t <= end]

    def alive(self) -> list[str]:
        """The command lines of the processes below this one now, less those up before the watch
        began (an earlier test's in this worker: multiprocessing's resource tracker)."""
        import psutil

        out = []
        for p in self.me.children(recursive=True):
            if p.pid in self.before:
                continue
            try:
                out.append(" ".join(p.cmdline()))
            except psutil.Error:
                pass
        return out


def _deployment_run(
    tmp_path: Path, executors: bool, in_place: bool = False
) -> tuple[Descendants, list[float], list[list[str]], dict]:
    """A 3-round tiny FedIT run on a 2-node loopback deployment (``in_place``: its first node served
    by a thread of this process), its processes watched: (the watch, each round's end, the processes
    alive then, the summary)."""
    from fedtune.engines.flower.commands import client_groups
    from fedtune.engines.flower.deployment import LoopbackDeployment

    config = tiny(tmp_path / "flower", "fedit", KIND, "seed=5", "rounds=3", "engine=flower")
    groups = client_groups(config.federation.num_clients, 2)
    ends: list[float] = []
    alive: list[list[str]] = []

    def on_round(record) -> None:
        ends.append(time.time())
        alive.append(watch.alive())

    with Descendants() as watch, LoopbackDeployment(groups, threads=1, executors=executors, in_place=in_place) as d:
        summary = d.run(config, on_round=on_round, timeout=600)
    return watch, ends, alive, summary


def test_a_deployment_starts_no_process_per_message_and_gives_the_embedded_run(tmp_path, monkeypatch):
    from fedtune.engines.flower import worker

    shared = []  # (the context a node in place trains on, the server's context then)
    own = worker._in_place_context
    monkeypatch.setattr(
        worker,
        "_in_place_context",
        lambda config, contexts: shared.append((own(config, contexts), worker.SHARED.server)) or shared[-1][0],
    )
    watch, ends, alive, summary = _deployment_run(tmp_path, executors=True, in_place=True)

    # rounds 2 and 3 started no process: every message was answered by a process already up (the
    # summary's platform probe, after the last round, may start one)
    assert len(ends) == 3 and watch.started_between(ends[0], ends[2]) == []
    seen = [cmd for _, cmd in watch.seen.values()]
    assert not [c for c in seen if "flwr-clientapp" in c or "flwr-serverapp" in c or "flower-superexec" in c]
    # what runs the rounds: the SuperLink, per node its SuperNode, and the second node's executor (the
    # first node's is a thread of this process, training on the server's base: one base, not two)
    names = ("flower-superlink", "flower-supernode", "flower.executor")
    kinds = sorted(next((k for k in names if k in c), c) for c in alive[2])
    assert kinds == [names[0], names[1], names[1], names[2]], alive[2]
    assert shared and all(server is not None and context.shares_base is server for context, server in shared)
    assert all(context.task is server.task for context, server in shared)  # and one copy of the data
    assert worker.SHARED.server is None  # released with the run

    # the embedded engine's run, round by round and to the last weight
    embedded = run_experiment(tiny(tmp_path / "embedded", "fedit", KIND, "seed=5", "rounds=3"))
    runs = []
    for s in (summary, embedded):
        state = load_state(Path(s["run_dir"]) / "checkpoint.npz")
        state.pop("_engine")
        lines = [json.loads(x) for x in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        runs.append((flatten(state), lines))
    (f_state, f_lines), (e_state, e_lines) = runs
    assert_same_state(f_state, e_state)
    for key in ("round", "clients", "client_bytes_up", "client_bytes_down", "client_steps", "accuracy"):
        assert [x[key] for x in f_lines] == [x[key] for x in e_lines], key
    np.testing.assert_allclose([x["train_loss"] for x in f_lines], [x["train_loss"] for x in e_lines], rtol=1e-6)


@pytest.mark.slow
def test_the_process_count_catches_stock_flowers_process_per_message(tmp_path):
    """The control of the test above: stock Flower (a SuperExec per SuperNode starting a
    ``flwr-clientapp`` per message) starts processes in every round."""
    watch, ends, _, _ = _deployment_run(tmp_path, executors=False)
    late = watch.started_between(ends[0], ends[2])
    assert sum("flwr-clientapp" in c for c in late) >= 2 * 2  # 2 nodes x rounds 2 and 3
