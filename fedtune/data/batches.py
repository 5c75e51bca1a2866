"""Tokenize once, batch many times: the cached form every client and the server train on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

GROUP_CHUNK = 8  # batches per length-sorted chunk when grouping by length


@dataclass
class TokenizedSet:
    """Token ids (unpadded, one array per example) and labels, tokenized once at start-up."""

    ids: list[np.ndarray]
    labels: np.ndarray  # (N,) int64
    pad_id: int

    @classmethod
    def from_texts(cls, tokenizer, texts: list[str], labels: np.ndarray, max_length: int) -> "TokenizedSet":
        enc = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
        return cls([np.asarray(e, dtype=np.int64) for e in enc], np.asarray(labels, dtype=np.int64), tokenizer.pad_token_id)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(e) for e in self.ids), dtype=np.int64, count=len(self.ids))

    def collate(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Pad the examples ``idx`` to the longest among them."""
        rows = [self.ids[i] for i in idx]
        width = max(len(r) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for j, r in enumerate(rows):
            input_ids[j, : len(r)] = r
            mask[j, : len(r)] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask),
            "labels": torch.from_numpy(self.labels[idx]),
        }

    def train_batches(
        self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator, group_by_length: bool
    ) -> Iterator[dict[str, torch.Tensor]]:
        """``steps`` batches from ``pool``: epochs of a fresh permutation, the last batch of an
        epoch possibly smaller. With ``group_by_length``, examples of similar length share a batch
        (sorted within chunks of ``GROUP_CHUNK`` batches, chunk order kept random)."""
        produced = 0
        lengths = self.lengths if group_by_length else None
        while produced < steps:
            order = pool[rng.permutation(len(pool))]
            if lengths is not None:
                chunk = batch_size * GROUP_CHUNK
                order = np.concatenate(
                    [c[np.argsort(lengths[c], kind="stable")] for c in np.split(order, range(chunk, len(order), chunk))]
                )
            batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
            if lengths is not None:
                batches = [batches[i] for i in rng.permutation(len(batches))]
            for b in batches[: steps - produced]:
                yield self.collate(b)
            produced += min(len(batches), steps - produced)

    def eval_batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """All examples once, sorted by length so padding is minimal."""
        order = np.argsort(self.lengths, kind="stable")
        for i in range(0, len(order), batch_size):
            yield self.collate(order[i : i + batch_size])
