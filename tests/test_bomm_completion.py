"""BoMM's preference-driven completion (eqs. (3)-(4)): the implicit reward with its reference model,
the DPO loss and its gradient against hand computation, L_special, L_G's ablations, and generator
training. Two unfaithful variants (the reward without the reference model, and eq. (3)'s bracket as
printed) give other gradients, which the hand check rejects."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedtune.methods.bomm.common import fit_generator, generate
from fedtune.methods.bomm.completion import generator_loss, implicit_reward, preference_loss, special_loss
from fedtune.methods.bomm.networks import Generator


def test_reward_and_losses_on_a_one_dimensional_case_by_hand():
    pred, ref, g_p, g_q = (torch.tensor([[v]]) for v in (1.0, 0.0, 2.0, 0.0))
    # R(g_p) = -((2 - 1)^2 - (2 - 0)^2) = 3, R(g_q) = -((0 - 1)^2 - 0) = -1
    assert implicit_reward(g_p, pred, ref).item() == pytest.approx(3.0)
    assert implicit_reward(g_q, pred, ref).item() == pytest.approx(-1.0)
    assert preference_loss(pred, ref, g_p, g_q, beta=0.5).item() == pytest.approx(math.log1p(math.exp(-2.0)))
    assert special_loss(pred, g_p, torch.tensor([0.25])).item() == pytest.approx(0.75)
    total, parts = generator_loss(pred, ref, g_p, ref, torch.tensor([0.25]), beta=0.5, gamma=2.0)
    # L_G uses g^q = G_ref(x) = ref: R(ref) = -((0 - 1)^2 - 0) = -1 as well here
    assert total.item() == pytest.approx(math.log1p(math.exp(-2.0)) + 2 * 0.75)
    assert parts == pytest.approx({"prefer": math.log1p(math.exp(-2.0)), "special": 0.75})


def hand_gradient(w, w0, x, g_p, g_q, beta, variant="faithful"):
    """dL_prefer/dW for pred = W x, ref = W0 x (numpy), from the formulas (D = rows of W)."""
    d = w.shape[0]
    pred, ref = x @ w.T, x @ w0.T  # (B, D)

    def reward(g):
        out = -(((g - pred) ** 2).sum(1) - ((g - ref) ** 2).sum(1)) / d
        return out if variant != "no-reference" else -(((g - pred) ** 2).sum(1)) / d

    def d_reward(g):  # dR/dW per sample: (2/D) (g - W x) x^T, (B, D, in)
        return 2.0 / d * (g - pred)[:, :, None] * x[:, None, :]

    if variant == "printed-bracket":  # sigma(beta R_p - R_q)
        m = beta * reward(g_p) - reward(g_q)
        dm = beta * d_reward(g_p) - d_reward(g_q)
    else:
        m = beta * (reward(g_p) - reward(g_q))
        dm = beta * (d_reward(g_p) - d_reward(g_q))
    sig = 1 / (1 + np.exp(-m))
    return -((1 - sig)[:, None, None] * dm).mean(0)


def test_preference_loss_gradient_matches_the_hand_formula_and_the_unfaithful_variants_do_not():
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 4))
    w_np = w0 + 0.3 * rng.normal(size=(3, 4))
    x, g_p, g_q = rng.normal(size=(5, 4)), rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    beta = 0.7
    w = torch.tensor(w_np, requires_grad=True)
    xt = torch.tensor(x)
    loss = preference_loss(xt @ w.T, xt @ torch.tensor(w0).T, torch.tensor(g_p), torch.tensor(g_q), beta)
    loss.backward()
    got = w.grad.numpy()
    np.testing.assert_allclose(got, hand_gradient(w_np, w0, x, g_p, g_q, beta), rtol=1e-10, atol=1e-12)
    for variant in ("no-reference", "printed-bracket"):
        assert not np.allclose(got, hand_gradient(w_np, w0, x, g_p, g_q, beta, variant), rtol=1e-3), variant


def test_special_loss_gradient_by_hand():
    rng = np.random.default_rng(1)
    w_np, x, g_p, sim = rng.normal(size=(3, 2)), rng.normal(size=(4, 2)), rng.normal(size=(4, 3)), rng.uniform(-1, 1, 4)
    w = torch.tensor(w_np, requires_grad=True)
    special_loss(torch.tensor(x) @ w.T, torch.tensor(g_p), torch.tensor(sim)).backward()
    pred = x @ w_np.T
    want = (2 / 3 * (pred - g_p) * (1 - sim)[:, None])[:, :, None] * x[:, None, :]
    np.testing.assert_allclose(w.grad.numpy(), want.mean(0), rtol=1e-10)


def test_ablations_drop_the_named_term():
    pred, ref = torch.randn(6, 5, requires_grad=True), torch.randn(6, 5)
    g_p, sim = torch.randn(6, 5), torch.rand(6)
    full, _ = generator_loss(pred, ref, g_p, ref, sim, beta=1.0, gamma=0.5)
    no_pref, parts = generator_loss(pred, ref, g_p, ref, sim, beta=1.0, gamma=0.5, prefer=False)
    no_special, _ = generator_loss(pred, ref, g_p, ref, sim, beta=1.0, gamma=0.0)
    assert "prefer" not in parts and no_pref.item() == pytest.approx(0.5 * special_loss(pred, g_p, sim).item())
    assert no_special.item() == pytest.approx(preference_loss(pred, ref, g_p, ref, 1.0).item())
    assert full.item() == pytest.approx(no_pref.item() + no_special.item())


def test_the_preference_gradient_at_the_reference_pulls_toward_the_preferred_output():
    """At G = G_ref with g^q = G_ref(x): -dL/dG is proportional to (g^p - G(x))."""
    ref = torch.randn(3, 4)
    pred = ref.clone().requires_grad_(True)
    g_p = torch.randn(3, 4)
    preference_loss(pred, ref, g_p, ref, beta=2.0).backward()
    direction = -pred.grad
    cos = F.cosine_similarity(direction, g_p - ref, dim=1)
    np.testing.assert_allclose(cos.numpy(), 1.0, atol=1e-6)


#: the generator fits' shared settings: the reward's beta, preferring the target, seed 0
FIT = {"beta": 1.0, "prefer": True, "seed": 0}


@pytest.mark.parametrize("preference", [False, True])
def test_generator_training_moves_generations_toward_their_targets(preference):
    rng = np.random.default_rng(0)
    d, n = 16, 256
    source = rng.normal(size=(n, d)).astype(np.float32)
    target = rng.integers(0, 2, n)
    mix = rng.normal(size=(2, d, d)).astype(np.float32) / np.sqrt(d)
    g_p = np.stack([source[i] @ mix[t] for i, t in enumerate(target)]).astype(np.float32)
    torch.manual_seed(0)
    gen = Generator(d, hidden=32)

    def error():
        return np.mean([np.mean((generate(gen, source[target == t], t) - g_p[target == t]) ** 2) for t in (0, 1)])

    before = error()
    data = (source, target, g_p, np.zeros(n))
    metrics = fit_generator(gen, *data, preference=preference, gamma=1.0, epochs=20, lr=3e-3, batch_size=32, **FIT)
    assert error() < 0.5 * before
    assert ("generator_prefer" in metrics) == preference and "generator_loss" in metrics


def test_a_fixed_reference_enters_the_reward_and_stays_frozen():
    """``reference`` given (options.reference = "initial"): R uses it, g^q is still the generation on entry."""
    rng = np.random.default_rng(1)
    source, g_p = rng.normal(size=(64, 8)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32)
    target = np.zeros(64, np.int64)
    torch.manual_seed(0)
    gen, reference = Generator(8, hidden=16), Generator(8, hidden=16)
    frozen = {k: v.clone() for k, v in reference.state_dict().items()}
    data = (source, target, g_p, np.zeros(64))
    fit_generator(gen, *data, preference=True, gamma=0.0, epochs=1, lr=1e-3, batch_size=64, reference=reference, **FIT)
    assert all(torch.equal(frozen[k], v) for k, v in reference.state_dict().items())
    # one step by hand: the same gradient as preference_loss with ref = reference(x), g^q = gen_before(x)
    torch.manual_seed(0)
    gen2 = Generator(8, hidden=16)
    before = Generator(8, hidden=16)
    before.load_state_dict(gen2.state_dict())
    src = torch.from_numpy(source)
    loss = preference_loss(
        gen2(src, 0), reference(src, 0).detach(), torch.from_numpy(g_p), before(src, 0).detach(), 1.0
    )
    loss.backward()
    opt = torch.optim.Adam(gen2.parameters(), lr=1e-3)
    opt.step()
    for a, b in zip(gen.parameters(), gen2.parameters()):
        torch.testing.assert_close(a, b)
