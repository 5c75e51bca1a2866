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

from fedtune.methods.base.privacy import Mechanism, mechanism
from fedtune.methods.base.robust import ROBUST_AGGREGATION, aggregate_updates
from fedtune.methods.base.server_optimizer import ServerOptimizer
from fedtune.models.training import FitResult, seed_for
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SECURE_LAYOUT, SECURE_MAX_WEIGHT, SECURE_WEIGHT, SecureSum, Strategy
from fedtune.protocol.validation import ArraySpec, spec_like

Weighting = Literal["examples", "uniform"]
#: The cross-method options (fedtune.registry.CROSS_METHOD_OPTIONS) a method honours when its server
#: steps through :class:`ServerOptimized` and its clients upload through :meth:`UpdateClient.upload`.
SERVER_STEP_AND_UPLOAD_CODEC = ("federation.server_optimizer", "federation.upload_topk", "federation.wire_dtype")
#: ... and when its server also combines the updates with :func:`~fedtune.methods.base.robust.aggregate_updates`.
WEIGHTED_SUM_OPTIONS = (*SERVER_STEP_AND_UPLOAD_CODEC, *ROBUST_AGGREGATION)
#: ... and when its server step is a weighted sum SecAgg+ can compute (:class:`SecureSummed`).
SECURE_AGGREGATION = ("federation.secure_aggregation",)


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

    def upload(self, update: dict[str, np.ndarray], result: FitResult, rnd: int | None = None, **meta) -> Message:
        """The reply: the (possibly compressed) update and the fit metrics. Under ``privacy.mode``
        the update is first what the mechanism has the client release (local DP: clipped and
        noised; SecAgg+ with central DP: clipped), and where the server must not see the client's
        numbers (local DP, SecAgg+) the metadata is fixed: ``num_examples`` 1 and ``meta``."""
        fed = self.config.federation
        private = mechanism(self.config) if self.config.privacy.mode != "none" else None
        if private is None:
            reported = {**result.meta(), **meta}
        else:
            update = private.client_release(update, self.state, self.cid, rnd)
            hidden = private.clips_on_client or fed.secure_aggregation
            reported = {"num_examples": 1, **meta} if hidden else {**result.meta(), **meta}
        return Message(encode_update(update, *self.profile.upload_codec(fed.upload_topk, fed.wire_dtype)), reported)

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


