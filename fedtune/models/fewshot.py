"""The few-shot model: a 4-block conv backbone (the embedding, x) and linear heads on it (y).

Backbone (Vinyals et al. 2016; Snell et al. 2017): four blocks of 3x3 conv (``filters`` channels,
padding 1), batch norm, ReLU and 2x2 max-pool, flattened; a 28x28 image gives a ``filters``-dim
embedding (28 -> 14 -> 7 -> 3 -> 1).

Heads act on a batch of B episodes at once, one linear classifier (W, b) per episode, W (B, N, d),
b (B, N), logits ``emb @ W^T + b``:

- :func:`prototype_head`: the prototypical-network classifier in closed form (Snell et al. 2017,
  eq. 1-2 with squared Euclidean distance, and their Section 2.3): with c_k the mean support
  embedding of class k, W_k = 2 c_k and b_k = -||c_k||^2, so logit_k(q) = -||q - c_k||^2 + ||q||^2,
  the negative distance up to a constant per query (same softmax).
- :func:`fit_head`: a linear classifier fitted on the support set by ``steps`` gradient-descent
  steps on its cross-entropy from a given start (zero by default), differentiable when asked
  (``create_graph``), so a query loss can be back-propagated into the backbone through the fit:
  the inner problem of hyper-representation learning (Franceschi et al. 2018, Section 3.2).
- ``FewShotNet.head``: one linear layer shared by every episode, for methods that treat the head
  as shared parameters y.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Head = tuple[torch.Tensor, torch.Tensor]  # W (B, N, d), b (B, N)


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))


class Conv4(nn.Sequential):
    """Four conv blocks and a flatten: (n, 1, S, S) -> (n, filters * (S // 16)^2)."""

    def __init__(self, filters: int = 64, channels: int = 1, image_size: int = 28) -> None:
        super().__init__(*(conv_block(channels if i == 0 else filters, filters) for i in range(4)), nn.Flatten())
        side = image_size
        for _ in range(4):
            side //= 2
        self.out_dim = filters * side * side


class FewShotNet(nn.Module):
    """``backbone`` (x, the embedding) and ``head`` (y, a linear layer over ``n_way`` classes)."""

    def __init__(self, n_way: int, filters: int = 64, image_size: int = 28) -> None:
        super().__init__()
        self.backbone = Conv4(filters, 1, image_size)
        self.head = nn.Linear(self.backbone.out_dim, n_way)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """(n, 1, S, S) -> (n, d)."""
        return self.backbone(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits of the shared head, (n, n_way)."""
        return self.head(self.backbone(images))

    def shared_head(self, episodes: int) -> Head:
        """The shared head as one (W, b) per episode: W (B, N, d), b (B, N) (views, gradients flow)."""
        return self.head.weight.expand(episodes, -1, -1), self.head.bias.expand(episodes, -1)


def linear_logits(emb: torch.Tensor, head: Head) -> torch.Tensor:
    """emb (B, M, d), W (B, N, d), b (B, N) -> logits (B, M, N)."""
    weight, bias = head
    return torch.baddbmm(bias.unsqueeze(1), emb, weight.transpose(1, 2))


def episode_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each episode: logits (B, M, N), labels (B, M) -> (B,)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape).mean(1)


def class_means(emb: torch.Tensor, labels: torch.Tensor, n_way: int) -> torch.Tensor:
    """Prototypes c_k = mean of the support embeddings of class k: emb (B, M, d) -> (B, N, d)."""
    onehot = F.one_hot(labels, n_way).to(emb.dtype)  # (B, M, N)
    return onehot.transpose(1, 2) @ emb / onehot.sum(1).clamp_min(1).unsqueeze(-1)


def prototype_head(emb: torch.Tensor, labels: torch.Tensor, n_way: int) -> Head:
    """The ProtoNet classifier as a linear head: W_k = 2 c_k, b_k = -||c_k||^2 (Snell et al. 2017, Sec. 2.3)."""
    protos = class_means(emb, labels, n_way)  # (B, N, d)
    return 2 * protos, -(protos**2).sum(-1)


def fit_head(
    emb: torch.Tensor,
    labels: torch.Tensor,
    n_way: int,
    steps: int,
    lr: float,
    start: Head | None = None,
    create_graph: bool = False,
) -> Head:
    """A linear head fitted on the support set: ``steps`` steps of y <- y - lr * grad_y L_S(y), L_S
    each episode's mean support cross-entropy, from ``start`` (default W = 0, b = 0).

    Episodes are fitted independently (their losses are summed, so each gets its own gradient).
    With ``create_graph`` the steps stay differentiable (gradients reach ``emb`` and ``start``,
    the unrolled inner loop); otherwise the result is detached from ``emb``.
    """
    if start is None:
        weight = emb.new_zeros(emb.shape[0], n_way, emb.shape[-1])
        bias = emb.new_zeros(emb.shape[0], n_way)
    else:
        weight, bias = start
    if not create_graph:
        emb = emb.detach()
        weight, bias = weight.detach(), bias.detach()
    with torch.enable_grad():
        if not weight.requires_grad:
            weight, bias = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        for _ in range(steps):
            loss = episode_cross_entropy(linear_logits(emb, (weight, bias)), labels).sum()
            grad_w, grad_b = torch.autograd.grad(loss, (weight, bias), create_graph=create_graph)
            weight, bias = weight - lr * grad_w, bias - lr * grad_b
    if not create_graph:
        weight, bias = weight.detach(), bias.detach()
    return weight, bias
