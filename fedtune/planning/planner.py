"""Each client's setting from its budget, before anything trains; and the measured peak of its fit.

A client has a budget when its profile states ``memory_gib``, ``bandwidth_mb`` or ``deadline_s``
(``speed`` scales its predicted seconds). Each method carries its own plan
(:class:`~fedtune.planning.spec.PlanSpec`, registered with the method): the profile field a client
varies (its knob: a LoRA method's rank or sketch ratio, :mod:`fedtune.planning.lora_plan`; a
sub-model method's capacity; a proxy method's ``trains_on``; or none: one setting or nothing) and
its cost model, which prices each setting's peak memory, the seconds of a round's local steps at
the client's speed and the values it uploads. The planner names no method: it searches any
method's knob the same way, largest value first, and gives each client the first setting that
fits every budget it states. A client that states its knob (``rank``, ``sketch_ratio``,
``capacity``, ``trains_on``) keeps it and the run measures it. A client that no setting fits is
excluded, with the reason of the smallest setting, and every round drops it with that reason; a
method that registers no plan gets one line (ConfigError) when a client states a budget.

At each value of the knob, largest first, a client over its memory budget is tried with gradient
checkpointing (it costs time, about a third more compute, and no accuracy), then on an 8-bit and a
4-bit base (``federation.profiles[i].quantization``; where the knob prices base formats: the
method honours ``model.quantization`` and bitsandbytes is installed; a profile that states it keeps
it), each without and with checkpointing, and only then at the next smaller value: quantization
changes the model the client trains on, but the base's weights are most of a client's peak, while a
smaller rank saves only the adapter's share (a few percent) and shrinks what the client contributes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import TYPE_CHECKING

import torch

from fedtune.config import ConfigError
from fedtune.models.precision import DTYPES
from fedtune.planning.lora_plan import CHECKPOINTING
from fedtune.planning.spec import Knob, PlanningContext, PlanSpec
from fedtune.protocol.messages import Message
from fedtune.protocol.profiles import ClientProfile
from fedtune.steps import track

if TYPE_CHECKING:
    from fedtune.protocol.client import Client


#: the key of a training reply's metadata with the client's measured peak bytes
PEAK_BYTES = "peak_bytes"
MB = 1e6  # MB per round: 10^6 bytes
GIB = 2**30


def planned_methods() -> list[str]:
    """The registered methods that carry a plan (``register(..., plan=...)``), by name."""
    from fedtune.methods import list_methods

    return [m.name for m in list_methods() if m.plan is not None]


def has_budget(profile: ClientProfile) -> bool:
    return any(getattr(profile, k) is not None for k in ("memory_gib", "bandwidth_mb", "deadline_s"))


@dataclass
class ClientPlan:
    cid: int
    device_class: str | None
    setting: str  # what the client trains with ("rank 8", "sketch ratio 0.25")
    peak_bytes: int
    seconds: float  # a round's local steps at the client's speed
    upload_mb: float
    excluded: str | None = None  # why no setting fits
    stated: bool = False  # the profile states the knob: kept, measured in the run
    over: str | None = None  # a stated setting's predicted breach of its budget


@dataclass
class Plan:
    clients: list[ClientPlan]
    profiles: list[ClientProfile]  # with each client's planned knob
    excluded: dict[int, str] = field(default_factory=dict)
    speed_note: str = ""  # what the predicted seconds assume (:func:`fedtune.planning.speed.reference`)
    note: str = ""  # what the plan leaves out of the profiles (capacities a full-model method ignores)


def _violation(profile: ClientProfile, peak: int, seconds: float, upload_mb: float) -> str | None:
    """The first budget ``profile`` states that the prediction breaks, or None."""
    if profile.memory_gib is not None and peak > profile.memory_gib * GIB:
        return f"predicted peak {peak / GIB:.3g} GiB > memory_gib {profile.memory_gib:g}"
    if profile.deadline_s is not None and seconds > profile.deadline_s:
        return f"predicted {seconds:.3g} s per round > deadline_s {profile.deadline_s:g}"
    if profile.bandwidth_mb is not None and upload_mb > profile.bandwidth_mb:
        return f"predicted upload {upload_mb:.3g} MB per round > bandwidth_mb {profile.bandwidth_mb:g}"
    return None


def _plan_of(method) -> PlanSpec:
    """``method``'s plan (a :class:`~fedtune.registry.MethodSpec`); ConfigError when it registers none."""
    if method.plan is None:
        raise ConfigError(
            f"federation: client budgets are planned for {', '.join(planned_methods())}; "
            f"method {method.name!r} has no planner"
        )
    return method.plan


