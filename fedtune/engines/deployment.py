"""Flower deployments started and stopped by fedtune: processes tracked by PID, certificates,
keys, and the loopback deployment behind ``fedtune run RECIPE --set engine=flower``.

:class:`LoopbackDeployment` starts, on 127.0.0.1 and in a private ``FLWR_HOME`` (a temporary
folder, mode 0700): one SuperLink, one fedtune worker plus one SuperNode per node (a node plays
one client or a group of clients, ``federation.nodes``; default ``min(clients per round,
cores)``), then ``flwr run`` submits the fedtune app (:func:`write_app`). Every process it
starts, and every process those start (SuperExec, ServerApp, ClientApps), is stopped by PID on
exit: after the run, on an error, and on Ctrl-C. Options: TLS (``tls=True``: a fresh CA and
server certificate for 127.0.0.1, :func:`generate_certificates`) and SuperNode authentication
(``auth=True``: the SuperLink admits only SuperNodes whose public keys were registered with
``flwr supernode register``, :func:`generate_node_key`; Flower requires TLS for it).

Per-round cost in a deployment: Flower starts a ``flwr-clientapp`` process per message; with a
worker (the default here) that process imports only Flower and fedtune's Flower module and hands
the work to the node's warm worker (:func:`fedtune.engines.flower.run_worker`). Flower's own
latencies remain: a SuperNode that found no message sleeps 3 s before asking again, and its
SuperExec polls for new tasks every ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` seconds (set here to
:data:`TASK_POLL_S`); the server pulls replies every :data:`~fedtune.engines.flower.POLL_S` s.

:func:`run_flower_deployment` is what ``engine = "flower"`` runs: it writes the same run folder
as the embedded engine (the ServerApp process runs :func:`fedtune.run.run_experiment`) and calls
``on_round`` with each round's record as its line appears in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedtune.errors import FedtuneError

TASK_POLL_S = 0.05  # FLWR_SUPEREXEC_TASK_POLL_INTERVAL of the loopback SuperNodes (Flower: 1 s)
APP_CONFIG_KEYS = ("recipe", "config", "overrides", "resume", "timeout", "clipping-norm")

APP_PYPROJECT = """\
# fedtune as a Flower App (written by fedtune.engines.deployment.write_app).
# fedtune itself must be installed where the SuperLink and SuperNodes run (this FAB ships no code).
[project]
name = "fedtune-flower"
version = "0.1.0"
description = "fedtune methods as a Flower App"
dependencies = []

[tool.flwr.app]
publisher = "fedtune"

[tool.flwr.app.components]
serverapp = "fedtune.engines.flower:server_app"
clientapp = "fedtune.engines.flower:client_app"

[tool.flwr.app.config]
recipe = ""          # a fedtune TOML recipe (path as seen by the ServerApp and ClientApp processes)
config = ""          # or a whole fedtune RunConfig as JSON (what `fedtune run`/`fedtune deploy run` submit)
overrides = ""       # "key=value; key=value", as `fedtune run --set`
resume = false       # continue the run folder from its last checkpoint
timeout = 0.0        # seconds to wait for nodes and for a round's replies (0: no limit)
clipping-norm = 0.0  # > 0: the nodes clip each update to this L2 norm (Flower's fixedclipping_mod)
"""


class DeploymentError(FedtuneError, RuntimeError):
    """A deployment process failed to start or the Flower run failed (the message names it)."""


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
                    f"{_name(proc)} exited with code {proc.returncode} before listening on {host}:{port}{_tail(log)}"
                ) from None
            if time.monotonic() > deadline:
                raise DeploymentError(f"nothing listens on {host}:{port} after {timeout:.0f} s{_tail(log)}") from None
            time.sleep(0.1)


def _name(proc: subprocess.Popen) -> str:
    args = proc.args if isinstance(proc.args, (list, tuple)) else [proc.args]
    return Path(str(args[0])).name


def _tail(log: Path | None, lines: int = 15) -> str:
    if log is None or not Path(log).is_file():
        return ""
    text = Path(log).read_text(errors="replace").strip().splitlines()[-lines:]
    return ("; log " + str(log) + ":\n  " + "\n  ".join(text)) if text else ""


def flower_command(name: str) -> str:
    """Path of a Flower command (``flower-superlink``, ``flwr``, ...): beside this Python first."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise DeploymentError(f"{name}: not found (install flwr in this environment)")
    return found


