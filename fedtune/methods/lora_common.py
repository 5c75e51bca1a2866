"""Pieces shared by the LoRA methods: local training on a Message, weighted averaging, the
server's step on the aggregated update, centralized evaluation and saving of a global adapter.

Clients upload *updates* (trained minus received arrays), so any upload codec (top-k) applies to
every method the same way; :func:`encode_update` / :func:`decode_update` are that codec's hooks.
The aggregated update goes through :class:`ServerOptimized` (``federation.server_optimizer``,
:mod:`fedtune.methods.server_optimizer`), implemented once for every method.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import numpy as np
import torch

from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import ArraySpec, spec_like
from fedtune.methods.server_optimizer import ServerOptimizer
from fedtune.models.training import FitResult, seed_for, train_local

Weighting = Literal["examples", "uniform"]
LORA = ("lora",)  # the task capability every LoRA method requires (register(..., requires=LORA))

# What departs from a method's paper in the settings every LoRA method shares (``fedtune methods
# --verbose`` prints these with each method's own, from its options class's ``deviations``).
SERVER_DEVIATIONS = {
    "federation.server_optimizer": "'adam' (FedAdam on the averaged update, Reddi et al. 2021; what the published "
    "FSLoRA code runs) departs from the method's plain (weighted) average",
    "federation.server_lr": "a value other than 1 scales the averaged update: departs from the method's average",
}


def encode_update(update: dict[str, np.ndarray], topk: float | None) -> dict[str, np.ndarray]:
    """Arrays to upload for ``update`` (identity unless ``federation.upload_topk`` is set)."""
    if topk is None:
        return update
    from fedtune.protocol.compression import topk_encode

    return topk_encode(update, topk)


def decode_update(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode_update` (dense arrays pass through)."""
    from fedtune.protocol.compression import is_topk_encoded, topk_decode

    return topk_decode(arrays) if is_topk_encoded(arrays) else dict(arrays)


def weighted_average(updates: list[Mapping[str, np.ndarray]], weights: Iterable[float]) -> dict[str, np.ndarray]:
    """sum_i p_i u_i with p_i = w_i / sum_j w_j, key by key."""
    w = np.asarray(list(weights), dtype=np.float64)
    w = w / w.sum()
    return {k: sum(float(p) * u[k] for p, u in zip(w, updates)).astype(np.float32) for k in updates[0]}


def client_weights(replies: Mapping[int, Message], weighting: Weighting) -> list[float]:
    """FedAvg weights: the clients' data sizes, or uniform (1/N)."""
    return [float(m.meta.get("num_examples", 1)) if weighting == "examples" else 1.0 for m in replies.values()]


def mean_train_loss(replies: Mapping[int, Message]) -> dict[str, float]:
    losses = [m.meta["train_loss"] for m in replies.values() if "train_loss" in m.meta]
    return {"train_loss": float(np.mean(losses))} if losses else {}


def update_of(sent: Message) -> dict[str, ArraySpec]:
    """The reply of a client that uploads an update of every array it was sent: the same names,
    shapes and dtypes (each may arrive top-k encoded)."""
    return spec_like(sent.arrays)


class UpdateClient(Client):
    """A client that uploads an update (trained minus received arrays) through the upload codec."""

    def upload(self, update: dict[str, np.ndarray], result: FitResult, **meta) -> Message:
        """The reply: the (possibly compressed) update and the fit metrics."""
        return Message(encode_update(update, self.config.federation.upload_topk), {**result.meta(), **meta})

    def train_seed(self, rnd: int) -> int:
        """Data order and dropout of this client in round ``rnd``: from (run seed, round, client) alone."""
        return seed_for(self.config.seed, rnd, self.cid)


class ServerOptimized:
    """A strategy whose aggregated update goes through the server optimizer
    (:class:`~fedtune.methods.server_optimizer.ServerOptimizer`, from ``federation.server_*``);
    its state belongs in the strategy's checkpoint (:meth:`server_state`)."""

    config: Any

    @property
    def server_opt(self) -> ServerOptimizer:
        if getattr(self, "_server_opt", None) is None:
            self._server_opt = ServerOptimizer(self.config.federation)
        return self._server_opt

    def server_state(self) -> dict:
        return {"server_opt": self.server_opt.state_dict()}

    def load_server_state(self, state: Mapping) -> None:
        self.server_opt.load_state_dict(state.get("server_opt"))


class BroadcastAverage(ServerOptimized, Strategy):
    """FedAvg's round over ``self.global_arrays``: every sampled client gets the same arrays
    (and :meth:`fit_meta`); the server adds the weighted mean of the clients' updates,
    theta^{t+1} = theta^t + sum_i p_i Delta_i (``options.weighting``), through the server
    optimizer (default: exactly this sum)."""

    global_arrays: dict[str, np.ndarray]

    def fit_meta(self, rnd: int) -> dict:
        return {"round": rnd}

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        message = Message(self.global_arrays, self.fit_meta(rnd))
        return {cid: message for cid in client_ids}

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        return update_of(sent)

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        updates = [decode_update(m.arrays) for m in replies.values()]
        mean = weighted_average(updates, client_weights(replies, self.options.weighting))
        self.global_arrays = self.server_opt.step(self.global_arrays, mean)
        return mean_train_loss(replies)


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
            ws.model,
            list(params.values()),
            task,
            self.context.partitions[self.cid],
            self.config.train,
            self.train_seed(rnd),
        )
        return {k: p.detach().numpy().copy() for k, p in params.items()}, result


class GlobalAdapterStrategy(ServerOptimized, Strategy):
    """A strategy whose global state is one adapter (``self.global_arrays``) of rank ``self.rank``:
    centralized evaluation, state_dict (with the server optimizer's) and saving come for free;
    clients are expected to reply with an update of every array they were sent."""

    rank: int
    global_arrays: dict[str, np.ndarray]
    alpha: float | None = None

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        return update_of(sent)

    def evaluate(self, rnd: int) -> dict[str, float]:
        ws = self.context.workspace
        ws.load(self.global_arrays, self.rank, self.alpha)
        return self.context.task.evaluate(ws.model, self.config.train.eval_batch_size)

    def state_dict(self) -> dict:
        return {"rank": self.rank, "global": {k: v.copy() for k, v in self.global_arrays.items()}, **self.server_state()}

    def load_state_dict(self, state: dict) -> None:
        self.rank = int(state["rank"])
        self.global_arrays = {k: np.asarray(v, dtype=np.float32).copy() for k, v in state["global"].items()}
        self.load_server_state(state)

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
