"""``hub:`` sets for the causal-LM task, offline: a ``DatasetDict`` saved by ``datasets`` and a
folder of data files read through ``hub:/path`` give exactly the examples of the equivalent local
file (prompts, responses, options, gold, labels) with ``task.columns`` mapping a set's own
column names (an ARC-style ``{"text", "label"}`` choices record and a letter answer key too);
missing columns or splits stop with one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedtune.config import ConfigError, load_config
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.causal_lm import CausalLM

datasets = pytest.importorskip("datasets")

TINY = ["task.kind=causal-lm", *CausalLM.test_overrides, "data.max_test_samples=100"]

FREE = {  # a Dolly-like set under its own column names; train and test differ
    "train": {
        "instruction": ["Name a colour.", "Add 2 and 3.", "Say hello in French.", "Spell cat backwards."],
        "context": ["", "Use digits.", "", ""],
        "output": ["Blue.", "5", "Bonjour.", "tac"],
    },
    "test": {
        "instruction": ["What is 1 + 1?", "Name a fruit."],
        "context": ["", "One word."],
        "output": ["2", "Apple"],
    },
}
ARC = {  # ARC on the hub: choices as {"text", "label"}, the answer as a letter
    "train": {
        "question": ["Which is a mammal?", "What melts ice?", "Which planet is red?"],
        "choices": [
            {"text": ["shark", "whale", "trout"], "label": ["A", "B", "C"]},
            {"text": ["heat", "cold"], "label": ["A", "B"]},
            {"text": ["Venus", "Earth", "Mars", "Saturn"], "label": ["A", "B", "C", "D"]},
        ],
        "answerKey": ["B", "A", "C"],
    },
    "test": {
        "question": ["What do plants need?", "Which is hot?"],
        "choices": [
            {"text": ["light", "noise", "sand"], "label": ["1", "2", "3"]},
            {"text": ["ice", "snow", "fire", "frost"], "label": ["A", "B", "C", "D"]},
        ],
        "answerKey": ["1", "C"],
    },
}


COLUMNS = 'task.columns={prompt = "instruction", input = "context", response = "output"}'


def _task(tmp_path, *overrides):
    return RunContext(resolve_run(load_config(None, [*TINY, f"output_dir={tmp_path / 'runs'}", *overrides]))).task


def _save(tmp_path, name: str, splits: dict) -> str:
    folder = tmp_path / name
    datasets.DatasetDict({k: datasets.Dataset.from_list(_rows(v)) for k, v in splits.items()}).save_to_disk(folder)
    return str(folder)


def _rows(columns: dict) -> list[dict]:
    n = len(next(iter(columns.values())))
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def _local(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _same(a, b) -> None:
    for field in ("instructions", "inputs", "responses", "choices", "tags", "questions", "label_names"):
        assert getattr(a, field) == getattr(b, field), field
    assert np.array_equal(a.gold, b.gold) and np.array_equal(a.labels, b.labels)


def test_saved_free_form_set_equals_the_local_file_with_columns_mapped(tmp_path):
    folder = _save(tmp_path, "dolly_like", FREE)
    hub = _task(tmp_path, f"data.name=hub:{folder}", COLUMNS)
    local = {
        s: _local(
            tmp_path,
            s,
            [{"prompt": r["instruction"], "input": r["context"], "response": r["output"]} for r in _rows(v)],
        )
        for s, v in FREE.items()
    }
    plain = _task(tmp_path, f"data.name={local['train']}", f"data.test_path={local['test']}")
    _same(hub.train, plain.train)
    _same(hub.test, plain.test)
    assert hub.train.responses == FREE["train"]["output"] and hub.test.instructions == FREE["test"]["instruction"]
    assert hub.train.inputs[1] == "Use digits." and not hub.train.multiple_choice.any()
    # the same rows, the same prompt + response tokens
    assert all(np.array_equal(x, y) for x, y in zip(hub.test_rows[0], plain.test_rows[0]))


def test_saved_arc_style_set_maps_letter_answers_to_option_indices(tmp_path):
    folder = _save(tmp_path, "arc_like", ARC)
    columns = 'task.columns={question = "question", choices = "choices", gold = "answerKey"}'
    hub = _task(tmp_path, f"data.name=hub:{folder}", columns, "data.test_split=test")
    assert hub.train.gold.tolist() == [1, 0, 2] and hub.test.gold.tolist() == [0, 2]  # "B" "A" "C"; "1" "C"
    assert hub.test.choices[1] == ["ice", "snow", "fire", "frost"]
    local = {
        s: _local(
            tmp_path,
            s,
            [
                {"question": r["question"], "choices": r["choices"]["text"], "gold": int(g)}
                for r, g in zip(_rows(v), hub.train.gold if s == "train" else hub.test.gold)
            ],
        )
        for s, v in ARC.items()
    }
    plain = _task(tmp_path, f"data.name={local['train']}", f"data.test_path={local['test']}")
    _same(hub.train, plain.train)
    _same(hub.test, plain.test)
    assert hub.test.responses == ["the correct answer is answer1", "the correct answer is answer3"]


PIQA = {  # PIQA on the hub: the goal, one column per solution, a 0-based integer label
    "train": {
        "goal": ["Open a jar.", "Dry wet hands.", "Cool hot soup."],
        "sol1": ["Twist the lid.", "Dip them in water.", "Blow on it."],
        "sol2": ["Paint the lid.", "Use a towel.", "Heat it more."],
        "label": [0, 1, 0],
    },
    "test": {"goal": ["Light a room."], "sol1": ["Close the curtains."], "sol2": ["Switch on a lamp."], "label": [1]},
}
HELLASWAG = {  # HellaSwag on the hub: the context, an endings list, the label a digit string
    "train": {
        "ctx": ["A man picks up a guitar.", "She opens the oven."],
        "endings": [
            ["eats it.", "plays a song.", "sings.", "sleeps."],
            ["takes out bread.", "runs.", "sits.", "cries."],
        ],
        "label": ["1", "0"],
    },
    "test": {
        "ctx": ["The dog sees a ball."],
        "endings": [["chases it.", "reads.", "cooks.", "drives."]],
        "label": ["0"],
    },
}


def test_choices_in_separate_columns_or_a_list_column_equal_the_local_file(tmp_path):
    """PIQA's layout (``sol1``, ``sol2``: ``choices`` names both columns, in order) and HellaSwag's
    (an ``endings`` list, a digit-string label) read from saved ``hub:`` sets give the examples of
    the equivalent ``{question, choices, gold}`` file; the option order is the columns' order."""
    layouts = {
        "piqa": (PIQA, '{question = "goal", choices = ["sol1", "sol2"], gold = "label"}', ["sol1", "sol2"], "goal"),
        "hellaswag": (HELLASWAG, '{question = "ctx", choices = "endings", gold = "label"}', "endings", "ctx"),
    }
    for name, (splits, columns, choices, question) in layouts.items():
        folder = _save(tmp_path, name, splits)
        hub = _task(tmp_path, f"data.name=hub:{folder}", f"task.columns={columns}", "data.test_split=test")

        def options(row, choices=choices):
            return [row[c] for c in choices] if isinstance(choices, list) else row["endings"]

        local = {
            s: _local(
                tmp_path,
                f"{name}-{s}",
                [{"question": r[question], "choices": options(r), "gold": int(r["label"])} for r in _rows(v)],
            )
            for s, v in splits.items()
        }
        plain = _task(tmp_path, f"data.name={local['train']}", f"data.test_path={local['test']}")
        _same(hub.train, plain.train)
        _same(hub.test, plain.test)
    piqa = _task(tmp_path, f"data.name=hub:{tmp_path / 'piqa'}", f"task.columns={layouts['piqa'][1]}")
    assert piqa.train.choices[1] == ["Dip them in water.", "Use a towel."] and piqa.train.gold.tolist() == [0, 1, 0]
    assert piqa.test.responses == ["the correct answer is answer2"]
    swapped = '{question = "goal", choices = ["sol2", "sol1"], gold = "label"}'  # the order is the options' order
    assert _task(tmp_path, f"data.name=hub:{tmp_path / 'piqa'}", f"task.columns={swapped}").train.choices[0] == [
        "Paint the lid.",
        "Twist the lid.",
    ]
    _one_line_error(
        r"^task\.columns: hub:.*piqa\[train\] has no column 'sol3' \(for choices\)",
        lambda: (
            _task(
                tmp_path,
                f"data.name=hub:{tmp_path / 'piqa'}",
                'task.columns={question = "goal", choices = ["sol1", "sol3"], gold = "label"}',
            ).train
        ),
    )
    for bad, match in (
        ('{question = ["goal", "sol1"], choices = "sol1"}', r"question: expected one column name, got a list"),
        ('{question = "goal", choices = ["sol1"]}', r"choices: expected at least 2 distinct column names"),
        ('{question = "goal", choices = ["sol1", "sol1"]}', r"choices: expected at least 2 distinct column names"),
    ):
        _one_line_error(
            match, lambda bad=bad: _task(tmp_path, f"data.name=hub:{tmp_path / 'piqa'}", f"task.columns={bad}")
        )


