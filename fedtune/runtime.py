"""One run, resolved once; and RunContext: what one process needs to play the server or any client.

:func:`resolve_run` is the one resolution step between a config and the first round: it fills the
task's defaults (``data.name``, ``model.name``), looks the method up, checks the task's options, the
method x task x model capabilities, the cross-method options it honours, its own options, the
server's aggregation (:func:`~fedtune.methods.base.aggregation.plan_aggregation`: the privacy
parameters checked and calibrated once) and the method's rules of :data:`fedtune.config.RULES`, and builds the client
profiles, in that order (so the first error names the first bad field). The immutable
:class:`ResolvedRun` it returns is what travels: :func:`fedtune.launch.launch` resolves once and
hands it to the engine, which hands it on (:class:`RunContext`, the run folder
:attr:`ResolvedRun.run_dir`); a process that gets only a config (a Flower ServerApp or node, a
client device's worker: :attr:`ResolvedRun.config` is their serialized form) resolves it once.

A :class:`RunContext` is built from a :class:`ResolvedRun`; it loads lazily and caches the task (its
data, prepared once on first use, and the seeded partition) and the task's base model with its LoRA
adapters. All clients of a process share one context; none of them holds a model. The embedded
engine gives the server a context of its own, whose LoRA workspace it shares (``shares_base``): one
frozen base per process, however many clients; every user of a workspace loads the adapter arrays it
needs (from a Message, or the server's state) before each use, so the two sides still exchange
nothing but Messages. A client whose profile states another base format (its own
``federation.profiles[i].quantization`` or ``dtype``) trains on the process's base of that format,
built on first use (:meth:`RunContext.base_for`): one base per format in use, shared by the
clients of that format. The budget planner reads the model's meta-device skeleton
(:attr:`RunContext.skeleton`), not a loaded base, so a client process builds the run's base only
when one of its clients trains on it. The plan reads each client's budget from its node's report
(:meth:`RunContext.adopt`; :mod:`fedtune.planning.node_report`), by default the config's simulated nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedtune.config import ConfigError, RunConfig, check_rules, validate_options
from fedtune.data.partition import label_histograms
from fedtune.methods import get_method
from fedtune.methods.base.aggregation import AggregationPlan, plan_aggregation
from fedtune.planning.node_report import Reports, apply_reports, collect_reports, simulated_reports
from fedtune.planning.planner import Plan, check_plannable, check_profile_codecs, unrunnable
from fedtune.planning.quantization import check_profile_quantization
from fedtune.planning.spec import Knob
from fedtune.protocol.client import Client
from fedtune.protocol.context import ClientContext
from fedtune.protocol.profiles import ClientProfile, build_profiles
from fedtune.protocol.strategy import Strategy
from fedtune.registry import MethodOptions, MethodSpec
from fedtune.tasks import Task, TaskOptions, get_task_class, resolve_config

if TYPE_CHECKING:
    from fedtune.models.lora import LoraWorkspace


@dataclass(frozen=True)
class ResolvedRun:
    """A config with the task's defaults filled in, and everything checked and derived from it."""

    config: RunConfig
    method: MethodSpec
    task_class: type[Task]
    task_options: TaskOptions
    options: MethodOptions
    profiles: tuple[ClientProfile, ...]
    aggregation: AggregationPlan  # the server's combiner, DP parameters (calibrated) and server optimizer

    @property
    def run_dir(self) -> Path:
        """The run folder, ``output_dir/run_name`` of the resolved config (its name may come from
        the task's default ``data.name``): the one place it is spelled out."""
        return Path(self.config.output_dir) / self.config.run_name

    def relocated(self, output_dir: str) -> ResolvedRun:
        """This run writing under ``output_dir`` (nothing resolved depends on it)."""
        return replace(self, config=self.config.model_copy(update={"output_dir": output_dir}))


