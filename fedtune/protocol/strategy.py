"""Server side of a method: the abstract Strategy every method implements.

A Strategy talks to clients only through :class:`~fedtune.protocol.messages.Message`.
The engines (in-process simulation, Flower) call, each round::

    messages = strategy.configure_fit(rnd, client_ids)      # one Message per sampled client
    replies  = {cid: client.fit(messages[cid]) ...}          # run by the engine
    metrics  = strategy.aggregate_fit(rnd, replies)
    metrics |= strategy.evaluate(rnd)                        # centralized evaluation, optional
    # federated evaluation, optional:
    replies  = {cid: client.evaluate(m) for cid, m in strategy.configure_evaluate(rnd, ids).items()}
    metrics |= strategy.aggregate_evaluate(rnd, replies)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedtune.config import RunConfig
from fedtune.protocol.context import ServerContext
from fedtune.protocol.messages import Message
from fedtune.protocol.validation import COMMON_META, ArraySpec, MetaField

#: Meta of a training request under secure aggregation: the weight a client masks its update with
#: ("examples": its ``num_examples``; "uniform": 1), the largest weight of the round's clients, and
#: the layout of the vector every client masks and the server sums ([[name, shape], ...], the same
#: for every client; :meth:`fedtune.protocol.client.Client.secure_vector` fills it).
SECURE_WEIGHT, SECURE_MAX_WEIGHT, SECURE_LAYOUT = "secure_weight", "secure_max_weight", "secure_layout"


def secure_layout_of(meta: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """A training request's ``secure_layout`` (from its ``meta``) as name -> shape (in order)."""
    return {str(name): tuple(int(d) for d in shape) for name, shape in meta[SECURE_LAYOUT]}


@dataclass
class SecureSum:
    """What secure aggregation (SecAgg+, Bonawitz et al. CCS 2017; Bell et al. CCS 2020) gives
    the server instead of the replies' arrays: ``arrays`` = sum_i w_i v_i over ``clients`` (v_i:
    client i's vector of the request's ``secure_layout``, its update Delta_i unless the method says
    otherwise)
    (dequantized, float64), ``weight`` = sum_i w_i, each client's weight w_i its own
    ``num_examples`` or 1 (what the strategy asked for in ``configure_fit``) rounded to a multiple
    of W/T (W the round's largest weight, T the quantization range), and ``error``, the largest
    possible deviation of a coordinate of ``arrays`` from the exact sum (quantization)."""

    arrays: dict[str, np.ndarray]
    weight: float
    clients: list[int]
    error: float = 0.0


@dataclass(frozen=True)
class RoundRules:
    """What the round loop asks of a strategy for one attempt of a round's training exchange
    (:meth:`Strategy.round_rules`); the loop follows the answer and knows no mechanism behind it.

    ``sample``: the round's clients when the strategy draws them itself (client-level DP: from the
    mechanism's secret), None for the engine's seeded uniform draw; ``fewest``: a sample smaller
    than this is asked nothing (a secure sum of one update is that update); ``need``: the valid
    replies the round aggregates with (None: ``federation.min_replies``); ``may_retry``: a round
    short of ``need`` is retried with a fresh sample (else it aggregates no reply);
    ``evaluate_federated``: the clients evaluate the new state on their data; ``private``: the
    round's record releases no per-client number (:class:`fedtune.engines.record.RoundRecord`);
    ``masked``: the updates cross masked, so no reply's arrays are screened and the transport's
    unmask stage gives their sum (:meth:`Strategy.aggregate_secure_fit`)."""

    sample: list[int] | None = None
    fewest: int = 0
    need: int | None = None
    may_retry: bool = True
    evaluate_federated: bool = True
    private: bool = False
    masked: bool = False


class ServerAggregation(Protocol):
    """What the round loop and the run folder ask of a strategy's aggregation
    (:class:`fedtune.methods.base.aggregation.Aggregation`: combiner, privacy mechanism, server optimizer)."""

    def rules(self, rnd: int, attempt: int) -> RoundRules:
        """How the round loop runs round ``rnd``'s ``attempt`` (0 first): :class:`RoundRules`."""
        ...

    def halt_before(self, rnd: int) -> str | None:
        """Why the run stops before round ``rnd`` (a spent privacy budget), or None."""
        ...

    def summary(self) -> dict[str, Any]:
        """What the aggregation adds to ``summary.json``."""
        ...


