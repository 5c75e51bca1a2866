"""Flower loopback deployment vs. the embedded engine: per-round wall time, Flower's fixed
per-round cost, and peak memory with 1,000 registered clients. Everything in one run.

Round time (``--part rounds``): FedIT on MiniLM / SST-2 (20,000 training examples), 2 clients
sampled per round, 1 torch thread per client (``train.threads = 1``), for a short round
(``--short-steps`` local steps, the issue's 10) and a long one (``--long-steps``, chosen so the
embedded round takes 30 s or more). Each setting runs on the embedded engine (one process, the
clients one after the other) and on the loopback deployment (``engine = "flower"``: a SuperLink,
SuperNodes each with a warm executor, ``flwr run``) with 1 node (both clients in one executor, one after
the other: the same compute as embedded, so the difference is Flower's cost) and with 2 nodes (the
default on 2 cores: the clients train in parallel), jobs one after another. The global model is
evaluated only after the last round (``eval_every = rounds``), so rounds 2..R-1 are training alone
(the server's evaluation costs the same on both engines and would only dilute the ratio). Reported
per setting: the median round wall time over rounds 2..R-1 (round 1 also loads the model and data:
shown apart), the ratio flower / embedded, and, from the deployment's ``flower_timing.jsonl``, where
Flower's fixed cost goes per message: dispatch (push -> ClientApp process start: the SuperNode's 3 s
idle poll, SuperExec's task poll, the spawn), start-up (process start -> fedtune's handler:
``flwr-clientapp`` imports and Flower's message plumbing), return (handler end -> the server's pull:
the reply's way back), and the round's fixed overhead (round wall minus the slowest client's handler
time).

Memory (``--part memory``): FedIT on MiniLM / SST-2, ``data.partition = dirichlet-client``, 10
clients sampled per round, with 10 vs 1,000 registered clients, on both engines; the peak of the
summed resident memory (RSS) of the job's whole process tree (the deployment: SuperLink,
SuperNodes, executors), sampled every 0.2 s.

Each job runs in a subprocess of this script (``--job``). The machine's load average is
recorded before and after each job (a shared machine: compare ratios measured in one run).
Writes benchmarks/results/flower_overhead.{md,json}.

    python benchmarks/engine/flower_overhead.py [--part rounds,memory] [--rounds 4] [--long-steps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from deployment_jobs import run_parts

RESULTS = Path(__file__).resolve().parents[1] / "results"
BASE = [
    "method=fedit",
    "model.name=minilm",
    "data.name=sst2",
    "data.max_train_samples=20000",
    "seed=0",
    "train.batch_size=16",
    "train.lr=1e-3",
]


def job(engine: str, overrides: list[str]) -> None:
    """Run one config (in this subprocess) and print its summary as JSON."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fedtune.config import load_config

    config = load_config(None, [*overrides, f"engine={engine}"])

    def stop(signum, frame):  # a deployment stops its processes on the way out
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if engine == "flower":
        from fedtune.engines.flower.deployment import run_flower_deployment

        summary = run_flower_deployment(config, timeout=1800)
    else:
        from fedtune.run import run_experiment

        summary = run_experiment(config)
    print("SUMMARY " + json.dumps(summary), flush=True)


