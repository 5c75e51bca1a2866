"""Fit the sub-model methods' memory coefficients (fedtune.methods.rabo.plan.SUBMODEL_FIT) from
measured runs of their recipes (issue 41).

Each recipe runs one round with five clients at RABO's capacities 1, 1/2, ..., 1/16 and a memory
budget far above what they need (so that every client's peak is measured: the tensor bytes its
training allocates at their most, :class:`~fedtune.planning.memory.PeakMeter`, and for RABO its
hypergradient phase's too). Per kind (single-level: Static, FedRolex; bilevel: RABO) the measured
peak less the predicted weights and trainable states is fitted as ``a + k x activations`` (least
squares, each sample weighted by 1 / its measurement); FIARSE (single-level) and RAFBO (bilevel)
are run the same way and checked against the fit, not fitted.

The seconds (``SUBMODEL_SECONDS``): each client's **CPU seconds** over its fit (the thread's, both
RABO phases; wall seconds on this shared machine follow the load) against its FLOP-count seconds
(capacity.py's ``flop_s``), fitted as ``a + b x flop_s`` per seconds kind (least squares weighted
by 1 / the measurement): single-level on Static and FedRolex (FIARSE checked), RABO's implicit
hypergradient and RAFBO's finite differences each on their own runs (their hypergradient phase is
no FLOP count's: b carries its passes, a the costs FLOPs do not count).

    PYTHONPATH=$PWD FEDTUNE_DATA_DIR=... python benchmarks/budgets/fit_capacity.py [--repeats 2]

Writes benchmarks/results/budgets/capacity-fit.json and prints the SUBMODEL_FIT line for capacity.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import fedtune.engines.local as local
from fedtune.config import load_config
from fedtune.methods.rabo.plan import CAPACITIES, SECONDS_KIND, predict_capacity
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "budgets" / "capacity-fit.json"
RECIPES = {"single-level": ["static.toml", "fedrolex.toml"], "bilevel": ["rabo.toml"]}
CHECKED = {"single-level": ["fiarse.toml"], "bilevel": ["rafbo.toml"]}


@contextmanager
def cpu_seconds():
    """The engine's client seconds as the serving thread's CPU seconds (one torch thread)."""
    exchange = local.exchange

    def timed(message, handler):
        start = time.thread_time()
        reply, down, up, _ = exchange(message, handler)
        return reply, down, up, time.thread_time() - start

    local.exchange = timed
    try:
        yield
    finally:
        local.exchange = exchange


def weighted_fit(x: list[float], y: list[float], scale: list[float]) -> tuple[float, float]:
    """(a, b) of ``y ~ a + b x`` by least squares, each sample weighted by 1 / its ``scale``."""
    w = 1 / np.array(scale, dtype=float)
    a, b = np.linalg.lstsq(np.c_[np.ones(len(x)), x] * w[:, None], np.array(y) * w, rcond=None)[0]
    return float(a), float(b)


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
    with cpu_seconds():
        run_dir = run_experiment(config)["run_dir"]
    line = json.loads(Path(run_dir, "metrics.jsonl").read_text().splitlines()[0])
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
                method=config.method,
                flop_s=p.seconds,
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
        measured = [s["measured"] for s in got]
        a, k = weighted_fit([s["activations"] for s in got], [s["measured"] - s["fixed"] for s in got], measured)
        fit[kind] = (round(a), round(k, 3))
        checked = [s for r in CHECKED[kind] for i in range(args.repeats) for s in samples(r, i)]
        for fitted, part in ((True, got), (False, checked)):
            for s in part:
                s.update(kind=kind, fitted=fitted, error=(s["fixed"] + a + k * s["activations"]) / s["measured"] - 1)
            worst = max(abs(s["error"]) for s in part)
            print(kind, "a, k =", fit[kind], "fitted" if fitted else "checked", f"worst error {worst:.1%}")
        rows += got + checked
    seconds = {}
    for kind in sorted(set(SECONDS_KIND.values())):
        part = [s for s in rows if SECONDS_KIND[s["method"]] == kind and s["method"] != "fiarse"]
        measured = [s["measured_seconds"] for s in part]
        a, b = weighted_fit([s["flop_s"] for s in part], measured, measured)
        seconds[kind] = (round(a, 3), round(b, 2))
        for s in rows:
            if SECONDS_KIND[s["method"]] == kind:
                s["seconds_ratio"] = (a + b * s["flop_s"]) / s["measured_seconds"]
        got = [s["seconds_ratio"] for s in rows if SECONDS_KIND[s["method"]] == kind]
        print(kind, "seconds a, b =", seconds[kind], f"predicted / measured {min(got):.2f} .. {max(got):.2f}")
    OUT.write_text(json.dumps({"fit": fit, "seconds": seconds, "samples": rows}, indent=1) + "\n")
    print(f"SUBMODEL_FIT = {fit}")
    print(f"SUBMODEL_SECONDS = {seconds}")


if __name__ == "__main__":
    main()
