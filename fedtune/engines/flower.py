"""The same Strategy and Client objects as a Flower ServerApp / ClientApp (flwr Message API).

Wire: a fedtune :class:`~fedtune.protocol.messages.Message` crosses inside a Flower Message as
its own encoding, one ``bytes`` value of a ConfigRecord::

    RecordDict {"fedtune": ConfigRecord {"message": Message.encode(), "cid": <client id>}}

Why bytes and not a native ArrayRecord plus a meta ConfigRecord: ``Message.decode`` restores
every dtype, shape, name order and the JSON meta exactly, and the bytes fedtune accounts
(``len(message.encode())``) are exactly the payload that crossed, as in the embedded engine. The
price: Flower mods that work on ArrayRecords (its DP / secagg mods) do not see the arrays, and a
message travels as one unchunked Flower object (ArrayRecords are cut in 5 MB chunks): fine for
adapters, worth revisiting for a method that ships whole models.

Client ids are Flower partition ids: the node that plays client ``cid`` has
``node_config["partition-id"] = cid`` (the simulation numbers its nodes ``0..N-1``; a real
SuperNode is started with ``--node-config "partition-id=<cid>"``). The server learns the
partition -> node id map with one ``query`` message to every node before round 1 and checks that
each client id is played by exactly one node. Each message also names its client id and the
ClientApp refuses a message meant for another one. A client's persistent state (``Client.state``)
lives in its node's ``context.state`` as an ArrayRecord.

The round loop is every engine's (:func:`~fedtune.engines.rounds.drive_rounds`), with a batched
transport: all clients of a round are sent at once (``grid.send_and_receive``), so nodes train in
parallel, and the replies are put back in the order of ``configure_fit`` (aggregation order fixes
float sums). A reply carrying an error, or none within the deadline, is a drop (the round loop
records it and retries a round short of ``federation.min_replies``). The ClientApp
times the Client call and returns the seconds beside the message (``compute_s`` in the same
ConfigRecord, outside the accounted bytes), as the embedded engine times it around the call.

Usage::

    from fedtune.engines.flower import run_flower_simulation
    summary = run_flower_simulation(load_config("configs/fedit.toml"))   # Ray, one node per client

Deployment (``flwr run flower_app <superlink>``, see ``flower_app/pyproject.toml``): the app's
components are the module-level ``server_app`` / ``client_app`` below, which read the RunConfig
from Flower's run config (:func:`config_from_run_config`). There each ClientApp call runs in a
fresh ``flwr-clientapp`` process, so the RunContext (model, tokenized data) is rebuilt per call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedtune.config import RunConfig
from fedtune.process import setup_process
from fedtune.protocol.messages import Message
from fedtune.engines.rounds import Delivery, Engine, RoundRecord, answer

RECORD = "fedtune"  # RecordDict key of the ConfigRecord that carries a fedtune Message
BLOB = "message"  # ConfigRecord key: Message.encode()
CID = "cid"  # ConfigRecord key: the fedtune client id the message is for / from
STATE = "fedtune-state"  # context.state key: the client's persistent arrays (ArrayRecord)
PARTITION_ID = "partition-id"  # node_config key naming the client id a node plays

COMPUTE_S = "compute_s"  # ConfigRecord key of a reply: seconds the Client call took on the node
ROUND = "round"  # ConfigRecord key: the round a message belongs to (request) or claims (reply)
ATTEMPT = "attempt"  # ConfigRecord key of a request: the round's attempt (fault injection draws)

class FlowerClientError(RuntimeError):
    """A ClientApp failed (or never answered); names the client, its node, the round and kind."""

    def __init__(self, cid: int | None, node_id: int, rnd: int, kind: str, reason: str) -> None:
        who = f"client {cid}" if cid is not None else "a client"
        super().__init__(f"{who} (Flower node {node_id}) failed in round {rnd} ({kind}): {reason}")
        self.cid, self.node_id, self.round, self.kind, self.reason = cid, node_id, rnd, kind, reason


# -- conversion --------------------------------------------------------------------------------
def pack(message: Message, cid: int, **extra: float | int | str) -> tuple[RecordDict, int]:
    """Flower content carrying ``message`` for/from client ``cid`` (plus transport-level scalars
    such as ``compute_s``, not part of the accounted bytes), and its encoded length."""
    data = message.encode()
    return RecordDict({RECORD: ConfigRecord({BLOB: data, CID: int(cid), **extra})}), len(data)


def unpack(content: RecordDict) -> tuple[int, Message, int]:
    """Inverse of :func:`pack`: (client id, message, encoded length)."""
    if RECORD not in content:
        raise ValueError(f"Flower message carries no {RECORD!r} record (keys: {sorted(content)})")
    record = content[RECORD]
    data = record[BLOB]
    return int(record[CID]), Message.decode(data), len(data)


def state_to_record(state: Mapping[str, Any]) -> ArrayRecord:
    """A client's persistent state (named arrays) as an ArrayRecord."""
    return ArrayRecord({str(k): Array(np.asarray(v, order="C")) for k, v in state.items()})


