"""Each client's setting from its budget, before anything trains; and the measured peak of its fit.

A client has a budget when its profile states ``memory_gib``, ``bandwidth_mb`` or ``deadline_s``
(``speed`` scales its predicted seconds). For the LoRA methods the planner predicts
(:mod:`fedtune.planning.memory`; on a model with no transformer config, a CNN, measured per rank:
:func:`~fedtune.planning.measured.measured_lora_knob`) the peak memory, the seconds of a round's local steps at the
client's speed and the MB it uploads, and picks, simplest first, the knob its method lets a
client vary: the rank for HeteroLoRA / FlexLoRA / FedStackLoRA, the sketch ratio (rank / r) for
FSLoRA, each client's largest of r, r/2, r/4, ..., 1 that fits every budget it states; FedIT has
no knob (rank r or nothing), nor has CoMMIT (FedIT's step with its trainer's extra passes and
held tensors: :func:`commit_workload`). The sub-model methods (RABO / RAFBO, Static, FedRolex,
FIARSE) vary the capacity, the largest of RABO's 1, 1/2, ..., 1/16 that fits, priced on the sliced
model (:mod:`fedtune.planning.capacity`); FedMBO trains the full model: capacity 1 or nothing.
FedPFT and FedOT choose the model a client trains the adapter on, the full model or else the
proxy (:mod:`fedtune.planning.proxy`). A client that states its knob (``rank``,
``sketch_ratio``, ``capacity``, ``trains_on``) keeps it and the run measures it. A client that
no setting fits is excluded, with the reason of the smallest setting, and every round drops it
with that reason.

At each value of the knob, largest first, a LoRA client over its memory budget is tried with
gradient checkpointing (it costs time, about a third more compute, and no accuracy), then on an
8-bit and a 4-bit base (``federation.profiles[i].quantization``; where the method honours
``model.quantization`` and bitsandbytes is installed; a profile that states it keeps it), each
without and with checkpointing, and only then at the next smaller value: quantization changes the
model the client trains on, but the base's weights are most of a client's peak, while a smaller
rank saves only the adapter's share (a few percent) and shrinks what the client contributes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace

import torch

from fedtune.config import ConfigError
from fedtune.models.precision import DTYPES
from fedtune.planning.knob import Knob, rank_knob
from fedtune.planning.workload import commit_workload, lora_workload
from fedtune.protocol.messages import Message
from fedtune.protocol.profiles import ClientProfile
from fedtune.steps import track

#: method -> the profile field the planner sets (None: the method has no per-client knob)
KNOBS: dict[str, str | None] = {
    "heterolora": "rank",
    "flexlora": "rank",
    "fedstacklora": "rank",
    "fslora": "sketch_ratio",
    "fedit": None,
    "commit": None,
    "fedpetuning": None,
    "local": None,
    **dict.fromkeys(("rabo", "rafbo", "static", "fedrolex", "fiarse"), "capacity"),
    "fedmbo": None,  # the full model: capacity 1 (planning.capacity.FULL_MODEL_METHODS)
    **dict.fromkeys(("fedpft", "fedot"), "trains_on"),
}
#: the key of a training reply's metadata with the client's measured peak bytes
PEAK_BYTES = "peak_bytes"
MB = 1e6  # MB per round: 10^6 bytes
GIB = 2**30


def _capacity_planned(method: str) -> bool:
    """Whether ``method``'s clients are priced on the sliced model (:mod:`fedtune.planning.capacity`)."""
    from fedtune.planning.capacity import FULL_MODEL_METHODS

    return KNOBS.get(method) == "capacity" or method in FULL_MODEL_METHODS


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
    note: str = ""  # what the plan leaves out of the profiles (FedMBO: their capacities)


def _violation(profile: ClientProfile, peak: int, seconds: float, upload_mb: float) -> str | None:
    """The first budget ``profile`` states that the prediction breaks, or None."""
    if profile.memory_gib is not None and peak > profile.memory_gib * GIB:
        return f"predicted peak {peak / GIB:.3g} GiB > memory_gib {profile.memory_gib:g}"
    if profile.deadline_s is not None and seconds > profile.deadline_s:
        return f"predicted {seconds:.3g} s per round > deadline_s {profile.deadline_s:g}"
    if profile.bandwidth_mb is not None and upload_mb > profile.bandwidth_mb:
        return f"predicted upload {upload_mb:.3g} MB per round > bandwidth_mb {profile.bandwidth_mb:g}"
    return None


