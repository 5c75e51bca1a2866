"""The memory model's predicted peak against the measured one on a SmolLM2-135M-shaped Llama
(random weights, built from its configuration: no download), float32 and bfloat16 at several
ranks, on the CPU (issue 41). Each setting trains a LoRA on q/v with AdamW for one step after a
warm-up step (:func:`fedtune.planning.calibrate.measure`), one thread.

    PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py [--batch 2 --length 64 --ranks 4 16 64]

Writes benchmarks/results/budgets/smollm2[-checkpointing].json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fedtune.planning.calibrate import measure

OUT = Path(__file__).resolve().parents[1] / "results" / "budgets"
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in args.dtypes:
        for rank in args.ranks:
            m = measure("llama", SMOLLM2, rank, args.batch, args.length, dtype, args.checkpointing, steps=1)
            p = m.prediction
            measured = p.weights + p.trainable * 4 * (1 + p.states) + m.activations
            rows.append({"dtype": dtype, "rank": rank, "predicted": p.peak, "measured": measured,
                         "predicted_activations": p.activations, "measured_activations": m.activations,
                         "weights": p.weights, "seconds": m.seconds, "predicted_seconds": p.seconds})  # fmt: skip
            print(rows[-1], flush=True)
    command = "PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py " + " ".join(sys.argv[1:])
    OUT.mkdir(parents=True, exist_ok=True)
    name = "smollm2-checkpointing" if args.checkpointing else "smollm2"
    (OUT / f"{name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Predicted vs measured peak: SmolLM2-135M shape, CPU, batch {args.batch} x {args.length} tokens, "
        f"LoRA q/v, AdamW, checkpointing {'on' if args.checkpointing else 'off'}",
        "",
        f"`{command}` (one thread; measured: weights as loaded + the resident growth over one step after a warm-up)",
        "",
        "| dtype | rank | weights MiB | predicted peak MiB | measured peak MiB | error "
        "| predicted s/step | measured s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        lines.append(
            f"| {r['dtype']} | {r['rank']} | {r['weights'] / 2**20:.0f} | {r['predicted'] / 2**20:.0f} | "
            f"{r['measured'] / 2**20:.0f} | {err:+.1%} | {r['predicted_seconds']:.2f} | {r['seconds']:.2f} |"
        )
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