class Strategy(ABC):
    """Server-side logic of one method. Holds the global state; never touches client objects.
    A strategy that aggregates through an :class:`ServerAggregation` holds it as ``aggregation``
    (the defaults of :meth:`halt_before`, :meth:`round_rules` and :meth:`summary` ask it)."""

    aggregation: ServerAggregation | None = None

    def __init__(self, context: ServerContext) -> None:
        """``context``: the process's run context (:class:`~fedtune.protocol.context.ServerContext`:
        the config, the method's options, the client profiles, the task and its cached model)."""
        self.context = context
        self.config: RunConfig = context.config
        self.options: object = context.options  # a method declares its options class: options: MyOptions

    @abstractmethod
    def initialize(self) -> None:
        """Build the initial global state (called once before round 1)."""

    @abstractmethod
    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        """One Message per sampled client of ``client_ids`` for round ``rnd`` (messages may differ per client)."""

    @abstractmethod
    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """Fold the clients' ``replies`` (client id -> Message) of round ``rnd`` into the global state;
        return round metrics."""

    def aggregate_secure_fit(self, rnd: int, replies: dict[int, Message], total: SecureSum) -> dict[str, float]:
        """:meth:`aggregate_fit` of round ``rnd`` under ``secure_aggregation.enabled``: ``replies`` hold the
        clients' metadata only (their arrays crossed masked), ``total`` their sum. Only a method
        that declares the option (``register(..., supports=...)``) is ever asked."""
        raise RuntimeError(f"{type(self).__name__} has no secure-aggregation form (it needs each update)")

    def phases(self, rnd: int) -> tuple[str, ...]:
        """Further exchanges of round ``rnd`` after the training one, in order (default none).

        A round is then: ``configure_fit`` / ``Client.fit`` / ``aggregate_fit``, and for each
        named phase p, with the clients whose replies were valid so far:
        ``configure_phase(p, ...)`` / ``Client.phase(p, message)`` / ``aggregate_phase(p, ...)``
        (RABO's hypergradient exchange after the inner one, BoMM's party / cloud exchanges).
        Every phase's messages are byte-accounted and validated like the training ones."""
        return ()

    def configure_phase(self, phase: str, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        """One Message per client of ``client_ids`` for ``phase`` of round ``rnd`` (see :meth:`phases`)."""
        raise RuntimeError(f"{type(self).__name__} declares phase {phase!r} but does not configure it")

    def aggregate_phase(self, phase: str, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """Fold the ``replies`` of ``phase`` of round ``rnd`` into the global state; return round metrics."""
        raise RuntimeError(f"{type(self).__name__} declares phase {phase!r} but does not aggregate it")

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec] | list[dict[str, ArraySpec]] | None:
        """The arrays expected in client ``cid``'s reply to ``sent`` in round ``rnd``: the engine
        rejects (drops) a reply that does not match before :meth:`aggregate_fit` (or
        :meth:`aggregate_phase`) sees it (:func:`fedtune.protocol.validation.check_arrays`); ``sent``
        tells the phase apart if the strategy puts it in ``sent.meta``. A list: alternative forms,
        any of which is valid. None: only finite values are checked."""
        return None

    def reply_meta_spec(self, kind: str, cid: int) -> dict[str, MetaField]:
        """The metadata expected in client ``cid``'s replies of exchange ``kind`` ("train",
        "evaluate" or a phase): the engine drops a reply whose metadata does not match
        (:func:`fedtune.protocol.validation.check_meta`). Default: :data:`COMMON_META`, with
        ``num_examples`` required in training replies and at most what the server knows of that
        client (``context.example_bound``: its partition's size; for "evaluate", the test set's). A
        method that reads further keys adds them."""
        examples = COMMON_META["num_examples"].with_high(self.context.example_bound(kind, cid))
        if kind == "train":  # every training reply says how much data it stands for (its FedAvg weight)
            examples = MetaField(examples.kind, examples.low, examples.high, required=True)
        return {**COMMON_META, "num_examples": examples}

    def meta_with(self, kind: str, cid: int, when: str, **fields: MetaField) -> dict[str, MetaField]:
        """:meth:`reply_meta_spec`'s default for client ``cid``'s replies of exchange ``kind``, plus
        ``fields`` when ``kind`` is ``when``: how a method declares the metadata keys it reads."""
        spec = Strategy.reply_meta_spec(self, kind, cid)
        return {**spec, **fields} if kind == when else spec

    def evaluate(self, rnd: int) -> dict[str, float]:
        """Centralized evaluation of the global state after round ``rnd`` (default: none)."""
        return {}

    def configure_evaluate(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        """Messages for federated evaluation by the clients of ``client_ids`` in round ``rnd`` (default: none)."""
        return {}

    def aggregate_evaluate(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """Combine the federated evaluation ``replies`` of round ``rnd`` (default: example-weighted mean of metrics)."""
        return weighted_mean_meta(replies)

    def halt_before(self, rnd: int) -> str | None:
        """One line when the run must stop before round ``rnd`` (a spent privacy budget), else None."""
        return None if self.aggregation is None else self.aggregation.halt_before(rnd)

    def round_rules(self, rnd: int, attempt: int) -> RoundRules:
        """How the round loop runs round ``rnd``'s ``attempt`` (0 first): its aggregation's
        :meth:`~ServerAggregation.rules` (under client-level DP the secret sample, no retry, no
        federated evaluation; under secure aggregation the unmask stage), else the defaults."""
        return RoundRules() if self.aggregation is None else self.aggregation.rules(rnd, attempt)

    def summary(self) -> dict[str, Any]:
        """What the strategy adds to ``summary.json`` (default: its aggregation's)."""
        return {} if self.aggregation is None else self.aggregation.summary()

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy holds, as named arrays and JSON-able values."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state``, what :meth:`state_dict` returned."""

    def save(self, run_dir: Path) -> None:
        """Write the final artifacts into ``run_dir`` (for LoRA methods: the adapter with ``save_pretrained``)."""


def weighted_mean_meta(replies: dict[int, Message], weight_key: str = "num_examples") -> dict[str, float]:
    """Mean of the numeric metadata of replies, weighted by ``meta[weight_key]`` (else uniform)."""
    if not replies:
        return {}
    metas = [m.meta for m in replies.values()]  # validated (Strategy.reply_meta_spec): finite numbers
    weights = np.array([float(m.get(weight_key, 1.0)) for m in metas])
    if weights.sum() <= 0:
        weights = np.ones(len(metas))
    keys = sorted({k for m in metas for k, v in m.items() if isinstance(v, (int, float)) and k != weight_key})
    out = {}
    for key in keys:
        pairs = [(w, float(m[key])) for w, m in zip(weights, metas) if isinstance(m.get(key), (int, float))]
        ws = np.array([p[0] for p in pairs])
        out[key] = float(np.dot(ws, [p[1] for p in pairs]) / ws.sum())
    return out
