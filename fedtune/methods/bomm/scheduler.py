"""The dynamic sample scheduler, BoMM Section 4.1.2, eqs. (5)-(8).

A party trains its small model on its rows plus the cloud's completions of their missing
modality. In each batch b the scheduler decides which completed samples use their generated
modality (:meth:`SampleScheduler.select`, eq. (8)); it learns from the rewards the completed
samples earn (:func:`sample_level_reward`, :func:`batch_level_reward`, eq. (5)) with an exploit
network R^p (eq. (6)) and an explore network R^q (eq. (7)), both residual MLPs
(:class:`ResidualMLP`).

Eq. (5), for completed sample i of batch b, a = (x_bar, y):

    r = -log P_{theta^{b-1}}(y | x_bar) + delta H(P_{theta^{b-1}}(. | x_bar))      sample level
        + (A - Q) / max(A, Q)                                                      batch level

with theta the party's classifier, H the entropy of its prediction, A the batch-average of
exp(L(a; theta^{b-1})) over batch b's completed samples *before* the update on batch b, and Q the
same average over batch b+1's completed samples under theta^b, i.e. *after* it ("we use
batch-average generated loss as an approximation of the expected generated loss"); L is the
classifier's cross-entropy on the completed sample (the paper writes L_G, its symbol for the
generator loss, with the classifier's parameters as argument: the loss *on generated samples*).
Averages rather than the printed sums over N_b keep A and Q comparable when two batches hold
different numbers of completed samples (equal to the sums' ratio when they hold as many).

Eq. (6): R^p regresses the observed rewards, L^p = 1/(2 N_b) sum (R^p(x_bar) - r)^2. Eq. (7): R^q
reads h^p, the concatenated hidden states of R^p *before* its update (theta_p^{b-1}), and regresses
the residual of R^p *after* it, r - R^p(x_bar; theta_p^b). Eq. (8): r_hat = R^p + lambda R^q;
the samples with r_hat > mu are selected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResidualMLP(nn.Module):
    """x (B, in) -> (value (B,), hidden states (B, hidden * (depth + 1))): a linear layer with ReLU,
    ``depth`` residual blocks h <- h + W2 relu(W1 h), a linear output; the hidden states are h after
    the input layer and after every block, concatenated."""

    def __init__(self, in_dim: int, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(in_dim, hidden)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden)) for _ in range(depth)]
        )
        self.out = nn.Linear(hidden, 1)
        self.hidden_dim = hidden * (depth + 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.inp(x))
        states = [h]
        for block in self.blocks:
            h = h + block(h)
            states.append(h)
        return self.out(h).squeeze(-1), torch.cat(states, dim=-1)


class SampleScheduler(nn.Module):
    """R^p (exploit) on x_bar and R^q (explore) on R^p's hidden states, eqs. (6)-(8)."""

    def __init__(self, in_dim: int, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.exploit = ResidualMLP(in_dim, hidden, depth)  # R^p
        self.explore = ResidualMLP(self.exploit.hidden_dim, hidden, depth)  # R^q

    @torch.no_grad()
    def predict(self, xbar: torch.Tensor, lam: float) -> torch.Tensor:
        """Eq. (8): r_hat = R^p(x_bar) + lambda R^q(h^p), (B,)."""
        rp, hp = self.exploit(xbar)
        rq, _ = self.explore(hp)
        return rp + lam * rq

    def select(self, xbar: torch.Tensor, lam: float, mu: float) -> torch.Tensor:
        """(B,) bool: the samples with r_hat > mu (eq. (8))."""
        return self.predict(xbar, lam) > mu

    def update(
        self, xbar: torch.Tensor, rewards: torch.Tensor, opt_p: torch.optim.Optimizer, opt_q: torch.optim.Optimizer
    ) -> tuple[float, float]:
        """One step of eq. (6) on R^p, then one of eq. (7) on R^q (its input h^p taken before R^p's
        step, its target the residual after it); returns the two losses."""
        xbar, rewards = xbar.detach(), rewards.detach()
        with torch.no_grad():
            _, hp_before = self.exploit(xbar)
        rp, _ = self.exploit(xbar)
        loss_p = 0.5 * (rp - rewards).pow(2).mean()
        opt_p.zero_grad(set_to_none=True)
        loss_p.backward()
        opt_p.step()
        with torch.no_grad():
            rp_after, _ = self.exploit(xbar)
        rq, _ = self.explore(hp_before)
        loss_q = 0.5 * (rq - (rewards - rp_after)).pow(2).mean()
        opt_q.zero_grad(set_to_none=True)
        loss_q.backward()
        opt_q.step()
        return loss_p.item(), loss_q.item()


def sample_level_reward(logits: torch.Tensor, labels: torch.Tensor, delta: float) -> torch.Tensor:
    """(B,) -log P(y | x_bar) + delta H(P(. | x_bar)), from the classifier's ``logits`` (B, C)."""
    logp = F.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return -logp.gather(1, labels[:, None]).squeeze(1) + delta * entropy


def batch_level_reward(losses_before: torch.Tensor, losses_after: torch.Tensor) -> float:
    """(A - Q) / max(A, Q) with A = mean exp(losses of batch b before its update) and Q = mean
    exp(losses of batch b+1 after it); 0 when either batch has no completed sample. Losses are
    capped at 50 (exp overflows float32 near 88)."""
    if len(losses_before) == 0 or len(losses_after) == 0:
        return 0.0
    a = float(losses_before.double().clamp(max=50).exp().mean())
    q = float(losses_after.double().clamp(max=50).exp().mean())
    return (a - q) / max(a, q)
