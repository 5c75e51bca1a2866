"""RABO and RAFBO: resource-adaptive distributed bilevel optimization with pruned inner and outer
sub-models (Li et al., "Distributed Bilevel Optimization with Dual Pruning for Resource-limited
Clients", Algorithms 1 and 2), over the :class:`~fedtune.models.bilevel.BilevelProblem` the task supplies.

A round q is two exchanges (the engine's :meth:`Strategy.phases`, both byte-accounted):

1. **inner** (``configure_fit`` / ``Client.fit`` / ``aggregate_fit``). The server draws each
   client's masks m_{q,x}^i, m_{q,y}^i = M(x_q, R_i) (eq. (3); the policy needs only x_q and the
   client's capacity, so the server computes it and sends the sub-model x_q (.) m_x, y_q (.) m_y
   and the kept unit indices: the download carries no pruned entry). The client takes T steps
   y_{t+1} = y_t - beta grad_y g_i(x_q^i, y_t) (.) m_y (eq. (5)) and uploads G_q^i at its mask;
   the server updates every entry k of y covered by C_{q,y}^k > 0 clients,
   y_{q+1}^k = y_q^k - beta (1 / C_{q,y}^k) sum_{i in N^k} G_q^{i,k}, and leaves the others (eq. (6)).
2. **hypergradient** (``configure_phase`` / ``Client.phase`` / ``aggregate_phase``). The server
   sends y_{q+1} (.) m_y; the client (which kept its x sub-model from phase 1 in ``Client.state``)
   computes its local hypergradient on its sub-model and uploads it at its x mask; the server sets
   x_{q+1}^s = x_q^s - alpha (1 / C_{q,x}^s) sum_{i in N^s} H_q^{i,s} for covered entries (eq. (8)).
   - RABO: eq. (7), grad_x f - grad^2_xy g [grad^2_yy g]^-1 grad_y f, the inverse-Hessian-vector
     product by conjugate gradient (``options.solver = "cg"``) or a Neumann series, from Hessian-
     vector products (:func:`~fedtune.methods.rabo.hypergrad.implicit_hypergradient`).
   - RAFBO: Algorithm 2, coordinate finite differences over ``fd_coordinates`` coordinates of the
     client's x sub-model with smoothing ``fd_mu``
     (:func:`~fedtune.methods.rabo.hypergrad.finite_difference_hypergradient`).

**Sign of G.** Algorithm 1 line 10 writes G_q^i = (y_{q,T} - y_{q,0}) / beta, which with line 18
would move y *up* its gradient; the proof of Lemma 4 (eq. (30)) expands y_{q+1} =
y_q - (beta / C) sum_j sum_t grad g_j, so the client uploads G_q^i = (y_{q,0} - y_{q,T}) / beta,
the sum of its T masked gradients, and one client covering everything gets back its own y_T.

Masks (``options.masks``, :func:`~fedtune.methods.rabo.masks.choose_units`): ``importance`` (default;
"we first split the model according to the weight importance and each client selects a
submodel that matches its capacity"): each unit group keeps the ceil(beta_i n) units of largest
L2 weight norm in x_q, recomputed every round, so masks change as the weights do and clients of
equal capacity share a mask; ``segment`` (Fig. 3: contiguous segments, ``options.segments`` maps
client -> segment) controls C_x^*; ``static`` and ``rolling`` are there for comparison. beta_i is
``profile.capacity`` (1 when unset). Batch-norm statistics of x (few-shot) are not differentiated:
each client uploads its statistics after the hypergradient's forward passes and the server
averages them over the clients that covered them.

Metrics per round: ``C_x_round`` / ``C_y_round`` (min over the trained entries of their
coverage, C_{q,x}^* of Definition 3), ``C_x_star`` / ``C_y_star`` (eqs. (12)-(13): the minimum over
all rounds so far), ``covered_x`` / ``covered_y`` (fraction of entries trained), ``outer_loss``,
and with ``options.count_flops`` each client's floating-point operations (``client_gflops``, mean
per client over both phases; torch's FLOP counter, about doubles the client's time).
"""

from __future__ import annotations

import numpy as np
import torch

