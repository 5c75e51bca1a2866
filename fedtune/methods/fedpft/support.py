"""What the proxy methods (FedPFT, FedOT) and FedPETuning share besides the strategy: a task over a
given model, tensor <-> array conversion, local LoRA training on a model, the public data set of
the distillations, and their cost metrics (parameters, training memory, bytes)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from fedtune.config import ConfigError, RunConfig
from fedtune.models import precision
from fedtune.models.lora import LoraWorkspace
from fedtune.models.tensors import to_numpy
from fedtune.models.train_memory import ActivationMeter, optimizer_states, training_peak_bytes
from fedtune.models.training import FitResult, train_local
from fedtune.protocol.context import ClientContext
from fedtune.protocol.messages import Message
from fedtune.tasks import build_task
from fedtune.tasks.base import subsample

MB = 1e6


class ModelTask:
    """The run's task with ``build_model`` returning ``factory()`` (a proxy, or the full model with
    other LoRA targets) and, when ``targets`` is given, those LoRA target modules; everything else
    is the task's own (for :class:`~fedtune.models.lora.LoraWorkspace`)."""

    def __init__(self, task: Any, factory: Callable[[], torch.nn.Module], targets: list[str] | None = None) -> None:
        self._task, self._factory = task, factory
        cfg = task.config
        self.config = (
            cfg
            if targets is None
            else cfg.model_copy(update={"model": cfg.model.model_copy(update={"target_modules": list(targets)})})
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def build_model(self, seed: int) -> torch.nn.Module:
        return self._factory()


def task_model(context: ClientContext) -> torch.nn.Module:
    """The task's model on the run's ``device`` (:func:`~fedtune.models.precision.place`): what a
    proxy is cut from, and the distillations' teacher."""
    model = context.task.build_model(context.config.seed)
    return precision.place(model, precision.resolve_device(context.config.device))


def lora_target_modules(task: Any, model: torch.nn.Module) -> list[str]:
    """Full names of the modules of ``model`` that the task's LoRA targets match (PEFT's rule:
    the name, or a name ending in ``.target``)."""
    cfg = task.config.model
    targets = list(cfg.target_modules) if cfg.target_modules is not None else task.lora_targets()
    return [n for n, _ in model.named_modules() if n and any(n == t or n.endswith("." + t) for t in targets)]


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, tensors kept as the live parameters / buffers."""
    return dict(model.state_dict(keep_vars=True))


def as_arrays(tensors: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, np.ndarray]:
    return {prefix + k: to_numpy(t) for k, t in tensors.items()}


def load_tensors(tensors: Mapping[str, torch.Tensor], arrays: Mapping[str, np.ndarray], strict: bool = True) -> None:
    """Copy ``arrays`` into the named ``tensors`` (all of them when ``strict``)."""
    if strict and set(arrays) != set(tensors):
        missing, extra = sorted(set(tensors) - set(arrays)), sorted(set(arrays) - set(tensors))
        raise ValueError(f"proxy arrays do not fit the skeleton: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, array in arrays.items():
            tensors[name].copy_(torch.as_tensor(array))


def train_lora(
    ws: LoraWorkspace,
    arrays: Mapping[str, np.ndarray],
    rank: int,
    alpha: float | None,
    task: Any,
    pool: np.ndarray,
    config: RunConfig,
    seed: int,
) -> tuple[dict[str, np.ndarray], FitResult, int]:
    """Load ``arrays`` into ``ws``'s adapter, train it locally (:func:`train_local`), and measure
    the training's peak memory (:func:`~fedtune.models.train_memory.training_peak_bytes`).
    Returns (trained arrays, fit result, peak bytes)."""
    params = ws.load(arrays, rank, alpha)
    model = ws.peft_model
    with ActivationMeter(model) as meter:
        result = train_local(model, list(params.values()), task, pool, config.train, seed)
    peak = training_peak_bytes(
        model, list(params.values()), optimizer_states(config.train.optimizer, config.train.momentum), meter.peak
    )
    return {k: to_numpy(p) for k, p in params.items()}, result, peak


def memory_metrics(replies: Mapping[int, Message]) -> dict[str, float]:
    peaks = [float(m.meta["peak_mem_bytes"]) for m in replies.values() if "peak_mem_bytes" in m.meta]
    return {"client_peak_mem_mb": max(peaks) / MB} if peaks else {}


def size_metrics(model_params: int, adapter: Mapping[str, np.ndarray]) -> dict[str, float]:
    """What a client holds and trains: the parameters of its model (without LoRA) and of the adapter."""
    return {
        "client_model_params": float(model_params),
        "client_trainable_params": float(sum(a.size for a in adapter.values())),
    }


def base_params(model: torch.nn.Module) -> int:
    """Parameters of a model, LoRA and PEFT's trainable copies of the head left out."""
    return sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n and "modules_to_save" not in n)


class _Indices:
    """An index "data set" for :func:`~fedtune.tasks.base.subsample`: which examples it keeps."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def subset(self, idx: np.ndarray) -> np.ndarray:
        return np.asarray(idx)


def public_source(config: RunConfig, name: str | None, samples: int, seed: int) -> tuple[Any, np.ndarray]:
    """(a Task of the run's kind over the public data set, the pool of its examples to use).
    ``name``: a data set of the same kind (``samples`` of its training examples, drawn with
    ``seed``). None: the task's own training source, the examples the clients' pool leaves out
    (``data.max_train_samples`` draws the pool, with the run's seed, as
    :func:`~fedtune.tasks.base.subsample`), at most ``samples`` of them (drawn with ``seed``)."""
    data = config.data.model_copy(update={"max_test_samples": 8})
    if name is not None:
        data = data.model_copy(update={"name": name, "max_train_samples": samples, "test_path": None})
        task = build_task(config.model_copy(update={"data": data, "seed": seed}))
        return task, np.arange(len(task.train))
    limit = config.data.max_train_samples
    task = build_task(config.model_copy(update={"data": data.model_copy(update={"max_train_samples": None})}))
    n = len(task.train)
    if limit is None or limit >= n:
        raise ConfigError(
            "options.distill_data: name a public data set of the task's kind for distillation "
            "(none given, and data.max_train_samples leaves no example of the training source out of "
            "the clients' pool)"
        )
    held_out = np.setdiff1d(np.arange(n), subsample(_Indices(n), limit, config.seed))
    if len(held_out) > samples:
        held_out = np.sort(np.random.default_rng([seed, 0xD157]).choice(held_out, samples, replace=False))
    return task, held_out


def progress(label: str, steps: int) -> Callable[[int, float], None]:
    """A ``log(step, loss)`` that prints about ten lines to stderr."""
    every = max(1, steps // 10)

    def log(step: int, loss: float) -> None:
        if step % every == 0 or step == steps:
            print(f"{label}: step {step}/{steps}, loss {loss:.4f}", file=sys.stderr, flush=True)

    return log
