"""A LoRA client's step as the planner prices it (:class:`~fedtune.planning.memory.Workload`): the
run's batch, the task's rows and logit positions (:meth:`~fedtune.tasks.base.Task.step_shape`),
its dtype, checkpointing, optimizer and dropout (:func:`lora_workload`), and CoMMIT's step beyond
FedIT's (:func:`commit_workload`)."""

from __future__ import annotations

from dataclasses import replace

import torch

from fedtune.config import ConfigError
from fedtune.models.precision import DTYPES


def lora_workload(context, base):
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


#: CoMMIT's local step (:func:`fedtune.methods.commit.balance.train_coordinated`) beyond FedIT's, per
#: path of the trainer: (forward-backward passes, gradient-free forward passes, copies of the
#: trainable values held, float32 tensors of the answer logits' shape held beyond the loss pass's)
COMMIT_STEP: dict[str, tuple[int, int, int, int]] = {
    # the loss pass, then D^T's and D^S's (each a forward and autograd.grad through the LM); the
    # provisional values and the swapped-out component's own; answer_distance holds log q, log p,
    # q, q - p and |q - p| where the cross-entropy holds its float copy and log-softmax
    "regularized": (3, 0, 2, 3),
    "measured": (1, 2, 1, 0),  # d_T and d_S: two no-grad forwards after the step; the values before it
    "cd": (1, 0, 1, 0),  # the first component's values at the window's start
    "plain": (1, 0, 0, 0),
}


def commit_workload(context, work):
    """``work`` (FedIT's step on the same base) as a CoMMIT client's (:data:`COMMIT_STEP` for its
    ``options.trainer``), with y_hat held too: the loss pass's logits over the A + 1 positions the
    LM head computes (``work.logits``: A, the task's longest answer, + 1), kept through the step.
    Without checkpointing (CoMMIT does not honour it: its trainer runs the model in evaluation mode)."""
    from fedtune.methods.commit.balance import CD_ORDER
    from fedtune.methods.commit.commit import coordination
    from fedtune.planning.memory import Shape

    coord = coordination(context.options, context.config)
    path = (
        "regularized" if coord.regularized
        else "measured" if coord.measures
        else "cd" if coord.trainer in CD_ORDER
        else "plain"
    )  # fmt: skip
    passes, forwards, copies, tensors = COMMIT_STEP[path]
    positions, vocab = work.logit_positions, Shape.of(context.skeleton).vocab
    logits = (4 if work.kbit else work.act_bytes) * work.batch * positions * vocab
    held = tensors * 4 * work.batch * (positions - 1) * vocab + logits
    return replace(work, checkpointing=False, passes=passes, forwards=forwards, copies=copies, held=held)
