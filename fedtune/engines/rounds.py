"""The round loop every engine runs (:func:`drive_rounds`): seeded client sampling, a
Strategy's configure / aggregate calls, reply validation, drops and retries, and per-round
records with the bytes that crossed. An engine supplies only a :data:`Transport` that delivers a
round's Messages to clients and brings back one :class:`Delivery` per client. The loop knows no
privacy mechanism or secure aggregation: who is sampled, how many valid replies a round needs,
whether a short round is retried, whether the clients evaluate, whether the record releases
per-client numbers and whether the updates cross masked (the transport's unmask stage then gives
their sum) are the strategy's answers (:meth:`Strategy.round_rules`, a
:class:`~fedtune.protocol.strategy.RoundRules` per attempt).

Faults (both engines). A client that raises, misses the round's deadline
(``federation.round_timeout_s``) or never answers is *dropped* for that round, and so is a
reply that fails validation: the wrong client id or round, larger than
``federation.max_reply_bytes``, metadata other than :meth:`Strategy.reply_meta_spec` declares
(types, ranges, finite numbers: a client's ``num_examples`` is at most what the server knows of
it), or arrays other than :meth:`Strategy.reply_spec` expects (names, shapes, dtypes, finite
values; :mod:`fedtune.protocol.validation`), and so is a training reply whose norm exceeds
``robust.max_update_ratio`` times the round's reference (not under DP; under local DP, one
beyond what a clipped and noised upload can be). Dropped replies never
reach ``aggregate_fit``. A round may hold further exchanges after the training one
(:meth:`Strategy.phases`: RABO's two phases, BoMM's party / cloud exchanges), each with the
clients still answering, each validated, byte-accounted and recorded the same way; a phase short
of ``min_replies`` stops the run (the round is redone from its checkpoint on resume). A round
aggregates when at least ``federation.min_replies`` replies are
valid; otherwise it is retried with a fresh sample (seeded by the attempt), up to
``federation.max_retries`` times, after which :class:`RoundFailed` stops the run (the caller has
checkpointed the last complete round). Every drop (who, why) is in the round's record.

Budgets (:mod:`fedtune.planning`): a client the plan excluded is dropped whenever it is sampled,
with the plan's reason; a client with a ``memory_gib`` has its fit's peak measured (the reply's
``peak_bytes``), kept in the record beside its budget, and is dropped above it (a simulated
out-of-memory); a client slower than its ``deadline_s`` is dropped as a missed deadline.

The parts: :mod:`fedtune.engines.delivery` (the transport protocol, a client's :class:`Delivery`,
:func:`answer` on the client side, fault injection), :mod:`fedtune.engines.policy` (the checks
that drop a reply) and :mod:`fedtune.engines.record` (a round's record); their names are
importable from here too.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import numpy as np

from fedtune.engines.delivery import (
    EVALUATE,
    TRAIN,
    Delivery,
    InjectedFailure,
    SecureTransport,
    Transport,
    answer,
    attacked,
)
from fedtune.engines.policy import RoundPolicy, measured_peak
from fedtune.engines.record import RoundRecord
from fedtune.errors import FedtuneError
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import RoundRules, SecureSum, Strategy

__all__ = [
    "EVALUATE",
    "TRAIN",
    "Delivery",
    "Engine",
    "InjectedFailure",
    "RoundFailed",
    "RoundPolicy",
    "RoundRecord",
    "RunHalted",
    "RunInterrupted",
    "SecureTransport",
    "Transport",
    "answer",
    "attacked",
    "drive_rounds",
    "first_nonfinite",
    "sample_clients",
]


def sample_clients(num_clients: int, sample_size: int, seed: int, rnd: int, attempt: int = 0) -> list[int]:
    """Clients of round ``rnd``: ``sample_size`` of the ``num_clients``, uniform without replacement,
    from (``seed``, round, ``attempt``) alone."""
    if sample_size >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, rnd, 0x5A] if attempt == 0 else [seed, rnd, 0x5A, attempt])
    return sorted(int(c) for c in rng.choice(num_clients, size=sample_size, replace=False))


class RoundFailed(FedtuneError, RuntimeError):
    """A round stayed short of ``federation.min_replies`` valid replies after every retry, or its
    aggregation was rejected."""

    exit_code = 1


def _exchange(
    strategy: Strategy,
    transport: Transport,
    policy: RoundPolicy,
    record: RoundRecord,
    kind: str,
    sent: dict[int, Message],
    rnd: int,
    attempt: int,
) -> dict[int, Message]:
    """One exchange of a round (training or a phase): the valid replies; bytes and drops go to
    ``record``."""
    valid: dict[int, Message] = {}
    for cid, got in transport(kind, rnd, sent, attempt).items():
        record.client_bytes_down[cid] = record.client_bytes_down.get(cid, 0) + got.down
        record.client_bytes_up[cid] = record.client_bytes_up.get(cid, 0) + got.up
        record.client_compute_s[cid] = record.client_compute_s.get(cid, 0.0) + got.seconds
        reason = policy.rejection(strategy, kind, rnd, cid, sent[cid], got)
        peak = measured_peak(got)  # kept for a reply dropped over its budget too
        if peak is not None and cid in policy.memory_bytes:
            record.client_peak_bytes[cid] = max(peak, record.client_peak_bytes.get(cid, 0))
            record.client_memory_budget_bytes[cid] = policy.memory_bytes[cid]
        if reason is None:
            assert got.reply is not None  # rejection() names a missing reply
            valid[cid] = got.reply
            record.client_steps[cid] = record.client_steps.get(cid, 0) + int(got.reply.meta.get("steps", 0))
        else:
            where = (f"attempt {attempt + 1}: " if attempt else "") + (f"{kind}: " if kind != TRAIN else "")
            record.dropped[cid] = where + reason
    return valid


def first_nonfinite(state: Any, path: str = "state") -> str | None:
    """The path of the first non-finite number in a strategy's state (nested dicts, lists,
    arrays), or None when every number is finite."""
    if isinstance(state, np.ndarray):
        return path if state.dtype.kind in "fc" and not np.isfinite(state).all() else None
    if isinstance(state, (float, np.floating)):
        return None if np.isfinite(state) else path
    items: Iterable[tuple[Any, Any]]
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return None
    for key, value in items:
        where = first_nonfinite(value, f"{path}/{key}")
        if where is not None:
            return where
    return None


def _aggregated(
    rnd: int, kind: str, aggregate: Callable[..., dict[str, float]], replies: Mapping[int, Message], *phase: Any
) -> dict[str, float]:
    """The metrics of ``aggregate(*phase, rnd, replies)``; an exception inside it (whatever the
    validated replies held) rejects the round with one line: nothing of it is recorded or
    checkpointed."""
    try:
        return aggregate(*phase, rnd, replies)
    except Exception as exc:  # noqa: BLE001 - any failure of aggregation rejects the round
        what = "aggregation" if kind == TRAIN else f"{kind} aggregation"
        raise RoundFailed(
            f"round {rnd}: {what} failed ({type(exc).__name__}: {exc}); nothing of this round is kept"
        ) from exc


def _unmasked(
    transport: Transport, record: RoundRecord, attempt: int, replies: dict[int, Message], sent: dict[int, Message]
) -> SecureSum | None:
    """The transport's unmask stage: the sum of the masked updates of ``replies`` (the valid ones;
    every other client's masks are removed), or None when it cannot be rebuilt. Its bytes and
    drops go to ``record``."""
    if not isinstance(transport, SecureTransport):
        raise RuntimeError("the strategy's round rules say the updates cross masked; the transport has no unmask stage")
    total, deliveries = transport.unmask(record.round, attempt, sorted(replies), sent)
    for cid, got in deliveries.items():
        record.client_bytes_down[cid] = record.client_bytes_down.get(cid, 0) + got.down
        record.client_bytes_up[cid] = record.client_bytes_up.get(cid, 0) + got.up
        if got.error is not None:
            record.dropped[cid] = (f"attempt {attempt + 1}: " if attempt else "") + f"unmask: {got.error}"
    return total


Fit = Callable[[int, dict[int, Message]], dict[str, float]]  # a strategy's aggregation of a round's training replies


def _gathered(
    strategy: Strategy,
    transport: Transport,
    policy: RoundPolicy,
    record: RoundRecord,
    rules: RoundRules,
    attempt: int,
    replies: dict[int, Message],
    sent: dict[int, Message],
) -> tuple[dict[int, Message], Fit] | None:
    """What the round aggregates after a training exchange, as ``rules`` say: the replies (screened
    for outsized updates unless masked) and the strategy's aggregation of them (of masked ones: of
    the sum the transport's unmask stage rebuilds, :meth:`Strategy.aggregate_secure_fit`); None
    when fewer than ``rules.need`` (default ``policy.min_replies``) remain."""
    need = policy.min_replies if rules.need is None else rules.need
    if not rules.masked:  # masked replies carry no arrays to measure
        replies = policy.screened(record, replies, sent, attempt)
    if len(replies) < need:
        return None
    if not rules.masked or not sent:
        return replies, strategy.aggregate_fit
    total = _unmasked(transport, record, attempt, replies, sent)
    if total is None or len(total.clients) < need:
        return None
    return {cid: replies[cid] for cid in total.clients}, partial(strategy.aggregate_secure_fit, total=total)


def _trained(
    strategy: Strategy, transport: Transport, policy: RoundPolicy, record: RoundRecord, draw: Callable[[int], list[int]]
) -> tuple[dict[int, Message], Fit, RoundRules]:
    """Round ``record.round``'s training exchange, attempt after attempt, each run by the
    strategy's :meth:`~Strategy.round_rules`: its clients (the rules' sample, else ``draw(attempt)``,
    less the plan's excluded), the exchange, and what it gathers (:func:`_gathered`). A short attempt
    is retried up to ``policy.max_retries`` times when the rules allow it (else the round aggregates
    no reply); then :class:`RoundFailed`. Returns the replies, their aggregation and the last rules."""
    rnd = record.round
    for attempt in range(policy.max_retries + 1):
        record.attempts = attempt + 1
        rules = strategy.round_rules(rnd, attempt)
        record.private = rules.private
        clients = rules.sample if rules.sample is not None else draw(attempt)
        record.dropped.update({c: policy.excluded[c] for c in clients if c in policy.excluded})
        clients = [c for c in clients if c not in policy.excluded]
        clients = clients if len(clients) >= rules.fewest else []
        record.clients = sorted(set(record.clients) | set(clients))
        sent = strategy.configure_fit(rnd, clients)
        replies = _exchange(strategy, transport, policy, record, TRAIN, sent, rnd, attempt)
        gathered = _gathered(strategy, transport, policy, record, rules, attempt, replies, sent)
        if gathered is not None:
            return (*gathered, rules)
        if not rules.may_retry:
            return {}, strategy.aggregate_fit, rules
    raise RoundFailed(
        f"round {rnd}: fewer than federation.min_replies = {policy.min_replies} valid replies after "
        f"{policy.max_retries + 1} attempts; drops: {record.dropped}"
    )


def _phases(
    strategy: Strategy, transport: Transport, policy: RoundPolicy, record: RoundRecord, replies: dict[int, Message]
) -> None:
    """The round's further exchanges (:meth:`Strategy.phases`), each with the clients still
    answering; a phase short of ``policy.min_replies`` stops the run (:class:`RoundFailed`)."""
    rnd = record.round
    for phase in strategy.phases(rnd):
        sent = strategy.configure_phase(phase, rnd, sorted(replies))
        replies = _exchange(strategy, transport, policy, record, phase, sent, rnd, 0)
        if len(replies) < policy.min_replies:
            raise RoundFailed(
                f"round {rnd}, phase {phase!r}: fewer than federation.min_replies = {policy.min_replies} "
                f"valid replies; drops: {record.dropped}"
            )
        record.metrics.update(_aggregated(rnd, phase, strategy.aggregate_phase, replies, phase))


def _check_state(strategy: Strategy, rnd: int) -> None:
    """:class:`RoundFailed` when the aggregated global state holds a non-finite number."""
    where = first_nonfinite(strategy.state_dict())
    if where is not None:
        raise RoundFailed(
            f"round {rnd}: the aggregated global state is not finite ({where}); nothing of this round is kept"
        )


def _evaluate(
    strategy: Strategy, transport: Transport, policy: RoundPolicy, record: RoundRecord, rules: RoundRules, n: int
) -> None:
    """The round's centralized evaluation (a non-finite loss stops the run), then, when ``rules``
    allow it, the federated one by the ``n`` clients; metrics, bytes and drops go to ``record``."""
    rnd = record.round
    record.metrics.update(strategy.evaluate(rnd))
    if not np.isfinite(record.metrics.get("loss", 0.0)):  # every client would fail on this state
        raise RoundFailed(
            f"round {rnd}: the aggregated global state evaluates to a non-finite loss; nothing of this round is kept"
        )
    eval_messages = strategy.configure_evaluate(rnd, list(range(n))) if rules.evaluate_federated else {}
    eval_replies: dict[int, Message] = {}
    for cid, got in transport(EVALUATE, rnd, eval_messages, 0).items():
        record.eval_bytes += got.down + got.up
        reason = policy.rejection(strategy, EVALUATE, rnd, cid, None, got)
        if reason is None:
            assert got.reply is not None  # rejection() names a missing reply
            eval_replies[cid] = got.reply
        else:
            record.dropped.setdefault(cid, f"evaluation: {reason}")
    if eval_replies:
        record.metrics.update(_aggregated(rnd, EVALUATE, strategy.aggregate_evaluate, eval_replies))


def drive_rounds(
    strategy: Strategy,
    transport: Transport,
    num_clients: int,
    sample_size: int,
    rounds: int,
    seed: int,
    eval_every: int = 1,
    on_round: Callable[[RoundRecord], None] | None = None,
    start_round: int = 1,
    policy: RoundPolicy = RoundPolicy(),
    should_stop: Callable[[], bool] = lambda: False,
) -> list[RoundRecord]:
    """Rounds ``start_round..rounds`` of ``strategy``, messages delivered by ``transport`` (the
    embedded engine's in-process clients, or Flower's grid): one loop for every engine.
    ``on_round`` sees each record as its round ends (the caller writes metrics and the
    checkpoint there); ``should_stop()`` is asked after each round (Ctrl-C). Each round samples
    ``sample_size`` of the ``num_clients`` clients (:func:`sample_clients` with ``seed``) unless the
    strategy's round rules draw them, evaluates every ``eval_every`` rounds, and drops and retries
    as ``policy`` (:class:`RoundPolicy`) and the rules (:meth:`Strategy.round_rules`) say."""
    history = []
    for rnd in range(start_round, rounds + 1):
        reason = strategy.halt_before(rnd)
        if reason is not None:
            raise RunHalted(reason, rnd - 1)
        start = time.perf_counter()
        record = RoundRecord(rnd, [])
        draw = partial(sample_clients, num_clients, sample_size, seed, rnd)
        replies, fit, rules = _trained(strategy, transport, policy, record, draw)
        record.metrics.update(_aggregated(rnd, TRAIN, fit, replies))
        _phases(strategy, transport, policy, record, replies)
        _check_state(strategy, rnd)
        if rnd % eval_every == 0 or rnd == rounds:
            _evaluate(strategy, transport, policy, record, rules, num_clients)
        record.wall_s = time.perf_counter() - start
        history.append(record)
        if on_round is not None:
            on_round(record)
        if should_stop() and rnd < rounds:
            raise RunInterrupted(rnd)
    return history


class RunInterrupted(Exception):
    """The run was asked to stop (Ctrl-C) and stopped after round ``round`` (checkpointed)."""

    def __init__(self, rnd: int) -> None:
        """``rnd``: the last complete round."""
        super().__init__(f"interrupted after round {rnd}")
        self.round = rnd


class RunHalted(Exception):
    """The strategy stopped the run before round ``round + 1`` (:meth:`Strategy.halt_before`);
    rounds up to ``round`` are complete and checkpointed."""

    def __init__(self, reason: str, rnd: int) -> None:
        """``reason``: the strategy's one line; ``rnd``: the last complete round."""
        super().__init__(reason)
        self.round = rnd