def check_plannable(run) -> None:
    """At resolve time (before anything is read or written): client budgets only for a method the
    planner covers (ConfigError otherwise); ``run``: a :class:`~fedtune.runtime.ResolvedRun`."""
    if any(has_budget(p) for p in run.profiles):
        _plan_of(run.method)


def unrunnable(plan: Plan | None, min_replies: int) -> str | None:
    """Why no round of a run planned as ``plan`` can aggregate (every client excluded, or fewer
    left than ``min_replies``, ``federation.min_replies``), or None; decided before the run folder
    is claimed."""
    if plan is None or not plan.excluded:
        return None
    left = len(plan.profiles) - len(plan.excluded)
    if left >= max(1, min_replies):
        return None
    cid, why = next(iter(plan.excluded.items()))
    return (
        f"federation: the budget plan excludes {len(plan.excluded)} of {len(plan.profiles)} clients, leaving "
        f"{left} (federation.min_replies = {min_replies}); client {cid} {why}: raise the budgets "
        "(fedtune plan shows what each client needs)"
    )


def price_run(context: PlanningContext) -> tuple[str | None, Knob, str]:
    """The run's knob (the profile field the plan sets; None: none), its :class:`Knob` (ladder and
    prices, by the method's own cost model: its :class:`~fedtune.planning.spec.PlanSpec`) and the
    plan's note; ConfigError for a method that registers no plan. The context keeps it
    (:attr:`~fedtune.planning.spec.PlanningContext.pricing`)."""
    spec = _plan_of(context.method)
    knobs, note = spec.price(context)
    return spec.knob, knobs, note


def plan_budgets(context: PlanningContext, always: bool = False) -> Plan | None:
    """The plan of ``context``'s run (a :class:`~fedtune.runtime.RunContext`; each client's budget as
    its node reports it, :attr:`~fedtune.runtime.RunContext.budgeted_profiles`), or None when no
    client states a budget and no node's report was dropped (``always``: the predictions all the
    same); ConfigError for a method that registers no plan."""
    profiles = context.budgeted_profiles
    dropped = dict(context.reports.dropped)
    if not always and not dropped and not any(has_budget(p) for p in profiles):
        return None
    knob, knobs, note = context.pricing
    price = cache(knobs.cost)  # each (value, checkpointing, format) priced once for all clients
    rows = [
        _dropped(cid, p, dropped[cid]) if cid in dropped else _plan_client(context, knob, knobs, price, cid, p)
        for cid, p in track(enumerate(profiles), f"planning {len(profiles)} clients", len(profiles), "clients")
    ]
    clients = [c for c, _ in rows]
    excluded = {c.cid: c.excluded for c in clients if c.excluded is not None}
    return Plan(clients, [p for _, p in rows], excluded, knobs.speed_note, note)


@dataclass(frozen=True)
class _Candidate:
    """One setting the search tries: the knob's value, checkpointing, base format and upload codec,
    its prediction, seconds at the client's speed and upload MB, and the budget it breaks (None: fits)."""

    value: object
    checkpointing: bool
    fmt: tuple[str, str] | None
    codec: tuple[float | None, str]
    peak: int
    seconds: float
    upload: float
    reason: str | None


def _dropped(cid: int, profile: ClientProfile, why: str) -> tuple[ClientPlan, ClientProfile]:
    """A client whose node's report failed the check: excluded, nothing priced."""
    return ClientPlan(cid, profile.device_class, "-", 0, 0.0, 0.0, f"excluded: {why}"), profile


