"""RABO, RAFBO and the full-model bilevel baseline through the real Strategy / Client and the
engine's round loop (messages encoded, both phases byte-accounted).

- A bilevel problem with closed-form pieces (quadratic in y) run for one round through the
  embedded engine: y_{q+1} (eq. (6)) and x_{q+1} (eq. (8)) recomputed by hand in numpy from the
  masks, the T inner steps and the local hypergradients on the sub-models.
- Parameter-wise aggregation on a hand-computed case: uncovered entries unchanged, covered ones
  averaged over their coverers only. The unfaithful variant that averages over all clients fails.
- Few-shot (the real task, a tiny Conv4): masks exactly at capacity, the inner phase equal to the
  task's own ``fit_head`` (which fixes the sign of G_q^i; Algorithm 1's literal sign fails), the
  losses equal to the task's ``support_loss`` / ``query_loss``, coverage C_x^* in the metrics,
  smaller clients uploading fewer bytes, and resume.
- Unfaithful variants of RABO that fail the closed-form round: averaging over all clients instead
  of the coverers (eqs. (6), (8)), Algorithm 1 line 10's literal sign of G, a first-order
  hypergradient (eq. (7) without the implicit term), eq. (7) solved off the sub-model (full y).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedtune.config import load_config
from fedtune.engines.embedded import run_rounds
from fedtune.methods.rabo.masks import SubModel, covered_update
from fedtune.methods.rabo.rabo import BilevelClient, RaboOptions, RaboStrategy
from fedtune.models.bilevel import BilevelProblem
from fedtune.models.structure import Member, Structure, UnitGroup, units_kept
from fedtune.protocol.messages import Message
from fedtune.protocol.profiles import ClientProfile
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run

TINY_FEW_SHOT = [
    "task.kind=few-shot",
    "task.head=fitted",
    "task.filters=8",
    "task.q_query=2",
    "task.eval_episodes=20",
    "task.official_runs=false",
    "train.batch_size=2",
    "federation.num_clients=3",
    "rounds=2",
    "train.eval_batch_size=64",
]
CAPACITIES = [1.0, 0.5, 0.25]
PROFILES = "federation.profiles=[{capacity=1.0},{capacity=0.5},{capacity=0.25}]"


# -- a problem with closed-form pieces ---------------------------------------------------------------
D1, D2, T, BETA, ALPHA = 6, 4, 3, 0.1, 0.5


class Quadratic(BilevelProblem):
    """g_i = 1/2 y^T A_i y - y^T B_i phi(x), f_i = 1/2 ||y - t_i||^2 + 1/2 ||x||^2, phi(x) = x + x^2 / 2;
    x and y are one unit group each (entry-level units), zero-masked full-size tensors."""

    outer, inner = ["x"], ["y"]

    def __init__(self, context, options, seed=0):
        super().__init__(context, options)
        rng = np.random.default_rng(seed)
        n = context.config.federation.num_clients
        m = rng.normal(size=(n, D2, D2))
        self.A = m @ m.transpose(0, 2, 1) + D2 * np.eye(D2)
        self.B, self.t = rng.normal(size=(n, D2, D1)), rng.normal(size=(n, D2))
        self.x0 = rng.normal(size=D1).astype(np.float32)

    def initial(self):
        return {"x": self.x0.copy()}, {"y": np.zeros(D2, np.float32)}

    def structure(self):
        return Structure(
            [UnitGroup("gx", D1, (Member("x", 0),)), UnitGroup("gy", D2, (Member("y", 0),))],
            {"x": (D1,), "y": (D2,)},
            physical=False,
        )

    def data(self, cid, rnd):
        return cid

    def inner_batches(self, data, steps):
        return [data] * steps

    def hyper_batches(self, data):
        return data, data

    def _t(self, a):
        return torch.as_tensor(a, dtype=torch.float32)

    def g(self, x, y, cid):
        phi = x["x"] + 0.5 * x["x"] ** 2
        return 0.5 * y["y"] @ self._t(self.A[cid]) @ y["y"] - y["y"] @ (self._t(self.B[cid]) @ phi)

    def f(self, x, y, cid):
        return 0.5 * ((y["y"] - self._t(self.t[cid])) ** 2).sum() + 0.5 * (x["x"] ** 2).sum()

    def evaluate(self, x, y):
        return {}

    def prepare(self):
        pass


def quadratic_context(capacities, **options):
    cfg = load_config(None, [f"federation.num_clients={len(capacities)}", "method=rabo", "seed=0"])
    opts = RaboOptions(
        outer_lr=ALPHA, inner_lr=BETA, inner_steps=T, inner_l2=0.0, solver="cg", solver_iters=50, **options
    )
    ctx = SimpleNamespace(
        config=cfg,
        options=opts,
        profiles=[ClientProfile(capacity=c) for c in capacities],
        partitions=[np.arange(1)] * len(capacities),
        model=torch.nn.Module(),
    )
    ctx.example_bound = lambda kind, cid: len(ctx.partitions[cid])  # a reply's examples: its partition's, as RunContext
    ctx.task = SimpleNamespace(kind="quadratic", bilevel_problem=lambda c, o: Quadratic(c, o))
    return ctx


def expected_round(problem: Quadratic, capacities):
    """One RABO round by hand: importance masks (x by |x0|, y all zero -> the first k), T masked
    inner steps from y_q (.) m_y, eq. (6), then each client's hypergradient on its sub-model, eq. (8)."""
    x0, y0 = problem.x0.astype(np.float64), np.zeros(D2)
    masks = []
    for c in capacities:
        mx, my = np.zeros(D1, bool), np.zeros(D2, bool)
        mx[np.argsort(-np.abs(x0), kind="stable")[: units_kept(c, D1)]] = True
        my[: units_kept(c, D2)] = True
        masks.append((mx, my))
    total, count = np.zeros(D2), np.zeros(D2)
    for i, (mx, my) in enumerate(masks):
        xs, y = x0 * mx, y0 * my
        for _ in range(T):
            y = y - BETA * (problem.A[i] @ y - problem.B[i] @ (xs + 0.5 * xs**2)) * my
        total[my] += ((y0 * my - y) / BETA)[my]
        count[my] += 1
    y1 = y0.copy()
    y1[count > 0] -= BETA * total[count > 0] / count[count > 0]
    total, count = np.zeros(D1), np.zeros(D1)
    for i, (mx, my) in enumerate(masks):
        xs, ys, s = x0 * mx, y1 * my, np.flatnonzero(my)
        grad_y = (ys - problem.t[i])[s]
        v = np.linalg.solve(problem.A[i][np.ix_(s, s)], grad_y)
        hyper = xs + (1 + xs) * (problem.B[i][s].T @ v)
        total[mx] += hyper[mx]
        count[mx] += 1
    x1 = x0.copy()
    x1[count > 0] -= ALPHA * total[count > 0] / count[count > 0]
    return masks, y1, x1


