"""Seconds of a client's local training: its FLOPs over the FLOP/s of its base's format and width.

A client of speed 1 trains a base at :data:`FLOPS`' FLOP/s for the base's format, the base's
(weights, compute dtype) as loaded (:func:`base_format`): a bfloat16 base computes in bfloat16 on a
CPU with bfloat16 units and in float32 without them (fedtune upcasts each weight:
:func:`fedtune.models.precision.computes_natively`, which reads torch's CPU probes), so the CPU's
kind picks the entry. Each entry holds the FLOP/s measured at a few hidden widths (a product's
speed grows with its matrices) by ``benchmarks/budgets/fit_speed.py`` (results:
benchmarks/results/budgets/speed-fit.json) on this machine's CPU, one thread: LoRA training steps on
random-weight Llamas, the formats interleaved step by step in one process, each one's median CPU
seconds (the CPU is shared by other processes: the wall seconds of a step were 3-7x its CPU
seconds, and drifted with the load). Between two widths the FLOP/s are interpolated on log scales;
outside them the nearest width's are used. A format without an entry, or a base on another device,
is priced at float32's and the plan says so; :func:`calibrated` puts this machine's measured
ratios to float32 in place of the table's (``fedtune plan --calibrate-speed``).
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

#: float32 FLOP/s of a speed-1 client for the sub-model methods (their plan's seconds):
#: the wall seconds of small models on this shared CPU (fit_memory.py, before the fit below).
REFERENCE_FLOPS = 1.16e10
#: FLOP/s of a speed-1 client per (weights, compute dtype): ((hidden width, FLOP/s), ...), fitted by
#: benchmarks/budgets/fit_speed.py (1 x 64 tokens, LoRA r = 16 on q/v, AdamW).
FLOPS: dict[tuple[str, str], tuple[tuple[int, float], ...]] = {
    ("float32", "float32"): ((256, 5.14e10), (576, 6.95e10), (3072, 8.25e10)),
    ("bfloat16", "bfloat16"): ((256, 6.7e10), (576, 1.35e11), (3072, 2.81e11)),
    ("bfloat16", "float32"): ((256, 4.86e10), (576, 6.63e10), (3072, 7.13e10)),
    ("4bit", "float32"): ((256, 3.91e10), (576, 6.22e10), (3072, 4.01e10)),
    ("4bit", "bfloat16"): ((256, 4.58e10), (576, 9.34e10), (3072, 6.32e10)),
}
#: this machine's ratios to float32 measured by :func:`calibrate`, used in place of :data:`FLOPS`' while set
_measured: dict[tuple[str, str], float] = {}


@dataclass(frozen=True)
class Reference:
    """FLOP/s of a speed-1 client for a base, and where the figure comes from."""

    flops: float
    note: str


def at_width(points: tuple[tuple[int, float], ...], hidden: int) -> float:
    """``points``' FLOP/s at width ``hidden``: log-log interpolation, the nearest point outside them."""
    widths = [w for w, _ in points]
    i = bisect.bisect_left(widths, hidden)
    if i == len(points) or widths[i] == hidden or i == 0:
        return points[min(i, len(points) - 1)][1]
    (w0, f0), (w1, f1) = points[i - 1], points[i]
    t = math.log(hidden / w0) / math.log(w1 / w0)
    return math.exp(math.log(f0) + t * math.log(f1 / f0))


def train_flops(
    frozen: int, trainable: int, tokens: int, checkpointing: bool, head: int = 0, logit_tokens: int = 0
) -> float:
    """FLOPs of one training step: the forward (2 per frozen value and token), the input's
    gradient (2), a second forward under checkpointing (2), and 6 per trainable value and token;
    ``head`` of the frozen values (the LM head) over the ``logit_tokens`` whose logits the loss
    computes only, 4 each (checkpointing recomputes the transformer layers, not the head)."""
    return (2 * (2 + checkpointing) * (frozen - head) + 6 * trainable) * tokens + 4 * head * logit_tokens


def forward_flops(frozen: int, trainable: int, tokens: int, head: int = 0, logit_tokens: int = 0) -> float:
    """FLOPs of one gradient-free forward pass: 2 per value and token, ``head``'s per logit token."""
    return 2 * (frozen - head + trainable) * tokens + 2 * head * logit_tokens


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def base_format(base: nn.Module, heads: Sequence[str] = ()) -> tuple[str, str]:
    """(weights, compute dtype) of ``base`` as loaded: a quantized base's bits and its layers'
    compute dtype; else its largest linear layer's dtype and the dtype it computes in there, the
    task's ``heads`` left out (they stay float32 in a bfloat16 base, and a small model's head, a
    multimodal projector, may be its largest linear: read, the bfloat16 copy's seconds were priced
    at float32's speed, about 6 % (x 1.3 with bfloat16 units) off the plan from the skeleton)."""
    from fedtune.models.precision import _under, computes_natively

    linears = []  # (not a head's, weight): a head's only where the model has no other linear
    for name, module in base.named_modules():
        kind = type(module).__module__.split(".")[0] + "." + type(module).__name__
        if kind == "bitsandbytes.Linear4bit":
            return "4bit", _dtype_name(cast(torch.dtype, module.compute_dtype))
        if kind == "bitsandbytes.Linear8bitLt":
            return "8bit", "int8"
        if isinstance(module, nn.Linear):
            linears.append((not _under(name, heads), module.weight))
    _, weight = max(linears, key=lambda x: (x[0], x[1].numel()))
    compute = weight.dtype if computes_natively(weight.device, weight.dtype) else torch.float32
    return _dtype_name(weight.dtype), _dtype_name(compute)


