"""Both CPU kinds on any machine: a CPU without bfloat16 units (AVX2) and one with them (AVX512-BF16 /
AMX). Each test forces the capability checks that pick a path, fedtune's
(:func:`fedtune.models.precision.computes_natively`, through torch.cpu's probes) and bitsandbytes'
(``has_avx512bf16``: its 4-bit layers' packed CPU path; torch's CPU capability: its int8 matrix
product), so a developer on either kind of CPU runs the paths of the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import load_config
from fedtune.models import precision
from fedtune.run import run_experiment

bnb = pytest.importorskip("bitsandbytes")

#: the CPU kinds: whether the bfloat16 (and float16) units are there
CPU_KINDS = {"avx2": False, "avx512-bf16+amx": True}
#: (model.quantization, model.dtype) of every base a CPU must train
SETTINGS = [
    (quantization, dtype)
    for quantization in ("none", "4bit", "8bit")
    for dtype in ("float32", "bfloat16", "float16")
    if (quantization, dtype) != ("none", "float32")  # a float32 base is left as it was built
]


@pytest.fixture(params=sorted(CPU_KINDS))
def cpu_units(request, monkeypatch):
    """This machine seen as the CPU kind of the parameter: whether it has bfloat16/float16 units."""
    units = CPU_KINDS[request.param]
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: units, raising=False)
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: units)
    return units


def tiny_lora_lm(hidden: int, quantization: str, dtype: str):
    """A 2-layer Llama of width ``hidden`` prepared as fedtune prepares a base, with LoRA (random A
    and B, no dropout) on its attention projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    run = load_config(None, [f"model.quantization={quantization}", f"model.dtype={dtype}", "device=cpu"])
    base = precision.prepare_base(LlamaForCausalLM(cfg), run)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(base, lora)


def train_step(model, ids) -> dict[str, torch.Tensor]:
    """One training forward and backward: the LoRA weights' gradients (zeroed after)."""
    model.train()
    model(ids).logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("hidden", [32, 64])  # 32: narrower than a 4-bit block; 64: one block
@pytest.mark.parametrize("quantization,dtype", SETTINGS)
def test_every_base_trains_alike_before_and_after_an_evaluation_on_either_cpu_kind(
    cpu_units, quantization, dtype, hidden
):
    """An evaluation (eval mode, no gradient) between two training steps changes nothing: both
    steps give every LoRA weight, the first layer's included, the same finite nonzero gradient
    (bitsandbytes' AVX512-BF16 path repacked 4-bit weights at the evaluation: the width-32 model
    failed there, the width-64 one lost its gradients below each layer). The compute dtype follows
    the CPU: bfloat16/float16 where it has the units, else float32."""
    model = tiny_lora_lm(hidden, quantization, dtype)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    before = train_step(model, ids)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits.float()).all()
    after = train_step(model, ids)
    lora = {n for n, p in model.named_parameters() if "lora_" in n}
    assert before.keys() == after.keys() == lora
    first = next(n for n in lora if ".layers.0." in n and "lora_A" in n)
    assert before[first].abs().sum() > 0
    for name in lora:
        assert torch.isfinite(before[name]).all() and torch.equal(before[name], after[name]), name
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    native = cpu_units and dtype != "float32"
    if quantization == "4bit":
        assert not getattr(q_proj.weight.quant_state, "packing_format_for_cpu", False)
        assert q_proj.compute_dtype == (precision.DTYPES[dtype] if native else torch.float32)
    if quantization == "none":
        assert isinstance(q_proj, precision.UpcastLinear) != native
        assert q_proj.weight.dtype == precision.DTYPES[dtype]


def test_a_4bit_run_gives_the_same_numbers_on_either_cpu_kind(tmp_path, monkeypatch):
    """Two rounds of FedIT on tiny-llama's 4-bit base (an evaluation after each round, training
    after the first) give the same metrics, bit for bit, whether the CPU is seen with bfloat16
    units or without: one 4-bit CPU path."""
    from fedtune.tasks.instruction import Instruction

    runs = {}
    for kind, units in CPU_KINDS.items():
        for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
            monkeypatch.setattr(torch.cpu, probe, lambda units=units: units, raising=False)
        monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda units=units: units)
        overrides = [*Instruction.test_overrides, "data.max_train_samples=16", "data.max_test_samples=4"]
        overrides += ["train.local_steps=2", "train.batch_size=4", "federation.num_clients=2", "rounds=2"]
        cfg = load_config(
            None, ["task.kind=instruction", *overrides, "model.quantization=4bit", f"output_dir={tmp_path / kind}"]
        )
        lines = (Path(run_experiment(cfg)["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        runs[kind] = [{k: v for k, v in json.loads(x).items() if "time" not in k and "_s" not in k} for x in lines]
    assert all(np.isfinite(x["loss"]) and np.isfinite(x["train_loss"]) for x in runs["avx2"])
    assert runs["avx2"] == runs["avx512-bf16+amx"]


#: an 8-bit base's training step in a fresh interpreter whose torch reports the CPU capability
#: argv[1] before bitsandbytes is imported (bitsandbytes registers its int8 CPU product by it)
INT8_PROBE = """
import json, sys, torch
torch.backends.cpu.get_cpu_capability = lambda: sys.argv[1]
import bitsandbytes
from tests.test_cpu_paths import tiny_lora_lm, train_step
model = tiny_lora_lm(64, "8bit", "float32")
ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
grads = train_step(model, ids)
model.eval()
with torch.no_grad():
    logits = model(ids).logits
kernel = torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::int8_linear_matmul", "CPU")
print(json.dumps({"cpu_kernel": kernel, "finite": bool(torch.isfinite(logits).all()),
                  "grads": {n: g.abs().sum().item() for n, g in grads.items()}}))
"""


def test_an_8bit_base_trains_with_either_int8_product_of_bitsandbytes():
    """bitsandbytes multiplies int8 matrices with torch._int_mm where torch reports AVX512 and with
    its default (float32) product elsewhere: an 8-bit base trains with either (finite outputs,
    the same nonzero LoRA gradients up to float32 rounding)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = {}
    for capability in ("AVX2", "AVX512"):
        done = subprocess.run(
            [sys.executable, "-c", INT8_PROBE, capability], cwd=root, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        out[capability] = json.loads(done.stdout.strip().splitlines()[-1])
    assert not out["AVX2"]["cpu_kernel"] and out["AVX512"]["cpu_kernel"]
    assert out["AVX2"]["finite"] and out["AVX512"]["finite"]
    grads = [out[c]["grads"] for c in ("AVX2", "AVX512")]
    assert grads[0].keys() == grads[1].keys() and all(v > 0 for v in grads[0].values())
    for name, value in grads[0].items():
        assert grads[1][name] == pytest.approx(value, rel=1e-4), name
