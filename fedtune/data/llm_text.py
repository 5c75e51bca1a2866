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
- ``mmlu``: MMLU's dev and test splits (:func:`fedtune.data.mmlu.load_mmlu`; evaluation only, the
  dev split its few-shot pool), labels = the subject; :data:`MMLU_GROUPS` groups the 57 subjects.
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

The examples (:class:`~fedtune.data.prompt_set.PromptSet`), the multiple-choice templates
(:mod:`fedtune.data.multiple_choice`) and MMLU (:mod:`fedtune.data.mmlu`) live in modules of their
own; their public names are importable from here too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedtune.config import ConfigError, DataConfig
from fedtune.data.mmlu import MMLU, MMLU_GROUPS, MMLU_HUB, MMLU_SUBJECTS, hub_offline, load_mmlu
from fedtune.data.multiple_choice import (
    ANSWER_PREFIX,
    as_option_texts,
    commonsense_instruction,
    multiple_choice_set,
)
from fedtune.data.prompt_set import PromptSet, read_csv, read_jsonl, require_file, text_cell
from fedtune.data.text import source_name

__all__ = [
    "ALL_SETS",
    "ANSWER_PREFIX",
    "COLUMNS",
    "COMMONSENSE_DIR",
    "COMMONSENSE_SETS",
    "DOLLY_CLIENT_COLUMN",
    "DOLLY_TEST",
    "DOLLY_TRAIN",
    "EXTRA_SETS",
    "MMLU",
    "MMLU_GROUPS",
    "MMLU_HUB",
    "MMLU_SUBJECTS",
    "TEST_FRACTION",
    "PromptSet",
    "as_option_texts",
    "check_sets",
    "commonsense_instruction",
    "eval_split",
    "hub_offline",
    "load_commonsense",
    "load_dolly",
    "load_hub",
    "load_local",
    "load_mmlu",
    "load_prompt_set",
    "local_set",
    "multiple_choice_set",
    "read_jsonl",
    "renamed",
]

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
#: the columns a local file or hub set gives (``task.columns`` maps them to a set's own)
COLUMNS = ("prompt", "input", "response", "category", "question", "choices", "gold")
TEST_FRACTION = 0.1


# -- dolly --------------------------------------------------------------------------------------
def load_dolly(root: Path) -> tuple[PromptSet, PromptSet]:
    """(FedIT's 10-client training pool, FedIT's 80-example global test set)."""
    train_rows = read_jsonl(require_file(root / DOLLY_TRAIN, "'dolly'"))
    test_rows = read_jsonl(require_file(root / DOLLY_TEST, "'dolly'"))
    names = sorted({text_cell(r, "category", root / DOLLY_TRAIN, n) for n, r in enumerate(train_rows, 1)})

    def build(rows: tuple[dict, ...], path: Path, clients: bool) -> PromptSet:
        labels = []
        for n, r in enumerate(rows, 1):
            cat = text_cell(r, "category", path, n)
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
            [text_cell(r, "instruction", path, n) for n, r in enumerate(rows, 1)],
            [text_cell(r, "context", path, n, optional=True) for n, r in enumerate(rows, 1)],
            [text_cell(r, "response", path, n) for n, r in enumerate(rows, 1)],
            np.asarray(labels, dtype=np.int64),
            names,
            columns,
        )

    return build(train_rows, root / DOLLY_TRAIN, True), build(test_rows, root / DOLLY_TEST, False)


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
    train: list[PromptSet] = []
    test: list[PromptSet] = []
    for label, name in enumerate(chosen):
        for split, out in (("train", train), (eval_split(root, name), test)):
            path = require_file(root / COMMONSENSE_DIR / f"{name}_{split}.jsonl.gz", f"'commonsense' set {name!r}")
            part = multiple_choice_set(read_jsonl(path), path, name, label, chosen)
            if out is test and test_per_set is not None and test_per_set < len(part):
                rng = np.random.default_rng(0)
                part = part.subset(np.sort(rng.choice(len(part), size=test_per_set, replace=False)))
            out.append(part)
    return PromptSet.concat(train, chosen), PromptSet.concat(test, chosen)


# -- local files ------------------------------------------------------------------------------
def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise ConfigError(
            f"data.name: {str(path)!r} is not a file (expected dolly, commonsense, hub:<dataset> or a .jsonl/.csv file)"
        )
    if path.suffix == ".jsonl":
        return list(read_jsonl(path))
    if path.suffix == ".csv":
        return read_csv(path)
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
    prompts = [text_cell(r, "prompt", path, n) for n, r in enumerate(rows, 1)]
    responses = [text_cell(r, "response", path, n) for n, r in enumerate(rows, 1)]
    inputs = [text_cell(r, "input", path, n, optional=True) for n, r in enumerate(rows, 1)]
    if "category" in first:
        cats = [text_cell(r, "category", path, n) for n, r in enumerate(rows, 1)]
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

    name, parts = source_name(cfg)[len("hub:") :], []
    for split in (cfg.train_split, cfg.test_split):
        part = hub_split(name, cfg, split)
        where = f"hub:{name}[{split}]"
        parts.append(local_set(renamed(part.to_list(), columns, part.column_names, where), Path(where)))
    return _with_test(*parts)


def load_local(cfg: DataConfig, columns: dict[str, str | list[str]] | None = None) -> tuple[PromptSet, PromptSet]:
    """(training pool, test set) of a local file (``data.test_path``, else a seeded 10 % hold-out)."""
    path = Path(source_name(cfg)).expanduser()
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
    name = source_name(cfg)
    if name == "dolly":
        train, test = load_dolly(root)
        if test_per_set is not None and test_per_set < len(test):
            test = test.subset(np.arange(test_per_set))
        return train, test
    if name == "commonsense":
        return load_commonsense(root, sets, test_per_set)
    if name == MMLU:
        return load_mmlu(root)
    if name.startswith("hub:"):
        return load_hub(cfg, columns)
    return load_local(cfg, columns)
