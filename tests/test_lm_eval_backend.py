"""``fedtune eval --backend lm-eval``: lm-evaluation-harness's own task (here ARC-Easy's YAML,
pointed at the data folder's questions through a custom task under ``--include-path``, as the
hub is offline) scored on the model fedtune builds (a run's adapter on its base, or a bare base)
chooses per question what ``--backend fedtune`` chooses on the same questions; the record is
``eval.json``'s shape with the protocol ``lm-eval:<task>`` and lm-eval's version; a missing
lm-eval, an unknown task and the other backend's options are one-line errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.data import llm_text
from tests.test_lm_eval_crosscheck import hub_record
from tests.test_trained_lm import run_dir  # noqa: F401 - the module's trained tiny-llama run (a fixture)

pytest.importorskip("lm_eval")

runner = CliRunner()
DATA = Path(os.environ["FEDTUNE_DATA_DIR"])
N = 10


def local_arc_easy(folder: Path, n: int = N) -> str:
    """A custom lm-eval task ``arc_easy_local`` under ``folder``: lm-eval's own ``arc_easy`` YAML
    (included) reading the first ``n`` ARC-Easy test questions of the data folder as hub rows."""
    import lm_eval.tasks

    rows = llm_text.read_jsonl(DATA / "commonsense" / "arc_easy_test.jsonl.gz")[:n]
    data = folder / "arc_easy_test.jsonl"
    data.write_text("".join(json.dumps(hub_record("arc_easy", r)) + "\n" for r in rows))
    base = Path(lm_eval.tasks.__file__).parent / "arc" / "arc_easy.yaml"
    (folder / "arc_easy_local.yaml").write_text(
        f"include: {base}\ntask: arc_easy_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntraining_split: null\nvalidation_split: null\n"
        "test_split: test\n"
    )
    return "arc_easy_local"


def _eval(*args: str) -> dict:
    out = Path(args[args.index("--out") + 1])
    result = runner.invoke(app, ["eval", *args])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def _same_picks(ours: dict, theirs: dict, set_name: str, task: str) -> None:
    mine, other = ours["examples"][set_name], theirs["examples"][task]
    assert len(mine["pick"]) == len(other["pick"]) == N
    assert mine["pick"] == other["pick"]
    assert mine["acc"] == other["acc"] and mine["acc_norm"] == other["acc_norm"]
    assert ours["sets"][set_name]["acc"] == pytest.approx(theirs["sets"][task]["acc"])


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_both_backends_choose_alike_per_question_on_a_bare_model(tmp_path, model):
    task = local_arc_easy(tmp_path)
    common = [model, "--limit", str(N), "--batch-size", "4"]
    ours = _eval(*common, "--tasks", "arc_easy", "--out", str(tmp_path / "ours.json"))
    theirs = _eval(
        *common, "--tasks", task, "--backend", "lm-eval", "--include-path", str(tmp_path),
        "--out", str(tmp_path / "theirs.json"),
    )  # fmt: skip
    _same_picks(ours, theirs, "arc_easy", task)
    assert theirs["protocol"]["name"] == f"lm-eval:{task}" and theirs["protocol"]["backend"] == "lm-eval"
    assert theirs["versions"]["lm_eval"] and theirs["protocol"]["tasks"][task]["num_fewshot"] == 0
    assert theirs["metrics"][task]["acc,none"] == pytest.approx(np.mean(theirs["examples"][task]["acc"]))
    assert theirs["sets"][task]["n"] == N and theirs["sets"][task]["acc_se"] > 0
    assert theirs["adapter"] is None and theirs["target"] == model


def test_a_runs_adapter_and_its_base_are_handed_to_lm_eval(run_dir, tmp_path):  # noqa: F811
    """The run's adapter acts (its picks differ from its base's somewhere) and on both the run and
    its base (``--baseline``) lm-eval's task chooses per question what fedtune's does."""
    task = local_arc_easy(tmp_path)
    common = [str(run_dir), "--limit", str(N), "--baseline"]
    ours = _eval(*common, "--tasks", "arc_easy", "--out", str(tmp_path / "ours.json"))
    theirs = _eval(
        *common, "--tasks", task, "--backend", "lm-eval", "--include-path", str(tmp_path),
        "--out", str(tmp_path / "theirs.json"),
    )  # fmt: skip
    assert theirs["adapter"] == str(run_dir / "adapter")
    _same_picks(ours, theirs, "arc_easy", task)
    _same_picks(ours["baseline"], theirs["baseline"], "arc_easy", task)
    assert theirs["examples"][task]["pick"] != theirs["baseline"]["examples"][task]["pick"]  # the adapter acts
    mine, other = ours["paired"]["sets"]["arc_easy"], theirs["paired"]["sets"][task]
    for key in ("acc", "acc_se", "acc_norm", "acc_norm_se"):
        assert other[key] == pytest.approx(mine[key], nan_ok=True), key


def _one_line(args: list[str], *expected: str) -> None:
    result = runner.invoke(app, ["eval", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and all(e in lines[0] for e in expected), result.output


def test_backend_errors_are_one_line(tmp_path, monkeypatch):
    out = ["--out", str(tmp_path / "e.json")]
    _one_line(["tiny-llama", "--backend", "lm-eval", "--tasks", "no_such_task", *out], "no_such_task", "lm-eval")
    _one_line(["tiny-llama", "--backend", "lm-eval", *out], "--tasks")
    _one_line(["tiny-llama", "--backend", "helm", "--tasks", "arc_easy", *out], "--backend", "helm")
    _one_line(["tiny-llama", "--tasks", "arc_easy", "--include-path", str(tmp_path), *out], "--include-path")
    _one_line(["tiny-llama", "--backend", "lm-eval", "--tasks", "arc_easy", "--protocol", "run", *out], "--protocol")
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # as if lm-eval were not installed
    _one_line(["tiny-llama", "--backend", "lm-eval", "--tasks", "arc_easy", *out], "not installed", "fedtune[lm-eval]")
    assert not (tmp_path / "e.json").exists()


def test_the_table_shows_lm_evals_other_metrics_with_their_errors():
    from rich.console import Console

    from fedtune.trained.table import eval_table

    rows = {
        "gsm8k": {"n": 10, "exact_match": 0.3, "exact_match_se": 0.15},
        "arc_easy": {"n": 10, "acc": 0.5, "acc_se": 0.16},
    }
    console = Console(width=200, record=True)
    console.print(
        eval_table({"target": "m", "protocol": {"name": "lm-eval:gsm8k,arc_easy"}, "sets": rows, "average": {}})
    )
    text = console.export_text()
    assert "exact_match" in text and "0.3000 ± 0.1500" in text and "50.0 ± 16.0" in text


def test_a_task_whose_data_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch):
    """Under --include-path: a malformed task YAML is named (lm-eval's index skipped it without a
    word, and the task then "did not exist"); a task YAML whose data file is missing, and a task
    whose hub data set is not available offline (HF_HUB_OFFLINE=1), are one line saying what to do
    (before: "unexpected FileNotFoundError" / "ConnectionError", a fedtune bug). lm-eval's own task
    index is left out here (seconds to build on a shared machine): the custom tasks are enough."""
    import functools

    import lm_eval.tasks

    monkeypatch.setattr(
        lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
    )
    arc = Path(lm_eval.tasks.__file__).parent / "arc" / "arc_easy.yaml"
    out = ["--out", str(tmp_path / "e.json"), "--limit", "2"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.yaml").write_text("task: broken\ndataset_path: [json\n")
    _one_line(
        ["tiny-llama", "--backend", "lm-eval", "--tasks", "broken", "--include-path", str(bad), *out], "broken.yaml"
    )
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "local.yaml").write_text(
        f"include: {arc}\ntask: arc_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'absent.jsonl'}\ntraining_split: null\n"
        "validation_split: null\ntest_split: test\n"
    )
    args = ["tiny-llama", "--backend", "lm-eval", "--tasks", "arc_local", "--include-path", str(missing), *out]
    _one_line(args, "data file is missing", "absent.jsonl", "data_files")
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "hub.yaml").write_text(f"include: {arc}\ntask: arc_hub\ntag: []\n")  # allenai/ai2_arc from the hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["tiny-llama", "--backend", "lm-eval", "--tasks", "arc_hub", "--include-path", str(hub), *out]
    _one_line(args, "data set is not available", "HF_HUB_OFFLINE is set", "--include-path")
    assert not (tmp_path / "e.json").exists()
