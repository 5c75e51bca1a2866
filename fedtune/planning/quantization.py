"""A client's own base format (``federation.profiles[i].quantization`` and ``dtype``): checked once,
the planner's ladder of formats, and the weight bytes of a base in a format the process has not
loaded.

A profile that states a quantization or dtype other than ``model.quantization`` / ``model.dtype``
gets a base of its own in its process (:meth:`fedtune.runtime.RunContext.base_for`, one per format
in use); its adapter, what it uploads and what the server averages stay float32, as every LoRA
client's. The planner gives a client over its memory budget the next cheaper base before a smaller
rank (:func:`base_formats`: a float32 base's bfloat16 copy, then 8-bit and 4-bit;
:mod:`fedtune.planning.planner`).
"""

from __future__ import annotations

import math
from importlib.util import find_spec
from typing import Any

from torch import nn

from fedtune.config import ConfigError

#: the base quantizations, heaviest first (``model.quantization``'s values)
QUANTIZATIONS = ("none", "8bit", "4bit")
#: the cross-method option a method honours when its clients may train on a quantized base
OPTION = "model.quantization"
BNB_HINT = "pip install --no-deps bitsandbytes==0.50.2"


#: the cross-method option a method honours when its clients may train on a base of another dtype
DTYPE_OPTION = "model.dtype"


def can_quantize(method: Any) -> bool:
    """Whether the clients of ``method`` (a registry MethodSpec) may train on a quantized base here:
    it honours ``model.quantization`` and bitsandbytes is installed."""
    return OPTION in method.honours and find_spec("bitsandbytes") is not None


def own_bases(method: Any) -> bool:
    """Whether the clients of ``method`` may each train on a base of their own format: it honours
    ``model.quantization`` and ``model.dtype`` (a method that merges into the base's weights, FlexLoRA
    or FedStackLoRA, keeps one base)."""
    return {OPTION, DTYPE_OPTION} <= method.honours


def base_formats(method: Any, quantization: str, dtype: str) -> list[tuple[str, str]]:
    """The base formats (quantization, dtype) the planner may give a client of ``method`` in a run of
    ``quantization`` and ``dtype``, heaviest first: the run's; where clients may hold their own
    base (:func:`own_bases`), a float32 base's bfloat16 copy, then each cheaper quantization in the
    run's dtype (with bitsandbytes)."""
    formats = [(quantization, dtype)]
    if not own_bases(method):
        return formats
    if quantization == "none" and dtype == "float32":
        formats.append(("none", "bfloat16"))
    if can_quantize(method):
        formats += [(q, dtype) for q in cheaper(quantization)[1:]]
    return formats


def check_profile_quantization(run: Any) -> None:
    """A profile stating a base quantization other than the run's needs a method that honours
    ``model.quantization`` and bitsandbytes, one stating another dtype a method whose clients may
    hold their own base (:func:`own_bases`) (ConfigError naming the first such profile); ``run``: a
    :class:`~fedtune.runtime.ResolvedRun`."""
    for cid, p in enumerate(run.profiles):
        if p.dtype not in (None, run.config.model.dtype) and not own_bases(run.method):
            raise ConfigError(
                f"federation.profiles[{cid}].dtype: method {run.config.method!r} keeps one base "
                f"(model.dtype {run.config.model.dtype!r} for every client)"
            )
        if p.quantization in (None, run.config.model.quantization):
            continue
        where = f"federation.profiles[{cid}].quantization"
        if OPTION not in run.method.honours:
            raise ConfigError(f"{where}: method {run.config.method!r} keeps its base unquantized (expected none)")
        if find_spec("bitsandbytes") is None:
            raise ConfigError(f"{where}: {p.quantization!r} needs the bitsandbytes package ({BNB_HINT})")


def cheaper(quantization: str) -> list[str]:
    """``quantization`` and each cheaper one of :data:`QUANTIZATIONS`, heaviest first."""
    return list(QUANTIZATIONS[QUANTIZATIONS.index(quantization) :])


def quantized_bytes(values: int, bits: int) -> int:
    """Bytes bitsandbytes holds for a linear layer's ``values`` weights (its rows: ``values`` /
    in-features) at ``bits``: 4-bit NF4 packs two a byte, with one uint8 scale per 64-weight
    block, those scales' float32 scale per 256 blocks and the two maps (16 and 256 float32);
    8-bit one byte each (its float32 row scales are counted by the caller)."""
    if bits == 8:
        return values
    blocks = math.ceil(values / 64)
    return math.ceil(values / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 * (16 + 256)


def weight_bytes(base: nn.Module, quantization: str, keep: tuple[str, ...], dtype_bytes: int = 4) -> int:
    """Bytes of ``base``'s weights and buffers (each storage once, the adapters' left out) were it
    prepared with ``quantization`` from the model it was built as, as
    :func:`~fedtune.models.precision.prepare_base` does: each linear layer outside ``keep`` (the
    task's heads) and :data:`~fedtune.models.precision.NEVER_QUANTIZED` packed
    (:func:`quantized_bytes`), every other parameter float32 (PEFT's k-bit preparation), buffers
    as they are (what :func:`~fedtune.planning.memory.base_weight_bytes` counts of such a base);
    ``none``: those layers' weights and the other matrix layers' parameters in ``model.dtype``
    (``dtype_bytes`` each), the rest as built. ``base`` may be a skeleton on the meta device
    (:attr:`~fedtune.runtime.RunContext.skeleton`: a tied weight is one Parameter there)."""
    from fedtune.models.precision import MATRIX_LAYERS, NEVER_QUANTIZED, _under
    from fedtune.planning.memory import _adapter_part

    bits = 4 if quantization == "4bit" else 8
    skip = (*keep, *NEVER_QUANTIZED)
    quantized = {
        name: m
        for name, m in base.named_modules()
        if isinstance(m, nn.Linear)
        and not _adapter_part(name)
        and not _under(name, skip)
        and not any(name.endswith("." + k) for k in skip)
    }
    seen: dict[int, int] = {}
    for name, module in base.named_modules():
        if _adapter_part(name):
            continue
        for pname, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            ptr = id(t) if t.is_meta else t.untyped_storage().data_ptr()
            if name in quantized and pname == "weight":
                values = module.in_features * module.out_features
                if quantization == "none":
                    seen[ptr] = dtype_bytes * values
                else:
                    seen[ptr] = quantized_bytes(values, bits) + (4 * module.out_features if bits == 8 else 0)
            elif isinstance(t, nn.Parameter):
                matrix = quantization == "none" and isinstance(module, MATRIX_LAYERS) and not _under(name, keep)
                seen[ptr] = (dtype_bytes if matrix else t.element_size() if quantization == "none" else 4) * t.numel()
            else:
                seen[ptr] = t.untyped_storage().nbytes()
    return sum(seen.values())