def resolve_run(config: RunConfig) -> ResolvedRun:
    """Resolve ``config`` once (see the module docstring); raises ConfigError naming the first bad field."""
    task_class = get_task_class(config.task.kind)
    config = resolve_config(config)
    method = get_method(config.method)
    task_options = validate_options(config.task.options, task_class.Options, prefix="task")
    method.check(task_class, config)
    method.check_options(config)
    options = validate_options(config.options, method.options)
    aggregation = plan_aggregation(config)  # the privacy parameters checked and calibrated once
    check_rules(config, options)
    fed = config.federation
    try:
        profiles = build_profiles(fed.num_clients, fed.profiles, fed.profile_choices, config.seed, fed.device_classes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    run = ResolvedRun(config, method, task_class, task_options, options, tuple(profiles), aggregation)
    check_plannable(run)
    check_profile_codecs(run)
    check_profile_quantization(run)
    return run


def as_resolved(run: RunConfig | ResolvedRun) -> ResolvedRun:
    """``run`` itself, or, given a config, resolved: an entry point's (:func:`~fedtune.launch.launch`,
    :func:`~fedtune.run.run_experiment`, ...) one resolution when it is called with a config."""
    return run if isinstance(run, ResolvedRun) else resolve_run(run)


class RunContext:
    """What one process needs to play the server or any client of the resolved ``run``; ``shares_base``:
    the context whose LoRA workspace this one shares (see the module docstring), None to build its own."""

    def __init__(self, run: ResolvedRun, shares_base: RunContext | None = None) -> None:
        if not isinstance(run, ResolvedRun):
            raise TypeError(f"RunContext takes a ResolvedRun (fedtune.runtime.resolve_run), got {type(run).__name__}")
        self.run = run
        self.shares_base = shares_base
        self.config = self.run.config
        self.method = self.run.method
        self.task: Task = self.run.task_class(self.config, self.run.task_options)
        self.options = self.run.options
        self._bases: dict[tuple[str, str], LoraWorkspace] = {}  # (quantization, dtype) -> a base (base_for)
        self.reports: Reports = collect_reports(simulated_reports(run.profiles))  # the config's simulated nodes

    def adopt(self, reports: Reports) -> None:
        """Plan from the nodes' ``reports`` (:mod:`fedtune.planning.node_report`) from now on: the
        plan and the profiles are made again on next use."""
        self.reports = reports
        for name in ("plan", "profiles"):
            self.__dict__.pop(name, None)

    @property
    def budgeted_profiles(self) -> list[ClientProfile]:
        """The config's profiles with each client's budget as its node reports it (:meth:`adopt`)."""
        return apply_reports(self.run.profiles, self.reports)

    @cached_property
    def plan(self) -> Plan | None:
        """The budget plan (:func:`~fedtune.planning.planner.plan_budgets`), None without budgets."""
        from fedtune.planning.planner import plan_budgets

        return plan_budgets(self)

    @cached_property
    def pricing(self) -> tuple[str | None, Knob, str]:
        """The run's knob, its priced :class:`~fedtune.planning.spec.Knob` and the plan's note
        (:func:`~fedtune.planning.planner.price_run`), built once (the plan and a node's refusal read it)."""
        from fedtune.planning.planner import price_run

        return price_run(self)

    def check_plan(self) -> None:
        """ConfigError when the budget plan leaves no round able to aggregate
        (:func:`~fedtune.planning.planner.unrunnable`): asked before the run folder is claimed."""
        reason = unrunnable(self.plan, self.config.federation.min_replies)
        if reason is not None:
            raise ConfigError(reason)

    @cached_property
    def profiles(self) -> list[ClientProfile]:
        """Each client's profile: the config's, with the planned knob where clients state budgets."""
        return list(self.run.profiles) if self.plan is None else list(self.plan.profiles)

    def round_limits(self) -> dict[str, dict[int, Any]]:
        """What the round loop enforces of the budgets (:class:`~fedtune.engines.rounds.RoundPolicy`)."""
        profiles = self.profiles
        return {
            "memory_bytes": {c: int(p.memory_gib * 2**30) for c, p in enumerate(profiles) if p.memory_gib},
            "deadlines": {c: p.deadline_s for c, p in enumerate(profiles) if p.deadline_s},
            "excluded": {} if self.plan is None else dict(self.plan.excluded),
        }

    @cached_property
    def partitions(self) -> list[np.ndarray]:
        """Client id -> indices into the task's training pool (seeded)."""
        return self.task.partition(self.config.federation.num_clients, self.config.seed)

    def example_bound(self, kind: str, cid: int) -> int:
        """The most examples client ``cid`` can hold in a reply of ``kind``: its partition's size; in
        an evaluation reply ("evaluate"), the test set's (clients evaluate on it)."""
        return len(self.task.test) if kind == "evaluate" else len(self.partitions[cid])

    def histograms(self) -> list[list[int]]:
        """Per-client label counts, ``[client][class]``."""
        return label_histograms(self.task.train.labels, self.partitions, self.task.num_labels)

    @cached_property
    def model(self) -> torch.nn.Module:
        """The task's base model, for methods that train it directly (no LoRA), on the run's
        ``device`` (:func:`~fedtune.models.precision.place`)."""
        from fedtune.models.precision import place

        return place(self.task.build_model(self.config.seed), self.config.device)

    @cached_property
    def skeleton(self) -> torch.nn.Module:
        """The task's model on the meta device: its modules and shapes, no weights (a pretrained
        model from its configuration, :func:`~fedtune.models.loading.on_meta`). The planner reads
        it, so a process plans without loading a base and builds one only for a client of its own."""
        import warnings

        with torch.device("meta"), warnings.catch_warnings():
            # a pretrained encoder's weights copied into its meta parameters: a no-op torch warns of
            warnings.filterwarnings("ignore", "for .*: copying from a non-meta parameter", UserWarning)
            return self.task.build_model(self.config.seed)

    @cached_property
    def workspace(self) -> LoraWorkspace:
        """The task's base model with PEFT LoRA adapters by rank (LoRA methods): ``shares_base``'s
        when given (the same config in the same process), else built here."""
        from fedtune.models.lora import LoraWorkspace

        if self.shares_base is not None:
            return self.shares_base.workspace
        return LoraWorkspace(self.task, self.config.seed)

    def base_format(self, profile: ClientProfile) -> tuple[str, str]:
        """(quantization, dtype) of the base ``profile``'s client trains on: its own, else the run's."""
        cfg = self.config.model
        return profile.quantization or cfg.quantization, profile.dtype or cfg.dtype

    def base_for(self, quantization: str | None, dtype: str | None = None) -> LoraWorkspace:
        """The LoRA workspace whose base is quantized as ``quantization`` and stored in ``dtype`` (a
        client profile's; None: the run's ``model.quantization`` / ``model.dtype``; both the run's:
        :attr:`workspace`), built on first use by the context that holds the process's bases
        (``shares_base``'s): one base per format, shared by the clients of that format."""
        cfg = self.config.model
        key = (quantization or cfg.quantization, dtype or cfg.dtype)
        if key == (cfg.quantization, cfg.dtype):
            return self.workspace
        if self.shares_base is not None:
            return self.shares_base.base_for(*key)
        if key not in self._bases:
            from fedtune.models.lora import LoraWorkspace

            self._bases[key] = LoraWorkspace(self.task, self.config.seed, *key)
        return self._bases[key]

    def loaded_bases(self) -> list[torch.nn.Module]:
        """The base models this context has loaded so far (:attr:`model`, :attr:`workspace`'s and
        each :meth:`base_for`'s), none built here: what a DP run fingerprints (:mod:`fedtune.fingerprint`)."""
        held = vars(self)
        modules = [held["model"]] if "model" in held else []
        if "workspace" in held:
            modules.append(held["workspace"].base)
        return modules + [ws.base for _, ws in sorted(self._bases.items())]

    def client(
        self, cid: int, state: dict[str, np.ndarray] | None = None, profile: ClientProfile | None = None
    ) -> Client:
        """A fresh client object for ``cid`` (cheap: it shares this context's model and data), given
        its carried ``state`` (None: a new client) and ``profile`` (None: its planned one); one whose
        profile states its own base format sees this context with that base as its workspace."""
        profile = self.profiles[cid] if profile is None else profile
        context: ClientContext = self
        if self.base_format(profile) != (self.config.model.quantization, self.config.model.dtype):
            context = OwnBase(self, self.base_for(*self.base_format(profile)))
        return self.method.client(cid, profile, context, state)

    def strategy(self) -> Strategy:
        """A fresh server strategy of the run's method on this context."""
        return self.method.strategy(self)


class OwnBase:
    """``context`` as a client with its own base sees it: every attribute the context's, but its
    ``workspace`` (:meth:`RunContext.base_for`)."""

    def __init__(self, context: RunContext, workspace: LoraWorkspace) -> None:
        self.context, self.workspace = context, workspace

    def __getattr__(self, name: str) -> Any:
        return getattr(self.context, name)
