"""A seeded fuzz of ``fedtune run / eval / export / plan`` with bad input: wrong types, missing
files, bad values, hostile files, conflicting options, damaged run folders and output targets.
Every case ends in success (exit 0) or in exit 2 with one line, never an unexpected error ("a
fedtune bug"); a refusal leaves the workspace as it was: no folder or file created, none changed.

The cases are drawn from :data:`SEED` (``random.Random``): each picks a command, a kind of damage
and its details, so the same seed gives the same cases; ``FEDTUNE_FUZZ_SEED`` and
``FEDTUNE_FUZZ_CASES`` explore others. The
workspace holds one finished tiny run (tiny-bert, FedIT, one round), which the run folder cases
damage a copy of, and a tiny recipe. Options that Typer itself refuses (``--limit 0``) print its
usage box and are left out: the cases reach fedtune's own checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from tests.conftest import TINY, output_lines
from tests.test_bad_input import numeric_keys

runner = CliRunner()

SEED = int(os.environ.get("FEDTUNE_FUZZ_SEED", 49))  # another seed explores other cases
CASES = int(os.environ.get("FEDTUNE_FUZZ_CASES", 48))
LIMIT_S = 120  # seconds a case may take (the slowest, a resumed round or an export, take a few)
#: values that are never a valid number
NOT_NUMBERS = ["true", '"1"', '"ten"', "[1]", "{a = 1}", "nan", "-inf", "1e999", "''"]
#: (key, value) pairs each out of its range or in conflict with the tiny run
OUT_OF_RANGE = [
    ("rounds", "0"),
    ("train.lr", "-1"),
    ("federation.num_clients", "0"),
    ("data.alpha", "0"),
    ("federation.fraction", "1.5"),
    ("model.lora_rank", "0"),
    ("seed", "-1"),
    ("train.batch_size", "0"),
    ("data.max_length", "0"),
    ("federation.clients_per_round", "99"),
    ("model.lora_rank", "100000"),
    ("name", '"../escape"'),
]
#: option sets that cannot train together
CONFLICTS = [
    ["method=fedavg", "federation.profiles=[{memory_gib=4}]"],
    ["federation.profiles=[{memory_gib=0.0001}]"],
    ["federation.profiles=[{bandwidth_mb=1e-9}]"],
    ["federation.profiles=[{memory_gib=true}]"],
    ["method=fslora", "robust.aggregation=median"],
    ["method=bomm"],
    ["method=flexlora", "privacy.mode=central", "privacy.clip=1", "privacy.noise_multiplier=1"],
    ["privacy.mode=central", "privacy.clip=1", 'privacy.noise_multiplier="1"'],
    ["federation.profiles=[{attack='metadata'}, {rank=2}]"],
]


def tree(folder: Path) -> dict[str, str]:
    """Every path under ``folder``: a file's sha256, a folder's "dir", a link's target."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = f"-> {path.readlink()}"
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


class Workspace:
    """The fuzz's folder: a finished run (``done``), a tiny recipe, and a fresh path per case."""

    def __init__(self, root: Path, done: Path) -> None:
        self.root, self.done, self.n = root, done, 0
        self.recipe = root / "tiny.toml"
        self.recipe.write_text("\n".join(_toml_line(s) for s in TINY) + "\n")

    def fresh(self, stem: str) -> Path:
        self.n += 1
        return self.root / f"{stem}-{self.n}"

    def damaged_run(self, rng: random.Random) -> tuple[Path, str]:
        """A copy of the finished run with one kind of damage."""
        run = Path(shutil.copytree(self.done, self.fresh("run")))
        kind = rng.choice(["checkpoint", "metrics", "run_config", "config", "adapter", "eval", "template"])
        if kind == "checkpoint":
            data = (run / "checkpoint.npz").read_bytes()
            (run / "checkpoint.npz").write_bytes(data[: rng.randrange(len(data))])
        elif kind == "metrics":
            with (run / "metrics.jsonl").open("a") as f:
                f.write(rng.choice(["{garbage\n", "[1, 2]\n", '{"round": "one"}\n', "null\n"]))
        elif kind == "run_config":
            (run / "run_config.json").unlink()
        elif kind == "config":
            (run / "config.toml").write_bytes(rng.randbytes(64))
        elif kind == "adapter":
            (run / "adapter" / "adapter_config.json").write_text(rng.choice(["{", "[]", '{"r": "x"}']))
        elif kind == "eval":
            (run / "eval.json").write_text(json.dumps({"sets": {"x": {"acc": rng.choice(["high", None, [1]])}}}))
        else:
            (run / "prompt_template.json").write_text(rng.choice(["nope", "[1]", '"a string"']))
        return run, kind


