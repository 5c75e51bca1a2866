"""Local training and batched no-grad evaluation, shared by every method's clients and servers."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from fedtune.config import TrainConfig
from fedtune.data.batches import TokenizedSet


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
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def seed_for(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client, ...), stable across processes."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


def train_local(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    data: TokenizedSet,
    pool: np.ndarray,
    cfg: TrainConfig,
    seed: int,
) -> FitResult:
    """``cfg.local_steps`` optimizer steps on batches from ``pool``; data order and dropout are
    fixed by ``seed`` (so the same client, round and seed train identically in any process)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    optimizer = make_optimizer(params, cfg)
    model.train()
    total = 0.0
    for batch in data.train_batches(pool, cfg.batch_size, cfg.local_steps, rng, cfg.group_by_length):
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return FitResult(total / cfg.local_steps, cfg.local_steps, len(pool), time.perf_counter() - start)


@torch.inference_mode()
def evaluate_model(model: torch.nn.Module, data: TokenizedSet, batch_size: int) -> dict[str, float]:
    """Accuracy and mean cross-entropy over ``data``, in length-sorted batches."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for batch in data.eval_batches(batch_size):
        out = model(**batch)
        loss_sum += out.loss.item() * len(batch["labels"])
        correct += (out.logits.argmax(-1) == batch["labels"]).sum().item()
    n = max(len(data), 1)
    return {"accuracy": correct / n, "loss": loss_sum / n}


@torch.inference_mode()
def predict(model: torch.nn.Module, data: TokenizedSet, batch_size: int) -> np.ndarray:
    """Predicted labels in the order of ``data``."""
    model.eval()
    out = np.empty(len(data), dtype=np.int64)
    order = np.argsort(data.lengths, kind="stable")
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        out[idx] = model(**data.collate(idx)).logits.argmax(-1).numpy()
    return out