def _check_planner(method: str) -> None:
    """ConfigError when ``method`` has no planner."""
    if method not in KNOBS:
        raise ConfigError(
            f"federation: client budgets are planned for {', '.join(KNOBS)}; method {method!r} has no planner"
        )


def check_plannable(run) -> None:
    """At resolve time (before anything is read or written): client budgets only for a method the
    planner covers (ConfigError otherwise); ``run``: a :class:`~fedtune.runtime.ResolvedRun`."""
    if any(has_budget(p) for p in run.profiles):
        _check_planner(run.config.method)


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


def pricing(context) -> tuple[str | None, Knob, str]:
    """The run's knob (the profile field the plan sets; None: none), its :class:`Knob` (ladder and
    prices) and the plan's note, built once per ``context``; ConfigError for a method the planner does
    not cover."""
    cached = context.__dict__.get("_pricing")
    if cached is not None:
        return cached
    config = context.config
    _check_planner(config.method)
    knob = KNOBS[config.method]
    note = ""
    if _capacity_planned(config.method):
        from fedtune.planning.capacity import CAPACITIES, predict_capacity

        def price(v, *_):
            return predict_capacity(context, v)

        if knob == "capacity":
            knobs = Knob(list(CAPACITIES), lambda p: p.capacity, price, "capacity {:g}".format)
        else:  # FedMBO: the full model, whatever capacity a profile states (the method ignores it)
            knobs = Knob([1.0], lambda p: None, price, lambda v: "full model")
            ignored = [str(cid) for cid, p in enumerate(context.run.profiles) if p.capacity not in (None, 1.0)]
            if ignored:
                note = (
                    f"{config.method} trains the full model: the capacities of clients {', '.join(ignored)} are ignored"
                )
    elif knob == "trains_on":
        from fedtune.planning.proxy import SETTINGS, predict_settings

        settings = predict_settings(context, lora_workload(context, context.skeleton))
        label = {"full": "full model", "proxy": "proxy"}.__getitem__
        knobs = Knob(list(SETTINGS), lambda p: p.trains_on, lambda v, *_: settings[v], label)
    else:
        knobs = _lora_knob(context, knob)
    context.__dict__["_pricing"] = (knob, knobs, note)
    return knob, knobs, note


