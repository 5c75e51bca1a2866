"""The client side on Flower: the ClientApp that answers a request as the fedtune client it names
(in this process or in the node's worker), and the node's clients."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from flwr.app import ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp

from fedtune.config import RunConfig
from fedtune.engines.flower.codec import (
    AS_WEIGHTS,
    ATTEMPT,
    BUNDLE,
    CID,
    CLIENTS,
    CLIPPING_NORM,
    COMPUTE_S,
    NODE_CLIENTS,
    NODE_THREADS,
    NODE_WORKER,
    PARTITION_ID,
    PHASE,
    RECORD,
    ROUND,
    STATE,
    TIMES,
    format_clients,
    from_array_record,
    pack,
    parse_clients,
    to_array_record,
    unpack,
)
from fedtune.engines.flower.runconfig import config_from_run_config
from fedtune.engines.flower.worker import call_worker, serve_request
from fedtune.protocol.messages import Message


# -- client side ---------------------------------------------------------------------------------
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


def _deployment_client_app() -> ClientApp:
    from flwr.clientapp.mod import fixedclipping_mod

    return make_client_app(mods=[only_when_clipping(fixedclipping_mod)])


#: The module-level ClientApp of deployments (``flwr run``): the run config comes from Flower's run
#: config; it clips updates when the server asks (``clipping-norm``).
client_app = _deployment_client_app()
