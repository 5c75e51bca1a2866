"""The embedded engine's clients spread over several devices: one worker process per device.

:class:`DevicePool` is a transport (:data:`~fedtune.engines.rounds.Transport`) with the
semantics of :class:`~fedtune.engines.local.LocalTransport`, served by ``spawn``-ed worker
processes (a fresh interpreter each: torch's global RNG, which clients seed per request, is
per process; threads would race on it). Worker ``w`` builds its own
:class:`~fedtune.runtime.RunContext` for the run's config with ``device = devices[w]``: one
frozen base per process, on that device. A request's messages are dealt to the workers by
:func:`assignment` (sorted client ids, round-robin); each worker serves its share in order
through ``LocalTransport.deliver`` (the same encode / decode, the same bytes accounted) and
sends back each client's :class:`~fedtune.engines.rounds.Delivery` as it finishes. The client
states live here, in the parent: a client's state goes with its request and is replaced only
when it answers. A worker that dies fails the deliveries it still owed, with a reason naming its
device, and is started again on the next call; :meth:`DevicePool.close` stops every worker by
its own handle (the embedded engine calls it when the run ends or fails).

Torch threads: each worker runs ``train.threads`` when given, else this process's torch thread
count divided by the number of workers (at least 1).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from fedtune.config import RunConfig
from fedtune.engines.local import LocalTransport
from fedtune.engines.rounds import Delivery
from fedtune.protocol.messages import Message

if TYPE_CHECKING:
    from fedtune.runtime import RunContext


def client_devices(config: RunConfig) -> list[str]:
    """The devices the embedded engine's clients spread over in ``config``: ``placement.client_devices``
    (each must exist here, else one line naming the option); by default every visible CUDA device
    when ``device`` is ``cuda`` or ``auto`` and there are two or more; else ``[]`` (the clients
    run in the server's process)."""
    import torch

    from fedtune.models.precision import resolve_device

    given = config.placement.client_devices
    if given is None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] if config.device in ("cuda", "auto") and count > 1 else []
    for name in given:
        resolve_device(name, "placement.client_devices")
    return list(given)


def assignment(client_ids: list[int], workers: int) -> list[list[int]]:
    """Worker ``w``'s share of a request: ``sorted(client_ids)[w::workers]``, each client once."""
    ordered = sorted(client_ids)
    return [ordered[w::workers] for w in range(workers)]


def worker_config(config: RunConfig, device: str) -> RunConfig:
    """A worker's config: the run's, computing on ``device`` (and spreading nothing further)."""
    placement = config.placement.model_copy(update={"client_devices": None})
    return config.model_copy(update={"device": device, "placement": placement})


def client_context(config: RunConfig) -> RunContext:
    """A worker's :class:`~fedtune.runtime.RunContext` (its own base; ``config`` resolved once in
    the worker's process: its device is the worker's, not the run's), the worker's current CUDA
    device set to ``config.device`` (so code naming plain ``cuda`` stays on it). Its data and, for
    a LoRA method, the bases its clients train on (:meth:`~fedtune.runtime.RunContext.base_for`:
    the run's only where a client the plan keeps trains on it) are loaded here, before the first
    request, as the server's are before the first round in one process: a client's compute time
    does not hold the worker's start."""
    import torch

    from fedtune.runtime import RunContext, resolve_run

    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    context = RunContext(resolve_run(config))
    context.partitions  # noqa: B018 - loads the task's data
    if "lora" in context.method.requires:
        excluded = context.plan.excluded if context.plan is not None else {}
        for fmt in dict.fromkeys(context.base_format(p) for c, p in enumerate(context.profiles) if c not in excluded):
            context.base_for(*fmt)  # builds the base on the device
        import peft  # noqa: F401 - imported by the first adapter's activation (seconds), else inside a fit
    return context


def _serve(conn: Connection, config: RunConfig, threads: int, make_context: Callable[[RunConfig], RunContext]) -> None:
    """A worker's loop: requests ``(kind, rnd, attempt, [(cid, message, state), ...])`` in, one
    ``(cid, delivery, state)`` out per client as it finishes; ``None`` (or the parent gone) ends it."""
    import signal

    from fedtune.process import setup_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    setup_process(threads)
    broken = None
    try:
        local = LocalTransport(make_context(config).client, config.seed)
    except Exception as exc:  # noqa: BLE001 - reported as every request's failure
        broken = f"worker on device {config.device!r} could not start ({type(exc).__name__}: {exc})"
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        kind, rnd, attempt, jobs = request
        for cid, message, state in jobs:
            if broken is not None:
                conn.send((cid, Delivery(None, message.nbytes, error=broken), None))
                continue
            local.states = {cid: state}
            got = local.deliver(kind, rnd, cid, message, attempt)
            conn.send((cid, got, local.states[cid]))


