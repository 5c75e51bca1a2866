"""What one client's LoRA training costs: peak memory, seconds and upload bytes, predicted from the
model's shape and the run's settings, and the meter that measures a client's peak.

``peak = weights + trainable x 4 x (1 gradient + optimizer states) + activations``:

- **weights**: the base as loaded (every parameter and buffer, each storage once), so its dtype
  and quantization (bitsandbytes' packed 4- and 8-bit weights) are what is counted;
- **trainable**: the adapter, r x (in + out) per adapted layer, plus the task's head (both float32);
  AdamW keeps 2 states per value, SGD with momentum 1, plain SGD none;
- **activations**, fitted from measurements (``benchmarks/budgets/fit_memory.py``) per model family
  as a sum of features times bytes, with t = batch x length tokens, n layers, hidden h,
  intermediate i, a heads, vocabulary V (0 for a classifier), r the rank and m the adapted
  layers per transformer layer, e the bytes of the compute dtype::

      no checkpointing: e t n (c_h h + c_i i + c_a a length) + c_v 4 t V + c_r 4 t n m r
      checkpointing:    e k t n h + (the same for one layer, n = 1)

The fitted coefficients also cover what autograd keeps besides the saved tensors (the gradient of
the logits, the backward's transient buffers) because they are fitted to the resident growth.
Time: ``(2 (2 + checkpointing) N_base + 6 N_trainable) t`` FLOPs a step (a 4-bit weight counted
unpacked) over the speed-1 client's FLOP/s in the base's format (:mod:`fedtune.planning.speed`)
times ``speed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedtune.planning.speed import REFERENCE_FLOPS as REFERENCE_FLOPS  # float32's, for planning.capacity
from fedtune.planning.speed import reference, train_flops
from fedtune.process import _malloc_trim

#: Activation coefficients (c_h, c_i, c_a, c_v, c_r, k) per model family, fitted by
#: ``benchmarks/budgets/fit_memory.py`` (results: benchmarks/results/budgets/fit.json); the
#: planner refuses a family not listed.
COEFFICIENTS: dict[str, tuple[float, ...]] = {
    "llama": (20.93, 3.123, 1.228, 4.594, 0, 12.99),  # 20 samples: predicted peak within 9.0 % of measured
    "bert": (25.63, 0, 4.381, 0, 0.745, 13.86),  # 20 samples: within 12.1 % in float32 without checkpointing, 45 % else
}


@dataclass(frozen=True)
class Shape:
    """The transformer dimensions the activation model reads (from the Hugging Face config)."""

    family: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int  # 0: the model has no language-model head

    @classmethod
    def of(cls, model: nn.Module) -> Shape:
        """The shape of the first Hugging Face transformer inside ``model`` (ValueError when none)."""
        for module in model.modules():
            cfg = getattr(module, "config", None)
            if cfg is not None and hasattr(cfg, "hidden_size") and hasattr(cfg, "num_hidden_layers"):
                head = getattr(module, "get_output_embeddings", lambda: None)()
                return cls(
                    cfg.model_type,
                    cfg.num_hidden_layers,
                    cfg.hidden_size,
                    getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
                    cfg.num_attention_heads,
                    cfg.vocab_size if head is not None else 0,
                )
        raise ValueError("the model has no Hugging Face transformer config to plan from")


@dataclass(frozen=True)
class Workload:
    """One client's local training: its batches, the compute dtype's bytes, checkpointing, optimizer."""

    batch: int
    length: int
    act_bytes: int  # bytes of one activation value (the compute dtype)
    checkpointing: bool
    states: int  # optimizer states per trainable value
    steps: int = 1


@dataclass(frozen=True)
class Prediction:
    weights: int
    trainable: int  # values
    states: int
    activations: int
    seconds: float  # of all steps, at speed 1
    features: tuple[float, ...]  # the activation term's (:func:`features`)

    @property
    def peak(self) -> int:
        return self.weights + self.trainable * 4 * (1 + self.states) + self.activations


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _adapter_part(name: str) -> bool:
    """A name inside PEFT's adapter modules (its LoRA matrices, its head copies)."""
    return "lora_" in name or "modules_to_save" in name