def _toml_line(assignment: str) -> str:
    key, value = assignment.split("=", 1)
    return f"{key} = {value if value[:1] in '0123456789[{' else json.dumps(value)}"


def run_case(ws: Workspace, rng: random.Random) -> list[str]:
    out = f"output_dir={ws.fresh('runs')}"
    kind = rng.choice(["not a number", "out of range", "missing file", "hostile recipe", "hostile data", "conflict"])
    if kind == "not a number":
        return ["run", *sets(*TINY, out, f"{rng.choice(numeric_keys())}={rng.choice(NOT_NUMBERS)}")]
    if kind == "out of range":
        key, value = rng.choice(OUT_OF_RANGE)
        return ["run", *sets(*TINY, out, f"{key}={value}")]
    if kind == "missing file":
        missing = ws.root / "absent" / rng.choice(["x.toml", "x.csv", "x.jsonl", "model"])
        return rng.choice(
            [
                ["run", str(missing.with_suffix(".toml")), *sets(out)],
                ["run", *sets(*TINY, out, f"data.name={missing.with_suffix('.csv')}")],
                ["run", *sets(*TINY, out, f"model.name={missing}")],
                ["run", "--resume", str(missing.parent)],
            ]
        )
    if kind == "hostile recipe":
        recipe = ws.fresh("recipe").with_suffix(".toml")
        recipe.write_bytes(
            rng.choice(
                [
                    rng.randbytes(200),
                    b"rounds = " + b"[" * 500 + b"]" * 500 + b"\n",
                    b"rounds = 99999999999999999999999999\n",
                    b"[federation]\nprofiles = 'all of them'\n",
                    b"method = 'fedit'\nmethod = 'fedavg'\n",
                ]
            )
        )
        return ["run", str(recipe), *sets(out)]
    if kind == "hostile data":
        data = ws.fresh("data").with_suffix(rng.choice([".csv", ".jsonl", ".tsv"]))
        data.write_bytes(
            rng.choice(
                [
                    rng.randbytes(300),
                    b"text,label\n" + b"a,\x00\n" * 30,
                    b'{"text": {"nested": [1]}, "label": 1}\n' * 30,
                    b'{"text": "a", "label": 1e400}\n' * 30,
                    b"text,label\n" + b"x,1\n" * 3,
                ]
            )
        )
        return ["run", *sets(*TINY, out, f"data.name={data}")]
    return ["run", *sets(*TINY, out, *rng.choice(CONFLICTS))]


def resume_case(ws: Workspace, rng: random.Random) -> list[str]:
    run, _ = ws.damaged_run(rng)
    extra = rng.choice([[], ["--set", "rounds=0"], ["--set", "model.lora_rank=2"], ["--set", "rounds=2"]])
    return ["run", "--resume", str(run), *extra]


def eval_case(ws: Workspace, rng: random.Random) -> list[str]:
    out = ["-o", str(ws.fresh("eval").with_suffix(".json"))]
    kind = rng.choice(["missing", "damaged", "tasks", "task file", "user file", "backend", "own test set"])
    if kind == "missing":
        return ["eval", str(ws.root / "absent-run"), *out]
    if kind == "damaged":
        return ["eval", str(ws.damaged_run(rng)[0]), "--limit", "2", *out]
    if kind == "tasks":
        return ["eval", str(ws.done), "--tasks", rng.choice(["arc", "arc_easy,arc_easy", ",", "../x.jsonl"]), *out]
    if kind == "task file":
        questions = ws.fresh("questions").with_suffix(".jsonl")
        questions.write_bytes(rng.choice([b"{not json\n", b'{"question": 1}\n', rng.randbytes(100)]))
        return ["eval", "tiny-llama", "--tasks", str(questions), "--limit", "2", *out]
    if kind == "user file":
        mine = ws.fresh("mine").with_suffix(".json")
        mine.write_text('{"mine": 1}')
        return ["eval", str(ws.done), "--limit", "2", "-o", str(mine)]
    if kind == "backend":
        return rng.choice(
            [
                ["eval", "tiny-llama", "--backend", "helm", "--tasks", "arc_easy", *out],
                ["eval", "tiny-llama", "--tasks", "arc_easy", "--include-path", str(ws.root), *out],
                ["eval", "tiny-llama", "--backend", "lm-eval", *out],
            ]
        )
    return ["eval", str(ws.done), "--limit", "4", *out]  # its own test set: succeeds


