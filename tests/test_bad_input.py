"""Bad input, everywhere: every malformed recipe, value or data file stops ``fedtune run`` with
exit code 2 and one line naming what is wrong, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from tests.conftest import TINY

runner = CliRunner()

ROWS = [("good movie", "pos"), ("bad movie", "neg"), ("great", "pos"), ("awful", "neg")] * 10


def csv_file(tmp_path, name: str, body: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(body)
    return str(path)


def data_files(tmp_path) -> dict[str, tuple[str, str]]:
    """case -> (file, what the one line must name)."""
    good = "text,label\n" + "\n".join(f"{t},{y}" for t, y in ROWS) + "\n"
    return {
        "empty file": (csv_file(tmp_path, "empty.csv", b""), "no examples"),
        "header only": (csv_file(tmp_path, "header.csv", b"text,label\n"), "no examples"),
        "one row": (csv_file(tmp_path, "one.csv", b"text,label\ngood movie,pos\n"), "test set is empty"),
        "wrong columns": (
            csv_file(tmp_path, "cols.csv", good.replace("text,label", "review,y").encode()),
            "no column 'text'",
        ),
        "undecodable bytes": (csv_file(tmp_path, "bin.csv", b"text,label\n\xff\xfe\x00bad,pos\n" * 20), "not UTF-8"),
        "one class": (
            csv_file(tmp_path, "one_class.csv", ("text,label\n" + "movie,pos\n" * 40).encode()),
            "same label",
        ),
        "bad jsonl": (csv_file(tmp_path, "bad.jsonl", b'{"text": "a", "label": 1}\n{not json\n'), "malformed"),
        "jsonl keys": (csv_file(tmp_path, "keys.jsonl", b'{"review": "a", "y": 1}\n'), "expected keys 'text'"),
        "wrong suffix": (csv_file(tmp_path, "data.parquet", b"x"), "expected a .tsv, .csv or .jsonl"),
        "missing file": (str(tmp_path / "absent.csv"), "data.name"),
        "null label": (jsonl_file(tmp_path, "null.jsonl", [0, 1] * 10 + [None]), "row 21: missing label (null)"),
        "empty label": (
            csv_file(tmp_path, "empty_label.csv", ("text,label\n" + "movie,pos\nfilm,neg\n" * 10 + "x,\n").encode()),
            "row 21: empty label",
        ),
        "float label": (jsonl_file(tmp_path, "float.jsonl", [0, 1] * 10 + [1.5]), "row 21: label 1.5 is a float"),
        "bool label": (jsonl_file(tmp_path, "bool.jsonl", [True, False] * 10), "row 1: label True is a bool"),
        "huge label id": (
            jsonl_file(tmp_path, "huge.jsonl", [0, 1] * 10 + [1_000_000_000]),
            "integer labels up to 1000000000 but only 3 distinct",
        ),
    }


def jsonl_file(tmp_path, name: str, labels: list) -> str:
    import json

    rows = [json.dumps({"text": f"movie number {i}", "label": y}) for i, y in enumerate(labels)]
    return csv_file(tmp_path, name, ("\n".join(rows) + "\n").encode())


def recipes(tmp_path) -> dict[str, tuple[list[str], str]]:
    """case -> (extra CLI arguments, what the one line must name)."""
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("rounds = [1,\n")
    return {
        "missing recipe": ([str(tmp_path / "nope.toml")], "file not found"),
        "invalid toml": ([str(bad_toml)], "invalid TOML"),
        "unknown key": (["--set", "roundz=3"], "roundz"),
        "unknown section key": (["--set", "train.lrr=0.1"], "train.lrr"),
        "wrong type": (["--set", "rounds=ten"], "rounds"),
        "non-positive": (["--set", "train.lr=0"], "train.lr"),
        "infinite": (["--set", "train.lr=inf"], "train.lr"),
        "not a number": (["--set", "federation.fraction=nan"], "federation.fraction"),
        "infinite weight decay": (["--set", "train.weight_decay=inf"], "train.weight_decay"),
        "no equals": (["--set", "rounds"], "expected key=value"),
        "unknown method": (["--set", "method=fedsomething"], "method"),
        "unknown task": (["--set", "task=videos"], "task.kind"),
        "bad task option": (["--set", "task.nonsense=1"], "task.nonsense"),
        "bad method option": (["--set", "options.weighting=median"], "options.weighting"),
        "profiles count": (["--set", "federation.profiles=[{rank=2},{rank=4}]"], "federation.profiles"),
        "bad profile value": (["--set", "federation.profiles=[{rank=0}]"], "federation.profiles[0].rank"),
        "unknown profile field": (
            ["--set", "federation.profile_choices={ram=[1,2]}"],
            "federation.profile_choices.ram",
        ),
        "sample > clients": (["--set", "federation.clients_per_round=99"], "federation.clients_per_round"),
        "partition": (["--set", "data.partition=random"], "data.partition"),
        "model path": (["--set", "model.name=/no/such/model"], "model.name"),
        "output dir": (["--set", "output_dir=/proc/fedtune-runs"], "output_dir"),
    }


def assert_one_line_exit_2(args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["run", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert expected in lines[0], lines[0]


def tiny_args(*extra: str) -> list[str]:
    return [a for t in [*TINY, *extra] for a in ("--set", t)]


@pytest.mark.parametrize("case", list(data_files(__import__("pathlib").Path("/"))))
def test_malformed_data_file(tmp_path, case):
    path, expected = data_files(tmp_path)[case]
    assert_one_line_exit_2(
        tiny_args(f"data.name={path}", "federation.num_clients=10", f"output_dir={tmp_path}"), expected
    )


@pytest.mark.parametrize("case", list(recipes(__import__("pathlib").Path("/tmp"))))
def test_malformed_recipe_or_value(tmp_path, case):
    extra, expected = recipes(tmp_path)[case]
    recipe = [extra[0]] if extra and not extra[0].startswith("--") else []
    sets = extra[len(recipe) :]
    assert_one_line_exit_2([*recipe, *tiny_args(f"output_dir={tmp_path}"), *sets], expected)
