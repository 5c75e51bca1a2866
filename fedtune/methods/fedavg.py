"""FedAvg: federated averaging of the model's own trainable tensors, no LoRA (McMahan et al. 2017).

Round t: the server sends the global tensors theta^t; each client loads them into the task's base
model, trains for H local steps and uploads its update Delta_i = theta_i - theta^t; the server sets
theta^{t+1} = theta^t + sum_i p_i Delta_i, p_i proportional to the client's data size
(``options.weighting = "uniform"``: p_i = 1/N).

What travels (:func:`~fedtune.methods.base.full_model.trainable_tensors`): every parameter with
``requires_grad`` (all of them, or the head alone with ``model.finetune = "head"``) and the
floating-point buffers of the modules that train (batch-norm running means and variances, averaged
like the weights, as FedAvg code does; frozen batch norms keep their statistics, see
:func:`fedtune.models.training.train_mode`). Runs on every task; for small models trained from
scratch and as the full-model baseline. The final global model is saved as ``model.safetensors``
(the base model's full ``state_dict``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedtune.methods.base.aggregation import Aggregation, planned
from fedtune.methods.base.averaging import (
    SECURE_AGGREGATION,
    WEIGHTED_SUM_OPTIONS,
    BroadcastAverage,
    UpdateClient,
    Weighting,
)
from fedtune.methods.base.full_model import ModelStateStrategy, load_tensors, tensor_arrays
from fedtune.methods.base.privacy import PRIVACY_OPTIONS
from fedtune.models.training import train_local
from fedtune.protocol.context import ServerContext
from fedtune.protocol.messages import Message
from fedtune.registry import MethodOptions, register


class FedAvgOptions(MethodOptions):
    weighting: Weighting = Field("examples", description="p_i: data size (FedAvg) or 1/N")


class FedAvgStrategy(BroadcastAverage, ModelStateStrategy):
    """FedAvg: average the model's trainable tensors (no LoRA; McMahan et al. 2017)."""

    options: FedAvgOptions  # the method's registered options class (resolve_run validated them)

    def __init__(self, context: ServerContext) -> None:
        super().__init__(context)
        self.aggregation = Aggregation(planned(context))

    def state_dict(self) -> dict:
        return {**ModelStateStrategy.state_dict(self), **self.aggregation.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        ModelStateStrategy.load_state_dict(self, state)
        self.aggregation.load_state_dict(state)


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
        return self.upload({k: trained[k] - message.arrays[k] for k in trained}, result, rnd=message.meta["round"])


register(
    "fedavg",
    FedAvgStrategy,
    FedAvgClient,
    FedAvgOptions,
    supports=(*WEIGHTED_SUM_OPTIONS, *PRIVACY_OPTIONS, *SECURE_AGGREGATION, "device"),
)