def _plan_client(
    context: PlanningContext, knob: str | None, knobs: Knob, price: Callable, cid: int, profile: ClientProfile
) -> tuple[ClientPlan, ClientProfile]:
    """Client ``cid``'s row of the plan and its planned profile: the first setting of the search
    (:func:`_candidates`) that fits its budget, else (excluded, or measured when it states its knob)
    the last one tried."""
    own = knobs.stated(profile)
    stated = knob is not None and own is not None
    values = [own] if own is not None else knobs.ladder if knob is not None else knobs.ladder[:1]
    codecs = _codecs(context, profile)
    formats = knobs.formats
    if formats[0] is not None and (profile.quantization is not None or profile.dtype is not None):
        formats = (context.base_format(profile),)  # a profile that states its base's format keeps it
    *_, chosen = _candidates(knobs, price, profile, values, formats, codecs)
    setting = _label(knobs, codecs, chosen)
    excluded = None
    if chosen.reason is not None and not stated:
        excluded = f"excluded by the plan: no setting fits its budget ({setting}: {chosen.reason})"
    own_base = formats is knobs.formats and not excluded
    planned = _planned_profile(knob if not stated else None, knobs, codecs, chosen, profile, own_base)
    over = chosen.reason if stated else None
    c = chosen
    return ClientPlan(cid, planned.device_class, setting, c.peak, c.seconds, c.upload, excluded, stated, over), planned


def _candidates(knobs: Knob, price: Callable, profile: ClientProfile, values, formats, codecs) -> Iterator[_Candidate]:
    """The settings tried for ``profile``, in order, ending at the first that fits: at each value
    (largest first) each base format and checkpointing variant, and, where only the upload breaks
    the budget, each lighter codec; the next variant only where the memory breaks it."""
    budgeted = has_budget(profile)
    for value in values:
        for fmt, checkpointing in ((f, c) for f in formats for c in knobs.variants):
            p, upload_values = price(value, checkpointing, fmt)
            seconds = p.seconds / profile.speed
            # a lighter codec only where the upload is what breaks the budget
            fits = not budgeted or _violation(profile, p.peak, seconds, 0.0) is None
            for codec in codecs if fits else codecs[:1]:
                upload = upload_values * bytes_per_value(*codec) / MB
                reason = _violation(profile, p.peak, seconds, upload) if budgeted else None
                yield _Candidate(value, checkpointing, fmt, codec, p.peak, seconds, upload, reason)
                if reason is None:
                    return
            if profile.memory_gib is None or p.peak <= profile.memory_gib * GIB:
                break  # checkpointing and a lighter base only where the memory is what breaks it


def _label(knobs: Knob, codecs: list, c: _Candidate) -> str:
    """The setting as the plan prints it ("rank 4, checkpointing, 4bit base, upload bfloat16 top-k 0.1")."""
    setting = knobs.label(c.value)
    if c.checkpointing != knobs.variants[0]:
        setting += ", checkpointing"
    if c.fmt is not None and c.fmt != knobs.formats[0]:
        setting += f", {c.fmt[0] if c.fmt[0] != 'none' else c.fmt[1]} base"
    if c.codec != codecs[0]:
        setting += f", upload {c.codec[1]}" + ("" if c.codec[0] is None else f" top-k {c.codec[0]:g}")
    return setting


def _planned_profile(
    knob: str | None, knobs: Knob, codecs: list, c: _Candidate, profile: ClientProfile, own_base: bool
) -> ClientProfile:
    """``profile`` with what the plan chose: its checkpointing, ``knob``'s value (None: the method
    has none, or the profile states it), its base's format where the search gave it another
    (``own_base``: the search chose the format and the client is not excluded) and its codec."""
    update: dict = {}
    if c.checkpointing != knobs.variants[0]:
        update["gradient_checkpointing"] = True
    if knob is not None:
        update[knob] = knobs.value(c.value)
    run_format = knobs.formats[0]
    if own_base and c.fmt is not None and run_format is not None and c.fmt != run_format:
        update |= {k: v for k, v, r in zip(("quantization", "dtype"), c.fmt, run_format) if v != r}
    if c.codec != codecs[0]:
        update |= {"upload_topk": c.codec[0], "wire_dtype": c.codec[1]}
    return profile.model_copy(update=update) if update else profile


