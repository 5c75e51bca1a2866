"""Weighted averaging of client updates, the bases of every method whose server adds a weighted
mean of updates (FedAvg's round), and the upload codec.

Clients upload *updates* (trained minus received arrays), so any upload codec (top-k) applies to
every method the same way; :func:`encode_update` / :func:`decode_update` are that codec's hooks.
The server's side of every such method is composed in :mod:`fedtune.methods.base.aggregation`
(combiner, privacy mechanism, server optimizer), built once per run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

import numpy as np

from fedtune.methods.base.aggregation import Aggregation, layout_of, mean_train_loss, planned
from fedtune.methods.base.robust import ROBUST_AGGREGATION
from fedtune.models.training import FitResult, seed_for
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SecureSum, Strategy
from fedtune.protocol.validation import ArraySpec, spec_like

Weighting = Literal["examples", "uniform"]


class Weighted(Protocol):
    """The options of a method whose server averages (:class:`BroadcastAverage`): each declares
    ``weighting``, the p_i of the mean."""

    @property
    def weighting(self) -> Weighting:
        """p_i: by data size ("examples") or 1/N ("uniform")."""
        ...


#: The cross-method options (fedtune.registry.CROSS_METHOD_OPTIONS) a method honours when its server
#: steps through its :class:`~fedtune.methods.base.aggregation.Aggregation` and its clients upload
#: through :meth:`UpdateClient.upload`.
SERVER_STEP_AND_UPLOAD_CODEC = ("server.optimizer", "federation.upload_topk", "federation.wire_dtype")
#: ... and when its server also combines the updates with its combiner (:mod:`fedtune.methods.base.robust`).
WEIGHTED_SUM_OPTIONS = (*SERVER_STEP_AND_UPLOAD_CODEC, *ROBUST_AGGREGATION)
#: ... and when its server step is a weighted sum SecAgg+ can compute (:meth:`Aggregation.secure_mean`).
SECURE_AGGREGATION = ("secure_aggregation.enabled",)


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
        private = planned(self.context).privacy
        if private is None:
            reported = {**result.meta(), **meta}
        else:
            if rnd is None:
                raise ValueError(f"client {self.cid}: a private upload needs its round (its noise stream)")
            update = private.kind.client_release(private, update, self.state, self.cid, rnd)
            hidden = private.kind.clips_on_client or self.config.secure_aggregation.enabled
            reported = {"num_examples": 1, **meta} if hidden else {**result.meta(), **meta}
        return Message(encode_update(update, *self.profile.upload_codec(fed.upload_topk, fed.wire_dtype)), reported)

    def bound_secure_vector(self, vector: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Under ``privacy.mode``: the mechanism's :meth:`~fedtune.methods.base.privacy.Mechanism.secure_release`
        of ``vector`` (central DP: clipped below C by SecAgg+'s rounding margin)."""
        private = planned(self.context).privacy
        return vector if private is None else private.kind.secure_release(private, vector)

    def train_seed(self, rnd: int) -> int:
        """Data order and dropout of this client in round ``rnd``: from (run seed, round, client) alone."""
        return seed_for(self.config.seed, rnd, self.cid)


class BroadcastAverage(Strategy):
    """FedAvg's round over ``self.global_arrays``, and the averaging skeleton FedIT, FSLoRA and
    HeteroLoRA fill in. By default every sampled client gets the same arrays (and :meth:`fit_meta`)
    and the server adds the weighted mean of the clients' updates, theta^{t+1} = theta^t + sum_i
    p_i Delta_i (``options.weighting``). A round moves ``self.global_arrays`` through the strategy's
    :class:`~fedtune.methods.base.aggregation.Aggregation`: under ``privacy.mode`` by the
    mechanism's noised aggregate of the clients' updates in the global shapes
    (:meth:`private_updates`), released even when nobody replied; otherwise, when some client
    replied, to :meth:`averaged` (default: the sum above through ``federation``'s combiner and the
    server optimizer); under secure aggregation from the sum SecAgg+ gives
    (:meth:`aggregate_secure_fit`). A method that sends other requests (FSLoRA's sketches,
    HeteroLoRA's truncations) overrides :meth:`configure_fit` and :meth:`reply_spec` too. The
    concrete strategy builds ``aggregation``."""

    global_arrays: dict[str, np.ndarray]
    aggregation: Aggregation
    options: Weighted

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """The round's step (class docstring); its metrics: the mean training loss, or under DP
        only what the mechanism releases."""
        if self.aggregation.privacy is not None:  # a round releases its noised aggregate even when nobody replied
            updates = self.private_updates(rnd, replies)
            self.global_arrays, metrics = self.aggregation.private_step(rnd, self.global_arrays, updates)
            return metrics
        if not replies:
            return {}
        self.global_arrays = self.averaged(rnd, replies)
        return mean_train_loss(replies)

    def private_updates(self, rnd: int, replies: dict[int, Message]) -> list[dict[str, np.ndarray]]:
        """Each reply's update in the shapes of ``self.global_arrays``, for the DP mechanism to
        clip and sum (default: the decoded upload, already in those shapes)."""
        return [decode_update(m.arrays) for m in replies.values()]

    def averaged(self, rnd: int, replies: dict[int, Message]) -> dict[str, np.ndarray]:
        """The global arrays after round ``rnd`` without DP (default: theta + the combiner's
        ``options.weighting``-weighted mean of the decoded updates, through the server optimizer)."""
        updates = [decode_update(m.arrays) for m in replies.values()]
        return self.aggregation.step(self.global_arrays, updates, client_weights(replies, self.options.weighting))

    def aggregate_secure_fit(self, rnd: int, replies: dict[int, Message], total: SecureSum) -> dict[str, float]:
        """FedAvg's round from the sum alone: theta + sum_i w_i v_i / sum_i w_i (v_i: what the
        client summed, its update unless the method says otherwise), or, under DP, the mechanism's
        noised sum over the fixed m, through the server optimizer."""
        self.global_arrays, metrics = self.aggregation.secure_step(rnd, total, self.global_arrays, replies)
        return metrics

    def fit_meta(self, rnd: int) -> dict:
        return {"round": rnd}

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        bounds = (self.context.example_bound("train", cid) for cid in client_ids)
        secure = self.aggregation.secure_meta(layout_of(self.global_arrays), self.options.weighting, bounds)
        message = Message(self.global_arrays, {**self.fit_meta(rnd), **secure})
        self.aggregation.asked(client_ids)
        return {cid: message for cid in client_ids}

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec] | list[dict[str, ArraySpec]]:
        return update_of(sent)