class Engine(ABC):
    """What runs a run's rounds: a transport to the clients, plus whatever state the checkpoint
    must keep beside the strategy's (the embedded engine's client states)."""

    name = "engine"

    def __init__(self, config: Any) -> None:
        """``config``: the run's resolved :class:`~fedtune.config.RunConfig`."""
        self.config = config

    @abstractmethod
    def transport(self) -> Transport:
        """The transport of this run (built on first use: Flower discovers its nodes here)."""

    def prepare(self, context: Any) -> None:
        """Before the first round, give the server's ``context`` (a RunContext) the budgets the nodes
        report (:meth:`~fedtune.runtime.RunContext.adopt`). Default: none; the plan reads the config's
        simulated nodes (``federation.profiles`` / ``device_classes``)."""

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint keeps for the engine beside the strategy's state (default: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state``, a :meth:`state_dict` (resume)."""

    def run(
        self,
        strategy: Strategy,
        on_round: Callable[[RoundRecord], None] | None = None,
        start_round: int = 1,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[RoundRecord]:
        """The rounds ``start_round..`` of ``strategy`` through this engine's transport
        (:func:`drive_rounds`, with ``on_round`` and ``should_stop``)."""
        c, fed = self.config, self.config.federation
        return drive_rounds(
            strategy,
            self.transport(),
            fed.num_clients,
            fed.sample_size(),
            c.rounds,
            c.seed,
            c.eval_every,
            on_round,
            start_round,
            RoundPolicy.of(c, c.privacy.mode != "none", strategy.context),
            should_stop,
        )