def state_from_record(record: ArrayRecord | None) -> dict[str, np.ndarray]:
    return {} if record is None else {k: record[k].numpy() for k in record}


# -- config from Flower's run config (deployment with `flwr run`) -------------------------------
def config_from_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from Flower's run config (``flwr run -c ...``): ``recipe`` (a TOML path, may be
    empty), ``overrides`` (``"rounds=3; data.name=sst2"``, as ``fedtune run --set``) and dotted
    ``fedtune.<key> = value`` entries (``fedtune.rounds = 3``), applied in that order."""
    from fedtune.config import ConfigError, load_config

    overrides = [part.strip() for part in str(run_config.get("overrides", "")).split(";") if part.strip()]
    for key, value in run_config.items():
        if key.startswith("fedtune."):
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            overrides.append(f"{key.removeprefix('fedtune.')}={text}")
        elif key not in ("recipe", "overrides"):
            raise ConfigError(f"Flower run config {key!r}: expected 'recipe', 'overrides' or 'fedtune.<key>'")
    return load_config(run_config.get("recipe") or None, overrides)


# -- client side ---------------------------------------------------------------------------------
_CONTEXTS: dict[str, Any] = {}  # config JSON -> RunContext, one per process (a Ray actor, a SuperNode)
_CONTEXTS_LOCK = threading.Lock()


def _process_context(config: RunConfig):
    """This process's RunContext for ``config`` (built once: it caches the model and the data)."""
    from fedtune.runtime import RunContext

    key = config.model_dump_json()
    with _CONTEXTS_LOCK:
        if key not in _CONTEXTS:
            setup_process(config.train.threads)
            _CONTEXTS[key] = RunContext(config)
        return _CONTEXTS[key]


def _partition_id(context: Context) -> int:
    if PARTITION_ID not in context.node_config:
        raise RuntimeError(
            f"node {context.node_id} has no node_config[{PARTITION_ID!r}]: start the SuperNode with "
            f"--node-config \"{PARTITION_ID}=<client id>\""
        )
    return int(context.node_config[PARTITION_ID])


def handle_client_message(config: RunConfig | None, message: FlowerMessage, context: Context) -> FlowerMessage:
    """Answer one Flower message as fedtune client ``partition-id``: build the Client from this
    process's RunContext and the node's persistent state, serve it with
    :func:`~fedtune.engines.rounds.answer` (fault injection, then ``fit`` or ``evaluate``). A
    failure propagates: Flower returns it to the server as an error reply (a drop)."""
    pid = _partition_id(context)
    kind = message.metadata.message_type.split(".")[0]
    if kind == "query":  # the server's hello: which client id does this node play?
        return FlowerMessage(RecordDict({RECORD: ConfigRecord({PARTITION_ID: pid})}), reply_to=message)
    if kind not in ("train", "evaluate"):
        raise ValueError(f"unexpected message type {message.metadata.message_type!r}")
    cid, request, _ = unpack(message.content)
    if cid != pid:
        raise RuntimeError(f"message for client {cid} reached the node of client {pid}")
    envelope = message.content[RECORD]
    rnd, attempt = int(envelope.get(ROUND, 0)), int(envelope.get(ATTEMPT, 0))
    config = config if config is not None else config_from_run_config(context.run_config)
    client = _process_context(config).client(pid, state_from_record(context.state.get(STATE)))
    start = time.perf_counter()  # the engine times the client call, as embedded.exchange does
    reply = answer(client, kind, request, config.seed, rnd, attempt)
    seconds = time.perf_counter() - start
    context.state[STATE] = state_to_record(client.state)
    content, _ = pack(reply, pid, **{COMPUTE_S: seconds, ROUND: rnd})
    return FlowerMessage(content, reply_to=message)


def make_client_app(config: RunConfig | None = None) -> ClientApp:
    """A ClientApp playing fedtune client ``node_config["partition-id"]`` of ``config`` (default:
    the config from Flower's run config, see :func:`config_from_run_config`)."""
    app = ClientApp()

    # The handlers only delegate to a module-level function: Ray pickles these closures by value
    # per call, but `handle_client_message` by reference, so `_CONTEXTS` persists in the actor.
    @app.train()
    def train(message: FlowerMessage, context: Context) -> FlowerMessage:
        return handle_client_message(config, message, context)

    @app.evaluate()
    def evaluate(message: FlowerMessage, context: Context) -> FlowerMessage:
        return handle_client_message(config, message, context)

    @app.query()
    def query(message: FlowerMessage, context: Context) -> FlowerMessage:
        return handle_client_message(config, message, context)

    return app


