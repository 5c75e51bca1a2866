"""The same Strategy and Client objects as a Flower ServerApp / ClientApp (flwr Message API).

What crosses. A fedtune :class:`~fedtune.protocol.messages.Message` travels as Flower-native
records, one ArrayRecord and one ConfigRecord (the shape Flower's mods expect)::

    RecordDict {
      "fedtune-arrays": ArrayRecord {name: Array(array), ...}   # Message.arrays, in order
      "fedtune": ConfigRecord {
        "meta": JSON of Message.meta,                           # the fedtune metadata
        "cid": client id, "round": r,                           # who and when (both ways)
        "attempt": a,                                           # request: the round's attempt
        "compute_s": s,                                         # reply: seconds of the Client call
        "clipping_norm": C, "update-as-weights": True,          # request, only with DP clipping
      }
    }

Each Array keeps its name, dtype and shape; ``Message(arrays, json.loads(meta))`` on the other
side is the message that was sent (tests/test_flower.py round-trips it through Flower's
protobuf serialization).

How bytes are counted. The bytes a run reports are ``Message.nbytes`` of each message, the
length of fedtune's own encoding of the same arrays and meta (magic, JSON header, raw array
bytes), exactly as the embedded engine counts them (there ``len(message.encode())``); so both
engines report the same numbers for the same run. The transport scalars of the ConfigRecord
and Flower's own framing (protobuf, per-Array ``np.save`` headers, object ids, HTTP) are not
counted: they are Flower's cost, not the method's, and differ between Flower versions.

Nodes and clients. A node plays the client ids in its ``node_config``: ``partition-id`` (one
client, Flower's convention; the simulation numbers its nodes ``0..N-1``) or ``fedtune-clients``
(a group, ``"0-99"`` or ``"0,5,7-9"``), so 1,000 clients need not be 1,000 SuperNodes. The
server asks every node once (a ``query`` message) which clients it plays and checks that each
client id 0..N-1 is played by exactly one node. Each request names its client id; a node
refuses a client it does not play. A client's persistent state (``Client.state``) lives in its
node's ``context.state`` (one ArrayRecord per client id).

Rounds. The round loop is every engine's (:func:`~fedtune.engines.rounds.drive_rounds`), with a
batched transport (:class:`GridTransport`): all messages of a round are pushed at once, so nodes
train in parallel, replies are pulled every :data:`POLL_S` seconds (Flower's
``send_and_receive`` sleeps 3 s between pulls) and put back in the order of ``configure_fit``
(aggregation order fixes float sums). A node playing several of an exchange's clients gets them
as one *bundle* (one Flower message: each client's two records with the keys suffixed
``-<cid>``, plus a ``fedtune-bundle`` ConfigRecord listing the clients), served one after
another by one ClientApp process; a client failing inside a bundle is named in the reply's
bundle record and dropped alone. Requests for Flower's clipping mod are never bundled (the mod
wants one ArrayRecord per message). A reply carrying an error, or none within the deadline, is a
drop. The ClientApp times each Client call and returns the seconds as ``compute_s``.

Deployment. Stock Flower starts a fresh ``flwr-clientapp`` process per message. Importing torch,
transformers and PEFT there takes seconds, so a node may name a long-lived fedtune worker
(``node_config["fedtune-worker"]``, a Unix socket; :func:`run_worker`, started next to the
SuperNode by :mod:`fedtune.engines.deployment` or ``fedtune deploy supernode``): the ClientApp
then imports only Flower and this module, hands the request and the client's state to the
worker, and returns its reply; the worker keeps the task's model and data warm. Nothing of
Flower's internals is involved: the worker is fedtune's own process, reached through a public
ClientApp. Without a worker the ClientApp trains in its own process (the simulation, or a
SuperNode started by hand); the tokenized data then comes from the on-disk cache
(:mod:`fedtune.data.cache`). ``node_config["fedtune-threads"]`` sets the torch threads of a
node's training (default of the deployments: cores / nodes).

Differential privacy. Flower's client-side ``fixedclipping_mod`` clips ``reply - request`` of the
single ArrayRecord and needs ``clipping_norm`` in the request's single ConfigRecord; fedtune
clients reply with *updates* (trained - received), so with ``clipping_norm`` set
(:class:`GridTransport` ``request_config``, or ``clipping-norm`` in Flower's run config) a
request also carries ``update-as-weights``: the ClientApp returns received + update, the mod
clips it, and the server takes ``reply - request`` back. :data:`client_app` applies the mod only
to requests that carry a clipping norm (:func:`only_when_clipping`). The server-side noise of
central DP is not implemented here.

Usage::

    from fedtune.engines.flower import run_flower_simulation
    summary = run_flower_simulation(load_config("configs/fedit.toml"))   # Ray, one node per client
    # a loopback deployment: fedtune run RECIPE --set engine=flower (fedtune.engines.deployment)
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedtune.config import RunConfig
from fedtune.engines.deployment import ReapDescendants
from fedtune.engines.rounds import Delivery, Engine, RoundRecord, answer
from fedtune.errors import FedtuneError
from fedtune.process import setup_process
from fedtune.protocol.messages import Message
from fedtune.runtime import resolve_run

RECORD = "fedtune"  # RecordDict key of the ConfigRecord: meta and transport scalars
ARRAYS = "fedtune-arrays"  # RecordDict key of the ArrayRecord: the message's arrays
META = "meta"  # ConfigRecord key: JSON of Message.meta
CID = "cid"  # ConfigRecord key: the fedtune client id the message is for / from
ROUND = "round"  # ConfigRecord key: the round a message belongs to (request) or claims (reply)
ATTEMPT = "attempt"  # ConfigRecord key of a request: the round's attempt (fault injection draws)
PHASE = "phase"  # ConfigRecord key of a request: the Strategy phase it belongs to (sent as "train")
COMPUTE_S = "compute_s"  # ConfigRecord key of a reply: seconds the Client call took on the node
CLIENTS = "clients"  # ConfigRecord key of a query reply: the client ids the node plays
CLIPPING_NORM = "clipping_norm"  # ConfigRecord key read by Flower's clipping mods (KEY_CLIPPING_NORM)
AS_WEIGHTS = "update-as-weights"  # ConfigRecord key of a request: reply with received + update
STATE = "fedtune-state"  # context.state key prefix: f"{STATE}-{cid}" holds a client's state
BUNDLE = "fedtune-bundle"  # ConfigRecord of a bundle: CLIENTS (request); CLIENTS, errors, TIMES (reply)
TIMES = ("t-process", "t-enter", "t-exit")  # reply: ClientApp process start, handler entry and exit (epoch s)
TIMING_FILE = "flower_timing.jsonl"  # run folder: where the Flower engine's time went, per exchange

PARTITION_ID = "partition-id"  # node_config: the one client id a node plays (Flower's convention)
NODE_CLIENTS = "fedtune-clients"  # node_config: the client ids a node plays, "0-9" or "0,3,5-7"
NODE_WORKER = "fedtune-worker"  # node_config: Unix socket of the node's fedtune worker
NODE_THREADS = "fedtune-threads"  # node_config: torch threads of the node's training

ENGINE_KEYS = ("resume", "timeout", "clipping-norm")  # Flower run config keys for the ServerApp
POLL_S = 0.05  # seconds between two pulls of replies from the grid


class FlowerClientError(FedtuneError, RuntimeError):
    """A ClientApp failed (or never answered); names the client, its node, the round and kind."""

    def __init__(self, cid: int | None, node_id: int, rnd: int, kind: str, reason: str) -> None:
        who = f"client {cid}" if cid is not None else "a client"
        super().__init__(f"{who} (Flower node {node_id}) failed in round {rnd} ({kind}): {reason}")
        self.cid, self.node_id, self.round, self.kind, self.reason = cid, node_id, rnd, kind, reason


# -- conversion --------------------------------------------------------------------------------
def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Named arrays as an ArrayRecord (names, order, dtypes and shapes kept)."""
    return ArrayRecord({str(k): Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def from_array_record(record: ArrayRecord | None) -> dict[str, np.ndarray]:
    return {} if record is None else {k: record[k].numpy() for k in record}


state_to_record, state_from_record = to_array_record, from_array_record  # a client's persistent state


def pack(
    message: Message,
    cid: int,
    arrays: ArrayRecord | None = None,
    suffix: str = "",
    into: RecordDict | None = None,
    **extra: Any,
) -> tuple[RecordDict, int]:
    """Flower content carrying ``message`` for/from client ``cid`` (plus transport scalars such
    as ``compute_s``, not part of the accounted bytes) and the accounted bytes,
    ``message.nbytes``. ``arrays``: the message's ArrayRecord when already built (a broadcast);
    ``suffix``/``into``: add the records, their keys suffixed, to a bundle's content."""
    record = ConfigRecord({META: json.dumps(message.meta, separators=(",", ":")), CID: int(cid), **extra})
    content = RecordDict() if into is None else into
    content[ARRAYS + suffix] = to_array_record(message.arrays) if arrays is None else arrays
    content[RECORD + suffix] = record
    return content, message.nbytes


def unpack(content: RecordDict, suffix: str = "") -> tuple[int, Message, int]:
    """Inverse of :func:`pack`: (client id, message, accounted bytes ``message.nbytes``)."""
    if RECORD + suffix not in content or ARRAYS + suffix not in content:
        raise ValueError(
            f"Flower message carries no {RECORD + suffix!r} / {ARRAYS + suffix!r} records (keys: {sorted(content)})"
        )
    record = content[RECORD + suffix]
    message = Message(from_array_record(content[ARRAYS + suffix]), json.loads(record[META]))
    return int(record[CID]), message, message.nbytes


def parse_clients(text: str | int) -> list[int]:
    """``"0-3,7"`` -> [0, 1, 2, 3, 7] (node_config ``fedtune-clients``)."""
    out: list[int] = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi if hi else lo) + 1))
    return out