def refusal(context: PlanningContext, profile: ClientProfile) -> str | None:
    """Why ``profile``'s own setting (its knob, base format, checkpointing and upload codec as it
    states them, else the run's) breaks a budget it states, as the plan says it (a node refuses such
    a setting before it loads anything); None when it holds or no budget is stated."""
    if not has_budget(profile):
        return None
    knob, knobs, _ = context.pricing
    value = knobs.stated(profile) if knob is not None else None
    if value is None:  # unstated: what the client trains on (the ladder's first, unless the knob says)
        value = knobs.unstated if knobs.unstated is not None else knobs.ladder[0]
    fed = context.config.federation
    checkpointing = bool(profile.gradient_checkpointing or context.config.train.gradient_checkpointing)
    fmt = None if knobs.formats[0] is None else context.base_format(profile)
    p, upload_values = knobs.cost(value, checkpointing, fmt)
    upload = upload_values * bytes_per_value(*profile.upload_codec(fed.upload_topk, fed.wire_dtype)) / MB
    return _violation(profile, p.peak, p.seconds / profile.speed, upload)


#: the upload codecs (top-k fraction, wire dtype) the planner may give a client, heaviest first
CODECS = ((None, "float32"), (None, "bfloat16"), (0.25, "bfloat16"), (0.1, "bfloat16"), (0.05, "bfloat16"))
#: the cross-method options of a method whose clients upload through the codec
CODEC_OPTIONS = ("federation.upload_topk", "federation.wire_dtype")


def bytes_per_value(topk: float | None, wire_dtype: str) -> float:
    """Upload bytes per update value: dense in ``wire_dtype``, or top-k's kept values and their int32 indices."""
    size = torch.finfo(DTYPES[wire_dtype]).bits // 8
    return size if topk is None else topk * (size + 4)


def compresses(context: PlanningContext) -> bool:
    """Whether the run's clients upload through the codec (the method honours it; no secure aggregation)."""
    return set(CODEC_OPTIONS) <= context.method.honours and not context.config.secure_aggregation.enabled


def _codecs(context: PlanningContext, profile: ClientProfile) -> list[tuple[float | None, str]]:
    """The client's codec ladder: its own (or the federation's), then, where the run's uploads go
    through the codec and the profile states none, each lighter one of :data:`CODECS`."""
    fed = context.config.federation
    first = profile.upload_codec(fed.upload_topk, fed.wire_dtype)
    if profile.upload_topk is not None or profile.wire_dtype is not None or not compresses(context):
        return [first]
    return [first, *(c for c in CODECS if bytes_per_value(*c) < bytes_per_value(*first))]


def check_profile_codecs(run) -> None:
    """A profile that states an upload codec needs a method whose uploads go through it, one that
    states gradient checkpointing a method that honours it, one that states ``trains_on`` a proxy
    method (ConfigError naming the first such profile); ``run``: a :class:`~fedtune.runtime.ResolvedRun`."""
    from fedtune.methods import list_methods

    for cid, p in enumerate(run.profiles):
        if p.trains_on is not None and (run.method.plan is None or run.method.plan.knob != "trains_on"):
            proxies = [m.name for m in list_methods() if m.plan is not None and m.plan.knob == "trains_on"]
            raise ConfigError(
                f"federation.profiles[{cid}].trains_on: method {run.config.method!r} trains on no proxy "
                f"({' and '.join(proxies)} do)"
            )
        if p.gradient_checkpointing and CHECKPOINTING not in run.method.honours:
            raise ConfigError(
                f"federation.profiles[{cid}].gradient_checkpointing: method {run.config.method!r} does not honour it"
            )
        field_ = "upload_topk" if p.upload_topk is not None else "wire_dtype" if p.wire_dtype is not None else None
        if field_ is None:
            continue
        if not set(CODEC_OPTIONS) <= run.method.honours:
            raise ConfigError(
                f"federation.profiles[{cid}].{field_}: method {run.config.method!r} does not compress its uploads"
            )
        if run.config.secure_aggregation.enabled:
            raise ConfigError(f"federation.profiles[{cid}].{field_}: not with secure_aggregation.enabled")


