"""Learning balance between a feature encoder S and a language model T, and the local trainers of
CoMMIT (Wu et al., "CoMMIT: Coordinated Instruction Tuning for Multimodal Large Language Models").

The model is a :class:`~fedtune.models.prefix_lm.PrefixLM` (usually inside PEFT) whose trainable
parameters fall into two groups: S (``encoder``: encoders and projectors) and T
(``language_model``: the LM's LoRA). The generation distribution on a batch is the LM's
next-token distribution at each answer position (:func:`fedtune.models.prefix_lm.answer_logits`).

Readings of the paper where it leaves a choice (each tested in ``tests/test_commit*.py``):

- **Metric d** (eqs. (1)-(3), (7)-(8)): total variation between next-token distributions,
  ``d(p, q) = 1/2 sum_v |p_v - q_v|``, averaged over an example's K_i answer tokens and then over
  the batch, ``1/|N_t| sum_i 1/K_i sum_k d(p_ik, q_ik)`` (the averaging eqs. (7)-(8) write out).
  The paper's (H, d) is a metric space (eq. (2) uses the triangle inequality): total variation is a
  metric, KL is not. ``metric = "kl"`` (KL(p_t || p_{t+1})) is offered as an alternative.
- **One step of one component** (eq. (3)): the optimizer step the trainer takes at t (AdamW or SGD
  with the component's current rate), applied to that component alone, the other kept at t. Both
  optimizers update each parameter from its own gradient and state, so T's part of the joint step
  is exactly "T's step alone". Then
  ``kappa_t = d[p(S_t, T_{t+1}), p(S_t, T_t)] / d[p(S_{t+1}, T_t), p(S_t, T_t)] = d_T / d_S``,
  clipped to [1e-6, 1e6] so that eq. (6) stays finite when a component did not move at all.
- **H terms** (eq. (5)): ``H_S = d_S / (||I^T|| + ||theta_S(I^S)||)``, ``H_T = d_T / ||I^S||``
  with per-example Frobenius norms averaged over the batch (:func:`input_norms`): I^T the input
  embeddings of the instruction's tokens (prompt tokens; not padding, prefix slots or answer),
  theta_S(I^S) the prefix embeddings the encoders and projectors make, I^S the raw modality inputs.
- **Coordinated rates** (eq. (6), :class:`Schedule`): kappa~_t is the plain mean of the last
  N_kappa kappas (fewer while fewer exist); ``beta_T = alpha / (gamma (kappa~ + 1))``,
  ``beta_S = alpha / (gamma (1 / kappa~ + 1))``, refreshed after steps t = L_lr, 2 L_lr, ...;
  until the first refresh both rates are ``alpha / (2 gamma)`` (kappa~ = 1). Rates scale the
  optimizer's step (AdamW's lr).
- **Regularizer** (eqs. (7)-(8)): D^T = d(y_hat, y_hat^T) and D^S = d(y_hat, y_hat^S), with y_hat
  the current prediction (no gradient) and y_hat^T / y_hat^S the predictions one step forward of T
  / S alone (the provisional optimizer step on the loss gradient, as for kappa). The equations
  *add* beta * grad d to the descent step: gradient **ascent** on the distance, i.e. the objective
  L - lambda D. Its gradient is taken at the one-step-forward point (first order: differentiating
  through the step, (I - beta H) grad D, would need a Hessian; we drop beta H). The component's
  gradient fed to the optimizer is ``grad L(theta_t) - lambda grad_phi D(phi)|phi = theta_{t+1}``.
  The same two forward passes give d_T and d_S for kappa (at no extra cost).
- **y_hat in evaluation mode**: the trainers run the model in evaluation mode throughout. For this
  model that changes nothing but dropout (LoRA dropout must be 0; pretrained batch norms stay in
  evaluation mode anyway, the ones trained from scratch keep no running statistics), so the training
  forward's detached logits are y_hat.
- **Coordinate descent** (Feature / Language CD, Section 7): train the first component alone
  (its rate ``lr``, the other frozen) until its weights stabilize, then the second alone for the
  rest of the run. Stabilized: after every ``cd_window`` steps of the first phase (windows restart
  each round), the relative change of its weights over the window,
  ``||theta(t) - theta(t - W)|| / ||theta(t - W)||``, is below ``cd_tolerance``; or the run has
  spent ``cd_max_steps`` steps in the first phase (a cap, so that T is trained at all).

Measuring never changes the model: swapped-in parameters are restored bit for bit
(:func:`swapped`), and the provisional optimizer step restores parameters and optimizer state
(:func:`lookahead`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from fedtune.models import prefix_lm as plm
from fedtune.models.precision import model_device, to_device

S, T = "encoder", "language_model"  # the task's parameter groups (Task.parameter_groups)
METRICS = ("tv", "kl")
KAPPA_RANGE = (1e-6, 1e6)

#: trainers: Section 4's Synced LR (constant), Language LR up, Vision LR up; Section 7's Feature CD,
#: Language CD; CoMMIT-CLR (eq. (6) only) and CoMMIT (eq. (6) and eqs. (7)-(8))
TRAINERS = ("constant", "language-lr-up", "vision-lr-up", "feature-cd", "language-cd", "commit-clr", "commit")
CD_ORDER = {"feature-cd": (S, T), "language-cd": (T, S)}


# -- the metric and the measurement -----------------------------------------------------------
def answer_distance(
    ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, metric: str = "tv"
) -> torch.Tensor:
    """``1/|N| sum_i 1/K_i sum_k d(p_ik, q_ik)`` (eqs. (7)-(8)): p from ``ref_logits`` (no
    gradient), q from ``logits``, both (B, A, V), over the answer positions (``targets`` (B, A)
    != -100); d is total variation (``tv``) or KL(p || q) (``kl``)."""
    mask = (targets != -100).to(torch.float32)  # (B, A)
    logq = F.log_softmax(logits.float(), -1)
    logp = F.log_softmax(ref_logits.detach().float(), -1)
    if metric == "tv":
        tok = 0.5 * (logq.exp() - logp.exp()).abs().sum(-1)  # (B, A)
    elif metric == "kl":
        tok = (logp.exp() * (logp - logq)).sum(-1)
    else:
        raise ValueError(f"metric: expected one of {METRICS}, got {metric!r}")
    return ((tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


@contextmanager
def swapped(params: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """Parameters ``params`` hold ``values`` inside the block; their own values come back bit
    for bit afterwards (also when the block raises)."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def _clone_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


