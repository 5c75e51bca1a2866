"""The round loop every engine runs (:func:`drive_rounds`): seeded client sampling, a
Strategy's configure / aggregate calls, reply validation, drops and retries, and per-round
records with the bytes that crossed. An engine supplies only a :data:`Transport` that delivers a
round's Messages to clients and brings back one :class:`Delivery` per client.

Faults (both engines). A client that raises, misses the round's deadline
(``federation.round_timeout_s``) or never answers is *dropped* for that round, and so is a
reply that fails validation: the wrong client id or round, larger than
``federation.max_reply_bytes``, metadata other than :meth:`Strategy.reply_meta_spec` declares
(types, ranges, finite numbers: a client's ``num_examples`` is at most what the server knows of
it), or arrays other than :meth:`Strategy.reply_spec` expects (names, shapes, dtypes, finite
values; :mod:`fedtune.protocol.validation`), and so is a training reply whose norm exceeds
``federation.max_update_ratio`` times the round's reference (not under DP). Dropped replies never
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

Fault injection for tests and benchmarks: profile fields ``failure_prob`` (a client fails a
request with that probability, drawn from (seed, round, client, attempt)), ``delay_s`` (it
waits that long before answering) and ``attack`` (a hostile client: every floating array of its
training reply sign-flipped, or scaled by ``attack_scale``; clients reply with updates, so this
is the update), applied on the client side by :func:`answer`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fedtune.errors import FedtuneError
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SECURE_LAYOUT, SecureSum, Strategy
from fedtune.protocol.validation import check_arrays, check_meta, outsized_updates


def sample_clients(num_clients: int, sample_size: int, seed: int, rnd: int, attempt: int = 0) -> list[int]:
    """Clients of round ``rnd``: uniform without replacement, from (seed, round, attempt) alone."""
    if sample_size >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, rnd, 0x5A] if attempt == 0 else [seed, rnd, 0x5A, attempt])
    return sorted(int(c) for c in rng.choice(num_clients, size=sample_size, replace=False))


TRAIN, EVALUATE = "train", "evaluate"  # transport kinds; any other kind is a Strategy phase


class InjectedFailure(RuntimeError):
    """A failure injected by the client's profile (``failure_prob``)."""


def answer(client: Client, kind: str, message: Message, seed: int, rnd: int, attempt: int = 0) -> Message:
    """Serve one request on the client side, as every engine does: the profile's injected delay
    and failure first, then ``fit`` ("train"), ``evaluate``, or the named phase. Under secure
    aggregation (the request names a ``secure_layout``) a training reply's arrays become the vector
    the client masks (:meth:`Client.secure_reply`)."""
    profile = client.profile
    if profile.delay_s:
        time.sleep(profile.delay_s)
    if (
        profile.failure_prob
        and np.random.default_rng([seed, rnd, client.cid, attempt, 0xFA11]).random() < profile.failure_prob
    ):
        raise InjectedFailure(f"injected failure (failure_prob {profile.failure_prob})")
    if kind == TRAIN:
        if profile.memory_gib is not None or profile.gradient_checkpointing:  # measured; planned checkpointing
            from fedtune.planning.planner import metered_fit

            reply = metered_fit(client, message)
        else:
            reply = client.fit(message)
        reply = attacked(reply, profile.attack, profile.attack_scale) if profile.attack else reply
        return client.secure_reply(message, reply) if SECURE_LAYOUT in message.meta else reply
    if kind == EVALUATE:
        return client.evaluate(message)
    if profile.memory_gib is not None:  # a phase of the round's training (RABO's hypergradient): measured too
        from fedtune.planning.planner import metered_fit

        return metered_fit(client, message, partial(client.phase, kind))
    return client.phase(kind, message)


def attacked(reply: Message, attack: str, scale: float) -> Message:
    """``reply`` with every floating array sign-flipped (``"sign-flip"``) or times ``scale``
    (``"scale"``); integer arrays (top-k indices) and the metadata as they are."""
    factor = -1.0 if attack == "sign-flip" else scale
    arrays = {
        k: (v * factor).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v for k, v in reply.arrays.items()
    }
    return Message(arrays, reply.meta)


