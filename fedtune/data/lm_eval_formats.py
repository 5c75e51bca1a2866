"""lm-evaluation-harness's (lm-eval 0.4) multiple-choice task formats, rebuilt from the
commonsense files' ranked-classification form (OLMES's ``question``, :mod:`fedtune.data.llm_text`).

Each option is one (context, continuation) request, as lm-eval's task of that name asks it
(``doc_to_text``, ``doc_to_choice``, ``target_delimiter`` " "): ARC-Easy / ARC-Challenge
``"Question: {question}\\nAnswer:"`` + ``" " + option``; PIQA ``"Question: {goal}\\nAnswer:"``;
SocialIQA (lm-eval's ``social_iqa``) ``"Q: {context} {question}\\nA:"``; OpenBookQA the bare
question stem; BoolQ ``"{passage}\\nQuestion: {question}?\\nAnswer:"`` (options yes / no);
HellaSwag the preprocessed ``"{activity}: {context}"``; CSQA (``commonsense_qa``) the question
with lettered options, the letters scored; WinoGrande (partial scoring) one context per option,
the sentence up to the blank with the option filled in, and the rest of the sentence as the
continuation; MMLU (each of its 57 subjects) ``"{question}\nA. ...\nD. ...\nAnswer:"``, the letters
scored, after ``"The following are multiple choice questions (with answers) about {subject}.\n\n"``
(:func:`description`). A local ``{question, choices, gold}`` file is asked as ARC is (its question
as it is). Few-shot (:func:`fewshot_prefix`): the first ``k`` examples of the set's training split, each
its context, ``" "`` and its gold continuation, followed by ``"\\n\\n"`` (lm-eval's ``first_n``
sampler and delimiters).
"""

from __future__ import annotations

from fedtune.config import ConfigError
from fedtune.data.llm_text import ALL_SETS, MMLU_SUBJECTS

#: sets whose lm-eval form this module rebuilds: the registered multiple-choice sets
#: (:data:`fedtune.data.llm_text.ALL_SETS`) and ``local`` (a question file, asked as ARC)
FORMATS = (*sorted(ALL_SETS), "local")
LETTERS = "ABCDEFGHIJ"
#: the sets whose lm-eval task reports acc_norm beside acc (the others' options, letters or
#: answers of one kind, report acc alone)
WITH_ACC_NORM = ("arc_challenge", "arc_easy", "hellaswag", "openbookqa", "piqa")


def _inner(question: str, prefix: str, suffix: str = "\nAnswer:") -> str:
    text = question[len(prefix) :] if question.startswith(prefix) else question
    return text[: -len(suffix)] if text.endswith(suffix) else text


def requests(name: str, question: str, choices: list[str]) -> list[tuple[str, str]]:
    """(context, continuation) of each option of a question of set ``name`` (see the module
    docstring); ``question`` in the data's ranked-classification form."""
    if name in MMLU_SUBJECTS:
        options = "".join(f"\n{LETTERS[j]}. {c}" for j, c in enumerate(choices))
        return [(f"{question.strip()}{options}\nAnswer:", f" {LETTERS[j]}") for j in range(len(choices))]
    if name in ("arc_easy", "arc_challenge", "boolq", "hellaswag", "local"):
        context = question
    elif name == "piqa":
        context = f"Question: {_inner(question, 'Goal: ')}\nAnswer:"
    elif name == "socialiqa":
        context = f"Q: {_inner(question, 'Question: ')}\nA:"
    elif name == "openbookqa":
        context = _inner(question, "Question: ")
    elif name == "csqa":
        options = "".join(f"\n{LETTERS[j]}. {c}" for j, c in enumerate(choices))
        context = f"Question: {_inner(question, 'Question: ').strip()}{options}\nAnswer:"
        return [(context, f" {LETTERS[j]}") for j in range(len(choices))]
    elif name == "winogrande":
        cut = question.index("_")
        rest = " " + question[cut + 1 :].strip()
        return [(question[:cut] + c, rest) for c in choices]
    else:
        raise ConfigError(f"protocol lm-eval: no lm-eval format for set {name!r}; expected one of {', '.join(FORMATS)}")
    return [(context, f" {c}") for c in choices]


def description(name: str) -> str:
    """The text lm-eval puts before the shots and the question: MMLU's subject line, else none."""
    if name in MMLU_SUBJECTS:
        return f"The following are multiple choice questions (with answers) about {name.replace('_', ' ')}.\n\n"
    return ""


def gold_text(name: str, question: str, choices: list[str], gold: int) -> str:
    """A solved example as a few-shot shot: its gold request's context and continuation."""
    context, continuation = requests(name, question, choices)[gold]
    return context + continuation


def fewshot_prefix(name: str, shots: list[tuple[str, list[str], int]]) -> str:
    """The few-shot text before a question: each shot ``(question, choices, gold)`` solved
    (:func:`gold_text`) and followed by a blank line."""
    return "".join(gold_text(name, q, c, g) + "\n\n" for q, c, g in shots)
