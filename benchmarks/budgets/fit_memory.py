"""Fit the activation coefficients of fedtune.planning.memory from measured LoRA training on small
random-weight models (issue 41; the FLOP/s of the time model: fit_speed.py).

Each sample trains a rank-r LoRA (AdamW, two steps after a warm-up) on a Llama (causal LM, LoRA on
q/v) or a BERT classifier (LoRA on query/value, head trained), in one process, one thread, on the
CPU; its growth (fedtune.planning.memory.PeakMeter: the tensor bytes allocated, at their most)
less the trainable values and their gradient and AdamW states is the measured activation memory
(the process's resident growth is recorded beside it, not fitted). The coefficients are a
non-negative least-squares fit of those, relative (each sample weighted by 1 / its measurement).

    PYTHONPATH=$PWD python benchmarks/budgets/fit_memory.py [--samples 24]

Writes benchmarks/results/budgets/fit.json (every sample, the fit, each sample's relative error of
the predicted peak) and prints the COEFFICIENTS lines to paste into memory.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from fedtune.planning.calibrate import measure

OUT = Path(__file__).resolve().parents[1] / "results" / "budgets" / "fit.json"


def grid(family: str, samples: int, seed: int) -> list[dict]:
    """``samples`` settings drawn from small shapes (the same ones every time for a seed)."""
    rng = np.random.default_rng([seed, len(family)])
    out = []
    for i in range(samples):
        h = int(rng.choice([64, 128, 192]))
        heads = int(rng.choice([2, 4]))
        dims = dict(
            hidden_size=h,
            intermediate_size=int(h * rng.choice([2, 3])),
            num_hidden_layers=int(rng.choice([2, 4])),
            num_attention_heads=heads,
            vocab_size=int(rng.choice([1000, 4000])),
        )
        if family == "llama":
            dims.update(num_key_value_heads=heads, tie_word_embeddings=True)
        else:
            dims.update(max_position_embeddings=256, num_labels=2)
        out.append(
            dict(
                dims=dims,
                rank=int(rng.choice([4, 16, 64])),
                batch=int(rng.choice([4, 8, 16])),
                length=int(rng.choice([32, 64, 128])),
                dtype=str(rng.choice(["float32", "bfloat16"])),
                checkpointing=bool(i % 3 == 2),
            )
        )
    return out


def fit(rows: list[dict]) -> list[float]:
    """Non-negative coefficients, each sample weighted by 1 / its measurement: the
    no-checkpointing ones (the first five features) first, then k and c_v' from the checkpointed
    rows less their one-layer terms."""
    from scipy.optimize import nnls

    plain = [r for r in rows if not r["checkpointing"]]
    a = np.array([r["features"][:5] for r in plain]) / np.array([[r["activations"]] for r in plain])
    coef, _ = nnls(a, np.ones(len(plain)))
    ck = [r for r in rows if r["checkpointing"]]
    measured = np.array([r["activations"] for r in ck])
    rest = np.array([r["activations"] - np.dot(coef, r["features"][:5]) for r in ck])
    b = np.array([r["features"][5:] for r in ck]) / measured[:, None]
    tail, _ = nnls(b, rest / measured)
    return [*map(float, coef), *map(float, tail)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24, help="samples per family")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"command": f"PYTHONPATH=$PWD python benchmarks/budgets/fit_memory.py --samples {args.samples}"}
    for family in ("llama", "bert"):
        rows = []
        for setting in grid(family, args.samples, args.seed):
            m = measure(family, **setting)
            p = m.prediction
            state = p.trainable * 4 * (1 + p.states)
            rows.append({**setting, "features": list(p.features), "activations": m.activations,
                         "fixed": p.weights + state, "resident": m.resident, "seconds": m.seconds})  # fmt: skip
            print(family, setting, f"activations {m.activations / 2**20:.1f} MiB, {m.seconds:.2f} s", flush=True)
        coef = fit(rows)
        for r in rows:
            predicted = r["fixed"] + float(np.dot(coef, r["features"]))
            r["peak_error"] = predicted / (r["fixed"] + r["activations"]) - 1
        errors = [abs(r["peak_error"]) for r in rows]
        result[family] = {"coefficients": coef, "max_peak_error": max(errors), "samples": rows}
        print(f'    "{family}": ({", ".join(f"{c:.4g}" for c in coef)}),  max |peak error| {max(errors):.1%}')
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
