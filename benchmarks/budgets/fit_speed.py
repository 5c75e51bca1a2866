"""Fit the speed of each base format relative to float32 (fedtune.planning.speed.RATIOS) from
timed LoRA training steps on random-weight Llamas built from shapes (issue 41).

Per shape, one base per format is built in one process (float32; bfloat16 computing in bfloat16;
bfloat16 computing in float32, the path of a CPU without bfloat16 units, taken here by hiding this
CPU's units from fedtune's probes while the base is built; 4-bit NF4 computing in float32 and in
bfloat16), each with a rank-16 LoRA on q/v, and the formats take one AdamW step each in turn,
``--repeats`` times after a warm-up step. The CPU is shared (8 workers on 2 cores), so absolute
seconds drift; the ratio of each format's median to float32's median in the same rounds is what
is fitted. One torch thread.

    PYTHONPATH=$PWD python benchmarks/budgets/fit_speed.py [--shapes smollm2 3b-layers --repeats 7]

Writes benchmarks/results/budgets/speed-fit.json and speed-fit.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch
from smollm2_check import LLAMA_3B, SMOLLM2  # the shapes the memory model is checked on

from fedtune.planning import speed
from fedtune.planning.memory import frozen_values

OUT = Path(__file__).resolve().parents[1] / "results" / "budgets"
SHAPES = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, vocab_size=2000),
    "smollm2": SMOLLM2,
    # two layers of the Llama-3.2-3B shape and a small vocabulary (the full model: 6 GiB in bfloat16)
    "3b-layers": {**LLAMA_3B, "num_hidden_layers": 2, "vocab_size": 4096},
}
#: (weights, compute) -> (model.dtype, model.quantization, hide the CPU's bfloat16 units)
FORMATS = {
    ("float32", "float32"): ("float32", "none", False),
    ("bfloat16", "bfloat16"): ("bfloat16", "none", False),
    ("bfloat16", "float32"): ("bfloat16", "none", True),
    ("4bit", "float32"): ("float32", "4bit", False),
    ("4bit", "bfloat16"): ("bfloat16", "4bit", False),
}
PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")


@contextlib.contextmanager
def units_hidden(hide: bool):
    """fedtune's CPU probes report no bfloat16 / float16 units inside the block (when ``hide``)."""
    saved = {p: getattr(torch.cpu, p, None) for p in PROBES}
    if hide:
        for p in PROBES:
            setattr(torch.cpu, p, lambda: False)
    try:
        yield
    finally:
        for p, f in saved.items():
            if f is not None:
                setattr(torch.cpu, p, f)