# -- server side ---------------------------------------------------------------------------------
def _wait_for_nodes(grid: Grid, count: int, timeout: float | None) -> list[int]:
    start = time.monotonic()
    while len(ids := list(grid.get_node_ids())) < count:
        if timeout is not None and time.monotonic() - start > timeout:
            raise TimeoutError(f"{len(ids)} Flower nodes connected after {timeout:.0f} s; expected {count}")
        time.sleep(0.2)
    return ids


def discover_nodes(grid: Grid, num_clients: int, timeout: float | None = None) -> dict[int, int]:
    """Client id -> Flower node id, from the partition id each connected node reports."""
    node_ids = _wait_for_nodes(grid, num_clients, timeout)
    hello = [
        FlowerMessage(RecordDict({RECORD: ConfigRecord({})}), dst_node_id=n, message_type="query", group_id="0")
        for n in node_ids
    ]
    node_of: dict[int, int] = {}
    replies = list(grid.send_and_receive(hello, timeout=timeout))
    for reply in replies:
        nid = reply.metadata.src_node_id
        if reply.has_error():
            raise FlowerClientError(None, nid, 0, "query", reply.error.reason)
        pid = int(reply.content[RECORD][PARTITION_ID])
        if not 0 <= pid < num_clients:
            raise RuntimeError(
                f"Flower node {nid} plays client {pid}; expected 0..{num_clients - 1} (federation.num_clients)"
            )
        if pid in node_of:
            raise RuntimeError(f"client {pid} is played by two Flower nodes ({node_of[pid]} and {nid})")
        node_of[pid] = nid
    missing = sorted(set(range(num_clients)) - node_of.keys())
    if missing:
        raise RuntimeError(f"no Flower node answered for clients {missing} (of {len(node_ids)} nodes asked)")
    return node_of


class GridTransport:
    """Send a round's messages through a Flower Grid in one batch and collect the replies; a
    client that fails (an error reply) or does not answer within ``timeout`` seconds is a failed
    :class:`~fedtune.engines.rounds.Delivery` (dropped by the round loop)."""

    def __init__(self, grid: Grid, node_of: dict[int, int], timeout: float | None = None) -> None:
        self.grid, self.node_of, self.timeout = grid, node_of, timeout
        self.cid_of = {nid: cid for cid, nid in node_of.items()}

    def __call__(self, kind: str, rnd: int, messages: dict[int, Message], attempt: int = 0) -> dict[int, Delivery]:
        if not messages:
            return {}
        out, down = [], {}
        encoded: dict[int, bytes] = {}  # a Message broadcast to many clients is encoded once
        for cid, message in messages.items():
            if id(message) not in encoded:
                encoded[id(message)] = message.encode()
            data = encoded[id(message)]
            down[cid] = len(data)
            content = RecordDict({RECORD: ConfigRecord({BLOB: data, CID: int(cid), ROUND: rnd, ATTEMPT: attempt})})
            out.append(FlowerMessage(content, dst_node_id=self.node_of[cid], message_type=kind, group_id=str(rnd)))
        received: dict[int, Delivery] = {}
        for reply in self.grid.send_and_receive(out, timeout=self.timeout):
            cid = self.cid_of.get(reply.metadata.src_node_id)
            if cid is None or cid not in messages:
                continue  # a node we did not ask: ignore
            if reply.has_error():
                received[cid] = Delivery(None, down[cid], error=f"client error: {reply.error.reason}")
                continue
            try:
                sender, message, up = unpack(reply.content)
                record = reply.content[RECORD]
                received[cid] = Delivery(
                    message, down[cid], up, float(record.get(COMPUTE_S, 0.0)), sender, int(record.get(ROUND, -1))
                )
            except Exception as exc:  # noqa: BLE001 - a reply that does not even decode is a drop
                received[cid] = Delivery(None, down[cid], error=f"undecodable reply ({exc})")
        # in configure order: aggregation sums in dict order, as the embedded engine does
        return {
            cid: received.get(cid) or Delivery(None, down[cid], error=f"no reply within {self.timeout} s")
            for cid in messages
        }


class FlowerEngine(Engine):
    """Rounds over a Flower Grid: nodes are discovered on first use (:func:`discover_nodes`);
    client state lives on the nodes (``context.state``), not in the server's checkpoint."""

    name = "flower"

    def __init__(self, config: RunConfig, grid: Grid, timeout: float | None = None) -> None:
        super().__init__(config)
        self.grid, self.timeout, self._transport = grid, timeout, None

    def transport(self) -> GridTransport:
        if self._transport is None:
            fed = self.config.federation
            node_of = discover_nodes(self.grid, fed.num_clients, self.timeout)
            self._transport = GridTransport(self.grid, node_of, fed.round_timeout_s or self.timeout)
        return self._transport


