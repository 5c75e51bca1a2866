"""A node's long-lived fedtune worker: it keeps the task's model and data warm, and the ClientApp
process (started by Flower per message) hands it the request over a Unix socket."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedtune.config import RunConfig
from fedtune.engines.flower.codec import sends_compute_s
from fedtune.engines.rounds import answer
from fedtune.process import setup_process
from fedtune.protocol.messages import Message

if TYPE_CHECKING:
    from fedtune.runtime import RunContext

State = dict[str, np.ndarray]  # a client's persistent state (Client.state)

# -- the node's long-lived worker ----------------------------------------------------------------
_CONTEXTS: dict[str, RunContext] = {}  # config JSON -> RunContext, one per process (a Ray actor, a worker)
_CONTEXTS_LOCK = threading.Lock()


def _process_context(config: RunConfig, threads: int | None = None) -> RunContext:
    """This process's RunContext for ``config`` (resolved and built once per process: it caches the
    model and the data); ``train.threads``, else ``threads``, torch threads."""
    from fedtune.runtime import RunContext, resolve_run

    key = config.model_dump_json()
    with _CONTEXTS_LOCK:
        if key not in _CONTEXTS:
            setup_process(config.train.threads or threads)
            _CONTEXTS[key] = RunContext(resolve_run(config))
        return _CONTEXTS[key]


def serve_request(
    config: RunConfig,
    kind: str,
    cid: int,
    request: Message,
    state: State,
    rnd: int,
    attempt: int,
    threads: int | None = None,
) -> tuple[Message, State, float]:
    """Serve one ``kind`` request of round ``rnd`` (try ``attempt``) of the run ``config`` as client
    ``cid`` with its ``state``, in this process (``threads``: as :func:`run_worker`'s): (reply, the
    client's new state, seconds of the Client call), through :func:`~fedtune.engines.rounds.answer`
    (fault injection, then ``fit`` or ``evaluate``), timed as the embedded engine times it. Where the
    reply carries no seconds (local DP, SecAgg+), a call slower than the round's or the client's
    deadline raises :class:`DeadlineMissed` instead (the client's state of that call is not kept)."""
    client = _process_context(config, threads).client(cid, state)
    start = time.perf_counter()
    reply = answer(client, kind, request, config.seed, rnd, attempt)
    seconds = time.perf_counter() - start
    if not sends_compute_s(config):  # the server cannot time this client (local DP, SecAgg+): the node does
        limits = [s for s in (config.federation.round_timeout_s, client.profile.deadline_s) if s]
        if limits and seconds > min(limits):
            raise DeadlineMissed(f"missed its {min(limits):g} s deadline")  # the seconds stay on the node
    return reply, client.state, seconds


class DeadlineMissed(RuntimeError):
    """A client slower than ``federation.round_timeout_s`` or its ``deadline_s``, found by its own
    node where the reply carries no seconds (:func:`~fedtune.engines.flower.codec.sends_compute_s`):
    the request fails, so the server drops the client as the embedded engine does, without learning
    how long it took."""


def _worker_key(address: str) -> bytes:
    return Path(f"{address}.key").read_bytes()


def call_worker(
    address: str, config: RunConfig, kind: str, cid: int, request: Message, state: State, rnd: int, attempt: int
) -> tuple[Message, State, float]:
    """:func:`serve_request` in the worker listening on the Unix socket ``address`` (authenticated
    with the key in ``<address>.key``), with the same ``config``, ``kind``, ``cid``, ``request``,
    ``state``, ``rnd`` and ``attempt``; its failure is raised here with the worker's reason."""
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
    key is written to ``<address>.key`` (mode 0600); only this user's processes can read it.
    ``threads``: torch threads (a config's ``train.threads`` first); ``ready``: called once listening."""
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