def closed_form_round(strategy_cls=RaboStrategy, client_cls=BilevelClient):
    """One RABO round of ``strategy_cls`` / ``client_cls`` on the quadratic problem through the
    embedded engine's round loop (messages encoded, both phases), checked against the round by hand."""
    # Prepare
    capacities = [1.0, 0.5, 0.5]
    server = quadratic_context(capacities)
    strategy = strategy_cls(server)
    strategy.initialize()
    clients = quadratic_context(capacities)
    # Execute: the real round loop (messages encoded), phases inner and hypergradient
    history = run_rounds(
        strategy,
        lambda cid, state: client_cls(cid, clients.profiles[cid], clients, state),
        len(capacities),
        len(capacities),
        1,
        seed=0,
    )
    # Assert
    masks, y1, x1 = expected_round(strategy.problem, capacities)
    for cid, (mx, my) in enumerate(masks):
        assert np.array_equal(strategy.subs[cid].masks["x"], mx) and np.array_equal(strategy.subs[cid].masks["y"], my)
    assert np.allclose(strategy.y["y"], y1, atol=1e-5), (strategy.y["y"], y1)
    assert np.allclose(strategy.x["x"], x1, atol=1e-4), (strategy.x["x"], x1)
    record = history[0]
    assert record.metrics["C_x_round"] == 1 and record.metrics["C_x_star"] == 1  # x entries only client 0 holds
    assert record.metrics["C_y_round"] == 1
    assert all(record.client_bytes_up[c] > 0 and record.client_bytes_down[c] > 0 for c in range(3))


def test_one_round_on_closed_form_problem_through_the_engine():
    closed_form_round()


class LiteralSignClient(BilevelClient):
    """Unfaithful: uploads Algorithm 1 line 10 literally, G = (y_T - y_0) / beta."""

    def fit(self, message):
        reply = super().fit(message)
        return Message({k: -v if k.startswith("G/") else v for k, v in reply.arrays.items()}, reply.meta)


