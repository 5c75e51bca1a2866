"""The same fedtune Strategy/Client objects run through Flower (ServerApp + ClientApp, Message
API) give what the embedded engine gives: the same global adapter and the same bytes.

Fast tests drive the apps through an in-process loopback Grid (Flower-native records, Flower's
own ``fixedclipping_mod``, a node's worker); one test runs the real Flower simulation runtime
(Ray backend, one virtual SuperNode per client). Every method against the embedded engine:
tests/test_flower_contract.py; real loopback deployments (TLS, authentication, Ctrl-C):
tests/test_flower_deploy.py.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Error, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid

from fedtune.checkpoint import load_state
from fedtune.config import load_config
from fedtune.engines.flower import clientapp, codec, deployment, serverapp, simulation
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.codec import pack, state_from_record, state_to_record, unpack
from fedtune.engines.flower.runconfig import config_from_run_config
from fedtune.engines.flower.serverapp import serve
from fedtune.engines.rounds import RoundFailed
from fedtune.process import ReapDescendants
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
    ``drop`` never answer a train message). ``groups``: the client ids of each node (default:
    one client per node, Flower's ``partition-id``)."""

    def __init__(self, client_app, num_nodes: int, drop: set[int] = frozenset(), groups=None) -> None:
        self.app, self.drop = client_app, drop
        groups = groups or [[i] for i in range(num_nodes)]
        self.contexts = {}
        for i, clients in enumerate(groups):
            node_id = 7000 + 13 * (len(groups) - i)
            node_config = (
                {"partition-id": clients[0], "num-partitions": len(groups)}
                if groups is None or len(clients) == 1
                else {"fedtune-clients": codec.format_clients(clients)}
            )
            self.contexts[node_id] = Context(
                run_id=1, node_id=node_id, node_config=node_config, state=RecordDict(), run_config={}
            )
        self.sent: list[FlowerMessage] = []
        self.replies: dict[str, FlowerMessage] = {}

    def set_run(self, run):  # pragma: no cover - unused
        raise AssertionError("serve() must not call this Grid member")

    @property
    def run(self):  # pragma: no cover - unused
        raise AssertionError("serve() must not call this Grid member")

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # pragma: no cover
        raise AssertionError("serve() must not call this Grid member")

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for message in messages:
            self.sent.append(message)
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(message.metadata.message_id)
            context = self.contexts[message.metadata.dst_node_id]
            if self._dropped(context) and message.metadata.message_type == "train":
                continue
            try:
                reply = self.app(message, context)
            except Exception as exc:  # what the Flower runtime does with a failing ClientApp
                reply = FlowerMessage(Error(code=0, reason=repr(exc)), reply_to=message)
            self.replies[message.metadata.message_id] = reply
        return ids

    def _dropped(self, context) -> bool:
        config = context.node_config
        clients = (
            [config["partition-id"]] if "partition-id" in config else codec.parse_clients(config["fedtune-clients"])
        )
        return bool(set(clients) & set(self.drop))

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in reversed(list(message_ids)) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):  # pragma: no cover - serve() pushes and pulls
        raise AssertionError("serve() must not call send_and_receive (it waits 3 s between pulls)")


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

    # Assert: Flower-native records (one ArrayRecord of one Array per dtype, one ConfigRecord), the
    # fedtune bytes counted
    assert list(content.array_records) == [codec.ARRAYS] and list(content.config_records) == [codec.RECORD]
    assert list(content[codec.ARRAYS]) == ["<f4", "<f2", "<i8", "<f8"]  # the dtypes, in order of appearance
    assert content[codec.ARRAYS]["<f4"].numpy().shape == (12,)  # lora_B and empty, flattened and concatenated
    assert cid == 17 and nbytes == nbytes_back == len(message.encode()) == message.nbytes
    assert list(back.arrays) == list(arrays) and back.meta == message.meta
    for key, value in message.arrays.items():
        assert back.arrays[key].dtype == value.dtype and back.arrays[key].shape == value.shape
        np.testing.assert_array_equal(back.arrays[key], value)
    assert back.encode() == message.encode()


