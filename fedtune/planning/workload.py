"""A LoRA client's step as the planner prices it (:class:`~fedtune.planning.memory.Workload`): the
run's batch, the task's rows and logit positions (:meth:`~fedtune.tasks.base.Task.step_shape`),
its dtype, checkpointing, optimizer and dropout (:func:`lora_workload`). A method whose step does
more states it in its own plan (:func:`fedtune.planning.lora_plan.lora_plan`'s ``step``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedtune.config import ConfigError
from fedtune.models.precision import DTYPES
from fedtune.protocol.context import ClientContext

if TYPE_CHECKING:
    from fedtune.planning.memory import Workload


def lora_workload(context: ClientContext, base: torch.nn.Module) -> Workload:
    """A client's LoRA training on ``base`` as the run states it (a
    :class:`~fedtune.planning.memory.Workload`), its rows and logit positions the task's
    (:meth:`~fedtune.tasks.base.Task.step_shape`; under DP :meth:`~fedtune.tasks.base.Task.public_step_shape`,
    so that the public plan depends on no client's data); ConfigError for a model the memory model does not cover."""
    from fedtune.models.precision import computes_natively, resolve_device
    from fedtune.models.train_memory import optimizer_states
    from fedtune.planning.memory import COEFFICIENTS, Shape, Workload

    config = context.config
    cfg, train = config.model, config.train
    dtype = DTYPES[cfg.dtype]
    compute = dtype if computes_natively(resolve_device(config.device), dtype) else torch.float32
    # under DP the plan (plan.json) is public: priced from public shapes, never the longest training row
    private = config.privacy.mode != "none"
    length, logits = context.task.public_step_shape() if private else context.task.step_shape()
    work = Workload(
        train.batch_size,
        length,
        torch.finfo(compute).bits // 8,
        train.gradient_checkpointing,
        optimizer_states(train.optimizer, train.momentum),
        train.local_steps,
        cfg.quantization != "none",
        logits=logits,
        dropout=cfg.lora_dropout > 0,
    )
    try:
        family = Shape.of(base).family
    except ValueError as exc:
        raise ConfigError(f"model.name: {cfg.name!r}: {exc}; budgets are planned for transformer models") from None
    if family not in COEFFICIENTS:
        raise ConfigError(
            f"model.name: {cfg.name!r} is a {family!r} model; the memory model is fitted for "
            f"{', '.join(COEFFICIENTS)} (benchmarks/budgets/fit_memory.py)"
        )
    return work
