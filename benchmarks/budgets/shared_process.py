"""Each client's measured peak against its predicted one when all clients share one process
(issue 41): three_classes.py's AG News / MiniLM federation, HeteroLoRA at ranks 4 / 16 / 64 (by
client id), every client with a memory budget so large that none is dropped, so that every
client-round is measured (``PeakMeter`` on the CPU: the tensor bytes each fit allocated, at their
most, plus the base it holds).

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data PYTHONPATH=$PWD python benchmarks/budgets/shared_process.py

Writes benchmarks/results/budgets/shared-process.json and .md (each client-round's measured /
predicted) and a scratch run under benchmarks/results/_scratch/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fedtune.config import load_config
from fedtune.planning.planner import GIB
from fedtune.run import run_experiment

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "benchmarks" / "budgets-three-classes.toml"
OUT = REPO / "benchmarks" / "results" / "budgets"
RANKS = (4, 16, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profiles = ", ".join(f"{{rank={RANKS[cid % 3]}, memory_gib=64}}" for cid in range(6))
    config = load_config(
        RECIPE,
        [
            "method=heterolora",
            'options={weighting="uniform", padding="zeros", scaling="rank"}',
            f"federation.profiles=[{profiles}]",
            f"rounds={args.rounds}",
            f"eval_every={args.rounds}",
            f"seed={args.seed}",
            f"output_dir={REPO / 'benchmarks' / 'results' / '_scratch' / 'budgets-shared-process'}",
        ],
    )
    summary = run_experiment(config, overwrite=True)
    run = Path(summary["run_dir"])
    predicted = {c["cid"]: c["peak_bytes"] for c in json.loads((run / "plan.json").read_text())["clients"]}
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for cid, peak in record.get("client_peak_bytes", {}).items():
            rows.append({"round": record["round"], "client": int(cid), "rank": RANKS[int(cid) % 3],
                         "predicted": predicted[int(cid)], "measured": peak})  # fmt: skip
    ratios = [r["measured"] / r["predicted"] for r in rows]
    command = "PYTHONPATH=$PWD python benchmarks/budgets/shared_process.py " + " ".join(sys.argv[1:])
    spread = {"mean": statistics.mean(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
    (OUT / "shared-process.json").write_text(json.dumps({"command": command, "spread": spread, "rows": rows}) + "\n")
    lines = [
        "# Measured against predicted peak per client, six clients in one process (MiniLM, AG News)",
        "",
        f"`{command}`: measured / predicted {spread['mean']:.3f} on average, {spread['min']:.3f} to "
        f"{spread['max']:.3f} ({spread['n']} client-rounds)",
        "",
        "| round | client | rank | predicted GiB | measured GiB | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['round']} | {r['client']} | {r['rank']} | {r['predicted'] / GIB:.4f} | {r['measured'] / GIB:.4f} "
        f"| {r['measured'] / r['predicted']:.3f} |"
        for r in rows
    ]
    (OUT / "shared-process.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