@dataclass
class Delivery:
    """One client's answer to one message, as the transport saw it."""

    reply: Message | None  # None when the client failed or never answered
    down: int  # bytes sent to the client
    up: int = 0  # bytes it sent back
    seconds: float = 0.0  # its compute time
    sender: int | None = None  # the client id the reply claims
    round: int | None = None  # the round the reply claims
    error: str | None = None  # why there is no reply
    masked: bool = False  # the reply's arrays crossed masked (secure aggregation): only its meta is checked here


class Transport(Protocol):
    """What an engine gives the round loop: ``transport(kind, rnd, messages, attempt)`` delivers
    ``messages`` (client id -> Message) as ``kind`` ("train", "evaluate" or a Strategy phase name)
    and returns client id -> Delivery for every message, in the order of ``messages``
    (aggregation sums in that order)."""

    def __call__(self, kind: str, rnd: int, messages: dict[int, Message], attempt: int) -> dict[int, Delivery]:
        """One exchange's deliveries (see the class docstring)."""
        ...


@runtime_checkable
class SecureTransport(Transport, Protocol):
    """A transport that masks the training replies (secure aggregation,
    :mod:`fedtune.engines.flower.secagg`): its training deliveries carry metadata only
    (``Delivery.masked``), and the round aggregates the sum of the valid ones' updates
    (:meth:`Strategy.aggregate_secure_fit`), which :meth:`unmask` rebuilds."""

    def unmask(
        self, rnd: int, attempt: int, client_ids: list[int], sent: dict[int, Message]
    ) -> tuple[SecureSum | None, dict[int, Delivery]]:
        """The sum of the masked updates of ``client_ids`` (None when it cannot be rebuilt) and
        the unmask exchange's deliveries."""
        ...


@dataclass(frozen=True)
class RoundPolicy:
    """How a round treats faults (``federation.*``)."""

    min_replies: int = 1
    max_retries: int = 2
    timeout_s: float | None = None
    max_reply_bytes: int = 256 * 2**20
    max_update_ratio: float | None = None  # None: no outsized-update screen
    memory_bytes: dict[int, int] = field(default_factory=dict)  # client -> its memory budget
    deadlines: dict[int, float] = field(default_factory=dict)  # client -> its deadline_s
    excluded: dict[int, str] = field(default_factory=dict)  # client -> why the plan excluded it

    @classmethod
    def of(cls, fed: Any, private: bool = False, context: Any = None) -> RoundPolicy:
        """The policy of ``fed`` (``federation.*``) and the budgets of ``context`` (a RunContext's
        ``round_limits``); ``private`` (DP): no outsized-update screen, whose reference would
        depend on the other clients' updates (DP clipping bounds them)."""
        ratio = None if private or not fed.max_update_ratio else fed.max_update_ratio
        limits = context.round_limits() if hasattr(context, "round_limits") else {}
        return cls(fed.min_replies, fed.max_retries, fed.round_timeout_s, fed.max_reply_bytes, ratio, **limits)

    def screened(
        self, record: RoundRecord, replies: dict[int, Message], sent: dict[int, Message], attempt: int
    ) -> dict[int, Message]:
        """``replies`` less the outsized ones (:func:`~fedtune.protocol.validation.outsized_updates`),
        each dropped in ``record`` with its reason."""
        if self.max_update_ratio is None:
            return replies
        outsized = outsized_updates(replies, sent, self.max_update_ratio)
        for cid, reason in outsized.items():
            record.dropped[cid] = (f"attempt {attempt + 1}: " if attempt else "") + reason
        return {cid: reply for cid, reply in replies.items() if cid not in outsized}

    def rejection(
        self, strategy: Strategy, kind: str, rnd: int, cid: int, sent: Message | None, got: Delivery
    ) -> str | None:
        """Why ``got`` (a reply of exchange ``kind``) may not be aggregated, or None."""
        if got.error is not None:
            return got.error
        if got.reply is None:
            return "no reply"
        if got.sender != cid:
            return f"reply claims to come from client {got.sender}"
        if got.round != rnd:
            return f"reply claims round {got.round}"
        if self.timeout_s is not None and got.seconds > self.timeout_s:
            return f"missed the {self.timeout_s:g} s deadline ({got.seconds:.2f} s)"
        if cid in self.deadlines and got.seconds > self.deadlines[cid]:
            return f"missed its deadline_s = {self.deadlines[cid]:g} ({got.seconds:.2f} s)"
        if got.up > self.max_reply_bytes:
            return f"reply of {got.up} bytes exceeds federation.max_reply_bytes = {self.max_reply_bytes}"
        reason = check_meta(got.reply.meta, strategy.reply_meta_spec(kind, cid))
        peak = got.reply.meta.get("peak_bytes")
        if reason is None and peak is not None and peak > self.memory_bytes.get(cid, peak):
            reason = (
                f"simulated out-of-memory: measured peak {peak / 2**30:.3g} GiB over its memory_gib "
                f"{self.memory_bytes[cid] / 2**30:.3g}"
            )
        if reason is not None or got.masked:  # a masked update is checked as part of the sum
            return reason
        spec = strategy.reply_spec(rnd, cid, sent) if sent is not None else None
        if isinstance(spec, list):  # alternative forms (a client that may prune its rank, say)
            reasons = [check_arrays(got.reply.arrays, s) for s in spec]
            return None if None in reasons else reasons[0]
        return check_arrays(got.reply.arrays, spec)


