"""The memory model's predicted peak against the measured one on a SmolLM2-135M- or
Llama-3.2-3B-shaped Llama (random weights, built from its configuration: no download), float32,
bfloat16 or a 4-bit base at several ranks, on the CPU (issue 41). Each setting trains a LoRA on q/v
with AdamW for ``--steps`` steps (default 2: the second holds the optimizer's states beside its
activations, as a client's local steps do) after a warm-up step (:func:`fedtune.planning.calibrate.measure`: the
tensor bytes allocated at their most, with the resident growth beside them), one thread.

    PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py [--batch 2 --length 64 --ranks 4 16 64]
    PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py --shape 3b --dtypes bfloat16 --batch 1
    PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py --quantization 4bit --ranks 4 16

Writes benchmarks/results/budgets/<shape>[-4bit][-checkpointing].json and .md; ``--repredict``
re-prices those rows with memory.py's current features and coefficients (the same other options).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from fedtune.planning.calibrate import measure
from fedtune.planning.memory import Shape, Workload, activation_bytes, features

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
def built_as(dtype: str):
    """Build the base in ``dtype`` from the start (a 3B base never exists in float32)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        yield
    finally:
        torch.set_default_dtype(default)


#: each shape's batch x length whose results' file names leave it out
NAMED_BATCH = {"smollm2": (2, 64), "3b": (1, 64)}


def name_of(args: argparse.Namespace) -> str:
    """The results' file name (no suffix) for the setting ``args`` (``-batch{B}x{L}`` beside another
    shape's :data:`NAMED_BATCH`)."""
    batch = "" if (args.batch, args.length) == NAMED_BATCH[args.shape] else f"-batch{args.batch}x{args.length}"
    quantized = "-4bit" if args.quantization == "4bit" else ""
    return args.shape + quantized + batch + ("-checkpointing" if args.checkpointing else "")


def repredict(args: argparse.Namespace, rows: list[dict]) -> None:
    """Re-price ``rows``, measured with ``args``, with memory.py's current features and
    coefficients, in place."""
    dims = SHAPES[args.shape][1]
    shape = Shape("llama", dims["num_hidden_layers"], dims["hidden_size"], dims["intermediate_size"],
                  dims["num_attention_heads"], dims["vocab_size"])  # fmt: skip
    for r in rows:
        compute = getattr(torch, r["dtype"].split(", ")[-1])  # this CPU computes in bfloat16
        work = Workload(args.batch, args.length, torch.finfo(compute).bits // 8, args.checkpointing, 2, args.steps,
                        args.quantization != "none")  # fmt: skip
        r["features"] = features(shape, work, r["rank"], 2)  # LoRA on q and v
        acts = activation_bytes(shape, work, r["features"])
        r["predicted"] += acts - r["predicted_activations"]
        r["predicted_activations"] = acts


def write(args: argparse.Namespace, title: str, rows: list[dict], command: str) -> None:
    """The rows so far as ``<name>.json`` and a table ``<name>.md`` under :data:`OUT`."""
    OUT.mkdir(parents=True, exist_ok=True)
    name = name_of(args)
    (OUT / f"{name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    lines = [
        f"# Predicted vs measured peak: {title} shape, CPU, batch {args.batch} x {args.length} tokens, "
        f"LoRA q/v, AdamW, checkpointing {'on' if args.checkpointing else 'off'}",
        "",
        f"`{command}` (one thread; measured: weights as loaded + the tensor bytes allocated at their most over one "
        f"{args.steps} step(s) after a warm-up, `PeakMeter`; resident: the process's resident growth over them)",
        "",
        "| dtype | rank | weights MiB | predicted peak MiB | measured peak MiB | error | resident growth MiB "
        "| predicted s/step | measured s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        lines.append(
            f"| {r['dtype']} | {r['rank']} | {r['weights'] / 2**20:.0f} | {r['predicted'] / 2**20:.0f} | "
            f"{r['measured'] / 2**20:.0f} | {err:+.1%} | {r['resident'] / 2**20:.0f} | {r['predicted_seconds']:.2f} "
            f"| {r['seconds']:.2f} |"
        )
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=2, help="metered steps (1 for the 3B shape: its time)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--quantization", choices=["none", "4bit"], default="none")
    parser.add_argument(
        "--repredict", action="store_true", help="re-price the setting's stored rows with memory.py's current model"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    title, dims = SHAPES[args.shape]
    if args.repredict:
        stored = json.loads((OUT / f"{name_of(args)}.json").read_text())
        repredict(args, stored["rows"])
        write(args, title, stored["rows"], stored["command"])
        return
    command = "PYTHONPATH=$PWD python benchmarks/budgets/smollm2_check.py " + " ".join(sys.argv[1:])
    rows = []
    for dtype in args.dtypes:
        for rank in args.ranks:
            with built_as(dtype if args.quantization == "none" else "float32"):
                m = measure(
                    "llama",
                    dims,
                    rank,
                    args.batch,
                    args.length,
                    dtype,
                    args.checkpointing,
                    args.steps,
                    args.quantization,
                )
            p = m.prediction
            measured = p.weights + p.trainable * 4 * (1 + p.states) + m.activations
            label = dtype if args.quantization == "none" else f"4-bit NF4, {dtype}"
            rows.append({"dtype": label, "rank": rank, "predicted": p.peak, "measured": measured,
                         "predicted_activations": p.activations, "measured_activations": m.activations,
                         "weights": p.weights, "resident": m.resident, "features": list(p.features),
                         "seconds": m.seconds, "predicted_seconds": p.seconds})  # fmt: skip
            print(rows[-1], flush=True)
            write(args, title, rows, command)  # after each setting: a long run keeps what it measured


if __name__ == "__main__":
    main()
