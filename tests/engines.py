"""Every guarantee on every engine (issue 48; DESIGN.md, "Every guarantee on every engine"): a test
that states a README guarantee takes the engine as a parameter (the ``engine`` fixture of
tests/conftest.py: its ``ENGINES``) and reads runs made here, each once per test session
(:class:`EngineRuns`, the session fixture ``engine_runs``) through a real entry point:

- :meth:`EngineRuns.killed`: ``fedtune run`` killed with SIGKILL once round 1 is checkpointed (its
  whole process tree, as when the machine dies), then ``fedtune run --resume``: the ``honest``
  run of every engine, its output the resume's;
- :meth:`EngineRuns.cli`: ``fedtune run`` as a user types it, in a subprocess: its exit code,
  stdout and stderr are what the user sees (``failing`` on every engine; ``honest`` on the
  embedded engine, uninterrupted: the reference of the others);
- :meth:`EngineRuns.launched`: :func:`fedtune.launch.launch` in this process, with every reply the
  server receives recorded: from its Flower grid (:class:`RecordingGrid`; a deployment's ServerApp
  process runs :data:`recording_server_app`), or from the embedded engine's in-process transport
  (``private`` on every engine).

The cases (:data:`CASES`) are tiny FedIT runs under central DP with the test-only reproducible
noise, so that two runs can be compared field by field, and one torch thread per process, so that
every engine computes the same bits (measured: the three engines' checkpoints are equal): ``honest``
(4 clients, all sampled; on a deployment 2 nodes of 2 clients, requests in bundles), its neighbour
``failing`` (client 0 fails every request) and ``private`` (local DP, with SecAgg+ on the Flower
engines on 2 clients, one per node), where the server must receive nothing of a client but its
upload. A new engine is one more name in ``ENGINES``: every such test then runs on it, and fails
until the engine keeps the guarantee.

Cost: each Flower case starts Ray or a deployment (4 per engine); the tests that read them are
grouped on one xdist worker (tests/conftest.py), so that each run is made once per session.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from tests.conftest import DEPLOYMENTS, ENGINES, TINY

__all__ = ["DEPLOYMENTS", "ENGINES", "EngineRuns", "RecordingGrid", "console", "public_files"]

ROOT = Path(__file__).resolve().parents[1]
BASE = [  # tests/conftest.py's TINY (4 clients, 2 rounds), then what these cases change
    *TINY,
    "method=fedit",
    "federation.clients_per_round=4",  # q = 1: every client asked every round, so a neighbour shows each round
    "train.local_steps=2",
    "train.threads=1",  # one torch thread in every process: every engine computes the same bits
    "seed=5",
]
C, Z = 0.05, 0.8
SAME_NOISE = "privacy.insecure_reproducible_noise=true"  # tests only: two runs draw the same noise
CENTRAL = ['privacy.mode="central"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}", SAME_NOISE]
LOCAL = ['privacy.mode="local"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}", SAME_NOISE]
FAILING = "federation.profiles=[{failure_prob=1.0},{},{},{}]"  # client 0 fails every request
SLOW_S = 2.0
SLOW = f"federation.profiles=[{{}},{{}},{{}},{{delay_s={SLOW_S}}}]"  # client 3 sleeps before each answer
SECURE = ["secure_aggregation.enabled=true", "federation.num_clients=2", "federation.clients_per_round=2"]
CASES: dict[str, list[str]] = {
    "honest": CENTRAL,
    "failing": [*CENTRAL, FAILING],
    "private": LOCAL,  # on the Flower engines with SECURE too (the embedded engine refuses SecAgg+)
}
#: What a DP run may release: the mechanism's outputs (the state, its evaluation on the server's
#: test set, epsilon) and what the config and the server's own data say.
LINE_KEYS = {"round", "accuracy", "loss", "epsilon", "private"}
SUMMARY_KEYS = {
    "name", "method", "task", "data", "rounds", "seed", "final_accuracy", "best_accuracy", "final_loss",
    "majority_accuracy", "reference_name", "test_examples", "run_dir", "engine", "environment", "privacy",
}  # fmt: skip
MECHANISM_OUTPUTS = {"accuracy", "loss", "final_accuracy", "best_accuracy", "final_loss"}
#: Every file a DP run folder may hold (the adapter's files apart): the embedded engine's.
DP_FILES = {"config.toml", "run_config.json", "metrics.jsonl", "checkpoint.npz", "summary.json"}
#: The transport fields a reply may carry besides the method's metadata, by what the mode lets the
#: server learn: under local DP and SecAgg+ nothing but who answered, for which round.
ENVELOPE = {"meta", "cid", "round"}


def overrides(engine: str, case: str) -> list[str]:
    """The ``--set`` overrides of ``case`` on ``engine``."""
    extra = [*SECURE] if case == "private" and engine != "embedded" else []
    return [*BASE, *CASES[case], *extra, f'engine="{engine}"']


# -- what the server receives --------------------------------------------------------------------
def describe(reply: Any) -> dict[str, Any]:
    """A Flower reply as the server received it: each ConfigRecord's entries (bytes as their
    length, the fedtune ``meta`` JSON parsed), each ArrayRecord's array names, or its error."""
    if reply.has_error():
        return {"type": reply.metadata.message_type, "error": reply.error.reason}
    content = reply.content
    records = {}
    for name, record in content.config_records.items():
        entries = {}
        for key, value in record.items():
            if isinstance(value, bytes):
                value = len(value)
            elif isinstance(value, list) and value and isinstance(value[0], bytes):
                value = [len(v) for v in value]
            entries[key] = json.loads(value) if key == "meta" else value
        records[name] = entries
    arrays = {name: sorted(record) for name, record in content.array_records.items()}
    metrics = {name: dict(record) for name, record in content.metric_records.items()}
    return {"type": reply.metadata.message_type, "config": records, "arrays": arrays, "metrics": metrics}