class RoundFailed(FedtuneError, RuntimeError):
    """A round stayed short of ``federation.min_replies`` valid replies after every retry, or its
    aggregation was rejected."""

    exit_code = 1


@dataclass
class RoundRecord:
    round: int
    clients: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    client_bytes_up: dict[int, int] = field(default_factory=dict)
    client_bytes_down: dict[int, int] = field(default_factory=dict)
    client_steps: dict[int, int] = field(default_factory=dict)
    client_compute_s: dict[int, float] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)  # client -> why (every attempt of the round)
    attempts: int = 1
    eval_bytes: int = 0
    wall_s: float = 0.0
    private: bool = False  # a round under client-level DP: its line releases no per-client number
    client_peak_bytes: dict[int, int] = field(default_factory=dict)  # measured (clients with a memory budget)
    client_memory_budget_bytes: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line for this round: the record's own fields, and the metrics
        between them; a metric named like a field (a strategy passing on what clients reported)
        never replaces the engine's accounting. A private round's line is only what the privacy
        mechanism releases: the round, the metrics (the server's evaluation of the released state,
        epsilon) and ``"private": true``; not the sample, bytes, timings, steps or drops, which
        depend on who was sampled and on their data."""
        if self.private:
            return {"round": self.round, **{k: v for k, v in self.metrics.items() if k != "private"}, "private": True}
        own = {
            "round": self.round,
            "accuracy": self.metrics.get("accuracy"),
            "loss": self.metrics.get("loss"),
            "bytes_up": sum(self.client_bytes_up.values()),
            "bytes_down": sum(self.client_bytes_down.values()),
            "eval_bytes": self.eval_bytes,
            "wall_s": self.wall_s,
            "compute_s": sum(self.client_compute_s.values()),
            "clients": self.clients,
        }
        tail = {
            "client_bytes_up": {str(k): v for k, v in self.client_bytes_up.items()},
            "client_bytes_down": {str(k): v for k, v in self.client_bytes_down.items()},
            "client_steps": {str(k): v for k, v in self.client_steps.items()},
            "client_compute_s": {str(k): round(v, 4) for k, v in self.client_compute_s.items()},
            "dropped": {str(k): v for k, v in self.dropped.items()},  # on every line, {} when none was
            "attempts": self.attempts,
        }
        if self.client_peak_bytes:  # only runs with memory budgets
            tail["client_peak_bytes"] = {str(k): v for k, v in self.client_peak_bytes.items()}
            tail["client_memory_budget_bytes"] = {str(k): v for k, v in self.client_memory_budget_bytes.items()}
        metrics = {k: v for k, v in self.metrics.items() if k not in own and k not in tail}
        return {**own, **metrics, **tail}

    #: The keys of a :meth:`to_json` line that are the record's own fields (the rest are metrics).
    FIELDS = (
        "round",
        "bytes_up",
        "bytes_down",
        "eval_bytes",
        "wall_s",
        "compute_s",
        "clients",
        "client_bytes_up",
        "client_bytes_down",
        "client_steps",
        "client_compute_s",
        "client_peak_bytes",
        "client_memory_budget_bytes",
        "dropped",
        "attempts",
    )

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> RoundRecord:
        """The record of a ``metrics.jsonl`` line (:meth:`to_json`'s inverse; the per-client
        totals are recomputed from the per-client maps, and a metric that was None is left out)."""

        def by_client(key: str) -> dict[int, Any]:
            return {int(k): v for k, v in (line.get(key) or {}).items()}

        return cls(
            round=int(line["round"]),
            clients=[int(c) for c in line.get("clients", [])],
            metrics={k: v for k, v in line.items() if k not in (*cls.FIELDS, "private") and v is not None},
            client_bytes_up=by_client("client_bytes_up"),
            client_bytes_down=by_client("client_bytes_down"),
            client_steps=by_client("client_steps"),
            client_compute_s=by_client("client_compute_s"),
            client_peak_bytes=by_client("client_peak_bytes"),
            client_memory_budget_bytes=by_client("client_memory_budget_bytes"),
            dropped=by_client("dropped"),
            attempts=int(line.get("attempts", 1)),
            eval_bytes=int(line.get("eval_bytes", 0)),
            wall_s=float(line.get("wall_s", 0.0)),
            private=bool(line.get("private", False)),
        )


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
    valid = {}
    for cid, got in transport(kind, rnd, sent, attempt).items():
        record.client_bytes_down[cid] = record.client_bytes_down.get(cid, 0) + got.down
        record.client_bytes_up[cid] = record.client_bytes_up.get(cid, 0) + got.up
        record.client_compute_s[cid] = record.client_compute_s.get(cid, 0.0) + got.seconds
        reason = policy.rejection(strategy, kind, rnd, cid, sent[cid], got)
        peak = got.reply.meta.get("peak_bytes") if got.reply is not None else None
        if isinstance(peak, int) and cid in policy.memory_bytes:
            record.client_peak_bytes[cid] = max(peak, record.client_peak_bytes.get(cid, 0))
            record.client_memory_budget_bytes[cid] = policy.memory_bytes[cid]
        if reason is None:
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


def _aggregated(rnd: int, kind: str, aggregate: Callable[..., dict[str, float]], replies, *phase) -> dict[str, float]:
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
    unmask: Callable[..., tuple[SecureSum | None, dict[int, Delivery]]],
    record: RoundRecord,
    rnd: int,
    attempt: int,
    replies: dict[int, Message],
    sent: dict[int, Message],
) -> SecureSum | None:
    """Secure aggregation's last exchange: the sum of the masked updates of ``replies`` (the
    valid ones; every other client's masks are removed), or None when it cannot be rebuilt (the
    round is retried). Its bytes and drops go to ``record``."""
    total, deliveries = unmask(rnd, attempt, sorted(replies), sent)
    for cid, got in deliveries.items():
        record.client_bytes_down[cid] = record.client_bytes_down.get(cid, 0) + got.down
        record.client_bytes_up[cid] = record.client_bytes_up.get(cid, 0) + got.up
        if got.error is not None:
            record.dropped[cid] = (f"attempt {attempt + 1}: " if attempt else "") + f"unmask: {got.error}"
    return total


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
    checkpoint there); ``should_stop()`` is asked after each round (Ctrl-C)."""
    history = []
    unmask = transport.unmask if isinstance(transport, SecureTransport) else None
    for rnd in range(start_round, rounds + 1):
        reason = strategy.halt_before(rnd)
        if reason is not None:
            raise RunHalted(reason, rnd - 1)
        start = time.perf_counter()
        record = RoundRecord(rnd, [])
        total = None
        for attempt in range(policy.max_retries + 1):
            record.attempts = attempt + 1
            secret = strategy.private_sample(rnd, attempt)
            record.private = secret is not None
            clients = secret if record.private else sample_clients(num_clients, sample_size, seed, rnd, attempt)
            secure = unmask is not None
            if record.private and secure and len(clients) < 2:
                clients = []  # a sum of one update is that update: the round releases noise alone
            record.dropped.update({c: policy.excluded[c] for c in clients if c in policy.excluded})
            clients = [c for c in clients if c not in policy.excluded]
            record.clients = sorted(set(record.clients) | set(clients))
            sent = strategy.configure_fit(rnd, clients)
            replies = _exchange(strategy, transport, policy, record, TRAIN, sent, rnd, attempt)
            if not secure:  # masked replies carry no arrays to measure
                replies = policy.screened(record, replies, sent, attempt)
            need = 0 if record.private else policy.min_replies  # DP: missing replies are zero updates
            if len(replies) >= need:
                if not secure or not clients:
                    break
                total = _unmasked(unmask, record, rnd, attempt, replies, sent)
                if total is not None and len(total.clients) >= need:
                    replies = {cid: replies[cid] for cid in total.clients}
                    break
            if record.private:  # never retried: a fresh sample would condition the first on failing
                replies = {}
                break
        else:
            raise RoundFailed(
                f"round {rnd}: fewer than federation.min_replies = {policy.min_replies} valid replies after "
                f"{policy.max_retries + 1} attempts; drops: {record.dropped}"
            )
        if total is None:
            record.metrics.update(_aggregated(rnd, TRAIN, strategy.aggregate_fit, replies))
        else:
            secure_fit = partial(strategy.aggregate_secure_fit, total=total)
            record.metrics.update(_aggregated(rnd, TRAIN, secure_fit, replies))
        for phase in strategy.phases(rnd):  # further exchanges, with the clients still answering
            sent = strategy.configure_phase(phase, rnd, sorted(replies))
            replies = _exchange(strategy, transport, policy, record, phase, sent, rnd, 0)
            if len(replies) < policy.min_replies:
                raise RoundFailed(
                    f"round {rnd}, phase {phase!r}: fewer than federation.min_replies = {policy.min_replies} "
                    f"valid replies; drops: {record.dropped}"
                )
            record.metrics.update(_aggregated(rnd, phase, strategy.aggregate_phase, replies, phase))
        where = first_nonfinite(strategy.state_dict())
        if where is not None:
            raise RoundFailed(
                f"round {rnd}: the aggregated global state is not finite ({where}); nothing of this round is kept"
            )
        if rnd % eval_every == 0 or rnd == rounds:
            record.metrics.update(strategy.evaluate(rnd))
            if not np.isfinite(record.metrics.get("loss", 0.0)):  # every client would fail on this state
                raise RoundFailed(
                    f"round {rnd}: the aggregated global state evaluates to a non-finite loss; nothing of this "
                    "round is kept"
                )
            # federated evaluation reports on the clients' data, outside what DP accounts for
            eval_messages = {} if record.private else strategy.configure_evaluate(rnd, list(range(num_clients)))
            eval_replies = {}
            for cid, got in transport(EVALUATE, rnd, eval_messages, 0).items():
                record.eval_bytes += got.down + got.up
                reason = policy.rejection(strategy, EVALUATE, rnd, cid, None, got)
                if reason is None:
                    eval_replies[cid] = got.reply
                else:
                    record.dropped.setdefault(cid, f"evaluation: {reason}")
            if eval_replies:
                record.metrics.update(_aggregated(rnd, EVALUATE, strategy.aggregate_evaluate, eval_replies))
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
        super().__init__(f"interrupted after round {rnd}")
        self.round = rnd


class RunHalted(Exception):
    """The strategy stopped the run before round ``round + 1`` (:meth:`Strategy.halt_before`);
    rounds up to ``round`` are complete and checkpointed."""

    def __init__(self, reason: str, rnd: int) -> None:
        super().__init__(reason)
        self.round = rnd


class Engine(ABC):
    """What runs a run's rounds: a transport to the clients, plus whatever state the checkpoint
    must keep beside the strategy's (the embedded engine's client states)."""

    name = "engine"

    def __init__(self, config: Any) -> None:
        self.config = config

    @abstractmethod
    def transport(self) -> Transport:
        """The transport of this run (built on first use: Flower discovers its nodes here)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (resume)."""

    def run(
        self,
        strategy: Strategy,
        on_round: Callable[[RoundRecord], None] | None = None,
        start_round: int = 1,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> list[RoundRecord]:
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
            RoundPolicy.of(fed, c.privacy.mode != "none", strategy.context),
            should_stop,
        )
