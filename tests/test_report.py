"""Tests for fedtune.report: loading run folders, the markdown table, plots, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedtune.report import ReportError, cumulative_mb_up, load_run, make_report, markdown_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, name: str, final_accuracy: float | None = 0.8125, **extra) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    rounds = [
        {"round": 1, "accuracy": None, "loss": None, "bytes_up": 1_000_000, "bytes_down": 2_000_000, "wall_s": 1.0},
        {
            "round": 2,
            "accuracy": 0.75,
            "loss": 0.6,
            "bytes_up": 500_000,
            "bytes_down": 2_000_000,
            "wall_s": 1.0,
            "client_bytes_up": {"0": 250_000, "1": 250_000},
        },
        {
            "round": 3,
            "accuracy": final_accuracy,
            "loss": 0.5,
            "bytes_up": 734_567,
            "bytes_down": 2_000_000,
            "wall_s": 1.0,
        },
    ]
    summary = {
        "name": name,
        "method": "fedit",
        "data": "sst2",
        "rounds": 3,
        "final_accuracy": final_accuracy,
        "majority_accuracy": 0.5,
        "final_loss": 0.5,
        "total_bytes_up": sum(r["bytes_up"] for r in rounds),
        "total_bytes_down": sum(r["bytes_down"] for r in rounds),
        "wall_s": 3.5,
        **extra,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return run_dir


def table_rows(markdown: str) -> list[list[str]]:
    lines = markdown.strip().splitlines()[2:]  # skip header and separator
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_table_one_row_per_run_with_formatted_numbers(tmp_path):
    runs = [load_run(make_run(tmp_path, "a")), load_run(make_run(tmp_path, "b", final_accuracy=None))]
    rows = table_rows(markdown_table(runs))
    assert len(rows) == 2
    a, b = rows
    assert a == ["a", "fedit", "sst2", "3", "81.25", "81.25", "50.00", "0.5000", "2.235", "6.000", "3.5"]
    assert b[0] == "b" and b[4] == "–"  # null final accuracy
    assert b[5] == "75.00"  # best accuracy falls back to the best evaluated round


def test_table_prefers_summary_best_accuracy(tmp_path):
    run = load_run(make_run(tmp_path, "a", best_accuracy=0.9))
    assert table_rows(markdown_table([run]))[0][5] == "90.00"


def test_cumulative_mb_up(tmp_path):
    run = load_run(make_run(tmp_path, "a"))
    assert cumulative_mb_up(run.rounds) == pytest.approx([1.0, 1.5, 2.234567])
    assert cumulative_mb_up([]) == []


def test_make_report_writes_markdown_and_pngs(tmp_path):
    dirs = [make_run(tmp_path / "runs", "a"), make_run(tmp_path / "runs", "b", final_accuracy=0.7)]
    markdown, paths = make_report(dirs)
    names = {p.name for p in paths}
    assert names == {"report.md", "accuracy_vs_round.png", "accuracy_vs_mb_up.png"}
    assert all(p.parent == tmp_path / "runs" for p in paths)
    assert (tmp_path / "runs" / "report.md").read_text() == markdown
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC


def test_make_report_custom_out_dir(tmp_path):
    _, paths = make_report([make_run(tmp_path, "a")], tmp_path / "out")
    assert all(p.parent == tmp_path / "out" and p.exists() for p in paths)


def test_missing_summary_names_path(tmp_path):
    run_dir = make_run(tmp_path, "a")
    (run_dir / "summary.json").unlink()
    with pytest.raises(ReportError, match="file not found") as info:
        load_run(run_dir)
    assert str(run_dir / "summary.json") in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_folder(tmp_path):
    with pytest.raises(ReportError, match="nope"):
        load_run(tmp_path / "nope")


def test_bad_metrics_line_names_line_number(tmp_path):
    run_dir = make_run(tmp_path, "a")
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = "{not json"
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError) as info:
        load_run(run_dir)
    message = str(info.value)
    assert str(metrics) in message and "line 2" in message and "\n" not in message


def test_report_replaces_only_its_own_files_and_names_a_bad_out_in_one_line(tmp_path, monkeypatch):
    """-o naming a file, or a folder holding a user's report.md or plot of the same name: one line,
    nothing written or changed; an earlier report's files are replaced; a read-only folder is one
    line and leaves no partial file."""
    import errno

    from typer.testing import CliRunner

    from fedtune.cli import app

    run = str(make_run(tmp_path / "runs", "a"))

    def one_line(out, *expected):
        result = CliRunner().invoke(app, ["report", run, "-o", str(out)])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, result.output
        assert all(text in lines[0] for text in expected), lines[0]

    (tmp_path / "file").write_text("mine")
    one_line(tmp_path / "file", "exists and is not a folder")
    for name in ("report.md", "accuracy_vs_round.png", "accuracy_vs_mb_up.png"):
        user = tmp_path / name.split(".")[0]
        user.mkdir()
        (user / name).write_bytes(b"| my own table |\n")
        one_line(user, str(user / name), "not an earlier fedtune output")
        assert [p.name for p in user.iterdir()] == [name] and (user / name).read_bytes() == b"| my own table |\n"
    out = tmp_path / "out"
    for _ in range(2):  # the second replaces the first's files
        assert CliRunner().invoke(app, ["report", run, "-o", str(out)]).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["accuracy_vs_mb_up.png", "accuracy_vs_round.png", "report.md"]

    def read_only(self, data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "write_bytes", read_only)
    one_line(tmp_path / "ro", "Read-only file system")
    assert list((tmp_path / "ro").iterdir()) == []
