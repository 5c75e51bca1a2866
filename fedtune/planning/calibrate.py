"""Measure one client's LoRA training on a model built from its shape (random weights, no
download), beside the memory model's prediction: what ``benchmarks/budgets/fit_memory.py`` fits
the coefficients of :mod:`fedtune.planning.memory` from, and what the tests check them against."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from fedtune.planning.memory import PeakMeter, Prediction, Workload, predict

#: Per family: the model class, its LoRA targets and head modules (the tasks' defaults).
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", ["q_proj", "v_proj"], []),
    "bert": ("BertForSequenceClassification", "BertConfig", ["query", "value"], ["classifier"]),
}


@dataclass
class Measurement:
    prediction: Prediction
    activations: int | None  # the measured growth less the trainable values and their states
    growth: int | None  # the measured growth over the local training (:class:`PeakMeter`: tensor bytes)
    resident: int | None  # the process's resident growth over it (Linux)
    seconds: float


def build(
    family: str, dims: dict, dtype: str, checkpointing: bool, seed: int = 0, quantization: str = "none"
) -> torch.nn.Module:
    """A random-weight ``family`` model of ``dims`` prepared as a run's base (:func:`prepare_base`)
    with ``model.quantization=quantization``."""
    import transformers

    from fedtune.config import load_config
    from fedtune.models.precision import prepare_base

    model_cls, config_cls, _, heads = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**dims)
    model = getattr(transformers, model_cls)(cfg)
    run = load_config(
        None,
        [
            f"model.dtype={dtype}",
            f"train.gradient_checkpointing={str(checkpointing).lower()}",
            "device=cpu",
            f"model.quantization={quantization}",
        ],
    )
    return prepare_base(model, run, heads)


def measure(
    family: str,
    dims: dict,
    rank: int,
    batch: int,
    length: int,
    dtype: str = "float32",
    checkpointing: bool = False,
    steps: int = 2,
    quantization: str = "none",
) -> Measurement:
    """Train a rank-``rank`` LoRA (AdamW) for ``steps`` steps on ``batch`` x ``length`` random
    tokens, after one warm-up step: their seconds, then the growth over them run again
    (:class:`PeakMeter`, with the resident growth beside it), and the prediction."""
    from peft import LoraConfig, get_peft_model

    _, _, targets, heads = FAMILIES[family]
    base = build(family, dims, dtype, checkpointing, quantization=quantization)
    from fedtune.models.precision import DTYPES, computes_natively

    compute = DTYPES[dtype] if computes_natively(torch.device("cpu"), DTYPES[dtype]) else torch.float32
    bits = torch.finfo(compute).bits
    work = Workload(batch, length, bits // 8, checkpointing, states=2, steps=steps, kbit=quantization != "none")
    prediction = predict(base, targets, heads, rank, work)
    model = get_peft_model(base, LoraConfig(r=rank, target_modules=targets, modules_to_save=heads or None))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, dims.get("vocab_size", 1000), (batch, length), generator=gen)
    labels = ids if family == "llama" else torch.zeros(batch, dtype=torch.long)

    def train(n: int) -> None:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(n):
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model.train()
    train(1)  # warm-up: kernels, caches, the upcast buffers of a low-precision base
    start = time.perf_counter()
    train(steps)  # timed without the meter, whose profiler slows the steps
    seconds = time.perf_counter() - start
    gc.collect()
    with PeakMeter(torch.device("cpu"), resident=True) as meter:
        train(steps)
    state = prediction.trainable * 4 * (1 + prediction.states)
    acts = None if meter.growth is None else meter.growth - state
    return Measurement(prediction, acts, meter.growth, meter.resident, seconds)
