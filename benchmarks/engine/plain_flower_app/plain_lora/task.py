"""Model, data and training of the plain Flower App, as Flower's examples write them."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer


def model_path() -> str:
    """The local all-MiniLM-L6-v2 (the hub's sentence-transformers/all-MiniLM-L6-v2, offline)."""
    from fedtune.models.loading import resolve_model_path

    return resolve_model_path("minilm")


def get_model(rank: int, alpha: float, seed: int) -> torch.nn.Module:
    """MiniLM with a 2-label head and LoRA on query/value (the head trained too)."""
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(model_path(), num_labels=2)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=["query", "value"], modules_to_save=["classifier"], lora_dropout=0.0
    )
    return get_peft_model(model, config)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained part of the state dict (LoRA and head): what crosses the wire."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in trained}


def load_partition(partition_id: int, num_partitions: int, samples: int, max_length: int, seed: int):
    """This node's IID share of the first ``samples`` SST-2 training rows, tokenized."""
    folder = Path(os.environ.get("FEDTUNE_DATA_DIR", "data"))
    with open(folder / "sst2" / "train.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))[:samples]
    order = np.random.default_rng(seed).permutation(len(rows))
    mine = [rows[i] for i in np.array_split(order, num_partitions)[partition_id]]
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    encoded = tokenizer(
        [r["sentence"] for r in mine], truncation=True, max_length=max_length, padding="max_length", return_tensors="pt"
    )
    labels = torch.tensor([int(r["label"]) for r in mine])
    return encoded["input_ids"], encoded["attention_mask"], labels


def train(model, data, steps: int, batch_size: int, lr: float, seed: int) -> tuple[float, float]:
    """``steps`` AdamW steps on random batches of ``data``: (mean loss, seconds)."""
    start = time.perf_counter()
    ids, mask, labels = data
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        pick = torch.randint(len(labels), (batch_size,), generator=generator)
        out = model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels[pick])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss))
    return float(np.mean(losses)), time.perf_counter() - start
