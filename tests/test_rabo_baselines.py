"""RABO's sub-model baselines, each against its own paper / reference code, through the real
Strategy.configure_fit / aggregate_fit and Client.fit; one unfaithful variant each that fails.

- Structures: a sliced sub-network computes exactly what the full network with the pruned
  channels zeroed computes (so the channel groups own the right rows, columns and BN entries).
- Static (HeteroFL): nested prefixes of ceil(beta n) units.
- FedRolex: the window of ceil(beta n) units starting at (round - 1) mod n; every unit equally
  often over n rounds. Unfaithful: a window that does not roll. Aggregation over coverers only
  (hand-computed); unfaithful: averaging over all clients.
- One round of the real engine loop (configure_fit, encoded messages, Client.fit, aggregate_fit)
  for Static, FedRolex and FIARSE: each entry moves by the mean update of the clients whose mask,
  by the method's own definition, held it; entries nobody held are unchanged. Unfaithful: FedRolex
  with a window that does not roll, FedRolex and FIARSE averaging over all replies.
- FIARSE: the kept entries are the k_i largest magnitudes of the model's maskable tensors (k_i the
  width-beta_i sub-model's count). Unfaithful: the first k_i entries by index. TCB-GD: one SGD
  step moves a kept entry by -lr g (1 + 2 tau |theta| / (|theta| + tau)^2) and a pruned one not
  at all. Unfaithful: a plain mask without the threshold's surrogate gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedtune.config import load_config
from fedtune.methods.base.full_model import trainable_tensors
from fedtune.methods.rabo.fedrolex import FedRolexStrategy
from fedtune.methods.rabo.fiarse import FiarseClient, FiarseStrategy, ThresholdMask
from fedtune.methods.rabo.masks import SubModel, choose_units, covered_update, expand, submodel_of
from fedtune.models.structure import structure_of, units_kept
from fedtune.protocol.messages import Message
from fedtune.runtime import RunContext, resolve_run

FEW_SHOT = [
    "task.kind=few-shot",
    "task.filters=8",
    "task.q_query=2",
    "task.eval_episodes=20",
    "task.official_runs=false",
    "train.batch_size=2",
    "train.local_steps=1",
    "federation.num_clients=3",
]
IMAGES = [
    "task.kind=image-classification",
    "model.name=small-cnn",
    "data.name=digits",
    "data.max_train_samples=200",
    "data.max_test_samples=50",
    "federation.num_clients=2",
    "train.optimizer=sgd",
    "train.lr=0.5",
    "train.local_steps=1",
    "train.batch_size=16",
]
PROFILES = "federation.profiles=[{capacity=1.0},{capacity=0.5},{capacity=0.25}]"


def context(method: str, base: list[str], *extra: str) -> RunContext:
    return RunContext(resolve_run(load_config(None, [f"method={method}", *base, *extra])))


def started(ctx: RunContext):
    strategy = ctx.strategy()
    strategy.initialize()
    return strategy


# -- structures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("base", [FEW_SHOT, IMAGES], ids=["conv4", "small-cnn"])
def test_sliced_submodel_computes_the_zero_masked_full_model(base):
    from fedtune.methods.rabo.masks import materialize

    ctx = context("static", base)
    model = ctx.model
    structure = structure_of(model, ctx.task.head_modules())
    rng = np.random.default_rng(0)
    units = {g.name: np.sort(rng.choice(g.size, size=max(1, g.size // 2), replace=False)) for g in structure.groups}
    sub = submodel_of(structure, units)
    full = {
        n: t.detach().numpy()
        for n, t in list(model.named_parameters()) + list(model.named_buffers())
        if n in structure.shapes
    }
    sliced = materialize(model, expand({n: a[sub.masks[n]] for n, a in full.items()}, sub, physical=True))
    zeroed = materialize(model, {n: torch.from_numpy(a * sub.masks[n]) for n, a in full.items()})
    for m in (sliced, zeroed):
        m.train()
    images = torch.rand(6, 1, 28, 28) if base is FEW_SHOT else torch.rand(6, 1, 8, 8)
    with torch.no_grad():
        out_sliced = sliced.embed(images) if base is FEW_SHOT else sliced(images)
        out_zeroed = zeroed.embed(images) if base is FEW_SHOT else zeroed(images)
    if base is FEW_SHOT:  # the sliced embedding holds the kept channels of the last block
        out_zeroed = out_zeroed[:, units[structure.groups[-1].name]]
    assert torch.allclose(out_sliced, out_zeroed, atol=1e-5)


# -- Static (HeteroFL) --------------------------------------------------------------------------------
def test_static_keeps_nested_prefixes_at_capacity():
    strategy = started(context("static", FEW_SHOT, PROFILES))
    for rnd in (1, 2):
        messages = strategy.configure_fit(rnd, [0, 1, 2])
        for cid, capacity in enumerate([1.0, 0.5, 0.25]):
            for g in strategy.structure.groups:
                assert np.array_equal(messages[cid].arrays[f"units/{g.name}"], np.arange(units_kept(capacity, g.size)))


# -- FedRolex -----------------------------------------------------------------------------------------
class StaticWindow(FedRolexStrategy):
    """Unfaithful: a window that never rolls (HeteroFL's slices under FedRolex's name)."""

    policy = "static"


def check_rolling(strategy_cls):
    strategy = started(context("fedrolex", FEW_SHOT, PROFILES))
    strategy.__class__ = strategy_cls
    n = strategy.structure.groups[0].size
    counts = np.zeros(n, dtype=int)
    for rnd in range(1, n + 2):
        messages = strategy.configure_fit(rnd, [0, 1, 2])
        for cid, capacity in enumerate([1.0, 0.5, 0.25]):
            k = units_kept(capacity, n)
            for g in strategy.structure.groups:
                assert np.array_equal(messages[cid].arrays[f"units/{g.name}"], np.sort((rnd - 1 + np.arange(k)) % n))
        if rnd <= n:
            counts[messages[2].arrays["units/g0"]] += 1
    assert (counts == counts[0]).all()  # every unit trained equally often over n rounds


def test_fedrolex_window_rolls_one_unit_per_round():
    check_rolling(FedRolexStrategy)


def test_a_window_that_does_not_roll_fails():
    with pytest.raises(AssertionError):
        check_rolling(StaticWindow)


class AllClientsAverage(FedRolexStrategy):
    """Unfaithful: each entry's sum divided by the number of replies, not by its coverers."""

    def aggregate(self, old, contributions, scale):
        new, counts = covered_update(old, contributions, scale)
        n = len(contributions)
        return {
            k: (v + (new[k] - v) * counts[k] / n).astype(v.dtype) if k in counts else new[k] for k, v in old.items()
        }, counts


