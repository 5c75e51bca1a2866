"""Greedy decoding of a Hugging Face causal LM over left-padded rows, with its KV cache: the one
generation loop of the instruction task's prefix LM and of the causal-LM task.

Rows are left-padded and position ids count real tokens only (:func:`positions`), so a row's
output does not depend on how much padding its batch needs.
"""

from __future__ import annotations

import torch
from torch import nn


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0, 1, ... over the real tokens (padding gets 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def greedy_generate(
    lm: nn.Module, mask: torch.Tensor, max_new_tokens: int, eos_token_id: int, **inputs: torch.Tensor
) -> torch.Tensor:
    """Greedy continuations (B, T <= ``max_new_tokens``) of left-padded rows: one prefill of the
    prompt (``inputs``: ``input_ids`` (B, L) or ``inputs_embeds`` (B, L, H); ``mask`` (B, L), 0 on
    the padding), then one token per step from the cache; a row that has produced
    ``eos_token_id`` keeps emitting it, and decoding stops when every row has."""
    pos = positions(mask)
    out = lm(**inputs, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    done = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    tokens = []
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1).masked_fill(done, eos_token_id)
        tokens.append(nxt)
        done |= nxt == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        pos = pos[:, -1:] + 1
        out = lm(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=pos,
            past_key_values=out.past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )
    return torch.stack(tokens, dim=1)