class SecureSummed:
    """A strategy whose server step needs only sum_i w_i v_i and sum_i w_i over the clients that
    replied, v_i a vector each client computes from its own update: what secure aggregation
    (SecAgg+, Bell et al. CCS 2020; ``federation.secure_aggregation``) gives the server
    (:class:`~fedtune.protocol.strategy.SecureSum`). The strategy declares the layout of v_i
    (:meth:`secure_layout`, default the global arrays: v_i = Delta_i) and puts :meth:`secure_meta`
    in its training requests; its client turns a reply into v_i
    (:meth:`~fedtune.protocol.client.Client.secure_vector`); its ``aggregate_secure_fit`` reads the
    sum back (:meth:`secure_sum`, :meth:`secure_mean`). The masking is the transport's, one for all
    such methods (:mod:`fedtune.engines.flower.secagg`)."""

    config: Any
    context: Any
    options: Any
    global_arrays: dict[str, np.ndarray]

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the vector v_i every client masks (default: the global arrays')."""
        return {k: tuple(np.shape(v)) for k, v in self.global_arrays.items()}

    def secure_meta(self, client_ids: list[int]) -> dict:
        """The training requests' meta under secure aggregation ({} without it): how the clients
        weigh v_i (w_i: their data sizes, FedAvg's p_i, at most each one's partition size; or 1
        under ``options.weighting = "uniform"`` and DP-FedAvg's uniform weights), the round's
        largest weight W, and the layout of v_i."""
        if not self.config.federation.secure_aggregation:
            return {}
        if getattr(self, "privacy", None) is None and self.options.weighting == "examples":
            bound = max(self.context.example_bound("train", cid) for cid in client_ids)
            weights = {SECURE_WEIGHT: "examples", SECURE_MAX_WEIGHT: float(bound)}
        else:
            weights = {SECURE_WEIGHT: "uniform", SECURE_MAX_WEIGHT: 1.0}
        return {**weights, SECURE_LAYOUT: [[k, list(shape)] for k, shape in self.secure_layout().items()]}

    def secure_sum(self, total: SecureSum) -> tuple[dict[str, np.ndarray], float]:
        """``total``'s arrays, checked against :meth:`secure_layout`, and the round's denominator:
        sum_i w_i, or, under DP, the fixed m (DP-FedAvg)."""
        layout = self.secure_layout()
        if list(total.arrays) != list(layout) or any(np.shape(v) != layout[k] for k, v in total.arrays.items()):
            raise ValueError("the secure sum's arrays are not the names and shapes of the strategy's secure_layout")
        privacy = getattr(self, "privacy", None)
        denominator = privacy.m if privacy is not None else total.weight
        if not denominator > 0:
            raise ValueError(f"the secure sum's total weight is {denominator}")
        return total.arrays, float(denominator)

    def secure_mean(self, rnd: int, total: SecureSum) -> dict[str, np.ndarray]:
        """sum_i w_i Delta_i / sum_i w_i of the global arrays, in their dtypes; under DP the
        mechanism's (sum + xi) / m (local DP: the uploads carry the noise)."""
        arrays, denominator = self.secure_sum(total)
        privacy = getattr(self, "privacy", None)
        if privacy is not None:
            privacy.aggregated()
            mean = privacy.noised_mean({k: arrays[k] for k in self.global_arrays}, rnd)
            return {k: mean[k].astype(v.dtype) for k, v in self.global_arrays.items()}
        return {k: (arrays[k] / denominator).astype(v.dtype) for k, v in self.global_arrays.items()}

    def aggregate_secure_fit(self, rnd: int, replies: dict[int, Message], total: SecureSum) -> dict[str, float]:
        """FedAvg's round from the sum alone: theta + sum_i w_i Delta_i / sum_i w_i, or, under DP,
        the mechanism's noised sum over the fixed m, through the server optimizer."""
        self.global_arrays = self.server_opt.step(self.global_arrays, self.secure_mean(rnd, total))
        return self.secure_metrics(replies)

    def secure_metrics(self, replies: dict[int, Message]) -> dict[str, float]:
        """The round's metrics: the mean training loss, or under DP only what the mechanism releases."""
        privacy = getattr(self, "privacy", None)
        return privacy.metrics() if privacy is not None else mean_train_loss(replies)


class PrivateAverage(ServerOptimized):
    """A strategy under ``privacy.mode``: its mechanism (:mod:`fedtune.methods.base.privacy`)
    draws the secret sample, aggregates, accounts and keeps its private state in the checkpoint."""

    @property
    def privacy(self) -> Mechanism | None:
        if self.config.privacy.mode == "none":
            return None
        if getattr(self, "_privacy", None) is None:
            self._privacy = mechanism(self.config)
        return self._privacy

    def private_sample(self, rnd: int, attempt: int) -> list[int] | None:
        return None if self.privacy is None else self.privacy.sample(rnd, attempt)

    def count_sample(self, rnd: int, client_ids: list[int]) -> None:
        """Local DP: every client asked uploads once more (a fresh noise draw each time)."""
        if self.privacy is not None:
            self.privacy.asked(client_ids)

    def halt_before(self, rnd: int) -> str | None:
        return None if self.privacy is None else self.privacy.halt_before(rnd)

    def private_aggregate(self, rnd: int, updates: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The mechanism's aggregate of ``updates`` (each in the global arrays' shapes; none: noise)."""
        self.privacy.aggregated()
        return self.privacy.aggregate(updates, rnd, self.global_arrays)

    def private_step(self, rnd: int, updates: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """theta <- server_opt(theta, private aggregate); the metrics the mechanism releases."""
        self.global_arrays = self.server_opt.step(self.global_arrays, self.private_aggregate(rnd, updates))
        return self.privacy.metrics()

    def summary(self) -> dict:
        return {} if self.privacy is None else {"privacy": self.privacy.report()}

    def server_state(self) -> dict:
        extra = {} if self.privacy is None else self.privacy.state_dict()
        return {**ServerOptimized.server_state(self), **extra}

    def load_server_state(self, state: Mapping) -> None:
        ServerOptimized.load_server_state(self, state)
        if self.privacy is not None:
            self.privacy.load_state_dict(state)


class BroadcastAverage(PrivateAverage, SecureSummed, Strategy):
    """FedAvg's round over ``self.global_arrays``: every sampled client gets the same arrays
    (and :meth:`fit_meta`); the server adds the weighted mean of the clients' updates,
    theta^{t+1} = theta^t + sum_i p_i Delta_i (``options.weighting``), through the server
    optimizer (default: exactly this sum); ``federation``'s robust-aggregation options replace
    the weighted mean (:mod:`fedtune.methods.base.robust`)."""

    global_arrays: dict[str, np.ndarray]

    def fit_meta(self, rnd: int) -> dict:
        return {"round": rnd}

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        message = Message(self.global_arrays, {**self.fit_meta(rnd), **self.secure_meta(client_ids)})
        self.count_sample(rnd, client_ids)
        return {cid: message for cid in client_ids}

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        return update_of(sent)

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        updates = [decode_update(m.arrays) for m in replies.values()]
        if self.privacy is not None:  # a round releases its noised aggregate even when nobody replied
            return self.private_step(rnd, updates)
        if not replies:
            return {}
        combined = aggregate_updates(updates, client_weights(replies, self.options.weighting), self.config.federation)
        self.global_arrays = self.server_opt.step(self.global_arrays, combined)
        return mean_train_loss(replies)