class RecordingGrid(Grid):
    """``grid`` with every reply the server pulls from it appended to ``sink`` (JSON lines of
    :func:`describe`); everything else is ``grid``'s."""

    def __init__(self, grid: Grid, sink: Path) -> None:
        self.grid, self.sink = grid, Path(sink)

    def pull_messages(self, message_ids):
        got = list(self.grid.pull_messages(message_ids))
        with open(self.sink, "a") as out:
            for reply in got:
                out.write(json.dumps(describe(reply)) + "\n")
        return got

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def push_messages(self, messages):
        return self.grid.push_messages(messages)

    def create_message(self, *args, **kwargs):  # pragma: no cover - fedtune's server does not call it
        return self.grid.create_message(*args, **kwargs)

    def send_and_receive(self, *args, **kwargs):  # pragma: no cover - fedtune's server pushes and pulls
        return self.grid.send_and_receive(*args, **kwargs)

    def set_run(self, run_id):  # pragma: no cover
        return self.grid.set_run(run_id)

    @property
    def run(self):  # pragma: no cover
        return self.grid.run


def replies_file(config: Any) -> Path:
    """Where the replies of run ``config`` are recorded: beside its run folder, never in it."""
    return Path(config.output_dir) / f"{config.run_name}.replies.jsonl"


recording_server_app = ServerApp()


@recording_server_app.main()
def _recording_main(grid: Grid, context: Context) -> None:
    """fedtune's deployment ServerApp (``serverapp:server_app``) over a :class:`RecordingGrid`: what a
    test deployment runs in its ServerApp process (:func:`_recording_app`)."""
    from fedtune.engines.flower.runconfig import config_from_run_config
    from fedtune.engines.flower.serverapp import server_app

    server_app(RecordingGrid(grid, replies_file(config_from_run_config(context.run_config))), context)


@contextmanager
def _recording(engine: str, monkeypatch: Any, sink: Path) -> Iterator[None]:
    """Record what the server of a launched ``engine`` run receives into ``sink``: the embedded
    engine's in-process deliveries (meta and array names), the simulation's and the loopback
    deployment's grid (their ServerApp runs here), or a deployment's grid in a ServerApp process of
    its own (the app names :data:`recording_server_app`, importable there through PYTHONPATH)."""
    from fedtune.engines.flower import commands, deployment, serverapp
    from fedtune.engines.local import LocalTransport

    if engine == "embedded":
        deliver = LocalTransport.deliver

        def recorded(self, kind, rnd, cid, message, attempt=0):
            got = deliver(self, kind, rnd, cid, message, attempt)
            entry = {"type": kind, "meta": None if got.reply is None else got.reply.meta, "error": got.error}
            with open(sink, "a") as out:
                out.write(json.dumps({**entry, "arrays": sorted(got.reply.arrays) if got.reply else []}) + "\n")
            return got

        monkeypatch.setattr(LocalTransport, "deliver", recorded)
    else:  # the simulation's ServerApp, and the loopback deployment's (inprocess.py), run here
        serve = serverapp.serve
        monkeypatch.setattr(serverapp, "serve", lambda grid, *a, **k: serve(RecordingGrid(grid, sink), *a, **k))
    if engine == "flower":  # a ServerApp in its own process (executors off) runs the recording app
        app = commands.APP_PYPROJECT.replace(
            "fedtune.engines.flower.serverapp:server_app", f"{__name__}:recording_server_app"
        )

        def write_app(folder: Path) -> Path:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "pyproject.toml").write_text(app)
            return folder

        monkeypatch.setattr(deployment, "write_app", write_app)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    yield


