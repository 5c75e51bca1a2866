"""A frozen base model made ready for its run: device, dtype, quantization (QLoRA), checkpointing.

:func:`prepare_base` applies, in this order, what the config asks of the base a LoRA method
adapts (``model.dtype``, ``model.quantization``, ``train.gradient_checkpointing``, ``device``):

1. **dtype.** The parameters of the matrix layers (linear, embedding, convolution) outside the
   task's head modules are cast to ``model.dtype``; norms and buffers (rotary frequencies, norm
   statistics) keep theirs. Heads stay float32,
   and PEFT creates LoRA weights in float32 over a bfloat16/float16 layer (its
   ``autocast_adapter_dtype``), so what trains, travels and is averaged stays float32.
2. **Quantization** (Dettmers et al. 2023, QLoRA): every ``nn.Linear`` outside the heads and the
   output embedding becomes a bitsandbytes ``Linear4bit`` (NF4, double quantization, compute in
   ``model.dtype`` where the device computes in it at speed, else float32) or ``Linear8bitLt``
   (LLM.int8, no fp16 weights kept), quantized when the model
   moves to its device; then PEFT's ``prepare_model_for_kbit_training`` (every weight left in
   16-bit precision, the embeddings and norms, goes to float32, for stable training). The model
   is marked ``is_loaded_in_4bit`` / ``is_loaded_in_8bit`` as transformers marks a model it loads
   quantized, which is how PEFT
   chooses its quantized LoRA layers.
3. **Gradient checkpointing** on every Hugging Face model inside (non-reentrant), or one line
   saying the model has none.
4. **Device.** The model moves to ``device`` and a forward pre-hook moves every tensor of a
   call's arguments there, so a task's CPU batches need no device code.

Compute in a lower precision runs under ``torch.autocast(device, model.dtype)`` around the forward
of the model, of its direct parts and of each Hugging Face model inside (which a task or the
model's own ``generate`` may call directly), so float32
heads and adapters meet bfloat16/float16 layers, where the device computes in that dtype at speed
(:func:`computes_natively`: an accelerator, or a CPU with AVX512-BF16 / AMX). A CPU without those
units keeps ``model.dtype`` as the *storage* of the linear and embedding weights and computes in
float32 (:func:`store_in`): each linear layer upcasts its weight for the call and keeps only the
stored weight for the backward pass (:class:`UpcastLinear`), each embedding's output is float32.
Measured on a 2-core AVX2 CPU (torch 2.13, one thread), a 64 x 3072 by 3072 x 8192 bfloat16 layer's
forward and input gradient took 16 s under bfloat16 compute (the input gradient's bfloat16
matrix product alone 13 s) and 0.24 s so (float32 compute: 0.12 s). A float32 base on the CPU is
left exactly as it was built (the default: the same numbers as before).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from fedtune.config import ConfigError, RunConfig
from fedtune.steps import step, track

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: modules never quantized: the output projection (tied to the input embedding in many LMs)
NEVER_QUANTIZED = ("lm_head",)


def load_dtype(model: Any) -> torch.dtype | str:
    """The dtype a pretrained base is read in (``model``: the ``[model]`` section): ``model.dtype``,
    or, for a base about to be quantized, the checkpoint's own (``"auto"``): its linear layers
    become 4- or 8-bit and PEFT's k-bit preparation makes every other parameter float32, so the
    result is the same as reading it in float32 first, without a float32 copy of the whole
    checkpoint (12.8 GB for a 3B bfloat16 checkpoint)."""
    return "auto" if model.quantization != "none" else DTYPES[model.dtype]


def resolve_device(name: str, option: str = "device") -> torch.device:
    """``device``: ``auto`` is CUDA when available (then MPS, else the CPU); a named accelerator
    must exist here, else one line naming the option (``option``) and what this machine has."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    hint = "use cpu or auto" if option == "device" else "list devices this machine has"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            raise ConfigError(f"{option}: {name!r} is not available here ({count} CUDA devices); {hint}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option}: {name!r} is not available here (no MPS); {hint}")
    return device


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