def check_coverer_average(strategy_cls):
    """Entry coverage by hand: client 0 holds entries {0, 1}, client 1 holds {1, 2}, entry 3 nobody."""
    strategy = started(context("fedrolex", FEW_SHOT))
    strategy.__class__ = strategy_cls
    name = "backbone.0.0.bias"  # (8,)
    old = strategy.global_arrays[name].copy()
    masks = [np.zeros(8, bool), np.zeros(8, bool)]
    masks[0][[0, 1]] = True
    masks[1][[1, 2]] = True
    full = {n: np.ones(a.shape, bool) for n, a in strategy.global_arrays.items()}
    strategy.subs = {
        cid: SubModel({**{n: np.zeros_like(m) for n, m in full.items()}, name: masks[cid]}) for cid in (0, 1)
    }
    zero = {f"d/{n}": np.zeros(0, np.float32) for n in strategy.global_arrays if n != name}
    replies = {
        0: Message({**zero, f"d/{name}": np.array([1.0, 2.0], np.float32)}, {"train_loss": 0.0}),
        1: Message({**zero, f"d/{name}": np.array([4.0, 6.0], np.float32)}, {"train_loss": 0.0}),
    }
    strategy.aggregate_fit(1, replies)
    new = strategy.global_arrays[name]
    assert np.allclose(new[:4] - old[:4], [1.0, 3.0, 6.0, 0.0]), new[:4] - old[:4]
    assert np.array_equal(new[3:], old[3:])


def test_fedrolex_averages_over_coverers_only():
    check_coverer_average(FedRolexStrategy)


def test_averaging_over_all_clients_fails():
    with pytest.raises(AssertionError):
        check_coverer_average(AllClientsAverage)


# -- FIARSE -------------------------------------------------------------------------------------------
class IndexMasks(FiarseStrategy):
    """Unfaithful: the first k_i entries of each tensor (by index) instead of the largest magnitudes."""

    def submodel(self, rnd, cid):
        k = self.budget(cid)
        masks = {}
        for n, a in self.global_arrays.items():
            m = np.zeros(a.size, bool)
            if n in self.maskable:
                take = min(k, a.size)
                m[:take] = True
                k -= take
            else:
                m[:] = True
            masks[n] = m.reshape(a.shape)
        return SubModel(masks)