def plan_budgets(context, always: bool = False) -> Plan | None:
    """The plan of ``context``'s run (a :class:`~fedtune.runtime.RunContext`; each client's budget as
    its node reports it, :attr:`~fedtune.runtime.RunContext.budgeted_profiles`), or None when no
    client states a budget and no node's report was dropped (``always``: the predictions all the
    same); ConfigError for a method the planner does not cover."""
    profiles = context.budgeted_profiles if hasattr(context, "budgeted_profiles") else list(context.run.profiles)
    dropped = dict(context.reports.dropped) if hasattr(context, "reports") else {}
    if not always and not dropped and not any(has_budget(p) for p in profiles):
        return None
    knob, knobs, note = pricing(context)
    costs: dict = {}
    clients, planned, excluded = [], [], {}
    for cid, profile in track(enumerate(profiles), f"planning {len(profiles)} clients", len(profiles), "clients"):
        if cid in dropped:  # its node's report failed the check: excluded, nothing priced
            excluded[cid] = f"excluded: {dropped[cid]}"
            clients.append(ClientPlan(cid, profile.device_class, "-", 0, 0.0, 0.0, excluded[cid]))
            planned.append(profile)
            continue
        own = knobs.stated(profile)
        stated = knob is not None and own is not None
        values = [own] if own is not None else knobs.ladder if knob is not None else knobs.ladder[:1]
        codecs = _codecs(context, profile)
        formats = knobs.formats
        if formats[0] is not None and (profile.quantization is not None or profile.dtype is not None):
            formats = (context.base_format(profile),)
        for value in values:
            for fmt, checkpointing in ((f, c) for f in formats for c in knobs.variants):
                if (value, checkpointing, fmt) not in costs:
                    costs[value, checkpointing, fmt] = knobs.cost(value, checkpointing, fmt)
                p, upload_values = costs[value, checkpointing, fmt]
                seconds = p.seconds / profile.speed
                # a lighter codec only where the upload is what breaks the budget
                fits = not has_budget(profile) or _violation(profile, p.peak, seconds, 0.0) is None
                for codec in codecs if fits else codecs[:1]:
                    upload = upload_values * bytes_per_value(*codec) / MB
                    reason = _violation(profile, p.peak, seconds, upload) if has_budget(profile) else None
                    if reason is None:
                        break
                # checkpointing only where the memory is what breaks it
                if reason is None or profile.memory_gib is None or p.peak <= profile.memory_gib * GIB:
                    break
            if reason is None:
                break
        setting = knobs.label(value)
        if checkpointing != knobs.variants[0]:
            setting += ", checkpointing"
            profile = profile.model_copy(update={"gradient_checkpointing": True})
        if fmt is not None and fmt != knobs.formats[0]:
            setting += f", {fmt[0] if fmt[0] != 'none' else fmt[1]} base"
        if codec != codecs[0]:
            setting += f", upload {codec[1]}" + ("" if codec[0] is None else f" top-k {codec[0]:g}")
        if reason is not None and not stated:
            excluded[cid] = f"excluded by the plan: no setting fits its budget ({setting}: {reason})"
        if knob is not None and not stated:
            profile = profile.model_copy(update={knob: knobs.value(value)})
        run_format = knobs.formats[0]
        own_base = fmt is not None and run_format is not None and fmt != run_format
        if own_base and formats is knobs.formats and cid not in excluded:
            assert fmt is not None and run_format is not None  # for mypy: own_base says so
            own_format = {k: v for k, v, r in zip(("quantization", "dtype"), fmt, run_format) if v != r}
            profile = profile.model_copy(update=own_format)
        if codec != codecs[0]:
            profile = profile.model_copy(update={"upload_topk": codec[0], "wire_dtype": codec[1]})
        clients.append(
            ClientPlan(
                cid,
                profile.device_class,
                setting,
                p.peak,
                seconds,
                upload,
                excluded.get(cid),
                stated,
                reason if stated else None,
            )  # fmt: skip
        )
        planned.append(profile)
    return Plan(clients, planned, excluded, knobs.speed_note, note)


def refusal(context, profile: ClientProfile) -> str | None:
    """Why ``profile``'s own setting (its knob, base format, checkpointing and upload codec as it
    states them, else the run's) breaks a budget it states, as the plan says it (a node refuses such
    a setting before it loads anything); None when it holds or no budget is stated."""
    if not has_budget(profile):
        return None
    knob, knobs, _ = pricing(context)
    value = knobs.stated(profile) if knob is not None else None
    if value is None:  # unstated: what the client trains on (FedPFT / FedOT: the proxy)
        value = "proxy" if knob == "trains_on" else knobs.ladder[0]
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
CHECKPOINTING = "train.gradient_checkpointing"


def bytes_per_value(topk: float | None, wire_dtype: str) -> float:
    """Upload bytes per update value: dense in ``wire_dtype``, or top-k's kept values and their int32 indices."""
    size = torch.finfo(DTYPES[wire_dtype]).bits // 8
    return size if topk is None else topk * (size + 4)


def compresses(context) -> bool:
    """Whether the run's clients upload through the codec (the method honours it; no secure aggregation)."""
    return set(CODEC_OPTIONS) <= context.method.honours and not context.config.federation.secure_aggregation