class FirstOrderClient(BilevelClient):
    """Unfaithful: drops eq. (7)'s implicit term, uploading grad_x f alone (a first-order method)."""

    def hypergradient(self, problem, x, y, data, sub, physical, rnd):
        xn, yn, bind = self._closures(problem, x, y)
        _, zeta = problem.hyper_batches(data)
        xs = [x[n].requires_grad_() for n in xn]
        outer = bind(problem.f, zeta)(xs, [y[n] for n in yn])
        return dict(zip(xn, torch.autograd.grad(outer, xs))), float(outer.detach())


class FullModelHypergradClient(BilevelClient):
    """Unfaithful: solves eq. (7) on the full y instead of the client's inner sub-model (ignores m_y)."""

    def hypergradient(self, problem, x, y, data, sub, physical, rnd):
        xn, yn, bind = self._closures(problem, x, y)
        xi, zeta = problem.hyper_batches(data)
        from fedtune.methods.rabo.hypergrad import implicit_hypergradient

        o = self.options
        hyper, outer = implicit_hypergradient(
            bind(problem.g, xi),
            bind(problem.f, zeta),
            [x[n].requires_grad_() for n in xn],
            [y[n].requires_grad_() for n in yn],
            solver=o.solver,
            iters=o.solver_iters,
        )
        return dict(zip(xn, hyper)), outer


# -- parameter-wise aggregation, by hand ---------------------------------------------------------------
def sub_of(**masks) -> SubModel:
    return SubModel({k: np.asarray(v, dtype=bool) for k, v in masks.items()})


class AllClientsAverage(RaboStrategy):
    """Unfaithful: divides every entry's sum by the number of replies instead of its coverers."""

    def aggregate(self, old, contributions, scale):
        new, counts = covered_update(old, contributions, scale)
        n = len(contributions)
        out = {}
        for k, v in old.items():
            if k not in counts:
                out[k] = new[k]
                continue
            summed = (new[k].astype(np.float64) - v) / scale * counts[k]
            out[k] = (v + scale * summed / n).astype(v.dtype)
        return out, counts


def check_parameter_wise(strategy_cls):
    """x = [1, 2, 3, 4]; client 0 covers entries 0, 1 with H = [1, 1]; client 1 covers 1, 2 with
    H = [3, 5]; alpha = 0.5: x' = [1 - .5, 2 - .5 (1 + 3) / 2, 3 - .5 * 5, 4] = [.5, 1, .5, 4]."""
    strategy = strategy_cls(quadratic_context([1.0, 1.0]))
    strategy.initialize()
    strategy.x = {"x": np.array([1.0, 2.0, 3.0, 4.0], np.float32)}
    strategy.subs = {0: sub_of(x=[1, 1, 0, 0], y=[1, 0, 0, 0]), 1: sub_of(x=[0, 1, 1, 0], y=[0, 1, 0, 0])}
    replies = {
        0: Message({"H/x": np.array([1.0, 1.0], np.float32)}, {"outer_loss": 0.0}),
        1: Message({"H/x": np.array([3.0, 5.0], np.float32)}, {"outer_loss": 0.0}),
    }
    metrics = strategy.aggregate_phase("hypergradient", 1, replies)
    assert np.allclose(strategy.x["x"], [0.5, 1.0, 0.5, 4.0]), strategy.x["x"]
    assert metrics["C_x_round"] == 1 and metrics["covered_x"] == pytest.approx(0.75)
    # eq. (6) on y, beta = 0.1: y' = y - beta G on each client's own entry, the rest unchanged
    strategy.y = {"y": np.array([1.0, 1.0, 1.0, 1.0], np.float32)}
    replies = {
        0: Message({"G/y": np.array([2.0], np.float32)}, {"train_loss": 0.0}),
        1: Message({"G/y": np.array([-4.0], np.float32)}, {"train_loss": 0.0}),
    }
    strategy.aggregate_fit(1, replies)
    assert np.allclose(strategy.y["y"], [0.8, 1.4, 1.0, 1.0]), strategy.y["y"]


def test_parameter_wise_aggregation_averages_over_coverers_only():
    check_parameter_wise(RaboStrategy)


def test_averaging_over_all_clients_fails_the_hand_computed_case():
    with pytest.raises(AssertionError):
        check_parameter_wise(AllClientsAverage)


@pytest.mark.parametrize(
    ("strategy_cls", "client_cls"),
    [
        (AllClientsAverage, BilevelClient),  # eqs. (6), (8) divided by all replies, not by C^k
        (RaboStrategy, LiteralSignClient),  # Alg. 1 line 10's sign: y moves up its gradient
        (RaboStrategy, FirstOrderClient),  # eq. (7) without the implicit term
        (RaboStrategy, FullModelHypergradClient),  # eq. (7) solved on the full y, not the sub-model
    ],
    ids=["all-clients-average", "literal-sign-of-G", "first-order-hypergradient", "hypergradient-off-the-sub-model"],
)
def test_unfaithful_rabo_fails_the_closed_form_round(strategy_cls, client_cls):
    with pytest.raises(AssertionError):
        closed_form_round(strategy_cls, client_cls)


