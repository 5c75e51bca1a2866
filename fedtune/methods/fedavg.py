"""FedAvg: federated averaging of the model's own trainable tensors, no LoRA (McMahan et al. 2017).

Round t: the server sends the global tensors theta^t; each client loads them into the task's base
model, trains for H local steps and uploads its update Delta_i = theta_i - theta^t; the server sets
theta^{t+1} = theta^t + sum_i p_i Delta_i, p_i proportional to the client's data size
(``options.weighting = "uniform"``: p_i = 1/N).

What travels (:func:`trainable_tensors`): every parameter with ``requires_grad`` (all of them, or
the head alone with ``model.finetune = "head"``) and the floating-point buffers of the modules
that train (batch-norm running means and variances, averaged like the weights, as FedAvg code
does; frozen batch norms keep their statistics, see :func:`fedtune.models.training.train_mode`).
Runs on every task; for small models trained from scratch and as the full-model baseline. The
final global model is saved as ``model.safetensors`` (the base model's full ``state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from fedtune.methods.base.averaging import SERVER_STEP_AND_UPLOAD_CODEC, BroadcastAverage, UpdateClient, Weighting
from fedtune.models.training import train_local
from fedtune.protocol.messages import Message
from fedtune.registry import MethodOptions, register


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


class FedAvgOptions(MethodOptions):
    weighting: Weighting = "examples"


class FedAvgStrategy(BroadcastAverage):
    """FedAvg: average the model's trainable tensors (no LoRA; McMahan et al. 2017)."""

    def initialize(self) -> None:
        self.global_arrays = tensor_arrays(trainable_tensors(self.context.model))

    def evaluate(self, rnd: int) -> dict[str, float]:
        load_tensors(self.context.model, self.global_arrays)
        return self.context.task.evaluate(self.context.model, self.config.train.eval_batch_size)

    def state_dict(self) -> dict:
        return {"global": {k: v.copy() for k, v in self.global_arrays.items()}, **self.server_state()}

    def load_state_dict(self, state: dict) -> None:
        self.global_arrays = {k: np.asarray(v).copy() for k, v in state["global"].items()}
        self.load_server_state(state)

    def save(self, run_dir: Path) -> None:
        from safetensors.torch import save_model

        load_tensors(self.context.model, self.global_arrays)
        save_model(self.context.model, str(run_dir / "model.safetensors"))  # tied weights stored once


class FedAvgClient(UpdateClient):
    def fit(self, message: Message) -> Message:
        model = self.context.model
        tensors = load_tensors(model, message.arrays)
        params = [t for t in tensors.values() if isinstance(t, torch.nn.Parameter)]
        result = train_local(
            model,
            params,
            self.context.task,
            self.context.partitions[self.cid],
            self.config.train,
            self.train_seed(message.meta["round"]),
        )
        trained = tensor_arrays(tensors)
        return self.upload({k: trained[k] - message.arrays[k] for k in trained}, result)


register("fedavg", FedAvgStrategy, FedAvgClient, FedAvgOptions, supports=SERVER_STEP_AND_UPLOAD_CODEC)