def test_a_bundled_reply_names_its_failed_client_and_decodes_the_others(task_identity):
    """GridTransport._delivery reads a bundle's ``error-<cid>`` entry as that client's failure, and a
    client without one from its suffixed records."""
    from fedtune.engines.flower.transport import GridTransport

    sent = Message({"w": np.ones(2, dtype=np.float32)}, {"round": 1})
    content, _ = pack(sent, 4, suffix="-4", into=RecordDict(), **{codec.COMPUTE_S: 0.5, codec.ROUND: 1})
    content[codec.BUNDLE] = ConfigRecord({codec.CLIENTS: [3, 4], "error-3": "ValueError: boom"})
    reply = FlowerMessage(content, dst_node_id=1, message_type="train")
    failed = GridTransport._delivery(reply, 3, "-3", sent, 10, {})
    answered = GridTransport._delivery(reply, 4, "-4", sent, 10, {})
    assert failed.reply is None and failed.error == "client error: ValueError: boom"
    assert answered.error is None and answered.sender == 4 and answered.round == 1
    np.testing.assert_array_equal(answered.reply.arrays["w"], sent.arrays["w"])
    assert GridTransport._delivery(reply, 5, "", sent, 10, {}).error.startswith("undecodable reply")


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


def test_a_run_config_is_parsed_once_per_process(tmp_path, monkeypatch):
    """Every request a ClientApp serves asks for the config: the same run config is parsed once."""
    from fedtune.engines.flower import runconfig

    calls = []
    parse = runconfig.parse_run_config
    monkeypatch.setattr(runconfig, "parse_run_config", lambda rc: calls.append(1) or parse(rc))
    runconfig._parsed.cache_clear()
    rc = {"config": load_config(None, [f"output_dir={tmp_path}"]).model_dump_json(), "timeout": 0.0}
    first = config_from_run_config(rc)
    assert all(config_from_run_config(dict(reversed(list(rc.items())))) is first for _ in range(5))
    assert calls == [1]
    config_from_run_config({**rc, "timeout": 5.0})  # another run config: parsed again
    assert calls == [1, 1]


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
    from fedtune.runtime import RunContext, resolve_run

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
    strategy = RunContext(resolve_run(config)).strategy()
    strategy.initialize()
    embedded_history = run_rounds(strategy, RunContext(resolve_run(config)).client, 2, 2, config.rounds, config.seed)

    # Assert
    assert [r.metrics["calls"] for r in flower_history] == [1.0, 2.0]  # state persisted on the node
    assert [r.metrics["seen"] for r in flower_history] == [1.0, 2.0]
    assert [r.eval_bytes for r in flower_history] == [r.eval_bytes for r in embedded_history]
    for f, e in zip(flower_history, embedded_history):
        assert f.metrics.keys() == e.metrics.keys()
        np.testing.assert_allclose([f.metrics[k] for k in e.metrics], list(e.metrics.values()), rtol=1e-6)


@pytest.fixture
def client_1_fails_in_round_2(monkeypatch):
    """FedIT's client 1 raises "out of memory on purpose" in round 2."""
    from fedtune.methods.fedit import FedITClient

    original = FedITClient.fit

    def fit(self, message):
        if self.cid == 1 and message.meta["round"] == 2:
            raise RuntimeError("out of memory on purpose")
        return original(self, message)

    monkeypatch.setattr(FedITClient, "fit", fit)


