"""The LoRA methods' plan (:func:`lora_plan`): the rank on r, r/2, ..., 1 (or the sketch ratio
rank / r, or no knob), each priced by the memory model (:func:`~fedtune.planning.memory.predict`)
on the run's skeleton in each base format the method lets a client hold, with and without gradient
checkpointing; on a model with no transformer config (a CNN) measured per rank instead
(:func:`~fedtune.planning.measured.measured_lora_knob`). A method whose step does more than the
plain LoRA step gives ``step``: the :class:`~fedtune.planning.memory.Workload` of its step from
the plain one's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from fedtune.models.precision import DTYPES
from fedtune.planning.knob import Knob, rank_knob
from fedtune.planning.memory import Workload
from fedtune.planning.spec import PlanningContext, PlanSpec
from fedtune.planning.workload import lora_workload

#: the option a client's planned gradient checkpointing stands for
CHECKPOINTING = "train.gradient_checkpointing"

#: a method's own step from the plain LoRA step's (context, the plain workload -> its workload)
Step = Callable[[PlanningContext, Workload], Workload]


def lora_plan(knob: str | None, step: Step | None = None) -> PlanSpec:
    """The plan a LoRA method registers: ``knob`` (``"rank"``, ``"sketch_ratio"`` or None: rank r
    or nothing) priced by :func:`lora_knob` with the method's ``step``."""
    return PlanSpec(knob, partial(_priced, knob=knob, step=step))


def _priced(context: PlanningContext, knob: str | None, step: Step | None) -> tuple[Knob, str]:
    return lora_knob(context, knob, step), ""


def lora_knob(context: PlanningContext, knob: str | None, step: Step | None = None) -> Knob:
    """The LoRA methods' knob: the rank on r, r/2, ..., 1 (``knob`` "sketch_ratio": rank / r),
    each priced on ``context``'s skeleton (``step``: the method's step from the plain one's; a method
    without one is measured on a model with no transformer config)."""
    from fedtune.models.precision import computes_natively, resolve_device
    from fedtune.planning.measured import has_shape, measured_lora_knob
    from fedtune.planning.memory import Shape, predict
    from fedtune.planning.quantization import base_formats, weight_bytes
    from fedtune.planning.speed import planned_format, reference

    config = context.config
    cfg, train, task = config.model, config.train, context.task
    targets = list(cfg.target_modules) if cfg.target_modules is not None else task.lora_targets()
    base = context.skeleton  # shapes only: each base's weights and format are predicted
    if step is None and not has_shape(base):
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
        if step is not None:
            client = step(context, client)
        p = predict(base, targets, task.head_modules(), rank, client, weights=weights, fmt=fmt, device=device)
        return p, p.trainable

    variants: tuple[bool, ...] = (train.gradient_checkpointing,)
    if not train.gradient_checkpointing and checkpointable(context, base):
        variants = (False, True)

    formats = tuple(base_formats(context.method, cfg.quantization, cfg.dtype))
    note = reference(base, Shape.of(base).hidden, planned_format(cfg.quantization, dtype, device), device).note
    return rank_knob(cfg.lora_rank, knob, cost, variants=variants, formats=formats, speed_note=note)


def checkpointable(context: PlanningContext, base: torch.nn.Module) -> bool:
    """Whether the planner may turn gradient checkpointing on for a client: the method honours
    ``train.gradient_checkpointing`` and the model supports it."""
    return CHECKPOINTING in context.method.honours and any(
        getattr(m, "supports_gradient_checkpointing", False) for m in base.modules()
    )
