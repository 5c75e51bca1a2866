"""The BoMM cloud's classifier psi_1 trained on the labeled samples it holds (L_task at the cloud,
the paired task's loss), their missing modalities completed by the generator."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedtune.methods.bomm.backbone import FEATURE_DIM
from fedtune.methods.bomm.pool import M, Pool
from fedtune.models.precision import model_device


def sample_tensors(zc: np.ndarray, mc: np.ndarray, samples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, V, M, D) views of each sample (V: the most views a sample has) and their mask."""
    v = max(len(s) for s in samples)
    x = np.zeros((len(samples), v, M, FEATURE_DIM), np.float32)
    m = np.zeros((len(samples), v, M), bool)
    for n, rows in enumerate(samples):
        x[n, : len(rows)], m[n, : len(rows)] = zc[rows], mc[rows]
    return torch.from_numpy(x), torch.from_numpy(m)


def cloud_loss(
    classifier: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, unimodal_weight: float
) -> torch.Tensor:
    """CE(fused) + unimodal_weight x CE of every present (view, modality) classified alone (the
    paired task's loss, at the cloud)."""
    fused, single = classifier(x, mask)
    loss = F.cross_entropy(fused, y)
    if unimodal_weight:
        labels = y[:, None, None].expand(mask.shape)
        loss = loss + unimodal_weight * F.cross_entropy(single[mask], labels[mask])
    return loss


def train_classifier(
    classifier: torch.nn.Module,
    pool: Pool,
    zc: np.ndarray,
    mc: np.ndarray,
    samples: list[np.ndarray],
    options: Any,
    seed: int,
    unimodal_weight: float,
) -> dict[str, float]:
    """``options.cloud_epochs`` epochs (Adam, ``cloud_lr``, ``cloud_batch_size``, order and torch
    from ``seed``) on the labeled samples; a sample's label is that of any labeled view. Returns
    the counts and, when it trained, ``cloud_train_loss`` (the last epoch's mean)."""
    o = options
    labels = np.array([next((int(pool.label[r]) for r in rows if pool.label[r] >= 0), -1) for rows in samples])
    labeled = [s for s, y in zip(samples, labels) if y >= 0]
    out = {"cloud_samples": float(len(labeled)), "cloud_multi_view": float(sum(len(s) > 1 for s in labeled))}
    if not labeled or o.cloud_epochs == 0:
        return out
    dev = model_device(classifier)
    x, mask = (t.to(dev) for t in sample_tensors(zc, mc, labeled))
    y = torch.from_numpy(labels[labels >= 0]).to(dev)
    opt = torch.optim.Adam(classifier.parameters(), lr=o.cloud_lr)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    classifier.train()
    total = 0.0
    for _ in range(o.cloud_epochs):
        total = 0.0
        order = torch.from_numpy(rng.permutation(len(y))).to(dev)
        for start in range(0, len(y), o.cloud_batch_size):
            idx = order[start : start + o.cloud_batch_size]
            loss = cloud_loss(classifier, x[idx], mask[idx], y[idx], unimodal_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
    classifier.eval()
    return out | {"cloud_train_loss": total / len(y)}