def measure_shape(name: str, batch: int, length: int, repeats: int, formats: list) -> dict:
    dims = SHAPES[name]
    models, flops = {}, {}
    for fmt in formats:
        dtype, quantization, hide = FORMATS[fmt]
        with units_hidden(hide):
            model = speed.lora_llama(dims, dtype, quantization)
            base = model.base_model.model
            got = speed.base_format(base)
        assert got == fmt, (got, fmt)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        flops[fmt] = speed.train_flops(frozen_values(base), trainable, batch * length, False)
        models[fmt] = model
    ids = torch.randint(0, dims["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))
    seconds = speed.interleaved(models, ids, repeats)
    cpu = {fmt: statistics.median(c for c, _ in s) for fmt, s in seconds.items()}
    out = {}
    for fmt, s in seconds.items():
        ratio, wall = cpu["float32", "float32"] / cpu[fmt], statistics.median(w for _, w in s)
        out["/".join(fmt)] = {"cpu_s": [c for c, _ in s], "wall_s": [w for _, w in s], "median_cpu_s": cpu[fmt],
                              "median_wall_s": wall, "ratio": ratio, "flops": flops[fmt],
                              "flops_per_s": flops[fmt] / cpu[fmt]}  # fmt: skip
        print(
            name, fmt, f"CPU {cpu[fmt]:.3f} s (wall {wall:.3f}), ratio {ratio:.3f}, {flops[fmt] / cpu[fmt]:.3g} FLOP/s"
        )
    return {"dims": dims, "batch": batch, "length": length, "repeats": repeats, "formats": out}


def write(result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "speed-fit.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Speed of each base format relative to float32 (CPU, one thread)",
        "",
        f"`{result['command']}`: the formats interleaved step by step in one process (LoRA r = 16 on q/v, "
        "AdamW); median CPU seconds of the process a step, median wall seconds beside them (the CPU is "
        "shared); ratio = float32's median CPU seconds / the format's; GFLOP/s = the step's FLOPs / its "
        "median CPU seconds.",
        "",
        "| shape | hidden | batch x length | format (weights/compute) | CPU s/step | wall s/step | ratio to float32 "
        "| GFLOP/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, r in result["shapes"].items():
        for fmt, f in r["formats"].items():
            lines.append(
                f"| {shape} | {r['dims']['hidden_size']} | {r['batch']} x {r['length']} | {fmt} | "
                f"{f['median_cpu_s']:.3f} | {f['median_wall_s']:.3f} | {f['ratio']:.2f} | "
                f"{f['flops_per_s'] / 1e9:.1f} |"
            )
    (OUT / "speed-fit.md").write_text("\n".join(lines) + "\n")


#: the held-out check: (shape, weights/compute formats, batch, length); the 3B shape is built in bfloat16
CHECKS = [
    ("smollm2", list(FORMATS), 1, 64),
    ("smollm2", list(FORMATS), 2, 64),
    ("1b", [("bfloat16", "bfloat16"), ("4bit", "bfloat16")], 1, 64),
    ("3b", [("bfloat16", "bfloat16")], 1, 64),
]
#: the full shapes of the check: Llama-3.2-3B (benchmarks/llm/llm_scale.py's) and Llama-3.2-1B, a width not fitted
FULL = {
    "3b": {**SHAPES["3b-layers"], "num_hidden_layers": 28, "vocab_size": 128256},
    "1b": {**SHAPES["3b-layers"], "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "vocab_size": 128256},
}  # fmt: skip


def check(repeats: int, shapes: list[str], command: str) -> None:
    """Predicted (:func:`fedtune.planning.memory.predict`) against measured seconds of a step on
    the full SmolLM2 shape in every format, the Llama-3.2-1B shape (a width between the fitted
    ones) and the full Llama-3.2-3B shape in bfloat16 (``shapes``: those of :data:`CHECKS` to
    run); each shape's rows replace its earlier ones in speed-check.json / .md as it ends."""
    from fedtune.planning.memory import Workload, predict

    path = OUT / "speed-check.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    for shape, formats, batch, length in CHECKS:
        if shape not in shapes:
            continue
        rows = [r for r in rows if (r["shape"], r["batch"], r["length"]) != (shape, batch, length)]
        dims = FULL.get(shape) or SHAPES[shape]
        models, predicted, notes = {}, {}, {}
        for fmt in formats:
            dtype, quantization, hide = FORMATS[fmt]
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16 if shape in FULL else torch.float32)  # no float32 copy
            with units_hidden(hide):
                base = speed.llama_base(dims, dtype, quantization)
                work = Workload(batch, length, 4 if fmt[1] == "float32" else 2, False, states=2)
                # as the planner sees it: the base before its adapter
                predicted[fmt] = predict(base, ["q_proj", "v_proj"], [], 16, work).seconds
                notes[fmt] = speed.reference(base, dims["hidden_size"]).note
            torch.set_default_dtype(default)
            models[fmt] = speed.with_lora(base)
        ids = torch.randint(0, dims["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))
        seconds = speed.interleaved(models, ids, repeats)
        for fmt in models:
            cpu = statistics.median(c for c, _ in seconds[fmt])
            wall = statistics.median(w for _, w in seconds[fmt])
            rows.append({"shape": shape, "format": "/".join(fmt), "batch": batch, "length": length,
                         "predicted_s": predicted[fmt], "cpu_s": cpu, "wall_s": wall, "note": notes[fmt],
                         "command": command})  # fmt: skip
            print(rows[-1], flush=True)
        del models, seconds, base
        write_check(rows)


def write_check(rows: list[dict]) -> None:
    (OUT / "speed-check.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    lines = [
        "# Predicted vs measured seconds a step (CPU, one thread; LoRA r = 16 on q/v, AdamW)",
        "",
        "`PYTHONPATH=$PWD python benchmarks/budgets/fit_speed.py --check SHAPE`, the command of each row in "
        "speed-check.json: the formats of a shape interleaved step by step, medians; predicted / measured "
        "CPU seconds (the wall seconds on this shared CPU beside them).",
        "",
        "| shape | format | batch x length | predicted s | CPU s | predicted / CPU | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['format']} | {r['batch']} x {r['length']} | {r['predicted_s']:.3f} | "
            f"{r['cpu_s']:.3f} | {r['predicted_s'] / r['cpu_s']:.2f} | {r['wall_s']:.3f} |"
        )
    (OUT / "speed-check.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2", "3b-layers"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--check",
        nargs="+",
        choices=sorted({c[0] for c in CHECKS}),
        help="predicted vs measured on these full shapes instead",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    command = "PYTHONPATH=$PWD python benchmarks/budgets/fit_speed.py " + " ".join(sys.argv[1:])
    if args.check:
        check(args.repeats, args.check, command)
        return
    result = {"command": command, "shapes": {}}
    for shape in args.shapes:
        result["shapes"][shape] = measure_shape(shape, args.batch, args.length, args.repeats, list(FORMATS))
        write(result)
    print("FLOPS = {")  # to paste into fedtune/planning/speed.py
    for fmt in FORMATS:
        points = sorted(
            (r["dims"]["hidden_size"], r["formats"]["/".join(fmt)]["flops_per_s"]) for r in result["shapes"].values()
        )
        print(f"    {fmt}: ({', '.join(f'({w}, {f:.3g})' for w, f in points)},),")
    print("}")


if __name__ == "__main__":
    main()