def format_clients(ids: Iterable[int]) -> str:
    """Inverse of :func:`parse_clients`: sorted ids as ranges, ``"0-3,7"``."""
    ids = sorted(set(ids))
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


# -- config from Flower's run config (deployment with `flwr run`) -------------------------------
def config_from_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """A RunConfig from Flower's run config (``flwr run -c ...``): ``recipe`` (a TOML path, may be
    empty), ``overrides`` (``"rounds=3; data.name=sst2"``, as ``fedtune run --set``) and dotted
    ``fedtune.<key> = value`` entries (``fedtune.rounds = 3``), applied in that order. The
    ServerApp's own keys (:data:`ENGINE_KEYS`) are read by :func:`make_server_app`."""
    from fedtune.config import ConfigError, apply_override, load_config
    from fedtune.config import RunConfig as Config

    overrides = [part.strip() for part in str(run_config.get("overrides", "")).split(";") if part.strip()]
    for key, value in run_config.items():
        if key.startswith("fedtune."):
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            overrides.append(f"{key.removeprefix('fedtune.')}={text}")
        elif key not in ("recipe", "overrides", "config", *ENGINE_KEYS):
            raise ConfigError(
                f"Flower run config {key!r}: expected 'recipe', 'config', 'overrides', 'fedtune.<key>' or one of {ENGINE_KEYS}"
            )
    if run_config.get("config"):  # a whole RunConfig as JSON: what fedtune submits (no path to share)
        if run_config.get("recipe"):
            raise ConfigError("Flower run config: give 'recipe' or 'config', not both")
        tree = json.loads(run_config["config"])
        for assignment in overrides:
            apply_override(tree, assignment)
        return Config.model_validate(tree)
    return load_config(run_config.get("recipe") or None, overrides)


