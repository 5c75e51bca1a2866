"""Prompt templates and token rows for causal-LM instruction tuning.

Templates (:class:`PromptFormat`): ``chat`` renders the instruction (and its input, after a blank
line) as the user turn of the tokenizer's chat template, with the assistant header after it;
``alpaca`` renders the plain Alpaca template (Taori et al. 2023; the wording LLM-Adapters and
FSLoRA's commonsense runs use), in its with-input form when the example has an input. Text is
encoded with no special tokens added, so a model whose tokenizer puts a beginning-of-sequence
token before every text (Gemma, Llama; :func:`bos_prefix`) gets it written at the start of a
rendered prompt that lacks it (as chat templates write it themselves): Gemma-3-270M scores
hand-checked questions clearly worse without it. The
response follows the rendered prompt and ends with the tokenizer's end-of-sequence token (for a
chat template, its end-of-turn token).

Token rows (:func:`encode_pair`): at most ``max_length`` tokens. When prompt + response is
longer, the response keeps up to ``max(max_length - len(prompt), max_length // 2)`` tokens (cut
on the right) and the prompt the rest, cut from the stated side (``left``: its beginning goes,
so the question's end and the assistant header survive; a beginning-of-sequence token stays).
Batches (:func:`collate_left`) are left-padded: every row's response ends at the last column;
``labels`` are -100 except on the response tokens.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from fedtune.steps import in_chunks

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
        """The prompt text, starting with the tokenizer's :func:`bos_prefix` where it has one."""
        if self.template == "alpaca":
            text = (ALPACA_INPUT if input else ALPACA).format(instruction=instruction, input=input)
        else:
            user = f"{instruction}\n\n{input}" if input else instruction
            turns = ([{"role": "system", "content": self.system}] if self.system is not None else []) + [
                {"role": "user", "content": user}
            ]
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        bos = bos_prefix(tokenizer)
        return text if text.startswith(bos) else bos + text

    def describe(self, tokenizer) -> dict:
        """What a run used, for its run folder: the template's name and its text, and the
        beginning-of-sequence text put before a prompt that lacks it."""
        text = tokenizer.chat_template if self.template == "chat" else {"plain": ALPACA, "with_input": ALPACA_INPUT}
        return {"template": self.template, "system": self.system, "text": text, "bos_prefix": bos_prefix(tokenizer)}


def bos_prefix(tokenizer) -> str:
    """The beginning-of-sequence token's text when ``tokenizer`` puts it before every text it
    encodes with its special tokens (Gemma, Llama); else "" (SmolLM2, the tiny test tokenizer)."""
    if tokenizer in _BOS:
        return _BOS[tokenizer]
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a")["input_ids"] if bos and bos_id is not None else []
    _BOS[tokenizer] = bos if ids and ids[0] == bos_id else ""
    return _BOS[tokenizer]


_BOS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its bos_prefix, once each


def encode(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token ids of each text, no special tokens added (the templates carry their own)."""
    if not texts:
        return []
    ids = in_chunks(
        list(texts),
        lambda part: tokenizer(list(part), add_special_tokens=False)["input_ids"],
        f"tokenizing {len(texts):,} texts",
        "texts",
    )
    return [np.asarray(x, dtype=np.int64) for x in ids]


def cut_prompt(prompt: np.ndarray, length: int, side: str = "left", keep_start: int = 0) -> np.ndarray:
    """``prompt`` in at most ``length`` tokens, cut from ``side``; a left cut keeps the first
    ``keep_start`` tokens (a beginning-of-sequence token) and drops the ones after them."""
    if side not in ("left", "right"):
        raise ValueError(f"truncation side {side!r}: expected left or right")
    if len(prompt) <= length:
        return prompt
    if side == "right":
        return prompt[:length]
    head = min(keep_start, length)
    return np.concatenate([prompt[:head], prompt[len(prompt) - (length - head) :]])


def encode_pair(
    prompt: np.ndarray, response: np.ndarray, max_length: int, side: str = "left", keep_start: int = 0
) -> tuple[np.ndarray, int]:
    """(the row prompt + response in at most ``max_length`` tokens, the prompt's length in it);
    the prompt cut by :func:`cut_prompt`."""
    keep_response = min(len(response), max(max_length - len(prompt), max_length // 2))
    p = cut_prompt(prompt, min(len(prompt), max_length - keep_response), side, keep_start)
    return np.concatenate([p, response[:keep_response]]).astype(np.int64), len(p)


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
