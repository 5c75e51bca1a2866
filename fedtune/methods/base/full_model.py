"""Strategies over the model's own trainable tensors (no LoRA; what travels:
:func:`fedtune.models.tensors.trainable_tensors`):
:class:`ModelStateStrategy`, whose global state is those tensors (initialization from the task's
model, centralized evaluation, state, ``model.safetensors``). FedAvg and the submodel methods
(static, FedRolex, FIARSE) build on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedtune.models.tensors import load_tensors, tensor_arrays, trainable_tensors
from fedtune.protocol.strategy import Strategy


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
