"""Multiple-choice questions as prompt/response pairs: the instruction templates of FSLoRA's
Table B.1 (LLM-Adapters' wording), the ``{question, choices, gold}`` rows read into a
:class:`~fedtune.data.prompt_set.PromptSet`, and lm-evaluation-harness's option-text form.

Every multiple-choice example keeps its option texts, their answer tags, the gold index and the
bare question (the data's ranked-classification form, e.g. "Question: ...\\nAnswer:"), which the
log-likelihood protocol scores the option texts after.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from fedtune.config import ConfigError
from fedtune.data.prompt_set import PromptSet, text_cell

ANSWER_PREFIX = "the correct answer is "


def _strip(text: str, prefix: str, suffix: str) -> str:
    text = text[len(prefix) :] if text.startswith(prefix) else text
    return text[: -len(suffix)] if text.endswith(suffix) else text


def _options(word: str, choices: list[str], sep: str) -> str:
    return sep.join(f"{word}{i}: {c}" for i, c in enumerate(choices, 1))


def _formats(tag: str, n: int) -> str:
    return "/".join(f"{tag}{i}" for i in range(1, n + 1))


def commonsense_instruction(name: str, question: str, choices: list[str]) -> tuple[str, list[str]]:
    """(the instruction of FSLoRA's Table B.1 for a question of set ``name``, the answer tag of
    each option), worded as LLM-Adapters' files (``../shared/data/llm-adapters``). ``question`` is
    the data's ranked-classification form ("Question: ...\\nAnswer:", "Goal: ...", BoolQ's
    passage + question, HellaSwag's "activity: context", WinoGrande's sentence with "_")."""
    n = len(choices)
    if name in ("arc_challenge", "arc_easy", "csqa", "openbookqa", "socialiqa", "local"):
        q = _strip(question, "Question: ", "\nAnswer:")
        tags = [f"answer{i}" for i in range(1, n + 1)]
        text = (
            f"Please choose the correct answer to the question: {q}\n\n"
            f"{_options('Answer', choices, ' ')}\n\nAnswer format: {_formats('answer', n)}"
        )
    elif name == "boolq":  # LLM-Adapters asks the question alone (no passage)
        q = _strip(question.rsplit("\nQuestion: ", 1)[-1], "", "\nAnswer:")
        q = q[:-1] if q.endswith("?") else q
        tags = ["true" if c.strip().lower() == "yes" else "false" for c in choices]
        text = f"Please answer the following question with true or false, question: {q}?\n\nAnswer format: true/false"
    elif name == "piqa":
        q = _strip(question, "Goal: ", "\nAnswer:")
        tags = [f"solution{i}" for i in range(1, n + 1)]
        text = (
            f"Please choose the correct solution to the question: {q}\n\n"
            f"{_options('Solution', choices, chr(10) * 2)}\n\nAnswer format: {_formats('solution', n)}"
        )
    elif name == "hellaswag":
        tags = [f"ending{i}" for i in range(1, n + 1)]
        text = (
            f"Please choose the correct ending to complete the given sentence: {question}\n\n"
            f"{_options('Ending', choices, ' ')}\n\nAnswer format: {_formats('ending', n)}"
        )
    elif name == "winogrande":
        tags = [f"option{i}" for i in range(1, n + 1)]
        text = (
            "Please choose the correct answer to fill in the blank to complete the given sentence: "
            f"{question}\n\n{_options('Option', choices, ' ')} Answer format: {_formats('option', n)}"
        )
    else:
        raise ValueError(f"no Table B.1 template for set {name!r}")
    return text, tags


def _mc_row(row: dict, path: Path, n: int) -> tuple[str, list[str], int]:
    """(question, choices, gold) of one multiple-choice row, checked."""
    question = text_cell(row, "question", path, n)
    choices, gold = row.get("choices"), row.get("gold")
    if isinstance(choices, dict) and "text" in choices:  # {"text": [...], "label": ["A", ...]}
        labels, choices = choices.get("label"), choices["text"]
        if isinstance(gold, str) and isinstance(labels, list) and gold in labels:
            gold = labels.index(gold)
    if isinstance(choices, str):  # a CSV cell: a JSON list
        try:
            choices = json.loads(choices)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}: row {n}: column 'choices' must be a JSON list of strings") from None
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
        raise ConfigError(f"{path}: row {n}: column 'choices' must be a list of at least 2 strings")
    if isinstance(gold, str) and gold.strip().lstrip("-").isdigit():
        gold = int(gold)
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ConfigError(f"{path}: row {n}: column 'gold' must be an index 0-{len(choices) - 1}, got {gold!r}")
    return question, choices, gold


def multiple_choice_set(
    rows, path: Path, name: str, label: int, label_names: list[str], distinct: bool = False
) -> PromptSet:
    """Multiple-choice rows (``question``, ``choices``, ``gold``) as Table B.1 prompt/response pairs;
    ``distinct`` (a user's file): a blank option, or two the same, is refused naming the row (the
    published sets keep theirs: CSQA and SocialIQA repeat options in a few hundred rows)."""
    instructions, responses, choices_all, tags_all, gold_all, questions = [], [], [], [], [], []
    for n, row in enumerate(rows, 1):
        question, choices, gold = _mc_row(row, path, n)
        stripped = [c.strip() for c in choices]
        if distinct and (not all(stripped) or len(set(stripped)) < len(stripped)):
            raise ConfigError(f"{path}: row {n}: column 'choices' holds a blank or repeated option ({choices})")
        text, tags = commonsense_instruction(name, question, choices)
        instructions.append(text)
        responses.append(ANSWER_PREFIX + tags[gold])
        choices_all.append(choices)
        tags_all.append(tags)
        gold_all.append(gold)
        questions.append(question)
    k = len(instructions)
    return PromptSet(
        instructions,
        [""] * k,
        responses,
        np.full(k, label, dtype=np.int64),
        label_names,
        {},
        choices_all,
        tags_all,
        np.asarray(gold_all, dtype=np.int64),
        questions,
    )


def as_option_texts(ds: PromptSet) -> PromptSet:
    """``ds`` with each multiple-choice example asked in lm-evaluation-harness's form: the bare
    question as the prompt (no input) and the gold option's text as the response; free-form
    examples unchanged. The option lists, tags, gold indices and labels are kept."""
    mc = ds.multiple_choice
    return dataclasses.replace(
        ds,
        instructions=[q if m else x for q, x, m in zip(ds.questions, ds.instructions, mc)],
        inputs=["" if m else x for x, m in zip(ds.inputs, mc)],
        responses=[c[g] if m else r for c, g, r, m in zip(ds.choices, ds.gold, ds.responses, mc)],
    )