def test_failing_client_is_dropped_and_named(task_identity, tmp_path, client_1_fails_in_round_2):
    config = _config(tmp_path)
    grid = LoopbackGrid(make_client_app(config), config.federation.num_clients)
    summary = serve(grid, config, timeout=60)
    lines = [json.loads(x) for x in Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["dropped"] == {} and lines[0]["attempts"] == 1
    assert list(lines[1]["dropped"]) == ["1"] and "on purpose" in lines[1]["dropped"]["1"]
    # with both replies required the round is retried, then the run stops naming the drop
    config = _config(tmp_path / "strict", "federation.min_replies=2", "federation.max_retries=1")
    grid = LoopbackGrid(make_client_app(config), config.federation.num_clients)
    with pytest.raises(RoundFailed, match=r"round 2: fewer than federation.min_replies = 2 .*on purpose"):
        serve(grid, config, timeout=60)


def test_the_server_app_writes_how_its_run_ended(task_identity, tmp_path, client_1_fails_in_round_2):
    """A deployment learns how the ServerApp's run ended from the run folder's status file (not
    from log text): ok, or the round that failed with its one-line message."""
    from flwr.app import Context, RecordDict

    def main_of(config):
        app = serverapp.make_server_app(config, timeout=60)
        grid = LoopbackGrid(make_client_app(config), config.federation.num_clients)
        return lambda: app._main(grid, Context(0, 0, {}, RecordDict(), {}))  # Flower's ServerApp entry

    from fedtune.runtime import resolve_run

    start, ok = time.time(), _config(tmp_path / "ok")
    main_of(ok)()
    assert serverapp.read_status(resolve_run(ok).run_dir, start) == {"status": "ok"}
    strict = _config(tmp_path / "strict", "federation.min_replies=2", "federation.max_retries=0")
    with pytest.raises(RoundFailed) as failed:
        main_of(strict)()
    run_dir = resolve_run(strict).run_dir
    assert serverapp.read_status(run_dir, start) == {"status": "round_failed", "message": str(failed.value)}
    assert serverapp.read_status(run_dir, time.time() + 60) is None  # an earlier run's status is not this one's


def test_missing_reply_is_dropped_and_missing_node_raises(task_identity, tmp_path):
    config = _config(tmp_path)
    summary = serve(LoopbackGrid(make_client_app(config), 2, drop={0}), config, timeout=2)
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[0])
    assert line["dropped"] == {"0": "no reply within 2 s"}
    with pytest.raises(TimeoutError, match="1 Flower nodes connected"):
        serve(LoopbackGrid(make_client_app(config), 1), config.model_copy(update={"name": "one-node"}), timeout=0.5)


def test_message_for_another_client_is_refused(task_identity, tmp_path):
    config = _config(tmp_path)
    app = make_client_app(config)
    grid = LoopbackGrid(app, 2)
    node = grid.get_node_ids()[0]
    content, _ = pack(Message({}, {"round": 1}), cid=1 - grid.contexts[node].node_config["partition-id"])
    message = FlowerMessage(content, dst_node_id=node, message_type="train", group_id="1")
    (reply,) = grid.pull_messages(grid.push_messages([message]))
    assert reply.has_error() and "reached a node that plays clients" in reply.error.reason


# -- the real Flower simulation runtime (Ray) -------------------------------------------------------
def test_flower_simulation_matches_embedded_engine(tmp_path, embedded):
    ray = pytest.importorskip("ray")

    # Prepare
    config = _config(tmp_path / "flower")
    flower_history = []

    # Execute
    summary = simulation.run_flower_simulation(config, timeout=1200, on_round=flower_history.append)

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
    with ReapDescendants():
        try:
            with pytest.raises(RoundFailed, match=r"(?s)round 1: fewer than .*missing"):
                run_simulation(
                    serverapp.make_server_app(config, timeout=1200),
                    make_client_app(broken),
                    2,
                    backend_config=simulation.ray_backend_config(2),
                )
        finally:
            if ray.is_initialized():
                ray.shutdown()


# -- Flower mods: client-side fixed clipping (central DP) with fedit --------------------------------
def _round_one_updates(monkeypatch, config, grid, request_config=None):
    """The updates FedIT's strategy aggregates in round 1 (client id -> flat update)."""
    from fedtune.methods.fedit import FedITStrategy

    seen = {}
    original = FedITStrategy.aggregate_fit

    def aggregate_fit(self, rnd, replies):
        if rnd == 1:
            seen.update({cid: np.concatenate([a.ravel() for a in m.arrays.values()]) for cid, m in replies.items()})
        return original(self, rnd, replies)

    monkeypatch.setattr(FedITStrategy, "aggregate_fit", aggregate_fit)
    serve(grid, config, timeout=60, request_config=request_config)
    monkeypatch.setattr(FedITStrategy, "aggregate_fit", original)
    return seen


