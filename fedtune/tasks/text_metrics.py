"""Metrics of generated text: ROUGE-L (the ``rouge-score`` package papers report with) and the
answer extraction of LLM-Adapters' commonsense evaluation (Hu et al. 2023), which FSLoRA's
Table 5.2 uses."""

from __future__ import annotations

import re
from functools import cache


@cache
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of ``prediction`` against ``reference`` from ``rouge-score`` (its tokenizer:
    lower-case runs of letters and digits, no stemming); 1 when neither has a word (two empty
    answers agree; the package scores that 0)."""
    score = _scorer().score(reference, prediction)["rougeL"].fmeasure
    if score == 0.0 and not _scorer()._tokenizer.tokenize(prediction) and not _scorer()._tokenizer.tokenize(reference):
        return 1.0
    return float(score)


def extract_answer(text: str, tags: list[str]) -> int:
    """The option a generated ``text`` picks: the index in ``tags`` of the first tag that occurs
    in it ("answer2", "true", "solution1", "option2", "ending4", as LLM-Adapters'
    ``extract_answer``: the first match of the tags' alternation, case-sensitive); -1 when none does."""
    pattern = "|".join(re.escape(t) for t in sorted(tags, key=len, reverse=True))
    found = re.search(pattern, text)
    return tags.index(found.group(0)) if found else -1
