"""Fit the sub-model methods' memory coefficients (fedtune.planning.capacity.SUBMODEL_FIT) from
measured runs of their recipes (issue 41).

Each recipe runs one round with five clients at RABO's capacities 1, 1/2, ..., 1/16 and a memory
budget far above what they need (so that every client's peak is measured: the tensor bytes its
training allocates at their most, :class:`~fedtune.planning.memory.PeakMeter`, and for RABO its
hypergradient phase's too). Per kind (single-level: Static, FedRolex; bilevel: RABO) the measured
peak less the predicted weights and trainable states is fitted as ``a + k x activations`` (least
squares, each sample weighted by 1 / its measurement); FIARSE (single-level) and RAFBO (bilevel)
are run the same way and checked against the fit, not fitted.

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
CHECKED = {"single-level": ["fiarse.toml"], "bilevel": ["rafbo.toml"]}


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
        checked = [s for r in CHECKED[kind] for i in range(args.repeats) for s in samples(r, i)]
        for fitted, part in ((True, got), (False, checked)):
            for s in part:
                s.update(kind=kind, fitted=fitted, error=(s["fixed"] + a + k * s["activations"]) / s["measured"] - 1)
            worst = max(abs(s["error"]) for s in part)
            print(kind, "a, k =", fit[kind], "fitted" if fitted else "checked", f"worst error {worst:.1%}")
        rows += got + checked
    OUT.write_text(json.dumps({"fit": fit, "samples": rows}, indent=1) + "\n")
    print(f"SUBMODEL_FIT = {fit}")


if __name__ == "__main__":
    main()
