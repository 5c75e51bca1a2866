"""The prompt/response examples of the causal-LM sets (:class:`PromptSet`) and reading the files
they come from: ``.jsonl`` (``.jsonl.gz``) and ``.csv`` rows, their string cells checked with
one-line errors naming the file and row."""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from fedtune.config import ConfigError


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
def require_file(path: Path, what: str) -> Path:
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


def read_csv(path: Path) -> list[dict]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # a byte-order mark is not data
            return list(csv.DictReader(f))
    except (csv.Error, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable CSV file ({exc})") from None


def text_cell(row: dict, column: str, path: Path, n: int, optional: bool = False) -> str:
    value = row.get(column)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{path}: row {n}: column {column!r} must be a string ({got}; columns: {', '.join(row)})")
    return value