def check_magnitude_masks(strategy_cls):
    ctx = context("fiarse", IMAGES, "federation.profiles=[{capacity=0.5},{capacity=0.25}]")
    strategy = started(ctx)
    strategy.__class__ = strategy_cls
    strategy.configure_fit(1, [0, 1])
    for cid, capacity in enumerate([0.5, 0.25]):
        sub = strategy.subs[cid]
        width = submodel_of(
            strategy.structure, {g.name: choose_units("static", g, capacity, 1, cid) for g in strategy.structure.groups}
        )
        budget = sum(width.kept(n) for n in strategy.maskable)
        kept = np.concatenate([np.abs(strategy.global_arrays[n])[sub.masks[n]] for n in strategy.maskable])
        dropped = np.concatenate([np.abs(strategy.global_arrays[n])[~sub.masks[n]] for n in strategy.maskable])
        assert len(kept) == budget
        assert kept.min() >= dropped.max()  # the budget's largest magnitudes, model-wise


def test_fiarse_keeps_the_largest_magnitudes():
    check_magnitude_masks(FiarseStrategy)


def test_index_masks_fail():
    with pytest.raises(AssertionError):
        check_magnitude_masks(IndexMasks)


class PlainMask(torch.nn.Module):
    def __init__(self, tau):
        super().__init__()
        self.tau = tau

    def forward(self, theta):
        return theta * (theta.abs() >= self.tau)


class PlainMaskClient(FiarseClient):
    """Unfaithful: masks the weights without TCB-GD's surrogate gradient."""

    def prepare(self, model, sub, physical, message):
        from torch.nn.utils import parametrize

        for name in self.masked:
            owner, _, leaf = name.rpartition(".")
            parametrize.register_parametrization(model.get_submodule(owner), leaf, PlainMask(self.tau))


def check_tcb_step(client_cls):
    # Prepare: one SGD step (lr 0.5) of a client of capacity 0.5
    from fedtune.methods.rabo.fiarse import maskable
    from fedtune.methods.rabo.masks import magnitude_masks, materialize

    ctx = context("fiarse", IMAGES, "federation.profiles=[{capacity=0.5}]", "federation.num_clients=1")
    strategy = started(ctx)
    message = Message.decode(strategy.configure_fit(1, [0])[0].encode())
    client = client_cls(0, ctx.profiles[0], ctx, {})
    # Execute
    reply = client.fit(message)
    # Assert: the step by hand, autograd on theta (.) m with the client's batch
    theta = strategy.global_arrays
    names = maskable(ctx.model, theta)
    masks, tau = magnitude_masks(theta, names, strategy.budget(0))
    effective = {n: torch.from_numpy(theta[n] * masks[n]) for n in theta}
    model = materialize(ctx.model, effective)
    seed = client.train_seed(1)
    batch = next(iter(ctx.task.train_batches(ctx.partitions[0], 16, 1, np.random.default_rng(seed))))
    model.train()
    grads = dict(zip(theta, torch.autograd.grad(ctx.task.loss(model, batch), list(trainable_tensors(model).values()))))
    for n in theta:
        a = np.abs(theta[n])
        factor = 1 + 2 * tau * a / (a + tau) ** 2 if n in names else 1.0
        expected = (-0.5 * grads[n].numpy() * factor)[masks[n]]
        assert np.allclose(reply.arrays[f"d/{n}"], expected, atol=1e-6), n
    assert sum(int(m.sum()) for n, m in masks.items() if n in names) == strategy.budget(0)


def test_fiarse_step_is_threshold_controlled_biased_gradient_descent():
    check_tcb_step(FiarseClient)


def test_a_plain_mask_without_the_surrogate_gradient_fails():
    with pytest.raises(AssertionError):
        check_tcb_step(PlainMaskClient)


def test_threshold_mask_gradient_by_hand():
    theta = torch.tensor([0.5, -2.0, 0.1], requires_grad=True)
    out = ThresholdMask(tau=1.0)(theta)
    out.sum().backward()
    assert torch.equal(out.detach(), torch.tensor([0.0, -2.0, 0.0]))
    assert torch.allclose(theta.grad, torch.tensor([0.0, 1 + 2 * 2.0 / 9.0, 0.0]))


