"""The client side on Flower: the ClientApp that answers a request as the fedtune client it names
(in this process: a node's executor, or a process Flower started for the message), and the node's
clients."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from fedtune.config import RunConfig
from fedtune.engines.flower.budgets import report_entry, request_budget
from fedtune.engines.flower.codec import (
    AS_WEIGHTS,
    ATTEMPT,
    BUNDLE,
    CID,
    CLIENTS,
    CLIPPING_NORM,
    COMPUTE_S,
    META,
    NODE_CLIENTS,
    NODE_THREADS,
    PARTITION_ID,
    PHASE,
    RECORD,
    ROUND,
    STATE,
    TIMES,
    compact_bundle,
    expand_bundle,
    format_clients,
    from_array_record,
    keeps_timing,
    pack,
    parse_clients,
    sends_compute_s,
    to_array_record,
    unpack,
)
from fedtune.engines.flower.runconfig import config_from_run_config
from fedtune.engines.flower.worker import serve_request
from fedtune.methods.base.privacy import fresh_secret
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SECURE_WEIGHT

CallNext = Callable[[FlowerMessage, Context], FlowerMessage]  # the rest of a ClientApp's chain
Mod = Callable[[FlowerMessage, Context, CallNext], FlowerMessage]  # a Flower client mod


# -- client side ---------------------------------------------------------------------------------
def node_clients(context: Context) -> list[int]:
    """The client ids the node of ``context`` plays (``fedtune-clients`` or ``partition-id``)."""
    node_config: Mapping[str, Any] = context.node_config
    if NODE_CLIENTS in node_config:
        return parse_clients(node_config[NODE_CLIENTS])
    if PARTITION_ID in node_config:
        return [int(node_config[PARTITION_ID])]
    raise RuntimeError(
        f"node {context.node_id} has no node_config[{PARTITION_ID!r}] or [{NODE_CLIENTS!r}]: start the SuperNode "
        f'with --node-config "{PARTITION_ID}=<client id>" or \'{NODE_CLIENTS}="0-9"\''
    )


def _process_start() -> float:
    """When this process took the message (epoch s): a node executor's claim of its task
    (:mod:`.executor`), else this process's start (a ``flwr-clientapp`` process per message), to
    10 ms on Linux (psutil rounds the boot time to 1 s)."""
    from fedtune.engines.flower.runtime_api import task_claimed_at

    if task_claimed_at[0] is not None:
        return task_claimed_at[0]
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        created: float = psutil.Process().create_time()
        return created


def handle_client_message(config: RunConfig | None, message: FlowerMessage, context: Context) -> FlowerMessage:
    """Answer one Flower ``message`` as the client it names (or, for a bundle, as each client it
    names, one after another) of the run ``config`` (None: the one in Flower's run config), from the
    node's persistent state for that client (in ``context``), in this process
    (:func:`serve_request`: a node's executor, or a ``flwr-clientapp`` process). A failure propagates:
    Flower returns it to the server as an error reply (a drop); in a bundle, a failing client's
    reason is returned beside the others' replies. The reply carries the times of :data:`TIMES`
    (for :data:`TIMING_FILE`) only where the server keeps that file (:func:`keeps_timing`: not under
    DP or SecAgg+)."""
    entered = time.time()
    kind = message.metadata.message_type.split(".")[0]
    clients = node_clients(context)
    if kind == "query":  # the server's hello: which client ids does this node play, on what budget?
        return FlowerMessage(
            RecordDict({RECORD: ConfigRecord({CLIENTS: clients, **report_entry(context)})}), reply_to=message
        )
    if kind not in ("train", "evaluate"):
        raise ValueError(f"unexpected message type {message.metadata.message_type!r}")
    config = config if config is not None else config_from_run_config(context.run_config)
    if BUNDLE not in message.content:
        reply, extra = _serve_one(config, kind, message.content, "", clients, context)
        times = _times(config, entered)
        record: Mapping[str, Any] = message.content[RECORD]
        secure = RECORD_KEY_CONFIGS in message.content.config_records  # SecAgg+: the update crosses masked
        content, _ = pack(reply, int(record[CID]), (ArrayRecord(), "[]") if secure else None, **extra, **times)
        if secure:  # the mod masks fitres.parameters and clears every ArrayRecord
            _as_fit_res(content, json.loads(record[META]), reply)
        return FlowerMessage(content, reply_to=message)
    requests = expand_bundle(message.content)
    cids = [int(c) for c in cast(list[int], requests[BUNDLE][CLIENTS])]
    content, errors = RecordDict(), dict[str, str]()
    for cid in cids:
        try:
            reply, extra = _serve_one(config, kind, requests, f"-{cid}", clients, context)
            pack(reply, cid, suffix=f"-{cid}", into=content, **extra)
        except Exception as exc:  # noqa: BLE001 - this client is dropped, the others still answer
            errors[f"error-{cid}"] = f"{type(exc).__name__}: {exc}"
    content[BUNDLE] = ConfigRecord({CLIENTS: cids, **errors, **_times(config, entered)})
    return FlowerMessage(compact_bundle(content), reply_to=message)


def _times(config: RunConfig, entered: float) -> dict[str, Any]:
    """A reply's :data:`TIMES` (this process's start, ``entered`` the handler, now), or none where the
    server keeps no timing file (:func:`keeps_timing`)."""
    return dict(zip(TIMES, (_process_start(), entered, time.time()))) if keeps_timing(config) else {}


def _serve_one(
    config: RunConfig, kind: str, content: RecordDict, suffix: str, clients: list[int], context: Context
) -> tuple[Message, dict[str, Any]]:
    """One client's request in ``content`` (keys suffixed with ``suffix``) served: (the reply,
    its transport scalars)."""
    cid, request, _ = unpack(content, suffix)
    if cid not in clients:
        raise RuntimeError(f"message for client {cid} reached a node that plays clients {format_clients(clients)}")
    envelope: Mapping[str, Any] = content[RECORD + suffix]
    rnd, attempt = int(envelope.get(ROUND, 0)), int(envelope.get(ATTEMPT, 0))
    kind = str(envelope.get(PHASE, kind))  # a further exchange of the round travels as "train"
    state = from_array_record(cast(ArrayRecord | None, context.state.get(f"{STATE}-{cid}")))
    node_config: Mapping[str, Any] = context.node_config
    threads = node_config.get(NODE_THREADS)
    budget = request_budget(context, envelope)  # the node's own budget and the request's setting
    threads = threads and int(threads)
    reply, state, seconds = serve_request(config, kind, cid, request, state, rnd, attempt, threads, budget)
    context.state[f"{STATE}-{cid}"] = to_array_record(state)
    if envelope.get(AS_WEIGHTS):  # for Flower's clipping mods: received + update (the server subtracts)
        if list(reply.arrays) != list(request.arrays):
            raise ValueError(f"{AS_WEIGHTS}: the reply's arrays {list(reply.arrays)[:3]} are not the request's")
        reply = Message({k: request.arrays[k] + v for k, v in reply.arrays.items()}, reply.meta)
    return reply, ({COMPUTE_S: seconds} if sends_compute_s(config) else {}) | {ROUND: rnd}


def _as_fit_res(content: RecordDict, request_meta: dict[str, Any], reply: Message) -> None:
    """Add to ``content`` the legacy FitRes records Flower's ``secaggplus_mod`` reads: the
    update's ArrayRecord (the mod then clears every ArrayRecord: the arrays cross masked) and,
    as ``num_examples``, the weight the strategy asked for (``secure_weight``: the client's
    ``num_examples``, or 1)."""
    weight = int(reply.meta["num_examples"]) if request_meta.get(SECURE_WEIGHT) == "examples" else 1
    content["fitres.parameters"] = to_array_record(reply.arrays)  # one Array each, as secure_layout
    content["fitres.num_examples"] = MetricRecord({"num_examples": weight})
    content["fitres.metrics"] = ConfigRecord({})
    content["fitres.status"] = ConfigRecord({"code": 0, "message": "Success"})


def only_when_secure(mod: Mod, config: RunConfig | None = None) -> Mod:
    """Flower ``mod`` (``secaggplus_mod``) applied only to requests that carry SecAgg+'s config
    record; every other message passes untouched. The mod's stochastic rounding draws from numpy's
    global generator: seeded here for the call (and restored afterwards) by :func:`rounding_seed`.
    A setup stage whose quantization is coarser than the run's worst round is refused
    (:func:`check_setup`): the client's clip margin was computed for that step."""

    def wrapped(message: FlowerMessage, context: Context, call_next: CallNext) -> FlowerMessage:
        if not message.has_content() or RECORD_KEY_CONFIGS not in message.content.config_records:
            return call_next(message, context)
        envelope: Mapping[str, Any] | None = message.content.config_records.get(RECORD)
        if envelope is not None and int(envelope[CID]) not in node_clients(context):
            raise RuntimeError(f"SecAgg+ message for client {envelope[CID]} reached a node that does not play it")
        run = config if config is not None else config_from_run_config(context.run_config)
        check_setup(run, message.content.config_records[RECORD_KEY_CONFIGS])
        saved = np.random.get_state()
        np.random.seed(rounding_seed(run, envelope))
        try:
            return mod(message, context, call_next)
        finally:
            np.random.set_state(saved)

    wrapped.__name__ = f"only_when_secure({getattr(mod, '__name__', mod)})"
    return wrapped


