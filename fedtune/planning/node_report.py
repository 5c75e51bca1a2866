"""Budgets where the devices are: what a node states of its own resources, the report the server
checks and plans from, and the setting the server sends back.

A Flower SuperNode states its budget in its own node config (``--node-config "memory-gib=8
bandwidth-mb=20 deadline-s=60 speed=0.5"``; ``fedtune deploy supernode --memory-gib 8 ...``), or
has it measured when it first answers (``measure-memory=true``: the memory available now;
``measure-speed=true``: a short float32 product timed against the planner's reference FLOP/s,
:func:`probe_speed`). It reports the budget in its answer to the server's first query
(:func:`node_report`), as profile fields. The server trusts nothing it reads there:
:func:`check_report` accepts only the budget fields, each a real positive finite number; a node
whose report fails (negative, NaN, a string, a list, an unknown field) has it dropped with that
reason, and its clients are excluded from the plan with it (:func:`collect_reports`).

One planning path for every engine: the planner reads each client's budget from its node's
report (:func:`apply_reports`); a client whose node states none keeps its profile's budget from
the config (``federation.profiles`` / ``device_classes``: the simulated nodes of the embedded
engine and ``flower-sim``, :func:`simulated_reports`). A reported budget replaces every budget
field of the client's profile, and its device class becomes the node's. The server sends each
node-budgeted client its planned setting (:data:`SETTING_FIELDS`, :func:`setting_of`); the node
rebuilds the client's profile from its config's, its own budget and that setting
(:func:`node_profile`) and refuses, before it loads anything, a setting its budget cannot hold
(:func:`fedtune.planning.planner.refusal`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from pydantic import ValidationError

from fedtune.protocol.profiles import BUDGET_FIELDS, ClientProfile

#: node-config key -> the profile field it states
NODE_KEYS = {"memory-gib": "memory_gib", "bandwidth-mb": "bandwidth_mb", "deadline-s": "deadline_s", "speed": "speed"}
#: node-config keys that measure a field when the node first answers, instead of stating it
MEASURE_KEYS = {"measure-memory": "memory_gib", "measure-speed": "speed"}
#: the profile fields the planner sets: the setting a node-budgeted client is sent
SETTING_FIELDS = (
    "rank",
    "sketch_ratio",
    "capacity",
    "trains_on",
    "quantization",
    "dtype",
    "gradient_checkpointing",
    "upload_topk",
    "wire_dtype",
)
GIB = 2**30


def node_report(node_config: Mapping[str, Any]) -> dict[str, Any]:
    """The budget a node states in its ``node_config``, as profile fields, values as given (the
    server checks them), the fields it is asked to measure measured now; ``{}`` when it states none."""
    out = {NODE_KEYS[k]: v for k, v in node_config.items() if k in NODE_KEYS}
    for key, name in MEASURE_KEYS.items():
        if node_config.get(key) is True and name not in out:
            out[name] = round(available_gib(), 3) if name == "memory_gib" else round(probe_speed(), 3)
    return out


def available_gib() -> float:
    """The memory this machine has available now (GiB): what a node measuring its memory states."""
    import psutil

    return float(psutil.virtual_memory().available) / GIB


def probe_speed(width: int = 576, seconds: float = 0.2) -> float:
    """This machine's speed relative to the planner's speed-1 client: the FLOP/s of float32 products
    of ``width`` (SmolLM2-135M's hidden width) over ``seconds`` of wall time, best of three, over
    :data:`~fedtune.planning.speed.FLOPS`' float32 entry at that width."""
    import torch

    from fedtune.planning.speed import FLOPS, at_width

    a, b = torch.randn(width, width), torch.randn(width, width)
    best = 0.0
    for _ in range(3):
        start, count = time.perf_counter(), 0
        while time.perf_counter() - start < seconds / 3:
            torch.mm(a, b)
            count += 1
        best = max(best, 2 * width**3 * count / (time.perf_counter() - start))
    return best / at_width(FLOPS[("float32", "float32")], width)


def check_report(report: Any) -> tuple[dict[str, float] | None, str | None]:
    """A node's budget ``report`` as received (a mapping, or its JSON text): (its fields as floats,
    None), or (None, why it is refused): anything but a mapping of :data:`BUDGET_FIELDS` to real,
    positive, finite numbers. Never raises."""
    if isinstance(report, (str, bytes)):
        try:
            report = json.loads(report)
        except ValueError as exc:
            return None, f"budget report is not JSON ({exc})"
    if not isinstance(report, Mapping):
        return None, f"budget report is a {type(report).__name__}, expected a mapping of budget fields"
    out = {}
    for key, value in report.items():
        if key not in BUDGET_FIELDS:
            return None, f"budget report names {str(key)!r:.40}; expected some of {', '.join(BUDGET_FIELDS)}"
        number = isinstance(value, Real) and not isinstance(value, bool)
        if not number or not math.isfinite(float(value)) or value <= 0:
            return None, f"budget report {key} = {value!r:.40}: expected a positive finite number"
        out[key] = float(value)
    return out, None


@dataclass
class Reports:
    """What the server's plan reads of the nodes: client id -> its node's checked budget
    (``budgets``), client id -> why its node's report was dropped (``dropped``), client id -> the
    label of the node that reported for it (``node``; absent: the config's simulated node)."""

    budgets: dict[int, dict[str, float]] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    node: dict[int, str] = field(default_factory=dict)


def simulated_reports(profiles: Sequence[ClientProfile]) -> dict[int, tuple[str | None, dict[str, Any]]]:
    """The reports of the simulated nodes: each client whose config profile states a budget reports
    its budget fields, from no real node (None)."""
    return {
        cid: (None, {k: getattr(p, k) for k in BUDGET_FIELDS if getattr(p, k) is not None})
        for cid, p in enumerate(profiles)
        if any(getattr(p, k) is not None for k in ("memory_gib", "bandwidth_mb", "deadline_s"))
    }


def collect_reports(raw: Mapping[int, tuple[str | None, Any]]) -> Reports:
    """:class:`Reports` from ``raw``: client id -> (its node's label, None for a simulated node;
    the report as received), each checked by :func:`check_report`."""
    out = Reports()
    for cid, (node, report) in raw.items():
        budget, reason = check_report(report)
        if node is not None:
            out.node[cid] = node
        if reason is not None:
            out.dropped[cid] = f"{node or 'its node'}'s {reason}; reply dropped"
        else:
            assert budget is not None
            out.budgets[cid] = budget
    return out


def apply_reports(profiles: Sequence[ClientProfile], reports: Reports) -> list[ClientProfile]:
    """``profiles`` with each reported client's budget fields replaced by its node's report (a
    field it does not state unset, speed 1), its device class the node's label."""
    out = list(profiles)
    for cid, budget in reports.budgets.items():
        if cid not in reports.node:  # a simulated node: the config's own budget
            continue
        fields = {k: budget.get(k, 1.0 if k == "speed" else None) for k in BUDGET_FIELDS}
        out[cid] = out[cid].model_copy(update={**fields, "device_class": reports.node[cid]})
    return out


def setting_of(profile: ClientProfile) -> str:
    """The planned ``profile``'s setting (:data:`SETTING_FIELDS` it states) as the JSON a request carries."""
    return json.dumps({k: getattr(profile, k) for k in SETTING_FIELDS if getattr(profile, k) is not None})


def node_profile(profile: ClientProfile, budget: Mapping[str, float], setting: Any) -> ClientProfile:
    """The client's ``profile`` on its node: its config profile with the node's own ``budget`` (every
    budget field; checked) and the server's ``setting`` (:func:`setting_of`'s JSON, or None); a
    setting that is not JSON of :data:`SETTING_FIELDS` with valid values is a ValueError naming it."""
    fields = {k: budget.get(k, 1.0 if k == "speed" else None) for k in BUDGET_FIELDS} if budget else {}
    if setting is not None:
        try:
            asked = json.loads(setting)
        except (TypeError, ValueError):
            raise ValueError(f"setting {setting!r:.60} is not JSON") from None
        if not isinstance(asked, dict) or not set(asked) <= set(SETTING_FIELDS):
            raise ValueError(f"setting {setting!r:.60}: expected a mapping of {', '.join(SETTING_FIELDS)}")
        fields.update(asked)
    try:
        return ClientProfile(**{**profile.model_dump(), **fields})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise ValueError(f"setting {where}: {err['msg']} (got {err.get('input')!r:.40})") from None
