"""Flower's command lines and files, shared by the loopback deployment and ``fedtune deploy``: the
commands and their environment, SuperLink / SuperNode / worker arguments, the Flower config and
the fedtune Flower App."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedtune.process import DeploymentError, log_tail

if TYPE_CHECKING:
    from fedtune.config import RunConfig

TASK_POLL_S = 0.05  # FLWR_SUPEREXEC_TASK_POLL_INTERVAL of the loopback SuperNodes (Flower: 1 s)
APP_CONFIG_KEYS = ("recipe", "config", "overrides", "resume", "timeout", "clipping-norm")

APP_PYPROJECT = """\
# fedtune as a Flower App (written by fedtune.engines.flower.commands.write_app).
# fedtune itself must be installed where the SuperLink and SuperNodes run (this FAB ships no code).
[project]
name = "fedtune-flower"
version = "0.1.0"
description = "fedtune methods as a Flower App"
dependencies = []

[tool.flwr.app]
publisher = "fedtune"

[tool.flwr.app.components]
serverapp = "fedtune.engines.flower.serverapp:server_app"
clientapp = "fedtune.engines.flower.clientapp:client_app"

[tool.flwr.app.config]
recipe = ""          # a fedtune TOML recipe (path as seen by the ServerApp and ClientApp processes)
config = ""          # or a whole fedtune RunConfig as JSON (what `fedtune run`/`fedtune deploy run` submit)
overrides = ""       # "key=value; key=value", as `fedtune run --set`
resume = false       # continue the run folder from its last checkpoint
timeout = 0.0        # seconds to wait for nodes and for a round's replies (0: no limit)
clipping-norm = 0.0  # > 0: the nodes clip each update to this L2 norm (Flower's fixedclipping_mod)
"""


def flower_command(name: str) -> str:
    """Path of the Flower command ``name`` (``flower-superlink``, ``flwr``, ...): beside this Python first."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise DeploymentError(f"{name}: not found (install flwr in this environment)")
    return found


def flower_env(home: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of every deployment process: no runtime dependency installation (it
    would install a CUDA torch), this Python's bin first on PATH, ``FLWR_HOME`` = ``home`` when given,
    and the ``extra`` variables."""
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


# -- command lines (shared by the loopback deployment and `fedtune deploy`) ----------------------
def superlink_args(
    host: str, port: int, certificates: dict[str, Path] | None = None, auth: bool = False, extra: Sequence[str] = ()
) -> list[str]:
    """``flower-superlink`` arguments, listening on ``host``:``port``: TLS from ``certificates``
    (``ca``, ``cert``, ``key``) or ``--insecure``; ``auth``: admit only registered SuperNodes; ``extra``: appended."""
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
    budget: Mapping[str, Any] | None = None,
) -> list[str]:
    """``flower-supernode`` arguments for a node playing ``clients``, connecting to ``superlink`` (its
    fleet ``port``): TLS with
    ``root_certificates`` (the CA that signed the SuperLink's certificate) or ``--insecure``;
    ``private_key``: authenticate with it; ``worker``: the node's fedtune worker socket; ``threads``:
    its torch threads; ``extra``: appended; ``budget``: the node's own resources as node-config
    entries (``{"memory-gib": 8, "measure-speed": True}``: :mod:`fedtune.planning.node_report`)."""
    from fedtune.engines.flower.codec import NODE_CLIENTS, NODE_THREADS, NODE_WORKER, format_clients

    node_config = [f'{NODE_CLIENTS}="{format_clients(clients)}"']
    if worker:
        node_config.append(f'{NODE_WORKER}="{worker}"')
    if threads:
        node_config.append(f"{NODE_THREADS}={int(threads)}")
    node_config += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (budget or {}).items()]
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
    """The command of a node's fedtune worker (:func:`fedtune.engines.flower.worker.run_worker`) on
    ``socket_path`` with ``threads`` torch threads (None: torch's choice)."""
    code = (
        "import sys; from fedtune.engines.flower.worker import run_worker; "
        "run_worker(sys.argv[1], int(sys.argv[2]) or None)"
    )
    return [sys.executable, "-c", code, socket_path, str(int(threads or 0))]


def wait_for_worker(socket_path: str, proc: subprocess.Popen[Any], log: Path | None, timeout: float = 120) -> None:
    """Wait until the worker process ``proc`` serves ``socket_path`` (its socket and key exist); a
    DeploymentError, with the tail of its ``log``, when it exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not (Path(socket_path).exists() and Path(f"{socket_path}.key").exists()):
        if proc.poll() is not None:
            raise DeploymentError(f"fedtune worker exited with code {proc.returncode}{log_tail(log)}")
        if time.monotonic() > deadline:
            raise DeploymentError(f"fedtune worker {socket_path} not ready after {timeout:.0f} s{log_tail(log)}")
        time.sleep(0.05)


def write_flower_config(home: Path, address: str, root_certificates: Path | None = None, name: str = "fedtune") -> str:
    """``FLWR_HOME/config.toml`` (``home``) naming the SuperLink connection ``name`` at ``address`` for
    ``flwr`` commands (TLS with ``root_certificates``, else insecure)."""
    home.mkdir(parents=True, exist_ok=True)
    tls = f'root-certificates = "{root_certificates}"\n' if root_certificates else "insecure = true\n"
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n{tls}'
    )
    return name


def write_app(folder: Path) -> Path:
    """The fedtune Flower App in ``folder`` (a ``pyproject.toml`` naming fedtune's ServerApp and ClientApp)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder


def default_nodes(config: RunConfig) -> int:
    """SuperNodes of a loopback deployment of ``config``: ``federation.nodes``, else min(clients sampled per
    round, cores); one per client under ``federation.secure_aggregation``."""
    fed = config.federation
    if getattr(fed, "secure_aggregation", False):  # SecAgg+ keys and state are a node's
        return fed.num_clients
    nodes: int = getattr(fed, "nodes", None) or min(fed.sample_size(), os.cpu_count() or 1)
    return max(1, min(nodes, fed.num_clients))


def client_groups(num_clients: int, nodes: int) -> list[list[int]]:
    """Client ids ``0..num_clients-1`` in ``nodes`` contiguous groups of (nearly) equal size."""
    bounds = [round(i * num_clients / nodes) for i in range(nodes + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(nodes)]
