"""FIARSE: importance-aware sub-model extraction (Wu et al., NeurIPS 2024), a baseline of RABO,
following the reference code (``fiarse/``: model-wise threshold).

Importance is magnitude. In round t a client of budget k_i keeps the entries theta with
|theta| >= tau_i, tau_i the k_i-th largest magnitude over the weights and biases of every linear,
convolution and embedding layer of the global model taken together (``generate_mask(topk=True)``:
``torch.topk(|theta|, k)``, ``scores >= threshold``); normalization layers are never masked.
The client downloads the global model (its mask is a function of it) and trains
theta (.) 1[|theta| >= tau_i] with *threshold-controlled biased gradient descent* (TCB-GD, the
reference's ``Bern`` autograd function): the mask is re-evaluated at every forward pass with the
fixed tau_i (an entry whose magnitude falls below tau_i leaves the sub-model, a pruned entry never
enters it), and a kept entry's gradient is scaled by 1 + |theta| 2 tau / (|theta| + tau)^2, the
derivative of theta (.) m(|theta|) through the surrogate d m / d|theta| = 2 tau / (|theta| + tau)^2.
It uploads its update at its round-start mask; the server averages each entry over the clients
whose mask held it and steps theta <- theta + eta (1 / C^k) sum_i Delta_i^k (``tot_grad / tot_mask``,
``lr_global``: ``options.server_lr``), entries nobody held unchanged. (The reference counts a
client for an entry when its update there is non-zero, which differs only for a kept entry whose
update is exactly zero.)

Budgets: RABO's capacities beta_i are width ratios (``profile.capacity``); FIARSE sizes its
sub-models by parameter count, so k_i here is the number of maskable entries in the width-beta_i
sub-model of the structured methods: every method trains the same number of parameters on a
client.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from fedtune.methods.rabo.masks import SubModel, choose_units, magnitude_masks, submodel_of
from fedtune.methods.rabo.plan import CAPACITY_PLAN
from fedtune.methods.rabo.submodel import SubmodelClient, SubmodelOptions, SubmodelStrategy
from fedtune.models.precision import model_device
from fedtune.protocol.messages import Message
from fedtune.registry import register

MASKED_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)


def maskable(model: nn.Module, names) -> list[str]:
    """The weights and biases of the model's linear, convolution and embedding layers (in ``names``)."""
    out = []
    for mname, module in model.named_modules():
        if isinstance(module, MASKED_LAYERS):
            out += [f"{mname}.{p}" for p, _ in module.named_parameters(recurse=False) if f"{mname}.{p}" in names]
    return out


class _ThresholdMask(torch.autograd.Function):
    """theta (.) 1[|theta| >= tau] forward; TCB-GD's gradient backward (module docstring)."""

    @staticmethod
    def forward(ctx, theta: torch.Tensor, tau: float) -> torch.Tensor:
        mask = theta.abs() >= tau
        ctx.save_for_backward(theta, mask)
        ctx.tau = tau
        return theta * mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        theta, mask = ctx.saved_tensors
        a, tau = theta.abs(), ctx.tau
        surrogate = torch.nan_to_num(a * 2 * tau / (a + tau) ** 2, nan=0.0, posinf=0.0, neginf=0.0)
        return grad * mask * (1 + surrogate), None


class ThresholdMask(nn.Module):
    """A parametrization: the layer computes with theta (.) 1[|theta| >= tau] (TCB-GD)."""

    def __init__(self, tau: float) -> None:
        super().__init__()
        self.tau = tau

    def forward(self, theta: torch.Tensor) -> torch.Tensor:
        return _ThresholdMask.apply(theta, self.tau)


class FiarseStrategy(SubmodelStrategy):
    """FIARSE: importance-aware (magnitude) sub-models with TCB-GD (Wu et al. 2024)."""

    def initialize(self) -> None:
        super().initialize()
        self.maskable = maskable(self.context.model, self.global_arrays)

    def budget(self, cid: int) -> int:
        """k_i: the maskable entries of the width-beta_i structured sub-model."""
        units = {g.name: choose_units("static", g, self.capacity(cid), 1, cid) for g in self.structure.groups}
        width = submodel_of(self.structure, units)
        return sum(width.kept(n) for n in self.maskable)

    def submodel(self, rnd: int, cid: int) -> SubModel:
        masks, _ = magnitude_masks(self.global_arrays, self.maskable, self.budget(cid))
        return SubModel(masks)

    def fit_arrays(self, sub: SubModel) -> dict[str, np.ndarray]:
        return {f"x/{n}": v for n, v in self.global_arrays.items()}  # the full model: the mask is a function of it

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        messages = super().configure_fit(rnd, client_ids)
        for cid, m in messages.items():
            m.meta["budget"] = self.budget(cid)
        return messages


class FiarseClient(SubmodelClient):
    """Trains theta (.) 1[|theta| >= tau_i] with TCB-GD; uploads its update at the round-start mask."""

    def receive(self, message: Message):
        values = {k[len("x/") :]: v for k, v in message.arrays.items() if k.startswith("x/")}
        names = maskable(self.context.model, values)
        masks, self.tau = magnitude_masks(values, names, int(message.meta["budget"]))
        self.masked = names
        sub = SubModel(masks)
        device = model_device(self.context.model)
        return (
            sub,
            {n: torch.as_tensor(np.asarray(v, dtype=np.float32)).clone().to(device) for n, v in values.items()},
            False,
        )

    def prepare(self, model, sub, physical, message) -> None:
        for name in self.masked:
            owner, _, leaf = name.rpartition(".")
            parametrize.register_parametrization(model.get_submodule(owner), leaf, ThresholdMask(self.tau))

    def finish(self, model) -> None:
        for name in self.masked:
            owner, _, leaf = name.rpartition(".")
            parametrize.remove_parametrizations(model.get_submodule(owner), leaf, leave_parametrized=False)


register("fiarse", FiarseStrategy, FiarseClient, SubmodelOptions, supports=("device",), plan=CAPACITY_PLAN)