from fedtune.methods.rabo.hypergrad import finite_difference_hypergradient, implicit_hypergradient, second_order_kernels
from fedtune.methods.rabo.masks import (
    Policy,
    SubModel,
    choose_units,
    coverage_stats,
    covered_update,
    expand,
    flatten_at,
    submodel_of,
    take,
)
from fedtune.methods.rabo.options import BilevelOptions, ImplicitOptions, MaskOptions, RaboOptions, RafboOptions
from fedtune.methods.rabo.plan import CAPACITY_PLAN
from fedtune.models.bilevel import BilevelProblem
from fedtune.models.training import seed_for
from fedtune.protocol.client import Client
from fedtune.protocol.context import options_as
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import ArraySpec, MetaField
from fedtune.registry import register

INNER, HYPER = "inner", "hypergradient"
BILEVEL = ("bilevel",)  # the task capability these methods need (a task that offers an (x, y) split)


def _counting(enabled: bool):
    from contextlib import nullcontext

    if not enabled:
        return nullcontext(None)
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


class BilevelStrategy(Strategy):
    """RABO (Algorithm 1) on the server: masks, eq. (6) on y, eq. (8) on x, coverage metrics."""

    options: BilevelOptions  # the method's registered options class (resolve_run validated them)

    masked = True

    def reply_meta_spec(self, kind: str, cid: int) -> dict[str, MetaField]:
        """The keys aggregation reads: ``train_loss`` (inner phase) and ``outer_loss`` (hypergradient
        phase), finite; ``flops`` (either) finite and not negative."""
        spec = {**super().reply_meta_spec(kind, cid), "flops": MetaField(float, low=0.0)}
        if kind == "train":
            spec["train_loss"] = MetaField(float, required=True)
        elif kind == HYPER:
            spec["outer_loss"] = MetaField(float, required=True)
        return spec

    def initialize(self) -> None:
        self.problem: BilevelProblem = self.context.task.bilevel_problem(self.context, self.options)
        self.structure = self.problem.structure()
        self.x, self.y = self.problem.initial()
        self.star: dict[str, int] = {}
        self.subs: dict[int, SubModel] = {}
        self.flops: dict[int, float] = {}

    def aggregate(self, old, contributions, scale):
        """Parameter-wise aggregation over the coverers of each entry (eqs. (6), (8))."""
        return covered_update(old, contributions, scale)

    # -- masks --------------------------------------------------------------------------------------
    def capacity(self, cid: int) -> float:
        cap = self.context.profiles[cid].capacity
        return 1.0 if cap is None or not self.masked else float(cap)

    def submodel(self, rnd: int, cid: int) -> SubModel:
        """m_{q,x}^i, m_{q,y}^i = M(x_q, R_i) (eq. (3)) as one sub-model over x and y."""
        policy: Policy = self.options.masks if self.masked and isinstance(self.options, MaskOptions) else "full"
        weights = {n: a for part in (self.x, self.y) for n, a in part.items() if n not in self.problem.buffers}
        units = {
            g.name: choose_units(
                policy,
                g,
                self.capacity(cid),
                rnd,
                cid,
                weights,
                self.options.segments if isinstance(self.options, MaskOptions) else None,
            )
            for g in self.structure.groups
        }
        return submodel_of(self.structure, units)

    def params(self, part: str) -> list[str]:
        names = self.problem.outer if part == "x" else self.problem.inner
        return [n for n in names if n not in self.problem.buffers]

    def buffers(self, part: str) -> list[str]:
        names = self.problem.outer if part == "x" else self.problem.inner
        return [n for n in names if n in self.problem.buffers]

    # -- phase 1: inner -----------------------------------------------------------------------------
    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        if self.problem.reset_inner:
            self.y = {n: np.zeros_like(a) for n, a in self.y.items()}
        self.subs, self.flops = {}, {}
        messages = {}
        for cid in client_ids:
            sub = self.subs[cid] = self.submodel(rnd, cid)
            arrays = {
                **{f"x/{n}": v for n, v in take(self.x, sub).items()},
                **{f"y/{n}": v for n, v in take(self.y, sub).items()},
                **{f"units/{g}": u.astype(np.int32) for g, u in sub.units.items()},
            }
            messages[cid] = Message(arrays, {"round": rnd, "phase": INNER})
        return messages

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec] | None:
        sub = self.subs.get(cid)
        if sub is None:
            return None
        part, key = ("y", "G") if sent.meta.get("phase") == INNER else ("x", "H")
        spec = {f"{key}/{n}": ArraySpec((sub.kept(n),)) for n in self.params(part)}
        spec.update({f"B/{n}": ArraySpec((sub.kept(n),)) for n in self.buffers(part)})
        return spec

    def _average_buffers(
        self, old: dict[str, np.ndarray], part: str, replies: dict[int, Message]
    ) -> dict[str, np.ndarray]:
        """Batch-norm statistics: the mean over the clients that covered each entry."""
        names = self.buffers(part)
        if not names:
            return old
        contributions = [
            (self.subs[cid], {n: m.arrays[f"B/{n}"] - take(old, self.subs[cid], [n])[n] for n in names})
            for cid, m in replies.items()
        ]
        new, _ = self.aggregate(old, contributions, 1.0)
        return new

    def _coverage(self, part: str, counts: dict[str, np.ndarray]) -> dict[str, float]:
        least, covered = coverage_stats(counts)
        out = {f"covered_{part}": covered}
        if least is not None:
            out[f"C_{part}_round"] = least
            self.star[part] = min(self.star.get(part, least), least)
            out[f"C_{part}_star"] = self.star[part]
        return out

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """Eq. (6): y_{q+1}^k = y_q^k - beta (1 / C_{q,y}^k) sum_{i in N_{q,y}^k} G_q^{i,k}."""
        names = self.params("y")
        contributions = [(self.subs[cid], {n: m.arrays[f"G/{n}"] for n in names}) for cid, m in replies.items()]
        self.y, counts = self.aggregate(self.y, contributions, -self.options.inner_lr)
        self.y = self._average_buffers(self.y, "y", replies)
        self.flops = {cid: float(m.meta.get("flops", 0.0)) for cid, m in replies.items()}
        metrics = self._coverage("y", counts)
        metrics["train_loss"] = float(np.mean([m.meta["train_loss"] for m in replies.values()]))
        return metrics

    # -- phase 2: hypergradient ---------------------------------------------------------------------
    def phases(self, rnd: int) -> tuple[str, ...]:
        return (HYPER,)

    def configure_phase(self, phase: str, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        return {
            cid: Message({f"y/{n}": v for n, v in take(self.y, self.subs[cid]).items()}, {"round": rnd, "phase": HYPER})
            for cid in client_ids
        }

    def aggregate_phase(self, phase: str, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """Eq. (8): x_{q+1}^s = x_q^s - alpha (1 / C_{q,x}^s) sum_{i in N_{q,x}^s} H_q^{i,s}."""
        names = self.params("x")
        contributions = [(self.subs[cid], {n: m.arrays[f"H/{n}"] for n in names}) for cid, m in replies.items()]
        self.x, counts = self.aggregate(self.x, contributions, -self.options.outer_lr)
        self.x = self._average_buffers(self.x, "x", replies)
        metrics = self._coverage("x", counts)
        metrics["outer_loss"] = float(np.mean([m.meta["outer_loss"] for m in replies.values()]))
        if self.options.count_flops:
            flops = [self.flops.get(cid, 0.0) + float(m.meta.get("flops", 0.0)) for cid, m in replies.items()]
            metrics["client_gflops"] = float(np.mean(flops) / 1e9)
        return metrics

    # -- evaluation and state -------------------------------------------------------------------------
    def evaluate(self, rnd: int) -> dict[str, float]:
        return self.problem.evaluate(self.x, self.y)

    def state_dict(self) -> dict:
        return {
            "x": {k: v.copy() for k, v in self.x.items()},
            "y": {k: v.copy() for k, v in self.y.items()},
            "coverage_star": dict(self.star),
        }

    def load_state_dict(self, state: dict) -> None:
        self.x = {k: np.asarray(v, dtype=np.float32).copy() for k, v in state["x"].items()}
        self.y = {k: np.asarray(v, dtype=np.float32).copy() for k, v in state["y"].items()}
        self.star = {k: int(v) for k, v in state.get("coverage_star", {}).items()}


class BilevelClient(Client):
    """A client of Algorithm 1: the inner steps (phase 1) and its local hypergradient (phase 2)."""

    options: BilevelOptions  # the method's registered options class (resolve_run validated them)

    estimator = "implicit"

    def _setup(self, units: dict[str, np.ndarray]) -> tuple[BilevelProblem, SubModel, bool]:
        problem = self.context.task.bilevel_problem(self.context, self.options)
        structure = problem.structure()
        problem.prepare()
        return problem, submodel_of(structure, units), structure.physical

    @staticmethod
    def _masks(sub: SubModel, names: list[str], physical: bool, device: torch.device) -> dict[str, torch.Tensor] | None:
        return None if physical else {n: torch.from_numpy(sub.masks[n]).float().to(device) for n in names}

    def fit(self, message: Message) -> Message:
        """Phase 1: T masked inner steps from y_q (.) m_y; upload G_q^i = (y_0 - y_T) / beta."""
        rnd = int(message.meta["round"])
        units = {k[len("units/") :]: v for k, v in message.arrays.items() if k.startswith("units/")}
        problem, sub, physical = self._setup(units)
        opts = self.options
        x = expand({n: message.arrays[f"x/{n}"] for n in problem.outer}, sub, physical, problem.device)
        y0 = expand({n: message.arrays[f"y/{n}"] for n in problem.inner}, sub, physical, problem.device)
        data = problem.data(self.cid, rnd)
        batches = problem.inner_batches(data, opts.inner_steps)
        params = [n for n in problem.inner if n not in problem.buffers]
        with _counting(opts.count_flops) as counter:
            y_t = problem.inner_solve(x, y0, batches, opts.inner_lr, self._masks(sub, params, physical, problem.device))
        with torch.no_grad():
            loss = float(problem.g(x, {n: t.clone() for n, t in y_t.items()}, batches[-1]))
        grads = {n: (y0[n] - y_t[n]) / opts.inner_lr for n in params}
        arrays = {f"G/{n}": v for n, v in flatten_at(grads, sub, physical).items()}
        arrays.update(
            {
                f"B/{n}": v
                for n, v in flatten_at(
                    {n: y_t[n] for n in problem.inner if n in problem.buffers}, sub, physical
                ).items()
            }
        )
        # phase 2 needs this round's x sub-model: kept here, not downloaded twice
        self.state = {
            "round": np.asarray(rnd),
            **{f"x/{n}": message.arrays[f"x/{n}"] for n in problem.outer},
            **{f"units/{g}": u for g, u in units.items()},
        }
        meta = {"train_loss": loss, "steps": opts.inner_steps, "num_examples": len(self.context.partitions[self.cid])}
        if counter is not None:
            meta["flops"] = float(counter.get_total_flops())
        return Message(arrays, meta)

    def phase(self, name: str, message: Message) -> Message:
        """Phase 2: the local hypergradient at (x_q^i, y_{q+1}^i), uploaded at the x mask."""
        if name != HYPER:
            return super().phase(name, message)
        rnd = int(message.meta["round"])
        if "round" not in self.state or int(self.state["round"]) != rnd:
            raise RuntimeError(f"hypergradient phase of round {rnd} without this round's inner phase")
        units = {k[len("units/") :]: v for k, v in self.state.items() if k.startswith("units/")}
        problem, sub, physical = self._setup(units)
        x = expand({n: self.state[f"x/{n}"] for n in problem.outer}, sub, physical, problem.device)
        y = expand({n: message.arrays[f"y/{n}"] for n in problem.inner}, sub, physical, problem.device)
        data = problem.data(self.cid, rnd)
        with _counting(self.options.count_flops) as counter, second_order_kernels():
            hyper, outer_loss = self.hypergradient(problem, x, y, data, sub, physical, rnd)
        arrays = {f"H/{n}": v for n, v in flatten_at(hyper, sub, physical).items()}
        arrays.update(
            {
                f"B/{n}": v
                for n, v in flatten_at({n: x[n] for n in problem.outer if n in problem.buffers}, sub, physical).items()
            }
        )
        self.state = {}
        meta = {"outer_loss": outer_loss, "num_examples": len(self.context.partitions[self.cid])}
        if counter is not None:
            meta["flops"] = float(counter.get_total_flops())
        return Message(arrays, meta)

    # -- the local hypergradient ------------------------------------------------------------------------
    def _closures(self, problem: BilevelProblem, x: dict, y: dict):
        xn = [n for n in problem.outer if n not in problem.buffers]
        yn = [n for n in problem.inner if n not in problem.buffers]
        fixed_x = {n: x[n] for n in problem.outer if n in problem.buffers}
        fixed_y = {n: y[n] for n in problem.inner if n in problem.buffers}

        def bind(loss, batch):
            return lambda xs, ys: loss({**fixed_x, **dict(zip(xn, xs))}, {**fixed_y, **dict(zip(yn, ys))}, batch)

        return xn, yn, bind

    def hypergradient(self, problem, x, y, data, sub, physical, rnd) -> tuple[dict[str, torch.Tensor], float]:
        """RABO eq. (7) by implicit differentiation (CG or Neumann over Hessian-vector products)."""
        xn, yn, bind = self._closures(problem, x, y)
        xi, zeta = problem.hyper_batches(data)
        xs = [x[n].requires_grad_() for n in xn]
        ys = [y[n].requires_grad_() for n in yn]
        o = options_as(self.context, ImplicitOptions)  # the implicit hypergradient's methods (RABO, FedMBO)
        y_mask = None if physical else [torch.from_numpy(sub.masks[n]).float().to(problem.device) for n in yn]
        hyper, outer = implicit_hypergradient(
            bind(problem.g, xi),
            bind(problem.f, zeta),
            xs,
            ys,
            solver=o.solver,
            iters=o.solver_iters,
            neumann_lr=o.neumann_lr,
            y_mask=y_mask,
        )
        return dict(zip(xn, hyper)), outer


class FiniteDifferenceClient(BilevelClient):
    """RAFBO's client: the hypergradient of Algorithm 2 (second-order free)."""

    options: RafboOptions  # the method's registered options class (resolve_run validated them)

    def coordinates(self, problem, x, sub, physical, names, rnd) -> list[tuple[int, int]]:
        """P_q^i: ``fd_coordinates`` entries of the x sub-model, drawn without replacement (seeded)."""
        sizes = [sub.kept(n) for n in names]
        total = sum(sizes)
        rng = np.random.default_rng(seed_for(self.config.seed, rnd, self.cid, 0xFD))
        picks = np.sort(rng.choice(total, size=min(self.options.fd_coordinates, total), replace=False))
        bounds = np.cumsum([0, *sizes])
        out = []
        for p in picks:
            t = int(np.searchsorted(bounds, p, side="right") - 1)
            j = int(p - bounds[t])
            if not physical:  # the j-th kept entry of the full tensor
                j = int(np.flatnonzero(sub.masks[names[t]].ravel())[j])
            out.append((t, j))
        return out

    def hypergradient(self, problem, x, y, data, sub, physical, rnd):
        """Algorithm 2: grad_x f + sum_{p in P} <(y_hat(x + mu e_p) - y_hat(x)) / mu, grad_y f> e_p."""
        xn, yn, bind = self._closures(problem, x, y)
        o = self.options
        _, zeta = problem.hyper_batches(data)
        steps = o.fd_steps or o.inner_steps
        batches = problem.inner_batches(data, steps)
        # y_hat starts where phase 1 started (zero heads for per-episode y) or at y_{q+1}
        start = {n: (torch.zeros_like(t) if problem.reset_inner else t.detach().clone()) for n, t in y.items()}
        fixed_x = {n: x[n] for n in problem.outer if n in problem.buffers}
        masks = self._masks(sub, yn, physical, problem.device)

        def inner_solve(xs):
            xd = {**{n: t.clone() for n, t in fixed_x.items()}, **dict(zip(xn, xs))}
            y0 = {n: t.clone() for n, t in start.items()}
            solved = problem.inner_solve(xd, y0, batches, o.inner_lr, masks)
            return [solved[n] for n in yn]

        coords = self.coordinates(problem, x, sub, physical, xn, rnd)
        hyper, outer = finite_difference_hypergradient(
            bind(problem.f, zeta), inner_solve, [x[n] for n in xn], [y[n] for n in yn], coords, o.fd_mu
        )
        return dict(zip(xn, hyper)), outer


class RaboStrategy(BilevelStrategy):
    """RABO: resource-adaptive distributed bilevel optimization, implicit hypergradient (Alg. 1)."""


class RafboStrategy(BilevelStrategy):
    """RAFBO: RABO with the second-order-free coordinate finite-difference hypergradient (Alg. 2)."""


register("rabo", RaboStrategy, BilevelClient, RaboOptions, requires=BILEVEL, supports=("device",), plan=CAPACITY_PLAN)
register(
    "rafbo", RafboStrategy, FiniteDifferenceClient, RafboOptions, requires=BILEVEL, supports=("device",),
    plan=CAPACITY_PLAN,
)  # fmt: skip
