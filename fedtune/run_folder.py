"""A run folder is never lost: a fresh run refuses a folder that holds an earlier run, unless told
to move that run aside (``--overwrite``), which renames the folder and deletes nothing.

The files that make a folder an earlier run's are those every run writes (:data:`RUN_FILES`): any
one of them marks it (a user's file of such a name too, which a run would overwrite); an empty
folder, or one holding other files only, is free.

A folder in use is locked (:func:`locked`): an advisory lock (``flock``) on the file
:data:`LOCK_FILE` inside it, which holds the owner's PID. A second process that would write the
folder (a fresh run with ``--overwrite``, a ``--resume``) is refused in one line naming that PID
(:class:`RunFolderInUse`); the kernel drops the lock of a process that dies, so a stale lock file
(a killed run's) is taken over. A process whose ancestor holds the lock (a Flower deployment's
ServerApp, started by the ``fedtune run`` that locked the folder) or that holds it itself works
under that lock.
"""

from __future__ import annotations

import fcntl
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
    """:class:`RunFolderTaken` when ``run_dir`` holds an earlier run (one that completed no round
    cannot be resumed: the line says so)."""
    if not holds_run(run_dir):
        return
    if not (run_dir / "checkpoint.npz").exists():
        raise RunFolderTaken(
            f"run folder {str(run_dir)!r} holds an earlier run that completed no round (no checkpoint.npz), so "
            "there is nothing to resume: pass --overwrite to move it aside, or pick another name (--set name=...)"
        )
    raise RunFolderTaken(
        f"run folder {str(run_dir)!r} holds an earlier run: pick another name (--set name=...), "
        f"continue it with --resume {run_dir}, or pass --overwrite to move it aside"
    )


#: the lock file inside a run folder in use (:func:`locked`)
LOCK_FILE = ".fedtune.lock"


class RunFolderInUse(ConfigError):
    """Another live process holds the run folder's lock (one line naming its PID)."""


def _lock_owner(fd: int) -> int | None:
    """The PID the lock file open as ``fd`` holds, or None when it holds none."""
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None


def _ours(pid: int | None) -> bool:
    """Whether ``pid`` is this process or one of its ancestors (it holds the lock for us)."""
    import psutil

    try:
        return pid is not None and pid in {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    except psutil.Error:
        return pid == os.getpid()


def _in_use(run_dir: Path, pid: int | None) -> RunFolderInUse:
    owner = f"process {pid}" if pid is not None else "another process"
    return RunFolderInUse(
        f"run folder {str(run_dir)!r} is in use by {owner} (its lock {LOCK_FILE}): wait for it to end, or "
        "pick another name (--set name=...)"
    )


def check_unlocked(run_dir: Path) -> None:
    """:class:`RunFolderInUse` when another live process (not this one nor an ancestor) holds
    ``run_dir``'s lock; creates nothing (asked before any input is read, to refuse early)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return  # no lock file (or none readable): nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with an owner's exclusive lock only
    except BlockingIOError:
        pid = _lock_owner(fd)
        if not _ours(pid):
            raise _in_use(run_dir, pid) from None
    finally:
        os.close(fd)


def _made_folders(run_dir: Path) -> list[Path]:
    """Make ``run_dir`` and its missing parents; the ones made here, deepest first (ConfigError
    naming ``output_dir`` when it cannot be made)."""
    missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"output_dir {str(run_dir.parent)!r}: cannot create the run folder ({exc.strerror or exc})"
        ) from None
    return missing


@contextmanager
def locked(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the block (see the module docstring), making the folder when
    needed; at the end the lock file goes, and so do the folders made here if they are still
    empty (a refused run leaves nothing). Held by this process or an ancestor: the block runs under
    that lock. :class:`RunFolderInUse` when another live process holds it."""
    made = _made_folders(run_dir)
    path = run_dir / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"run folder {str(run_dir)!r}: cannot lock it ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _lock_owner(fd)
            os.close(fd)
            if not _ours(pid):
                raise _in_use(run_dir, pid) from None
            yield  # an ancestor's (or this process's own) lock covers the block
            return
        try:  # the file may have been unlinked by its last owner between our open and flock
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)  # before the unlock: a process that opened it meanwhile sees it gone
        except OSError:
            pass  # moved away with its folder (--overwrite) or already gone
        os.close(fd)  # releases the lock
        for folder in made:
            try:
                folder.rmdir()  # only when still empty
            except OSError:
                break


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


@contextmanager
def claimed(run_dir: Path, resume: bool, overwrite: bool) -> Iterator[None]:
    """``run_dir`` locked for the block (:func:`locked`); for a fresh run, free
    (:func:`check_free`) or, with ``overwrite``, its earlier run first moved aside under its lock."""
    if not resume and overwrite and holds_run(run_dir):
        with locked(run_dir):  # nobody writes it while it moves
            aside = rename_aside(run_dir)
        (aside / LOCK_FILE).unlink(missing_ok=True)  # this process's own, moved with it
    with locked(run_dir):
        if not resume:
            check_free(run_dir)
        yield


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
    _made_folders(run_dir)
    for name, text in files.items():
        write_text(run_dir / name, text)
