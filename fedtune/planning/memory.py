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
  layers per transformer layer, e the bytes of the compute dtype (4 on a quantized base: PEFT's
  k-bit preparation keeps its norms and embedding in float32, and bitsandbytes' quantized linears
  return their input's dtype, so its activations are float32 whatever it computes in), e_h those
  of the hidden states (e; 4 for :data:`FLOAT32_HIDDEN`'s families), t_V = batch x the positions
  whose LM-head logits the loss computes (:attr:`Workload.logits`; t where it computes every one)::

      no checkpointing: t n (e_h c_h h + e c_i i + e c_a a length) + c_v 4 t_V V + c_r 4 t n m r
      checkpointing:    k e_h t n h + c_v' 4 t_V V + (the same without the logits for one layer, n = 1)

  plus, on a quantized base computing in bfloat16 / float16, V h times the compute dtype's bytes:
  the autocast's copy of its float32 LM head, which the backward keeps; and with LoRA dropout,
  (e + 1) t x the adapted layers' input widths (each keeps its dropped input and the mask, a byte
  a value; not fitted: the fit trains without dropout), one transformer layer's with checkpointing.

The fitted coefficients also cover what autograd keeps besides the saved tensors (the gradient of
the logits, the backward's transient buffers) because they are fitted to the measured peak
(:class:`PeakMeter`: the tensor bytes allocated at their most); with checkpointing the logits
peak and the recomputed layer's do not coincide, so the logits have their own c_v'.
Time: ``(2 (2 + checkpointing) (N_base - V h) + 6 N_trainable) t + 4 V h t_V`` FLOPs a step (a
4-bit weight counted unpacked; the LM head's V h over the logit positions only, not recomputed)
over the speed-1 client's FLOP/s in the base's format (:mod:`fedtune.planning.speed`) times ``speed``.
A method whose step does more (its plan's ``step``, :func:`fedtune.planning.lora_plan.lora_plan`) states its
passes and what it holds beside the step in its :class:`Workload`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from fedtune.planning.speed import REFERENCE_FLOPS as REFERENCE_FLOPS  # float32's, for the sub-model methods' plan
from fedtune.planning.speed import base_format, forward_flops, reference, train_flops
from fedtune.process import _malloc_trim

#: Activation coefficients (c_h, c_i, c_a, c_v, c_r, k, c_v') per model family, fitted by
#: ``benchmarks/budgets/fit_memory.py`` (results: benchmarks/results/budgets/fit.json); the
#: planner refuses a family not listed.
COEFFICIENTS: dict[str, tuple[float, ...]] = {
    # 20 samples each; predicted peak against measured: Llama within 1.6 % without checkpointing, 10.7 % with;
    # BERT within 6.9 % without, 17.4 % with (bfloat16; float32 2.5 %)
    "llama": (7.179, 2.888, 0, 3.039, 0.9356, 0, 2.342),
    "bert": (8.007, 1.565, 3.267, 0, 0, 2.583, 0),
}
#: Families whose hidden states stay float32 under a low-precision autocast (LayerNorm runs in
#: float32 there, and the residual stream adds to its output; Llama's RMSNorm returns the input's dtype).
FLOAT32_HIDDEN = {"bert"}


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
    kbit: bool = False  # a quantized base (its activations are float32: :func:`features`)
    passes: int = 1  # forward-backward passes a step (a regularizer's adds more)
    forwards: int = 0  # gradient-free forward passes a step (a measurement after the step)
    copies: int = 0  # copies of the trainable values held beside them, their gradients and states
    held: int = 0  # other bytes held at the peak beyond the LoRA step's (a copy of the logits)
    logits: int | None = None  # positions per row whose LM-head logits the loss computes (None: every one)
    dropout: bool = False  # LoRA dropout (``model.lora_dropout`` > 0) on the adapted layers' inputs

    @property
    def logit_positions(self) -> int:
        return self.length if self.logits is None else self.logits


@dataclass(frozen=True)
class Prediction:
    weights: int
    trainable: int  # values
    states: int
    activations: int
    seconds: float  # of all steps, at speed 1
    features: tuple[float, ...]  # the activation term's (:func:`features`)
    held: int = 0  # bytes the method holds beyond the LoRA step's (:attr:`Workload.copies`, :attr:`Workload.held`)

    @property
    def peak(self) -> int:
        return self.weights + self.trainable * 4 * (1 + self.states) + self.activations + self.held


def _matches(name: str, targets: list[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def _adapter_part(name: str) -> bool:
    """A name inside PEFT's adapter modules (its LoRA matrices, its head copies)."""
    return "lora_" in name or "modules_to_save" in name


def base_weight_bytes(base: nn.Module) -> int:
    """Bytes of ``base``'s own parameters and buffers as loaded, each storage once, with the scales
    bitsandbytes keeps beside a packed weight (:func:`_quant_state`); none of the adapters or head
    copies PEFT added to it."""
    seen = {}
    for name, t in [*base.named_parameters(), *base.named_buffers()]:
        if not _adapter_part(name):
            for x in (t, *_quant_state(t)):
                seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


def _quant_state(weight: torch.Tensor) -> list[torch.Tensor]:
    """The tensors beside a bitsandbytes weight: a 4-bit one's block scales and maps, an 8-bit one's row scales."""
    state = getattr(weight, "quant_state", None)
    nested = getattr(state, "state2", None)
    found = [getattr(s, k, None) for s in (state, nested) if s is not None for k in ("absmax", "code")]
    return [x for x in (*found, getattr(weight, "SCB", None)) if isinstance(x, torch.Tensor)]


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
    """(in, out) of each layer LoRA adapts (a convolution as its (c_in x kernel, c_out) matrix); a
    layer PEFT wrapped is read from its ``base_layer`` (a 4-bit one's ``weight`` is the packed bytes)."""
    dims = []
    for name, module in base.named_modules():
        if _adapter_part(name) or not _matches(name, targets):
            continue
        layer = getattr(module, "base_layer", module)
        if isinstance(layer, nn.Linear):
            dims.append((layer.in_features, layer.out_features))
        elif getattr(layer, "weight", None) is not None and layer.weight.dim() >= 2:
            dims.append((layer.weight[0].numel(), layer.weight.shape[0]))
    return dims


def head_values(base: nn.Module, heads: list[str]) -> int:
    """Values of the task's head modules (trained in full, as PEFT's ``modules_to_save``)."""
    modules = [m for name, m in base.named_modules() if not _adapter_part(name) and _matches(name, heads)]
    return sum(p.numel() for m in modules for name, p in m.named_parameters() if not _adapter_part(name))


def predict(
    base: nn.Module,
    targets: list[str],
    heads: list[str],
    rank: int,
    work: Workload,
    shape: Shape | None = None,
    weights: int | None = None,
    fmt: tuple[str, str] | None = None,
    device: torch.device | None = None,
) -> Prediction:
    """The predicted cost of training a rank-``rank`` adapter on ``base`` (as loaded) with ``work``;
    ``shape``: the activation term's (default: ``base``'s config; a proxy's differs from it);
    ``weights``, ``fmt`` and ``device``: the base's bytes, (weights, compute) format and device where
    ``base`` is not it as loaded (another quantization, a meta skeleton:
    :func:`fedtune.planning.quantization.weight_bytes`, :func:`fedtune.planning.speed.planned_format`)."""
    shape = shape or Shape.of(base)
    dims = adapted_layers(base, targets)
    feats = tuple(features(shape, work, rank, len(dims) / shape.layers))
    trainable = rank * sum(i + o for i, o in dims) + head_values(base, heads)
    frozen, tokens = frozen_values(base), work.batch * work.length
    head = (shape.vocab * shape.hidden, work.batch * work.logit_positions)  # the LM head, its logit tokens
    step = work.passes * train_flops(frozen, trainable, tokens, work.checkpointing, *head)
    flops = (step + work.forwards * forward_flops(frozen, trainable, tokens, *head)) * work.steps
    return Prediction(
        weights=base_weight_bytes(base) if weights is None else weights,
        trainable=trainable,
        states=work.states,
        activations=activation_bytes(shape, work, feats) + dropout_bytes(shape, work, sum(i for i, _ in dims)),
        seconds=flops / reference(base, shape.hidden, fmt or base_format(base, heads), device).flops,
        features=feats,
        held=work.copies * 4 * trainable + work.held,
    )


def activation_bytes(shape: Shape, work: Workload, feats: tuple[float, ...] | list[float]) -> int:
    """The activation term: the fitted sum over ``feats`` (:func:`features`), plus, on a quantized
    base computing in a lower precision, the copy of its float32 output embedding (the LM head,
    never quantized) that the autocast makes in the compute dtype and the backward keeps."""
    cast = shape.vocab * shape.hidden * work.act_bytes if work.kbit and work.act_bytes < 4 else 0
    return int(sum(c * f for c, f in zip(COEFFICIENTS[shape.family], feats))) + cast


def dropout_bytes(shape: Shape, work: Workload, inputs: int) -> int:
    """What LoRA dropout keeps (0 without it): each adapted layer's dropped input, in the
    activations' dtype, and its mask, over ``inputs``, the adapted layers' summed input widths;
    with checkpointing one transformer layer's."""
    if not work.dropout:
        return 0
    held = ((4 if work.kbit else work.act_bytes) + 1) * work.batch * work.length * inputs
    return held // shape.layers if work.checkpointing else held


def features(shape: Shape, work: Workload, rank: int, adapted_per_layer: float) -> list[float]:
    """The activation term's features, in :data:`COEFFICIENTS`' order (the module docstring);
    ``adapted_per_layer``: m."""
    t, tv = work.batch * work.length, work.batch * work.logit_positions
    e = 4 if work.kbit else work.act_bytes
    eh = 4 if shape.family in FLOAT32_HIDDEN else e  # the hidden states' bytes
    ck = work.checkpointing
    n = 1 if ck else shape.layers
    return [
        eh * t * n * shape.hidden,
        e * t * n * shape.intermediate,
        e * t * n * shape.heads * work.length,
        0.0 if ck else 4 * tv * shape.vocab,
        4 * t * n * adapted_per_layer * rank,
        eh * t * shape.layers * shape.hidden if ck else 0.0,
        4 * tv * shape.vocab if ck else 0.0,
    ]


class PeakMeter:
    """Context manager: ``growth``, the most bytes held during the block above what was held when
    it began, and with ``resident`` the process's resident growth over the block too (CPU, Linux;
    else None; it costs a heap trim and the pages' faults).

    A CUDA device: its max allocated bytes. The CPU: the tensor bytes the block allocated, at their
    most at once: the CPU allocator's events on the block's thread (PyTorch's profiler with
    ``profile_memory``: each allocation's address and size, each release's; the backward runs on
    that thread, and intra-op threads mostly write into tensors it allocated), replayed in time order,
    a release counted only for an address the block allocated. So memory allocated before the
    block (by an earlier client, or held by other objects), other threads' allocations and what the
    C heap keeps after a release do not count: the CPU analogue of ``max_memory_allocated``, one
    client's whatever else the process holds. When a profiler is already running (profilers do not
    nest), ``growth`` is the resident growth: the whole process's, reset at the start through
    ``/proc/self/clear_refs`` after the C heap's free pages went back, so above the tensor bytes by
    what the heap keeps and libraries allocate outside PyTorch, and possibly below a transient peak
    freed inside the block (the kernel's high-water mark does not always record one: a test read 11
    of 64 MB once); the same where this PyTorch lacks the profiler interface the meter uses.
    Kineto's log lines at each start and stop are silenced (``KINETO_LOG_LEVEL`` 6) unless the
    environment sets a level."""

    def __init__(self, device: torch.device, resident: bool = False) -> None:
        self.device = device
        self.growth: int | None = None
        self.resident: int | None = None
        self.start: int | None = None  # the allocated (cuda) or resident bytes at entry; None: not read
        self._profiling = False
        self._resident = resident

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return self
        self._profiling = not torch._C._autograd._profiler_enabled() and _start_allocation_profiler()
        self.start = _reset_resident_peak() if self._resident or not self._profiling else None
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.growth = torch.cuda.max_memory_allocated(self.device) - (self.start or 0)
            return
        if self.start is not None:
            peak = _status_bytes("VmHWM")
            self.resident = None if peak is None else max(0, peak - self.start)
        if self._profiling:
            self._profiling = False
            self.growth = _allocated_peak(torch.autograd._disable_profiler().experimental_event_tree())
        else:
            self.growth = self.resident


def _start_allocation_profiler() -> bool:
    """Start PyTorch's profiler recording the CPU allocator's events; False where this PyTorch
    lacks the (private) interface it uses, so that the meter falls back to the resident growth."""
    try:
        from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, _ExperimentalConfig

        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when Kineto first starts
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        torch.autograd._prepare_profiler(config, {ProfilerActivity.CPU})
        torch.autograd._enable_profiler(config, {ProfilerActivity.CPU})
    except (ImportError, AttributeError, TypeError):
        return False
    return True


def _allocated_peak(roots: list) -> int:
    """The most bytes held at once by the allocations among the profiler's events (``roots``, the
    event trees), replayed in time order; a release of an address not allocated among them is
    skipped."""
    from torch._C._profiler import _EventType

    events, stack = [], list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    live: dict[int, int] = {}
    held = peak = 0
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
        elif ptr in live:
            size = -live.pop(ptr)
        else:
            continue
        held += size
        peak = max(peak, held)
    return peak


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