def rounding_seed(run: RunConfig, envelope: Mapping[str, Any] | None) -> int | np.ndarray:
    """The seed of one SecAgg+ message's stochastic rounding (``envelope``: its fedtune envelope,
    naming round, client and attempt) for ``run``. Under ``privacy.mode``: 128 bits of
    fresh OS entropy (:func:`~fedtune.methods.base.privacy.fresh_secret`), so nobody can know or
    repeat a client's rounding and two runs of one config round differently (its error is then
    independent of everything public); with ``privacy.insecure_reproducible_noise`` (tests only)
    and without DP: one word from (run seed, round, client, attempt), so a run is reproducible."""
    if run.privacy.mode != "none" and not run.privacy.insecure_reproducible_noise:
        return fresh_secret()
    words = [run.seed, *(int(envelope.get(k, 0)) for k in (ROUND, CID, ATTEMPT))] if envelope else [run.seed]
    return int(np.random.SeedSequence([*words, 0x5EC]).generate_state(1)[0])


def check_setup(run: RunConfig, record: Mapping[str, Any]) -> None:
    """Refuse (ValueError) a SecAgg+ setup ``record`` whose quantization step 2c/T exceeds the
    run's worst (:meth:`~fedtune.config.SecureAggregationConfig.step`); other stages pass."""
    if record.get(Key.STAGE) != Stage.SETUP:
        return
    step = 2 * float(record[Key.CLIPPING_RANGE]) / int(record[Key.TARGET_RANGE])
    worst = run.secure_aggregation.step(run.federation.num_clients)
    if not step <= worst * (1 + 1e-12):
        raise ValueError(
            f"SecAgg+ setup: quantization step {step:.3g} is coarser than this run's worst {worst:.3g} "
            "(secure_aggregation.clipping_range / quantization_range)"
        )


