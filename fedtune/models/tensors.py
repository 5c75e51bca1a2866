"""A model's own trainable tensors as arrays (the full-model methods' and the bilevel problems'
currency): every parameter with ``requires_grad`` and the floating-point buffers of the modules
that train (batch-norm statistics), read and written by name."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor of what FedAvg trains and averages: parameters with ``requires_grad``,
    then the floating-point buffers of every module that owns one of them (BN statistics)."""
    out: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for name, module in model.named_modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            for bname, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    out[f"{name}.{bname}" if name else bname] = buf
    return out


def load_tensors(model: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Copy ``arrays`` into the model's :func:`trainable_tensors` (every one must be given)."""
    tensors = trainable_tensors(model)
    if tensors.keys() != arrays.keys():
        raise KeyError(f"fedavg: arrays {sorted(tensors.keys() ^ arrays.keys())[:3]} do not match the model's tensors")
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(torch.as_tensor(arrays[name]))
    return tensors


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor on any device as a host array that owns its memory (arrays cross as CPU numpy);
    bfloat16, which numpy lacks, becomes float32 (exact)."""
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.cpu().numpy().copy()


def tensor_arrays(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: to_numpy(t) for k, t in tensors.items()}
