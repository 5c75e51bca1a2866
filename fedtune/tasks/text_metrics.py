"""Metrics of generated text: ROUGE-L (the ``rouge-score`` package papers report with) and the
answer extraction of LLM-Adapters' commonsense evaluation (Hu et al. 2023), which FSLoRA's
Table 5.2 uses; and the means of per-example metrics per set (or category)."""

from __future__ import annotations

import re
from functools import cache

import numpy as np


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


def per_label_means(per: dict[str, np.ndarray], labels: np.ndarray, names: list[str], macro: bool) -> dict[str, float]:
    """Each metric's mean per label (``<metric>_<label>``: per set, per Dolly category) where the
    test set spans several, and overall: the mean of the per-label means (``macro``: the
    multiple-choice sets' average) or over examples. NaN entries: examples a metric skips."""
    out: dict[str, float] = {}
    present = list(np.unique(labels))
    for key, values in per.items():
        means = []
        for s in present:
            v = values[labels == s]
            v = v[~np.isnan(v)]
            if len(v):
                means.append(float(v.mean()))
                if len(present) > 1:
                    out[f"{key}_{names[s]}"] = means[-1]
        kept = values[~np.isnan(values)]
        if means:
            out[key] = float(np.mean(means)) if macro else float(kept.mean())
    return out
