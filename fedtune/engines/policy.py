"""How a round treats faults (:class:`RoundPolicy`, from ``federation.*``, the run's budgets and its
DP mechanism): why a client's reply may not be aggregated (errors, deadlines, size, metadata,
memory, arrays) and the screen of outsized training updates (without DP: against the others'
norms; under local DP: against what a clipped and noised upload can be)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedtune.engines.delivery import Delivery
from fedtune.engines.record import RoundRecord
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import beyond_bound, check_arrays, check_meta, outsized_updates


def measured_peak(got: Delivery) -> int | None:
    """The peak memory ``got``'s reply reports (its metadata's ``peak_bytes``): None unless the
    metadata is a mapping and the value an int of at least 0 (an untrusted reply may hold anything)."""
    meta = got.reply.meta if got.reply is not None else None
    peak = meta.get("peak_bytes") if isinstance(meta, Mapping) else None
    return peak if isinstance(peak, int) and not isinstance(peak, bool) and peak >= 0 else None


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
    privacy: Any = None  # the run's PrivacyParams under DP: its mechanism's bound on each upload

    @classmethod
    def of(cls, config: Any, private: bool = False, context: Any = None) -> RoundPolicy:
        """The policy of ``config`` (a RunConfig: ``federation.*``, ``robust.max_update_ratio``) and
        the budgets of ``context`` (a RunContext's ``round_limits``); ``private`` (DP): no
        outsized-update screen, whose reference would depend on the other clients' updates, but the
        mechanism's own bound on an upload (``upload_bound``: local DP's clipped and noised norm;
        the context's run's privacy parameters)."""
        fed, ratio = config.federation, config.robust.max_update_ratio
        ratio = None if private or not ratio else ratio
        limits = context.round_limits() if hasattr(context, "round_limits") else {}
        params = context.run.aggregation.privacy if private and hasattr(context, "run") else None
        policy = (fed.min_replies, fed.max_retries, fed.round_timeout_s, fed.max_reply_bytes, ratio)
        return cls(*policy, **limits, privacy=params)

    def screened(
        self, record: RoundRecord, replies: dict[int, Message], sent: dict[int, Message], attempt: int
    ) -> dict[int, Message]:
        """``replies`` less the outsized ones: beyond the DP mechanism's bound on an upload
        (:func:`~fedtune.protocol.validation.beyond_bound`), or, without DP, against the states
        ``sent`` (:func:`~fedtune.protocol.validation.outsized_updates`); each dropped in ``record``
        with its reason (prefixed with the ``attempt`` after the first). A private round's drops are
        private; the operator's console gets a note (:attr:`RoundRecord.notes`) of each."""
        if self.privacy is not None:
            params = self.privacy
            outsized = beyond_bound(replies, lambda d: params.kind.upload_bound(params, d))
        elif self.max_update_ratio is not None:
            outsized = outsized_updates(replies, sent, self.max_update_ratio)
        else:
            return replies
        for cid, reason in outsized.items():
            record.dropped[cid] = (f"attempt {attempt + 1}: " if attempt else "") + reason
            if record.private:
                record.notes.append(f"client {cid}'s upload dropped: {reason}")
        return {cid: reply for cid, reply in replies.items() if cid not in outsized}

    def rejection(
        self, strategy: Strategy, kind: str, rnd: int, cid: int, sent: Message | None, got: Delivery
    ) -> str | None:
        """Why ``got`` (client ``cid``'s reply of exchange ``kind`` in round ``rnd``, to the request
        ``sent``) may not be aggregated by ``strategy``, or None."""
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
        reason = check_meta(got.reply.meta, strategy.reply_meta_spec(kind, cid))  # the shape first, then read
        peak = measured_peak(got) if reason is None else None
        if peak is not None and peak > self.memory_bytes.get(cid, peak):
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
