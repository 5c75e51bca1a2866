"""Preference-driven modality completion, BoMM Section 4.1.1, eqs. (3)-(4).

The generator G (the cloud's psi_2) maps the representation of a modality a sample has to the
one it lacks. For each (sample i, generated modality) the preference pair is (g_i^p, g_i^q):
g_i^p, the preferred output, is the real representation of the target modality where the sample
has one (its own row, or an aligned partner's), else the target modality of its closest global
prototype o_i; g_i^q, the non-preferred output, is the generation the cloud last made for it.

**Reward and reference model.** Eq. (3) is DPO's loss (Rafailov et al. 2023) with the reward
R(x, g) scaled by beta. DPO's reward is the implicit one, R(x, g) = log pi_psi(g | x) -
log pi_ref(g | x); in representation space the policy is a Gaussian around the generator's
output, pi_psi(g | x) = N(G_psi(x), (D/2) I), so

    R(x, g) = -( ||g - G_psi(x)||^2 - ||g - G_ref(x)||^2 ) / D            (D: the modality's width)

the squared-error form that Diffusion-DPO and RankDPO (Karthik et al. 2024, cited for images) use.
The reward is computed per generated modality (each has its own generator head and width D). The
non-preferred output g^q is the generation the cloud last sent the party, i.e. the generator's
output at the start of the round. The reference G_ref is, by default (``options.reference =
"round"``), that same generator frozen at the start of the round: iterative DPO, whose reference is
refreshed every round; ``"initial"`` keeps the generator as initialized (seeded) as a fixed
reference. Then R(x, g^q) = -||G_psi(x) - G_ref(x)||^2 / D and the margin is linear in G_psi along
g^p - g^q.

**beta** (not stated in the paper) defaults to 1. Measured on the digits recipe (8 rounds): with
beta = 1 the test completions' cosine to the real representations stays at 0.07-0.13; with beta = 5
(either reference) it alternates between about 0.1 and 0 from round to round: a strong push away
from last round's generation overshoots, and the next round pushes back.

Eq. (3) as printed reads sigma(beta(R(x, g^p)) - R(x, g^q)); the bracket is a typo of DPO's
sigma(beta (R(x, g^p) - R(x, g^q))), which is what :func:`preference_loss` computes.

Eq. (4): L_special = ||g^q - g^p||^2 (1 - sim(x, o_i)), where g^q is the *current* generation
G_psi(x) (this is the term through which the generator's output itself is pulled) and sim the
cosine between the sample's present modality and the same modality of its prototype o_i; squared
norms are divided by D like the reward. L_G = L_prefer + gamma L_special (:func:`generator_loss`;
``prefer=False`` drops L_prefer, the ablation "w/o preference loss"; gamma = 0, "w/o special loss").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def implicit_reward(g: torch.Tensor, pred: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """(B,) R(x, g) = -(||g - G_psi(x)||^2 - ||g - G_ref(x)||^2) / D, for g, G_psi(x) = ``pred``
    and G_ref(x) = ``ref``, all (B, D)."""
    d = g.shape[-1]
    return -((g - pred).pow(2).sum(-1) - (g - ref).pow(2).sum(-1)) / d


def preference_loss(
    pred: torch.Tensor, ref: torch.Tensor, g_p: torch.Tensor, g_q: torch.Tensor, beta: float
) -> torch.Tensor:
    """Eq. (3): -mean log sigma(beta (R(x, g^p) - R(x, g^q)))."""
    margin = implicit_reward(g_p, pred, ref) - implicit_reward(g_q, pred, ref)
    return -F.logsigmoid(beta * margin).mean()


def special_loss(pred: torch.Tensor, g_p: torch.Tensor, sim: torch.Tensor) -> torch.Tensor:
    """Eq. (4): mean ||G_psi(x) - g^p||^2 / D * (1 - sim(x, o_i))."""
    d = pred.shape[-1]
    return ((pred - g_p).pow(2).sum(-1) / d * (1.0 - sim)).mean()


def generator_loss(
    pred: torch.Tensor,
    ref: torch.Tensor,
    g_p: torch.Tensor,
    g_q: torch.Tensor,
    sim: torch.Tensor,
    beta: float,
    gamma: float,
    prefer: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_G = L_prefer + gamma L_special for one generated modality: ``pred`` = G_psi(x), ``ref`` =
    G_ref(x) and ``g_q`` (both detached here), ``g_p``, ``sim``; returns the loss and its parts."""
    ref, g_q = ref.detach(), g_q.detach()
    special = special_loss(pred, g_p, sim)
    loss = gamma * special
    parts = {"special": float(special.detach())}
    if prefer:
        prefer_term = preference_loss(pred, ref, g_p, g_q, beta)
        loss = loss + prefer_term
        parts["prefer"] = float(prefer_term.detach())
    return loss, parts
