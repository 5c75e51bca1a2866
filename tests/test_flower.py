"""The same fedtune Strategy/Client objects run through Flower (ServerApp + ClientApp, Message
API) give what the embedded engine gives: the same global adapter and the same bytes.

Fast tests drive the apps through an in-process loopback Grid; one test runs the real Flower
simulation runtime (Ray backend, one virtual SuperNode per client).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Error, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid

from fedtune.config import load_config
from fedtune.engines import flower
from fedtune.engines.flower import (
    config_from_run_config,
    make_client_app,
    pack,
    serve,
    state_from_record,
    state_to_record,
    unpack,
)
from fedtune.checkpoint import load_state
from fedtune.engines.rounds import RoundFailed
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment

TINY = [
    "method=fedit",
    "model.name=tiny-bert",
    "data=tweets",
    "data.max_train_samples=200",
    "data.max_test_samples=100",
    "federation.num_clients=2",
    "rounds=2",
    "train.local_steps=2",
    "seed=3",
]


class LoopbackGrid(Grid):
    """A Grid that hands each message to a ClientApp in this process, one Context per node
    (node ids deliberately unrelated to partition ids, replies in reverse order; the nodes in
    ``drop`` never answer a train message)."""

    def __init__(self, client_app, num_nodes: int, drop: set[int] = frozenset()) -> None:
        self.app, self.drop = client_app, drop
        self.contexts = {
            7000 + 13 * (num_nodes - i): Context(
                run_id=1, node_id=7000 + 13 * (num_nodes - i),
                node_config={"partition-id": i, "num-partitions": num_nodes}, state=RecordDict(), run_config={},
            )
            for i in range(num_nodes)
        }
        self.sent: list[FlowerMessage] = []

    def set_run(self, run):  # pragma: no cover - unused
        raise AssertionError("serve() must not call this Grid member")

    @property
    def run(self):  # pragma: no cover - unused
        raise AssertionError("serve() must not call this Grid member")

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        raise AssertionError("serve() must not call this Grid member")

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):  # pragma: no cover - unused
        raise AssertionError("serve() must not call this Grid member")

    def pull_messages(self, message_ids):  # pragma: no cover - unused
        raise AssertionError("serve() must not call this Grid member")

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            self.sent.append(message)
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            context = self.contexts[message.metadata.dst_node_id]
            if context.node_config["partition-id"] in self.drop and message.metadata.message_type == "train":
                continue
            try:
                replies.append(self.app(message, context))
            except Exception as exc:  # what the Flower runtime does with a failing ClientApp
                replies.append(FlowerMessage(Error(code=0, reason=repr(exc)), reply_to=message))
        return replies[::-1]


@pytest.fixture
def task_identity(monkeypatch):
    """What a Flower runtime sets before a ServerApp creates messages (restored afterwards)."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


