"""``text-classification``: a sentence in, one of C classes out.

Data (``data.name``): ``tweets`` (packaged, the default), ``sst2`` and ``agnews`` (data directory),
a local ``.tsv/.csv/.jsonl`` file, or ``hub:<dataset>`` (:mod:`fedtune.data.text`). Each set is
tokenized once per machine (:meth:`~fedtune.data.batches.TokenizedSet.cached`: an on-disk cache
that later processes map in milliseconds), training batches grouped by length
(``train.group_by_length``), evaluation in length-sorted no-grad batches. Model
(``model.name``): the packaged all-MiniLM-L6-v2 (``minilm``, the default), any Hugging Face
sequence-classification model by name or path, or ``tiny-bert`` (2 layers, hidden 32) for tests;
LoRA targets ``query`` / ``value`` (or PEFT's defaults for the model type), head ``classifier``.
Loss: the model's cross-entropy. Metrics: accuracy and mean cross-entropy.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from fedtune.data.batches import TokenizedSet, longest_row
from fedtune.data.text import TextDataset, load_text_dataset
from fedtune.models.training import evaluate_classifier, freeze_except
from fedtune.tasks.base import Task, register_task

HEAD = ["classifier"]


@register_task
class TextClassification(Task):
    kind = "text-classification"
    description = "text -> class: tweets (packaged), sst2, agnews, local files, hub sets; HF encoders (MiniLM)"
    capabilities = frozenset({"lora", "transformer"})
    defaults = {"data.name": "tweets", "model.name": "minilm"}
    peft_task_type = "SEQ_CLS"
    test_overrides = (
        "model.name=tiny-bert",
        "data.name=tweets",
        "data.max_train_samples=64",
        "data.max_test_samples=32",
        "data.max_length=16",
    )

    def load(self) -> tuple[TextDataset, TextDataset]:
        return load_text_dataset(self.config.data)

    @property
    def label_names(self) -> list[str]:
        return self.train.label_names

    @cached_property
    def tokenizer(self):
        from fedtune.models.loading import load_tokenizer

        return load_tokenizer(self.config.model.name)

    @cached_property
    def tokenized(self) -> tuple[TokenizedSet, TokenizedSet]:
        """(training pool, test set), tokenized once (clients index the pool with their partition)."""
        from fedtune.models.loading import tokenizer_key

        length, key = self.config.data.max_length, tokenizer_key(self.model_name)
        train, test = (
            TokenizedSet.cached(lambda: self.tokenizer, key, ds.texts, ds.labels, length) for ds in self.data
        )
        return train, test

    # -- model -------------------------------------------------------------------------------
    def build_model(self, seed: int) -> torch.nn.Module:
        from fedtune.models.loading import load_classifier

        model = load_classifier(self.model_name, self.num_labels, seed)
        return freeze_except(model, HEAD) if self.config.model.finetune == "head" else model

    def lora_targets(self) -> list[str]:
        return ["query", "value"]

    def head_modules(self) -> list[str]:
        return list(HEAD)

    # -- batches, loss, metrics --------------------------------------------------------------
    def train_batches(self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator):
        return self.tokenized[0].train_batches(pool, batch_size, steps, rng, self.config.train.group_by_length)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    def step_shape(self) -> tuple[int, None]:
        """(the longest training row, tokenized and cut to ``data.max_length``; None): a batch is
        padded to its longest row (:meth:`~fedtune.data.batches.TokenizedSet.collate`), and the
        classifier head has no vocabulary logits."""
        return longest_row(self.tokenized[0].ids), None

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> dict[str, float]:
        def forward(m, batch):
            out = m(**batch)
            return out.logits, batch["labels"], out.loss

        return evaluate_classifier(model, self.tokenized[1].eval_batches(batch_size), forward)
