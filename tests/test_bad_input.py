"""Bad input, everywhere: every malformed recipe, value, data file, run name, damaged run folder
and report input stops ``fedtune`` with exit code 2 and one line naming what is wrong, never a
traceback; and nothing outside the new run folder changes (a finished neighbouring run folder is
hashed before and after each case). Deploy flags: ``tests/test_flower_deploy.py``."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
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


def case_names(make) -> list[str]:
    """The case names of ``make(folder)`` (:func:`data_files`, :func:`recipes`), from a throw-away
    folder: collection writes nothing outside it."""
    with tempfile.TemporaryDirectory() as folder:
        return list(make(Path(folder)))


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
        "float labels in a csv": (
            csv_file(tmp_path, "floats.csv", ("text,label\n" + "movie,1\nfilm,0\n" * 10 + "x,0.5\n").encode()),
            "row 21: label '0.5' is a float",
        ),
        "integral float labels in a tsv": (
            csv_file(tmp_path, "floats.tsv", ("text\tlabel\n" + "movie\t1.0\nfilm\t0.0\n" * 10).encode()),
            "row 1: label '1.0' is a float",
        ),
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
    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(256)))
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
        "binary recipe": ([str(binary)], "invalid TOML"),
        "recipe is a folder": ([str(tmp_path)], "recipe"),
        "unknown target module": (["--set", 'model.target_modules=["nope"]'], "model.target_modules: 'nope'"),
        "negative seed": (["--set", "seed=-1"], "seed"),
        "zero rounds": (["--set", "rounds=0"], "rounds"),
        "unknown engine": (["--set", "engine=spark"], "engine"),
        "list for a number": (["--set", "train.lr=[1]"], "train.lr"),
        "dropout of 1": (["--set", "model.lora_dropout=1"], "model.lora_dropout"),
    }


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished one-round tiny run: the neighbour every case must leave alone, and the folder
    every resume case damages a copy of."""
    out = tmp_path_factory.mktemp("finished")
    result = runner.invoke(app, ["run", *tiny_args("rounds=1", f"output_dir={out}", "name=done")])
    assert result.exit_code == 0, result.output
    return out / "done"


