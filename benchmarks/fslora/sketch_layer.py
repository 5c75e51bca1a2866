"""Micro-benchmark: forward + backward time of one sketched LoRA layer, k = 8 vs k = 64 (r = 64).

FSLoRA's client trains W0 + (alpha/r) B S A as a PEFT LoRA Linear of rank k with the same
lora_alpha (fedtune/methods/fslora.py), so its compute should scale with k. This times exactly
that path (``peft`` LoRA ``Linear`` at rank k, injected into a 384x384 ``nn.Linear``, MiniLM's
hidden size) on a batch of 16 x 64 tokens, and, for comparison, the dense masked form
(rank-64 adapter with the diagonal sketch applied as a mask, what a "mask the gradient"
implementation computes). All variants are measured in one run with interleaved repetitions
(the order rotates every repetition); the reported time is the median.

Two views: the whole layer (frozen W0 matmul included; the input needs a gradient, as for any
layer above the first adapted one) and the LoRA branch alone (lora_B(lora_A(dropout(x))) * s).

    .venv/bin/python benchmarks/fslora/sketch_layer.py            # writes benchmarks/results/fslora_sketch_layer.md
    .venv/bin/python benchmarks/fslora/sketch_layer.py --reps 41 --threads 2 --dropouts 0
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HIDDEN, BATCH, TOKENS, RANK = 384, 16, 64, 64
RESULTS = Path(__file__).resolve().parents[1] / "results" / "fslora_sketch_layer.md"


def lora_layer(rank: int, alpha: float, dropout: float, seed: int = 0) -> nn.Module:
    """A 384x384 linear layer with a PEFT LoRA adapter of ``rank`` (the client's computation)."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    holder = nn.Module()
    holder.proj = nn.Linear(HIDDEN, HIDDEN)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=["proj"])
    holder = inject_adapter_in_model(cfg, holder)
    layer = holder.proj
    with torch.no_grad():  # B = 0 at PEFT init; give it values so the branch is not trivially zero
        layer.lora_B["default"].weight.normal_(0, 0.02)
    layer.train()
    return layer


def make_step(layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, branch_only: bool, mask: torch.Tensor | None):
    """One forward + backward; gradients reset as ``zero_grad(set_to_none=True)`` does."""
    a, b = layer.lora_A["default"], layer.lora_B["default"]
    drop, scaling = layer.lora_dropout["default"], layer.scaling["default"]
    params = [a.weight, b.weight]

    def forward() -> torch.Tensor:
        if mask is None and not branch_only:
            return layer(x)  # PEFT's Linear.forward: W0 x + (alpha/k) B A dropout(x)
        h = a(drop(x))  # (B, T, r)
        if mask is not None:
            h = h * mask  # dense sketch: S = (r/k) diag over I, zeros elsewhere
        out = b(h) * scaling
        return out if branch_only else layer.base_layer(x) + out

    def step() -> None:
        for p in params:
            p.grad = None
        x.grad = None
        forward().backward(grad_out)

    return step