# -- the few-shot task -------------------------------------------------------------------------------
@pytest.fixture
def few_shot(tmp_path):
    def make(*extra: str, method: str = "rabo"):
        return load_config(None, [f"method={method}", *TINY_FEW_SHOT, PROFILES, f"output_dir={tmp_path}", *extra])

    return make


def test_masks_respect_each_clients_capacity_exactly(few_shot):
    # Prepare
    ctx = RunContext(resolve_run(few_shot()))
    strategy = ctx.strategy()
    strategy.initialize()
    # Execute
    messages = strategy.configure_fit(1, [0, 1, 2])
    # Assert: every unit group keeps ceil(beta n) units; the values sent are the global ones at the mask
    for cid, capacity in enumerate(CAPACITIES):
        m = Message.decode(messages[cid].encode())
        for g in strategy.structure.groups:
            kept = m.arrays[f"units/{g.name}"]
            assert len(kept) == (1 if g.name == "client" else units_kept(capacity, g.size))
        sub = strategy.subs[cid]
        for name in strategy.problem.outer:
            assert np.array_equal(m.arrays[f"x/{name}"], strategy.x[name][sub.masks[name]])
        conv = sub.masks["backbone.1.0.weight"]  # (8, 8, 3, 3): kept out channels x kept in channels
        k = units_kept(capacity, 8)
        assert conv.sum() == k * k * 9
        assert m.arrays["x/backbone.1.0.weight"].size == k * k * 9
        assert sub.masks["episodes.weight"][cid].sum() == len(m.arrays["units/g3"]) * strategy.problem.n_way * 2
        assert sub.masks["episodes.weight"].sum() == sub.masks["episodes.weight"][cid].sum()  # only its slot


def inner_phase_equals_fit_head(few_shot, client_cls):
    """With lambda = 0 the inner phase is the task's own ``fit_head`` on the client's episodes: the
    server's y_{q+1} must hold exactly those heads in the client's slot."""
    from fedtune.models.fewshot import fit_head

    cfg = few_shot("options.inner_l2=0.0", "options.inner_steps=4", "options.inner_lr=0.1", "federation.profiles=[{}]")
    server = RunContext(resolve_run(cfg))
    strategy = server.strategy()
    strategy.initialize()
    clients = RunContext(resolve_run(cfg))
    sent = strategy.configure_fit(1, [0])
    replies = {
        0: Message.decode(
            client_cls(0, clients.profiles[0], clients, {}).fit(Message.decode(sent[0].encode())).encode()
        )
    }
    strategy.aggregate_fit(1, replies)
    problem = strategy.problem
    batch = problem.data(0, 1)
    x = {n: torch.from_numpy(v.copy()) for n, v in strategy.x.items()}
    server.model.train()
    with torch.no_grad():
        emb = problem.embed(x, batch.support)
    weight, bias = fit_head(emb, batch.support_labels, batch.n_way, 4, 0.1)
    assert np.allclose(strategy.y["episodes.weight"][0], weight.numpy(), atol=1e-5)
    assert np.allclose(strategy.y["episodes.bias"][0], bias.numpy(), atol=1e-5)


def test_inner_phase_is_the_tasks_fitted_head(few_shot):
    inner_phase_equals_fit_head(few_shot, BilevelClient)


def test_literal_sign_of_g_fails(few_shot):
    with pytest.raises(AssertionError):
        inner_phase_equals_fit_head(few_shot, LiteralSignClient)


def test_few_shot_losses_are_the_tasks_hooks(few_shot):
    ctx = RunContext(resolve_run(few_shot("options.inner_l2=0.0")))
    ctx.model.train()
    from fedtune.tasks.bilevel_problems import HyperRepresentation

    problem = HyperRepresentation(ctx, ctx.options)
    batch = problem.data(0, 1)
    heads = torch.randn(1, len(batch), batch.n_way, problem.dim), torch.randn(1, len(batch), batch.n_way)
    y = {"episodes.weight": heads[0], "episodes.bias": heads[1]}
    x = {n: t for n, t in list(ctx.model.named_parameters()) + list(ctx.model.named_buffers()) if n in problem.outer}
    torch.manual_seed(0)
    with torch.no_grad():
        head = (heads[0][0], heads[1][0])
        assert float(problem.g(x, y, batch)) == pytest.approx(
            len(batch) * float(ctx.task.support_loss(ctx.model, batch, head)), rel=1e-5
        )
        assert float(problem.f(x, y, batch)) == pytest.approx(
            float(ctx.task.query_loss(ctx.model, batch, head)), rel=1e-5
        )


