"""fedtune on a Flower deployment against the embedded engine, Flower's simulation and a plain Flower
app, side by side in one run; and a loopback deployment's fixed cost per round up to 16 nodes.

Engines (``--part engines``): FedIT on MiniLM / SST-2 (20,000 training examples), 4 clients, all 4
sampled every round, 1 torch thread per client (``train.threads = 1``), at 1, 10 and 50 local
steps (``--steps``), each setting on:

- ``embedded``: one process, the clients one after another;
- ``flower-sim``: Flower's simulation runtime (Ray, a virtual node per client);
- ``flower, N nodes`` (N = 1, 2, 4): a loopback deployment (``engine = "flower"``): a SuperLink, N
  SuperNodes each with fedtune's executor, the ServerApp in the job's process; 1 node trains the 4
  clients one after another (the embedded engine's compute: the excess is the deployment's cost),
  2 and 4 nodes in parallel (2 cores: 4 nodes contend for them);
- ``plain Flower app``: the same FedAvg-LoRA job written as a plain Flower App
  (``plain_flower_app/``: Flower's ``FedAvg``, a ClientApp building the PEFT model and loading its
  data on every message, as Flower's examples do) on a stock loopback deployment of 4 SuperNodes
  (a ``flwr-clientapp`` process per message).

Reported per row: seconds per round (median of rounds 2..R-1: round 1 also loads the model and
data, round R evaluates), the ratio to embedded, the ratio to the round's own compute on its
critical path (the slowest node's Client calls, one after another; the plain app: its slowest
client's training; embedded: every client's; the simulation: not given; free of the machine's
drift between two jobs), the fixed cost per round (the round's wall time minus that compute) and,
for fedtune's deployments, where it went (``flower_timing.jsonl``: dispatch, startup, return),
and the peak memory of the job's whole process tree, sampled every 0.5 s: summed RSS (a page shared
by two processes counted twice) and summed PSS (each shared page split between its processes: the
memory the tree holds).

Scale (``--part scale``): a loopback deployment of 1, 2, 4, 8 and 16 nodes (processes) running
FedIT on the tiny test model (``tiny-bert``, tweets), 16 clients all sampled, 1 local step, 4
rounds: the fixed cost per round against nodes, and the CPU cores Flower's control plane (the
SuperLink and the SuperNodes) kept busy.

Memory (``--part memory --tag T``, run alone): the peak RSS of each process of the tree by its role
(the job's own process: the ServerApp and, on a deployment, the node it serves in place; the
SuperLink; the SuperNodes; the executor processes), embedded and 1- and 2-node deployments, on
tiny-bert and MiniLM, 2 clients a round, 1 local step, 3 rounds; a table per tag (``before`` from
the code before a change, ``after``) in benchmarks/results/flower_memory.{md,json}.

Each job runs in a subprocess (``--job``); the machine's load average is recorded before and after
each. Writes benchmarks/results/flower_deployment.{md,json}. About 65 minutes on 2 cores (2026-11-29);
``--quick`` is a smoke run (2 clients, 1 and 2 nodes, no simulation; 3 rounds, 1 local step and
scale to 4 nodes unless ``--rounds`` / ``--steps`` / ``--scale-nodes`` say otherwise; results in
``flower_deployment_quick.*``, with ``--steps S`` in ``flower_deployment_quick_Ssteps.*``).

    python benchmarks/engine/flower_deployment.py [--part engines,scale] [--rounds 4] [--steps 1,10,50] [--quick]
    python benchmarks/engine/flower_deployment.py --part memory --tag after
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from deployment_jobs import job, run_job, run_parts

MINILM = [
    "method=fedit",
    "model.name=minilm",
    "data.name=sst2",
    "data.max_train_samples=20000",
    "data.partition=iid",
    "seed=0",
    "train.batch_size=16",
    "train.lr=1e-3",
    "train.threads=1",
]
TINY = ["method=fedit", "model.name=tiny-bert", "data=tweets", "data.max_train_samples=800", "seed=0"]
TINY += ["data.max_test_samples=100", "train.batch_size=16", "train.lr=1e-3", "train.threads=1"]


def engines_job(clients: int, rounds: int, steps: int) -> list[str]:
    """The settings of an engines job (FedIT on MiniLM, ``clients`` all sampled, ``rounds`` rounds
    evaluated at the last, ``steps`` local steps); also standby_trace.py's and deployment_ab.py's."""
    overrides = [*MINILM, f"federation.num_clients={clients}", f"federation.clients_per_round={clients}"]
    return overrides + [f"rounds={rounds}", f"eval_every={rounds}", f"train.local_steps={steps}"]


def label(kind: str, nodes: int) -> str:
    nodes_text = f"{nodes} node{'s' * (nodes > 1)}"
    return {"embedded": "embedded", "sim": "flower-sim", "plain": f"plain Flower app, {nodes_text}"}.get(
        kind, f"flower, {nodes_text}"
    )


def part_engines(args, out: Path) -> dict:
    rows = [("embedded", 0)] + [("sim", 0)] * (not args.quick) + [("flower", n) for n in args.nodes_list]
    rows.append(("plain", args.clients))  # the plain app: one client per SuperNode, as Flower's examples
    settings = []
    for steps in args.steps:
        overrides = engines_job(args.clients, args.rounds, steps)
        results = []
        for kind, nodes in rows:
            print(f"[engines] {steps} steps: {label(kind, nodes)} ...", flush=True)
            name = f"name=engines-{steps}-{kind}-{nodes}"
            results.append(run_job(Path(__file__), kind, nodes, [*overrides, name], out))
            r = results[-1]
            fixed = f"{r['fixed_s']:.2f}" if r["fixed_s"] is not None else "-"
            print(f"  {r['round_s']:.2f} s/round, fixed {fixed} s, peak {r['peak_rss_mb']:.0f} MB", flush=True)
        settings.append({"local_steps": steps, "rows": results})
    return {"settings": settings, "clients": args.clients}


def part_scale(args, out: Path) -> dict:
    rows = []
    for nodes in args.scale_nodes:
        overrides = [*TINY, "federation.num_clients=16", "federation.clients_per_round=16", "rounds=4"]
        overrides += ["eval_every=4", "train.local_steps=1", f"name=scale-{nodes}"]
        print(f"[scale] {nodes} nodes ...", flush=True)
        rows.append(run_job(Path(__file__), "flower", nodes, overrides, out))
        print(f"  fixed {rows[-1]['fixed_s']:.2f} s/round, {rows[-1]['round_s']:.2f} s/round", flush=True)
    return {"rows": rows}


def part_memory(args, out: Path) -> dict:
    """Peak memory per process of embedded and 1- and 2-node deployments, tiny-bert and MiniLM (2 clients
    a round, 1 local step, 3 rounds: memory, not speed)."""
    wanted = set(args.rows.split(",")) if args.rows else None  # model-kind-nodes; the others kept as they were
    rows = []
    for model, overrides in (("tiny-bert", TINY), ("minilm", MINILM)):
        for kind, nodes in (("embedded", 0), ("flower", 1), ("flower", 2)):
            kept = [r for r in args.previous if (r["model"], r["kind"], r["nodes"]) == (model, kind, nodes)]
            if wanted is not None and f"{model}-{kind}-{nodes}" not in wanted:
                rows += kept
                continue
            print(f"[memory] {model}: {label(kind, nodes)} ...", flush=True)
            settings = [*overrides, "federation.num_clients=2", "federation.clients_per_round=2", "rounds=3"]
            settings += ["eval_every=3", "train.local_steps=1", f"name=memory-{model}-{kind}-{nodes}"]
            rows.append({"model": model, **run_job(Path(__file__), kind, nodes, settings, out)})
            print(f"  peak {rows[-1]['peak_rss_mb']:.0f} MB RSS: {rows[-1]['roles']}", flush=True)
    return {"rows": rows, "tag": args.tag, "uptime": os.popen("uptime").read().strip()}


def memory_markdown(part: dict, embedded: dict[str, float]) -> list[str]:
    """The memory table of ``part`` (:func:`part_memory`): the tree's peak and each role's; ``embedded``:
    the embedded engine's peak RSS by model, for a part that did not rerun it (its code unchanged)."""
    lines = [f"## Peak memory per process ({part['tag']}): 2 clients a round, 1 local step, 3 rounds", ""]
    lines += [f"`{part['command']}`; {part['machine']}; `uptime` at the end: {part['uptime']}.", ""]
    lines += [
        "RSS MB, each role's peak (several processes of a role: their sum at the peak, n processes, one's most).",
        "",
    ]
    lines += [
        "| model | engine | tree RSS | x embedded | tree PSS | fedtune process | superlink | supernodes | executors |"
    ]
    lines += ["|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    emb = {**embedded, **{r["model"]: r["peak_rss_mb"] for r in part["rows"] if r["kind"] == "embedded"}}

    def cell(r: dict, key: str) -> str:
        x = r["roles"].get(key)
        if x is None:
            return "-"
        return f"{x['peak_rss_mb']:.0f}" + (f" ({x['processes']} x <= {x['one_mb']:.0f})" if x["processes"] > 1 else "")

    for r in part["rows"]:
        lines.append(
            f"| {r['model']} | {label(r['kind'], r['nodes'])} | {r['peak_rss_mb']:.0f} | "
            f"{r['peak_rss_mb'] / emb[r['model']]:.2f} | {r['peak_pss_mb']:.0f} | {cell(r, 'job')} | "
            f"{cell(r, 'superlink')} | {cell(r, 'supernode')} | {cell(r, 'executor')} |"
        )
    return [*lines, ""]


def goals(engines: dict) -> list[str]:
    """The issue's goals, read off the engines table (None where a row is missing)."""
    by = {(s["local_steps"], r["kind"], r["nodes"]): r for s in engines["settings"] for r in s["rows"]}
    lines = []
    fixed = [r["fixed_s"] for (_, k, _), r in by.items() if k == "flower"]
    if fixed:
        lines.append(f"- fixed cost per round <= 2 s: deployment rows {min(fixed):.2f}-{max(fixed):.2f} s")
    if (10, "flower", 1) in by and (10, "embedded", 0) in by:
        one = by[(10, "flower", 1)]
        ratio = one["round_s"] / by[(10, "embedded", 0)]["round_s"]
        own = f"; over the round's own compute {one['x_own_compute']:.2f}x" if one.get("x_own_compute") else ""
        lines.append(f"- 10-step round, 1 node <= 1.3x embedded: {ratio:.2f}x{own}")
    for steps in sorted({s for s, _, _ in by}):
        if (steps, "flower", 1) in by and (steps, "flower", 2) in by:
            one, two = by[(steps, "flower", 1)]["round_s"], by[(steps, "flower", 2)]["round_s"]
            lines.append(f"- {steps} steps, 2 nodes faster than 1: {two:.2f} vs {one:.2f} s/round")
        if (steps, "flower", 1) in by and (steps, "embedded", 0) in by:
            d, e = by[(steps, "flower", 1)], by[(steps, "embedded", 0)]
            lines.append(
                f"- {steps} steps, peak memory of a 1-node deployment <= 1.5x embedded (same clients per round): "
                f"RSS {d['peak_rss_mb'] / e['peak_rss_mb']:.2f}x, PSS {d['peak_pss_mb'] / e['peak_pss_mb']:.2f}x"
            )
        plain = [r for (st, k, _), r in by.items() if st == steps and k == "plain"]
        if plain and (steps, "flower", plain[0]["nodes"]) in by:
            p, f = plain[0], by[(steps, "flower", plain[0]["nodes"])]
            lines.append(
                f"- {steps} steps, fedtune at least as fast as the plain app ({p['nodes']} nodes each): "
                f"{f['round_s']:.2f} vs {p['round_s']:.2f} s/round"
            )
    return lines


OWN_COMPUTE = (
    "*x own compute*: each round's wall time over its compute on the critical path (embedded: every "
    "client's Client calls; a deployment: its slowest node's), median of the same rounds: free of the "
    "machine's drift between two jobs (x embedded divides rows run minutes apart). On 1 node the compute "
    "on the critical path is the embedded engine's (the 4 clients one after another), so there it is "
    "the deployment's cost over the same work."
)
CONTROL_PLANE = (
    "*control plane cores*: the CPU seconds of the SuperLink and the SuperNodes (Flower's processes) over "
    "the job's wall time, the job's start and end included: the share of the machine's cores they kept "
    "busy (each role's CPU seconds are in the JSON's `roles`)."
)


def stages_table(engines: dict) -> list[str]:
    """Where the deployments' fixed cost went (:func:`deployment_jobs.timing_stages`), a row per one."""
    rows = [(s["local_steps"], r) for s in engines["settings"] for r in s["rows"] if r.get("stages_s")]
    if not rows:
        return []
    lines = [
        "Where the fixed cost went (`flower_timing.jsonl`; the request whose reply came last, median of the "
        "same rounds): *dispatch* the server's push to the node's claim, *startup* the claim to the ClientApp's "
        "handler, *return* the handler's end to the server's pull of the reply, *server* the rest of the round "
        "(encoding, aggregation, bookkeeping).",
        "",
        "| local steps | engine | dispatch s | startup s | return s | server s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for steps, r in rows:
        t = r["stages_s"]
        lines.append(
            f"| {steps} | {label(r['kind'], r['nodes'])} | {t['dispatch_s']:.2f} | {t['startup_s']:.2f} | "
            f"{t['return_s']:.2f} | {t['server_s']:.2f} |"
        )
    return [*lines, ""]


def markdown(result: dict) -> str:
    lines = ["# fedtune on a Flower deployment", "", "Written by `benchmarks/engine/flower_deployment.py`.", ""]
    if "engines" in result:
        e = result["engines"]
        lines += [
            f"## Engines side by side (FedIT, MiniLM, SST-2, {e['clients']} clients a round, 1 torch thread each)"
        ]
        lines += [""]
        lines += [f"`{e['command']}`; {e['machine']}.", ""]
        lines += [
            "| local steps | engine | s/round | x embedded | x own compute | fixed s/round | first round s | "
            "peak RSS MB | peak PSS MB | load |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in e["settings"]:
            emb = next((r for r in s["rows"] if r["kind"] == "embedded"), None)
            for r in s["rows"]:
                ratio = f"{r['round_s'] / emb['round_s']:.2f}" if emb else "-"
                fixed = f"{r['fixed_s']:.2f}" if r["fixed_s"] is not None else "-"
                own = f"{r['x_own_compute']:.2f}" if r.get("x_own_compute") is not None else "-"
                lines.append(
                    f"| {s['local_steps']} | {label(r['kind'], r['nodes'])} | {r['round_s']:.2f} | {ratio} | {own} | "
                    f"{fixed} | {r['first_round_s']:.1f} | {r['peak_rss_mb']:.0f} | {r['peak_pss_mb']:.0f} | "
                    f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |"
                )
        lines += ["", OWN_COMPUTE, "", *stages_table(e), "Goals (issue 50), from this table:", "", *goals(e), ""]
    if "scale" in result:
        s = result["scale"]
        lines += ["## Fixed cost per round against nodes (tiny-bert, 16 clients, 1 local step)", ""]
        lines += [f"`{s['command']}`; {s['machine']}.", ""]
        lines += [
            "| nodes | s/round | fixed s/round | first round s | peak RSS MB | peak PSS MB | control plane cores | "
            "load |"
        ]
        lines += ["|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s["rows"]:
            cores = f"{r['control_plane_cores']:.2f}" if "control_plane_cores" in r else "-"
            lines.append(
                f"| {r['nodes']} | {r['round_s']:.2f} | {r['fixed_s']:.2f} | {r['first_round_s']:.1f} | "
                f"{r['peak_rss_mb']:.0f} | {r['peak_pss_mb']:.0f} | {cores} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |"
            )
        lines += ["", CONTROL_PLANE, ""]
    memory = sorted(k for k in result if k.startswith("memory"))
    embedded = {r["model"]: r["peak_rss_mb"] for k in memory for r in result[k]["rows"] if r["kind"] == "embedded"}
    for name in memory:
        lines += memory_markdown(result[name], embedded)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="engines,scale")
    parser.add_argument("--rounds", type=int, help="rounds per job (default 4; --quick: 3)")
    parser.add_argument("--steps", help="local steps per setting (default 1,10,50; --quick: 1)")
    parser.add_argument("--scale-nodes", help="nodes of the scale part (default 1,2,4,8,16; --quick: 1,2,4)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer clients, rows and rounds")
    parser.add_argument("--job", choices=["embedded", "sim", "flower", "plain"])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--tag", default="after", help="--part memory: the label of its table (before, after)")
    parser.add_argument("--rows", help="--part memory: only these rows (model-kind-nodes, e.g. minilm-flower-1)")
    args = parser.parse_args()
    if args.job:
        return job(args.job, args.nodes, args.set)
    steps, scale = ("1", "1,2,4") if args.quick else ("1,10,50", "1,2,4,8,16")
    stem = "flower_deployment_quick" if args.quick else "flower_deployment"
    if args.quick and args.steps:  # a smoke run at other steps keeps the default one's results
        stem += f"_{args.steps.replace(',', '-')}steps"
    args.steps = [int(x) for x in (args.steps or steps).split(",")]
    args.scale_nodes = [int(x) for x in (args.scale_nodes or scale).split(",")]
    args.clients, args.nodes_list = 4, [1, 2, 4]
    args.rounds = args.rounds or (3 if args.quick else 4)
    if args.quick:  # 2 clients, 1 and 2 nodes, no simulation
        args.clients, args.nodes_list = 2, [1, 2]
    parts = {"engines": part_engines, "scale": part_scale}
    if args.part == "memory":  # its own results file, a table per --tag
        stem, args.part, parts = "flower_memory", f"memory-{args.tag}", {f"memory-{args.tag}": part_memory}
        done = Path(__file__).parents[1] / "results" / f"{stem}.json"
        earlier = json.loads(done.read_text()).get(args.part, {}) if done.is_file() else {}
        args.previous = earlier.get("rows", [])
    run_parts(parts, args, stem, markdown, Path(__file__).name)


if __name__ == "__main__":
    main()