def _codecs(context, profile: ClientProfile) -> list[tuple[float | None, str]]:
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
    fed = run.config.federation
    for cid, p in enumerate(run.profiles):
        if p.trains_on is not None and KNOBS.get(run.config.method) != "trains_on":
            raise ConfigError(
                f"federation.profiles[{cid}].trains_on: method {run.config.method!r} trains on no proxy "
                "(fedpft and fedot do)"
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
        if fed.secure_aggregation:
            raise ConfigError(f"federation.profiles[{cid}].{field_}: not with federation.secure_aggregation")


def _lora_knob(context, knob: str | None) -> Knob:
    """The LoRA methods' knob: the rank on r, r/2, ..., 1 (FSLoRA: the sketch ratio rank / r)."""
    from fedtune.models.precision import computes_natively, resolve_device
    from fedtune.planning.memory import Shape, predict
    from fedtune.planning.quantization import base_formats, weight_bytes
    from fedtune.planning.speed import planned_format, reference

    config = context.config
    cfg, train, task = config.model, config.train, context.task
    targets = list(cfg.target_modules) if cfg.target_modules is not None else task.lora_targets()
    base = context.skeleton  # shapes only: each base's weights and format are predicted
    from fedtune.planning.measured import has_shape, measured_lora_knob

    if config.method != "commit" and not has_shape(base):
        return measured_lora_knob(context, knob)
    work = lora_workload(context, base)
    dtype, device = DTYPES[cfg.dtype], resolve_device(config.device)

    def cost(rank: int, checkpointing: bool, base_format: tuple[str, str] | None) -> tuple:
        quantization, dtype = base_format or (cfg.quantization, cfg.dtype)
        compute = DTYPES[dtype] if computes_natively(device, DTYPES[dtype]) else torch.float32
        weights = weight_bytes(base, quantization, tuple(task.head_modules()), DTYPES[dtype].itemsize)
        fmt = planned_format(quantization, DTYPES[dtype], device)
        kbit = quantization != "none"  # a quantized base's activations are float32
        act = torch.finfo(compute).bits // 8
        client = replace(work, checkpointing=checkpointing, kbit=kbit, act_bytes=act)
        if config.method == "commit":
            client = commit_workload(context, client)
        p = predict(base, targets, task.head_modules(), rank, client, weights=weights, fmt=fmt, device=device)
        return p, p.trainable

    variants: tuple[bool, ...] = (train.gradient_checkpointing,)
    if not train.gradient_checkpointing and _checkpointable(context, base):
        variants = (False, True)

    formats = tuple(base_formats(context.method, cfg.quantization, cfg.dtype))
    note = reference(base, Shape.of(base).hidden, planned_format(cfg.quantization, dtype, device), device).note
    return rank_knob(cfg.lora_rank, knob, cost, variants=variants, formats=formats, speed_note=note)


def _checkpointable(context, base) -> bool:
    """Whether the planner may turn gradient checkpointing on for a client: the method honours
    ``train.gradient_checkpointing`` and the model supports it."""
    return CHECKPOINTING in context.method.honours and any(
        getattr(m, "supports_gradient_checkpointing", False) for m in base.modules()
    )


@contextmanager
def planned_checkpointing(client):
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
            if getattr(m, "is_gradient_checkpointing", False) and hasattr(m, "gradient_checkpointing_disable"):
                m.gradient_checkpointing_disable()


def metered_fit(client, message: Message, call: Callable[[Message], Message] | None = None) -> Message:
    """``client.fit(message)`` (or ``call(message)``: a phase of the round) with its measured peak
    (:class:`~fedtune.planning.memory.PeakMeter` on the run's device, plus the frozen base a LoRA
    client holds; FedPFT / FedOT: the client's own ``peak_mem_bytes``,
    :func:`~fedtune.models.train_memory.training_peak_bytes`) in the reply's metadata, under the
    client's planned checkpointing. Under DP the peak is not sent: the client fails the request
    itself (a simulated out-of-memory) when it is over its ``memory_gib``."""
    from fedtune.models.precision import resolve_device
    from fedtune.planning.memory import PeakMeter, base_weight_bytes

    with planned_checkpointing(client), PeakMeter(resolve_device(client.config.device)) as meter:
        reply = (call or client.fit)(message)
    if KNOBS.get(client.config.method) == "trains_on" and "peak_mem_bytes" in reply.meta:
        # FedPFT / FedOT: the process cuts a proxy client's skeleton from the full model, so its
        # growth is not the client's; the client measures the model it trains on and its training
        peak = int(reply.meta["peak_mem_bytes"])
    elif meter.growth is None:
        return reply
    else:  # a LoRA client holds the frozen base; a sub-model client builds its sub-model inside its fit
        held = 0 if _capacity_planned(client.config.method) else base_weight_bytes(client.context.workspace.base)
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
