"""Flower's command lines and files, shared by the loopback deployment and ``fedtune deploy``: the
commands and their environment, SuperLink / SuperNode / executor arguments, the Flower config and
the fedtune Flower App."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedtune.process import DeploymentError

if TYPE_CHECKING:
    from fedtune.config import RunConfig

TASK_POLL_S = 0.2  # FLWR_SUPEREXEC_TASK_POLL_INTERVAL of the loopback SuperLink: a run's ServerApp start (Flower: 1 s)
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
    host: str,
    port: int,
    certificates: dict[str, Path] | None = None,
    auth: bool = False,
    extra: Sequence[str] = (),
    executor_secret: Path | None = None,
) -> list[str]:
    """``flower-superlink`` arguments, listening on ``host``:``port``: TLS from ``certificates``
    (``ca``, ``cert``, ``key``) or ``--insecure``; ``auth``: admit only registered SuperNodes;
    ``executor_secret``: process isolation, each run's ServerApp task claimed with this secret
    (:mod:`.inprocess`; None: Flower's SuperExec starts a ``flwr-serverapp`` process per run);
    ``extra``: appended."""
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
    if executor_secret is not None:
        args += ["--isolation", "process", "--superexec-auth-secret-file", str(executor_secret)]
    return args + list(extra)


def supernode_args(
    superlink: str,
    port: int,
    clients: Sequence[int],
    root_certificates: Path | None = None,
    private_key: Path | None = None,
    executor_secret: Path | None = None,
    threads: int | None = None,
    extra: Sequence[str] = (),
    budget: Mapping[str, Any] | None = None,
) -> list[str]:
    """``flower-supernode`` arguments for a node playing ``clients``, connecting to ``superlink``
    (its Runtime API on 127.0.0.1:``port``): TLS with ``root_certificates`` (the CA that signed the
    SuperLink's certificate) or ``--insecure``; ``private_key``: authenticate with it;
    ``executor_secret``: process isolation, its tasks claimed by the node's fedtune executor
    (:mod:`.executor`) with this secret (None: Flower's own SuperExec and a ``flwr-clientapp``
    process per message); ``threads``: its torch threads; ``extra``: appended; ``budget``: the node's
    own resources as node-config entries (``{"memory-gib": 8, "measure-speed": True}``:
    :mod:`fedtune.planning.node_report`)."""
    from fedtune.engines.flower.codec import NODE_CLIENTS, NODE_THREADS, format_clients

    node_config = [f'{NODE_CLIENTS}="{format_clients(clients)}"']
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
    if executor_secret is not None:
        args += ["--isolation", "process", "--superexec-auth-secret-file", str(executor_secret)]
    return args + list(extra)


def executor_args(port: int, secret: Path, threads: int | None) -> list[str]:
    """The command of a node's fedtune executor (:func:`fedtune.engines.flower.executor.run_executor`)
    for the SuperNode whose Runtime API is on 127.0.0.1:``port``, claiming tasks with ``secret``,
    with ``threads`` torch threads (None: torch's choice)."""
    return [
        sys.executable,
        "-m",
        "fedtune.engines.flower.executor",
        "--runtime-api-address",
        f"127.0.0.1:{port}",
        "--secret-file",
        str(secret),
        "--threads",
        str(int(threads or 0)),
    ]


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
    """SuperNodes of a loopback deployment of ``config``: ``placement.nodes``, else min(clients sampled per
    round, cores); one per client under ``secure_aggregation.enabled``."""
    fed = config.federation
    if config.secure_aggregation.enabled:  # SecAgg+ keys and state are a node's
        return fed.num_clients
    nodes: int = config.placement.nodes or min(fed.sample_size(), os.cpu_count() or 1)
    return max(1, min(nodes, fed.num_clients))


def client_groups(num_clients: int, nodes: int) -> list[list[int]]:
    """Client ids ``0..num_clients-1`` in ``nodes`` contiguous groups of (nearly) equal size."""
    bounds = [round(i * num_clients / nodes) for i in range(nodes + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(nodes)]