def label(fmt: tuple[str, str]) -> str:
    """A format as the plan names it."""
    return fmt[0] if fmt[0] == fmt[1] else f"{fmt[0]} weights, {fmt[1]} compute"


def planned_format(quantization: str, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """(weights, compute dtype) of a base prepared as
    :func:`~fedtune.models.precision.prepare_base` would with ``quantization`` and ``model.dtype``
    ``dtype`` on ``device``: what :func:`base_format` reads from such a base once built."""
    from fedtune.models.precision import computes_natively

    compute = dtype if computes_natively(device, dtype) else torch.float32
    if quantization == "4bit":
        return "4bit", _dtype_name(compute)
    if quantization == "8bit":
        return "8bit", "int8"
    return _dtype_name(dtype), _dtype_name(compute)


def reference(
    base: nn.Module, hidden: int, fmt: tuple[str, str] | None = None, device: torch.device | None = None
) -> Reference:
    """The FLOP/s of a speed-1 client training ``base`` of width ``hidden`` (it picks the point of
    the format's entry), or float32's with a note saying its format was not measured; ``fmt`` and
    ``device``: the format the client's base will have (:func:`planned_format`) and the device it
    will be on (default: ``base``'s own)."""
    fmt = fmt or base_format(base)
    float32 = at_width(FLOPS["float32", "float32"], hidden)
    device = device or next((p.device for p in base.parameters()), torch.device("cpu"))
    widths = sorted({w for points in FLOPS.values() for w, _ in points})
    fitted = f"fitted at widths {widths[0]}-{widths[-1]} (benchmarks/results/budgets/speed-fit.json)"
    if device.type != "cpu":
        note = f"no speed measured on {device.type}: this CPU's float32 {float32:.3g} FLOP/s used"
    elif fmt in _measured:
        flops = _measured[fmt] * float32
        note = f"{label(fmt)} measured on this machine at {_measured[fmt]:.3g} x float32's {float32:.3g} FLOP/s"
        return Reference(flops, f"time model: width {hidden}, {note}")
    elif fmt in FLOPS:
        flops = at_width(FLOPS[fmt], hidden)
        return Reference(flops, f"time model: width {hidden}, {label(fmt)} at {flops:.3g} FLOP/s, {fitted}")
    else:
        note = f"{label(fmt)}: speed not measured, float32's {float32:.3g} FLOP/s used"
    return Reference(float32, f"time model: width {hidden}, {note}")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of one causal-LM training step of ``model``
    with ``opt`` on ``ids``."""
    cpu, wall = time.process_time(), time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.process_time() - cpu, time.perf_counter() - wall


def interleaved(models: dict, ids: torch.Tensor, repeats: int) -> dict:
    """Each model's (CPU, wall) seconds of ``repeats`` AdamW steps, the models taking one step each
    in turn, after a warm-up step each."""
    opts = {
        key: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for key, m in models.items()
    }
    for key, model in models.items():
        model.train()
        train_step(model, opts[key], ids)
    seconds: dict = {key: [] for key in models}
    for _ in range(repeats):
        for key, model in models.items():
            seconds[key].append(train_step(model, opts[key], ids))
    return seconds


def llama_base(dims: dict, dtype: str, quantization: str = "none") -> nn.Module:
    """A random-weight Llama of ``dims`` prepared as a run's base on the CPU (``model.dtype``,
    ``model.quantization``)."""
    import transformers

    from fedtune.config import load_config
    from fedtune.models.precision import prepare_base

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
    return prepare_base(
        model, load_config(None, [f"model.dtype={dtype}", f"model.quantization={quantization}", "device=cpu"])
    )


def with_lora(base: nn.Module, rank: int = 16) -> nn.Module:
    """``base`` with a rank-``rank`` LoRA on q/v."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(base, LoraConfig(r=rank, target_modules=["q_proj", "v_proj"]))


def lora_llama(dims: dict, dtype: str, quantization: str = "none", rank: int = 16) -> nn.Module:
    """:func:`llama_base` with :func:`with_lora`."""
    return with_lora(llama_base(dims, dtype, quantization), rank)


def calibrate(shape, dtype: str, quantization: str, repeats: int = 3) -> dict[tuple[str, str], float]:
    """This machine's speed of a format relative to float32: two-layer Llamas of the widths of
    ``shape`` (a :class:`fedtune.planning.memory.Shape`; vocabulary 4096, 1 x 64 tokens) in float32
    and in ``dtype`` / ``quantization``, ``repeats`` steps each, interleaved, the medians of their
    CPU seconds compared (none for float32)."""
    dims = dict(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=2,
        num_attention_heads=shape.heads, vocab_size=4096,
    )  # fmt: skip
    models = {"float32": lora_llama(dims, "float32"), "run": lora_llama(dims, dtype, quantization)}
    run: Any = models["run"]  # a PEFT model
    fmt = base_format(run.base_model.model)
    if fmt == ("float32", "float32"):
        return {}
    ids = torch.randint(0, dims["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(1))
    seconds = interleaved(models, ids, repeats)
    cpu = {key: statistics.median(c for c, _ in s) for key, s in seconds.items()}
    return {fmt: cpu["float32"] / cpu["run"]}


@contextmanager
def calibrated(ratios: dict[tuple[str, str], float]) -> Iterator[None]:
    """:func:`reference` uses ``ratios`` (this machine's) in place of :data:`RATIOS` inside the block."""
    _measured.update(ratios)
    try:
        yield
    finally:
        _measured.clear()