def export_case(ws: Workspace, rng: random.Random) -> list[str]:
    kind = rng.choice(["missing", "damaged", "current folder", "a file", "inside a run", "holds a run", "fresh"])
    if kind == "missing":
        return ["export", str(ws.root / "absent-run")]
    if kind == "damaged":
        return ["export", str(ws.damaged_run(rng)[0]), "-o", str(ws.fresh("export"))]
    if kind == "current folder":
        return ["export", str(ws.done), "-o", ".", *rng.choice([[], ["--overwrite"]])]
    if kind == "a file":
        return ["export", str(ws.done), "-o", str(ws.recipe), "--overwrite"]
    if kind == "inside a run":
        return ["export", str(ws.done), "-o", str(ws.done / rng.choice(["adapter", "x", "export-merged"]))]
    if kind == "holds a run":
        return ["export", str(ws.done), "-o", str(ws.root), "--overwrite"]
    return ["export", str(ws.done), "-o", str(ws.fresh("export") / "new")]  # succeeds


def plan_case(ws: Workspace, rng: random.Random) -> list[str]:
    kind = rng.choice(["missing", "not a number", "no planner", "hostile recipe", "fine"])
    budget = "federation.profiles=[{memory_gib=4}]"
    if kind == "missing":
        return ["plan", str(ws.root / "absent.toml")]
    if kind == "not a number":
        key = rng.choice(["memory_gib", "bandwidth_mb", "deadline_s", "speed"])
        return ["plan", str(ws.recipe), *sets(f"federation.profiles=[{{{key}={rng.choice(NOT_NUMBERS)}}}]")]
    if kind == "no planner":
        return ["plan", str(ws.recipe), *sets("method=fedavg", budget)]
    if kind == "hostile recipe":
        recipe = ws.fresh("plan").with_suffix(".toml")
        recipe.write_bytes(rng.randbytes(120))
        return ["plan", str(recipe)]
    return ["plan", str(ws.recipe), *sets(budget)]  # succeeds


GENERATORS: list[tuple[str, Callable[[Workspace, random.Random], list[str]]]] = [
    ("run", run_case),
    ("run", run_case),
    ("resume", resume_case),
    ("eval", eval_case),
    ("export", export_case),
    ("plan", plan_case),
]


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-done")
    result = runner.invoke(app, ["run", *sets(*TINY, "rounds=1", f"output_dir={out}", "name=done")])
    assert result.exit_code == 0, result.output
    return out / "done"


class CaseTooLong(BaseException):
    """A case ran over :data:`LIMIT_S` (a BaseException: a client's ``except Exception`` in the round
    loop would take a TimeoutError for a failed client and go on)."""


def _too_long(signum, frame):
    raise CaseTooLong(f"a fuzz case ran over {LIMIT_S} s")


def test_seeded_bad_input_is_one_line_and_exit_2_or_success_and_a_refusal_leaves_nothing(done, tmp_path, monkeypatch):
    previous = signal.signal(signal.SIGALRM, _too_long)
    try:
        _fuzz(done, tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGALRM, previous)


def _fuzz(done: Path, tmp_path: Path, monkeypatch) -> None:
    rng = random.Random(SEED)
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root, Path(shutil.copytree(done, root / "done")))
    cwd = root / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # relative outputs (-o ., ./eval.json) land inside the workspace
    outcomes: dict[str, set[int]] = {}
    for case in range(CASES):
        command, make = GENERATORS[rng.randrange(len(GENERATORS))]
        args = make(ws, rng)
        before = tree(root)
        signal.alarm(LIMIT_S)  # a case that started a long run fails, naming itself, instead of hanging
        try:
            result = runner.invoke(app, args)
        except CaseTooLong:
            pytest.fail(f"case {case}: fedtune {' '.join(args)} ran over {LIMIT_S} s")
        finally:
            signal.alarm(0)
        where = f"case {case}: fedtune {' '.join(args)}\n{result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), where
        assert result.exit_code in (0, 2) and "a fedtune bug" not in result.output, where
        if result.exit_code == 2:
            lines = output_lines(result.output)
            assert len(lines) == 1 and lines[0].startswith("error: "), where
            assert tree(root) == before, where  # a refusal creates, changes and moves nothing
        outcomes.setdefault(command, set()).add(result.exit_code)
    assert set(outcomes) == {"run", "resume", "eval", "export", "plan"}, outcomes
    assert all(2 in codes for codes in outcomes.values()) and any(0 in codes for codes in outcomes.values()), outcomes
