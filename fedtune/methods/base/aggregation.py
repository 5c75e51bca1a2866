"""The server's aggregation, composed: a combiner, an optional privacy mechanism, the server
optimizer (and, under ``secure_aggregation.enabled``, the weighted sum SecAgg+ gives).

:func:`plan_aggregation` reads the run's options once, at resolve (:func:`fedtune.runtime.resolve_run`),
into an :class:`AggregationPlan`: immutable and secret-free, it travels in the ResolvedRun to the
server and to every client. The server's strategy builds one :class:`Aggregation` from it (the
stateful part: the mechanism's secret and release counts, the optimizer's moments, both in the
strategy's checkpoint) and delegates to it:

- ``plan.combiner`` (:mod:`fedtune.methods.base.robust`): weighted mean, trimmed mean, median,
  each optionally after norm clipping; used where the server sees each update;
- ``plan.privacy`` (:mod:`fedtune.methods.base.privacy`): under ``privacy.mode``, the mechanism
  replaces the combiner (it samples, clips, sums, noises over the fixed m and accounts);
- ``plan.server`` (:mod:`fedtune.methods.base.server_optimizer`): the step theta + Delta (SGD at
  lr 1) or FedAdam, applied to whatever the combiner or the mechanism gave;
- ``plan.secure``: the clients' weighted vectors cross masked, the round loop unmasks their sum
  through the transport (:class:`fedtune.engines.rounds.SecureTransport`), and the server reads
  the mean (or the mechanism's noised mean) from it (:meth:`Aggregation.secure_mean`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedtune.config import ConfigError, RunConfig
from fedtune.methods.base.privacy import Mechanism, PrivacyParams, privacy_params
from fedtune.methods.base.robust import Combiner, combiner
from fedtune.methods.base.server_optimizer import ServerOptimizer, ServerStep
from fedtune.protocol.context import ClientContext
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SECURE_LAYOUT, SECURE_MAX_WEIGHT, SECURE_WEIGHT, RoundRules, SecureSum

Layout = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class AggregationPlan:
    """What the server's aggregation is made of, resolved once (:func:`plan_aggregation`)."""

    combiner: Combiner
    privacy: PrivacyParams | None
    server: ServerStep
    secure: bool


def plan_aggregation(config: RunConfig) -> AggregationPlan:
    """The run's :class:`AggregationPlan`; raises ConfigError on a ``[privacy]`` that cannot run
    (:func:`~fedtune.methods.base.privacy.privacy_params`)."""
    return AggregationPlan(
        combiner(config.robust), privacy_params(config), ServerStep.of(config.server), config.secure_aggregation.enabled
    )


def planned(context: ClientContext) -> AggregationPlan:
    """The run's :class:`AggregationPlan` as ``context`` holds it (resolved once; the protocol, a
    layer below, cannot name its type): TypeError when it holds something else."""
    plan = context.run.aggregation
    if not isinstance(plan, AggregationPlan):
        raise TypeError(f"the run's aggregation is a {type(plan).__name__}, not an AggregationPlan")
    return plan


def mean_train_loss(replies: Mapping[int, Message]) -> dict[str, float]:
    """The replies' mean ``train_loss`` ({} when none reports one)."""
    losses = [m.meta["train_loss"] for m in replies.values() if "train_loss" in m.meta]
    return {"train_loss": float(np.mean(losses))} if losses else {}


def layout_of(arrays: Mapping[str, np.ndarray]) -> Layout:
    """Names and shapes of ``arrays``: the default vector every client masks (its update)."""
    return {k: tuple(np.shape(v)) for k, v in arrays.items()}


