"""RunContext: what one process needs to play the server or any client of a run.

Built from the config alone (so a Flower node builds the same one), it loads lazily and caches:
the task (its data, prepared once on first use, and the seeded partition) and the task's base
model with its LoRA adapters. All clients of a process share one context; none of them holds a
model. The embedded engine gives the server a context of its own, so the two sides share
nothing but Messages.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from fedtune.config import ConfigError, RunConfig, validate_options
from fedtune.data.partition import label_histograms
from fedtune.protocol.profiles import ClientProfile, build_profiles
from fedtune.registry import MethodSpec, get_method
from fedtune.tasks import Task, build_task, resolve_config


class RunContext:
    def __init__(self, config: RunConfig) -> None:
        self.config = resolve_config(config)
        self.method: MethodSpec = get_method(config.method)
        self.task: Task = build_task(self.config)  # the task's own options first: errors name task.<field>
        self.method.check_config(self.config)
        self.options = validate_options(config.options, self.method.options)
        fed = config.federation
        try:
            self.profiles: list[ClientProfile] = build_profiles(
                fed.num_clients, fed.profiles, fed.profile_choices, config.seed
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @cached_property
    def partitions(self) -> list[np.ndarray]:
        """Client id -> indices into the task's training pool (seeded)."""
        return self.task.partition(self.config.federation.num_clients, self.config.seed)

    def histograms(self) -> list[list[int]]:
        """Per-client label counts, ``[client][class]``."""
        return label_histograms(self.task.train.labels, self.partitions, self.task.num_labels)

    @cached_property
    def model(self) -> torch.nn.Module:
        """The task's base model, for methods that train it directly (no LoRA)."""
        return self.task.build_model(self.config.seed)

    @cached_property
    def workspace(self):
        """The task's base model with PEFT LoRA adapters by rank (LoRA methods)."""
        from fedtune.models.lora import LoraWorkspace

        return LoraWorkspace(self.task, self.config.seed)

    def client(self, cid: int, state: dict | None = None):
        """A fresh client object for ``cid`` (cheap: it shares this context's model and data)."""
        return self.method.client(cid, self.profiles[cid], self, state)

    def strategy(self):
        return self.method.strategy(self)
