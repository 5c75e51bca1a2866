"""Fit the sub-model methods' memory coefficients (fedtune.planning.capacity.SUBMODEL_FIT) from
measured runs of their recipes (issue 41).

Each recipe runs one round with five clients at RABO's capacities 1, 1/2, ..., 1/16 and a memory
budget far above what they need (so that every client's peak is measured: the resident growth
over its training and, for RABO, its hypergradient phase). Per kind (single-level: Static,
FedRolex, FIARSE; bilevel: RABO, RAFBO) the measured peak less the predicted weights and trainable
states is fitted as ``a + k x activations`` (least squares, each sample weighted by 1 / its
measurement).

    PYTHONPATH=$PWD FEDTUNE_DATA_DIR=... python benchmarks/budgets/fit_capacity.py [--repeats 2]

Writes benchmarks/results/budgets/capacity-fit.json and prints the SUBMODEL_FIT line for capacity.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from fedtune.config import load_config
from fedtune.planning.capacity import CAPACITIES, predict_capacity
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "budgets" / "capacity-fit.json"
RECIPES = {"single-level": ["static.toml", "fedrolex.toml"], "bilevel": ["rabo.toml"]}


def samples(recipe: str, repeat: int) -> list[dict]:
    profiles = ", ".join(f"{{memory_gib=64, capacity={c}}}" for c in CAPACITIES)
    overrides = [
        "rounds=1",
        "eval_every=100",
        "task.eval_episodes=5",
        f"federation.num_clients={len(CAPACITIES)}",
        f"federation.profiles=[{profiles}]",
        f"seed={repeat}",
        f"output_dir={tempfile.mkdtemp()}",
    ]
    config = load_config(ROOT / "configs" / recipe, overrides)
    context = RunContext(resolve_run(config))
    line = json.loads(Path(run_experiment(config)["run_dir"], "metrics.jsonl").read_text().splitlines()[0])
    out = []
    for cid, capacity in enumerate(CAPACITIES):
        p, _ = predict_capacity(context, capacity, fitted=False)
        out.append(
            dict(
                recipe=recipe,
                seed=repeat,
                capacity=capacity,
                fixed=p.weights + p.trainable * 4 * (1 + p.states),
                activations=p.activations,
                measured=line["client_peak_bytes"][str(cid)],
                predicted_seconds=p.seconds,
                measured_seconds=line["client_compute_s"][str(cid)],
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    fit, rows = {}, []
    for kind, recipes in RECIPES.items():
        got = [s for r in recipes for i in range(args.repeats) for s in samples(r, i)]
        y = np.array([s["measured"] - s["fixed"] for s in got], dtype=float)
        x = np.array([[1.0, s["activations"]] for s in got])
        w = 1 / np.array([s["measured"] for s in got], dtype=float)
        (a, k), *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        fit[kind] = (round(float(a)), round(float(k), 3))
        for s in got:
            s["kind"] = kind
            s["error"] = (s["fixed"] + a + k * s["activations"]) / s["measured"] - 1
        rows += got
        print(kind, "a, k =", fit[kind], "worst error", f"{max(abs(s['error']) for s in got):.1%}")
    OUT.write_text(json.dumps({"fit": fit, "samples": rows}, indent=1) + "\n")
    print(f"SUBMODEL_FIT = {fit}")


if __name__ == "__main__":
    main()
