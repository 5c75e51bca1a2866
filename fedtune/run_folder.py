"""A run folder is never lost: a fresh run refuses a folder that holds an earlier run, unless told
to move that run aside (``--overwrite``), which renames the folder and deletes nothing.

The files that make a folder an earlier run's are those every run writes (:data:`RUN_FILES`): any
one of them marks it (a user's file of such a name too, which a run would overwrite); an empty
folder, or one holding other files only, is free.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedtune.config import ConfigError
from fedtune.errors import FedtuneError

#: what a run writes first (config.toml, run_config.json), next (its data's label histograms) and
#: what it produces (not prompt_template.json, which an export folder holds too)
RUN_FILES = (
    "config.toml",
    "run_config.json",
    "label_histograms.json",
    "metrics.jsonl",
    "checkpoint.npz",
    "summary.json",
)


class RunFolderTaken(ConfigError):
    """A fresh run named a folder that holds an earlier run (one line: the folder and the ways out)."""


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds an earlier run's files."""
    return any((run_dir / name).exists() for name in RUN_FILES)


def check_free(run_dir: Path) -> None:
    """:class:`RunFolderTaken` when ``run_dir`` holds an earlier run."""
    if holds_run(run_dir):
        raise RunFolderTaken(
            f"run folder {str(run_dir)!r} holds an earlier run: pick another name (--set name=...), "
            f"continue it with --resume {run_dir}, or pass --overwrite to move it aside"
        )


def rename_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.old-<n>`` beside it (the first free n) and return the new path;
    nothing is deleted. One line naming it when the rename fails."""
    n = 1
    while os.path.lexists(aside := path.with_name(f"{path.name}.old-{n}")):
        n += 1
    try:
        path.rename(aside)
    except OSError as exc:
        raise ConfigError(f"--overwrite: cannot move {str(path)!r} aside ({exc.strerror})") from None
    logging.getLogger("fedtune").warning("moved the earlier %s to %s", path, aside)
    return aside


def move_aside(run_dir: Path) -> Path | None:
    """:func:`rename_aside` of ``run_dir`` when it holds an earlier run; None when there was nothing
    to move."""
    return rename_aside(run_dir) if holds_run(run_dir) else None


def run_folder_around(path: Path) -> Path | None:
    """The run folder ``path`` is, or lies inside (its nearest ancestor holding a run), else None."""
    path = path.resolve()
    return next((p for p in (path, *path.parents) if holds_run(p)), None)


class RunWriteError(FedtuneError):
    """A run folder write failed (a full disk, a read-only folder): one line naming the file; the
    rounds checkpointed before it are kept."""

    exit_code = 1


@contextmanager
def writing(path: Path, after: str = "") -> Iterator[None]:
    """Turn an OSError inside the block into :class:`RunWriteError` naming ``path`` (``after``: what
    the line adds, such as what was kept and how to continue)."""
    try:
        yield
    except OSError as exc:
        raise RunWriteError(f"cannot write {str(path)!r} ({exc.strerror or exc}){after}") from None


def write_text(path: Path, text: str) -> None:
    """``path``'s new content, or :class:`RunWriteError` naming it."""
    with writing(path):
        path.write_text(text)


def create(run_dir: Path, files: dict[str, str]) -> None:
    """Make ``run_dir`` (and its parents: a bad ``output_dir`` is a :class:`ConfigError`) and write
    its first ``files`` (name -> text)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"output_dir {str(run_dir.parent)!r}: cannot create the run folder ({exc.strerror or exc})"
        ) from None
    for name, text in files.items():
        write_text(run_dir / name, text)