def measure(reps: int, inner: int, dropouts: list[float], alpha: float) -> dict[str, tuple[float, float]]:
    """Median (CPU ms, wall ms) per step of every variant, all interleaved in one loop."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, TOKENS, HIDDEN, generator=gen, requires_grad=True)
    grad_out = torch.randn(BATCH, TOKENS, HIDDEN, generator=gen)
    idx = torch.randperm(RANK, generator=gen)[:8]
    mask = torch.zeros(RANK)
    mask[idx] = RANK / 8
    variants = {}
    for p in dropouts:
        layers = {k: lora_layer(k, alpha, p) for k in (8, 64)}
        for view, branch in (("layer", False), ("branch", True)):
            variants[(p, view, "k=8")] = make_step(layers[8], x, grad_out, branch, None)
            variants[(p, view, "k=64")] = make_step(layers[64], x, grad_out, branch, None)
            variants[(p, view, "k=8 dense masked")] = make_step(layers[64], x, grad_out, branch, mask)
    x2, dy2 = x.detach().reshape(-1, HIDDEN), grad_out.reshape(-1, HIDDEN)  # (T, n)
    for k in (8, 64):  # single products of the branch: forward x A^T and the weight gradient dy^T h
        a_k = torch.randn(k, HIDDEN, generator=gen)
        h_k = x2 @ a_k.t()  # (T, k)
        variants[("product", "forward x A^T", f"k={k}")] = lambda x2=x2, a_k=a_k: x2 @ a_k.t()
        variants[("product", "weight gradient dy^T h", f"k={k}")] = lambda dy2=dy2, h_k=h_k: dy2.t() @ h_k
    names = list(variants)
    for step in variants.values():  # warm-up
        for _ in range(3):
            step()
    cpu: dict = {n: [] for n in names}
    wall: dict = {n: [] for n in names}
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:  # rotated every repetition: interleaved, no fixed order
            step = variants[name]
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(inner):
                step()
            cpu[name].append((time.process_time() - c0) / inner)
            wall[name].append((time.perf_counter() - w0) / inner)
    return {n: (statistics.median(cpu[n]) * 1e3, statistics.median(wall[n]) * 1e3) for n in names}


LABELS = {
    "k=8": "k=8: rank-8 adapter (FSLoRA client)",
    "k=64": "k=64: rank-64 adapter",
    "k=8 dense masked": "k=8 as dense masked B S A (rank 64)",
}


def flops_ratio(view: str) -> float:
    """Multiply-add ratio k=8 / k=64 (W0: forward and input gradient; LoRA: 6 T n k)."""
    tokens = BATCH * TOKENS
    w0 = 0 if view == "branch" else 2 * tokens * HIDDEN * HIDDEN
    return (w0 + 6 * tokens * HIDDEN * 8) / (w0 + 6 * tokens * HIDDEN * 64)


def report(ms: dict, args) -> str:
    lines = [
        "# FSLoRA sketched LoRA layer: forward + backward, k = 8 vs k = 64 (r = 64)",
        "",
        f"`python {' '.join(['benchmarks/fslora/sketch_layer.py', *args.argv])}`",
        "",
        f"A {HIDDEN}x{HIDDEN} linear layer with a PEFT LoRA adapter (the FSLoRA client's path: a rank-k",
        f"adapter with the same lora_alpha={args.alpha:g}), batch {BATCH} x {TOKENS} tokens, float32,",
        f"torch {torch.__version__}, {args.threads} CPU thread(s), {platform.machine()}, {os.cpu_count()} cores shared",
        "with other jobs. One forward + backward per step (gradients for x, A and B; W0 frozen;",
        f"gradients reset to None each step). Median of {args.reps} interleaved repetitions of {args.inner}",
        "steps; CPU time (process_time) is the main number because the machine is shared; wall time beside it.",
        "",
        "| lora_dropout | view | variant | CPU ms / step | wall ms / step | CPU ratio to k=64 | multiply-add ratio |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for p in args.dropouts:
        for view in ("layer", "branch"):
            ref = ms[(p, view, "k=64")][0]
            for variant, label in LABELS.items():
                c, w = ms[(p, view, variant)]
                fr = flops_ratio(view) if variant == "k=8" else 1.0
                lines.append(f"| {p:g} | {view} | {label} | {c:.3f} | {w:.3f} | {c / ref:.3f} | {fr:.3f} |")
    lines += [
        "",
        f"Single products of the branch (T = {BATCH * TOKENS}, n = {HIDDEN}), same loop:",
        "",
        "| product | k=8 CPU ms | k=64 CPU ms | ratio | multiply-add ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for product in ("forward x A^T", "weight gradient dy^T h"):
        c8, c64 = ms[("product", product, "k=8")][0], ms[("product", product, "k=64")][0]
        lines.append(f"| {product} | {c8:.3f} | {c64:.3f} | {c8 / c64:.3f} | 0.125 |")
    lines.append("")
    for p in args.dropouts:
        layer = ms[(p, "layer", "k=8")][0] / ms[(p, "layer", "k=64")][0]
        branch = ms[(p, "branch", "k=8")][0] / ms[(p, "branch", "k=64")][0]
        verdict = "meets" if layer <= 0.3 else "misses"
        lines.append(
            f"- lora_dropout={p:g}: **whole layer k=8 / k=64 = {layer:.3f}** ({verdict} the goal <= 0.3); "
            f"**LoRA branch only = {branch:.3f}**."
        )
    lines += [
        "",
        '"layer" is PEFT\'s `Linear.forward` (W0 x + (alpha/k) B A dropout(x)); "branch" is',
        "lora_B(lora_A(dropout(x))) * scaling alone. The multiply-add ratio counts only the matrix",
        f"products: W0's 2 T n^2 (forward and input gradient, T = {BATCH * TOKENS} tokens, n = {HIDDEN}) do not",
        "depend on k, the LoRA products' 6 T n k do; so even a perfect rank-k branch leaves the whole",
        f"layer at {flops_ratio('layer'):.3f} of k=64, above the 0.3 goal. Below that bound the time does not follow",
        "the multiply-adds. The rank-k products are skinny (one side of size k): they run far below",
        "the arithmetic rate of a square product on CPU BLAS, the two weight-gradient products most of",
        f"all (dy^T h and dh^T x reduce over the T = {BATCH * TOKENS} tokens into an n x k output: see the",
        "single-product table). On top come k-free T x n passes",
        "(dropout's random mask, the scaling multiply, the add into the output, the",
        "input-gradient accumulation). The dense masked form (B S A at rank 64, what a masking",
        "implementation computes) costs what k = 64 costs: slicing the active ranks is what saves the",
        "work that can be saved.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--dropouts",
        type=float,
        nargs="+",
        default=[0.1, 0.0],
        help="lora_dropout values (configs/fslora.toml: 0.1; fedtune's default: 0)",
    )
    parser.add_argument("--alpha", type=float, default=128.0, help="lora_alpha (configs/fslora.toml: 128)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    torch.set_num_threads(args.threads)
    ms = measure(args.reps, args.inner, args.dropouts, args.alpha)
    text = report(ms, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
