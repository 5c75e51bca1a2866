"""CoMMIT's cost model for the planner: FedIT's LoRA step (:func:`fedtune.planning.lora_plan.lora_knob`)
with its trainer's extra passes and held tensors (:func:`commit_workload`), registered with the
method as its step (no knob: rank r or nothing)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from fedtune.methods.commit.balance import CD_ORDER, Coordination
from fedtune.planning.memory import Shape
from fedtune.planning.spec import PlanningContext

if TYPE_CHECKING:
    from fedtune.planning.memory import Workload


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


def commit_workload(context: PlanningContext, work: Workload, coord: Coordination):
    """``work`` (FedIT's step on the same base) as a CoMMIT client's (:data:`COMMIT_STEP` for the
    trainer ``coord`` runs, :func:`~fedtune.methods.commit.commit.coordination`), with y_hat held
    too: the loss pass's logits over the A + 1 positions the LM head computes (``work.logits``: A,
    the task's longest answer, + 1), kept through the step.
    Without checkpointing (CoMMIT does not honour it: its trainer runs the model in evaluation mode)."""
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