def _config(tmp_path, *extra):
    return load_config(None, [*TINY, f"output_dir={tmp_path}", *extra])


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The reference: TINY through the embedded engine (final strategy state, round records)."""
    history = []
    summary = run_experiment(_config(tmp_path_factory.mktemp("embedded")), on_round=history.append)
    return load_state(f"{summary['run_dir']}/checkpoint.npz"), history


def _assert_same_run(flower_state, flower_history, embedded):
    embedded_state, embedded_history = embedded
    assert flower_state["global"].keys() == embedded_state["global"].keys()
    for key, value in embedded_state["global"].items():
        np.testing.assert_allclose(flower_state["global"][key], value, rtol=0, atol=1e-6, err_msg=key)
    assert [r.clients for r in flower_history] == [r.clients for r in embedded_history]
    assert [r.client_bytes_down for r in flower_history] == [r.client_bytes_down for r in embedded_history]
    assert [r.client_bytes_up for r in flower_history] == [r.client_bytes_up for r in embedded_history]
    assert all(min(r.client_bytes_up.values()) > 1000 for r in flower_history)
    for record in flower_history:  # timed on the node around the Client call
        assert record.client_compute_s.keys() == set(record.clients) and min(record.client_compute_s.values()) > 0


# -- conversion --------------------------------------------------------------------------------
def test_pack_unpack_round_trip_through_flower_serialization():
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    # Prepare
    arrays = {
        "lora_B": np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32),
        "half": np.arange(6, dtype=np.float16).reshape(3, 2),
        "idx": np.array([5, 1, 7], dtype=np.int64),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 8), dtype=np.float32),
    }
    message = Message(arrays, {"round": 3, "rank": 8, "nested": {"k": [1, 2]}, "loss": 0.1 + 0.2})

    # Execute: fedtune -> Flower content -> protobuf bytes -> Flower content -> fedtune
    content, nbytes = pack(message, cid=17)
    wire = recorddict_to_proto(content).SerializeToString()
    proto = ProtoRecordDict()
    proto.ParseFromString(wire)
    cid, back, nbytes_back = unpack(recorddict_from_proto(proto))

    # Assert
    assert cid == 17 and nbytes == nbytes_back == len(message.encode()) == message.nbytes
    assert list(back.arrays) == list(arrays) and back.meta == message.meta
    for key, value in message.arrays.items():
        assert back.arrays[key].dtype == value.dtype and back.arrays[key].shape == value.shape
        np.testing.assert_array_equal(back.arrays[key], value)
    assert back.encode() == message.encode()


def test_client_state_round_trips_through_array_record():
    state = {"momentum": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4), "step": np.array(4)}
    back = state_from_record(state_to_record(state))
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert back[key].dtype == value.dtype
        np.testing.assert_array_equal(back[key], value)
    assert state_from_record(None) == {}


def test_config_from_flower_run_config(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('method = "fedit"\nrounds = 7\n[data]\nname = "sst2"\n')
    config = config_from_run_config(
        {
            "recipe": str(recipe),
            "overrides": "seed=4; data.partition=iid;",
            "fedtune.rounds": 3,
            "fedtune.data.alpha": 0.1,
            "fedtune.train.group_by_length": False,
        }
    )
    assert (config.rounds, config.seed, config.data.name, config.data.partition) == (3, 4, "sst2", "iid")
    assert (config.data.alpha, config.train.group_by_length) == (0.1, False)
    assert config_from_run_config({"recipe": "", "overrides": ""}) == load_config()
    with pytest.raises(ValueError, match="'rounds'"):
        config_from_run_config({"rounds": 3})


# -- the apps through an in-process Grid -----------------------------------------------------------
def test_loopback_flower_apps_match_embedded_engine(task_identity, tmp_path, embedded):
    # Prepare
    config = _config(tmp_path / "flower")
    grid = LoopbackGrid(make_client_app(config), config.federation.num_clients)
    flower_history = []

    # Execute
    summary = serve(grid, config, timeout=60, on_round=flower_history.append)

    # Assert
    _assert_same_run(load_state(f"{summary['run_dir']}/checkpoint.npz"), flower_history, embedded)
    assert summary["engine"] == "flower" and summary["total_bytes_up"] == sum(
        sum(r.client_bytes_up.values()) for r in flower_history
    )
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds == ["query"] * 2 + ["train"] * 2 * config.rounds
    lines = (tmp_path / "flower" / config.run_name / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2]


def test_federated_evaluation_and_client_state_match_embedded_engine(task_identity, tmp_path, monkeypatch):
    from fedtune.engines.embedded import run_rounds
    from fedtune.methods.fedit import FedITClient, FedITStrategy
    from fedtune.runtime import RunContext

    # Prepare: FedIT plus a federated evaluation whose clients count their calls in Client.state
    def configure_evaluate(self, rnd, client_ids):
        return {cid: Message({"probe": np.full(3, rnd, np.float32)}, {"round": rnd}) for cid in client_ids}

    def evaluate(self, message):
        calls = int(self.state.get("calls", np.array(0))) + 1
        self.state["calls"] = np.array(calls)
        seen = float(message.arrays["probe"][0])
        return Message({}, {"num_examples": 10 * (self.cid + 1), "calls": calls, "seen": seen})

    monkeypatch.setattr(FedITStrategy, "configure_evaluate", configure_evaluate)
    monkeypatch.setattr(FedITClient, "evaluate", evaluate)
    config = _config(tmp_path)
    flower_history = []

    # Execute
    serve(LoopbackGrid(make_client_app(config), 2), config, timeout=60, on_round=flower_history.append)
    strategy = RunContext(config).strategy()
    strategy.initialize()
    embedded_history = run_rounds(strategy, RunContext(config).client, 2, 2, config.rounds, config.seed)

    # Assert
    assert [r.metrics["calls"] for r in flower_history] == [1.0, 2.0]  # state persisted on the node
    assert [r.metrics["seen"] for r in flower_history] == [1.0, 2.0]
    assert [r.eval_bytes for r in flower_history] == [r.eval_bytes for r in embedded_history]
    for f, e in zip(flower_history, embedded_history):
        assert f.metrics.keys() == e.metrics.keys()
        np.testing.assert_allclose([f.metrics[k] for k in e.metrics], list(e.metrics.values()), rtol=1e-6)


def test_failing_client_is_dropped_and_named(task_identity, tmp_path, monkeypatch):
    from fedtune.methods.fedit import FedITClient

    original = FedITClient.fit

    def fit(self, message):
        if self.cid == 1 and message.meta["round"] == 2:
            raise RuntimeError("out of memory on purpose")
        return original(self, message)

    monkeypatch.setattr(FedITClient, "fit", fit)
    config = _config(tmp_path)
    grid = LoopbackGrid(make_client_app(config), config.federation.num_clients)
    summary = serve(grid, config, timeout=60)
    lines = [json.loads(x) for x in Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()]
    assert "dropped" not in lines[0]
    assert list(lines[1]["dropped"]) == ["1"] and "on purpose" in lines[1]["dropped"]["1"]
    # with both replies required the round is retried, then the run stops naming the drop
    config = _config(tmp_path / "strict", "federation.min_replies=2", "federation.max_retries=1")
    grid = LoopbackGrid(make_client_app(config), config.federation.num_clients)
    with pytest.raises(RoundFailed, match=r"round 2: fewer than federation.min_replies = 2 .*on purpose"):
        serve(grid, config, timeout=60)


def test_missing_reply_is_dropped_and_missing_node_raises(task_identity, tmp_path):
    config = _config(tmp_path)
    summary = serve(LoopbackGrid(make_client_app(config), 2, drop={0}), config, timeout=60)
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[0])
    assert line["dropped"] == {"0": "no reply within 60 s"}
    with pytest.raises(TimeoutError, match="1 Flower nodes connected"):
        serve(LoopbackGrid(make_client_app(config), 1), config, timeout=0.5)


def test_message_for_another_client_is_refused(task_identity, tmp_path):
    config = _config(tmp_path)
    app = make_client_app(config)
    grid = LoopbackGrid(app, 2)
    node = grid.get_node_ids()[0]
    content, _ = pack(Message({}, {"round": 1}), cid=1 - grid.contexts[node].node_config["partition-id"])
    message = FlowerMessage(content, dst_node_id=node, message_type="train", group_id="1")
    (reply,) = grid.send_and_receive([message])
    assert reply.has_error() and "reached the node of client" in reply.error.reason


# -- the real Flower simulation runtime (Ray) -------------------------------------------------------
def test_flower_simulation_matches_embedded_engine(tmp_path, embedded):
    ray = pytest.importorskip("ray")

    # Prepare
    config = _config(tmp_path / "flower")
    flower_history = []

    # Execute
    summary = flower.run_flower_simulation(config, timeout=1200, on_round=flower_history.append)

    # Assert
    assert not ray.is_initialized()
    _assert_same_run(load_state(f"{summary['run_dir']}/checkpoint.npz"), flower_history, embedded)
    assert (tmp_path / "flower" / config.run_name / "adapter").is_dir()


@pytest.mark.slow
def test_flower_simulation_surfaces_a_client_failure(tmp_path):
    ray = pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    # Prepare: the ClientApps cannot load their data
    config = _config(tmp_path)
    broken = _config(tmp_path, f"data.name={tmp_path / 'missing.csv'}")

    # Execute / Assert
    with flower._ReapDescendants():
        try:
            with pytest.raises(RoundFailed, match=r"(?s)round 1: fewer than .*missing"):
                run_simulation(
                    flower.make_server_app(config, timeout=1200),
                    make_client_app(broken),
                    2,
                    backend_config=flower.ray_backend_config(2),
                )
        finally:
            if ray.is_initialized():
                ray.shutdown()


# -- a real multi-process deployment on 127.0.0.1 (SuperLink, SuperNodes, `flwr run`) -------------
def _free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _wait_for_port(port: int, timeout: float = 120) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s") from None
            time.sleep(0.25)


def _stop_tree(popens) -> None:
    """Stop what we started and everything it spawned (Flower detaches its SuperExec into a new
    session, so process groups are not enough): collect the whole tree first, then stop by PID."""
    import psutil

    tree = []
    for popen in popens:
        try:
            root = psutil.Process(popen.pid)
            tree += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in reversed(tree):
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    flower.reap(tree, 10)
    for popen in popens:
        popen.wait(timeout=10)


@pytest.mark.slow
def test_flower_deployment_matches_embedded_engine(tmp_path, embedded):
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    # Prepare: a SuperLink and two SuperNodes on free loopback ports, a private FLWR_HOME
    bin_dir = Path(sys.executable).parent
    app_dir = Path(__file__).resolve().parents[1] / "flower_app"
    link, *node_ports = _free_ports(3)
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    out = tmp_path / "runs"
    overrides = "; ".join([*TINY, f"output_dir={out}"])
    started = []

    def start(name, *args):
        log = open(tmp_path / f"{name}.log", "w")
        started.append(subprocess.Popen(args, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT))

    # Execute
    try:
        start("superlink", bin_dir / "flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
              "--host", "127.0.0.1", "--port", str(link))
        _wait_for_port(link)
        for cid, port in enumerate(node_ports):
            start(f"supernode{cid}", bin_dir / "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link}",
                  "--port", str(port), "--node-config", f"partition-id={cid} num-partitions=2")
        for port in node_ports:
            _wait_for_port(port)
        run = subprocess.run(
            [bin_dir / "flwr", "run", app_dir, "loopback", "--stream", "--run-config", f"overrides='{overrides}'"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=500,
        )
        summary_path = out / "fedit-tweets-s3" / "summary.json"
        deadline = time.monotonic() + 60
        while not summary_path.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        _stop_tree(started)

    # Assert
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert json.loads(summary_path.read_text())["engine"] == "flower"
    embedded_state, embedded_history = embedded
    flower_state = load_state(summary_path.parent / "checkpoint.npz")
    for key, value in embedded_state["global"].items():
        np.testing.assert_allclose(flower_state["global"][key], value, rtol=0, atol=1e-6, err_msg=key)
    lines = [json.loads(line) for line in (summary_path.parent / "metrics.jsonl").read_text().splitlines()]
    assert [line["clients"] for line in lines] == [r.clients for r in embedded_history]
    for key in ("client_bytes_down", "client_bytes_up"):
        expected = [{str(c): b for c, b in getattr(r, key).items()} for r in embedded_history]
        assert [line[key] for line in lines] == expected
