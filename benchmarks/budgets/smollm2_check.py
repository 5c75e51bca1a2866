"""The memory model's predicted peak against the measured one on a SmolLM2-135M- or
Llama-3.2-3B-shaped Llama (random weights, built from its configuration: no download), float32,
bfloat16 or a 4-bit base at several ranks, on the CPU (issue 41). Each setting trains a LoRA on q/v
with AdamW for one step after a warm-up step (:func:`fedtune.planning.calibrate.measure`), one thread.

    PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py [--batch 2 --length 64 --ranks 4 16 64]
    PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py --shape 3b --dtypes bfloat16 --batch 1
    PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py --quantization 4bit --ranks 4 16

Writes benchmarks/results/budgets/<shape>[-4bit][-checkpointing].json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

import fedtune.config
from fedtune.planning.calibrate import measure

OUT = Path(__file__).resolve().parents[1] / "results" / "budgets"
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
)  # fmt: skip
# benchmarks/llm/llm_scale.py's "llama-3.2-3b"
LLAMA_3B = dict(
    hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
)  # fmt: skip
SHAPES = {"smollm2": ("SmolLM2-135M", SMOLLM2), "3b": ("Llama-3.2-3B", LLAMA_3B)}


@contextlib.contextmanager
def built_as(dtype: str, quantization: str):
    """Build the base in ``dtype`` from the start (a 3B base never exists in float32) and load it
    with ``model.quantization=quantization`` (the option :func:`measure` does not take)."""
    load, default = fedtune.config.load_config, torch.get_default_dtype()

    def load_quantized(path, overrides):
        return load(path, [*overrides, f"model.quantization={quantization}"])

    torch.set_default_dtype(getattr(torch, dtype))
    fedtune.config.load_config = load_quantized
    try:
        yield
    finally:
        torch.set_default_dtype(default)
        fedtune.config.load_config = load


def write(args: argparse.Namespace, title: str, rows: list[dict]) -> None:
    """The rows so far as ``<name>.json`` and a table ``<name>.md`` under :data:`OUT`."""
    command = "PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py " + " ".join(sys.argv[1:])
    OUT.mkdir(parents=True, exist_ok=True)
    name = (
        args.shape + ("-4bit" if args.quantization == "4bit" else "") + ("-checkpointing" if args.checkpointing else "")
    )
    (OUT / f"{name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Predicted vs measured peak: {title} shape, CPU, batch {args.batch} x {args.length} tokens, "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--quantization", choices=["none", "4bit"], default="none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    title, dims = SHAPES[args.shape]
    rows = []
    for dtype in args.dtypes:
        for rank in args.ranks:
            with built_as(dtype if args.quantization == "none" else "float32", args.quantization):
                m = measure("llama", dims, rank, args.batch, args.length, dtype, args.checkpointing, steps=1)
            p = m.prediction
            measured = p.weights + p.trainable * 4 * (1 + p.states) + m.activations
            label = dtype if args.quantization == "none" else f"4-bit NF4, {dtype}"
            rows.append({"dtype": label, "rank": rank, "predicted": p.peak, "measured": measured,
                         "predicted_activations": p.activations, "measured_activations": m.activations,
                         "weights": p.weights, "seconds": m.seconds, "predicted_seconds": p.seconds})  # fmt: skip
            print(rows[-1], flush=True)
            write(args, title, rows)  # after each setting: a long run keeps what it measured


if __name__ == "__main__":
    main()