@pytest.mark.parametrize("method", ["rabo", "rafbo", "fedmbo"])
def test_run_reports_coverage_and_smaller_clients_upload_less(few_shot, method):
    # Execute: a tiny run through run_experiment (embedded engine, both phases)
    summary = run_experiment(few_shot(method=method))
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    # Assert: C_x^* in every round's metrics, the running minimum of the rounds' minima
    assert all("C_x_star" in line and "C_x_round" in line and "covered_x" in line for line in lines)
    assert lines[-1]["C_x_star"] == min(line["C_x_round"] for line in lines)
    if method == "fedmbo":  # every client trains the whole model: C_x^* = the clients per round
        assert lines[-1]["C_x_star"] == 3 and lines[-1]["covered_x"] == 1.0
        up = [lines[0]["client_bytes_up"][c] for c in "012"]
        assert max(up) - min(up) < 64  # the same arrays; only the metadata's digits differ
    else:  # nested importance masks: the least important units are trained by the full client only
        assert lines[-1]["C_x_star"] == 1
        up = lines[0]["client_bytes_up"]
        assert up["0"] > up["1"] > up["2"]
    assert np.isfinite(summary["final_loss"]) and 0 <= summary["final_accuracy"] <= 1


def test_resume_continues_bit_identically(few_shot, tmp_path):
    full = run_experiment(few_shot("rounds=3", "name=full"))
    run_experiment(few_shot("rounds=2", "name=cut"))
    cut_dir = Path(full["run_dir"]).parent / "cut"
    cfg = few_shot("rounds=3", "name=cut")
    resumed = run_experiment(cfg, resume=True)
    a = [json.loads(x) for x in (Path(full["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (cut_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["accuracy"] for x in a] == [x["accuracy"] for x in b]
    assert resumed["final_accuracy"] == full["final_accuracy"]


def test_rabo_on_flower_apps_matches_embedded_engine(few_shot, tmp_path, monkeypatch):
    """Both phases through the real ServerApp / ClientApp (the x sub-model kept in the node's
    state between them): the same final state and the same bytes as the embedded engine."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedtune.checkpoint import load_state
    from fedtune.engines.flower.clientapp import make_client_app
    from fedtune.engines.flower.serverapp import serve
    from tests.test_contract import flatten
    from tests.test_flower import LoopbackGrid
    from tests.test_flower_contract import assert_same_run

    for attr, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)

    def finished(summary):
        run_dir = Path(summary["run_dir"])
        state = load_state(run_dir / "checkpoint.npz")
        state.pop("_engine")
        return flatten(state), [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    flower_cfg = few_shot(f"output_dir={tmp_path / 'flower'}")
    flower = serve(LoopbackGrid(make_client_app(flower_cfg), 3), flower_cfg, timeout=300)
    embedded = run_experiment(few_shot(f"output_dir={tmp_path / 'embedded'}"))
    assert flower["engine"] == "flower"
    assert_same_run(finished(flower), finished(embedded))


@pytest.mark.parametrize("method", ["rabo", "static", "fedrolex", "fiarse"])
def test_c_x_star_is_the_minimum_coverage_over_the_rounds_so_far(tmp_path, method):
    """C_x* (RABO eqs. (12)-(13), and the same tracker of the Static / FedRolex / FIARSE baselines)
    is the running minimum of each round's least coverage, not its maximum or the last value. The
    coverage varies here: three equal clients, one of which fails half its rounds (seeded)."""
    config = load_config(
        None,
        [
            *TINY_FEW_SHOT,
            f"method={method}",
            "rounds=6",
            "eval_every=6",
            "seed=4",  # client 2 answers in rounds 1, 4, 5 only
            "federation.profiles=[{capacity=1.0},{capacity=1.0},{capacity=1.0, failure_prob=0.5}]",
            f"output_dir={tmp_path}",
        ],
    )
    summary = run_experiment(config)
    lines = [json.loads(x) for x in open(f"{summary['run_dir']}/metrics.jsonl")]
    per_round = [line["C_x_round"] for line in lines]
    assert len(set(per_round)) > 1, per_round  # the premise: coverage differs between rounds
    assert per_round[0] > min(per_round)  # so that the first value is not the minimum either
    assert [line["C_x_star"] for line in lines] == list(np.minimum.accumulate(per_round))