@dataclass
class _Worker:
    device: str
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the worker to end, then kill it by its handle if it has not within ``grace_s``."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()

    def death(self) -> str:
        self.process.join(5)
        code = self.process.exitcode
        how = f" (exit code {code})" if code is not None else ""
        return f"worker process on device {self.device!r} (pid {self.process.pid}) died{how}"


def _stop_all(workers: list[_Worker | None]) -> None:
    for w, worker in enumerate(workers):
        if worker is not None:
            worker.stop()
            workers[w] = None


class DevicePool:
    """Clients served by one worker process per device (see the module docstring); ``states``
    as :attr:`LocalTransport.states <fedtune.engines.local.LocalTransport>` (the engine's
    checkpoint). ``make_context(config)`` builds a worker's context (default
    :func:`client_context`; a module-level function: it is sent to the worker by name). ``config``:
    the run's; ``devices``: one worker each; ``threads``: each worker's torch threads (None: see the
    module docstring)."""

    def __init__(
        self,
        config: RunConfig,
        devices: list[str],
        threads: int | None = None,
        make_context: Callable[[RunConfig], RunContext] = client_context,
    ) -> None:
        import torch

        self.config, self.devices, self.make_context = config, list(devices), make_context
        self.threads = threads or max(1, torch.get_num_threads() // len(self.devices))
        self.states: dict[int, dict[str, np.ndarray]] = {}
        self.workers: list[_Worker | None] = [None] * len(self.devices)
        self._finalizer = weakref.finalize(self, _stop_all, self.workers)

    def _worker(self, w: int) -> _Worker:
        """Worker ``w``, started (again) if it is not running."""
        worker = self.workers[w]
        if worker is None:
            ctx = get_context("spawn")
            parent, child = ctx.Pipe()
            config = worker_config(self.config, self.devices[w])
            process = ctx.Process(
                target=_serve,
                args=(child, config, self.threads, self.make_context),
                name=f"fedtune-clients-{self.devices[w]}",
            )
            process.start()
            child.close()  # the worker holds the only other end: its death reads as end of file here
            worker = self.workers[w] = _Worker(self.devices[w], process, parent)
        return worker

    def _lost(
        self, w: int, worker: _Worker, cids: list[int], messages: dict[int, Message], out: dict[int, Delivery]
    ) -> None:
        """Worker ``w`` (``worker``) died: the clients it still owed fail, naming its device; it restarts
        on the next call."""
        reason = worker.death()
        worker.stop(grace_s=0)
        self.workers[w] = None
        for cid in cids:
            out[cid] = Delivery(None, messages[cid].nbytes, error=reason)

    def __call__(self, kind: str, rnd: int, messages: dict[int, Message], attempt: int = 0) -> dict[int, Delivery]:
        out: dict[int, Delivery] = {}
        owed: dict[int, list[int]] = {}  # worker -> the clients it has still to answer for
        live: dict[int, _Worker] = {}  # the workers of owed
        for w, share in enumerate(assignment(list(messages), len(self.devices))):
            if not share:
                continue
            worker = self._worker(w)
            jobs = [(cid, messages[cid], self.states.get(cid, {})) for cid in share]
            try:
                worker.conn.send((kind, rnd, attempt, jobs))
            except OSError:  # it died since the last call
                self._lost(w, worker, share, messages, out)
                continue
            owed[w], live[w] = list(share), worker
        while owed:
            ready = set(wait([live[w].conn for w in owed] + [live[w].process.sentinel for w in owed]))
            for w in list(owed):
                worker = live[w]
                if worker.conn not in ready and worker.process.sentinel not in ready:
                    continue
                try:
                    if not worker.conn.poll():  # the sentinel fired with nothing left to read
                        raise EOFError
                    cid, got, state = worker.conn.recv()
                except (EOFError, OSError):
                    self._lost(w, worker, owed.pop(w), messages, out)
                    continue
                out[cid] = got
                if got.error is None:
                    self.states[cid] = state
                owed[w].remove(cid)
                if not owed[w]:
                    del owed[w]
        return {cid: out[cid] for cid in messages}  # in the order of the messages (aggregation sums in it)

    def close(self) -> None:
        """Stop every worker (by its own handle), waiting for each."""
        _stop_all(self.workers)
