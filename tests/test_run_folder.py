"""The run folder rule (fedtune.run_folder): any one file a run writes marks a folder as an earlier
run's (a fresh run refuses it, --overwrite moves it aside), and moving aside takes the first free
``<name>.old-<n>``, never replacing an earlier one."""

from __future__ import annotations

import pytest

from fedtune.run_folder import RUN_FILES, RunFolderTaken, check_free, move_aside, run_folder_around


@pytest.mark.parametrize("name", RUN_FILES)
def test_any_one_run_file_marks_an_earlier_run(tmp_path, name):
    """Each file alone (a run cut short after writing it, or a user's file of that name) makes the
    folder taken, and the folders inside it lie in a run folder; other files alone do not."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    check_free(folder)
    assert move_aside(folder) is None and run_folder_around(folder / "sub") is None
    (folder / name).write_text("x")
    with pytest.raises(RunFolderTaken, match="holds an earlier run"):
        check_free(folder)
    assert run_folder_around(folder / "sub" / "deeper") == folder.resolve()


def test_moving_aside_takes_the_first_free_number_and_keeps_every_earlier_one(tmp_path):
    """Three runs under one name: .old-1 and .old-2 hold the first two, unchanged; a dangling link
    named .old-3 is skipped, not replaced."""
    folder = tmp_path / "run"
    (tmp_path / "run.old-3").symlink_to(tmp_path / "nowhere")
    for n in (1, 2, 4):
        folder.mkdir()
        (folder / "config.toml").write_text(f"run {n}")
        assert move_aside(folder) == tmp_path / f"run.old-{n}"
    assert [(tmp_path / f"run.old-{n}" / "config.toml").read_text() for n in (1, 2, 4)] == ["run 1", "run 2", "run 4"]
    assert (tmp_path / "run.old-3").is_symlink() and not folder.exists()