def test_folder_of_data_files_reads_through_load_dataset(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    for split, cols in FREE.items():
        rows = [{"prompt": r["instruction"], "response": r["output"]} for r in _rows(cols)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = _task(tmp_path, f"data.name=hub:{folder}")
    assert task.train.instructions == FREE["train"]["instruction"] and task.test.responses == FREE["test"]["output"]


def _one_line_error(match: str, make) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_missing_columns_and_splits_are_one_line_errors(tmp_path):
    folder = _save(tmp_path, "dolly_like", FREE)
    train_only = _save(tmp_path, "train_only", {"train": FREE["train"]})
    _one_line_error(
        r"^task\.columns: hub:.*dolly_like\[train\] has no column 'answer' \(for response\); its columns are "
        r"\['instruction', 'context', 'output'\]",
        lambda: (
            _task(
                tmp_path, f"data.name=hub:{folder}", 'task.columns={prompt = "instruction", response = "answer"}'
            ).train
        ),
    )
    _one_line_error(
        r"^task\.columns: unknown column 'answer'",
        lambda: _task(tmp_path, f"data.name=hub:{folder}", 'task.columns={answer = "output"}'),
    )
    _one_line_error(
        r"dolly_like\[train\]: expected columns prompt and response, or question, choices and gold",
        lambda: _task(tmp_path, f"data.name=hub:{folder}").train,
    )
    _one_line_error(
        r"^data 'hub:.*train_only' split 'test': not saved there \(splits: train\)",
        lambda: _task(tmp_path, f"data.name=hub:{train_only}", COLUMNS).train,
    )
    _one_line_error(
        r"^data 'hub:.*no_such_folder' split 'train'",
        lambda: _task(tmp_path, f"data.name=hub:{tmp_path / 'no_such_folder'}").train,
    )


def test_text_classification_reads_a_saved_set_through_the_same_hub_loader(tmp_path):
    """:func:`fedtune.data.text.hub_split` serves the text-classification sets too: a saved
    ``DatasetDict`` with a ``ClassLabel`` column; a set with no text column is one line."""
    from fedtune.config import DataConfig
    from fedtune.data.text import load_text_dataset

    label = datasets.ClassLabel(names=["neg", "pos"])
    features = datasets.Features({"sentence": datasets.Value("string"), "label": label})
    parts = {
        "train": datasets.Dataset.from_dict({"sentence": ["bad", "good", "fine"], "label": [0, 1, 1]}, features),
        "test": datasets.Dataset.from_dict({"sentence": ["awful"], "label": [0]}, features),
    }
    datasets.DatasetDict(parts).save_to_disk(tmp_path / "sst")
    train, test = load_text_dataset(DataConfig(name=f"hub:{tmp_path / 'sst'}"))
    assert train.texts == ["bad", "good", "fine"] and train.labels.tolist() == [0, 1, 1]
    assert test.texts == ["awful"] and test.label_names == ["neg", "pos"]
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"body": ["x"], "label": [0]}) for s in parts}).save_to_disk(
        tmp_path / "odd"
    )
    _one_line_error(
        r"^data\.text_column: hub:.*odd has no text column; its columns are \['body', 'label'\]",
        lambda: load_text_dataset(DataConfig(name=f"hub:{tmp_path / 'odd'}")),
    )