def base_weight_bytes(base: nn.Module) -> int:
    """Bytes of ``base``'s own parameters and buffers as loaded, each storage once; none of the
    adapters or head copies PEFT added to it."""
    seen = {}
    for name, t in [*base.named_parameters(), *base.named_buffers()]:
        if not _adapter_part(name):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def frozen_values(base: nn.Module) -> int:
    """Values of ``base``'s own weights (none of PEFT's adapters or head copies), a 4-bit layer's
    as its unpacked matrix (bitsandbytes stores two per byte)."""
    values = {}  # by parameter, each (a tied weight) once
    for name, module in base.named_modules():
        if _adapter_part(name):
            continue
        for p in module.parameters(recurse=False):
            packed = type(module).__module__.startswith("bitsandbytes") and p.dtype == torch.uint8
            values[id(p)] = module.in_features * module.out_features if packed else p.numel()
    return sum(values.values())


def adapted_layers(base: nn.Module, targets: list[str]) -> list[tuple[int, int]]:
    """(in, out) of each layer LoRA adapts (a convolution as its (c_in x kernel, c_out) matrix)."""
    dims = []
    for name, module in base.named_modules():
        if _adapter_part(name) or not _matches(name, targets):
            continue
        if isinstance(module, nn.Linear):
            dims.append((module.in_features, module.out_features))
        elif getattr(module, "weight", None) is not None and module.weight.dim() >= 2:
            dims.append((module.weight[0].numel(), module.weight.shape[0]))
    return dims


def head_values(base: nn.Module, heads: list[str]) -> int:
    """Values of the task's head modules (trained in full, as PEFT's ``modules_to_save``)."""
    modules = [m for name, m in base.named_modules() if not _adapter_part(name) and _matches(name, heads)]
    return sum(p.numel() for m in modules for name, p in m.named_parameters() if not _adapter_part(name))


def predict(base: nn.Module, targets: list[str], heads: list[str], rank: int, work: Workload) -> Prediction:
    """The predicted cost of training a rank-``rank`` adapter on ``base`` (as loaded) with ``work``."""
    shape = Shape.of(base)
    dims = adapted_layers(base, targets)
    feats = tuple(features(shape, work, rank, len(dims) / shape.layers))
    coefficients = COEFFICIENTS[shape.family]
    trainable = rank * sum(i + o for i, o in dims) + head_values(base, heads)
    flops = train_flops(frozen_values(base), trainable, work.batch * work.length, work.checkpointing) * work.steps
    return Prediction(
        weights=base_weight_bytes(base),
        trainable=trainable,
        states=work.states,
        activations=int(sum(c * f for c, f in zip(coefficients, feats))),
        seconds=flops / reference(base, shape.hidden).flops,
        features=feats,
    )


def features(shape: Shape, work: Workload, rank: int, adapted_per_layer: float) -> list[float]:
    """The activation term's features, in :data:`COEFFICIENTS`' order (the module docstring);
    ``adapted_per_layer``: m."""
    t, e = work.batch * work.length, work.act_bytes
    n = 1 if work.checkpointing else shape.layers
    return [
        e * t * n * shape.hidden,
        e * t * n * shape.intermediate,
        e * t * n * shape.heads * work.length,
        4 * t * shape.vocab,
        4 * t * n * adapted_per_layer * rank,
        e * t * shape.layers * shape.hidden if work.checkpointing else 0.0,
    ]


class PeakMeter:
    """Context manager: ``growth``, the most memory held during the block above what was held when
    it began (a CUDA device: its max allocated bytes; the CPU: the process's resident peak, reset at
    the start through ``/proc/self/clear_refs`` after the C heap's free pages went back, so that
    the pages an earlier client freed do not hide this one's growth; None where neither is
    available)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.growth: int | None = None

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            self.start = _reset_resident_peak()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.growth = torch.cuda.max_memory_allocated(self.device) - self.start
        elif self.start is not None:
            peak = _status_bytes("VmHWM")
            self.growth = None if peak is None else max(0, peak - self.start)


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_resident_peak() -> int | None:
    """Return the heap's free pages, reset the process's resident peak (Linux) and return the
    resident bytes now, or None."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")