#: the layers whose weights hold nearly all of a model's memory; norms keep float32 (their
#: statistics and affine parameters meet float32 buffers, as in every mixed-precision recipe)
MATRIX_LAYERS = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)


def cast_parameters(model: nn.Module, dtype: torch.dtype, keep: Iterable[str]) -> None:
    """Cast the parameters of every matrix layer (:data:`MATRIX_LAYERS`) outside the modules
    ``keep`` (names) to ``dtype``."""
    keep = tuple(keep)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, MATRIX_LAYERS) or _under(name, keep):
                continue
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)


def computes_natively(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` computes in ``dtype`` at speed: float32 and every accelerator do; a CPU
    needs AVX512-BF16 or AMX for bfloat16 and AMX-FP16 for float16 (without them torch's CPU
    matrix products in those dtypes are emulated, up to 100x slower than float32's)."""
    if dtype == torch.float32 or device.type != "cpu":
        return True
    cpu = torch.cpu
    has = lambda name: bool(getattr(cpu, name, lambda: False)())  # noqa: E731  (private probes of torch.cpu)
    if dtype == torch.bfloat16:
        return has("_is_avx512_bf16_supported") or has("_is_amx_tile_supported")
    return has("_is_amx_fp16_supported")


#: an upcast weight of at most this many bytes is written into a buffer kept for its shape (one per
#: thread) instead of a fresh block per call (hundreds a step). glibc serves a block under 32 MiB
#: from its heap, which the fresh copies fragmented: on SmolLM2-135M in bfloat16 the peak grew from
#: 1.11 to 1.40 GiB over 32 one-step clients, with these buffers 1.13 to 1.20 (benchmarks/llm/llm_scale.py).
#: It maps a larger block and unmaps it when freed, so each call faulted its pages in afresh: a
#: Llama-3.2-3B MLP layer's forward and input gradient (64 tokens, one thread) took 0.249 s, 0.115 s
#: of it system time, and 0.167 s (0.008 s) with a buffer. 256 MiB covers every per-layer matrix
#: of an 8B Llama (the largest: 14336 x 4096 in float32, 224 MiB); the vocabulary matrices of
#: such models (128256 x 3072 or more: 1.5 GiB) stay transient, while SmolLM2's (113 MB) is kept
UPCAST_BUFFER_MAX_BYTES = 256 * 2**20
_upcast_buffers = threading.local()


def upcast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.to(dtype)`` for a product computed at once and not kept: weights up to
    :data:`UPCAST_BUFFER_MAX_BYTES` go into this thread's buffer for their (shape, dtype, device),
    overwritten by the next call of that shape."""
    size = weight.numel() * torch.empty((), dtype=dtype).element_size()
    if size > UPCAST_BUFFER_MAX_BYTES:
        return weight.to(dtype)
    buffers = _upcast_buffers.__dict__.setdefault("by_shape", {})
    key = (tuple(weight.shape), dtype, weight.device)
    buffer = buffers.get(key)
    if buffer is None:
        buffer = buffers[key] = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    return buffer.copy_(weight)


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b in ``x``'s dtype from a stored lower-precision W and b that get no gradient:
    the backward pass needs only dL/dx = dL/dy W, so W itself (not its upcast copy) is saved and
    upcast again there (a model's float32 copy never lives across its forward pass). Both products
    use W's upcast at once (:func:`upcast`: a reused buffer), and neither result aliases it."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return F.linear(x, upcast(weight, x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ upcast(weight, grad.dtype), None, None


class UpcastLinear(nn.Linear):
    """An ``nn.Linear`` whose weights are stored in a lower precision and whose product is computed
    in its input's dtype (:func:`store_in`); a trainable weight takes the plain upcast path (its
    gradient flows through the cast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        bias = self.bias
        if self.weight.requires_grad or (bias is not None and bias.requires_grad):
            return F.linear(x, self.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return _FrozenLinear.apply(x, self.weight, bias)


def _float32_output(module, args, output):
    return output.float() if output.is_floating_point() else output


def store_in(model: nn.Module, dtype: torch.dtype, keep: Iterable[str], device: torch.device) -> int:
    """Store the weights of the matrix layers (:data:`MATRIX_LAYERS`) outside the modules ``keep``
    in ``dtype`` and compute in float32: a linear layer becomes an :class:`UpcastLinear`; an
    embedding returns float32; a convolution computes under ``torch.autocast(device, dtype)`` as
    before (its input gradient has no float32 form here) and returns float32. Norms stay float32.
    The count of layers stored so."""
    keep = tuple(keep)
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if _under(name, keep) or not isinstance(module, MATRIX_LAYERS):
                continue
            if type(module) is nn.Linear:
                module.__class__ = UpcastLinear
            elif isinstance(module, nn.Linear):  # a subclass with its own forward: left as it is
                continue
            else:
                if not isinstance(module, nn.Embedding):
                    autocast_forward(module, device, dtype)
                module.register_forward_hook(_float32_output)
            for param in module.parameters(recurse=False):
                if param.is_floating_point():
                    param.data = param.data.to(dtype)
            count += 1
    return count


def quantize_linears(
    model: nn.Module, bits: int, compute_dtype: torch.dtype, keep: Iterable[str], device: torch.device
) -> int:
    """Replace each ``nn.Linear`` outside ``keep`` (and :data:`NEVER_QUANTIZED`) by its bitsandbytes
    counterpart holding the same weights, quantized on ``device`` at once, layer by layer (a layer
    left for a later ``.to(device)`` would hold its float32 copy until then: 11 GB for a 3B
    model's linears); the count.

    A 4-bit layer takes the path an AVX2 CPU takes (dequantize, then a matrix product in
    ``compute_dtype``) on every CPU, never bitsandbytes' AVX512-BF16 one (its
    ``Linear4bit.support_avx512bf16_for_cpu``, set from the CPU's flags): there bitsandbytes 0.50
    repacks a layer's weights in place at its first forward in eval mode under ``no_grad``, for a
    bfloat16 kernel without a backward. The repacking fails where the input width is not a multiple
    of the 64-weight quantization block (tiny-llama: "shape '[32, 0]' is invalid"), and elsewhere the
    weights stay repacked: the next round trains through that kernel in bfloat16 and no gradient
    reaches the layers below (measured: the input's gradient is None)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError(
            "model.quantization: needs the bitsandbytes package (pip install --no-deps bitsandbytes==0.50.2)"
        ) from None
    keep = (*keep, *NEVER_QUANTIZED)
    targets = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not _under(name, keep) and not any(name.endswith("." + k) for k in keep)
    ]
    what = f"quantizing {len(targets)} linear layers to {'4-bit NF4' if bits == 4 else '8-bit'}"
    for name in track(targets, what, len(targets), "layers"):  # by name: each replaced layer freed before the next
        lin = cast(nn.Linear, model.get_submodule(name))  # a target: type(module) is nn.Linear (above)
        weight = lin.weight.data.to(torch.float32 if bits == 4 else torch.float16)
        new: nn.Module
        if bits == 4:
            four = bnb.nn.Linear4bit(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            four.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4")
            four.support_avx512bf16_for_cpu = False  # the AVX2 path on every CPU (docstring)
            new = four
        else:
            eight = bnb.nn.Linear8bitLt(
                lin.in_features, lin.out_features, bias=lin.bias is not None, has_fp16_weights=False, device="meta"
            )
            eight.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            new = eight
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.data.to(compute_dtype), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new.to(device))  # bitsandbytes quantizes here
        del weight, lin
    return len(targets)


def enable_gradient_checkpointing(model: nn.Module, name: str) -> None:
    """Non-reentrant gradient checkpointing on every Hugging Face model in ``model`` (the
    outermost ones: a causal LM, or the language model inside a prefix LM)."""
    found = False
    for _, module in model.named_modules():
        if getattr(module, "supports_gradient_checkpointing", False) and hasattr(
            module, "gradient_checkpointing_enable"
        ):
            if not getattr(module, "is_gradient_checkpointing", False):
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            found = True
    if not found:
        raise ConfigError(f"train.gradient_checkpointing: model {name!r} does not support it")


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples, dataclass fields) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def autocast_forward(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under ``torch.autocast(device, dtype)``: hooks that enter the
    context before the call and leave it after, also when the call raises (hooks, unlike a
    replaced ``forward``, travel with a deep copy)."""
    active: list[torch.autocast] = []

    def enter(mod, args, kwargs):
        active.append(torch.autocast(device.type, dtype=dtype))
        active[-1].__enter__()

    def leave(mod, args, kwargs, output):
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)


def _inputs_to(device: torch.device):
    def hook(module, args, kwargs):
        return to_device(args, device), to_device(kwargs, device)

    return hook


def follow_inputs(model: nn.Module, device: torch.device) -> nn.Module:
    """A forward pre-hook on ``model`` moving every tensor of a call's arguments to ``device`` (an
    accelerator; nothing on the CPU), so a task's host batches need no device code."""
    if device.type != "cpu":
        model.register_forward_pre_hook(_inputs_to(device), with_kwargs=True)
    return model


def place(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model`` on ``device`` (a name is resolved by :func:`resolve_device`), its calls' tensors
    following it (:func:`follow_inputs`): for the models a method builds and trains directly (no
    LoRA workspace). On the CPU the model is left exactly as it was (the same numbers)."""
    device = resolve_device(device) if isinstance(device, str) else device
    if device.type != "cpu":
        model.to(device)
    return follow_inputs(model, device)


def prepare_base(model: nn.Module, config: RunConfig, keep: Iterable[str] = ()) -> nn.Module:
    """``model`` (a freshly built base) made ready as the module docstring says; ``keep``: the
    task's head modules (never cast or quantized)."""
    with step(f"preparing the base {config.model.name} ({_format(config)})"):
        return _prepare(model, config, tuple(keep))


def _format(config: RunConfig) -> str:
    """The base's format as a step names it: ``4-bit NF4``, ``bfloat16``, ``float32``."""
    return {"4bit": "4-bit NF4", "8bit": "8-bit"}.get(config.model.quantization, config.model.dtype)


def _prepare(model: nn.Module, config: RunConfig, keep: tuple[str, ...]) -> nn.Module:
    cfg = config.model
    dtype = DTYPES[cfg.dtype]
    device = resolve_device(config.device)
    compute = dtype if computes_natively(device, dtype) else torch.float32
    if dtype != compute and cfg.quantization == "none":
        store_in(model, dtype, keep, device)
    elif dtype != torch.float32:  # (a quantized base's other weights become float32 below)
        cast_parameters(model, dtype, keep)
    if cfg.quantization != "none":
        bits = 4 if cfg.quantization == "4bit" else 8
        if not quantize_linears(model, bits, compute, keep, device):
            raise ConfigError(f"model.quantization: model {cfg.name!r} has no linear layer to quantize")
        setattr(model, f"is_loaded_in_{bits}bit", True)
    if config.train.gradient_checkpointing:
        enable_gradient_checkpointing(model, str(cfg.name))
    if device.type != "cpu" or cfg.quantization != "none":
        model.to(device)
    if cfg.quantization != "none":
        from peft import prepare_model_for_kbit_training

        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    follow_inputs(model, device)
    if compute != torch.float32:
        from transformers import PreTrainedModel

        children = set(model.children())  # the parts a model's own methods (generate) call
        for module in model.modules():  # the root, its parts, each Hugging Face model inside
            if module is model or module in children or isinstance(module, PreTrainedModel):
                autocast_forward(module, device, compute)
    return model


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))
