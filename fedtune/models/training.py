"""Local training and no-grad evaluation, shared by every method's clients and servers and every task."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtune.config import TrainConfig
from fedtune.models.precision import model_device, to_device


@dataclass
class FitResult:
    loss: float  # mean training loss over the steps
    steps: int
    num_examples: int  # size of the client's data
    compute_s: float

    def meta(self) -> dict[str, float]:
        """What a client reports in its reply. Compute time is left out: it would make the
        upload size vary from run to run; the engines time the client call themselves."""
        return {"train_loss": self.loss, "steps": self.steps, "num_examples": self.num_examples}


def make_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """``train.optimizer``: plain SGD (heavy-ball with ``train.momentum``; the buffer starts at zero
    each call, i.e. each client each round) or AdamW."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def optimizer_arrays(optimizer: torch.optim.Optimizer, prefix: str = "optimizer/") -> dict[str, np.ndarray]:
    """The optimizer's per-parameter state (AdamW's step and moments, SGD's momentum buffer) as
    arrays ``{prefix}{i}/{key}``, ``i`` the parameter's position over the param groups: what a
    client keeps in its persistent ``state`` to continue one optimizer across rounds."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        f"{prefix}{i}/{key}": value.detach().cpu().numpy().copy()
        for i, p in enumerate(params)
        for key, value in optimizer.state.get(p, {}).items()
        if isinstance(value, torch.Tensor)
    }


def restore_optimizer(
    optimizer: torch.optim.Optimizer, arrays: dict[str, np.ndarray], prefix: str = "optimizer/"
) -> None:
    """Load what :func:`optimizer_arrays` returned into a fresh ``optimizer`` over parameters of
    the same shapes in the same order (its learning rates stay as built). Each state tensor goes
    to its parameter's device, except a step count that the optimizer keeps on the host (as
    ``Optimizer.load_state_dict`` places it: unless ``capturable`` or ``fused``)."""
    params = [(p, group) for group in optimizer.param_groups for p in group["params"]]
    for name, value in arrays.items():
        if not name.startswith(prefix):
            continue
        index, key = name[len(prefix) :].split("/", 1)
        param, group = params[int(index)]
        tensor = torch.from_numpy(np.array(value))
        if tensor.dim() and tensor.shape != param.shape:
            raise ValueError(f"optimizer state {name!r}: shape {tuple(tensor.shape)}, parameter {tuple(param.shape)}")
        if key != "step" or group.get("capturable") or group.get("fused"):
            tensor = tensor.to(param.device)
        optimizer.state[param][key] = tensor


def seed_for(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client, ...), stable across processes."""
    return int(
        np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1
    )


_NORMS = (torch.nn.modules.batchnorm._BatchNorm,)


def train_mode(model: torch.nn.Module) -> None:
    """``model.train()``, except batch norms whose affine parameters are frozen: they keep their
    running statistics (eval mode). A frozen base model is shared by every client of a process
    and by the server, so a statistic updated by one client's batches would leak into the next
    client and into evaluation; trained norms (full fine-tuning) update them, and methods that
    train them carry their buffers in their state."""
    model.train()
    for module in model.modules():
        if isinstance(module, _NORMS) and not any(p.requires_grad for p in module.parameters(recurse=False)):
            module.eval()


def train_local(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    task: Any,
    pool: np.ndarray,
    cfg: TrainConfig,
    seed: int,
) -> FitResult:
    """``cfg.local_steps`` optimizer steps of ``task.loss`` on ``task.train_batches(pool, ...)``;
    data order and dropout are fixed by ``seed`` (so the same client, round and seed train
    identically in any process)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    optimizer = make_optimizer(params, cfg)
    train_mode(model)
    device = model_device(model)
    total = 0.0
    for batch in task.train_batches(pool, cfg.batch_size, cfg.local_steps, rng):
        if device.type != "cpu":  # batches are built on the host
            batch = to_device(batch, device)
        loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return FitResult(total / cfg.local_steps, cfg.local_steps, len(pool), time.perf_counter() - start)


@torch.inference_mode()
def evaluate_classifier(
    model: torch.nn.Module,
    batches: Iterable[Any],
    forward: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> dict[str, float]:
    """Accuracy and mean cross-entropy over ``batches`` (host batches, moved to the model's
    device); ``forward(model, batch)`` returns (logits (B, C), labels (B,), the batch's mean loss)."""
    model.eval()
    device = model_device(model)
    correct, loss_sum, n = 0, 0.0, 0
    for batch in batches:
        if device.type != "cpu":
            batch = to_device(batch, device)
        logits, labels, loss = forward(model, batch)
        labels = labels.to(logits.device)
        loss_sum += loss.item() * len(labels)
        correct += int((logits.argmax(-1) == labels).sum().item())
        n += len(labels)
    n = max(n, 1)
    return {"accuracy": correct / n, "loss": loss_sum / n}


def freeze_except(model: torch.nn.Module, trainable_prefixes: list[str]) -> torch.nn.Module:
    """``requires_grad`` only for parameters under the named modules (``model.finetune = "head"``)."""
    for name, param in model.named_parameters():
        param.requires_grad_(any(name == p or name.startswith(p + ".") for p in trainable_prefixes))
    return model