class Aggregation:
    """One run's server aggregation (module docstring): built once by the strategy from the plan."""

    def __init__(self, plan: AggregationPlan) -> None:
        self.plan = plan
        self.combine: Combiner = plan.combiner
        self.privacy: Mechanism | None = None if plan.privacy is None else plan.privacy.kind(plan.privacy)
        self.server_opt = ServerOptimizer(plan.server)

    # -- the round loop's questions ------------------------------------------------------------
    def rules(self, rnd: int, attempt: int) -> RoundRules:
        """How round ``rnd``'s ``attempt`` runs. Without DP: the engine's seeded draw, retries,
        federated evaluation. Under DP: the mechanism's secret sample, need 0 (a missing reply is a
        zero update), never retried (a fresh sample would condition the first on failing), no
        federated evaluation (outside what the accountant counts) and a record that releases no
        per-client number; with secure aggregation also no sample of one. Under secure aggregation
        the updates cross masked."""
        masked = self.plan.secure
        if self.privacy is None:
            return RoundRules(masked=masked)
        sample = self.privacy.sample(rnd, attempt)
        return RoundRules(sample, 2 if masked else 0, 0, False, False, True, masked)

    def halt_before(self, rnd: int) -> str | None:
        """The one line that stops the run before round ``rnd`` (a spent privacy budget), else None."""
        return None if self.privacy is None else self.privacy.halt_before(rnd)

    def asked(self, client_ids: list[int]) -> None:
        """Local DP: every client asked uploads once more (a fresh noise draw each time)."""
        if self.privacy is not None:
            self.privacy.asked(client_ids)

    # -- the server step ---------------------------------------------------------------------------
    def step(
        self, params: Mapping[str, np.ndarray], updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]
    ) -> dict[str, np.ndarray]:
        """theta + the combined ``updates`` (the server sees each), through the server optimizer."""
        return self.server_opt.step(params, self.combine(updates, weights))

    def private_step(
        self, rnd: int, params: Mapping[str, np.ndarray], updates: list[dict[str, np.ndarray]]
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """Under DP: theta + the mechanism's aggregate of ``updates`` (each in the shapes of
        ``params``; none: noise alone), and the metrics it releases."""
        assert self.privacy is not None, "private_step without privacy.mode"
        self.privacy.aggregated()
        update = self.privacy.aggregate(updates, rnd, params)
        return self.server_opt.step(params, update), self.privacy.metrics()

    def metrics(self, replies: Mapping[int, Message]) -> dict[str, float]:
        """The round's metrics: the mean training loss, or under DP only what the mechanism releases."""
        return self.privacy.metrics() if self.privacy is not None else mean_train_loss(replies)

    # -- secure aggregation --------------------------------------------------------------------------
    def secure_meta(self, layout: Layout, weighting: str, bounds: Iterable[int]) -> dict[str, Any]:
        """The training requests' meta under secure aggregation ({} without it): how the clients
        weigh v_i (w_i: their data sizes, FedAvg's p_i, at most ``bounds``' largest, each client's
        partition size; or 1 under ``weighting = "uniform"`` and DP-FedAvg's uniform weights), the
        round's largest weight W, and ``layout``, the names and shapes of v_i."""
        if not self.plan.secure:
            return {}
        if self.plan.privacy is not None:  # the clients' clip bound must exist: else one line, at the first request
            try:
                self.plan.privacy.kind.secure_bound(self.plan.privacy, sum(math.prod(s) for s in layout.values()))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.privacy is None and weighting == "examples":
            weights: dict[str, Any] = {SECURE_WEIGHT: "examples", SECURE_MAX_WEIGHT: float(max(bounds, default=0))}
        else:
            weights = {SECURE_WEIGHT: "uniform", SECURE_MAX_WEIGHT: 1.0}
        return {**weights, SECURE_LAYOUT: [[k, list(shape)] for k, shape in layout.items()]}

    def secure_sum(self, total: SecureSum, layout: Layout) -> tuple[dict[str, np.ndarray], float]:
        """``total``'s arrays, checked against ``layout``, and the round's denominator: sum_i w_i,
        or, under DP, the fixed m (DP-FedAvg)."""
        if list(total.arrays) != list(layout) or any(np.shape(v) != layout[k] for k, v in total.arrays.items()):
            raise ValueError("the secure sum's arrays are not the names and shapes of the strategy's secure_layout")
        denominator = self.privacy.m if self.privacy is not None else total.weight
        if not denominator > 0:
            raise ValueError(f"the secure sum's total weight is {denominator}")
        return total.arrays, float(denominator)

    def secure_mean(
        self, rnd: int, total: SecureSum, layout: Layout, like: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """sum_i w_i Delta_i / sum_i w_i of the arrays of ``like``, in their dtypes; under DP the
        mechanism's (sum + xi) / m (local DP: the uploads carry the noise)."""
        arrays, denominator = self.secure_sum(total, layout)
        if self.privacy is not None:
            self.privacy.aggregated()
            mean = self.privacy.noised_mean({k: arrays[k] for k in like}, rnd)
            return {k: mean[k].astype(v.dtype) for k, v in like.items()}
        return {k: (arrays[k] / denominator).astype(v.dtype) for k, v in like.items()}

    def secure_step(
        self, rnd: int, total: SecureSum, params: Mapping[str, np.ndarray], replies: Mapping[int, Message]
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """FedAvg's round from the sum alone (v_i = Delta_i): theta + :meth:`secure_mean` through
        the server optimizer, and the round's metrics."""
        mean = self.secure_mean(rnd, total, layout_of(params), params)
        return self.server_opt.step(params, mean), self.metrics(replies)

    # -- state and report ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The server optimizer's state and the mechanism's private state (the strategy's checkpoint)."""
        private = {} if self.privacy is None else self.privacy.state_dict()
        return {"server_opt": self.server_opt.state_dict(), **private}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (resume)."""
        self.server_opt.load_state_dict(state.get("server_opt"))
        if self.privacy is not None:
            self.privacy.load_state_dict(state)

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s ``privacy`` under DP, else nothing."""
        return {} if self.privacy is None else {"privacy": self.privacy.report()}
