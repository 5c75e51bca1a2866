"""Aligning a proxy sub-model with its full model: layer-output distillation (FedPFT eq. 13,
Offsite-Tuning's emulator distillation) and the activation statistics of FedPFT's neuron-level
step (APoZ, eq. 14).

Every routine takes the batches of some data set and a ``forward(model, batch)`` that runs the
model on a batch (a task's loss: its value is never used). Layer outputs are read with forward
hooks (:class:`LayerTap`); once the last layer that is read has run, the forward pass is cut
short (the rest of the model, its head included, never runs), so a batch of a *public* data set
whose labels mean nothing to the task's head can be used.

Distillation loss, as the published FedPFT code computes eq. (13) (``DistillBertModel``): for
each aligned layer pair, the MSE of the layer outputs divided by the teacher output's mean
square, ``mean(((O - O') / rms(O))^2)`` over the whole batch tensor, plus ``mu`` times the same
normalized MSE of the FFN weight products W1 W2 vs W1' W2'; the sum is averaged over the
pairs. (The published code reads the weights through ``.data``, so its mu term carries no
gradient; here it does, as eq. (13) states.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedtune.methods.fedpft.ffn_proxy import Ffn, weight_product

Forward = Callable[[nn.Module, Any], Any]


class _StopForward(Exception):
    """Raised by a hook once every tapped layer has run."""


class LayerTap:
    """Records the outputs of ``modules`` during one forward pass (a tuple output's first
    element); with ``stop``, the pass ends right after the last of them."""

    def __init__(self, modules: Sequence[nn.Module], stop: bool = True) -> None:
        self.modules, self.stop = list(modules), stop

    def run(self, forward: Forward, model: nn.Module, batch: Any) -> list[torch.Tensor]:
        outputs: list[torch.Tensor | None] = [None] * len(self.modules)

        def hook(i: int):
            def record(module, args, output):
                outputs[i] = output[0] if isinstance(output, tuple) else output
                if self.stop and all(o is not None for o in outputs):
                    raise _StopForward

            return record

        handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(self.modules)]
        try:
            forward(model, batch)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        ran = [o for o in outputs if o is not None]
        if len(ran) < len(outputs):
            raise RuntimeError("a tapped layer did not run in the forward pass")
        return ran


def normalized_mse(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """mean(((teacher - student) / rms(teacher))^2), rms over the whole tensor (published code)."""
    rms = teacher.pow(2).mean().sqrt()
    return (teacher - student).div(rms).pow(2).mean()


@dataclass
class DistillPairs:
    """What eq. (13) compares: teacher and student layers (outputs matched pairwise) and, for the
    weight term, the teacher's W1 W2 and the student FFN of each pair."""

    teacher: nn.Module
    student: nn.Module
    teacher_layers: list[nn.Module]
    student_layers: list[nn.Module]
    products: list[tuple[torch.Tensor, Ffn]] = field(default_factory=list)  # (teacher W1 W2, student FFN)
    mu: float = 0.0

    def loss(self, forward: Forward, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(eq. 13's loss, its output term alone) on one batch; the teacher runs without gradient."""
        with torch.no_grad():
            targets = LayerTap(self.teacher_layers).run(forward, self.teacher, batch)
        outputs = LayerTap(self.student_layers).run(forward, self.student, batch)
        out_term = torch.as_tensor(sum(normalized_mse(t, s) for t, s in zip(targets, outputs))) / len(outputs)
        if not self.mu or not self.products:
            return out_term, out_term.detach()
        weight_term = sum(normalized_mse(t, weight_product(f)) for t, f in self.products) / len(outputs)
        return out_term + self.mu * weight_term, out_term.detach()


def _eval(*models: nn.Module) -> None:
    for m in models:
        m.eval()


def distill(
    pairs: DistillPairs,
    params: list[nn.Parameter],
    batches: Iterable[Any],
    forward: Forward,
    steps: int,
    lr: float,
    weight_decay: float = 0.01,
    warmup_ratio: float = 0.06,
    max_grad_norm: float = 1.0,
    masks: dict[nn.Parameter, torch.Tensor] | None = None,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``params`` of the student on ``steps`` batches to minimize eq. (13): AdamW, linear
    warm-up over ``warmup_ratio`` of the steps then linear decay, gradient clipping at
    ``max_grad_norm`` (Appendix C.2). ``masks`` (parameter -> bool tensor of its shape) trains
    only the True entries: the others' gradients are zeroed before clipping and their values
    restored after every step, so they end bit-identical. Both models run in eval mode (no
    dropout). Returns the loss of every step; ``log(step, loss)`` is called along the way."""
    _eval(pairs.teacher, pairs.student)
    frozen = {p: p.detach().clone() for p in (masks or {})}
    warm = max(1, int(math.ceil(warmup_ratio * steps)))
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm))
    )
    losses = []
    for step, batch in enumerate(batches):
        if step == steps:
            break
        loss, _ = pairs.loss(forward, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p, mask in (masks or {}).items():
            if p.grad is not None:
                p.grad.mul_(mask)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for p, mask in (masks or {}).items():
                p.copy_(torch.where(mask, p, frozen[p]))
        losses.append(float(loss.detach()))
        if log is not None:
            log(step + 1, losses[-1])
    return losses


@torch.no_grad()
def distill_error(pairs: DistillPairs, batches: Iterable[Any], forward: Forward) -> tuple[float, float]:
    """(mean eq. 13 loss, mean output term) over ``batches``: how far the student is from the
    teacher on held-out inputs."""
    _eval(pairs.teacher, pairs.student)
    total, out, n = 0.0, 0.0, 0
    for batch in batches:
        loss, term = pairs.loss(forward, batch)
        total, out, n = total + float(loss), out + float(term), n + 1
    return total / max(n, 1), out / max(n, 1)


# -- APoZ (eq. 14) ------------------------------------------------------------------------------------


def _activation_source(ffn: Ffn) -> tuple[nn.Module, bool]:
    """(module, is_pre_hook): where a neuron's activation a = act(x u_i + b1_i) is read: the output
    of the FFN's activation module, else (non-gated FFNs) the input of W2."""
    if ffn.act is not None:
        return ffn.act, False
    if ffn.gate is not None:
        raise ValueError("a gated FFN without an activation module: its activations cannot be read")
    return ffn.down, True


@torch.no_grad()
def count_zero_activations(
    model: nn.Module,
    ffns: Sequence[Ffn],
    last_layer: nn.Module,
    batches: Iterable[Any],
    forward: Forward,
    threshold: float,
) -> tuple[list[torch.Tensor], list[int]]:
    """Eq. (14)'s sums, per FFN: (number of positions where each neuron's activation a <= ``threshold``
    (int64, (d_ff,)), number of positions). A position is a token of an example (a batch dict's
    ``attention_mask`` of the activation's leading shape leaves padding out; otherwise every
    position counts). With ReLU, ``threshold = 0`` counts exact zeros; with GELU / SiLU,
    a <= 0 exactly when the pre-activation is <= 0 (the neuron is off). Gated FFNs: the gate's
    activation. The model runs in eval mode up to ``last_layer``."""
    model.eval()
    device = next(model.parameters()).device
    zeros = [torch.zeros(f.width, dtype=torch.int64, device=device) for f in ffns]
    tokens = [0] * len(ffns)
    mask_of_batch: list[torch.Tensor | None] = [None]

    def hook(i: int, pre: bool):
        def count(module, args, output=None):
            a = args[0] if pre else output
            a = a.reshape(-1, a.shape[-1])
            mask = mask_of_batch[0]
            hit = a <= threshold
            if mask is not None and mask.numel() == a.shape[0]:
                hit = hit[mask.reshape(-1).bool()]
            zeros[i] += hit.sum(0).to(torch.int64)
            tokens[i] += int(hit.shape[0])

        return count

    handles = []
    for i, f in enumerate(ffns):
        module, pre = _activation_source(f)
        handles.append(
            module.register_forward_pre_hook(hook(i, True)) if pre else module.register_forward_hook(hook(i, False))
        )
    try:
        tap = LayerTap([last_layer])
        for batch in batches:
            mask_of_batch[0] = batch.get("attention_mask") if isinstance(batch, dict) else None
            tap.run(forward, model, batch)
    finally:
        for h in handles:
            h.remove()
    return zeros, tokens
