"""The jobs of flower_deployment.py, each run in a subprocess of it (``--job``), and what is read back:
per-round wall time, the slowest node's compute per round (for Flower's fixed cost), and the peak
memory of the job's whole process tree (summed RSS, and summed PSS: shared pages counted once)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE = Path(__file__).resolve().parent
PLAIN_APP = ENGINE / "plain_flower_app"
JOB_LIMIT_S = 3600.0  # a job still running after this long is stopped and reported as failed (a hang)


def job(kind: str, nodes: int, overrides: list[str]) -> None:
    """Run one job in this process and print ``RESULT`` + JSON: the run folder or the times file."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fedtune.config import load_config

    def stop(signum, frame):  # a deployment stops its processes on the way out
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if kind == "plain":
        return print("RESULT " + json.dumps(plain_job(nodes, overrides)), flush=True)
    engine = {"embedded": "embedded", "sim": "flower-sim", "flower": "flower"}[kind]
    extra = [f"placement.nodes={nodes}"] if kind == "flower" else []
    config = load_config(None, [*overrides, f"engine={engine}", *extra])
    if kind == "flower":
        from fedtune.engines.flower.deployment import run_flower_deployment

        summary = run_flower_deployment(config, timeout=1800)
    elif kind == "sim":
        from fedtune.engines.flower.simulation import run_flower_simulation

        summary = run_flower_simulation(config, timeout=1800)
    else:
        from fedtune.run import run_experiment

        summary = run_experiment(config)
    print("RESULT " + json.dumps({"run_dir": summary["run_dir"]}), flush=True)


