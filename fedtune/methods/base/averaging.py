"""Weighted averaging of client updates, the bases of every method whose server adds a weighted
mean of updates (FedAvg's round), and the upload codec.

Clients upload *updates* (trained minus received arrays), so any upload codec (top-k) applies to
every method the same way; :func:`encode_update` / :func:`decode_update` are that codec's hooks.
The aggregated update goes through :class:`ServerOptimized` (``federation.server_optimizer``,
:mod:`fedtune.methods.base.server_optimizer`), implemented once for every method.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from fedtune.methods.base.robust import ROBUST_AGGREGATION, aggregate_updates
from fedtune.methods.base.server_optimizer import ServerOptimizer
from fedtune.models.training import FitResult, seed_for
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import ArraySpec, spec_like

Weighting = Literal["examples", "uniform"]
#: The cross-method options (fedtune.registry.CROSS_METHOD_OPTIONS) a method honours when its server
#: steps through :class:`ServerOptimized` and its clients upload through :meth:`UpdateClient.upload`.
SERVER_STEP_AND_UPLOAD_CODEC = ("federation.server_optimizer", "federation.upload_topk", "federation.wire_dtype")
#: ... and when its server also combines the updates with :func:`~fedtune.methods.base.robust.aggregate_updates`.
WEIGHTED_SUM_OPTIONS = (*SERVER_STEP_AND_UPLOAD_CODEC, *ROBUST_AGGREGATION)


def encode_update(
    update: dict[str, np.ndarray], topk: float | None, wire_dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """Arrays to upload for ``update``: top-k when ``federation.upload_topk`` is set, then every
    float array in ``federation.wire_dtype`` (identity at the defaults)."""
    from fedtune.protocol.compression import topk_encode, wire_encode

    return wire_encode(update if topk is None else topk_encode(update, topk), wire_dtype)


def decode_update(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inverse of :func:`encode_update` (dense float32 arrays pass through)."""
    from fedtune.protocol.compression import is_topk_encoded, topk_decode, wire_decode

    arrays = wire_decode(arrays)
    return topk_decode(arrays) if is_topk_encoded(arrays) else arrays


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
        fed = self.config.federation
        return Message(encode_update(update, fed.upload_topk, fed.wire_dtype), {**result.meta(), **meta})

    def train_seed(self, rnd: int) -> int:
        """Data order and dropout of this client in round ``rnd``: from (run seed, round, client) alone."""
        return seed_for(self.config.seed, rnd, self.cid)


class ServerOptimized:
    """A strategy whose aggregated update goes through the server optimizer
    (:class:`~fedtune.methods.base.server_optimizer.ServerOptimizer`, from ``federation.server_*``);
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
    optimizer (default: exactly this sum); ``federation``'s robust-aggregation options replace
    the weighted mean (:mod:`fedtune.methods.base.robust`)."""

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
        combined = aggregate_updates(updates, client_weights(replies, self.options.weighting), self.config.federation)
        self.global_arrays = self.server_opt.step(self.global_arrays, combined)
        return mean_train_loss(replies)