def lookahead(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The values of ``params`` one ``optimizer`` step from here (on the gradients in ``.grad``):
    the step is taken, read, and undone, parameters and optimizer state restored exactly."""
    state = {p: _clone_state(optimizer.state[p]) if p in optimizer.state else None for p in params}
    with swapped(params, [p.detach() for p in params]):  # the current values come back afterwards
        optimizer.step()
        ahead = [p.detach().clone() for p in params]
    for p, st in state.items():
        if st is None:
            optimizer.state.pop(p, None)
        else:
            optimizer.state[p] = st
    return ahead


def input_norms(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(||I^T||, ||theta_S(I^S)||, ||I^S||) of eq. (5): per-example Frobenius norms, averaged over
    the batch, of the instruction's token embeddings (prompt tokens only: no padding, prefix slots
    or answer tokens), of the prefix embeddings, and of the modality inputs (all modalities)."""
    base = plm.unwrap(model)
    with torch.no_grad():
        # language_model: a transformers model, which PrefixLM types as an nn.Module
        emb = base.language_model.get_input_embeddings()(batch["input_ids"])  # type: ignore[operator]  # (B, L, h)
        text = batch["attention_mask"].bool() & ~batch["prefix_mask"] & (batch["labels"] == -100)
        i_t = (emb.float().pow(2).sum(-1) * text).sum(-1).sqrt()  # (B,)
        encoded = base.prefix(batch).flatten(1).float().norm(dim=1)  # (B,)
        raw = torch.cat([batch[m].flatten(1).float() for m in base.modalities], 1).norm(dim=1)  # (B,)
    return float(i_t.mean()), float(encoded.mean()), float(raw.mean())


def balance_coefficient(d_t: float, d_s: float) -> float:
    """kappa = d_T / d_S (eq. (3)), clipped to :data:`KAPPA_RANGE`."""
    lo, hi = KAPPA_RANGE
    return float(min(hi, max(lo, d_t / d_s))) if d_s > 0 else (hi if d_t > 0 else 1.0)


def coordinated_rates(kappa_tilde: float, alpha: float, gamma: float) -> tuple[float, float]:
    """(beta_S, beta_T) of eq. (6): ``alpha / (gamma (1/kappa~ + 1))`` for the encoder,
    ``alpha / (gamma (kappa~ + 1))`` for the language model."""
    return alpha / (gamma * (1.0 / kappa_tilde + 1.0)), alpha / (gamma * (kappa_tilde + 1.0))


def relative_change(now: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> float:
    """``||now - before|| / ||before||`` over all the tensors (Feature / Language CD's criterion)."""
    num = math.sqrt(sum(float((a.detach() - b).float().pow(2).sum()) for a, b in zip(now, before)))
    den = math.sqrt(sum(float(b.float().pow(2).sum()) for b in before))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


# -- the trainers' settings and schedule -------------------------------------------------------
@dataclass(frozen=True)
class Coordination:
    """A local trainer and its settings (see the module docstring for each reading)."""

    trainer: str = "commit"
    lr: float = 1e-3  # the base rate: Constant LR's, and the CD phases'
    alpha: float | None = None  # eq. (6)'s learning advantage; None: 2 lr (both rates = lr at kappa~ = 1)
    gamma: float = 1.0  # eq. (6)'s gamma (eq. (1)'s Lipschitz constant)
    n_kappa: int = 10  # N_kappa: the moving average's window
    l_lr: int = 5  # L_lr: steps between rate refreshes
    reg_weight: float = 0.1  # lambda: the regularizer's weight (CoMMIT)
    metric: str = "tv"
    lr_up: float = 10.0  # Language / Vision LR up: that component's rate is lr_up x lr
    cd_window: int = 5
    cd_tolerance: float = 0.01
    cd_max_steps: int = 10**9
    measure: bool = True  # measure kappa for the trainers that do not need it (curves)

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"trainer: expected one of {', '.join(TRAINERS)}, got {self.trainer!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric: expected one of {METRICS}, got {self.metric!r}")

    @property
    def advantage(self) -> float:
        return 2.0 * self.lr if self.alpha is None else self.alpha

    @property
    def scheduled(self) -> bool:
        """Rates from eq. (6) (CoMMIT-CLR, CoMMIT)."""
        return self.trainer in ("commit-clr", "commit")

    @property
    def regularized(self) -> bool:
        """The auxiliary regularizer of eqs. (7)-(8) (CoMMIT)."""
        return self.trainer == "commit" and self.reg_weight > 0

    @property
    def measures(self) -> bool:
        """Whether kappa is measured at every step (CD trains one component at a time: no kappa)."""
        return self.scheduled or (self.measure and self.trainer not in CD_ORDER)

    def initial_rates(self) -> tuple[float, float]:
        """(beta_S, beta_T) before any refresh."""
        if self.scheduled:
            return coordinated_rates(1.0, self.advantage, self.gamma)
        if self.trainer == "language-lr-up":
            return self.lr, self.lr_up * self.lr
        if self.trainer == "vision-lr-up":
            return self.lr_up * self.lr, self.lr
        return self.lr, self.lr


@dataclass
class Schedule:
    """What a trainer carries from step to step and round to round: the steps taken (t), the last
    N_kappa kappas (eq. (6)'s window), the rates (beta_S, beta_T) and the CD phase (0: the first
    component, 1: the second)."""

    step: int = 0
    kappas: list[float] = field(default_factory=list)
    rates: tuple[float, float] = (0.0, 0.0)
    phase: int = 0

    @classmethod
    def start(cls, coord: Coordination) -> Schedule:
        return cls(0, [], coord.initial_rates(), 0)

    def observe(self, kappa: float | None, coord: Coordination) -> None:
        """Step t done (kappa_t measured, or None): slide the window and, every L_lr steps, set the
        rates from its mean (eq. (6)) for a scheduled trainer."""
        self.step += 1
        if kappa is not None:
            self.kappas = (self.kappas + [float(kappa)])[-coord.n_kappa :]
        if coord.scheduled and self.step % coord.l_lr == 0 and self.kappas:
            self.rates = coordinated_rates(sum(self.kappas) / len(self.kappas), coord.advantage, coord.gamma)

    def to_meta(self) -> dict[str, Any]:
        return {"step": self.step, "kappas": list(self.kappas), "rates": list(self.rates), "phase": self.phase}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Schedule:
        rate_s, rate_t = (float(r) for r in meta["rates"])  # (beta_S, beta_T): two, else ValueError
        return cls(int(meta["step"]), [float(k) for k in meta["kappas"]], (rate_s, rate_t), int(meta["phase"]))

    @classmethod
    def merge(cls, schedules: Sequence[Schedule], weights: Sequence[float]) -> Schedule:
        """The server's schedule after a round (federated mode): the clients' windows averaged
        position by position and their rates averaged (weights ``weights``), the second CD phase
        once clients holding at least half the weight reached it. One client: its schedule."""
        if len(schedules) == 1:
            return replace(schedules[0], kappas=list(schedules[0].kappas))
        w = [x / sum(weights) for x in weights]
        n = min(len(s.kappas) for s in schedules)
        kappas = [sum(wi * s.kappas[len(s.kappas) - n + j] for wi, s in zip(w, schedules)) for j in range(n)]
        rate_s, rate_t = (float(sum(wi * s.rates[i] for wi, s in zip(w, schedules))) for i in range(2))
        phase = int(sum(wi for wi, s in zip(w, schedules) if s.phase >= 1) >= 0.5)
        return cls(max(s.step for s in schedules), kappas, (rate_s, rate_t), phase)


CURVES = ("loss", "kappa", "d_S", "d_T", "H_S", "H_T", "lr_S", "lr_T", "grad_S", "grad_T", "cd_change")


def _norm(tensors: Iterable[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.detach().float().pow(2).sum()) for t in tensors))


