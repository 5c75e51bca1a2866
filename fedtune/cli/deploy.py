"""``fedtune deploy``: Flower processes for real machines (SuperLink, SuperNode, run, certificates, node keys)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from fedtune.cli.common import console, fail
from fedtune.errors import FedtuneError

deploy_app = typer.Typer(no_args_is_help=True, help="Flower deployment on real machines (see docs/flower.md).")
EXTRA = typer.Option([], "--flower-arg", help="passed to the Flower command as is (repeat)")


def _security(insecure: bool, certificates: Path | None, what: str) -> None:
    if insecure == (certificates is not None):
        fail(f"deploy {what}: give --insecure or the TLS certificate option (not both, not neither)")
    if certificates is not None and not certificates.exists():
        fail(f"deploy {what}: {certificates} not found")


def _check_port(port: int, what: str) -> None:
    if not 1 <= port <= 65535:
        fail(f"deploy {what} --port {port}: expected a port number 1-65535")


def _wait(procs) -> int:
    """Wait until a process ends (or Ctrl-C, or SIGTERM); its exit code."""
    import signal
    import time

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 130
    return next(p.returncode for p in procs if p.poll() is not None)


@deploy_app.command("superlink")
def deploy_superlink(
    host: str = typer.Option(
        "127.0.0.1",
        help="address to listen on (Fleet, Control and runtime APIs); the default, loopback, admits this "
        "machine only; another address exposes them to its network and needs --certificates (or --insecure)",
    ),
    port: int = typer.Option(9092, help="port of the SuperLink's APIs"),
    certificates: Path | None = typer.Option(
        None, help="folder with ca.crt, server.pem, server.key (TLS; `fedtune deploy certificates` makes a test set)"
    ),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (trusted networks only)"),
    auth: bool = typer.Option(
        False, "--auth", help="admit only SuperNodes registered with `flwr supernode register` (needs TLS)"
    ),
    extra: list[str] = EXTRA,
) -> None:
    """Start a Flower SuperLink for fedtune (flower-superlink, no runtime dependency installation).
    Whoever reaches its address can submit runs, and a submitted app's code runs on the SuperNodes:
    it listens on loopback unless --host says otherwise, and then only with TLS or --insecure."""
    from fedtune.engines.flower.commands import flower_env, superlink_args
    from fedtune.process import Processes, is_loopback

    _check_port(port, "superlink")
    if certificates is None and not insecure and not is_loopback(host):
        fail(
            f"deploy superlink --host {host}: not a loopback address, so anyone on that network could submit "
            "runs: give --certificates (and --auth), or --insecure on a network you trust"
        )
    if certificates is not None or not is_loopback(host):
        _security(insecure, certificates, "superlink")
    if auth and certificates is None:
        fail("deploy superlink: --auth needs TLS (--certificates); Flower refuses authentication without it")
    certs = (
        None
        if certificates is None
        else {"ca": certificates / "ca.crt", "cert": certificates / "server.pem", "key": certificates / "server.key"}
    )
    for path in (certs or {}).values():
        if not path.is_file():
            fail(f"deploy superlink --certificates: {path} not found")
    logs = Path.cwd()
    procs = Processes(logs)
    try:
        link = procs.start("superlink", superlink_args(host, port, certs, auth, extra), flower_env())
        console.print(f"SuperLink on {host}:{port} (log: {logs / 'superlink.log'}); Ctrl-C stops it")
        code = _wait([link])
    finally:
        procs.stop()
    raise typer.Exit(code)


@deploy_app.command("supernode")
def deploy_supernode(
    superlink: str = typer.Option(..., help="the SuperLink's address, HOST:PORT"),
    clients: str = typer.Option(..., help="fedtune client ids this node plays: 3, 0-4 or 0,2,5-7"),
    port: int = typer.Option(9094, help="port of this SuperNode's local runtime API"),
    root_certificates: Path | None = typer.Option(None, help="CA certificate that signed the SuperLink's (TLS)"),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (trusted networks only)"),
    auth_key: Path | None = typer.Option(None, help="this node's private key (OpenSSH EC; its .pub registered)"),
    threads: int | None = typer.Option(None, min=1, help="torch threads (default: all cores)"),
    executor: bool = typer.Option(
        True,
        help="a warm fedtune executor next to the node answers every message in one process (else Flower "
        "starts a flwr-clientapp process per message, which loads the model each time)",
    ),
    memory_gib: float | None = typer.Option(None, help="budget: memory for one client's local training (GiB)"),
    bandwidth_mb: float | None = typer.Option(None, help="budget: MB a client may upload per round"),
    deadline_s: float | None = typer.Option(None, help="budget: seconds a client may take per round"),
    speed: float | None = typer.Option(None, help="relative compute speed (1: the planner's reference)"),
    measure_memory: bool = typer.Option(False, "--measure-memory", help="state the memory available at start"),
    measure_speed: bool = typer.Option(False, "--measure-speed", help="state the speed a short probe measures"),
    extra: list[str] = EXTRA,
) -> None:
    """Start a Flower SuperNode playing fedtune clients, with its warm executor; Ctrl-C stops both. Its
    budget (the options below) is this node's own: it reports it to the server, which plans each of
    its clients from it, and it refuses a setting that the budget cannot hold."""
    import math
    import tempfile

    from fedtune.engines.flower.codec import parse_clients
    from fedtune.engines.flower.commands import executor_args, flower_env, supernode_args
    from fedtune.engines.flower.executor import write_secret
    from fedtune.process import Processes, wait_for_port

    _check_port(port, "supernode")
    _security(insecure, root_certificates, "supernode")
    if auth_key is not None and not auth_key.is_file():
        fail(f"deploy supernode --auth-key: {auth_key} not found")
    try:
        ids = parse_clients(clients)
    except ValueError:
        ids = []
    if not ids:
        fail(f"deploy supernode --clients: expected ids like 3, 0-4 or 0,2,5-7 (got {clients!r})")
    # the SuperNode runs in its own folder: paths as given here, made absolute
    root_certificates = root_certificates.resolve() if root_certificates is not None else None
    auth_key = auth_key.resolve() if auth_key is not None else None
    stated = {"memory-gib": memory_gib, "bandwidth-mb": bandwidth_mb, "deadline-s": deadline_s, "speed": speed}
    for key, value in stated.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            fail(f"deploy supernode --{key}: expected a positive finite number (got {value:g})")
    budget: dict[str, float | bool] = {k: v for k, v in stated.items() if v is not None}
    budget.update({k: True for k, on in (("measure-memory", measure_memory), ("measure-speed", measure_speed)) if on})
    home = Path(tempfile.mkdtemp(prefix="fedtune-node-"))
    home.chmod(0o700)
    procs = Processes(home)
    try:
        secret = write_secret(home / "executor.secret") if executor else None
        node = procs.start(
            "supernode",
            supernode_args(superlink, port, ids, root_certificates, auth_key, secret, threads, extra, budget),
            flower_env(),
        )
        if secret is not None:
            try:
                wait_for_port(port, node, log=procs.log_of(node))
            except FedtuneError as exc:
                fail(f"deploy supernode: {exc}")
            procs.start("executor", executor_args(port, secret, threads), flower_env())
        console.print(f"SuperNode for clients {clients} -> {superlink} (logs: {home}); Ctrl-C stops it")
        code = _wait([p for _, p, _ in procs.started])
    finally:
        procs.stop()
    raise typer.Exit(code)


@deploy_app.command("run")
def deploy_run(
    recipe: Path | None = typer.Argument(None, help="TOML recipe (see configs/)"),
    superlink: str = typer.Option(..., help="the SuperLink's address, HOST:PORT"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override: key=value"),
    root_certificates: Path | None = typer.Option(None, help="CA certificate that signed the SuperLink's (TLS)"),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (trusted networks only)"),
    timeout: float = typer.Option(0, help="seconds to wait for nodes and for each round's replies (0: no limit)"),
    clipping_norm: float = typer.Option(
        0, help="> 0: nodes clip each update to this L2 norm (Flower's fixedclipping_mod)"
    ),
) -> None:
    """Submit a recipe to a running SuperLink (flwr run) and stream its logs; the run folder is
    written on the SuperLink's machine (output_dir there)."""
    import tempfile

    from fedtune.config import load_config
    from fedtune.engines.flower.commands import write_flower_config
    from fedtune.engines.flower.deployment import run_app
    from fedtune.process import Processes

    _security(insecure, root_certificates, "run")
    procs = None
    try:
        config = load_config(recipe, set_)
        home = Path(tempfile.mkdtemp(prefix="fedtune-run-"))
        connection = write_flower_config(home, superlink, root_certificates and root_certificates.resolve())
        procs = Processes(home)
        run_app(
            config,
            home,
            connection,
            procs,
            timeout=timeout,
            clipping_norm=clipping_norm,
            on_output=lambda text: print(text, end="", file=sys.stderr),
        )
    except FedtuneError as exc:
        fail(str(exc), code=exc.exit_code)
    finally:
        if procs is not None:
            procs.stop()


@deploy_app.command("certificates")
def deploy_certificates(
    out: Path = typer.Argument(..., help="folder for ca.crt, server.pem, server.key"),
    host: list[str] = typer.Option(
        ["127.0.0.1", "localhost"], "--host", help="the SuperLink's IP or DNS name (repeat)"
    ),
) -> None:
    """A self-signed CA and a SuperLink certificate for trials (use your own PKI in production)."""
    from fedtune.certificates import generate_certificates

    try:
        paths = generate_certificates(out, host)
    except FedtuneError as exc:
        fail(f"deploy certificates: {exc}")
    for path in paths.values():
        console.print(f"wrote {path}")


@deploy_app.command("node-key")
def deploy_node_key(
    out: Path = typer.Argument(..., help="folder for the key pair"),
    name: str = typer.Option("supernode", help="file name of the private key (public: NAME.pub)"),
) -> None:
    """A SuperNode authentication key pair; register NAME.pub with `flwr supernode register`."""
    from fedtune.certificates import generate_node_key

    try:
        paths = generate_node_key(out, name)
    except FedtuneError as exc:
        fail(f"deploy node-key: {exc}")
    for path in paths:
        console.print(f"wrote {path}")
