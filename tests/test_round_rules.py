"""The round loop asks, it does not know (issue 53): ``drive_rounds`` runs each attempt of a round
as the strategy's :class:`~fedtune.protocol.strategy.RoundRules` say (its sample, the fewest
clients worth asking, the replies needed, retry, federated evaluation, a private record, a masked
exchange), and each rule has a control: the default rules do the opposite on the same clients."""

from __future__ import annotations

from typing import Any

import pytest

from fedtune.engines.rounds import EVALUATE, Delivery, RoundFailed, RoundPolicy, drive_rounds, sample_clients
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import RoundRules, Strategy

CLIENTS, PER_ROUND = 6, 2


class Unbounded:
    """The one member of a server context the round loop reads (through ``reply_meta_spec``): a
    bound on a reply's ``num_examples`` far above the 1 every reply here states."""

    def example_bound(self, kind: str, cid: int) -> int:
        return 1_000_000


class Probe(Strategy):
    """A strategy of no model that answers ``rules`` and records what the loop asked of it."""

    def __init__(self, rules: RoundRules) -> None:
        self.context: Any = Unbounded()
        self.rules = rules
        self.asked: list[list[int]] = []  # configure_fit's clients, per call
        self.aggregated: list[list[int]] = []  # aggregate_fit's replies, per call

    def round_rules(self, rnd: int, attempt: int) -> RoundRules:
        return self.rules

    def initialize(self) -> None:
        """Nothing to build."""

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        self.asked.append(list(client_ids))
        return {cid: Message({}, {"round": rnd}) for cid in client_ids}

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        self.aggregated.append(sorted(replies))
        return {}

    def configure_evaluate(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        return {cid: Message({}, {"round": rnd}) for cid in client_ids}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing held."""


def transport_of(answering: set[int], evaluated: list[int]):
    """Clients in ``answering`` reply to training; every other fails. Evaluation requests go to ``evaluated``."""

    def transport(kind: str, rnd: int, messages: dict[int, Message], attempt: int = 0) -> dict[int, Delivery]:
        if kind == EVALUATE:
            evaluated.extend(messages)
        out = {}
        for cid in messages:
            reply = Message({}, {"num_examples": 1})
            ok = cid in answering or kind == EVALUATE
            out[cid] = Delivery(reply, 1, 1, 0.0, cid, rnd) if ok else Delivery(None, 1, error="down")
        return out

    return transport


def drive(rules: RoundRules, answering: set[int], rounds: int = 1) -> tuple[Probe, list, list[int]]:
    probe, evaluated = Probe(rules), []
    history = drive_rounds(
        probe, transport_of(answering, evaluated), CLIENTS, PER_ROUND, rounds, seed=3, policy=RoundPolicy()
    )
    return probe, history, evaluated


def test_the_loop_samples_what_the_rules_draw_and_else_its_seeded_draw():
    probe, history, _ = drive(RoundRules(sample=[1, 4, 5]), set(range(CLIENTS)))
    assert probe.asked == [[1, 4, 5]] and history[0].clients == [1, 4, 5]
    control, history, _ = drive(RoundRules(), set(range(CLIENTS)))
    assert control.asked == [sample_clients(CLIENTS, PER_ROUND, 3, 1)] != [[1, 4, 5]]


def test_a_sample_below_the_rules_fewest_asks_nobody():
    probe, _, _ = drive(RoundRules(sample=[2], fewest=2, need=0), set(range(CLIENTS)))
    assert probe.asked == [[]] and probe.aggregated == [[]]
    control, _, _ = drive(RoundRules(sample=[2], need=0), set(range(CLIENTS)))
    assert control.asked == [[2]] and control.aggregated == [[2]]


def test_a_round_without_replies_aggregates_nothing_when_the_rules_need_none_and_forbid_a_retry():
    probe, history, _ = drive(RoundRules(need=0, may_retry=False), set())
    assert history[0].attempts == 1 and probe.aggregated == [[]]
    with pytest.raises(RoundFailed, match="after 3 attempts"):  # control: min_replies 1, two retries
        drive(RoundRules(), set())


def test_a_short_round_is_not_retried_when_the_rules_forbid_it():
    silent = sample_clients(CLIENTS, PER_ROUND, 3, 1)[0]  # one of round 1's first draw never answers
    answering = set(range(CLIENTS)) - {silent}
    probe, history, _ = drive(RoundRules(need=2, may_retry=False), answering)
    assert history[0].attempts == 1 and probe.aggregated == [[]]
    control, history, _ = drive(RoundRules(need=2), answering)  # retried with a fresh draw
    assert history[0].attempts > 1 and len(control.asked) == history[0].attempts


def test_federated_evaluation_runs_only_when_the_rules_allow_it():
    _, _, evaluated = drive(RoundRules(evaluate_federated=False), set(range(CLIENTS)))
    assert evaluated == []
    _, _, evaluated = drive(RoundRules(), set(range(CLIENTS)))
    assert evaluated == list(range(CLIENTS))


def test_a_private_round_releases_no_per_client_number():
    _, history, _ = drive(RoundRules(private=True), set(range(CLIENTS)))
    assert history[0].to_json() == {"round": 1, "private": True}
    _, history, _ = drive(RoundRules(), set(range(CLIENTS)))
    assert "clients" in history[0].to_json()


def test_masked_rules_need_a_transport_with_an_unmask_stage():
    with pytest.raises(RuntimeError, match="no unmask stage"):
        drive(RoundRules(masked=True), set(range(CLIENTS)))
    probe, _, _ = drive(RoundRules(), set(range(CLIENTS)))
    assert probe.aggregated == [sample_clients(CLIENTS, PER_ROUND, 3, 1)]