# -- client side ---------------------------------------------------------------------------------
_CONTEXTS: dict[str, Any] = {}  # config JSON -> RunContext, one per process (a Ray actor, a worker)
_CONTEXTS_LOCK = threading.Lock()


def _process_context(config: RunConfig, threads: int | None = None):
    """This process's RunContext for ``config`` (built once: it caches the model and the data);
    ``train.threads``, else ``threads``, torch threads."""
    from fedtune.runtime import RunContext

    key = config.model_dump_json()
    with _CONTEXTS_LOCK:
        if key not in _CONTEXTS:
            setup_process(config.train.threads or threads)
            _CONTEXTS[key] = RunContext(config)
        return _CONTEXTS[key]


def serve_request(
    config: RunConfig,
    kind: str,
    cid: int,
    request: Message,
    state: dict,
    rnd: int,
    attempt: int,
    threads: int | None = None,
) -> tuple[Message, dict, float]:
    """Serve one request as client ``cid`` in this process: (reply, the client's new state,
    seconds of the Client call), through :func:`~fedtune.engines.rounds.answer` (fault
    injection, then ``fit`` or ``evaluate``), timed as the embedded engine times it."""
    client = _process_context(config, threads).client(cid, state)
    start = time.perf_counter()
    reply = answer(client, kind, request, config.seed, rnd, attempt)
    return reply, client.state, time.perf_counter() - start