def test_fixedclipping_mod_clips_fedit_updates_to_the_norm(task_identity, tmp_path, monkeypatch):
    from flwr.clientapp.mod import fixedclipping_mod

    clipping = clientapp.only_when_clipping(fixedclipping_mod)  # Flower's mod, on requests that ask for it

    # Prepare: the unclipped round-1 updates, and a norm well below theirs
    config = _config(tmp_path / "plain", "rounds=1")
    plain = _round_one_updates(monkeypatch, config, LoopbackGrid(make_client_app(config, mods=[clipping]), 2))
    norms = {cid: float(np.linalg.norm(u)) for cid, u in plain.items()}
    clip = 0.25 * min(norms.values())

    # Execute: the server sends clipping_norm; the mod clips reply - request
    config = _config(tmp_path / "clipped", "rounds=1")
    grid = LoopbackGrid(make_client_app(config, mods=[clipping]), 2)
    clipped = _round_one_updates(monkeypatch, config, grid, {codec.CLIPPING_NORM: clip})

    # Assert: each update now has norm clip (what the mod promises: min(1, C / ||u||) u) and the
    # direction of the unclipped one
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert train and all(m.content[codec.RECORD][codec.CLIPPING_NORM] == clip for m in train)
    assert clipped.keys() == plain.keys()
    for cid, update in clipped.items():
        np.testing.assert_allclose(np.linalg.norm(update), clip, rtol=1e-4)
        np.testing.assert_allclose(update, plain[cid] * (clip / norms[cid]), atol=1e-6)

    # ... and a norm above theirs leaves them as they were
    config = _config(tmp_path / "loose", "rounds=1")
    grid = LoopbackGrid(make_client_app(config, mods=[clipping]), 2)
    loose = _round_one_updates(monkeypatch, config, grid, {codec.CLIPPING_NORM: 10 * max(norms.values())})
    for cid, update in loose.items():
        np.testing.assert_allclose(update, plain[cid], atol=1e-6)


def test_fixedclipping_mod_needs_one_array_record_and_the_norm_from_the_server(task_identity, tmp_path):
    from flwr.clientapp.mod import fixedclipping_mod

    config = _config(tmp_path)
    grid = LoopbackGrid(make_client_app(config, mods=[fixedclipping_mod]), 2)
    node = grid.get_node_ids()[0]
    cid = grid.contexts[node].node_config["partition-id"]

    def ask(**extra):
        content, _ = pack(Message({"x": np.ones(3, np.float32)}, {"round": 1}), cid, **extra)
        message = FlowerMessage(content, dst_node_id=node, message_type="train", group_id="1")
        (reply,) = grid.pull_messages(grid.push_messages([message]))
        return reply

    # a request without clipping_norm is rejected by the mod itself, before fedtune sees it
    reply = ask(round=1)
    assert reply.has_error() and "clipping_norm" in reply.error.reason
    # the node's query (no ArrayRecord) too: hence only_when_clipping in the deployment's ClientApp
    query = FlowerMessage(
        RecordDict({codec.RECORD: ConfigRecord({})}), dst_node_id=node, message_type="query", group_id="0"
    )
    (reply,) = grid.pull_messages(grid.push_messages([query]))
    assert reply.has_error() and "ArrayRecord" in reply.error.reason


def test_client_ids_parse_and_format():
    assert codec.parse_clients("0-3,7, 9-10") == [0, 1, 2, 3, 7, 9, 10]
    assert codec.format_clients([10, 0, 1, 2, 3, 7, 9]) == "0-3,7,9-10"
    assert codec.parse_clients(codec.format_clients(range(1000))) == list(range(1000))