def plain_job(nodes: int, overrides: list[str]) -> dict:
    """The plain Flower App (plain_flower_app/) on a stock loopback deployment of ``nodes``
    SuperNodes (partition-id i of ``nodes``), one torch thread per process, as fedtune's jobs."""
    from fedtune.engines.flower.commands import flower_command
    from fedtune.engines.flower.deployment import LoopbackDeployment

    os.environ["OMP_NUM_THREADS"] = "1"  # every ClientApp process: 1 torch thread (train.threads=1)
    given = dict(x.split("=", 1) for x in overrides)
    times = Path(tempfile.mkdtemp(prefix="plain-")) / "times.jsonl"
    config = {
        "num-server-rounds": int(given["rounds"]),
        "num-nodes": nodes,
        "local-steps": int(given["train.local_steps"]),
        "batch-size": int(given["train.batch_size"]),
        "learning-rate": float(given["train.lr"]),
        "train-samples": int(given["data.max_train_samples"]),
        "times-file": str(times),
    }
    text = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())
    with LoopbackDeployment([], executors=False) as d:
        for i in range(nodes):
            d.start_supernode([i], f"supernode{i}", extra=["--node-config", f"partition-id={i} num-partitions={nodes}"])
        args = [flower_command("flwr"), "run", str(PLAIN_APP), d.connection, "--stream", "--run-config", text]
        done = subprocess.run(args, env=d.env(), cwd=d.home, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or not times.is_file() or '"done"' not in times.read_text():
            raise RuntimeError(f"plain app failed ({done.returncode}): {(done.stdout + done.stderr)[-3000:]}")
        if '"train_metrics": {}' in times.read_text():  # Flower's FedAvg goes on when every client failed
            raise RuntimeError(f"plain app: no client trained: {(done.stdout + done.stderr)[-3000:]}")
    return {"times": str(times)}


def run_job(script: Path, kind: str, nodes: int, overrides: list[str], out: Path) -> dict:
    """``job`` in a subprocess of ``script``: its result, peak tree memory (RSS and PSS sums), each role's
    peak memory and CPU seconds (each process's at its last sample: up to 0.5 s of a process's last
    moments missed), the CPU cores Flower's control plane (SuperLink and SuperNodes) kept busy over the
    job's wall time, and the machine's load."""
    import psutil

    load_before = os.getloadavg()[0]
    args = [sys.executable, str(script), "--job", kind, "--nodes", str(nodes)]
    args += [f"--set={x}" for x in [*overrides, f"output_dir={out}"]]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, rss, pss = psutil.Process(proc.pid), 0, 0
    peaks: dict[str, list[float]] = {}  # role -> [peak summed RSS, most processes at once, peak RSS of one]
    cpu: dict[int, tuple[str, float]] = {}  # pid -> (role, its CPU seconds at the last sample)
    while proc.poll() is None:
        if time.perf_counter() - start > JOB_LIMIT_S:  # a hang (one was seen: a run's process not exiting)
            for p in [*root.children(recursive=True), root]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            proc.wait()
            raise RuntimeError(f"{kind} job ({nodes} nodes) still running after {JOB_LIMIT_S:.0f} s: stopped")
        total_rss = total_pss = 0
        now: dict[str, list[float]] = {}
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    m, used = p.memory_full_info(), p.cpu_times()
                    known = cpu.get(p.pid, ("other", 0.0))[0]  # a process that ended shows no command line:
                    name = known if known != "other" else role(p, root)  # it keeps the role it was seen in
                    cpu[p.pid] = (name, used.user + used.system)
                    total_rss, total_pss = total_rss + m.rss, total_pss + m.pss
                    held = now.setdefault(name, [0, 0, 0])
                    held[0], held[1], held[2] = held[0] + m.rss, held[1] + 1, max(held[2], m.rss)
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        rss, pss = max(rss, total_rss), max(pss, total_pss)
        for name, (summed, count, one) in now.items():
            peak = peaks.setdefault(name, [0, 0, 0])
            peak[:] = [max(peak[0], summed), max(peak[1], count), max(peak[2], one)]
        time.sleep(0.5)
    text = proc.stdout.read() if proc.stdout else ""
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} job failed ({proc.returncode}):\n{text[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    clients = int(dict(x.split("=", 1) for x in overrides)["federation.num_clients"])
    if kind == "plain":
        stats = plain_stats(Path(result["times"]))
    else:
        stats = run_stats(Path(result["run_dir"]), kind, nodes, clients)
    wall = time.perf_counter() - start
    cpu_s = {name: sum(s for n, s in cpu.values() if n == name) for name in peaks}
    return {
        **stats,
        "kind": kind,
        "nodes": nodes,
        "peak_rss_mb": rss / 2**20,
        "peak_pss_mb": pss / 2**20,
        "roles": {
            k: {"peak_rss_mb": v[0] / 2**20, "processes": int(v[1]), "one_mb": v[2] / 2**20, "cpu_s": cpu_s[k]}
            for k, v in peaks.items()
        },
        "control_plane_cores": (cpu_s.get("superlink", 0.0) + cpu_s.get("supernode", 0.0)) / wall,
        "job_wall_s": wall,
        "load": [load_before, os.getloadavg()[0]],
    }


#: a process of a job's tree by its command line: (what the command line holds, the role it plays)
ROLES = (
    ("flower-superlink", "superlink"),
    ("flower-supernode", "supernode"),
    ("flower.executor", "executor"),
    ("flower-superexec", "superexec"),
    ("flwr-clientapp", "clientapp"),
    ("flwr-serverapp", "serverapp"),
    ("ray", "ray"),
    ("flwr", "flwr run"),
)


def role(proc, root) -> str:
    """What ``proc`` of ``root``'s tree plays: ``job`` (root: the fedtune process, server and any node it
    runs in place), else the first of :data:`ROLES` its command line names, else ``other``."""
    if proc.pid == root.pid:
        return "job"
    text = " ".join(proc.cmdline())
    return next((name for key, name in ROLES if key in text), "other")


def _median_later(values: list[float]) -> float:
    """The median of rounds 2..R-1 (round 1 also loads the model and data; round R evaluates)."""
    return statistics.median(values[1:-1] or values)


def run_stats(run_dir: Path, kind: str, nodes: int, clients: int) -> dict:
    """Per-round wall time and fixed cost of a fedtune run folder: the round's wall time minus its
    compute on the critical path (a deployment: the node whose clients took longest, their Client
    calls one after another; embedded: every client, one after another; simulation: none given)."""
    from fedtune.engines.flower.commands import client_groups

    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [r["wall_s"] for r in rounds]
    fixed, over = [], []
    for r in rounds:
        compute = {int(c): s for c, s in r["client_compute_s"].items()}
        if kind == "flower":
            path = max(sum(compute.get(c, 0.0) for c in g) for g in client_groups(clients, nodes))
        else:
            path = sum(compute.values())
        fixed.append(r["wall_s"] - path)
        over.append(r["wall_s"] / path if path > 0 else float("nan"))
    return {
        "rounds_s": walls,
        "round_s": _median_later(walls),
        "first_round_s": walls[0],
        "fixed_s": None if kind == "sim" else _median_later(fixed),
        "x_own_compute": None if kind == "sim" else _median_later(over),
        "stages_s": timing_stages(run_dir / "flower_timing.jsonl", walls) if kind == "flower" else None,
    }


STAGES = ("dispatch_s", "startup_s", "return_s")  # flower_timing.jsonl: a request's way out and its reply's back


def timing_stages(path: Path, walls: list[float]) -> dict[str, float] | None:
    """Where a deployment's fixed cost went (the engine's ``flower_timing.jsonl``), per training round
    (its last attempt; ``walls``: the rounds' wall times from metrics.jsonl) for the request whose
    reply came last: dispatch (the server's push to the node's claim), startup (the claim to the
    ClientApp's handler), return (the handler's end to the server's pull of the reply) and server
    (the rest of the round: the handler outside the Client calls, encoding, aggregation,
    bookkeeping); each stage's median of rounds 2..R-1; None without the file (DP, SecAgg+)."""
    if not path.is_file():
        return None
    last: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "train" and row.get("clients"):
            last[row["round"]] = row
    stages: dict[str, list[float]] = {k: [] for k in (*STAGES, "server_s")}
    for rnd, row in sorted(last.items()):
        c = max(row["clients"].values(), key=lambda c: sum(c[k] for k in (*STAGES, "handler_s")))
        for k in STAGES:
            stages[k].append(c[k])
        if 1 <= rnd <= len(walls):
            stages["server_s"].append(walls[rnd - 1] - sum(c[k] for k in STAGES) - c["compute_s"])
    return {k: _median_later(v) for k, v in stages.items()} if last else None


def plain_stats(times: Path) -> dict:
    """The same of the plain app: its rounds' ends and each round's slowest client (training only)."""
    lines = [json.loads(x) for x in times.read_text().splitlines()]
    ends = {x["round"]: x["t"] for x in lines if "round" in x}
    metrics = next(x["train_metrics"] for x in lines if x.get("done"))
    walls = [ends[r] - ends[r - 1] for r in sorted(ends) if r > 0]
    compute = [float(metrics[str(r)]["compute_s"]) for r in range(1, len(walls) + 1)]
    fixed = [w - c for w, c in zip(walls, compute, strict=True)]
    handler = [float(metrics[str(r)]["handler_s"]) for r in range(1, len(walls) + 1)]
    return {
        "rounds_s": walls,
        "round_s": _median_later(walls),
        "first_round_s": walls[0],
        "fixed_s": _median_later(fixed),
        "x_own_compute": _median_later([w / c if c > 0 else float("nan") for w, c in zip(walls, compute, strict=True)]),
        "handler_s": _median_later(handler),
    }


def set_job_env() -> None:
    """The environment every job inherits: offline, and ``FEDTUNE_DATA_DIR`` an absolute path (default
    ``../shared/data`` beside the checkout): the plain app's ClientApps run in another folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    data = Path(os.environ.get("FEDTUNE_DATA_DIR", ENGINE.parents[2] / "shared" / "data"))
    os.environ["FEDTUNE_DATA_DIR"] = str(data.resolve())


def run_parts(parts: dict, args, stem: str, markdown, script: str) -> None:
    """Run the ``parts`` (name -> function of ``args`` and a scratch folder) that ``args.part``
    names, each stamped with the command and the machine's load at its start and end, writing
    benchmarks/results/``stem``.{json,md} (``markdown``: the results as Markdown) after each; a
    part run alone keeps the others' earlier results."""
    set_job_env()
    results = ENGINE.parent / "results"
    results.mkdir(exist_ok=True)
    path = results / f"{stem}.json"
    result = json.loads(path.read_text()) if path.is_file() else {}
    command = f"python benchmarks/engine/{script} " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="fedtune-bench-") as tmp:
        for part, run in parts.items():
            if part not in args.part.split(","):
                continue
            start_load = os.getloadavg()[0]
            result[part] = run(args, Path(tmp))
            result[part]["machine"] = (
                f"{os.cpu_count()} cores, load average {start_load:.1f} at the start and "
                f"{os.getloadavg()[0]:.1f} at the end of the part"
            )
            result[part]["command"] = command
            path.write_text(json.dumps(result, indent=1))
            (results / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