def node_clients(context: Context) -> list[int]:
    """The client ids this node plays (``fedtune-clients`` or ``partition-id``)."""
    if NODE_CLIENTS in context.node_config:
        return parse_clients(context.node_config[NODE_CLIENTS])
    if PARTITION_ID in context.node_config:
        return [int(context.node_config[PARTITION_ID])]
    raise RuntimeError(
        f"node {context.node_id} has no node_config[{PARTITION_ID!r}] or [{NODE_CLIENTS!r}]: start the SuperNode "
        f'with --node-config "{PARTITION_ID}=<client id>" or \'{NODE_CLIENTS}="0-9"\''
    )


def _process_start() -> float:
    """This process's start (epoch s), to 10 ms on Linux (psutil rounds the boot time to 1 s)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return psutil.Process().create_time()


def handle_client_message(config: RunConfig | None, message: FlowerMessage, context: Context) -> FlowerMessage:
    """Answer one Flower message as the client it names (or, for a bundle, as each client it
    names, one after another): from the node's persistent state for that client, in this process
    (:func:`serve_request`) or in the node's worker (:func:`call_worker`). A failure propagates:
    Flower returns it to the server as an error reply (a drop); in a bundle, a failing client's
    reason is returned beside the others' replies. The reply carries the times of :data:`TIMES`
    (for :data:`TIMING_FILE`)."""
    entered = time.time()
    kind = message.metadata.message_type.split(".")[0]
    clients = node_clients(context)
    if kind == "query":  # the server's hello: which client ids does this node play?
        return FlowerMessage(RecordDict({RECORD: ConfigRecord({CLIENTS: clients})}), reply_to=message)
    if kind not in ("train", "evaluate"):
        raise ValueError(f"unexpected message type {message.metadata.message_type!r}")
    config = config if config is not None else config_from_run_config(context.run_config)
    if BUNDLE not in message.content:
        reply, extra = _serve_one(config, kind, message.content, "", clients, context)
        times = dict(zip(TIMES, (_process_start(), entered, time.time())))
        content, _ = pack(reply, int(message.content[RECORD][CID]), **extra, **times)
        return FlowerMessage(content, reply_to=message)
    cids = [int(c) for c in message.content[BUNDLE][CLIENTS]]
    content, errors = RecordDict(), {}
    for cid in cids:
        try:
            reply, extra = _serve_one(config, kind, message.content, f"-{cid}", clients, context)
            pack(reply, cid, suffix=f"-{cid}", into=content, **extra)
        except Exception as exc:  # noqa: BLE001 - this client is dropped, the others still answer
            errors[f"error-{cid}"] = f"{type(exc).__name__}: {exc}"
    times = dict(zip(TIMES, (_process_start(), entered, time.time())))
    content[BUNDLE] = ConfigRecord({CLIENTS: cids, **errors, **times})
    return FlowerMessage(content, reply_to=message)


def _serve_one(
    config: RunConfig, kind: str, content: RecordDict, suffix: str, clients: list[int], context: Context
) -> tuple[Message, dict]:
    """One client's request in ``content`` (keys suffixed with ``suffix``) served: (the reply,
    its transport scalars)."""
    cid, request, _ = unpack(content, suffix)
    if cid not in clients:
        raise RuntimeError(f"message for client {cid} reached a node that plays clients {format_clients(clients)}")
    envelope = content[RECORD + suffix]
    rnd, attempt = int(envelope.get(ROUND, 0)), int(envelope.get(ATTEMPT, 0))
    kind = str(envelope.get(PHASE, kind))  # a further exchange of the round travels as "train"
    state = from_array_record(context.state.get(f"{STATE}-{cid}"))
    threads = context.node_config.get(NODE_THREADS)
    worker = context.node_config.get(NODE_WORKER)
    if worker:
        reply, state, seconds = call_worker(str(worker), config, kind, cid, request, state, rnd, attempt)
    else:
        reply, state, seconds = serve_request(config, kind, cid, request, state, rnd, attempt, threads and int(threads))
    context.state[f"{STATE}-{cid}"] = to_array_record(state)
    if envelope.get(AS_WEIGHTS):  # for Flower's clipping mods: received + update (the server subtracts)
        if list(reply.arrays) != list(request.arrays):
            raise ValueError(f"{AS_WEIGHTS}: the reply's arrays {list(reply.arrays)[:3]} are not the request's")
        reply = Message({k: request.arrays[k] + v for k, v in reply.arrays.items()}, reply.meta)
    return reply, {COMPUTE_S: seconds, ROUND: rnd}


def only_when_clipping(mod: Callable) -> Callable:
    """Flower ``mod`` (``fixedclipping_mod``) applied only to requests whose ConfigRecord carries
    ``clipping_norm``; every other message passes untouched (the mod would reject them)."""

    def wrapped(message: FlowerMessage, context: Context, call_next: Callable) -> FlowerMessage:
        record = message.content.config_records.get(RECORD) if message.has_content() else None
        if record is not None and CLIPPING_NORM in record:
            return mod(message, context, call_next)
        return call_next(message, context)

    wrapped.__name__ = f"only_when_clipping({getattr(mod, '__name__', mod)})"
    return wrapped


def make_client_app(config: RunConfig | None = None, mods: Iterable[Callable] = ()) -> ClientApp:
    """A ClientApp playing the clients of its node (``fedtune-clients`` or ``partition-id``) for
    ``config`` (default: the config from Flower's run config, :func:`config_from_run_config`),
    with Flower ``mods`` around it."""
    app = ClientApp(mods=list(mods))

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


# -- the node's long-lived worker ----------------------------------------------------------------
def _worker_key(address: str) -> bytes:
    return Path(f"{address}.key").read_bytes()


def call_worker(
    address: str, config: RunConfig, kind: str, cid: int, request: Message, state: dict, rnd: int, attempt: int
) -> tuple[Message, dict, float]:
    """:func:`serve_request` in the worker listening on the Unix socket ``address`` (authenticated
    with the key in ``<address>.key``); its failure is raised here with the worker's reason."""
    from multiprocessing.connection import Client as Connection

    payload = {
        "config": config.model_dump_json(),
        "kind": kind,
        "cid": cid,
        "request": request.encode(),
        "state": dict(state),
        "round": rnd,
        "attempt": attempt,
    }
    try:
        with Connection(address, family="AF_UNIX", authkey=_worker_key(address)) as conn:
            conn.send(payload)
            result = conn.recv()
    except (OSError, EOFError) as exc:
        raise RuntimeError(f"fedtune worker at {address} unreachable ({type(exc).__name__}: {exc})") from None
    if result.get("error"):
        raise RuntimeError(result["error"])
    return Message.decode(result["reply"]), result["state"], float(result["seconds"])


def run_worker(address: str, threads: int | None = None, ready: Callable[[], None] | None = None) -> None:
    """Serve :func:`call_worker` requests on the Unix socket ``address``, one at a time, forever:
    one RunContext per config, built on first use and kept (model, tokenized data). The socket's
    key is written to ``<address>.key`` (mode 0600); only this user's processes can read it."""
    import secrets
    from multiprocessing.connection import Listener

    from fedtune.config import RunConfig as Config

    setup_process(threads)
    import peft  # noqa: F401

    import fedtune.runtime  # noqa: F401 - torch, transformers, PEFT: imported before the first request

    key_path = Path(f"{address}.key")
    key_path.unlink(missing_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    Path(address).unlink(missing_ok=True)
    with Listener(address, family="AF_UNIX", authkey=key_path.read_bytes()) as listener:
        if ready is not None:
            ready()
        while True:
            try:
                conn = listener.accept()
            except Exception:  # noqa: BLE001 - a caller with the wrong key, or one that went away
                continue
            with conn:
                try:
                    job = conn.recv()
                    config = Config.model_validate_json(job["config"])
                    reply, state, seconds = serve_request(
                        config,
                        job["kind"],
                        job["cid"],
                        Message.decode(job["request"]),
                        job["state"],
                        job["round"],
                        job["attempt"],
                        threads,
                    )
                    result = {"reply": reply.encode(), "state": state, "seconds": seconds}
                except Exception as exc:  # noqa: BLE001 - returned to the ClientApp, which reports it
                    result = {"error": f"{type(exc).__name__}: {exc}"}
                try:
                    conn.send(result)
                except (OSError, EOFError):
                    pass


# -- server side ---------------------------------------------------------------------------------
def exchange(
    grid: Grid,
    messages: list[FlowerMessage],
    timeout: float | None,
    poll_s: float = POLL_S,
    pulled_at: dict[str, float] | None = None,
) -> tuple[list[str], list[FlowerMessage]]:
    """Push ``messages`` and pull their replies every ``poll_s`` seconds until all arrived or
    ``timeout`` seconds passed (Grid's public push/pull; its ``send_and_receive`` waits 3 s
    between pulls). Returns the pushed message ids (in order) and the replies; ``pulled_at``
    receives each reply's arrival time (epoch s) by the id of the message it answers."""
    ids = list(grid.push_messages(messages))
    pending = set(ids)
    deadline = None if timeout is None else time.monotonic() + timeout
    replies: list[FlowerMessage] = []
    while pending:
        got = list(grid.pull_messages(list(pending)))
        if pulled_at is not None:
            now = time.time()
            pulled_at.update((reply.metadata.reply_to_message_id, now) for reply in got)
        replies.extend(got)
        pending.difference_update(reply.metadata.reply_to_message_id for reply in got)
        if not pending or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(poll_s)
    return ids, replies


def discover_nodes(grid: Grid, num_clients: int, timeout: float | None = None) -> dict[int, int]:
    """Client id -> Flower node id, from the client ids each connected node reports; asks new
    nodes as they connect until every client id 0..N-1 has one (or ``timeout`` seconds)."""
    start, asked, node_of = time.monotonic(), set(), {}
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            asked.update(new)
            hello = [
                FlowerMessage(RecordDict({RECORD: ConfigRecord({})}), dst_node_id=n, message_type="query", group_id="0")
                for n in new
            ]
            left = None if timeout is None else max(1.0, timeout - (time.monotonic() - start))
            for reply in exchange(grid, hello, left)[1]:
                nid = reply.metadata.src_node_id
                if reply.has_error():
                    raise FlowerClientError(None, nid, 0, "query", reply.error.reason)
                for pid in reply.content[RECORD][CLIENTS]:
                    if not 0 <= pid < num_clients:
                        raise RuntimeError(
                            f"Flower node {nid} plays client {pid}; expected 0..{num_clients - 1} (federation.num_clients)"
                        )
                    if pid in node_of:
                        raise RuntimeError(f"client {pid} is played by two Flower nodes ({node_of[pid]} and {nid})")
                    node_of[pid] = nid
        if len(node_of) == num_clients:
            return node_of
        if timeout is not None and time.monotonic() - start > timeout:
            missing = format_clients(set(range(num_clients)) - node_of.keys())
            raise TimeoutError(
                f"{len(asked)} Flower nodes connected after {timeout:.0f} s; none plays clients {missing}"
            )
        time.sleep(0.2)


class GridTransport:
    """Send a round's messages through a Flower Grid in one batch and collect the replies; a
    client that fails (an error reply) or does not answer within ``timeout`` seconds is a failed
    :class:`~fedtune.engines.rounds.Delivery` (dropped by the round loop). ``request_config``
    entries go into every training request's ConfigRecord (``clipping_norm`` for Flower's
    clipping mods, which also sets ``update-as-weights``; see the module docstring). ``bundle``:
    a node's clients of one exchange travel in one Flower message."""

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
        if CLIPPING_NORM in self.request_config:
            self.request_config[AS_WEIGHTS] = True

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
                        records[id(message)] = to_array_record(message.arrays)
                    suffix = f"-{cid}" if len(group) > 1 else ""
                    _, down[cid] = pack(
                        message, cid, records[id(message)], suffix, content, **{ROUND: rnd, ATTEMPT: attempt, **extra}
                    )
                if len(group) > 1:
                    content[BUNDLE] = ConfigRecord({CLIENTS: group})
                out.append(FlowerMessage(content, dst_node_id=nid, message_type=wire, group_id=str(rnd)))
                targets.append(group)
        pushed, pulled_at = time.time(), {}
        ids, replies = exchange(self.grid, out, self.timeout, pulled_at=pulled_at)
        target_of = dict(zip(ids, targets))  # request id -> the client ids it carried
        self._log_timing(kind, rnd, attempt, pushed, replies, target_of, pulled_at)
        received: dict[int, Delivery] = {}
        for reply in replies:
            group = target_of.get(reply.metadata.reply_to_message_id)
            if group is None:
                continue  # not a reply to this batch: ignore
            for cid in group:
                received[cid] = self._delivery(
                    reply, cid, "" if len(group) == 1 else f"-{cid}", messages[cid], down[cid], extra
                )
        # in configure order: aggregation sums in dict order, as the embedded engine does
        return {
            cid: received.get(cid) or Delivery(None, down[cid], error=f"no reply within {self.timeout} s")
            for cid in messages
        }

    @staticmethod
    def _delivery(reply: FlowerMessage, cid: int, suffix: str, sent: Message, down: int, extra: Mapping) -> Delivery:
        """Client ``cid``'s answer in ``reply`` (its records suffixed with ``suffix`` in a bundle)."""
        if reply.has_error():
            return Delivery(None, down, error=f"client error: {reply.error.reason}")
        if suffix and BUNDLE in reply.content and f"error{suffix}" in reply.content[BUNDLE]:
            return Delivery(None, down, error=f"client error: {reply.content[BUNDLE][f'error{suffix}']}")
        try:
            sender, message, up = unpack(reply.content, suffix)
            if extra.get(AS_WEIGHTS):  # received + clipped update -> the (clipped) update
                message = Message({k: v - sent.arrays[k] for k, v in message.arrays.items()}, message.meta)
            record = reply.content[RECORD + suffix]
            return Delivery(message, down, up, float(record.get(COMPUTE_S, 0.0)), sender, int(record.get(ROUND, -1)))
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
            head = reply.content.config_records.get(BUNDLE if len(group) > 1 else RECORD)
            if head is None or not all(key in head for key in TIMES):
                continue
            t_process, t_enter, t_exit = (float(head[key]) for key in TIMES)
            records = [reply.content.config_records.get(RECORD + (f"-{c}" if len(group) > 1 else "")) for c in group]
            messages["+".join(map(str, group))] = {
                "dispatch_s": round(t_process - pushed, 4),
                "startup_s": round(t_enter - t_process, 4),
                "handler_s": round(t_exit - t_enter, 4),
                "compute_s": round(sum(float(r.get(COMPUTE_S, 0.0)) for r in records if r is not None), 4),
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


class FlowerEngine(Engine):
    """Rounds over a Flower Grid: nodes are discovered on first use (:func:`discover_nodes`);
    client state lives on the nodes (``context.state``), not in the server's checkpoint."""

    name = "flower"

    def __init__(
        self,
        config: RunConfig,
        grid: Grid,
        timeout: float | None = None,
        request_config: Mapping[str, Any] | None = None,
        resume: bool = False,
    ) -> None:
        super().__init__(config)
        self.grid, self.timeout, self.request_config, self.resume = grid, timeout, request_config, resume
        self._transport = None

    def transport(self) -> GridTransport:
        if self._transport is None:
            fed = self.config.federation
            node_of = discover_nodes(self.grid, fed.num_clients, self.timeout)
            timing = resolve_run(self.config).run_dir / TIMING_FILE
            if not self.resume:
                timing.unlink(missing_ok=True)
            self._transport = GridTransport(
                self.grid, node_of, fed.round_timeout_s or self.timeout, self.request_config, timing
            )
        return self._transport


def serve(
    grid: Grid,
    config: RunConfig,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
    request_config: Mapping[str, Any] | None = None,
) -> dict:
    """Run ``config``'s method over ``grid`` and write the run folder exactly as the embedded
    engine does (:func:`fedtune.run.run_experiment`, summary marked ``"engine": "flower"``)."""
    from fedtune.run import run_experiment

    setup_process(config.train.threads)
    engine = FlowerEngine(config, grid, timeout, request_config, resume)
    return run_experiment(config, on_round, on_start, engine=engine, resume=resume)


def make_server_app(
    config: RunConfig | None = None,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
) -> ServerApp:
    """A ServerApp running ``config`` (default: from Flower's run config) with :func:`serve`;
    ``timeout`` bounds the wait for nodes and for each round's replies (None: wait forever).
    From Flower's run config it also reads ``resume`` (continue the run folder), ``timeout``
    (seconds, 0: none) and ``clipping-norm`` (> 0: ask the nodes' clipping mods for it)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        rc = context.run_config
        run_config = config if config is not None else config_from_run_config(rc)
        wait = timeout if "timeout" not in rc else (float(rc["timeout"]) or None)
        clip = float(rc.get("clipping-norm", 0) or 0)
        serve(
            grid,
            run_config,
            wait,
            on_round,
            on_start,
            resume=resume or bool(rc.get("resume", False)),
            request_config={CLIPPING_NORM: clip} if clip > 0 else None,
        )

    return app


def _deployment_client_app() -> ClientApp:
    from flwr.clientapp.mod import fixedclipping_mod

    return make_client_app(mods=[only_when_clipping(fixedclipping_mod)])


#: Module-level apps for deployment (``flwr run``): the run config comes from Flower's run config;
#: the client app clips updates when the server asks (``clipping-norm``).
server_app = make_server_app()
client_app = _deployment_client_app()


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
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
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
    with ReapDescendants():
        try:
            run_simulation(
                make_server_app(config, timeout, on_round, on_start, resume),
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