def serve(
    grid: Grid,
    config: RunConfig,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
) -> dict:
    """Run ``config``'s method over ``grid`` and write the run folder exactly as the embedded
    engine does (:func:`fedtune.run.run_experiment`, summary marked ``"engine": "flower"``)."""
    from fedtune.run import run_experiment

    setup_process(config.train.threads)
    return run_experiment(config, on_round, on_start, engine=FlowerEngine(config, grid, timeout), resume=resume)


def make_server_app(
    config: RunConfig | None = None,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
) -> ServerApp:
    """A ServerApp running ``config`` (default: from Flower's run config) with :func:`serve`;
    ``timeout`` bounds the wait for nodes and for each round's replies (None: wait forever)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_config = config if config is not None else config_from_run_config(context.run_config)
        serve(grid, run_config, timeout, on_round, on_start)

    return app


#: Module-level apps for deployment (``flwr run``): the run config comes from Flower's run config.
server_app = make_server_app()
client_app = make_client_app()


# -- simulation ----------------------------------------------------------------------------------
def ray_backend_config(num_supernodes: int, verbose: bool = False) -> dict:
    """Flower's Ray backend config for a small offline machine: 1 CPU per ClientApp, a private
    local Ray instance (never someone else's cluster), no dashboard, no GPU."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return {
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
        "init_args": {
            "address": "local",
            "num_cpus": max(1, min(num_supernodes, os.cpu_count() or 1)),
            "num_gpus": 0,
            "include_dashboard": False,
            "logging_level": "INFO" if verbose else "ERROR",
            "log_to_driver": verbose,
        },
    }


def run_flower_simulation(
    config: RunConfig,
    num_supernodes: int | None = None,
    backend_config: dict | None = None,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    verbose: bool = False,
) -> dict:
    """Run ``config`` as a Flower ServerApp + ClientApp with ``flwr.simulation.run_simulation``
    (Ray backend, one virtual SuperNode per client, :func:`ray_backend_config` updated with
    ``backend_config``; Ray is shut down at the end); return the summary (``summary.json``).
    A ClientApp failure is a drop; a round without ``federation.min_replies`` valid replies
    raises :class:`~fedtune.engines.rounds.RoundFailed`."""
    num_clients = config.federation.num_clients
    num_supernodes = num_clients if num_supernodes is None else num_supernodes
    if num_supernodes != num_clients:
        raise ValueError(f"num_supernodes={num_supernodes}: one node plays one client, expected {num_clients}")
    setup_process()
    backend = ray_backend_config(num_supernodes, verbose)
    for key, value in (backend_config or {}).items():
        backend[key] = {**backend.get(key, {}), **value} if isinstance(value, dict) else value

    import ray
    from flwr.simulation import run_simulation

    pythonpath = os.environ.get("PYTHONPATH")  # Flower's Ray backend overwrites it with sys.path
    with _ReapDescendants():
        try:
            run_simulation(
                make_server_app(config, timeout, on_round),
                make_client_app(config),
                num_supernodes,
                backend_config=backend,
                verbose_logging=verbose,
            )
        finally:
            if ray.is_initialized():  # the backend shuts Ray down itself unless it failed early
                ray.shutdown()
            if pythonpath is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = pythonpath
    return json.loads((Path(config.output_dir) / config.run_name / "summary.json").read_text())


class _ReapDescendants:
    """Remember the processes started while inside (descendants absent on entry, polled: Ray's
    GCS, raylet, workers, actors); on exit wait for them to end, then kill those left, by PID.
    After ``ray.shutdown()`` the actors outlive the raylet a few seconds, re-parented to init."""

    def __init__(self, poll_s: float = 0.5, grace_s: float = 15.0) -> None:
        self.poll_s, self.grace_s = poll_s, grace_s
        self.seen: dict[int, Any] = {}
        self.done = threading.Event()

    def _poll(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.done.wait(self.poll_s):
            try:
                for proc in me.children(recursive=True):
                    if proc.pid not in self.before:
                        self.seen.setdefault(proc.pid, proc)
            except psutil.Error:
                pass

    def __enter__(self) -> "_ReapDescendants":
        import psutil

        self.before = {proc.pid for proc in psutil.Process().children(recursive=True)}  # not ours to stop
        self.thread = threading.Thread(target=self._poll, daemon=True, name="fedtune-reaper")
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import psutil

        self.done.set()
        self.thread.join()
        reap(list(self.seen.values()), self.grace_s)  # psutil.Process checks its create time: no PID reuse


def reap(procs: list, grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``procs`` (psutil.Process) to end, then kill the rest by PID."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
