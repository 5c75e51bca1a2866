"""A node's own budget on Flower (:mod:`fedtune.planning.node_report`): the report a node puts in its
answer to the server's first query, the server's plan from the reports and the setting each request
of a node-budgeted client carries, and on the node the client built from its budget and that
setting, or refused before anything is loaded when the budget cannot hold it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context

from fedtune.planning.node_report import (
    check_report,
    collect_reports,
    node_profile,
    node_report,
    setting_of,
    simulated_reports,
)

if TYPE_CHECKING:
    from fedtune.protocol.client import Client
    from fedtune.runtime import RunContext

BUDGET = "budget"  # ConfigRecord key of a query reply: the node's budget report (JSON of profile fields)
SETTING = "setting"  # ConfigRecord key of a request: the client's planned setting (JSON, node_report.setting_of)
STATE = "fedtune-budget"  # context.state key: the report the node answered the query with


class NodeRefusal(RuntimeError):
    """A node refuses a request whose setting its own budget cannot hold (the plan's reason)."""


# -- node side -----------------------------------------------------------------------------------
def report_entry(context: Context) -> dict[str, str]:
    """The query reply's budget entry (``{BUDGET: JSON}``; ``{}`` when the node states none): the report
    of the node whose Flower ``context`` this is, from its node config
    (:func:`~fedtune.planning.node_report.node_report`, measured fields measured now), kept in the
    node's state, so that its requests are held to what it reported."""
    report = node_report(context.node_config)
    if not report:
        return {}
    text = json.dumps(report)
    context.state[STATE] = ConfigRecord({BUDGET: text})
    return {BUDGET: text}


def request_budget(context: Context, envelope: Mapping[str, Any]) -> str | None:
    """What one request's client needs of its node's budget (for :func:`node_client`): JSON of the
    report of the node whose Flower ``context`` this is (as it answered the query, else from its node
    config now) and the setting the request's ``envelope`` carries; None when the node states no budget
    and the request carries no setting."""
    stored: Mapping[str, Any] | None = context.state.config_records.get(STATE)
    report = stored[BUDGET] if stored is not None else (json.dumps(node_report(context.node_config)) or None)
    setting = envelope.get(SETTING)
    if report in (None, "{}") and setting is None:
        return None
    return json.dumps({BUDGET: report, SETTING: setting})


def node_client(context: RunContext, cid: int, state: dict[str, Any], budget: str) -> Client:
    """Client ``cid`` of ``context`` with its ``state``, on a node with ``budget``
    (:func:`request_budget`'s JSON): its config profile with the node's own budget and the request's
    setting (:func:`~fedtune.planning.node_report.node_profile`); :class:`NodeRefusal` with the plan's
    reason, before any base is loaded, when that budget cannot hold that setting, or when the node's
    own report is malformed."""
    from fedtune.planning.planner import refusal

    spec = json.loads(budget)
    own: dict[str, float] = {}
    if spec.get(BUDGET) not in (None, "{}"):
        checked, reason = check_report(spec[BUDGET])
        if checked is None:
            raise NodeRefusal(f"this node's own {reason}")
        own = checked
    try:
        profile = node_profile(context.run.profiles[cid], own, spec.get(SETTING))
    except ValueError as exc:
        raise NodeRefusal(f"the request's {exc}") from None
    why = refusal(context, profile)
    if why is not None:
        raise NodeRefusal(f"refused by its node before loading anything: {why}")
    return context.client(cid, state, profile)


# -- server side ---------------------------------------------------------------------------------
def adopt_reports(context: RunContext, reported: Mapping[int, tuple[str, Any]]) -> dict[int, str]:
    """Plan ``context`` from the nodes' ``reported`` budgets (client id -> (node label, report as
    received); the other clients' from the config's simulated nodes) and return the setting each
    node-budgeted client the plan keeps is sent (client id -> JSON)."""
    raw: dict[int, tuple[str | None, Any]] = dict(simulated_reports(context.run.profiles))
    raw.update(reported)
    context.adopt(collect_reports(raw))
    plan = context.plan
    excluded = plan.excluded if plan is not None else {}
    return {
        cid: setting_of(profile)
        for cid, profile in enumerate(context.profiles)
        if cid in context.reports.node and cid not in excluded
    }
