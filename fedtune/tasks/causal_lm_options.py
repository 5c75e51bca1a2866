"""The ``causal-lm`` task's options (``[task]``: template, truncation, sets, generation, choice
scoring, answer format, columns) and the constants it reads (:mod:`fedtune.tasks.causal_lm`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedtune.data import llm_text
from fedtune.tasks.base import TaskOptions

#: LoRA targets of Llama-style models: attention and gated-MLP projections
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FFN_TARGETS = ("gate_proj", "up_proj", "down_proj")
BY_LABEL = ("commonsense", llm_text.MMLU)  # data whose label names each example's set (subject)
FREE_FORM_NEW_TOKENS = 64  # generation budget for free-form answers unless task.max_new_tokens


class CausalLMOptions(TaskOptions):
    template: Literal["auto", "chat", "alpaca"] = Field(
        "auto", description="prompt template (auto: the tokenizer's chat template when it has one, else Alpaca)"
    )
    system_prompt: str | None = Field(None, description="chat template's system turn (None: its own default)")
    truncation_side: Literal["left", "right"] = Field(
        "left", description="which end of a too-long prompt is cut (left keeps the question's end)"
    )
    sets: list[str] | None = Field(None, description="commonsense sets (default: all eight)")
    test_per_set: int | None = Field(None, ge=1, description="evaluate at most this many questions per set (seed 0)")
    max_new_tokens: int | None = Field(
        None, ge=1, le=2048, description="greedy generation budget (default: longest answer; free-form 64)"
    )
    choice_scoring: Literal["answer", "text", "lm-eval"] = Field(
        "answer",
        description="log-likelihood ranking of the trained answer format, of the option texts, or of lm-eval's "
        "task format (raw text, no template)",
    )
    num_fewshot: int = Field(
        0, ge=0, le=25, description="choice_scoring = 'lm-eval': solved examples before each question (first k)"
    )
    generate: bool = Field(True, description="evaluate greedy generations too (ROUGE-L, extracted answers)")
    answer_format: Literal["tag", "text"] = Field(
        "tag",
        description="multiple-choice answers trained and scored as the Table B.1 tag ('the correct answer is "
        "answer2') or as the gold option's text after the bare question (needs choice_scoring = 'text')",
    )
    columns: dict[str, str | list[str]] | None = Field(
        None,
        description="hub sets and local files: the set's column for each of prompt, input, response, category "
        "(free-form) or question, choices, gold (multiple choice); choices may name one column per option "
        '(PIQA: choices = ["sol1", "sol2"])',
    )

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, value: dict[str, str | list[str]] | None) -> dict[str, str | list[str]] | None:
        unknown = sorted(set(value or {}) - set(llm_text.COLUMNS))
        if unknown:
            raise ValueError(f"unknown column {unknown[0]!r}; expected some of {', '.join(llm_text.COLUMNS)}")
        for ours, theirs in (value or {}).items():
            if isinstance(theirs, list) and ours != "choices":
                raise ValueError(f"{ours}: expected one column name, got a list (only choices takes one per option)")
            if isinstance(theirs, list) and (len(theirs) < 2 or len(set(theirs)) != len(theirs)):
                raise ValueError(f"choices: expected at least 2 distinct column names, one per option, got {theirs}")
        return value