def assert_one_line_exit_2(
    args: list[str], expected: str, neighbour_in: Path, finished: Path, command: str = "run"
) -> None:
    """``fedtune <command> <args>`` exits 2 with one line holding ``expected``, and a copy of the
    ``finished`` run in ``neighbour_in`` (the case's output_dir) is byte for byte as before."""
    neighbour = neighbour_in / "neighbour"
    if not neighbour.exists():
        shutil.copytree(finished, neighbour)
    before = digest(neighbour)
    result = runner.invoke(app, [command, *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert expected in lines[0], lines[0]
    assert digest(neighbour) == before  # nothing outside the new run folder changed


def tiny_args(*extra: str) -> list[str]:
    return [a for t in [*TINY, *extra] for a in ("--set", t)]


@pytest.mark.parametrize("case", case_names(data_files))
def test_malformed_data_file(tmp_path, case, finished_run):
    path, expected = data_files(tmp_path)[case]
    args = tiny_args(f"data.name={path}", "federation.num_clients=10", f"output_dir={tmp_path}")
    assert_one_line_exit_2(args, expected, tmp_path, finished_run)


@pytest.mark.parametrize("case", case_names(recipes))
def test_malformed_recipe_or_value(tmp_path, case, finished_run):
    extra, expected = recipes(tmp_path)[case]
    recipe = [extra[0]] if extra and not extra[0].startswith("--") else []
    sets = extra[len(recipe) :]
    assert_one_line_exit_2([*recipe, *tiny_args(f"output_dir={tmp_path}"), *sets], expected, tmp_path, finished_run)


def numeric_keys() -> list[str]:
    """Every numeric key of the config (dotted), from its schema."""
    from pydantic import BaseModel

    from fedtune.config import RunConfig

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                yield from walk(ann, f"{prefix}{name}.")
            elif ann in (int, float, int | None, float | None):
                yield f"{prefix}{name}"

    return list(walk(RunConfig))


@pytest.mark.parametrize("value", ["nan", '"ten"'])
@pytest.mark.parametrize("key", numeric_keys())
def test_every_numeric_key_refuses_a_non_number(tmp_path, key, value, finished_run):
    """Not-a-number and a string, for each of the config's numeric keys (every one checked finite)."""
    assert_one_line_exit_2(
        [*tiny_args(f"output_dir={tmp_path}"), "--set", f"{key}={value}"], key, tmp_path, finished_run
    )


def test_the_sweep_has_at_least_100_cases():
    assert (
        len(case_names(data_files))
        + len(case_names(recipes))
        + 2 * len(numeric_keys())
        + len(RESUME_CASES)
        + len(REPORT_CASES)
        + len(NAME_CASES)
        >= 100
    )


NAME_CASES = {
    "parent folder": ("../x", "name: expected one folder name"),
    "dot": (".", "name: expected one folder name"),
    "dot dot": ("..", "name: expected one folder name"),
    "absolute": ("/tmp/x", "name: expected one folder name"),
    "two components": ("a/b", "name: expected one folder name"),
    "space": ("a b", "name: expected one folder name"),
    "empty": ("", "name: expected one folder name"),
}


@pytest.mark.parametrize("case", list(NAME_CASES))
def test_a_run_name_is_one_safe_folder_name(tmp_path, case, finished_run):
    name, expected = NAME_CASES[case]
    out = tmp_path / "out"
    assert_one_line_exit_2(
        [*tiny_args(f"output_dir={out}"), "--set", f"name={json.dumps(name)}"], expected, tmp_path, finished_run
    )
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["neighbour"]  # nothing written


def test_an_earlier_run_is_never_overwritten_and_overwrite_moves_it_aside(tmp_path, finished_run):
    """A finished run's name again: one line, its folder byte for byte as before; --overwrite moves
    it to done.old-1 (unchanged) and runs afresh; --overwrite with --resume is refused."""
    shutil.copytree(finished_run, tmp_path / "done")
    before = digest(tmp_path / "done")
    args = tiny_args("rounds=1", f"output_dir={tmp_path}", "name=done")
    assert_one_line_exit_2(args, "holds an earlier run: pick another name", tmp_path, finished_run)
    assert digest(tmp_path / "done") == before
    result = runner.invoke(app, ["run", *args, "--overwrite"])
    assert result.exit_code == 0, result.output
    assert digest(tmp_path / "done.old-1") == before and (tmp_path / "done" / "summary.json").is_file()
    result = runner.invoke(app, ["run", "--resume", str(tmp_path / "done"), "--overwrite"])
    assert result.exit_code == 2 and "--overwrite: a fresh run's option" in result.output


def test_a_failed_write_stops_with_one_line_and_keeps_the_earlier_rounds(tmp_path, monkeypatch):
    """A full disk at round 2's checkpoint: exit 1, one line naming the file and the rounds kept;
    round 1's checkpoint and line survive, and --resume then ends as an uninterrupted run."""
    import errno

    import fedtune.run as run_module

    real_save = run_module.save_state

    def full_disk_at_round_2(path, state, **kwargs):
        if state[run_module.ROUND_KEY] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(path, state, **kwargs)

    args = tiny_args("rounds=3", f"output_dir={tmp_path}", "name=full")
    monkeypatch.setattr(run_module, "save_state", full_disk_at_round_2)
    result = runner.invoke(app, ["run", *args])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "checkpoint.npz' (No space left on device); rounds 1-1 are checkpointed" in lines[-1], lines[-1]
    assert "fedtune run --resume" in lines[-1]
    monkeypatch.setattr(run_module, "save_state", real_save)
    assert runner.invoke(app, ["run", "--resume", str(tmp_path / "full")]).exit_code == 0
    assert runner.invoke(app, ["run", *tiny_args("rounds=3", f"output_dir={tmp_path}", "name=whole")]).exit_code == 0
    resumed, whole = (
        [
            {k: v for k, v in json.loads(x).items() if "wall" not in k and "compute" not in k}
            for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()
        ]
        for n in ("full", "whole")
    )
    assert resumed == whole


# -- resuming a damaged or edited run folder ---------------------------------------------------------
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
    "metrics cut inside the checkpointed round's line": (
        lambda run: (run / "metrics.jsonl").write_bytes((run / "metrics.jsonl").read_bytes()[:40]),
        [],
        "does not hold rounds 1-1 once each",
    ),
    "--overwrite with --resume": (lambda run: None, ["--overwrite"], "--overwrite: a fresh run's option"),
    "missing metrics": (lambda run: (run / "metrics.jsonl").unlink(), [], "metrics.jsonl"),
    "edited config": (
        lambda run: (run / "config.toml").write_text(
            (run / "config.toml").read_text().replace("lora_rank = 8", "lora_rank = 4")
        ),
        [],
        "differs from the one the run started with in model.lora_rank",
    ),
    "changed by --set": (lambda run: None, ["--set", "train.lr=0.5"], "in train.lr;"),
    "_round negative": (lambda run: _edit_checkpoint(run, _round=-7), [], "_round = -7, expected the last"),
    "_round zero": (lambda run: _edit_checkpoint(run, _round=0), [], "_round = 0, expected the last"),
    "_round not a whole number": (lambda run: _edit_checkpoint(run, _round=1.5), [], "_round = 1.5"),
    "fewer rounds than done": (
        lambda run: _edit_checkpoint(run, _round=2),
        ["--set", "rounds=1"],
        "rounds = 1 but 2 rounds are done; rounds may only be raised",
    ),
    "_round beyond metrics.jsonl": (
        lambda run: _raise_rounds(run, 3) or _edit_checkpoint(run, _round=2),
        [],
        "does not hold rounds 1-2 once each",
    ),
    "a rank-4 checkpoint in a rank-8 run": (lambda run: _edit_checkpoint(run, rank=4), [], "rank = 4, this run's is 8"),
    "an array of another shape": (
        lambda run: _edit_checkpoint(run, arrays=lambda a: a[..., :1]),
        [],
        "this run builds float32",
    ),
    "an array of another dtype": (
        lambda run: _edit_checkpoint(run, arrays=lambda a: a.astype("float64")),
        [],
        "float64",
    ),
    "a NaN in an array": (lambda run: _edit_checkpoint(run, arrays=lambda a: a * np.nan), [], "holds NaN or inf"),
    "an inf in an array": (
        lambda run: _edit_checkpoint(run, arrays=lambda a: np.full_like(a, np.inf)),
        [],
        "holds NaN or inf",
    ),
    "round 1 twice where rounds 1-2 are done": (
        lambda run: (
            _raise_rounds(run, 3)
            or _edit_checkpoint(run, _round=2)
            or (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() * 2)
        ),
        [],
        "does not hold rounds 1-2 once each",
    ),
    "an array renamed": (lambda run: _edit_checkpoint(run, rename=True), [], "differ from this run's"),
    "missing run_config.json": (lambda run: (run / "run_config.json").unlink(), [], "run_config.json' is missing"),
}


def _edit_checkpoint(run: Path, arrays=None, rename: bool = False, **plain) -> None:
    """Rewrite ``run``'s checkpoint.npz with ``plain`` values set, ``arrays(a)`` applied to every
    global array, or the first global array renamed."""
    from fedtune.checkpoint import load_state, save_state

    state = load_state(run / "checkpoint.npz")
    state.update(plain)
    if arrays is not None:
        state["global"] = {k: arrays(v) for k, v in state["global"].items()}
    if rename:
        first = sorted(state["global"])[0]
        state["global"][first + ".x"] = state["global"].pop(first)
    save_state(run / "checkpoint.npz", state)


def _raise_rounds(run: Path, rounds: int) -> None:
    """``rounds`` in both config files (as if the run had started with it)."""
    (run / "config.toml").write_text((run / "config.toml").read_text().replace("rounds = 1", f"rounds = {rounds}"))
    started = json.loads((run / "run_config.json").read_text())
    (run / "run_config.json").write_text(json.dumps({**started, "rounds": rounds}))


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
    damaged = digest(run)
    result = runner.invoke(app, ["run", "--resume", str(run), *extra])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert expected in lines[0], lines[0]
    assert digest(neighbour) == before  # nothing outside the resumed folder changed
    assert digest(run) == damaged  # nor inside it (metrics.jsonl kept: no data loss)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """A finished one-round run of method "local": each client keeps its adapter in its persistent
    state, which the checkpoint holds under _engine."""
    out = tmp_path_factory.mktemp("local")
    result = runner.invoke(app, ["run", *tiny_args("rounds=1", "method=local", f"output_dir={out}", "name=local")])
    assert result.exit_code == 0, result.output
    return out / "local"


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_resuming_with_a_non_finite_client_state_is_one_line(local_run, tmp_path, bad):
    """The engine's state (client 2's own adapter) is checked as the strategy's is: one non-finite
    value in it stops the resume with one line naming the array, the folder byte for byte as
    before (loaded unchecked, client 2 would train from a NaN adapter)."""
    from fedtune.checkpoint import load_state, save_state

    run = shutil.copytree(local_run, tmp_path / "local")
    state = load_state(run / "checkpoint.npz")
    client = state["_engine"]["2"]
    name = sorted(client)[0]
    assert client[name].dtype == np.float32 and np.isfinite(client[name]).all()
    client[name] = client[name].copy()
    client[name].flat[3] = bad
    save_state(run / "checkpoint.npz", state)
    before = digest(run)
    result = runner.invoke(app, ["run", "--resume", str(run)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"_engine: 2/{name} holds NaN or inf" in lines[0], lines[0]
    assert digest(run) == before


def test_rounds_may_be_raised_on_resume(finished_run, tmp_path):
    import json
    import shutil

    run = shutil.copytree(finished_run, tmp_path / "runs" / "done")
    result = runner.invoke(app, ["run", "--resume", str(run), "--set", "rounds=2"])
    assert result.exit_code == 0, result.output
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_bad_input_stops_every_engine_in_one_line_with_nothing_written(engine, engine_runs, tmp_path):
    """Every engine (tests/engines.py), through ``fedtune run``: a data file that does not exist, a
    fresh run into a folder holding an earlier run, and a resume of a copy of that engine's DP run
    with a damaged checkpoint, a NaN in it or another key set each stop with exit 2 and one line
    naming it, before any engine process is left running, and change nothing (the earlier run and
    the damaged copy byte for byte; no new folder). A launcher that starts Flower before reading
    the data fails here (the deployment's error was a traceback, exit 1, and a folder)."""
    import psutil

    from tests.engines import BASE, sets

    done = shutil.copytree(engine_runs.killed(engine).run_dir, tmp_path / "runs" / "done")
    fresh = sets([*BASE, f'engine="{engine}"', f"output_dir={tmp_path / 'runs'}"])
    damaged = shutil.copytree(done, tmp_path / "runs" / "damaged")
    cases = [
        ([*fresh, "--set", f"data.name={tmp_path / 'missing.csv'}", "--set", "name=new"], "is not a named set"),
        ([*fresh, "--set", "name=done"], "holds an earlier run: pick another name"),
        (["--resume", str(damaged), "--set", "train.lr=0.5"], "in train.lr;"),
        (["--resume", str(damaged)], "checkpoint"),
        (["--resume", str(damaged)], "holds NaN or inf"),
    ]
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    for i, (args, expected) in enumerate(cases):
        if i == 3:
            (damaged / "checkpoint.npz").write_bytes((damaged / "checkpoint.npz").read_bytes()[:200])
        if i == 4:
            shutil.copy(done / "checkpoint.npz", damaged / "checkpoint.npz")
            _edit_checkpoint(damaged, arrays=lambda a: a * np.nan)
        before = {folder: digest(folder) for folder in (done, damaged)}
        result = runner.invoke(app, ["run", *args])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and expected in lines[0], (engine, expected, result.output)
        assert {folder: digest(folder) for folder in (done, damaged)} == before
        assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["damaged", "done"]
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, "a process was left running"


# -- report inputs -----------------------------------------------------------------------------------
REPORT_CASES = {
    "no such folder": (lambda run: shutil.rmtree(run), "folder not found"),
    "binary metrics": (_write("metrics.jsonl", b"\x00\xff\x01" * 30), "metrics.jsonl: not UTF-8 text"),
    "garbled metrics line": (_write("metrics.jsonl", b'{"round": 1,\n'), "metrics.jsonl, line 1: invalid JSON"),
    "round not a number": (_write("metrics.jsonl", b'{"round": "x"}\n'), "line 1: round is 'x'"),
    "accuracy not a number": (_write("metrics.jsonl", b'{"round": 1, "accuracy": "high"}\n'), "accuracy is 'high'"),
    "metrics a list": (_write("metrics.jsonl", b"[1, 2]\n"), "line 1: got list"),
    "binary summary": (_write("summary.json", bytes(range(256))), "summary.json: not UTF-8 text"),
    "summary not an object": (_write("summary.json", b"[1]"), "summary.json: got list"),
    "summary number a string": (_write("summary.json", b'{"final_accuracy": "90%"}'), "final_accuracy is '90%'"),
    "missing summary": (lambda run: (run / "summary.json").unlink(), "summary.json: file not found"),
}


@pytest.mark.parametrize("case", list(REPORT_CASES))
def test_a_damaged_report_input_is_one_line(finished_run, tmp_path, case):
    damage, expected = REPORT_CASES[case]
    run = shutil.copytree(finished_run, tmp_path / "runs" / "done")
    damage(run)
    assert_one_line_exit_2(
        [str(run), "--out", str(tmp_path / "report")], expected, tmp_path / "runs", finished_run, "report"
    )
    assert not (tmp_path / "report").exists()


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path, tiny_config):
    """A CSV / JSONL saved with a UTF-8 byte-order mark (Excel, Notepad) reads as without it (before:
    "no column 'text'", the column being '\\ufefftext')."""
    from fedtune.runtime import RunContext, resolve_run

    rows = "".join(f"movie number {i},{['pos', 'neg'][i % 2]}\n" for i in range(40))
    for name, data in [
        ("bom.csv", "text,label\n" + rows),
        ("bom.jsonl", "".join(json.dumps({"text": f"m{i}", "label": i % 2}) + "\n" for i in range(40))),
    ]:
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + data.encode())
        task = RunContext(resolve_run(tiny_config(f"data.name={path}"))).task
        assert len(task.train) + len(task.test) == 40 and task.num_labels == 2
