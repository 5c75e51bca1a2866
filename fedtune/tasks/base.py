"""The Task interface: what a run learns (data, model, batches, loss, metrics), beside the method
(how parties collaborate) and the engine (how messages travel).

A task kind is one module in ``fedtune/tasks/`` that subclasses :class:`Task` and calls
:func:`register_task` (here; :mod:`fedtune.tasks` finds the modules and looks kinds up). One Task
object per process (held by the RunContext) caches its data in the form training needs (tokenized
text, decoded images, log-mel features), computed once on first use. Methods and engines only call
the methods below; they never branch on the kind. A method that needs more than this interface (for
example a bilevel split of parameters) asks for a capability (:attr:`Task.capabilities`).

The datasets a task returns are its own types; the interface needs only ``len(ds)``,
``ds.labels`` (an int64 array, one label per example, used by the partitioners) and
``ds.subset(idx)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from fedtune.config import ConfigError, RunConfig
from fedtune.models.bilevel import BilevelProblem


class TaskOptions(BaseModel):
    """Base for a task's own options (the ``[task]`` table of a recipe, beside ``kind``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite


def subsample(ds: Any, limit: int | None, seed: int) -> Any:
    """At most ``limit`` examples of ``ds``, drawn without replacement with ``seed`` (order kept)."""
    if limit is None or limit >= len(ds):
        return ds
    idx = np.sort(np.random.default_rng(seed).choice(len(ds), size=limit, replace=False))
    return ds.subset(idx)


def majority_rate(labels: np.ndarray) -> float:
    """Accuracy of always predicting the most frequent label."""
    labels = np.asarray(labels)
    return float(np.bincount(labels).max() / len(labels)) if len(labels) else 0.0


