"""Scoring left-padded prompt + response rows with a causal LM: the response-token loss and
summed response log-probabilities, computing the LM head only over the response columns.

A batch (:func:`fedtune.data.prompting.collate_left`) holds ``input_ids``, ``attention_mask`` (0
on the left padding) and ``labels`` (-100 except on the response tokens). Rows are left-padded,
so every row's response ends at the last column; position ids count real tokens only
(:func:`fedtune.models.generation.positions`). The model may be a PEFT wrapper (its base model,
LoRA layers in place, is called) or a bare Hugging Face causal LM.
"""

from __future__ import annotations

import torch
from torch import nn

from fedtune.models.generation import positions
from fedtune.models.prefix_lm import example_losses


def language_model(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside ``model`` (a PEFT wrapper's base model, LoRA in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def on_device(batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``batch`` on the device of ``model``'s parameters."""
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in batch.items()}


def response_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, A, V), targets (B, A)) over the last A columns, from the earliest response
    token of any row on: the logits at column t predict the token at column t + 1, so only the
    last A + 1 positions' LM head is computed. ``targets`` is -100 off the response tokens."""
    batch = on_device(batch, model)
    labels, mask = batch["labels"], batch["attention_mask"]
    first = max(1, int((labels != -100).float().argmax(-1).min()))  # a prompt has at least one token
    span = labels.shape[1] - first
    out = language_model(model)(
        input_ids=batch["input_ids"],
        attention_mask=mask,
        position_ids=positions(mask),
        use_cache=False,
        logits_to_keep=span + 1,
    )
    return out.logits[:, :-1], labels[:, first:]


def response_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the response tokens only: per row, the mean over its response tokens,
    then the mean over rows (as the instruction task's answer loss)."""
    return example_losses(*response_logits(model, batch)).mean()


def response_logprobs(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """((B,) the summed log-probability of each row's response tokens given everything before
    them, (B,) per-row losses: the mean negative log-probability of those tokens)."""
    logits, targets = response_logits(model, batch)
    losses = example_losses(logits, targets)
    count = (targets != -100).sum(-1)
    return -losses * count.to(losses.dtype), losses
