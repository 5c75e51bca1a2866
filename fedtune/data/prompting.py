"""Prompt templates and token rows for causal-LM instruction tuning.

Templates (:class:`PromptFormat`): ``chat`` renders the instruction (and its input, after a blank
line) as the user turn of the tokenizer's chat template, with the assistant header after it;
``alpaca`` renders the plain Alpaca template (Taori et al. 2023; the wording LLM-Adapters and
FSLoRA's commonsense runs use), in its with-input form when the example has an input. The
response follows the rendered prompt and ends with the tokenizer's end-of-sequence token (for a
chat template, its end-of-turn token).

Token rows (:func:`encode_pair`): at most ``max_length`` tokens. When prompt + response is
longer, the response keeps up to ``max(max_length - len(prompt), max_length // 2)`` tokens (cut
on the right) and the prompt the rest, cut from the stated side (``left``: its beginning goes,
so the question's end and the assistant header survive). Batches (:func:`collate_left`) are
left-padded: every row's response ends at the last column; ``labels`` are -100 except on the
response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ALPACA = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
TEMPLATES = ("chat", "alpaca")


@dataclass(frozen=True)
class PromptFormat:
    """How an (instruction, input) becomes the prompt text: ``template`` ``chat`` or ``alpaca``;
    ``system``: the chat's system turn (None: the chat template's own default)."""

    template: str
    system: str | None = None

    @classmethod
    def choose(cls, requested: str, tokenizer, system: str | None) -> PromptFormat:
        """``requested`` ``auto`` -> ``chat`` when the tokenizer has a chat template, else ``alpaca``."""
        if requested == "auto":
            requested = "chat" if getattr(tokenizer, "chat_template", None) else "alpaca"
        if requested not in TEMPLATES:
            raise ValueError(f"template {requested!r}: expected auto, chat or alpaca")
        return cls(requested, system)

    def render(self, tokenizer, instruction: str, input: str = "") -> str:
        if self.template == "alpaca":
            return (ALPACA_INPUT if input else ALPACA).format(instruction=instruction, input=input)
        user = f"{instruction}\n\n{input}" if input else instruction
        turns = ([{"role": "system", "content": self.system}] if self.system is not None else []) + [
            {"role": "user", "content": user}
        ]
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)

    def describe(self, tokenizer) -> dict:
        """What a run used, for its run folder: the template's name and its text."""
        text = tokenizer.chat_template if self.template == "chat" else {"plain": ALPACA, "with_input": ALPACA_INPUT}
        return {"template": self.template, "system": self.system, "text": text}


def encode(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, no special tokens added (the templates carry their own)."""
    if not texts:
        return []
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [np.asarray(x, dtype=np.int64) for x in ids]


def encode_pair(
    prompt: np.ndarray, response: np.ndarray, max_length: int, side: str = "left"
) -> tuple[np.ndarray, int]:
    """(the row prompt + response in at most ``max_length`` tokens, the prompt's length in it)."""
    if side not in ("left", "right"):
        raise ValueError(f"truncation side {side!r}: expected left or right")
    keep_response = min(len(response), max(max_length - len(prompt), max_length // 2))
    keep_prompt = min(len(prompt), max_length - keep_response)
    p = prompt[len(prompt) - keep_prompt :] if side == "left" else prompt[:keep_prompt]
    return np.concatenate([p, response[:keep_response]]).astype(np.int64), int(keep_prompt)


def collate_left(rows: list[np.ndarray], prompt_lengths: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on prompt and padding)."""
    width = max(len(r) for r in rows)
    n = len(rows)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.int64)
    labels = np.full((n, width), -100, dtype=np.int64)
    for j, (r, k) in enumerate(zip(rows, prompt_lengths)):
        ids[j, width - len(r) :] = r
        mask[j, width - len(r) :] = 1
        labels[j, width - len(r) + k :] = r[k:]
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
    }