def flower_env(home: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of every deployment process: no runtime dependency installation (it
    would install a CUDA torch), this Python's bin first on PATH, ``FLWR_HOME`` when given."""
    env = {
        **os.environ,
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    if home is not None:
        env["FLWR_HOME"] = str(home)
    env.update(extra)
    return env


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


# -- certificates and keys -----------------------------------------------------------------------
def generate_certificates(
    folder: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30
) -> dict[str, Path]:
    """A self-signed CA and a server certificate for ``hosts`` (IP addresses or DNS names), as
    PEM files in ``folder``: ``ca.crt`` (give it to SuperNodes and ``flwr``), ``server.pem`` and
    ``server.key`` (the SuperLink's). For tests and trials; use your own PKI in production."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedtune test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths["key"].chmod(0o600)
    return paths


def generate_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format, as Flower expects):
    ``<name>`` (private, ``flower-supernode --auth-supernode-private-key``) and ``<name>.pub``
    (``flwr supernode register``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    return private, public


# -- command lines (shared by the loopback deployment and `fedtune deploy`) ----------------------
def superlink_args(
    host: str, port: int, certificates: dict[str, Path] | None = None, auth: bool = False, extra: Sequence[str] = ()
) -> list[str]:
    """``flower-superlink`` arguments: TLS from ``certificates`` (``ca``, ``cert``, ``key``) or
    ``--insecure``; ``auth``: admit only registered SuperNodes."""
    args = [
        flower_command("flower-superlink"),
        "--disable-runtime-dependency-installation",
        "--host",
        host,
        "--port",
        str(port),
    ]
    if certificates is None:
        args.append("--insecure")
    else:
        args += [
            "--ssl-ca-certfile",
            str(certificates["ca"]),
            "--ssl-certfile",
            str(certificates["cert"]),
            "--ssl-keyfile",
            str(certificates["key"]),
        ]
    if auth:
        args.append("--enable-supernode-auth")
    return args + list(extra)


def supernode_args(
    superlink: str,
    port: int,
    clients: Sequence[int],
    root_certificates: Path | None = None,
    private_key: Path | None = None,
    worker: str | None = None,
    threads: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``flower-supernode`` arguments for a node playing ``clients``: TLS with
    ``root_certificates`` (the CA that signed the SuperLink's certificate) or ``--insecure``;
    ``private_key``: authenticate with it; ``worker``: the node's fedtune worker socket."""
    from fedtune.engines.flower import NODE_CLIENTS, NODE_THREADS, NODE_WORKER, format_clients

    node_config = [f'{NODE_CLIENTS}="{format_clients(clients)}"']
    if worker:
        node_config.append(f'{NODE_WORKER}="{worker}"')
    if threads:
        node_config.append(f"{NODE_THREADS}={int(threads)}")
    args = [
        flower_command("flower-supernode"),
        "--superlink",
        superlink,
        "--port",
        str(port),
        "--node-config",
        " ".join(node_config),
    ]
    args += ["--insecure"] if root_certificates is None else ["--root-certificates", str(root_certificates)]
    if private_key is not None:
        args += ["--auth-supernode-private-key", str(private_key)]
    return args + list(extra)


def worker_args(socket_path: str, threads: int | None) -> list[str]:
    """The command of a node's fedtune worker (:func:`fedtune.engines.flower.run_worker`)."""
    code = (
        "import sys; from fedtune.engines.flower import run_worker; run_worker(sys.argv[1], int(sys.argv[2]) or None)"
    )
    return [sys.executable, "-c", code, socket_path, str(int(threads or 0))]


def wait_for_worker(socket_path: str, proc: subprocess.Popen, log: Path | None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (Path(socket_path).exists() and Path(f"{socket_path}.key").exists()):
        if proc.poll() is not None:
            raise DeploymentError(f"fedtune worker exited with code {proc.returncode}{_tail(log)}")
        if time.monotonic() > deadline:
            raise DeploymentError(f"fedtune worker {socket_path} not ready after {timeout:.0f} s{_tail(log)}")
        time.sleep(0.05)


def write_flower_config(home: Path, address: str, root_certificates: Path | None = None, name: str = "fedtune") -> str:
    """``FLWR_HOME/config.toml`` naming the SuperLink connection ``name`` for ``flwr`` commands."""
    home.mkdir(parents=True, exist_ok=True)
    tls = f'root-certificates = "{root_certificates}"\n' if root_certificates else "insecure = true\n"
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n{tls}'
    )
    return name


def write_app(folder: Path) -> Path:
    """The fedtune Flower App (a ``pyproject.toml`` naming fedtune's ServerApp and ClientApp)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder


def default_nodes(config: Any) -> int:
    """SuperNodes of a loopback deployment: ``federation.nodes``, else min(clients sampled per
    round, cores)."""
    fed = config.federation
    nodes = getattr(fed, "nodes", None) or min(fed.sample_size(), os.cpu_count() or 1)
    return max(1, min(nodes, fed.num_clients))


def client_groups(num_clients: int, nodes: int) -> list[list[int]]:
    """Client ids in ``nodes`` contiguous groups of (nearly) equal size."""
    bounds = [round(i * num_clients / nodes) for i in range(nodes + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(nodes)]


# -- running the app -----------------------------------------------------------------------------
def record_from_line(line: dict):
    """A ``metrics.jsonl`` line back as a :class:`~fedtune.engines.rounds.RoundRecord` (for
    progress display)."""
    from fedtune.engines.rounds import RoundRecord

    structural = {
        "round",
        "bytes_up",
        "bytes_down",
        "eval_bytes",
        "wall_s",
        "compute_s",
        "clients",
        "client_bytes_up",
        "client_bytes_down",
        "client_steps",
        "client_compute_s",
        "dropped",
        "attempts",
    }
    ints = lambda d: {int(k): v for k, v in (d or {}).items()}  # noqa: E731
    return RoundRecord(
        round=line["round"],
        clients=list(line["clients"]),
        metrics={k: v for k, v in line.items() if k not in structural and v is not None},
        client_bytes_up=ints(line.get("client_bytes_up")),
        client_bytes_down=ints(line.get("client_bytes_down")),
        client_steps=ints(line.get("client_steps")),
        client_compute_s=ints(line.get("client_compute_s")),
        dropped=ints(line.get("dropped")),
        attempts=line.get("attempts", 1),
        eval_bytes=line.get("eval_bytes", 0),
        wall_s=line.get("wall_s", 0.0),
    )


def run_app(
    config: Any,
    home: Path,
    connection: str,
    processes: Processes,
    on_round: Callable | None = None,
    resume: bool = False,
    timeout: float | None = None,
    clipping_norm: float | None = None,
    interrupt: Callable[[], None] | None = None,
    on_output: Callable[[str], None] | None = None,
    local: bool = True,
) -> dict | None:
    """Submit ``config`` (as JSON in Flower's run config) to the SuperLink of ``connection`` (in
    ``home``) with ``flwr run --stream`` and wait for the run to end. When this machine sees the
    run folder (a loopback deployment; ``output_dir`` is made absolute), ``on_round`` gets each
    round as its line appears in ``metrics.jsonl`` and the summary is returned; otherwise
    (``local=False``, a remote SuperLink) None. ``on_output`` gets Flower's streamed output as it comes. Raises
    :class:`~fedtune.engines.rounds.RoundFailed`, :class:`~fedtune.engines.rounds.RunInterrupted`
    or :class:`DeploymentError` as the run ended."""
    import tomli_w

    from fedtune.engines.rounds import RoundFailed, RunInterrupted

    if local:  # the ServerApp's working directory is not ours
        config = config.model_copy(update={"output_dir": str(Path(config.output_dir).resolve())})
    run_dir = Path(config.output_dir) / config.run_name
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
    app = write_app(home / "app")
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
                on_round(record_from_line(json.loads(text)))
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
    if proc.returncode == 0 and summary.is_file() and summary.stat().st_mtime >= started - 1:
        return json.loads(summary.read_text())
    for line in text.splitlines():
        if "RunInterrupted:" in line:
            raise RunInterrupted(json.loads(metrics.read_text().splitlines()[-1])["round"] if metrics.is_file() else 0)
        if "RoundFailed:" in line:
            raise RoundFailed(line.split("RoundFailed:", 1)[1].strip())
    if not local and proc.returncode == 0 and "Traceback" not in text:
        return None  # finished on a machine whose run folder this one does not see
    raise DeploymentError(f"flwr run exited with code {proc.returncode}{_tail(log, 25)}")


class LoopbackDeployment:
    """A SuperLink, workers and SuperNodes on 127.0.0.1 in a private ``FLWR_HOME``; a context
    manager (everything is stopped by PID on exit). ``groups``: the client ids of each node."""

    def __init__(
        self,
        groups: Sequence[Sequence[int]],
        home: Path | None = None,
        tls: bool = False,
        auth: bool = False,
        threads: int | None = None,
        workers: bool = True,
        log_dir: Path | None = None,
    ) -> None:
        if auth and not tls:
            raise ValueError("SuperNode authentication needs TLS (Flower refuses it on an insecure connection)")
        self.groups = [list(g) for g in groups]
        self.tls, self.auth, self.workers = tls, auth, workers
        self.threads = threads or max(1, (os.cpu_count() or 1) // max(1, len(self.groups)))
        self._own_home = home is None
        self.home = Path(tempfile.mkdtemp(prefix="fedtune-flwr-")) if home is None else Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.home.chmod(0o700)
        self.log_dir = Path(log_dir) if log_dir else self.home / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.certificates: dict[str, Path] | None = None
        self.processes: Processes | None = None
        self.port = 0
        self.nodes: list[subprocess.Popen] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        return flower_env(self.home, FLWR_SUPEREXEC_TASK_POLL_INTERVAL=str(TASK_POLL_S), **extra)

    def __enter__(self) -> LoopbackDeployment:
        self.processes = Processes(self.log_dir)
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        if self.tls:
            self.certificates = generate_certificates(self.home / "certificates")
        self.port = free_ports(1)[0]
        link = self.processes.start(
            "superlink", superlink_args("127.0.0.1", self.port, self.certificates, self.auth), self.env()
        )
        wait_for_port(self.port, link, log=self.processes.log_of(link))
        self.connection = write_flower_config(self.home, self.address, self.certificates and self.certificates["ca"])
        for i, clients in enumerate(self.groups):
            key = self.register_node_key(f"node{i}") if self.auth else None
            self.start_supernode(clients, name=f"supernode{i}", private_key=key)

    def register_node_key(self, name: str) -> Path:
        """A fresh key pair for a SuperNode, its public key registered with the SuperLink; the
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
    ) -> subprocess.Popen:
        """Start a worker (unless ``workers=False``) and a SuperNode playing ``clients``;
        ``insecure``: connect without TLS even when the SuperLink has it (tests)."""
        worker = None
        if self.workers:
            worker = str(self.home / f"{name}.sock")
            proc = self.processes.start(f"{name}-worker", worker_args(worker, self.threads), self.env())
            if wait:
                wait_for_worker(worker, proc, self.processes.log_of(proc))
        port = free_ports(1)[0]
        roots = None if insecure or self.certificates is None else self.certificates["ca"]
        node = self.processes.start(
            name,
            supernode_args(self.address, port, clients, roots, private_key, worker, self.threads, extra),
            self.env(),
        )
        if wait:
            wait_for_port(port, node, log=self.processes.log_of(node))
        self.nodes.append(node)
        return node

    def run(
        self,
        config: Any,
        on_round: Callable | None = None,
        resume: bool = False,
        timeout: float | None = 600,
        clipping_norm: float | None = None,
    ) -> dict:
        """Run ``config`` on this deployment (:func:`run_app`); Ctrl-C asks the ServerApp to stop
        after the current round's checkpoint."""
        return run_app(
            config,
            self.home,
            self.connection,
            self.processes,
            on_round,
            resume,
            timeout,
            clipping_norm,
            interrupt=self.interrupt_server,
        )

    def interrupt_server(self) -> None:
        """Send SIGINT to the ServerApp process (``flwr-serverapp``): it stops after its round's checkpoint."""
        import psutil

        self.processes.reaper.poll()
        for proc in list(self.processes.reaper.seen.values()):
            try:
                if "flwr-serverapp" in " ".join(proc.cmdline()):
                    proc.send_signal(signal.SIGINT)
            except psutil.Error:
                pass

    def __exit__(self, *exc: object) -> None:
        if self.processes is not None:
            self.processes.stop()
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)


