"""Tokenize once, batch many times: the cached form every client and the server train on.

:meth:`TokenizedSet.cached` keeps the token ids on disk (:mod:`fedtune.data.cache`), keyed by
the texts, labels, tokenizer and ``max_length``, so a process that starts per message (a Flower
ClientApp) maps them in milliseconds instead of tokenizing again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedtune.steps import in_chunks

GROUP_CHUNK = 8  # batches per length-sorted chunk when grouping by length


def index_batches(pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """``steps`` index batches from ``pool``: epochs of a fresh ``rng`` permutation, the last batch
    of an epoch possibly smaller (the order
    :meth:`TokenizedSet.train_batches` uses without length grouping)."""
    produced = 0
    while produced < steps:
        order = pool[rng.permutation(len(pool))]
        for i in range(0, len(order), batch_size):
            if produced == steps:
                return
            yield order[i : i + batch_size]
            produced += 1


def length_grouped_batches(
    pool: np.ndarray, lengths: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator
) -> Iterator[np.ndarray]:
    """``steps`` index batches from ``pool`` in which examples of similar length (``lengths``,
    indexed like the whole set) share a batch: epochs of a fresh ``rng`` permutation, sorted by
    length within chunks of ``GROUP_CHUNK`` batches, the batches of an epoch in random order."""
    produced = 0
    while produced < steps:
        order = pool[rng.permutation(len(pool))]
        chunk = batch_size * GROUP_CHUNK
        order = np.concatenate(
            [c[np.argsort(lengths[c], kind="stable")] for c in np.split(order, range(chunk, len(order), chunk))]
        )
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        batches = [batches[i] for i in rng.permutation(len(batches))]
        yield from batches[: steps - produced]
        produced += min(len(batches), steps - produced)


def row_lengths(rows: list[np.ndarray]) -> np.ndarray:
    """(N,) int64: the length of each row (token ids, unpadded)."""
    return np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))


def longest_row(rows: list[np.ndarray]) -> int:
    """The longest of ``rows``: the width a batch holding it is padded to."""
    return int(row_lengths(rows).max())


@dataclass
class TokenizedSet:
    """Token ids (unpadded, one array per example) and labels, tokenized once at start-up."""

    ids: list[np.ndarray]
    labels: np.ndarray  # (N,) int64
    pad_id: int

    @classmethod
    def from_texts(cls, tokenizer, texts: list[str], labels: np.ndarray, max_length: int) -> TokenizedSet:
        def call(part):
            return tokenizer(list(part), truncation=True, max_length=max_length)["input_ids"]

        enc = in_chunks(list(texts), call, f"tokenizing {len(texts):,} texts", "texts")
        return cls(
            [np.asarray(e, dtype=np.int64) for e in enc], np.asarray(labels, dtype=np.int64), tokenizer.pad_token_id
        )

    @classmethod
    def cached(
        cls,
        tokenizer: Callable[[], Any],
        tokenizer_key: str | None,
        texts: list[str],
        labels: np.ndarray,
        max_length: int,
    ) -> TokenizedSet:
        """:meth:`from_texts` through the on-disk cache: the same ids (values and dtype), stored
        flat (``tokens`` plus ``offsets``) and mapped read-only. ``tokenizer()`` is called only
        on a miss; ``tokenizer_key`` names it (None: no caching, e.g. an unidentifiable tokenizer)."""
        from fedtune.data.cache import cached_arrays, digest_texts

        def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
            tok = tokenizer()
            made = cls.from_texts(tok, texts, labels, max_length)
            offsets = np.zeros(len(made.ids) + 1, dtype=np.int64)
            np.cumsum([len(e) for e in made.ids], out=offsets[1:])
            flat = np.concatenate(made.ids) if made.ids else np.zeros(0, dtype=np.int64)
            return {"tokens": flat.astype(np.int64, copy=False), "offsets": offsets}, {"pad_id": made.pad_id}

        if tokenizer_key is None:
            return cls.from_texts(tokenizer(), texts, labels, max_length)
        parts = {"tokenizer": tokenizer_key, "max_length": int(max_length), "texts": digest_texts(list(texts), labels)}
        arrays, meta = cached_arrays("tokens", parts, build)
        tokens, offsets = arrays["tokens"], arrays["offsets"]
        ids = [tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        return cls(ids, np.asarray(labels, dtype=np.int64), meta["pad_id"])

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return row_lengths(self.ids)

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
        if not group_by_length:
            yield from (self.collate(b) for b in index_batches(pool, batch_size, steps, rng))
            return
        yield from (self.collate(b) for b in length_grouped_batches(pool, self.lengths, batch_size, steps, rng))

    def eval_batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """All examples once, sorted by length so padding is minimal."""
        order = np.argsort(self.lengths, kind="stable")
        for i in range(0, len(order), batch_size):
            yield self.collate(order[i : i + batch_size])
