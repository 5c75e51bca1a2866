"""Flower deployments started and stopped by fedtune: processes tracked by PID, certificates,
keys, and the loopback deployment behind ``fedtune run RECIPE --set engine=flower``.

:class:`LoopbackDeployment` starts, on 127.0.0.1 and in a private ``FLWR_HOME`` (a temporary
folder, mode 0700): one SuperLink and, per node, a SuperNode and its fedtune executor (a node plays
one client or a group of clients, ``placement.nodes``; default ``min(clients per round,
cores)``); :meth:`LoopbackDeployment.run` submits the fedtune app with ``flwr run`` (:func:`write_app`)
and serves the run's ServerApp in this process. Every process it starts, and every process those
start, is stopped by PID on exit: after the run, on an error, and on Ctrl-C. Options: TLS
(``tls=True``: a fresh CA and server certificate for 127.0.0.1, :func:`generate_certificates`) and
SuperNode authentication (``auth=True``: the SuperLink admits only SuperNodes whose public keys
were registered with ``flwr supernode register``, :func:`generate_node_key`; Flower requires TLS
for it); ``executors=False``: stock Flower processes (a SuperExec per SuperNode starting a
``flwr-clientapp`` per message, a ``flwr-serverapp`` per run), for comparison.

Per-round cost: both the SuperLink and the SuperNodes run with ``--isolation process`` and a
SuperExec secret. A node's executor (:mod:`.executor`) answers every message of the node in one
process, the model and data kept warm; the ServerApp runs here (:mod:`.inprocess`); standby
messages (:mod:`.standby`) keep idle SuperNodes from Flower's 3 s idle sleep; objects are pulled
without Flower's 1 s back-off (:mod:`.runtime_api`) and packed one Array per dtype (:mod:`.packing`).

:func:`run_flower_deployment` is what ``engine = "flower"`` runs: it writes the same run folder
as the embedded engine (:func:`fedtune.run.run_experiment`) and calls ``on_round`` with each
round's record as it ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from fedtune.certificates import generate_certificates, generate_node_key
from fedtune.config import RunConfig
from fedtune.engines.flower.codec import CLIPPING_NORM
from fedtune.engines.flower.commands import (
    TASK_POLL_S,
    client_groups,
    default_nodes,
    executor_args,
    flower_command,
    flower_env,
    superlink_args,
    supernode_args,
    write_app,
    write_flower_config,
)
from fedtune.engines.flower.executor import NodeThread, write_secret
from fedtune.engines.flower.inprocess import serve_run
from fedtune.engines.flower.serverapp import read_status
from fedtune.engines.rounds import RoundFailed, RoundRecord, RunInterrupted
from fedtune.process import DeploymentError, Processes, free_ports, log_tail, wait_for_port
from fedtune.runtime import ResolvedRun, RunContext, as_resolved


# -- running the app -----------------------------------------------------------------------------
def submission(
    config: RunConfig, home: Path, resume: bool, timeout: float | None, clipping_norm: float | None
) -> tuple[Path, Path]:
    """The fedtune Flower App (:func:`write_app`) and the Flower run config that submits ``config``
    (as JSON: resolved once, by the ServerApp) with ``resume``, ``timeout`` and ``clipping_norm``
    (as :func:`run_app`'s), both in ``home``: (app folder, run config file)."""
    import tomli_w

    run_config = home / "run-config.toml"
    run_config.write_text(
        tomli_w.dumps(
            {
                "config": config.model_dump_json(exclude_none=True),
                "resume": bool(resume),
                "timeout": float(timeout or 0),
                "clipping-norm": float(clipping_norm or 0),
            }
        )
    )
    return write_app(home / "app"), run_config


def run_app(
    config: RunConfig,
    home: Path,
    connection: str,
    processes: Processes,
    on_round: Callable[[RoundRecord], None] | None = None,
    resume: bool = False,
    timeout: float | None = None,
    clipping_norm: float | None = None,
    interrupt: Callable[[], None] | None = None,
    on_output: Callable[[str], None] | None = None,
    run_dir: Path | None = None,
) -> dict[str, Any] | None:
    """Submit ``config`` (as JSON in Flower's run config: the ServerApp resolves it once) to the
    SuperLink of ``connection`` (in ``home``) with ``flwr run --stream``, started by ``processes``,
    and wait for the run to end (``resume``: continue the run folder; ``timeout``: the ServerApp's
    wait for nodes and replies; ``clipping_norm``: asked of the nodes' clipping mods; ``interrupt``:
    called on Ctrl-C, then the run is awaited). When this machine sees the run folder ``run_dir``
    (a loopback deployment: the resolved run's, ``output_dir`` absolute), ``on_round`` gets each
    round as its line appears in ``metrics.jsonl`` and the summary is returned; otherwise (None, a
    remote SuperLink) None. ``on_output`` gets Flower's streamed output as it comes. Raises
    :class:`~fedtune.engines.rounds.RoundFailed`, :class:`~fedtune.engines.rounds.RunInterrupted`
    or :class:`DeploymentError` as the run ended."""
    local = run_dir is not None
    run_dir = run_dir if run_dir is not None else Path(config.output_dir) / config.run_name  # remote: not read
    app, run_config = submission(config, home, resume, timeout, clipping_norm)
    metrics = run_dir / "metrics.jsonl"
    seen = metrics.read_text().count("\n") if resume and metrics.is_file() else 0
    started = time.time()
    proc = processes.start(
        "flwr-run",
        [flower_command("flwr"), "run", app, connection, "--stream", "--run-config", run_config],
        flower_env(home),
        cwd=home,
    )
    log = processes.log_of(proc)
    shown = 0

    def poll() -> None:
        nonlocal seen, shown
        if on_output is not None and log is not None and log.is_file():
            text = log.read_text(errors="replace")
            on_output(text[shown:]) if len(text) > shown else None
            shown = len(text)
        if on_round is None or not metrics.is_file() or metrics.stat().st_mtime < started - 1:
            return
        for text in metrics.read_text().splitlines()[seen:]:
            if text.endswith("}"):
                on_round(RoundRecord.from_json(json.loads(text)))
                seen += 1

    try:
        while proc.poll() is None:
            poll()
            time.sleep(0.25)
    except KeyboardInterrupt:
        if interrupt is None:
            raise
        interrupt()  # ask the ServerApp to stop after this round's checkpoint, then wait for it
        while proc.poll() is None:
            poll()
            time.sleep(0.25)
    poll()
    text = log.read_text(errors="replace") if log else ""
    summary = run_dir / "summary.json"
    status = read_status(run_dir, started, remove=True) if local else None  # the run folder keeps no engine file
    if proc.returncode == 0 and summary.is_file() and summary.stat().st_mtime >= started - 1:
        done: dict[str, Any] = json.loads(summary.read_text())
        return done
    if status is not None and status["status"] == "interrupted":
        raise RunInterrupted(int(status.get("round", 0)))
    if status is not None and status["status"] == "round_failed":
        raise RoundFailed(str(status.get("message", "")))
    if not local and proc.returncode == 0 and "Traceback" not in text:
        return None  # finished on a machine whose run folder this one does not see
    raise DeploymentError(f"flwr run exited with code {proc.returncode}{log_tail(log, 25)}")


class LoopbackDeployment:
    """A SuperLink, SuperNodes and their executors on 127.0.0.1 in a private ``FLWR_HOME``; a context
    manager (everything is stopped by PID on exit). ``groups``: the client ids of each node;
    ``home``: the ``FLWR_HOME`` (None: a temporary folder, removed on exit); ``tls``, ``auth``: see
    the module docstring; ``threads``: each node's torch threads (None: the cores shared out);
    ``executors``: a fedtune executor per node (:mod:`.executor`; False: Flower's SuperExec and a
    ``flwr-clientapp`` process per message); ``in_place``: the first node's executor is a thread of
    this process training on the server's base (:class:`.executor.NodeThread`), not a process of its
    own; ``log_dir``: the processes' logs (None: in ``home``); ``budgets``: each node's own
    resources, node-config entries (:func:`supernode_args`)."""

    def __init__(
        self,
        groups: Sequence[Sequence[int]],
        home: Path | None = None,
        tls: bool = False,
        auth: bool = False,
        threads: int | None = None,
        executors: bool = True,
        log_dir: Path | None = None,
        budgets: Sequence[Mapping[str, Any]] | None = None,
        in_place: bool = False,
    ) -> None:
        if auth and not tls:
            raise ValueError("SuperNode authentication needs TLS (Flower refuses it on an insecure connection)")
        self.groups = [list(g) for g in groups]
        self.budgets = list(budgets) if budgets is not None else [{}] * len(self.groups)
        self.tls, self.auth, self.executors, self.in_place = tls, auth, executors, in_place and executors
        self.node_thread: NodeThread | None = None  # the first node's executor, in place
        self.threads = threads or max(1, (os.cpu_count() or 1) // max(1, len(self.groups)))
        self._own_home = home is None
        self.home = Path(tempfile.mkdtemp(prefix="fedtune-flwr-")) if home is None else Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.home.chmod(0o700)
        self.log_dir = Path(log_dir) if log_dir else self.home / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.certificates: dict[str, Path] | None = None
        self.secret: Path | None = None  # the SuperLink's SuperExec secret (process isolation)
        self.processes: Processes | None = None
        self.port = 0
        self.nodes: list[subprocess.Popen[Any]] = []

    @property
    def address(self) -> str:
        """The SuperLink's Fleet API address (127.0.0.1 and its port)."""
        return f"127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of this deployment's processes (:func:`flower_env`) plus ``extra``."""
        return flower_env(self.home, FLWR_SUPEREXEC_TASK_POLL_INTERVAL=str(TASK_POLL_S), **extra)

    def __enter__(self) -> LoopbackDeployment:
        self.processes = Processes(self.log_dir)
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _started(self) -> Processes:
        """The processes of the entered deployment; outside its ``with`` block, a RuntimeError."""
        if self.processes is None:
            raise RuntimeError("LoopbackDeployment: start it with `with LoopbackDeployment(...) as deployment:`")
        return self.processes

    def _start(self) -> None:
        if self.tls:
            self.certificates = generate_certificates(self.home / "certificates")
        self.port = free_ports(1)[0]
        self.secret = write_secret(self.home / "superlink.secret") if self.executors else None
        link = self._started().start(
            "superlink",
            superlink_args("127.0.0.1", self.port, self.certificates, self.auth, executor_secret=self.secret),
            self.env(),
        )
        wait_for_port(self.port, link, log=self._started().log_of(link))
        roots = None if self.certificates is None else self.certificates["ca"]
        self.connection = write_flower_config(self.home, self.address, roots)
        for i, clients in enumerate(self.groups):
            key = self.register_node_key(f"node{i}") if self.auth else None
            in_place = self.in_place and i == 0
            self.start_supernode(clients, f"supernode{i}", key, budget=self.budgets[i], in_place=in_place)

    def register_node_key(self, name: str) -> Path:
        """A fresh key pair ``name`` for a SuperNode, its public key registered with the SuperLink; the
        private key's path."""
        private, public = generate_node_key(self.home / "keys", name)
        done = subprocess.run(
            [flower_command("flwr"), "supernode", "register", str(public), self.connection],
            env=self.env(),
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise DeploymentError(f"flwr supernode register {public}: {(done.stdout + done.stderr).strip()[-800:]}")
        return private

    def start_supernode(
        self,
        clients: Sequence[int],
        name: str,
        private_key: Path | None = None,
        insecure: bool = False,
        wait: bool = True,
        extra: Sequence[str] = (),
        budget: Mapping[str, Any] | None = None,
        in_place: bool = False,
    ) -> subprocess.Popen[Any]:
        """Start a SuperNode ``name`` playing ``clients`` and (unless ``executors=False``) its fedtune
        executor; ``private_key``: its authentication key; ``insecure``: connect without TLS even when
        the SuperLink has it (tests); ``wait``: until the SuperNode serves; ``extra``: more SuperNode
        arguments; ``budget``: its own resources (:func:`supernode_args`); ``in_place``: its executor a
        thread of this process (:class:`.executor.NodeThread`; one node at most)."""
        secret = write_secret(self.home / f"{name}.secret") if self.executors else None
        port = free_ports(1)[0]
        roots = None if insecure or self.certificates is None else self.certificates["ca"]
        node = self._started().start(
            name,
            supernode_args(self.address, port, clients, roots, private_key, secret, self.threads, extra, budget),
            self.env(),
        )
        if wait:
            wait_for_port(port, node, log=self._started().log_of(node))
        if secret is not None and in_place and self.node_thread is None:
            self.node_thread = NodeThread(f"127.0.0.1:{port}", secret.read_bytes()).start()
        elif secret is not None:
            self._started().start(f"{name}-executor", executor_args(port, secret, self.threads), self.env())
        self.nodes.append(node)
        return node

    def run(
        self,
        run: RunConfig | ResolvedRun,
        on_round: Callable[[RoundRecord], None] | None = None,
        resume: bool = False,
        timeout: float | None = 600,
        clipping_norm: float | None = None,
    ) -> dict[str, Any]:
        """Run ``run`` (a resolved run, or a config resolved here) on this deployment, ``output_dir``
        made absolute, and return its summary: submitted with ``flwr run``, its ServerApp served in
        this process (:func:`.inprocess.serve_run`; ``executors=False``: by Flower's ``flwr-serverapp``
        process, followed through the run folder, :func:`run_app`). ``on_round`` gets each round as
        it ends; ``resume``: continue the run folder; ``timeout``: the wait for nodes and replies;
        ``clipping_norm``: asked of the nodes' clipping mods. Ctrl-C stops the run after the current
        round's checkpoint."""
        resolved = as_resolved(run)
        resolved = resolved.relocated(str(Path(resolved.config.output_dir).resolve()))
        config = resolved.config
        if self.secret is None:
            done = run_app(
                config, self.home, self.connection, self._started(), on_round, resume, timeout, clipping_norm,
                interrupt=self.interrupt_server, run_dir=resolved.run_dir,
            )  # fmt: skip
            return cast(dict[str, Any], done)  # run_dir given: the summary, or run_app raised
        app, run_config = submission(config, self.home, resume, timeout, clipping_norm)
        flwr = [flower_command("flwr"), "run", str(app), self.connection, "--run-config", str(run_config)]
        sub = subprocess.run(flwr, env=self.env(), cwd=self.home, capture_output=True, text=True, timeout=300)
        if sub.returncode != 0:
            raise DeploymentError(f"flwr run exited with code {sub.returncode}: {(sub.stdout + sub.stderr)[-800:]}")
        roots = None if self.certificates is None else self.certificates["ca"].read_bytes()
        request = {CLIPPING_NORM: float(clipping_norm)} if clipping_norm else None
        shares = self.node_thread is not None  # the first node trains on the ServerApp's base
        return serve_run(
            self.address, self.secret.read_bytes(), roots, resolved, on_round, resume, timeout, request, shares
        )

    def interrupt_server(self) -> None:
        """Send SIGINT to the ServerApp process (``flwr-serverapp``, ``executors=False``): it stops
        after its round's checkpoint."""
        import psutil

        self._started().reaper.poll()
        for proc in list(self._started().reaper.seen.values()):
            try:
                if "flwr-serverapp" in " ".join(proc.cmdline()):
                    proc.send_signal(signal.SIGINT)
            except psutil.Error:
                pass

    def __exit__(self, *exc: object) -> None:
        if self.node_thread is not None:
            self.node_thread.stop()
            self.node_thread = None
        if self.processes is not None:
            self.processes.stop()
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)


def run_flower_deployment(
    run: RunConfig | ResolvedRun,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[RunContext], None] | None = None,
    resume: bool = False,
    tls: bool = False,
    auth: bool = False,
    timeout: float | None = 3600,
    keep_logs: Path | None = None,
) -> dict[str, Any]:
    """``engine = "flower"``: run ``run`` (a resolved run, or a config resolved here) on a fresh
    :class:`LoopbackDeployment` (nodes: :func:`default_nodes`, clients in contiguous groups, cores /
    nodes torch threads each unless ``train.threads``) and stop it; the run folder is the embedded
    engine's. ``on_start`` gets this process's RunContext (for the banner); ``timeout`` bounds the
    wait for nodes and for each round's replies (``federation.round_timeout_s`` overrides it for
    rounds). ``keep_logs``: copy the deployment's logs there. ``on_round``, ``resume``: as
    :func:`run_app`'s; ``tls``, ``auth``: as :class:`LoopbackDeployment`'s."""
    run = as_resolved(run)
    context = RunContext(run)
    config = run.config
    if on_start is not None:
        on_start(context)
    groups = client_groups(config.federation.num_clients, default_nodes(config))
    with LoopbackDeployment(groups, tls=tls, auth=auth, threads=config.train.threads, in_place=True) as deployment:
        try:
            return deployment.run(run, on_round, resume, timeout)
        finally:
            if keep_logs is not None:
                shutil.copytree(deployment.log_dir, keep_logs, dirs_exist_ok=True)