def run_flower_deployment(
    config: Any,
    on_round: Callable | None = None,
    on_start: Callable | None = None,
    resume: bool = False,
    tls: bool = False,
    auth: bool = False,
    timeout: float | None = 3600,
    keep_logs: Path | None = None,
) -> dict:
    """``engine = "flower"``: run ``config`` on a fresh :class:`LoopbackDeployment` (nodes:
    :func:`default_nodes`, clients in contiguous groups, cores / nodes torch threads each unless
    ``train.threads``) and stop it; the run folder is the embedded engine's. ``on_start`` gets
    this process's RunContext (for the banner); ``timeout`` bounds the wait for nodes and for each
    round's replies (``federation.round_timeout_s`` overrides it for rounds). ``keep_logs``: copy
    the deployment's logs there."""
    from fedtune.runtime import RunContext

    context = RunContext(config)
    config = context.config
    if on_start is not None:
        on_start(context)
    groups = client_groups(config.federation.num_clients, default_nodes(config))
    with LoopbackDeployment(groups, tls=tls, auth=auth, threads=config.train.threads) as deployment:
        try:
            return deployment.run(config, on_round, resume, timeout)
        finally:
            if keep_logs is not None:
                shutil.copytree(deployment.log_dir, keep_logs, dirs_exist_ok=True)