# -- one engine round of each sub-model baseline, by its own definition --------------------------------
def defined_masks(
    method: str, strategy, old: dict[str, np.ndarray], rnd: int, cid: int, message: Message
) -> dict[str, np.ndarray]:
    """Client ``cid``'s mask in round ``rnd`` from its paper's definition, not from the strategy:
    Static, the first ceil(beta n) units of every group (HeteroFL); FedRolex, ceil(beta n) units
    from (rnd - 1) mod n, wrapping (FedRolex eq. (4)); FIARSE, the entries of the maskable tensors
    with |theta| >= the budget's largest magnitude in the round-start model ``old`` (model-wise top-k)."""
    capacity = strategy.capacity(cid)
    if method == "fiarse":
        k = int(message.meta["budget"])
        flat = np.sort(np.concatenate([np.abs(old[n]).ravel() for n in strategy.maskable]))
        tau = flat[-k]
        return {n: (np.abs(a) >= tau) if n in strategy.maskable else np.ones(a.shape, bool) for n, a in old.items()}
    units = {}
    for g in strategy.structure.groups:
        k = units_kept(capacity, g.size)
        units[g.name] = np.arange(k) if method == "static" else np.sort((rnd - 1 + np.arange(k)) % g.size)
    return submodel_of(strategy.structure, units).masks


def check_engine_round(method: str, strategy_cls=None, rounds: int = 2):
    """``rounds`` rounds of the real engine loop (``run_rounds``: configure_fit, encoded messages,
    Client.fit, aggregate_fit); in every round each entry moves by the mean of the uploaded updates
    of the clients whose mask (by the method's definition) held it, and an entry nobody held keeps
    its value. Capacities 1/2 and 1/4: some entries have 2 coverers, some 1, some none."""
    from fedtune.engines.embedded import run_rounds
    from fedtune.methods import get_method

    ctx = context(method, FEW_SHOT, "federation.num_clients=2", "federation.profiles=[{capacity=0.5},{capacity=0.25}]")
    strategy = started(ctx)
    if strategy_cls is not None:
        strategy.__class__ = strategy_cls
    seen: dict[int, dict] = {}
    configure, aggregate = strategy.configure_fit, strategy.aggregate_fit

    def record_configure(rnd, ids):
        seen[rnd] = {"old": {n: a.copy() for n, a in strategy.global_arrays.items()}}
        messages = configure(rnd, ids)
        seen[rnd]["sent"] = {cid: Message.decode(m.encode()) for cid, m in messages.items()}
        return messages

    def record_aggregate(rnd, replies):
        seen[rnd]["replies"] = replies
        out = aggregate(rnd, replies)
        seen[rnd]["new"] = {n: a.copy() for n, a in strategy.global_arrays.items()}
        return out

    strategy.configure_fit, strategy.aggregate_fit = record_configure, record_aggregate
    client_cls = get_method(method).client
    run_rounds(
        strategy,
        lambda cid, state: client_cls(cid, ctx.profiles[cid], ctx, state),
        2,
        2,
        rounds,
        seed=0,
        eval_every=rounds,
    )
    counts_seen = set()
    for rnd, r in seen.items():
        masks = {cid: defined_masks(method, strategy, r["old"], rnd, cid, m) for cid, m in r["sent"].items()}
        for name, old in r["old"].items():
            total, count = np.zeros(old.shape), np.zeros(old.shape, int)
            for cid, reply in r["replies"].items():
                total[masks[cid][name]] += reply.arrays[f"d/{name}"]
                count[masks[cid][name]] += 1
            expected = old.astype(np.float64).copy()
            expected[count > 0] += total[count > 0] / count[count > 0]
            assert np.allclose(r["new"][name], expected, atol=1e-6), (rnd, name)
            assert np.array_equal(r["new"][name][count == 0], old[count == 0])  # nobody held it: unchanged
            counts_seen |= set(np.unique(count).tolist())
    assert counts_seen == {0, 1, 2}


class RolexAllClients(FedRolexStrategy):
    """Unfaithful FedRolex: every entry's sum over the replies divided by the number of replies."""

    aggregate = AllClientsAverage.aggregate


class FiarseAllClients(FiarseStrategy):
    """Unfaithful FIARSE: ``tot_grad / n`` instead of ``tot_grad / tot_mask``."""

    aggregate = AllClientsAverage.aggregate


@pytest.mark.parametrize("method", ["static", "fedrolex", "fiarse"])
def test_engine_round_averages_each_entry_over_its_coverers(method):
    check_engine_round(method)


@pytest.mark.parametrize(
    ("method", "variant"),
    [
        ("fedrolex", StaticWindow),  # the window does not roll: round 2's masks are not FedRolex's
        ("fedrolex", RolexAllClients),
        ("fiarse", FiarseAllClients),
    ],
    ids=["fedrolex-static-window", "fedrolex-all-clients-average", "fiarse-all-clients-average"],
)
def test_unfaithful_baselines_fail_the_engine_round(method, variant):
    with pytest.raises(AssertionError):
        check_engine_round(method, variant)
