"""A run folder's trained model: its config and its adapter, checked, on the run's own base.

A run folder (:mod:`fedtune.run`) holds ``config.toml`` (the resolved config) and, for LoRA
methods, ``adapter/`` (PEFT ``save_pretrained``). :func:`open_run` reads and checks both, the
adapter's weights too (readable, finite): bad input is one line naming the path.
:meth:`TrainedRun.model` builds the base as the run did (the task's ``build_model`` from the run's
seed, prepared for ``model.dtype`` / ``model.quantization`` / ``device`` by
:func:`~fedtune.models.precision.prepare_base`) and loads the adapter onto it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fedtune.config import ConfigError, RunConfig, load_config
from fedtune.runtime import resolve_run
from fedtune.tasks import Task

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def make_task(config: RunConfig) -> Task:
    """The task of ``config`` (resolved and checked as a run resolves it)."""
    run = resolve_run(config)
    return run.task_class(run.config, run.task_options)


def evaluation_task(config: RunConfig) -> Task:
    """The task of ``config`` for scoring only: its test set drawn as a run draws it
    (``data.max_test_samples``, seed 0), without the checks a training pool must pass (one
    commonsense set is one label: no pool to partition, and none is needed)."""
    from fedtune.tasks.base import subsample

    task = make_task(config)
    train, test = task.load()
    test = subsample(test, config.data.max_test_samples, 0)
    if len(test) == 0:
        raise ConfigError(f"data {config.data.name!r}: the test set is empty")
    task.__dict__["data"] = (train, test)  # Task.data is a cached_property: this is its value
    return task


def prepared_base(task: Task) -> torch.nn.Module:
    """The task's base model, built from the run's seed and prepared as the run's workspace
    prepares it (dtype, quantization, device)."""
    from fedtune.models.precision import prepare_base

    return prepare_base(task.build_model(task.config.seed), task.config, task.head_modules()).eval()


@dataclass(frozen=True)
class TrainedRun:
    """A checked run folder: ``config`` (its ``config.toml``) and ``adapter_dir``."""

    run_dir: Path
    config: RunConfig
    adapter_dir: Path
    adapter_config: dict

    def task(self, config: RunConfig | None = None) -> Task:
        return make_task(config or self.config)

    def model(self, task: Task) -> PeftModel:
        """The adapter on the run's base, prepared as the run's (eval mode)."""
        from peft import PeftModel

        try:
            return PeftModel.from_pretrained(prepared_base(task), str(self.adapter_dir)).eval()
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ConfigError(
                f"{str(self.adapter_dir)!r}: the adapter does not load onto the run's base "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None


def open_run(run_dir: Path) -> TrainedRun:
    """The run folder ``run_dir``, checked: a folder with a readable ``config.toml`` and an
    ``adapter/`` holding a readable ``adapter_config.json``; else one line naming the path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{str(run_dir)!r}: not a run folder (no such folder)")
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError(f"{str(run_dir)!r}: not a run folder (no config.toml)")
    config = load_config(config_path)
    adapter_dir = run_dir / ADAPTER
    adapter_config = adapter_dir / ADAPTER_CONFIG
    if not adapter_config.is_file():
        raise ConfigError(
            f"{str(adapter_dir)!r}: no adapter there (method {config.method!r} saves none, or the run did not finish)"
        )
    try:
        info = json.loads(adapter_config.read_text())
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{str(adapter_config)!r}: cannot be read ({exc})") from None
    check_weights(adapter_dir / ADAPTER_WEIGHTS)
    return TrainedRun(run_dir, config, adapter_dir, info)


def check_weights(path: Path) -> None:
    """One line naming ``path`` when its tensors cannot be read (missing, empty, truncated,
    corrupted) or are not all finite (an adapter of NaNs scores as if it were a model)."""
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error kinds on a damaged file
        first = (str(exc).splitlines() or [""])[0]
        raise ConfigError(
            f"{str(path)!r}: the adapter's weights cannot be read ({type(exc).__name__}: {first})"
        ) from None
    bad = next((name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    if bad is not None:
        raise ConfigError(f"{str(path)!r}: the adapter's weights are not finite ({bad} holds NaN or inf)")
