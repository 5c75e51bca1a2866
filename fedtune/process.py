"""Process plumbing for every entry point: one process set-up (CLI, engines, Flower nodes, benchmark
workers), and the processes a deployment starts: started in their own session, logged, waited
for on a port, and stopped by PID with everything they started (no PID reuse); free ports."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from fedtune.errors import FedtuneError

#: set (``fedtune --verbose``), the libraries' own warnings, log lines and progress bars are shown
VERBOSE_ENV = "FEDTUNE_VERBOSE"


def _critical_only(record: logging.LogRecord) -> bool:
    """A logging filter that keeps only ``record``s at CRITICAL (Flower's logger, unless verbose)."""
    return record.levelno >= logging.CRITICAL


_critical_only.fedtune = True  # type: ignore[attr-defined]


def quiet_libraries() -> None:
    """No third-party output the user did not ask for, unless :data:`VERBOSE_ENV` is set:
    bitsandbytes' log lines below errors (its "Failed to load CPU gemm_4bit_forward" at import on
    an AVX512-BF16 CPU), transformers' log lines below errors and the hub's progress bars (its
    "Loading weights"), PEFT's UserWarnings, Flower's log lines below critical (the simulation's
    "DEPRECATED FEATURE: run_simulation"; the ERROR line and traceback of a failing client's
    exception) and the libraries' DeprecationWarnings (torch.jit's, when Ray imports it): every
    engine prints the embedded engine's lines. Processes started from here inherit the setting."""
    if os.environ.get(VERBOSE_ENV):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    flwr = logging.getLogger("flwr")  # a filter, not a level: importing flwr resets its level to DEBUG
    if not any(getattr(f, "fedtune", False) for f in flwr.filters):  # its ERROR lines name a failing client
        flwr.addFilter(_critical_only)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if "transformers" in sys.modules:  # imported before the variables above were set
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


#: set by :func:`offline_without_network` to the hub host that did not resolve
NO_NETWORK_ENV = "FEDTUNE_HUB_UNREACHABLE"
PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _resolves(host: str, timeout: float) -> bool:
    """Whether ``host`` resolves (DNS) within ``timeout`` seconds."""
    found: list[object] = []

    def look_up() -> None:
        try:
            found.append(socket.getaddrinfo(host, 443))
        except OSError:
            pass

    worker = threading.Thread(target=look_up, daemon=True)
    worker.start()
    worker.join(timeout)
    return bool(found)


def offline_without_network(timeout: float = 3.0) -> None:
    """Fail fast without a network: when the hub's host (``HF_ENDPOINT``, default huggingface.co)
    does not resolve and no proxy is set, set ``HF_HUB_OFFLINE=1`` for this process and those it
    starts (the hub libraries then read their caches and fail at once, where the hub client would
    retry each file 5 times over 23 s, logging 11 lines). Nothing when ``HF_HUB_OFFLINE`` is set."""
    if "HF_HUB_OFFLINE" in os.environ or any(os.environ.get(k) for k in PROXY_ENV):
        return
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    if _resolves(host, timeout):
        return
    os.environ.update({"HF_HUB_OFFLINE": "1", NO_NETWORK_ENV: host})
    for module, name in (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_HUB_OFFLINE")):
        if module in sys.modules:  # imported before: they read the variable at import
            setattr(sys.modules[module], name, True)


def offline_hint() -> str:
    """What a one-line error about a model or data set the hub could not give adds when offline."""
    if os.environ.get(NO_NETWORK_ENV):
        return f" (offline: {os.environ[NO_NETWORK_ENV]} does not resolve, so HF_HUB_OFFLINE=1)"
    return " (offline: HF_HUB_OFFLINE=1)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""


def setup_process(threads: int | None = None) -> None:
    """Prepare this process for fedtune work: no tokenizer thread pool (it deadlocks after fork
    and fights torch for the cores), quiet deprecation noise and other output from the libraries
    (:func:`quiet_libraries`), offline at once without a network (:func:`offline_without_network`),
    the threads' malloc arenas shared (:func:`limit_malloc_arenas`), and ``threads`` torch threads
    when given (``train.threads``; None leaves torch's choice)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    quiet_libraries()
    offline_without_network()
    limit_malloc_arenas()
    if threads:
        import torch

        torch.set_num_threads(int(threads))


@lru_cache(maxsize=1)
def _glibc():
    """glibc (None on other C libraries)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def _malloc_trim():
    """glibc's ``malloc_trim`` (None on other C libraries)."""
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


M_ARENA_MAX = -8  # glibc's mallopt parameter: the most malloc arenas of the process
MALLOC_ARENAS = 2  # fedtune's limit (glibc's default: 8 per core)


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """Let the threads of this process share at most ``arenas`` glibc malloc arenas (``mallopt``;
    nothing elsewhere, nor where the user set ``MALLOC_ARENA_MAX``), from the next arena glibc would
    create.

    A freed buffer stays in the arena of the thread that allocated it, for that arena's next
    allocation. A loopback deployment trains its first node in a thread of the server's process
    (:class:`~fedtune.engines.flower.executor.NodeThread`) while the main thread evaluates and saves:
    with an arena each, the process kept both working sets; the embedded engine's one thread reuses
    one. MiniLM, 4 clients, 1 local step, 1 node: the process's peak PSS 1061-1183 MB (4 runs), with 2
    arenas and the node's trims (:func:`release_free_memory`) 938-1020 MB (3 runs), embedded 883-992
    MB (2026-11-29; ``benchmarks/results/flower_deployment.md`` for the whole tree)."""
    libc = _glibc()
    if libc is not None and "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(M_ARENA_MAX, int(arenas))


#: the growth of the resident size over its level one client after the last trim that makes
#: :func:`release_free_memory` trim
TRIM_GROWTH = 64 * 2**20
_level: list[int | None] = [None]  # the resident size one call after the last trim (None: not measured yet)


def resident_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def release_free_memory(min_growth: int = TRIM_GROWTH) -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim(0)``; nothing elsewhere)
    once the resident size has grown by ``min_growth`` bytes over its level one call after the
    last trim.

    Between two simulated clients the process holds what the round keeps (the replies awaiting
    aggregation) and the freed activations of the last client's training. glibc's heap keeps those
    freed pages: the long-lived replies sit between them, and its adaptive mmap threshold moves
    megabyte buffers onto the heap after the first frees, so the resident size grew by about
    12 MB per client on SmolLM2-135M (1.8 MB of which is the reply; benchmarks/llm/llm_scale.py, 32
    clients: peak 1.16x the bare loop). A trim returns the next client's working set too, which it
    faults in again: trimming before every client cost 14 % of the training speed there. So the
    level is measured one client after a trim (the working set back in place), and the next trim
    waits for ``min_growth`` of growth over it: a trim every few clients, the resident size within
    ``min_growth`` of the working set."""
    trim = _malloc_trim()
    if trim is None:
        return
    now = resident_bytes()
    if _level[0] is None:
        _level[0] = now
    elif now - _level[0] >= min_growth:
        trim(0)
        _level[0] = None


class DeploymentError(FedtuneError, RuntimeError):
    """A deployment process failed to start or the Flower run failed (the message names it)."""

    exit_code = 1


# -- processes -----------------------------------------------------------------------------------
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


class ReapDescendants:
    """Remember the processes started while inside (descendants absent on entry, polled: Ray's
    GCS, raylet, workers, actors; Flower's SuperExec and app processes); on exit terminate them,
    wait, then kill those left, by PID (psutil checks each one's start time: no PID reuse).
    After ``ray.shutdown()`` the actors outlive the raylet a few seconds, re-parented to init."""

    def __init__(self, poll_s: float = 0.5, grace_s: float = 15.0, terminate: bool = False) -> None:
        self.poll_s, self.grace_s, self.terminate = poll_s, grace_s, terminate
        self.seen: dict[int, Any] = {}
        self.done = threading.Event()

    def poll(self) -> None:
        import psutil

        try:
            for proc in psutil.Process().children(recursive=True):
                if proc.pid not in self.before:
                    self.seen.setdefault(proc.pid, proc)
        except psutil.Error:
            pass

    def _loop(self) -> None:
        while not self.done.wait(self.poll_s):
            self.poll()

    def __enter__(self) -> ReapDescendants:
        import psutil

        self.before = {proc.pid for proc in psutil.Process().children(recursive=True)}  # not ours to stop
        self.thread = threading.Thread(target=self._loop, daemon=True, name="fedtune-reaper")
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        import psutil

        self.done.set()
        self.thread.join()
        self.poll()
        procs = list(self.seen.values())
        for proc in procs:  # their own children too (a SuperExec's app processes)
            try:
                procs += [
                    c for c in proc.children(recursive=True) if c.pid not in self.seen and c.pid not in self.before
                ]
            except psutil.Error:
                pass
        if self.terminate:
            for proc in reversed(procs):
                try:
                    proc.terminate()
                except psutil.Error:
                    pass
        reap(procs, self.grace_s)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` TCP ports free on ``host`` right now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for_port(
    port: int,
    proc: subprocess.Popen | None = None,
    timeout: float = 120,
    host: str = "127.0.0.1",
    log: Path | None = None,
) -> None:
    """Wait until something listens on ``host:port``; fail early, with the log's tail, if
    ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise DeploymentError(
                    f"{_name(proc)} exited with code {proc.returncode} before listening on {host}:{port}{log_tail(log)}"
                ) from None
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"nothing listens on {host}:{port} after {timeout:.0f} s{log_tail(log)}"
                ) from None
            time.sleep(0.1)


def _name(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, (list, tuple)) else [proc.args]
    return Path(str(args[0])).name


def log_tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not Path(log).is_file():
        return ""
    text = Path(log).read_text(errors="replace").strip().splitlines()[-lines:]
    return ("; log " + str(log) + ":\n  " + "\n  ".join(text)) if text else ""


class Processes:
    """Processes started in their own session (a terminal's Ctrl-C reaches only fedtune, which
    then stops them in order), logged to files, and stopped with everything they started."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.started: list[tuple[str, subprocess.Popen, Path]] = []
        self.reaper = ReapDescendants(grace_s=10, terminate=True)
        self.reaper.__enter__()

    def start(
        self, name: str, args: Sequence[str | os.PathLike], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as sink:
            proc = subprocess.Popen(
                [str(a) for a in args],
                env=env,
                cwd=cwd or self.log_dir,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.started.append((name, proc, log))
        return proc

    def log_of(self, proc: subprocess.Popen) -> Path | None:
        return next((log for _, p, log in self.started if p is proc), None)

    def stop(self) -> None:
        """Terminate every process started (and its descendants), then kill what is left, by PID."""
        self.reaper.__exit__(None, None, None)
        for _, proc, _ in self.started:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) names this machine's loopback interface
    only; a DNS name other than ``localhost`` is not taken to."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
