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
        "lora rank above the layers": (["--set", "model.lora_rank=100000"], "model.lora_rank: 100000 exceeds"),
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


# -- resuming a damaged or edited run folder ---------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished one-round tiny run (the folder every resume case damages a copy of)."""
    out = tmp_path_factory.mktemp("finished")
    result = runner.invoke(app, ["run", *tiny_args("rounds=1", f"output_dir={out}", "name=done")])
    assert result.exit_code == 0, result.output
    return out / "done"


def _write(name: str, data: bytes):
    return lambda run: (run / name).write_bytes(data)


RESUME_CASES = {
    "truncated checkpoint": (
        lambda run: (run / "checkpoint.npz").write_bytes((run / "checkpoint.npz").read_bytes()[:200]),
        [],
        "checkpoint",
    ),
    "random checkpoint": (_write("checkpoint.npz", bytes(range(256)) * 40), [], "unreadable"),
    "empty checkpoint": (_write("checkpoint.npz", b""), [], "unreadable"),
    "garbage metrics line": (
        lambda run: (run / "metrics.jsonl").open("a").write("not json\n"),
        [],
        "line 2 is not a round",
    ),
    "binary metrics": (_write("metrics.jsonl", b"\xff\xfe\x00\x01" * 50), [], "metrics.jsonl"),
    "missing metrics": (lambda run: (run / "metrics.jsonl").unlink(), [], "metrics.jsonl"),
    "edited config": (
        lambda run: (run / "config.toml").write_text(
            (run / "config.toml").read_text().replace("lora_rank = 8", "lora_rank = 4")
        ),
        [],
        "differs from the one the run started with in model.lora_rank",
    ),
    "changed by --set": (lambda run: None, ["--set", "train.lr=0.5"], "in train.lr;"),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resuming_a_damaged_or_edited_run_folder_is_one_line(finished_run, tmp_path, case):
    import hashlib
    import shutil

    damage, extra, expected = RESUME_CASES[case]
    run = tmp_path / "runs" / "done"
    shutil.copytree(finished_run, run)
    neighbour = shutil.copytree(finished_run, tmp_path / "runs" / "neighbour")

    def digest(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}

    before = digest(neighbour)
    damage(run)
    result = runner.invoke(app, ["run", "--resume", str(run), *extra])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert expected in lines[0], lines[0]
    assert digest(neighbour) == before  # nothing outside the resumed folder changed


def test_rounds_may_be_raised_on_resume(finished_run, tmp_path):
    import json
    import shutil

    run = shutil.copytree(finished_run, tmp_path / "runs" / "done")
    result = runner.invoke(app, ["run", "--resume", str(run), "--set", "rounds=2"])
    assert result.exit_code == 0, result.output
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