def run_job(engine: str, overrides: list[str], out: Path) -> dict:
    """``job`` in a subprocess: its summary, round lines, timing lines, peak tree RSS and load."""
    import psutil

    load_before = os.getloadavg()
    args = [sys.executable, __file__, "--job", engine, *[f"--set={x}" for x in overrides], f"--set=output_dir={out}"]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(0.2)
    text = proc.stdout.read()
    wall = time.perf_counter() - start
    lines = [x for x in text.splitlines() if x.startswith("SUMMARY ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} job failed ({proc.returncode}):\n{text[-3000:]}")
    summary = json.loads(lines[-1].removeprefix("SUMMARY "))
    run_dir = Path(summary["run_dir"])
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timing_file = run_dir / "flower_timing.jsonl"
    timing = [json.loads(x) for x in timing_file.read_text().splitlines()] if timing_file.is_file() else []
    return {
        "engine": engine,
        "overrides": overrides,
        "summary": summary,
        "rounds": rounds,
        "timing": timing,
        "peak_rss_mb": peak / 2**20,
        "job_wall_s": wall,
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }


def round_stats(result: dict) -> dict:
    walls = [r["wall_s"] for r in result["rounds"]]
    later = walls[1:-1] or walls
    out = {
        "first_round_s": walls[0],
        "median_round_s": statistics.median(later),
        "rounds_s": walls,
        "compute_s": statistics.median([r["compute_s"] for r in result["rounds"][1:-1]] or [0]),
    }
    last = len(walls)
    train = [t for t in result["timing"] if t["kind"] == "train" and 1 < t["round"] < last]
    if train:
        per_msg = [c for t in train for c in t["clients"].values()]
        mean = lambda key: statistics.mean(c[key] for c in per_msg)  # noqa: E731
        out["dispatch_s"], out["startup_s"], out["return_s"] = mean("dispatch_s"), mean("startup_s"), mean("return_s")
        out["handler_s"] = mean("handler_s")
        out["fixed_overhead_s"] = statistics.median(
            t["wall_s"] - max(c["handler_s"] for c in t["clients"].values()) for t in train
        )
    return out


def part_rounds(args, out: Path) -> dict:
    rows = []
    for name, steps in (("short", args.short_steps), ("long", args.long_steps)):
        overrides = [
            *BASE,
            "federation.num_clients=2",
            "federation.clients_per_round=2",
            "data.partition=iid",
            f"rounds={args.rounds}",
            f"eval_every={args.rounds}",
            f"train.local_steps={steps}",
            "train.threads=1",
        ]
        results = {}
        for engine, nodes in (("embedded", 0), ("flower", 1), ("flower", 2)):
            label = engine if not nodes else f"flower-{nodes}"
            print(f"[rounds] {name} ({steps} steps): {label} ...", flush=True)
            extra = [f"placement.nodes={nodes}"] if nodes else []
            results[label] = run_job(engine, [*overrides, *extra, f"name=rounds-{name}-{label}"], out)
        stats = {label: round_stats(r) for label, r in results.items()}
        e = stats["embedded"]["median_round_s"]
        rows.append(
            {
                "setting": name,
                "local_steps": steps,
                **stats,
                "ratio": {label: stats[label]["median_round_s"] / e for label in ("flower-1", "flower-2")},
                "load": {label: r["load_before"][0] for label, r in results.items()},
            }
        )
        print(
            f"  embedded {e:.1f} s/round; flower / embedded: 1 node {rows[-1]['ratio']['flower-1']:.2f}, "
            f"2 nodes {rows[-1]['ratio']['flower-2']:.2f}",
            flush=True,
        )
    return {"rows": rows}


def part_memory(args, out: Path) -> dict:
    rows = []
    for clients in (10, 1000):
        overrides = [
            *BASE,
            f"federation.num_clients={clients}",
            "federation.clients_per_round=10",
            "data.partition=dirichlet-client",
            f"rounds={args.memory_rounds}",
            "train.threads=1",
            "data.max_test_samples=500",
            f"train.local_steps={args.memory_steps}",
            "train.eval_batch_size=128",
        ]
        for engine in ("embedded", "flower"):
            print(f"[memory] {clients} clients: {engine} ...", flush=True)
            r = run_job(engine, [*overrides, f"name=memory-{clients}-{engine}"], out)
            rows.append(
                {
                    "clients": clients,
                    "engine": engine,
                    "peak_rss_mb": r["peak_rss_mb"],
                    "median_round_s": round_stats(r)["median_round_s"],
                    "load": r["load_before"][0],
                }
            )
            print(f"  peak {r['peak_rss_mb']:.0f} MB", flush=True)
    ratios = {}
    for engine in ("embedded", "flower"):
        by = {row["clients"]: row["peak_rss_mb"] for row in rows if row["engine"] == engine}
        ratios[engine] = by[1000] / by[10]
    return {"rows": rows, "ratio_1000_vs_10": ratios}


def markdown(result: dict) -> str:
    lines = [
        "# Flower loopback deployment vs. embedded engine",
        "",
        "Written by `benchmarks/engine/flower_overhead.py` (each part: its command and the machine's load).",
        "",
    ]
    if "rounds" in result:
        lines += [
            "## Per-round wall time (FedIT, MiniLM, SST-2, 2 clients per round, 1 torch thread per client)",
            "",
            f"`{result['rounds']['command']}`; {result['rounds']['machine']}.",
            "",
            "| setting | local steps | embedded s/round | flower, 1 node | flower, 2 nodes | first round (emb / 1 / "
            "2 nodes) | load avg (emb / 1 / 2) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in result["rounds"]["rows"]:
            e, f1, f2, r = row["embedded"], row["flower-1"], row["flower-2"], row["ratio"]
            load = row["load"]
            lines.append(
                f"| {row['setting']} | {row['local_steps']} | {e['median_round_s']:.1f} | "
                f"{f1['median_round_s']:.1f} (**{r['flower-1']:.2f}x**) | {f2['median_round_s']:.1f} "
                f"(**{r['flower-2']:.2f}x**) | "
                f"{e['first_round_s']:.1f} / {f1['first_round_s']:.1f} / {f2['first_round_s']:.1f} | "
                f"{load['embedded']:.1f} / {load['flower-1']:.1f} / {load['flower-2']:.1f} |"
            )
        lines += [
            "",
            "Median over rounds 2..R-1 (training only; the last round also evaluates); round 1 also loads "
            "the model and data. Every job runs its clients with 1 torch thread (`train.threads=1`): the embedded "
            "engine trains the 2 clients one after the other in one process; the deployment with 1 node does the "
            "same in one executor (the 2 clients in one bundle per round), so its excess over embedded is Flower's "
            "cost; with 2 nodes the clients train in parallel, one per node.",
            "",
            "## Flower's fixed cost (deployment, rounds 2..R-1)",
            "",
            "| setting | nodes | fixed overhead / round | dispatch | ClientApp start-up | return | handler (Client "
            "calls) |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row in result["rounds"]["rows"]:
            for label in ("flower-1", "flower-2"):
                f = row[label]
                if "fixed_overhead_s" in f:
                    lines.append(
                        f"| {row['setting']} | {label[-1]} | {f['fixed_overhead_s']:.2f} s | {f['dispatch_s']:.2f} s | "
                        f"{f['startup_s']:.2f} s | {f['return_s']:.2f} s | {f['handler_s']:.2f} s |"
                    )
        lines += [
            "",
            "Per Flower message (one per node and round here). dispatch: push to ClientApp process start "
            "(the SuperNode's idle poll of 3 s, SuperExec's task poll, the spawn); start-up: process start to "
            "fedtune's handler (`flwr-clientapp` imports and Flower's plumbing); return: handler end to the "
            "server's pull; fixed overhead: round wall time minus the slowest handler.",
            "",
        ]
    if "memory" in result:
        lines += [
            "## Peak memory, 10 clients sampled per round (MiniLM, SST-2, dirichlet-client)",
            "",
            f"`{result['memory']['command']}`; {result['memory']['machine']}.",
            "",
            "| registered clients | engine | peak RSS of the process tree (MB) | s/round | load avg |",
            "|---:|---|---:|---:|---:|",
        ]
        for row in result["memory"]["rows"]:
            lines.append(
                f"| {row['clients']} | {row['engine']} | {row['peak_rss_mb']:.0f} | {row['median_round_s']:.1f} | "
                f"{row['load']:.1f} |"
            )
        r = result["memory"]["ratio_1000_vs_10"]
        lines += [
            "",
            f"1,000 vs 10 registered clients: embedded **{r['embedded']:.2f}x**, flower **{r['flower']:.2f}x** "
            "(peak of the summed RSS, sampled every 0.2 s; shared pages count once per process).",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="rounds,memory")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--short-steps", type=int, default=10)
    parser.add_argument("--long-steps", type=int, default=50)
    parser.add_argument("--memory-rounds", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=5)
    parser.add_argument("--job", choices=["embedded", "flower"])
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args()
    if args.job:
        return job(args.job, args.set)
    run_parts({"rounds": part_rounds, "memory": part_memory}, args, "flower_overhead", markdown, Path(__file__).name)


if __name__ == "__main__":
    main()
