"""Strategies over the model's own trainable tensors (no LoRA): what travels
(:func:`trainable_tensors`: every parameter with ``requires_grad`` and the floating-point buffers of
the modules that train, i.e. batch-norm statistics), loading and reading them, and
:class:`ModelStateStrategy`, whose global state is those tensors (initialization from the task's
model, centralized evaluation, state, ``model.safetensors``). FedAvg and the submodel methods
(static, FedRolex, FIARSE) build on it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from fedtune.protocol.strategy import Strategy


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


def tensor_arrays(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: t.detach().cpu().numpy().copy() for k, t in tensors.items()}


class ModelStateStrategy(Strategy):
    """A strategy whose global state is the task model's :func:`trainable_tensors`
    (``self.global_arrays``)."""

    global_arrays: dict[str, np.ndarray]

    def initialize(self) -> None:
        self.global_arrays = tensor_arrays(trainable_tensors(self.context.model))

    def evaluate(self, rnd: int) -> dict[str, float]:
        load_tensors(self.context.model, self.global_arrays)
        return self.context.task.evaluate(self.context.model, self.config.train.eval_batch_size)

    def state_dict(self) -> dict:
        return {"global": {k: v.copy() for k, v in self.global_arrays.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.global_arrays = {k: np.asarray(v).copy() for k, v in state["global"].items()}

    def save(self, run_dir: Path) -> None:
        from safetensors.torch import save_model

        load_tensors(self.context.model, self.global_arrays)
        save_model(self.context.model, str(run_dir / "model.safetensors"))  # tied weights stored once