def test_cli_runs_each_engine(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fedtune import cli

    calls = []

    def fake(name):
        def run(run, on_round=None, on_start=None, resume=False, **_):  # launch hands the resolved run
            calls.append((name, run.config.engine, resume, callable(on_round), callable(on_start)))
            return {
                "run_dir": str(tmp_path),
                "final_accuracy": 0.5,
                "majority_accuracy": 0.4,
                "total_bytes_up": 1,
                "total_bytes_down": 1,
                "wall_s": 1.0,
            }

        return run

    monkeypatch.setattr(simulation, "run_flower_simulation", fake("simulation"))
    monkeypatch.setattr(deployment, "run_flower_deployment", fake("deployment"))
    for engine in ("flower-sim", "flower"):
        result = CliRunner().invoke(cli.app, ["run", "--set", f"engine={engine}", "--set", f"output_dir={tmp_path}"])
        assert result.exit_code == 0, result.output
    assert calls == [("simulation", "flower-sim", False, True, True), ("deployment", "flower", False, True, True)]
    result = CliRunner().invoke(cli.app, ["run", "--set", "engine=ray"])
    assert result.exit_code == 2 and "engine" in result.output


def test_tokenized_cache_gives_the_same_batches(tmp_path, monkeypatch):
    """What a ClientApp maps from the on-disk cache is what tokenizing gives: ids, dtypes, batches."""
    from fedtune.data.batches import TokenizedSet
    from fedtune.data.cache import CACHE_ENV
    from fedtune.runtime import RunContext, resolve_run

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    task = RunContext(resolve_run(_config(tmp_path))).task
    (train, _), tokenizer = task.data, task.tokenizer
    reference = TokenizedSet.from_texts(tokenizer, train.texts, train.labels, 16)
    calls = []
    for _ in range(2):  # a miss (tokenizes, writes), then a hit (maps; the tokenizer is not asked)
        got = TokenizedSet.cached(lambda: calls.append(1) or tokenizer, "tok", train.texts, train.labels, 16)
        assert got.pad_id == reference.pad_id and len(got) == len(reference)
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got.ids, reference.ids))
        batches = [
            list(s.train_batches(np.arange(len(s)), 8, 5, np.random.default_rng(1), True)) for s in (got, reference)
        ]
        assert all(np.array_equal(x[k], y[k]) for x, y in zip(*batches) for k in x)
    assert calls == [1] and len(list((tmp_path / "cache" / "tokens").iterdir())) == 1
    TokenizedSet.cached(lambda: tokenizer, "tok", train.texts, train.labels, 17)  # another length: another entry
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2


def test_a_round_with_a_further_exchange_runs_on_flower_as_embedded(task_identity, tmp_path):
    """A Strategy phase (a second exchange in the round) crosses Flower as a "train" message
    naming its phase: same state, same bytes and the same drop as the embedded engine."""
    from tests.test_engine import TwoPhase, TwoPhaseClient, register_toy

    register_toy("toy-two-phase", TwoPhase, TwoPhaseClient)
    config = _config(tmp_path, "method=toy-two-phase", "federation.num_clients=4", "rounds=1")
    flower_history = []
    serve(LoopbackGrid(make_client_app(config), 4), config, timeout=60, on_round=flower_history.append)
    strategy = flower_history and load_state(tmp_path / config.run_name / "checkpoint.npz")
    assert np.allclose(strategy["x"], 1.5) and np.allclose(strategy["total"], (0 + 1 + 2) * 1.5)
    record = flower_history[0]
    assert record.dropped == {3: "sum: array 'y' missing"} and record.metrics["phase_replies"] == 3
    embedded = []
    run_experiment(
        _config(tmp_path / "e", "method=toy-two-phase", "federation.num_clients=4", "rounds=1"),
        on_round=embedded.append,
    )
    assert record.client_bytes_down == embedded[0].client_bytes_down
    assert record.client_bytes_up == embedded[0].client_bytes_up
