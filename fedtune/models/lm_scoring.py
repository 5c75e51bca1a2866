"""Scoring left-padded prompt + response rows with a causal LM: the response-token loss and
summed response log-probabilities, computing the LM head only over the response columns.

A batch (:func:`fedtune.data.prompting.collate_left`) holds ``input_ids``, ``attention_mask`` (0
on the left padding) and ``labels`` (-100 except on the response tokens). Rows are left-padded,
so every row's response ends at the last column; position ids count real tokens only
(:func:`fedtune.models.generation.positions`). The model may be a PEFT wrapper (its base model,
LoRA layers in place, is called) or a bare Hugging Face causal LM.

:func:`shared_prompt_logprobs` gives what :func:`response_logprobs` gives for rows ``prompt +
continuation`` whose prompts repeat (the options of one question, the question's own answer):
each distinct prompt runs through the model once and its KV cache serves all its continuations.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedtune.models.generation import positions
from fedtune.models.prefix_lm import example_losses, peft_base
from fedtune.steps import advance


def language_model(model: nn.Module) -> nn.Module:
    """The Hugging Face causal LM inside ``model`` (a PEFT wrapper's base model, LoRA in place)."""
    return peft_base(model)


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


@torch.no_grad()
def shared_prompt_logprobs(
    model: nn.Module, prompts: list[np.ndarray], continuations: list[np.ndarray], batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`response_logprobs` of the rows ``prompts[i] + continuations[i]`` (token ids; the
    continuation is the response), as ((N,) summed log-probabilities, (N,) mean losses), with each
    distinct prompt encoded once: the distinct prompts, left-padded, fill the KV cache in one
    pass (its last logits score every continuation's first token), the cache is repeated for the
    continuations of each prompt, and the continuations, right-padded, run after it in a second
    pass. At most ``batch_size`` continuations per pass (a prompt with more takes a pass alone).
    A row with no continuation tokens scores 0 (sum) and 0 (loss), as the plain path does."""
    lm = language_model(model)
    device = next(model.parameters()).device
    groups: dict[bytes, list[int]] = {}
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"row {i}: an empty prompt (a prompt has at least one token)")
        groups.setdefault(np.asarray(p, dtype=np.int64).tobytes(), []).append(i)
    order = sorted(groups.values(), key=lambda g: len(prompts[g[0]]))  # similar prompt lengths share a pass
    chunks: list[list[list[int]]] = [[]]
    for g in order:
        if chunks[-1] and sum(map(len, chunks[-1])) + len(g) > batch_size:
            chunks.append([])
        chunks[-1].append(g)
    logp, losses = np.zeros(len(prompts)), np.zeros(len(prompts))
    for chunk in chunks:
        rows = [i for g in chunk for i in g]
        owner = torch.tensor([j for j, g in enumerate(chunk) for _ in g], device=device)
        heads = [np.asarray(prompts[g[0]], dtype=np.int64) for g in chunk]
        width = max(len(h) for h in heads)
        ids = torch.zeros(len(heads), width, dtype=torch.long)
        mask = torch.zeros(len(heads), width, dtype=torch.long)
        for j, h in enumerate(heads):
            ids[j, width - len(h) :], mask[j, width - len(h) :] = torch.from_numpy(h), 1
        ids, mask = ids.to(device), mask.to(device)
        out = lm(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(out.logits[:, -1].float(), -1)[owner]  # (R, V): predicts each row's token 0
        conts = [np.asarray(continuations[i], dtype=np.int64) for i in rows]
        span = max(len(c) for c in conts)
        if span == 0:
            advance(len(rows))
            continue
        cont = torch.zeros(len(rows), span, dtype=torch.long)
        cmask = torch.zeros(len(rows), span, dtype=torch.long)
        for r, c in enumerate(conts):
            cont[r, : len(c)], cmask[r, : len(c)] = torch.from_numpy(c), 1
        cont, cmask = cont.to(device), cmask.to(device)
        token_logp = first.gather(-1, cont[:, :1])  # (R, 1)
        if span > 1:
            cache = out.past_key_values
            cache.reorder_cache(owner)
            lengths = mask.sum(-1)[owner]
            more = lm(
                input_ids=cont[:, :-1],
                attention_mask=torch.cat([mask[owner], cmask[:, :-1]], dim=1),
                position_ids=lengths[:, None] + torch.arange(span - 1, device=device),
                past_key_values=cache,
                use_cache=True,
            )
            rest = torch.log_softmax(more.logits.float(), -1).gather(-1, cont[:, 1:, None])[..., 0]
            token_logp = torch.cat([token_logp, rest], dim=1)
        sums = (token_logp * cmask).sum(-1)
        count = cmask.sum(-1)
        logp[rows] = sums.cpu().numpy()
        losses[rows] = (-sums / count.clamp(min=1)).cpu().numpy()
        advance(len(rows))  # a scoring step's rows (fedtune.steps)
    return logp, losses
