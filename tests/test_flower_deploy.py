"""Real loopback deployments (SuperLink, workers, SuperNodes and ``flwr run`` on 127.0.0.1, in a
private FLWR_HOME): TLS and SuperNode authentication refuse strangers, Ctrl-C stops a run after
its round's checkpoint and stops every process, and the pieces that need no processes.

The deployments take a minute or more on a loaded 2-core machine: those tests are ``slow``
(``pytest -m slow tests/test_flower_deploy.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedtune.certificates import generate_certificates, generate_node_key
from fedtune.config import load_config
from fedtune.engines.flower import commands
from fedtune.engines.flower.deployment import LoopbackDeployment
from tests import test_flower

TINY = [x for x in test_flower.TINY if not x.startswith("rounds=")]  # the deployment's own default rounds


@pytest.fixture
def started_here(monkeypatch):
    """A function giving the PIDs of the processes this test started that still run (not those of
    another xdist worker: each test's processes inherit a tag of its own in their environment,
    found even after they are re-parented)."""
    import uuid

    import psutil

    tag = uuid.uuid4().hex
    monkeypatch.setenv("FEDTUNE_TEST_PROCESS_TAG", tag)

    def alive() -> set[int]:
        out = set()
        for proc in psutil.process_iter(["pid", "uids"]):
            try:
                if proc.info["uids"].real != os.getuid() or proc.pid == os.getpid():
                    continue
                if proc.environ().get("FEDTUNE_TEST_PROCESS_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                    out.add(proc.pid)
            except (psutil.Error, TypeError):
                pass
        return out

    return alive


def _online_nodes(d: LoopbackDeployment) -> list[str]:
    done = subprocess.run(
        [commands.flower_command("flwr"), "supernode", "list", d.connection, "--format", "json"],
        env=d.env(),
        cwd=d.home,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return [n["node-id"] for n in json.loads(done.stdout)["nodes"] if n["status"] == "online"]


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


# -- no processes ----------------------------------------------------------------------------------
def test_certificates_and_node_keys_load_as_flower_needs(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    paths = generate_certificates(tmp_path, ["127.0.0.1", "superlink.example"])
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["superlink.example"]
    assert oct(paths["key"].stat().st_mode & 0o777) == "0o600"
    private, public = generate_node_key(tmp_path, "node")
    assert isinstance(load_ssh_private_key(private.read_bytes(), None), ec.EllipticCurvePrivateKey)
    assert isinstance(load_ssh_public_key(public.read_bytes()), ec.EllipticCurvePublicKey)


def test_deployment_pieces(tmp_path):
    assert commands.client_groups(10, 3) == [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]]
    assert commands.client_groups(1000, 2)[1] == list(range(500, 1000))
    config = load_config(None, [*TINY, "federation.num_clients=1000", "federation.clients_per_round=10"])
    assert commands.default_nodes(config) == min(10, os.cpu_count() or 1)
    assert commands.default_nodes(load_config(None, [*TINY, "placement.nodes=5"])) == 2  # at most one per client
    args = commands.supernode_args("h:1", 5, [0, 1, 2, 7], Path("ca.crt"), Path("k"), Path("/s.secret"), 3)
    node_config = args[args.index("--node-config") + 1]
    assert node_config == 'fedtune-clients="0-2,7" fedtune-threads=3'
    assert args[-8:] == ["--root-certificates", "ca.crt", "--auth-supernode-private-key", "k"] + [
        "--isolation",
        "process",
        "--superexec-auth-secret-file",
        "/s.secret",
    ]
    assert "--isolation" not in commands.supernode_args("h:1", 5, [0], executor_secret=None)  # stock Flower
    assert "--insecure" in commands.superlink_args("0.0.0.0", 1)
    assert "--enable-supernode-auth" in commands.superlink_args("0.0.0.0", 1, {"ca": 1, "cert": 2, "key": 3}, True)
    with pytest.raises(ValueError, match="needs TLS"):
        LoopbackDeployment([[0]], auth=True)


def test_a_deployment_starts_nothing_outside_its_with_block(tmp_path):
    with pytest.raises(RuntimeError, match="with LoopbackDeployment"):
        LoopbackDeployment([[0]], home=tmp_path).start_supernode([0], "supernode0")
    assert not list(tmp_path.glob("*.sock"))


def test_the_written_app_matches_flower_app(tmp_path):
    """flower_app/pyproject.toml (for `flwr run flower_app ...` by hand) names the same apps and
    run config keys as the app fedtune writes for its own deployments."""
    import tomllib

    written = tomllib.loads(commands.write_app(tmp_path).joinpath("pyproject.toml").read_text())
    shipped = tomllib.loads((Path(__file__).resolve().parents[1] / "flower_app" / "pyproject.toml").read_text())
    assert shipped["tool"]["flwr"]["app"]["components"] == written["tool"]["flwr"]["app"]["components"]
    assert shipped["tool"]["flwr"]["app"]["config"] == written["tool"]["flwr"]["app"]["config"]
    assert tuple(written["tool"]["flwr"]["app"]["config"]) == commands.APP_CONFIG_KEYS


# -- TLS and authentication ------------------------------------------------------------------------------
@pytest.mark.slow
def test_tls_and_authentication_admit_registered_nodes_only(tmp_path, started_here):
    import httpx

    config = load_config(None, [*TINY, "rounds=1", f"output_dir={tmp_path / 'runs'}"])
    with LoopbackDeployment([[0], [1]], tls=True, auth=True, log_dir=tmp_path / "logs") as d:
        # the registered nodes connect over TLS and a run works
        summary = d.run(config, timeout=300)
        assert summary["engine"] == "flower" and summary["dropped"] == 0
        registered = _online_nodes(d)
        assert len(registered) == 2

        # a SuperNode with a key the SuperLink does not know is refused: it gives up, never online
        key, _ = generate_node_key(d.home / "keys", "stranger")
        stranger = d.start_supernode([0], name="stranger", private_key=key, wait=False)
        _wait_for(lambda: stranger.poll() is not None, 120, "the unregistered SuperNode was not refused")
        assert stranger.returncode != 0
        assert "Failed to activate SuperNode" in (tmp_path / "logs" / "stranger.log").read_text()

        # a plaintext SuperNode cannot connect to the TLS SuperLink ...
        plain = d.start_supernode([1], name="plaintext", insecure=True, wait=False)
        _wait_for(
            lambda: "Connection attempt failed" in (tmp_path / "logs" / "plaintext.log").read_text(),
            120,
            "the plaintext SuperNode was not refused",
        )
        assert plain.poll() is None or plain.returncode != 0
        assert sorted(_online_nodes(d)) == sorted(registered)
        # ... nor can any plaintext HTTP client, while one that trusts the CA completes the handshake
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://{d.address}/", timeout=10)
        assert httpx.get(f"https://{d.address}/", verify=str(d.certificates["ca"]), timeout=10).status_code > 0
    assert not started_here(), "a deployment process outlived the deployment"


# -- Ctrl-C ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_stops_after_the_round_checkpoint_and_every_process(tmp_path, started_here):
    out = tmp_path / "runs"
    args = [
        sys.executable,
        "-m",
        "fedtune.cli",
        "run",
        *[f"--set={x}" for x in TINY],
        "--set=rounds=4",
        "--set=engine=flower",
        f"--set=output_dir={out}",
    ]
    env = {**os.environ, "COLUMNS": "200"}
    metrics = out / "fedit-tweets-s3" / "metrics.jsonl"
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 400, "no round finished")
        proc.send_signal(signal.SIGINT)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, text[-2000:]
    assert "fedtune run --resume" in text
    done = [json.loads(x)["round"] for x in metrics.read_text().splitlines()]
    assert 1 <= len(done) < 4 and done == list(range(1, len(done) + 1))
    _wait_for(lambda: not started_here(), 30, "a deployment process outlived Ctrl-C")

    # resume on the same engine finishes the run
    again = subprocess.run(
        [sys.executable, "-m", "fedtune.cli", "run", "--resume", str(metrics.parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-2000:]
    assert [json.loads(x)["round"] for x in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert json.loads((metrics.parent / "summary.json").read_text())["engine"] == "flower"
    assert not started_here()


# -- who can reach a SuperLink, and the keys ---------------------------------------------------------
def test_key_files_are_private_from_creation_and_never_overwritten(tmp_path, monkeypatch):
    """Private keys are created with mode 0600 (os.open's mode, O_EXCL: no moment world-readable,
    never through an existing file or link); a second set into the same folder, or a folder that
    is a file, stops with one line and changes nothing."""
    from fedtune.certificates import CertificateError

    created = {}
    real_open = os.open

    def recording_open(path, flags, mode=0o777, *args, **kwargs):
        created[Path(path).name] = (flags, mode)
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    paths = generate_certificates(tmp_path / "tls")
    private, public = generate_node_key(tmp_path / "keys", "node")
    assert created["server.key"][1] == created["node"][1] == 0o600
    assert created["ca.crt"][1] == created["node.pub"][1] == 0o644
    assert all(flags & os.O_EXCL for flags, _ in created.values())
    before = {p: p.read_bytes() for p in [*paths.values(), private, public]}
    with pytest.raises(CertificateError, match=r"ca.crt exists: keys are never overwritten"):
        generate_certificates(tmp_path / "tls")
    with pytest.raises(CertificateError, match=r"node exists"):
        generate_node_key(tmp_path / "keys", "node")
    assert {p: p.read_bytes() for p in before} == before
    paths["ca"].unlink()
    with pytest.raises(CertificateError, match=r"server.pem exists"):  # every file is checked before any is written
        generate_certificates(tmp_path / "tls")
    assert not paths["ca"].exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CertificateError, match=r"file: not a folder"):
        generate_certificates(tmp_path / "file")


def test_deploy_commands_refuse_an_exposed_superlink_and_existing_keys_in_one_line(tmp_path, started_here):
    from typer.testing import CliRunner

    from fedtune.cli import app

    runner = CliRunner()
    for args, expected in [
        (["superlink", "--host", "0.0.0.0"], "deploy superlink --host 0.0.0.0: not a loopback address"),
        (["superlink", "--host", "10.1.2.3", "--port", "1"], "--host 10.1.2.3: not a loopback address"),
        (["superlink", "--auth"], "--auth needs TLS"),
        (["superlink", "--insecure", "--certificates", str(tmp_path)], "not both, not neither"),
        (["certificates", str(tmp_path / "taken")], "taken: not a folder"),
        (["superlink", "--port", "70000"], "deploy superlink --port 70000: expected a port number 1-65535"),
        (["supernode", "--superlink", "x:1", "--clients", "0", "--insecure", "--port", "0"], "--port 0: expected"),
    ]:
        (tmp_path / "taken").write_text("a file")
        result = runner.invoke(app, ["deploy", *args])
        assert result.exit_code == 2, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1 and expected in result.output, (args, result.output)
    assert not started_here()  # nothing was started


def test_superlink_listens_on_loopback_only_by_default(tmp_path, started_here):
    """`fedtune deploy superlink` with no --host (and no TLS: allowed on loopback) binds every
    listening socket of its process tree to a loopback address; it stops by its PID."""
    import ipaddress

    import psutil

    from fedtune.process import free_ports, wait_for_port

    (port,) = free_ports(1)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedtune.cli", "deploy", "superlink", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_port(port, proc, timeout=120)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        listening = [c.laddr for p in tree for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert any(a.port == port for a in listening), listening
        assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    _wait_for(lambda: not started_here(), 30, "the SuperLink's processes to stop")


def test_deploy_supernode_hands_flower_absolute_paths_and_its_executor_the_secret(tmp_path, monkeypatch):
    """`fedtune deploy supernode` runs the SuperNode in a folder of its own: the certificate and key
    paths given relative to where the command runs reach Flower absolute (docs/flower.md gives them
    relative), and the SuperNode runs in process isolation with a 0600 secret its executor shares."""
    from typer.testing import CliRunner

    from fedtune.cli import app
    from fedtune.process import Processes

    (tmp_path / "ca.crt").write_text("-")
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "node0").write_text("-")
    started = []

    class Exited:
        returncode, args = 1, ["flower-supernode"]

        def poll(self):
            return 1

    def start(self, name, args, env, cwd=None):
        started.append((name, [str(a) for a in args]))
        return Exited()

    monkeypatch.setattr(Processes, "start", start)
    monkeypatch.chdir(tmp_path)
    args = ["deploy", "supernode", "--superlink", "10.0.0.1:9092", "--root-certificates", "ca.crt"]
    result = CliRunner().invoke(app, [*args, "--auth-key", "keys/node0", "--clients", "0-4", "--port", "9094"])
    (name, command), *_ = started
    assert name == "supernode" and result.exit_code == 2  # the fake SuperNode "exited": one line, exit 2
    assert command[command.index("--root-certificates") + 1] == str(tmp_path / "ca.crt")
    assert command[command.index("--auth-supernode-private-key") + 1] == str(tmp_path / "keys" / "node0")
    assert command[command.index("--isolation") + 1] == "process"
    secret = Path(command[command.index("--superexec-auth-secret-file") + 1])
    assert secret.is_absolute() and oct(secret.stat().st_mode & 0o777) == "0o600"
