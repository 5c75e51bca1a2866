"""An A/B of two fedtune trees on the same loopback deployment job, repeated: the jobs alternate (A B,
B A, A B, ...; so a drift of the machine falls on both), each a subprocess (``deployment_jobs.run_job``)
whose processes (the SuperNodes' executors included) import fedtune from the arm's tree: A from this
checkout, B from ``--b`` (a folder holding a ``fedtune`` package, put first on ``PYTHONPATH``).
One deployment job's fixed cost per round is bimodal on a loaded 2-core machine (a node that fell
into Flower's 3 s idle sleep or not), so one job per arm tells little: this prints every job and
each arm's mean, spread and sorted values. The setting is flower_deployment.py's engines job
(FedIT, MiniLM / SST-2, 4 clients all sampled, 1 torch thread each). Writes ``OUT/ab.json``.

    python benchmarks/engine/deployment_ab.py OUT --b /tmp/tree-b [--nodes 4] [--steps 1] [--rounds 6] [--repeats 5]
    python benchmarks/engine/deployment_ab.py OUT --repeats 5   # A only: the spread of one tree's job

Numbers and what they decided: benchmarks/results/flower_four_nodes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from deployment_jobs import run_job, set_job_env
from flower_deployment import engines_job

KEPT = ("round_s", "fixed_s", "control_plane_cores", "peak_pss_mb", "load")


def arm_env(tree: Path | None) -> None:
    """Point this process's environment (inherited by the job and all its processes) at ``tree``'s
    fedtune (None: this checkout's), and check that a fresh interpreter imports it from there."""
    os.environ.pop("PYTHONPATH", None)
    if tree is not None:
        os.environ["PYTHONPATH"] = str(tree)
    probe = "import fedtune, pathlib; print(pathlib.Path(fedtune.__file__).resolve().parents[1])"
    done = subprocess.run(  # run outside the checkout, as the jobs' processes (the script's folder, a log folder)
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()
    )
    found = Path(done.stdout.strip())
    expected = (tree or Path(__file__).resolve().parents[2]).resolve()
    if found != expected:
        raise SystemExit(f"--b: fedtune imports from {found}, not {expected}")


def summary(rows: list[dict]) -> dict:
    """Mean, standard deviation and sorted values of the jobs' fixed cost and s/round."""
    out = {}
    for key in ("fixed_s", "round_s"):
        values = sorted(r[key] for r in rows)
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        out[key] = {"mean": statistics.mean(values), "sd": spread, "values": values}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a folder for the run folders and ab.json")
    parser.add_argument("--b", type=Path, help="arm B: a folder holding the other fedtune package (none: A only)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1, help="local steps per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5, help="jobs per arm")
    args = parser.parse_args()
    for name in ("nodes", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} {getattr(args, name)}: expected at least 1")
    if args.b is not None and not (args.b / "fedtune" / "__init__.py").is_file():
        raise SystemExit(f"--b {args.b}: expected a folder holding a fedtune package (fedtune/__init__.py)")
    set_job_env()
    args.out.mkdir(parents=True, exist_ok=True)
    arms = {"A": None} if args.b is None else {"A": None, "B": args.b}
    overrides = engines_job(4, args.rounds, args.steps)
    jobs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for i in range(args.repeats):
        for arm in list(arms) if i % 2 == 0 else list(arms)[::-1]:
            arm_env(arms[arm])
            out = args.out / f"{arm}{i}"
            r = run_job(Path(__file__).with_name("flower_deployment.py"), "flower", args.nodes, overrides, out)
            row = {"job": i, **{k: r[k] for k in KEPT}, "stages_s": r["stages_s"]}
            jobs[arm].append(row)
            print(json.dumps({"arm": arm, **row}), flush=True)
            result = {"setting": vars(args) | {"out": str(args.out), "b": str(args.b)}, "jobs": jobs}
            result["summary"] = {a: summary(rows) for a, rows in jobs.items() if rows}
            (args.out / "ab.json").write_text(json.dumps(result, indent=1))
    for arm, s in result["summary"].items():
        f, w = s["fixed_s"], s["round_s"]
        print(
            f"{arm}: fixed s/round mean {f['mean']:.2f} (sd {f['sd']:.2f}) {[round(v, 2) for v in f['values']]}; "
            f"s/round mean {w['mean']:.2f}"
        )


if __name__ == "__main__":
    main()
