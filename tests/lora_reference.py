"""Reference computations for the LoRA faithfulness tests, independent of the methods' code: the
gradient of the training loss w.r.t. each adapted module's dense weight W, by torch autograd on a
fresh, un-adapted copy of the task's base model, for the batch and dropout draw a client uses in
its first local step; and a client model's effective weight change per module (PEFT's own)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch.func import functional_call

from fedtune.models.training import seed_for, train_mode


def dense_gradients(
    ctx, cid: int, rnd: int, deltas: Mapping[str, np.ndarray], head: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(module path -> dL/dW (m, n), head name -> dL/dhead) at W = W0 + deltas[path], for the first
    training batch of client ``cid`` in round ``rnd`` (its data order and dropout seed, as
    :func:`fedtune.models.training.train_local` draws them)."""
    config = ctx.config
    seed = seed_for(config.seed, rnd, cid)
    batch = next(
        iter(ctx.task.train_batches(ctx.partitions[cid], config.train.batch_size, 1, np.random.default_rng(seed)))
    )
    base = ctx.task.build_model(config.seed)
    train_mode(base)
    weights = {
        path: (base.get_parameter(path + ".weight").detach() + torch.as_tensor(d, dtype=torch.float32)).requires_grad_(
            True
        )
        for path, d in deltas.items()
    }
    heads = {k: torch.tensor(v, requires_grad=True) for k, v in head.items()}
    torch.manual_seed(seed)  # the client's dropout draw
    loss = ctx.task.loss(_Functional(base, {**{p + ".weight": w for p, w in weights.items()}, **heads}), batch)
    loss.backward()
    return (
        {p: w.grad.numpy().astype(np.float64) for p, w in weights.items()},
        {k: t.grad.numpy().astype(np.float64) for k, t in heads.items()},
    )


class _Functional(torch.nn.Module):
    """``base`` called with some parameters replaced (torch.func.functional_call)."""

    def __init__(self, base: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.base, self.params = base, params

    def forward(self, *args, **kwargs):
        return functional_call(self.base, self.params, args=args, kwargs=kwargs)


def effective_deltas(workspace) -> dict[str, np.ndarray]:
    """Module path -> s B A of the workspace's active adapter (PEFT's ``get_delta_weight``)."""
    out = {}
    for name, module in workspace.model.named_modules():
        if hasattr(module, "get_delta_weight") and getattr(module, "active_adapters", None):
            adapter = module.active_adapters[0]
            if adapter in getattr(module, "lora_A", {}):
                path = name.removeprefix("base_model.model.")
                out[path] = module.get_delta_weight(adapter).detach().numpy().astype(np.float64)
    return out