class Task(ABC):
    """One kind of learning problem: its data, its model, its batches, loss and metrics.

    Subclasses set :attr:`kind`, :attr:`defaults` (``data.name`` / ``model.name`` when the
    recipe leaves them out), optionally :attr:`Options` and :attr:`capabilities`, and implement
    the abstract methods.
    """

    kind: ClassVar[str]
    description: ClassVar[str] = ""
    #: what the task offers beyond the basics with some of its models: "lora" (LoRA target
    #: modules), "transformer" (transformer blocks with FFNs), "encoder+lm" (parameter groups
    #: ``encoder`` and ``language_model``), ...; :meth:`capabilities_for` says
    #: which of them the configured model has
    capabilities: ClassVar[frozenset[str]] = frozenset()
    #: config values used when the recipe leaves them out: {"data.name": ..., "model.name": ...}
    defaults: ClassVar[dict[str, str]] = {}
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    #: PEFT TaskType name of the model (for example "SEQ_CLS"), None for a custom module
    peft_task_type: ClassVar[str | None] = None
    #: overrides that make a run of this kind take seconds (a tiny model, a few examples, real
    #: data): the contract test runs every method that supports the kind on them
    test_overrides: ClassVar[tuple[str, ...]] = ()
    #: further named configurations the contract test runs too (each on top of ``test_overrides``),
    #: for model families the default one does not exercise (LoRA on convolutions, say)
    test_variants: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def capabilities_for(cls, config: RunConfig) -> frozenset[str]:
        """The capabilities of the task with ``config``'s model (default: all of them)."""
        return cls.capabilities

    def __init__(self, config: RunConfig, options: TaskOptions) -> None:
        self.config = config
        self.options = options

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of a task whose model reads text (an export writes it beside the
        weights); None for one that has none."""
        return None

    @property
    def model_name(self) -> str:
        """``model.name``, which :func:`fedtune.tasks.resolve_config` filled in from the task's
        default; one line when it is still unset (a task kind that names no default model)."""
        if self.config.model.name is None:
            raise ConfigError(f"model.name: not set, and task {self.kind!r} names no default model")
        return self.config.model.name

    # -- data --------------------------------------------------------------------------------
    @abstractmethod
    def load(self) -> tuple[Any, Any]:
        """(training pool, test set) in full, before any subsampling."""

    @cached_property
    def data(self) -> tuple[Any, Any]:
        """(training pool, test set) as :meth:`prepare` makes them, once."""
        return self.prepare()

    def prepare(self) -> tuple[Any, Any]:
        """(training pool, test set), subsampled to ``data.max_train_samples`` (with the run's
        seed) and ``data.max_test_samples`` (seed 0: every run of a set tests on the same examples);
        prepared on the CPU also when first read while a model's skeleton is built on the meta device."""
        cfg = self.config.data
        with torch.device("cpu"):
            train, test = self.load()
        train, test = (
            subsample(train, cfg.max_train_samples, self.config.seed),
            subsample(test, cfg.max_test_samples, 0),
        )
        if len(test) == 0:
            raise ConfigError(f"data {cfg.name!r}: the test set is empty (too few examples to hold out a test split?)")
        if len(np.unique(train.labels)) < 2:
            raise ConfigError(
                f"data {cfg.name!r}: every training example has the same label; a task needs at least 2 classes"
            )
        return train, test

    @property
    def train(self) -> Any:
        return self.data[0]

    @property
    def test(self) -> Any:
        return self.data[1]

    @property
    @abstractmethod
    def label_names(self) -> list[str]:
        """Class names, in label order."""

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def partition(self, num_clients: int, seed: int) -> list[np.ndarray]:
        """Client id -> indices into the training pool (``data.partition`` over the pool's labels,
        or over one of its ``columns`` where the pool has them)."""
        from fedtune.data.partition import partition

        return partition(self.train.labels, num_clients, self.config.data, seed, self.partition_columns())

    def partition_columns(self) -> dict[str, np.ndarray] | None:
        """The training pool's further integer columns by name (``data.partition = "column"``
        reads ``data.client_column`` there); default none."""
        return None

    #: what :meth:`majority_rate` is, as the run's summary line names it
    reference_name: str = "majority-class rate"

    def majority_rate(self) -> float:
        """The reference accuracy a learned model must beat: the test set's majority-class rate."""
        return majority_rate(self.test.labels)

    def run_files(self) -> dict[str, str]:
        """Files the run folder gets beside its config (name -> text): what the task chose that
        the config does not say (a causal-LM task's prompt template); default none."""
        return {}

    # -- model -------------------------------------------------------------------------------
    @abstractmethod
    def build_model(self, seed: int) -> torch.nn.Module:
        """The base model, its head freshly initialized from ``seed`` (every process that builds
        it, server or client, gets the same weights before training). Parameters that
        ``model.finetune = "head"`` freezes have ``requires_grad = False``."""

    def bilevel_problem(self, context: Any, options: Any) -> BilevelProblem:
        """This task's bilevel problem for the bilevel methods (RABO, RAFBO, FedMBO), given the
        run's context and the method's options; tasks with the ``bilevel`` capability supply one
        (:mod:`fedtune.tasks.bilevel_problems`)."""
        raise ConfigError(f"task {self.kind!r} offers no bilevel problem (it lacks the 'bilevel' capability)")

    def lora_targets(self) -> list[str]:
        """Default LoRA target modules of the task's model (``model.target_modules`` overrides;
        empty: the model has none, and a LoRA method asks the user to name them)."""
        return []

    def head_modules(self) -> list[str]:
        """Modules trained in full next to LoRA (PEFT ``modules_to_save``): the head."""
        return []

    def parameter_groups(self, names: list[str]) -> dict[str, list[str]]:
        """Trainable parameter names by group (CoMMIT tunes ``encoder`` and ``language_model``
        at different rates); default: one group ``model``."""
        return {"model": list(names)}

    # -- batches, loss, metrics --------------------------------------------------------------
    @abstractmethod
    def train_batches(self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator) -> Iterator[Any]:
        """``steps`` training batches from the examples ``pool`` of the training set, in an
        order fixed by ``rng``."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of ``model`` on ``batch`` (a scalar tensor)."""

    def step_shape(self) -> tuple[int, int | None]:
        """(tokens per row, positions per row whose LM-head logits :meth:`loss` computes; None:
        every one, or a head without vocabulary logits) of the largest training batch: the step the
        memory planner prices (:func:`fedtune.planning.workload.lora_workload`). Default:
        (``data.max_length``, None)."""
        return self.config.data.max_length, None

    def public_step_shape(self) -> tuple[int, int | None]:
        """A bound on :meth:`step_shape` from public information alone (the config and the task's
        label or answer vocabulary, public as a classifier's label set is; never the training
        rows): what the planner prices under DP,
        whose ``plan.json`` must not depend on one client's data. Default: (``data.max_length``,
        None), the cut every tokenized row gets."""
        return self.config.data.max_length, None

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, batch_size: int) -> dict[str, float]:
        """Metrics of ``model`` on the test set; always ``accuracy`` and ``loss``."""


_TASKS: dict[str, type[Task]] = {}


def register_task(task: type[Task]) -> type[Task]:
    """Register ``task`` under ``task.kind`` (usable as a class decorator)."""
    _TASKS[task.kind] = task
    return task
