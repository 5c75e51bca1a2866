"""RunContext: what one process needs to play the server or any client of a run.

Built from the config alone (so a Flower node builds the same one), it loads lazily and caches:
the data (train pool, test set, the seeded partition, each tokenized once, on first use) and
the base model with its LoRA adapters. All clients of a process share one context; none of them
holds a model. The embedded engine gives the server a context of its own, so the two sides share
nothing but Messages.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from fedtune.config import ConfigError, RunConfig, validate_options
from fedtune.data import TextDataset, label_histograms, load_text_dataset, partition, subsample
from fedtune.data.batches import TokenizedSet
from fedtune.federation.profiles import ClientProfile, build_profiles
from fedtune.registry import MethodSpec, get_method


class RunContext:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.method: MethodSpec = get_method(config.method)
        self.options = validate_options(config, self.method.options)
        fed = config.federation
        try:
            self.profiles: list[ClientProfile] = build_profiles(
                fed.num_clients, fed.profiles, fed.profile_choices, config.seed
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @cached_property
    def raw_data(self) -> tuple[TextDataset, TextDataset]:
        cfg = self.config.data
        train, test = load_text_dataset(cfg)
        return subsample(train, cfg.max_train_samples, self.config.seed), subsample(test, cfg.max_test_samples, 0)

    @cached_property
    def tokenizer(self):
        from fedtune.models.loading import load_tokenizer

        return load_tokenizer(self.config.model.name)

    @cached_property
    def label_names(self) -> list[str]:
        return self.raw_data[0].label_names

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @cached_property
    def majority_rate(self) -> float:
        """Accuracy of always predicting the test set's most frequent label."""
        return self.raw_data[1].majority_rate()

    @cached_property
    def partitions(self) -> list[np.ndarray]:
        """Client id -> indices into the training pool (seeded)."""
        cfg = self.config.data
        labels = self.raw_data[0].labels
        return partition(labels, self.config.federation.num_clients, cfg.partition, cfg.alpha, self.config.seed)

    def histograms(self) -> list[list[int]]:
        return label_histograms(self.raw_data[0].labels, self.partitions, self.num_labels)

    @cached_property
    def train(self) -> TokenizedSet:
        """The training pool, tokenized once (clients index it with their partition)."""
        ds = self.raw_data[0]
        return TokenizedSet.from_texts(self.tokenizer, ds.texts, ds.labels, self.config.data.max_length)

    @cached_property
    def test(self) -> TokenizedSet:
        ds = self.raw_data[1]
        return TokenizedSet.from_texts(self.tokenizer, ds.texts, ds.labels, self.config.data.max_length)

    @cached_property
    def workspace(self):
        from fedtune.models.lora import LoraWorkspace

        return LoraWorkspace(self.config.model, self.num_labels, self.config.seed)

    def client(self, cid: int, state: dict | None = None):
        """A fresh client object for ``cid`` (cheap: it shares this context's model and data)."""
        return self.method.client(cid, self.profiles[cid], self, state)

    def strategy(self):
        return self.method.strategy(self)