# -- runs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ran:
    """A finished run: its folder, and what it printed (a CLI run) or received (a launched run)."""

    engine: str
    case: str
    run_dir: Path
    returncode: int = 0
    stdout: str = ""
    stderr: str = ""
    replies: tuple[dict, ...] = ()


def fedtune(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """``fedtune ARGS`` in a subprocess (the installed command, this Python's environment; 1000
    columns, so that no line wraps)."""
    env = {**os.environ, "COLUMNS": "1000"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "fedtune"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sets(items: list[str]) -> list[str]:
    """``--set`` arguments for ``items``."""
    return [a for item in items for a in ("--set", item)]


#: Set to a folder, the session's runs are made there and kept, and a later session reuses those
#: that finished (to iterate on one test without remaking its runs); unset (CI), a fresh folder.
KEEP_ENV = "FEDTUNE_TEST_ENGINE_RUNS"


class EngineRuns:
    """The session's runs, each made once (by engine, case and entry point) under ``root``; each
    finished run is recorded in ``root/made/`` (what it printed or received), and read back from
    there by a later session on the same ``root`` (:data:`KEEP_ENV`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.made: dict[tuple[str, str, str], Ran] = {}
        for record in sorted((self.root / "made").glob("*.json")):
            ran = json.loads(record.read_text())
            ran["run_dir"], ran["replies"] = Path(ran["run_dir"]), tuple(ran["replies"])
            self.made[tuple(record.stem.split("--"))] = Ran(**ran)  # type: ignore[index]

    def _keep(self, key: tuple[str, str, str], ran: Ran) -> Ran:
        """Record the finished ``ran`` under ``key``."""
        (self.root / "made").mkdir(parents=True, exist_ok=True)
        fields = {**ran.__dict__, "run_dir": str(ran.run_dir), "replies": list(ran.replies)}
        (self.root / "made" / f"{'--'.join(key)}.json").write_text(json.dumps(fields))
        self.made[key] = ran
        return ran

    def _out(self, how: str, engine: str, case: str) -> Path:
        return self.root / how / engine / case

    def cli(self, engine: str, case: str) -> Ran:
        """``case`` on ``engine`` through ``fedtune run`` (it must succeed)."""
        key = ("cli", engine, case)
        if key not in self.made:
            out = self._out("cli", engine, case)
            done = fedtune("run", *sets([*overrides(engine, case), f"output_dir={out}", f"name={case}"]))
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
            self._keep(key, Ran(engine, case, out / case, done.returncode, done.stdout, done.stderr))
        return self.made[key]

    def launched(self, engine: str, case: str) -> Ran:
        """``case`` on ``engine`` through :func:`fedtune.launch.launch` in this process, with what the
        server received."""
        import pytest

        from fedtune.config import load_config
        from fedtune.launch import launch

        key = ("launched", engine, case)
        if key not in self.made:
            out = self._out("launched", engine, case)
            config = load_config(None, [*overrides(engine, case), f"output_dir={out}", f"name={case}"])
            sink = replies_file(config)
            with pytest.MonkeyPatch.context() as monkeypatch, _recording(engine, monkeypatch, sink):
                summary = launch(config)
            replies = tuple(json.loads(x) for x in sink.read_text().splitlines()) if sink.is_file() else ()
            self._keep(key, Ran(engine, case, Path(summary["run_dir"]), replies=replies))
        return self.made[key]

    def killed(self, engine: str, case: str = "honest") -> Ran:
        """``case`` on ``engine`` through ``fedtune run``, killed with SIGKILL with every process it
        started once round 1's line and checkpoint are written, then ``fedtune run --resume`` (its
        output is the resume's). Client 3 waits :data:`SLOW_S` before each answer (fault injection:
        the numbers are the case's), so that round 2 cannot end before the kill."""
        key = ("killed", engine, case)
        if key not in self.made:
            out = self._out("killed", engine, case)
            run_dir = out / case
            args = [*overrides(engine, case), f"output_dir={out}", f"name={case}", SLOW]
            env = {**os.environ, "COLUMNS": "1000"}
            command = [str(Path(sys.executable).parent / "fedtune"), "run", *sets(args)]
            log = self.root / "logs" / f"killed-{engine}-{case}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as sink:
                proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
            try:
                _wait_for_round(proc, run_dir, 1, log)
            finally:
                homes = _kill_tree(proc)
            for home in homes:  # a deployment's private FLWR_HOME, which a crash leaves behind
                shutil.rmtree(home, ignore_errors=True)
            assert not (run_dir / "summary.json").exists(), "the run finished before it was killed"
            done = fedtune("run", "--resume", str(run_dir))
            assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
            self._keep(key, Ran(engine, case, run_dir, done.returncode, done.stdout, done.stderr))
        return self.made[key]


def _wait_for_round(proc: subprocess.Popen, run_dir: Path, rnd: int, log: Path, timeout: float = 1800) -> None:
    """Until ``run_dir`` holds round ``rnd``'s metrics line and a checkpoint of it (written after the
    line), or ``proc`` ends (a failure, its output in ``log``)."""
    from fedtune.checkpoint import load_state

    deadline = time.monotonic() + timeout
    metrics, checkpoint = run_dir / "metrics.jsonl", run_dir / "checkpoint.npz"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended (code {proc.returncode}) before round {rnd}: {log.read_text()[-3000:]}"
            )
        if metrics.is_file() and checkpoint.is_file() and metrics.read_text().count("\n") >= rnd:
            try:
                if int(load_state(checkpoint)["_round"]) >= rnd:
                    return
            except Exception:  # noqa: BLE001 - a checkpoint being replaced: look again
                pass
        time.sleep(0.05)
    raise AssertionError(f"round {rnd} was not checkpointed within {timeout:.0f} s: {log.read_text()[-3000:]}")


def _kill_tree(proc: subprocess.Popen) -> list[Path]:
    """SIGKILL ``proc`` and every process it started (deployments start theirs in new sessions), all
    at once, by PID; returns the FLWR_HOME folders they used (``fedtune-flwr-*``)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    homes = set()
    for p in tree:
        try:
            homes.update(Path(m) for m in re.findall(r"\S*/fedtune-flwr-[^/\s]+", " ".join(p.cmdline())))
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(tree, timeout=30)
    proc.wait(timeout=30)
    return sorted(homes)


# -- comparing what runs release -----------------------------------------------------------------
def public_files(run_dir: Path) -> dict[str, Any]:
    """Every file of a run folder but the owner-only checkpoint and the adapter (the state: the
    mechanism's output), with what is not the mechanism's output of a field kept: the config
    without the run's name, folder, engine and fault-injection profiles (how a test builds a
    neighbour); each metrics line and the summary without the state's evaluation, the name,
    folder, engine and machine. Any other file byte for byte."""
    out: dict[str, Any] = {}
    skip = MECHANISM_OUTPUTS | {"name", "run_dir", "environment", "engine"}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel = str(path.relative_to(run_dir))
        if rel == "checkpoint.npz" or rel.startswith("adapter/"):
            continue
        if rel in ("config.toml", "run_config.json"):
            import tomllib

            text = path.read_text()
            config = tomllib.loads(text) if rel.endswith(".toml") else json.loads(text)
            config = {k: v for k, v in config.items() if k not in ("name", "output_dir", "engine")}
            config["federation"] = {k: v for k, v in config.get("federation", {}).items() if k != "profiles"}
            out[rel] = config
        elif rel == "metrics.jsonl":
            out[rel] = [
                {k: v for k, v in json.loads(x).items() if k not in skip} for x in path.read_text().splitlines()
            ]
        elif rel == "summary.json":
            out[rel] = {k: v for k, v in json.loads(path.read_text()).items() if k not in skip}
        else:
            out[rel] = path.read_bytes()
    return out


def console(ran: Ran) -> list[str]:
    """What a CLI run printed (stderr's lines, then stdout's), every decimal number (the state's
    evaluation, epsilon: the mechanism's outputs) as ``#``, its folder as ``<run>`` and name as
    ``<name>`` (the user's choice), runs of spaces and of table rules as one (a table's width
    follows the folder's path)."""
    lines = []
    for line in (ran.stderr + ran.stdout).splitlines():
        line = re.sub(rf"^{re.escape(ran.run_dir.name)}:", "<name>:", line.replace(str(ran.run_dir), "<run>"))
        line = re.sub(r"\d+\.\d+", "#", line)
        line = re.sub(r"([ ━─═])\1+", r"\1", line).strip()
        if line:
            lines.append(line)
    return lines
