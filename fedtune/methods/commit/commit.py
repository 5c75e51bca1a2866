"""CoMMIT (Wu et al.): coordinated tuning of a feature encoder S and a language model T, with its
baselines, centralized (one party) or inside federated rounds.

Registered once, as ``commit``; ``options.trainer`` picks the local trainer
(:data:`~fedtune.methods.commit.balance.TRAINERS`):

- ``constant``: Constant LR / Section 4's Synced LR: both components at ``train.lr``;
- ``language-lr-up`` / ``vision-lr-up``: Section 4's Language LR up / Vision LR up: the LM's (or the
  encoder's, vision or audio) rate is ``options.lr_up`` x ``train.lr``;
- ``feature-cd`` / ``language-cd``: coordinate descent (Section 7): S alone until its weights
  stabilize, then T alone (or the reverse);
- ``commit-clr``: rates from the learning balance kappa (eqs. (3), (6));
- ``commit`` (default): CoMMIT-CLR plus the auxiliary regularizer of eqs. (7)-(8).

The equations and every reading of the paper are in :mod:`fedtune.methods.commit.balance`.

Rounds. The server holds the global adapter (S's projectors and trainable encoders, T's LoRA) and
the trainers' schedule (:class:`~fedtune.methods.commit.balance.Schedule`: steps taken, the window of the
last N_kappa kappas, the two rates, the CD phase) and sends both; each client runs
``train.local_steps`` steps of its trainer on its own batches from the received schedule (a fresh
optimizer each round, as every method's local training), measuring its own kappa, and uploads its
update with its schedule and per-step curves. The server averages the updates (FedAvg, FedIT's
aggregation) and merges the schedules (:meth:`~fedtune.methods.commit.balance.Schedule.merge`: kappa windows
and rates averaged with the FedAvg weights). **Centralized mode** is ``federation.num_clients = 1``:
one party holding all data; the merge is then the identity, so its schedule runs on across rounds
exactly as in one continuous run; its optimizer does too with ``options.carry_optimizer`` (kept in
the client's persistent state), so a centralized run can be evaluated every round (``rounds = 1``
also keeps one optimizer throughout).
Federated clients are partitioned by question type (``task.partition_by = "question"``) or answer
(label) skew (``data.partition = "dirichlet"``) like any instruction run.

Round metrics (``metrics.jsonl``): ``kappa`` and ``kappa_std`` (over every client's steps of the
round), ``lr_encoder`` / ``lr_language_model`` (the server's rates after the round), ``cd_phase``,
and ``client_curves``: per client, per step, the loss, kappa, d_S, d_T, H_S, H_T (eq. (5)), the
rates, the normalized gradient norms ||G|| / ||theta|| of both components (Section 4.2), and CD's
weight change per window.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import numpy as np
import torch
from pydantic import Field

from fedtune.config import ConfigError, RunConfig
from fedtune.methods.base.averaging import SERVER_STEP_AND_UPLOAD_CODEC, BroadcastAverage, Weighting, client_weights
from fedtune.methods.base.lora import LORA, SERVER_DEVIATIONS, GlobalAdapterStrategy, LoraClient
from fedtune.methods.commit.balance import TRAINERS, Coordination, S, Schedule, T, train_coordinated
from fedtune.methods.commit.plan import commit_workload
from fedtune.models.tensors import to_numpy
from fedtune.models.training import FitResult, make_optimizer, optimizer_arrays, restore_optimizer
from fedtune.planning.lora_plan import lora_plan
from fedtune.planning.spec import PlanningContext
from fedtune.protocol.context import options_as
from fedtune.protocol.messages import Message
from fedtune.protocol.validation import MetaField
from fedtune.registry import MethodOptions, register

if TYPE_CHECKING:
    from fedtune.planning.memory import Workload


ENCODER_LM = "encoder+lm"  # the task capability (Task.capabilities): parameter groups `encoder` and `language_model`
Trainer = Literal["constant", "language-lr-up", "vision-lr-up", "feature-cd", "language-cd", "commit-clr", "commit"]
assert set(get_args(Trainer)) == set(TRAINERS)


class CommitOptions(MethodOptions):
    trainer: Trainer = Field("commit", description="local trainer: " + ", ".join(TRAINERS))
    alpha: float | None = Field(
        None,
        gt=0,
        description="eq. (6)'s learning advantage alpha (default 2 x train.lr: "
        "both rates equal train.lr at kappa~ = 1)",
    )
    gamma: float = Field(1.0, gt=0, description="eq. (6)'s gamma")
    n_kappa: int = Field(10, ge=1, description="N_kappa: steps in kappa's moving average (eq. (6))")
    l_lr: int = Field(5, ge=1, description="L_lr: steps between learning-rate refreshes (Section 5.1)")
    reg_weight: float = Field(0.1, ge=0, description="lambda: weight of the regularizer of eqs. (7)-(8) (commit)")
    metric: Literal["tv", "kl"] = Field("tv", description="d: total variation (a metric) or KL(p_t || p_t+1)")
    lr_up: float = Field(10.0, gt=0, description="language-lr-up / vision-lr-up: that component's rate factor")
    cd_window: int = Field(5, ge=1, description="CD: steps per stabilization check")
    cd_tolerance: float = Field(0.01, ge=0, description="CD: switch when the window's relative weight change is below")
    cd_max_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="CD: switch at the latest after this share of the run's steps (rounds x local_steps)",
    )
    measure_kappa: bool = Field(True, description="measure kappa for constant / lr-up trainers too (2 forwards a step)")
    weighting: Weighting = Field("examples", description="FedAvg weights p_i: data size or 1/N")
    carry_optimizer: bool = Field(
        False,
        description="centralized mode (one client) only: the optimizer's state "
        "carries across rounds, so R rounds of H steps train as one run of R x H steps "
        "evaluated every round",
    )

    deviations: ClassVar[dict[str, str]] = {
        **SERVER_DEVIATIONS,
        "options.weighting": "'uniform' departs from FedAvg's data-size weights",
        "options.metric": "'kl' is not a metric, as eqs. (1)-(2) assume of d",
    }

    def config_refusal(self, config: RunConfig) -> str | None:
        """Dropout (the kappa of eq. (3) compares deterministic predictions); ``carry_optimizer``
        with more than one client."""
        if config.model.lora_dropout:
            return "model.lora_dropout: method 'commit' compares deterministic predictions; set it to 0"
        if self.carry_optimizer and config.federation.num_clients != 1:
            return (
                f"options.carry_optimizer: centralized mode only (federation.num_clients = 1), got "
                f"{config.federation.num_clients} clients"
            )
        return None


def coordination(options: CommitOptions, config) -> Coordination:
    """The trainer's settings from the method's options and the run's ``train.lr``."""
    total = config.rounds * config.train.local_steps
    return Coordination(
        trainer=options.trainer,
        lr=config.train.lr,
        alpha=options.alpha,
        gamma=options.gamma,
        n_kappa=options.n_kappa,
        l_lr=options.l_lr,
        reg_weight=options.reg_weight,
        metric=options.metric,
        lr_up=options.lr_up,
        cd_window=options.cd_window,
        cd_tolerance=options.cd_tolerance,
        cd_max_steps=max(1, math.ceil(options.cd_max_fraction * total)),
        measure=options.measure_kappa,
    )