# -- the local loop ----------------------------------------------------------------------------
def _regularized_gradients(model, batch, ref, targets, optimizer, s_params, t_params, coord: Coordination):
    """CoMMIT's step gradients (eqs. (7)-(8)): with the loss gradients in ``.grad``, take the
    provisional step (:func:`lookahead`), and for each component X its distance
    D^X = d(y_hat, y_hat^X) one step forward of X alone; ``.grad`` of X becomes
    grad L - lambda grad D^X (evaluated at the provisional point). Returns (d_S, d_T) = (D^S, D^T)."""
    everything = s_params + t_params
    ahead = lookahead(optimizer, everything)
    ahead_s, ahead_t = ahead[: len(s_params)], ahead[len(s_params) :]
    out = {}
    for name, params, values in ((T, t_params, ahead_t), (S, s_params, ahead_s)):
        with swapped(params, values):
            logits, _ = plm.answer_logits(model, batch)
            dist = answer_distance(ref, logits, targets, coord.metric)
            grads = torch.autograd.grad(dist, params, allow_unused=True)
        out[name] = float(dist.detach())
        for p, g in zip(params, grads):
            if p.grad is not None and g is not None:
                p.grad = p.grad - coord.reg_weight * g
    return out[S], out[T]


@torch.no_grad()
def _measure_after_step(model, batch, ref, targets, s_params, t_params, before, metric: str) -> tuple[float, float]:
    """(d_S, d_T) of eq. (3) after the step t -> t+1 was taken: ``before`` holds every parameter at
    t; d_T compares p(S_t, T_{t+1}) with y_hat = p(S_t, T_t), d_S compares p(S_{t+1}, T_t) with it."""
    before_s, before_t = before[: len(s_params)], before[len(s_params) :]
    with swapped(s_params, before_s):
        d_t = float(answer_distance(ref, plm.answer_logits(model, batch)[0], targets, metric))
    with swapped(t_params, before_t):
        d_s = float(answer_distance(ref, plm.answer_logits(model, batch)[0], targets, metric))
    return d_s, d_t


