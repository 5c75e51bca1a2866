"""Pieces shared by the LoRA methods: local training of an adapter on a Message, the global
adapter strategy (centralized evaluation, state, saving), the clients' rank budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedtune.methods.base.aggregation import Aggregation, planned
from fedtune.methods.base.averaging import UpdateClient, update_of
from fedtune.models.tensors import to_numpy
from fedtune.models.training import FitResult, train_local
from fedtune.protocol.context import ServerContext
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import ArraySpec

if TYPE_CHECKING:
    pass

LORA = ("lora",)  # the task capability every LoRA method requires (register(..., requires=LORA))
#: The model-scale options (fedtune.registry.CROSS_METHOD_OPTIONS) a LoRA method honours when its
#: clients and server touch the base only through the workspace (fedtune.models.precision prepares it)
#: and train with train_local; a method that writes into base weights (a merge) leaves out quantization.
SCALE_OPTIONS = ("model.dtype", "model.quantization", "train.gradient_checkpointing", "device")
MERGING_SCALE_OPTIONS = ("model.dtype", "train.gradient_checkpointing", "device")

# What departs from a method's paper in the settings every LoRA method shares (``fedtune methods
# --verbose`` prints these with each method's own, from its options class's ``deviations``).
SERVER_DEVIATIONS = {
    "server.optimizer": "'adam' (FedAdam on the averaged update, Reddi et al. 2021; what the published "
    "FSLoRA code runs) departs from the method's plain (weighted) average",
    "server.lr": "a value other than 1 scales the averaged update: departs from the method's average",
    "server.momentum": "a value above 0 (FedAvgM, Hsu et al. 2019) carries earlier rounds' updates into "
    "each step: departs from the method's average",
}


class RegularizedTask:
    """The run's task with ``penalty()`` added to every training loss (HetLoRA's rank
    self-pruning term); everything else is the task's own."""

    def __init__(self, task: Any, penalty: Callable[[], torch.Tensor]) -> None:
        self._task, self._penalty = task, penalty

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return self._task.loss(model, batch) + self._penalty()


class LoraClient(UpdateClient):
    """A client that loads the received adapter of a given rank, trains it locally, and
    returns the new arrays and its fit result."""

    def train_adapter(
        self,
        arrays: Mapping[str, np.ndarray],
        rnd: int,
        rank: int,
        alpha: float | None = None,
        penalty: Callable[[Mapping[str, torch.nn.Parameter]], torch.Tensor] | None = None,
    ) -> tuple[dict[str, np.ndarray], FitResult]:
        """``penalty(params)``, when given, is added to the training loss at every step."""
        ws = self.context.workspace
        params = ws.load(arrays, rank, alpha)
        task = self.context.task if penalty is None else RegularizedTask(self.context.task, lambda: penalty(params))
        result = train_local(
            ws.peft_model,
            list(params.values()),
            task,
            self.context.partitions[self.cid],
            self.config.train,
            self.train_seed(rnd),
        )
        return {k: to_numpy(p) for k, p in params.items()}, result


class GlobalAdapterStrategy(Strategy):
    """A strategy whose global state is one adapter (``self.global_arrays``) of rank ``self.rank``:
    its :class:`~fedtune.methods.base.aggregation.Aggregation` (built once from the resolved run),
    centralized evaluation, state_dict (with the aggregation's) and saving come for free; clients
    are expected to reply with an update of every array they were sent."""

    rank: int
    global_arrays: dict[str, np.ndarray]
    alpha: float | None = None

    def __init__(self, context: ServerContext) -> None:
        super().__init__(context)
        self.aggregation: Aggregation = Aggregation(planned(context))

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec] | list[dict[str, ArraySpec]]:
        return update_of(sent)

    def evaluate(self, rnd: int) -> dict[str, float]:
        ws = self.context.workspace
        ws.load(self.global_arrays, self.rank, self.alpha)
        return self.context.task.evaluate(ws.peft_model, self.config.train.eval_batch_size)

    def state_dict(self) -> dict:
        return {
            "rank": self.rank,
            "global": {k: v.copy() for k, v in self.global_arrays.items()},
            **self.aggregation.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.rank = int(state["rank"])
        self.global_arrays = {k: np.asarray(v, dtype=np.float32).copy() for k, v in state["global"].items()}
        self.aggregation.load_state_dict(state)

    def save(self, run_dir: Path) -> None:
        self.context.workspace.save_pretrained(run_dir / "adapter", self.global_arrays, self.rank, self.alpha)


def client_rank(profile, global_rank: int) -> int:
    """A client's LoRA rank budget: ``profile.rank``, else ``round(profile.sketch_ratio * r)``
    (FSLoRA's k_i, rounded half up, so heterogeneous-rank baselines get r_i = k_i), else the global rank."""
    if profile.rank is not None:
        return min(int(profile.rank), global_rank)
    if profile.sketch_ratio is not None:
        return max(1, min(global_rank, int(profile.sketch_ratio * global_rank + 0.5)))  # half up
    return global_rank