def component_params(task, params: dict[str, torch.nn.Parameter]) -> dict[str, list[torch.nn.Parameter]]:
    """The adapter's parameters as S (``encoder``) and T (``language_model``), from the task's
    :meth:`~fedtune.tasks.base.Task.parameter_groups`; a task without exactly these two non-empty
    groups stops the run with one line."""
    try:
        names = task.parameter_groups(list(params))
    except ValueError as exc:
        raise ConfigError(f"method 'commit': task {task.kind!r}: {exc}") from None
    if set(names) != {S, T} or not names[S] or not names[T]:
        got = {k: len(v) for k, v in names.items()}
        raise ConfigError(
            f"method 'commit' needs trainable parameters in two groups, {S!r} and {T!r}; task {task.kind!r} gives {got}"
        )
    return {g: [params[n] for n in names[g]] for g in (S, T)}


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


class CommitStrategy(BroadcastAverage, GlobalAdapterStrategy):
    """CoMMIT and its baselines (options.trainer): coordinated encoder / LM tuning, FedAvg of S and T."""

    options: CommitOptions  # the method's registered options class (resolve_run validated them)

    def reply_meta_spec(self, kind: str, cid: int) -> dict[str, MetaField]:
        """Aggregation reads each training reply's ``schedule`` and ``curves``: required mappings (a
        kappa may be inf by eq. (3) when a component's step moved nothing, so their numbers are not
        required finite). A mapping of the wrong shape stops the round at aggregation, in one line."""
        mapping = MetaField(dict, required=True, finite=False)
        return self.meta_with(kind, cid, "train", schedule=mapping, curves=mapping)

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        ws = self.context.workspace
        component_params(self.context.task, ws.activate(self.rank))
        self.global_arrays = ws.state(self.rank)
        self.schedule = Schedule.start(coordination(self.options, self.config))

    def fit_meta(self, rnd: int) -> dict:
        return {"round": rnd, "rank": self.rank, "schedule": self.schedule.to_meta()}

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict:
        metrics: dict[str, Any] = super().aggregate_fit(rnd, replies)  # and the curves, None where unmeasured
        if not replies:
            return metrics
        schedules = [Schedule.from_meta(m.meta["schedule"]) for m in replies.values()]
        self.schedule = Schedule.merge(schedules, client_weights(replies, self.options.weighting))
        kappas = _finite(k for m in replies.values() for k in m.meta["curves"]["kappa"])
        metrics.update(
            {
                "kappa": float(np.mean(kappas)) if kappas else None,
                "kappa_std": float(np.std(kappas)) if kappas else None,
                "lr_encoder": self.schedule.rates[0],
                "lr_language_model": self.schedule.rates[1],
                "cd_phase": self.schedule.phase,
                "client_curves": {str(cid): m.meta["curves"] for cid, m in replies.items()},
            }
        )
        return metrics

    def state_dict(self) -> dict:
        return {**super().state_dict(), "schedule": self.schedule.to_meta()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.schedule = Schedule.from_meta(state["schedule"])


class CommitClient(LoraClient):
    options: CommitOptions  # the method's registered options class (resolve_run validated them)

    def fit(self, message: Message) -> Message:
        start = time.perf_counter()
        received, cfg = message.arrays, self.config.train
        ws, task = self.context.workspace, self.context.task
        params = ws.load(received, int(message.meta["rank"]))
        seed = self.train_seed(int(message.meta["round"]))
        torch.manual_seed(seed)
        pool = self.context.partitions[self.cid]
        batches = task.train_batches(pool, cfg.batch_size, cfg.local_steps, np.random.default_rng(seed))
        built: list[torch.optim.Optimizer] = []  # train_coordinated builds one optimizer

        def optimizer(groups: list[dict]) -> torch.optim.Optimizer:
            built.append(make_optimizer(groups, cfg))  # type: ignore[arg-type]  # torch's optimizers take param groups
            if self.options.carry_optimizer:  # centralized: continue last round's optimizer
                restore_optimizer(built[-1], self.state)
            return built[-1]

        schedule, curves = train_coordinated(
            ws.peft_model,
            component_params(task, params),
            batches,
            coordination(self.options, self.config),
            Schedule.from_meta(message.meta["schedule"]),
            optimizer,
        )
        if self.options.carry_optimizer:
            self.state = optimizer_arrays(built[-1])
        trained = {k: to_numpy(p) for k, p in params.items()}
        result = FitResult(
            float(np.mean(np.asarray(curves["loss"], dtype=np.float64))),
            cfg.local_steps,
            len(pool),
            time.perf_counter() - start,
        )
        return self.upload(
            {k: trained[k] - received[k] for k in trained}, result, schedule=schedule.to_meta(), curves=curves
        )


def planned_step(context: PlanningContext, work: Workload) -> Workload:
    """A CoMMIT client's step as the planner prices it: FedIT's ``work`` with the run's trainer's
    passes and held tensors (:func:`~fedtune.methods.commit.plan.commit_workload`)."""
    return commit_workload(context, work, coordination(options_as(context, CommitOptions), context.config))


register(
    "commit",
    CommitStrategy,
    CommitClient,
    CommitOptions,
    requires=(*LORA, ENCODER_LM),
    # a 4-bit base computes in float32 here; a bfloat16 base would round the predictions whose small
    # relative changes kappa compares (measured on the tiny task: kappa 1.91 vs 2.83 in float32).
    # No train.gradient_checkpointing: the trainer runs the model in evaluation mode (y_hat), where
    # Hugging Face layers do not checkpoint (measured: 22.3 MB peak with it, 21.5 MB without)
    supports=(*SERVER_STEP_AND_UPLOAD_CODEC, "model.quantization", "device"),
    description="CoMMIT and baselines (options.trainer: " + ", ".join(TRAINERS) + "); FedAvg of S and T",
    plan=lora_plan(None, step=planned_step),  # no knob: rank r or nothing
)
