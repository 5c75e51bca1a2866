"""BoMM's dynamic sample scheduler (eqs. (5)-(8)): the rewards by hand, the selection r_hat > mu
exactly, and one step of eqs. (6)-(7) against a hand-written replica. (The scheduler inside a
party's training is tested in tests/test_bomm_method.py.)"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from fedtune.methods.bomm.scheduler import ResidualMLP, SampleScheduler, batch_level_reward, sample_level_reward


def test_sample_level_reward_is_the_loss_plus_delta_times_the_entropy():
    logits = torch.tensor([[0.0, math.log(3.0)], [2.0, 2.0]])  # p = (1/4, 3/4); (1/2, 1/2)
    labels = torch.tensor([0, 1])
    h0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    want = [-math.log(0.25) + 0.2 * h0, -math.log(0.5) + 0.2 * math.log(2)]
    np.testing.assert_allclose(sample_level_reward(logits, labels, 0.2).numpy(), want, rtol=1e-6)


def test_batch_level_reward_is_the_relative_drop_of_mean_exp_loss():
    before, after = torch.tensor([0.0, math.log(3.0)]), torch.tensor([math.log(1.5)])  # A = 2, Q = 1.5
    assert batch_level_reward(before, after) == pytest.approx((2 - 1.5) / 2)
    assert batch_level_reward(after, before) == pytest.approx((1.5 - 2) / 2)
    assert batch_level_reward(before, torch.zeros(0)) == 0.0
    assert np.isfinite(batch_level_reward(torch.tensor([500.0]), torch.tensor([1.0])))  # capped, no overflow


def test_residual_mlp_exposes_its_hidden_states_for_the_explore_network():
    net = ResidualMLP(7, hidden=5, depth=2)
    value, hidden = net(torch.randn(3, 7))
    assert value.shape == (3,) and hidden.shape == (3, 15) and net.hidden_dim == 15
    sched = SampleScheduler(7, hidden=5, depth=2)
    assert sched.explore.inp.in_features == 15


@pytest.mark.parametrize("lam", [0.0, 0.5, 2.0])
def test_selection_is_exactly_the_samples_whose_predicted_reward_exceeds_mu(lam):
    torch.manual_seed(0)
    sched = SampleScheduler(6, hidden=8)
    x = torch.randn(200, 6)
    rp, hp = sched.exploit(x)
    rq, _ = sched.explore(hp)
    r_hat = (rp + lam * rq).detach()
    np.testing.assert_allclose(sched.predict(x, lam).numpy(), r_hat.numpy(), rtol=1e-6)
    for mu in [*np.quantile(r_hat.numpy(), [0.1, 0.5, 0.9]), float(r_hat[17]), -1e9, 1e9]:
        chosen = sched.select(x, lam, float(mu))
        assert torch.equal(chosen, sched.predict(x, lam) > float(mu))
    assert not sched.select(x, lam, float(sched.predict(x, lam)[17]))[17]  # strictly greater


def test_one_update_follows_eqs_6_and_7():
    torch.manual_seed(1)
    sched = SampleScheduler(4, hidden=6)
    replica = copy.deepcopy(sched)
    x, r = torch.randn(9, 4), torch.randn(9)
    lr = 0.1
    sched.update(
        x, r, torch.optim.SGD(sched.exploit.parameters(), lr=lr), torch.optim.SGD(sched.explore.parameters(), lr=lr)
    )
    # by hand: R^q reads R^p's hidden states *before* R^p's step, and regresses r - R^p *after* it
    with torch.no_grad():
        _, hp_before = replica.exploit(x)
    loss_p = ((replica.exploit(x)[0] - r) ** 2).sum() / (2 * len(r))  # eq. (6): 1/(2 N_b) sum (...)^2
    grads = torch.autograd.grad(loss_p, list(replica.exploit.parameters()))
    with torch.no_grad():
        for p, g in zip(replica.exploit.parameters(), grads):
            p -= lr * g
        rp_after = replica.exploit(x)[0]
    loss_q = ((replica.explore(hp_before)[0] - (r - rp_after)) ** 2).sum() / (2 * len(r))  # eq. (7)
    grads = torch.autograd.grad(loss_q, list(replica.explore.parameters()))
    with torch.no_grad():
        for p, g in zip(replica.explore.parameters(), grads):
            p -= lr * g
    for a, b in zip(sched.parameters(), replica.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_repeated_updates_learn_the_rewards():
    torch.manual_seed(2)
    sched = SampleScheduler(3, hidden=16)
    x = torch.randn(64, 3)
    r = x[:, 0] * 2 + 1
    opt_p, opt_q = (
        torch.optim.Adam(sched.exploit.parameters(), 1e-2),
        torch.optim.Adam(sched.explore.parameters(), 1e-2),
    )
    first, _ = sched.update(x, r, opt_p, opt_q)
    for _ in range(300):
        last, _ = sched.update(x, r, opt_p, opt_q)
    assert last < 0.05 * first
