"""Aligning a proxy with the full model on public data: the server's distillation runs, the part
that FedPFT's layer-level (Sec. 3.5.1, eq. 13) and neuron-level (Sec. 3.5.2) steps and FedOT's
emulator distillation share.

:class:`ProxyAligner` holds the public data set (``options.distill_data``, else the task's own
examples outside the clients' pool: :func:`~fedtune.methods.fedpft.support.public_source`), draws
its batches (seeded by ``options.distill_seed`` or the run's seed, one stream per distillation:
0 before FL, the round during FL), provides the teacher (the full model without any adapter) and
runs :func:`~fedtune.methods.fedpft.distill.distill` with the held-out error before and after.
*What* is aligned (which layer pairs, which parameters, which neurons) is the caller's.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np
import torch

from fedtune.methods.fedpft.distill import DistillPairs, distill, distill_error
from fedtune.methods.fedpft.options import ProxyOptions
from fedtune.methods.fedpft.support import progress, public_source, task_model
from fedtune.protocol.context import ServerContext, options_as


class ProxyAligner:
    """Distillation of proxy layers from the full model's on the public data set (module docstring);
    ``context``: the server's RunContext."""

    def __init__(self, context: ServerContext) -> None:
        self.context = context
        self.config, self.options = context.config, options_as(context, ProxyOptions)

    @cached_property
    def public(self) -> tuple[Any, np.ndarray, np.ndarray]:
        """(public Task, training pool, held-out pool) for distillation (:func:`public_source`)."""
        o = self.options
        task, pool = public_source(self.config, o.distill_data, o.distill_samples, o.distill_seed_of(self.config.seed))
        n_eval = min(256, len(pool) // 5)
        return task, pool[: len(pool) - n_eval], pool[len(pool) - n_eval :]

    def public_batches(self, steps: int, stream: int, held_out: bool = False):
        """``steps`` public batches of stream ``stream`` (the training pool, or the held-out one)."""
        task, pool, heldout = self.public
        rng = np.random.default_rng([self.options.distill_seed_of(self.config.seed), 0xD157, stream])
        return task.train_batches(heldout if held_out else pool, self.options.distill_batch_size, steps, rng)

    def forward(self, model: torch.nn.Module, batch: Any) -> Any:
        """A forward pass on a batch (the task's loss; distillation cuts it short before the head)."""
        return self.context.task.loss(model, batch)

    def teacher(self) -> torch.nn.Module:
        """The full model without any adapter (the server's, when not yet wrapped by LoRA)."""
        ws = self.context.workspace
        return ws.base if ws.model is None else task_model(self.context)

    def run_distillation(
        self, pairs: DistillPairs, params: list, steps: int, stream: int, label: str, masks: dict | None = None
    ) -> dict:
        """:func:`distill` of ``params`` (only the ``masks``' True entries, when given) on ``steps``
        public batches of ``stream``, with the held-out error before and after; returns its record."""
        heldout_steps = max(1, len(self.public[2]) // self.options.distill_batch_size)
        before = distill_error(pairs, self.public_batches(heldout_steps, stream, True), self.forward)
        losses = distill(
            pairs,
            params,
            self.public_batches(steps, stream),
            self.forward,
            steps,
            self.options.distill_lr,
            self.options.distill_weight_decay,
            masks=masks,
            log=progress(label, steps),
        )
        after = distill_error(pairs, self.public_batches(heldout_steps, stream, True), self.forward)
        return {
            "steps": steps,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "heldout_loss_before": before[0],
            "heldout_loss_after": after[0],
            "heldout_output_error_before": before[1],
            "heldout_output_error_after": after[1],
        }


__all__ = ["ProxyAligner"]