@contextmanager
def planned_checkpointing(client: Client) -> Iterator[None]:
    """Gradient checkpointing on the client's base for the block when its profile has it and the
    run does not (the base is shared by the process's clients: it is turned off again after)."""
    on = client.profile.gradient_checkpointing and not client.config.train.gradient_checkpointing
    if not on:
        yield
        return
    from fedtune.models.precision import enable_gradient_checkpointing

    base = client.context.workspace.base
    enable_gradient_checkpointing(base, str(client.config.model.name))
    try:
        yield
    finally:
        for m in base.modules():
            disable = getattr(m, "gradient_checkpointing_disable", None)  # a transformers model's
            if getattr(m, "is_gradient_checkpointing", False) and callable(disable):
                disable()


def metered_fit(client: Client, message: Message, call: Callable[[Message], Message] | None = None) -> Message:
    """``client.fit(message)`` (or ``call(message)``: a phase of the round) with its measured peak
    (:class:`~fedtune.planning.memory.PeakMeter` on the run's device, plus the frozen base a LoRA
    client holds; a proxy client, its plan's ``peak`` "reported": the client's own ``peak_mem_bytes``,
    :func:`~fedtune.models.train_memory.training_peak_bytes`) in the reply's metadata, under the
    client's planned checkpointing. Under DP the peak is not sent: the client fails the request
    itself (a simulated out-of-memory) when it is over its ``memory_gib``."""
    from fedtune.models.precision import resolve_device
    from fedtune.planning.memory import PeakMeter, base_weight_bytes

    with planned_checkpointing(client), PeakMeter(resolve_device(client.config.device)) as meter:
        reply = (call or client.fit)(message)
    plan = client.context.method.plan
    mode = "base" if plan is None else plan.peak
    if mode == "reported" and "peak_mem_bytes" in reply.meta:
        # a proxy client: the process cuts its skeleton from the full model, so its
        # growth is not the client's; the client measures the model it trains on and its training
        peak = int(reply.meta["peak_mem_bytes"])
    elif meter.growth is None:
        return reply
    else:  # a LoRA client holds the frozen base; a sub-model client builds its sub-model inside its fit
        held = 0 if mode == "growth" else base_weight_bytes(client.context.workspace.base)
        peak = held + meter.growth
    budget = client.profile.memory_gib
    if client.config.privacy.mode != "none":  # under DP the measured peak stays on the client, which enforces it
        if budget is not None and peak > budget * GIB:
            raise MemoryError(f"simulated out-of-memory: measured peak {peak / GIB:.3g} GiB over memory_gib {budget:g}")
        return reply
    return Message(reply.arrays, {**reply.meta, PEAK_BYTES: peak})


def format_plan(plan: Plan) -> str:
    """The plan as a table: one row per client, its budget, setting and predicted costs."""

    def budget(p: ClientProfile) -> str:
        parts = [f"{p.memory_gib:g} GiB" if p.memory_gib else "", f"{p.deadline_s:g} s" if p.deadline_s else ""]
        parts.append(f"{p.bandwidth_mb:g} MB" if p.bandwidth_mb else "")
        return ", ".join(x for x in parts if x) or "-"

    rows = [("client", "class", "budget", "setting", "peak GiB", "s/round", "MB/round up", "")]
    for c, p in zip(plan.clients, plan.profiles):
        note = c.excluded or ("stated in its profile" if c.stated else "")
        if c.over is not None:
            note += f"; {c.over}: the run measures it"
        rows.append((str(c.cid), c.device_class or "-", budget(p), c.setting, f"{c.peak_bytes / GIB:.3g}",
                     f"{c.seconds:.3g}", f"{c.upload_mb:.3g}", note))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) + ("  " + r[-1] if r[-1] else "") for r in rows]
    kept = len(plan.clients) - len(plan.excluded)
    lines.append(f"{kept} of {len(plan.clients)} clients planned, {len(plan.excluded)} excluded")
    if plan.note:
        lines.append(plan.note)
    if plan.speed_note:
        lines.insert(0, plan.speed_note)
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    """The plan as the run folder's ``plan.json``: one entry per client (:class:`ClientPlan`'s fields)."""
    return json.dumps({"clients": [asdict(c) for c in plan.clients]}, indent=1) + "\n"