def only_when_clipping(mod: Mod) -> Mod:
    """Flower ``mod`` (``fixedclipping_mod``) applied only to requests whose ConfigRecord carries
    ``clipping_norm``; every other message passes untouched (the mod would reject them)."""

    def wrapped(message: FlowerMessage, context: Context, call_next: CallNext) -> FlowerMessage:
        record = message.content.config_records.get(RECORD) if message.has_content() else None
        if record is not None and CLIPPING_NORM in record:
            return mod(message, context, call_next)
        return call_next(message, context)

    wrapped.__name__ = f"only_when_clipping({getattr(mod, '__name__', mod)})"
    return wrapped


def make_client_app(config: RunConfig | None = None, mods: Iterable[Mod] = ()) -> ClientApp:
    """A ClientApp playing the clients of its node (``fedtune-clients`` or ``partition-id``) for
    ``config`` (default: the config from Flower's run config, :func:`config_from_run_config`),
    with Flower ``mods`` around it, inside Flower's ``secaggplus_mod`` for the requests of secure
    aggregation (:func:`only_when_secure`; :mod:`.secagg`)."""
    from flwr.client.mod import secaggplus_mod

    app = ClientApp(mods=[only_when_secure(secaggplus_mod, config), *mods])

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

    @app.query("standby")
    def standby(message: FlowerMessage, context: Context) -> FlowerMessage:
        return FlowerMessage(RecordDict(), reply_to=message)  # keeps the SuperNode awake (.standby)

    return app


def _deployment_client_app() -> ClientApp:
    from flwr.clientapp.mod import fixedclipping_mod

    return make_client_app(mods=[only_when_clipping(fixedclipping_mod)])


#: The module-level ClientApp of deployments (``flwr run``): the run config comes from Flower's run
#: config; it clips updates when the server asks (``clipping-norm``).
client_app = _deployment_client_app()