def _rates(
    schedule: Schedule, coord: Coordination, order: tuple[str, str] | None
) -> tuple[tuple[str, ...], float, float]:
    """This step's trained components and the rates of S and T: both at the schedule's rates, or
    (CD, ``order`` its two phases) the phase's component at ``coord.lr`` and the other at 0."""
    if order is None:
        rate_s, rate_t = schedule.rates
        return (S, T), rate_s, rate_t
    active = (order[schedule.phase],)
    return active, coord.lr if S in active else 0.0, coord.lr if T in active else 0.0


def _backward(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    s_params: list[torch.nn.Parameter],
    t_params: list[torch.nn.Parameter],
    active: tuple[str, ...],
    row: dict[str, float | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of ``batch`` and its gradients, recorded in ``row`` (the loss and the normalized
    gradient norms ||G|| / ||theta|| of ``s_params`` and ``t_params``, Section 4.2), then the gradients
    of the components not ``active`` dropped; the answer logits and targets."""
    logits, targets = plm.answer_logits(model, batch)
    loss = plm.example_losses(logits, targets).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    row["loss"] = float(loss.detach())
    row["grad_S"] = _norm(p.grad for p in s_params if p.grad is not None) / max(_norm(s_params), 1e-12)
    row["grad_T"] = _norm(p.grad for p in t_params if p.grad is not None) / max(_norm(t_params), 1e-12)
    for name, params in ((S, s_params), (T, t_params)):
        if name not in active:
            for p in params:
                p.grad = None
    return logits, targets


def _step_and_measure(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    logits: torch.Tensor,
    targets: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    s_params: list[torch.nn.Parameter],
    t_params: list[torch.nn.Parameter],
    coord: Coordination,
    row: dict[str, float | None],
) -> float | None:
    """The optimizer step on ``batch`` (``logits``, ``targets``: its answer logits before the step),
    with eq. (5)'s d_S, d_T measured where ``coord``'s trainer needs them (regularized: before the
    step; else after it); the step's kappa and the measures recorded in ``row`` (None: unmeasured)."""
    ref = logits.detach()
    d_s = d_t = None
    if coord.regularized or coord.measures:
        norms = input_norms(model, batch)  # eq. (5)'s norms at theta_t
    if coord.regularized:
        d_s, d_t = _regularized_gradients(model, batch, ref, targets, optimizer, s_params, t_params, coord)
        optimizer.step()
    elif coord.measures:
        before = [p.detach().clone() for p in s_params + t_params]
        optimizer.step()
        d_s, d_t = _measure_after_step(model, batch, ref, targets, s_params, t_params, before, coord.metric)
    else:
        optimizer.step()
    if d_s is None or d_t is None:  # measured together
        return None
    kappa = balance_coefficient(d_t, d_s)
    i_t, encoded, raw = norms
    row.update(kappa=kappa, d_S=d_s, d_T=d_t, H_S=d_s / (i_t + encoded), H_T=d_t / raw)
    return kappa


def train_coordinated(
    model: torch.nn.Module,
    groups: dict[str, list[torch.nn.Parameter]],
    batches: Iterable[dict[str, torch.Tensor]],
    coord: Coordination,
    schedule: Schedule,
    make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
) -> tuple[Schedule, dict[str, list[float | None]]]:
    """One optimizer step of ``coord.trainer`` per batch, continuing ``schedule``; returns the new
    schedule and per-step curves (:data:`CURVES`: the loss, kappa, d_S, d_T, H_S and H_T of eq. (5),
    the rates, the normalized gradient norms ||G|| / ||theta|| of Section 4.2 (loss gradients) and,
    for CD, each window's relative weight change; None where not measured).

    ``make_optimizer(param_groups)`` builds the optimizer over ``[{"params": S}, {"params": T}]``
    (a fresh one per call: one round of one client, like every method's local training); the
    rates are set on its two groups before each step. A component that does not train this step
    (CD) gets no gradient, so the optimizer leaves it and its state alone."""
    schedule = Schedule(schedule.step, list(schedule.kappas), schedule.rates, schedule.phase)
    s_params, t_params = groups[S], groups[T]
    optimizer = make_optimizer([{"params": s_params}, {"params": t_params}])
    curves: dict[str, list[float | None]] = {k: [] for k in CURVES}
    order = CD_ORDER.get(coord.trainer)
    window: list[torch.Tensor] | None = None  # CD: the first component's weights at the window's start
    window_steps = 0
    model.eval()  # y_hat is the evaluation-mode prediction (module docstring)
    device = model_device(model)
    for batch in batches:
        if device.type != "cpu":  # host batches; eq. (5)'s norms call the embedding on them directly
            batch = to_device(batch, device)
        row: dict[str, float | None] = dict.fromkeys(CURVES)
        active, rate_s, rate_t = _rates(schedule, coord, order)
        if order is not None and schedule.phase == 0 and window is None:
            window = [p.detach().clone() for p in groups[order[0]]]
        optimizer.param_groups[0]["lr"], optimizer.param_groups[1]["lr"] = rate_s, rate_t
        row["lr_S"], row["lr_T"] = rate_s, rate_t
        logits, targets = _backward(model, batch, optimizer, s_params, t_params, active, row)
        kappa = _step_and_measure(model, batch, logits, targets, optimizer, s_params, t_params, coord, row)
        if order is not None and schedule.phase == 0:
            window_steps += 1
            if window_steps == coord.cd_window and window is not None:  # set at the phase's start
                first = groups[order[0]]
                row["cd_change"] = change = relative_change(first, window)
                if change < coord.cd_tolerance:
                    schedule.phase = 1
                window, window_steps = [p.detach().clone() for p in first], 0
        schedule.observe(kappa, coord)
        if order is not None and schedule.phase == 0 and schedule.step >= coord.cd_max_steps:
            schedule.phase = 1
        for k in CURVES:
            curves[k].append(row[k])
    return schedule, curves
