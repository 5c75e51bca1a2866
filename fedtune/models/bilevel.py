"""The bilevel problem interface of RABO eq. (1)-(2) (RABO, RAFBO and the full-model bilevel
baseline solve it): outer variables x, inner variables y, and per client i an inner loss g_i(x, y)
and an outer loss f_i(x, y) over a task's data and model. A task that offers the ``bilevel``
capability supplies its problem (``Task.bilevel_problem``; the few-shot and image-classification
ones are in :mod:`fedtune.tasks.bilevel_problems`); the methods ask the task for it.

A problem names its tensors (``outer`` x, ``inner`` y, and which of them are ``buffers``: batch-
norm statistics, carried and averaged but never differentiated), gives their initial values, the
:class:`~fedtune.models.structure.Structure` that masks them, each client's data of a round, the
two losses on (sub-)tensors, and the evaluation of the global (x, y).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedtune.models.precision import model_device
from fedtune.models.structure import Structure

Loss = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], torch.Tensor]
Tensors = dict[str, torch.Tensor]


def gradient_steps(
    g: Loss,
    x: Sequence[torch.Tensor],
    start: Sequence[torch.Tensor],
    steps: int,
    lr: float,
    mask: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """y_T from ``start`` by y_{t+1} = y_t - lr (grad_y g(x, y_t) (.) m) (RABO eq. (5)), without a
    graph through the steps (x is treated as a constant)."""
    xs = [t.detach() for t in x]
    y = [t.detach().clone() for t in start]
    for _ in range(steps):
        with torch.enable_grad():
            leaves = [t.requires_grad_() for t in y]
            grads: Sequence[torch.Tensor] = torch.autograd.grad(g(xs, leaves), leaves)
        if mask is not None:
            grads = [gr if m is None else gr * m for gr, m in zip(grads, mask)]
        y = [t.detach() - lr * gr for t, gr in zip(leaves, grads)]
    return y


class BilevelProblem(ABC):
    """x, y, g_i, f_i of one run (see the module docstring)."""

    outer: list[str]  # names of x
    inner: list[str]  # names of y
    buffers: set[str] = set()  # names (in x or y) carried but not differentiated
    reset_inner: bool = False  # y_q = 0 at the start of every round (per-episode heads)

    def __init__(self, context: Any, options: Any) -> None:
        self.context, self.options = context, options
        self.config = context.config

    @property
    def device(self) -> torch.device:
        """Where the shared model is (``device``): x, y, masks and batches are moved there."""
        return model_device(self.context.model)

    @abstractmethod
    def initial(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(x_0, y_0) as float32 arrays."""

    @abstractmethod
    def structure(self) -> Structure:
        """Unit groups over the tensors of x and y (a tensor in no group is never pruned)."""

    @abstractmethod
    def data(self, cid: int, rnd: int) -> Any:
        """Client ``cid``'s data of round ``rnd`` (the same in both phases: seeded by them alone)."""

    @abstractmethod
    def g(self, x: Tensors, y: Tensors, batch: Any) -> torch.Tensor:
        """g_i(x, y; xi): the inner loss."""

    @abstractmethod
    def f(self, x: Tensors, y: Tensors, batch: Any) -> torch.Tensor:
        """f_i(x, y; zeta): the outer loss."""

    @abstractmethod
    def inner_batches(self, data: Any, steps: int) -> list[Any]:
        """xi_0 .. xi_{T-1} of the inner steps (RABO eq. (5))."""

    @abstractmethod
    def hyper_batches(self, data: Any) -> tuple[Any, Any]:
        """(xi, zeta) of the hypergradient: the inner batch of its Hessians, the outer batch of f."""

    def inner_solve(
        self, x: Tensors, y0: Tensors, batches: list[Any], lr: float, masks: Mapping[str, torch.Tensor] | None = None
    ) -> Tensors:
        """y_T from y0 by y_{t+1} = y_t - lr (grad_y g(x, y_t; xi_t) (.) m) (RABO eq. (5)); x fixed."""
        names = [n for n in self.inner if n not in self.buffers]
        fixed = {n: y0[n] for n in self.inner if n in self.buffers}
        y = [y0[n] for n in names]
        for batch in batches:

            def loss(xs, ys, batch=batch):
                return self.g(x, {**fixed, **dict(zip(names, ys))}, batch)

            y = gradient_steps(loss, [], y, 1, lr, None if masks is None else [masks.get(n) for n in names])
        return {**fixed, **dict(zip(names, y))}

    @abstractmethod
    def evaluate(self, x: Mapping[str, np.ndarray], y: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Metrics of the global (x, y) on the task's test set."""

    def prepare(self) -> None:
        """Put the shared model in the mode the losses need (train: batch-norm batch statistics)."""
        self.context.model.train()
