"""The files ``fedtune report`` and ``fedtune eval`` write: each written whole (a temporary file
beside it, renamed over it), and only over a file fedtune wrote before (``ours(path)``); any other
existing file, folder or link at that path is refused with one line naming it."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from fedtune.errors import FedtuneError


def check_free(path: Path, ours: Callable[[Path], bool], option: str) -> None:
    """One line when ``path`` exists and is not an earlier output of fedtune's (``ours``)."""
    if path.is_symlink() or (path.exists() and (not path.is_file() or not ours(path))):
        raise FedtuneError(
            f"{option} {str(path)!r}: exists and is not an earlier fedtune output; choose another path "
            "(fedtune replaces only files it wrote)"
        )


def write_output(path: Path, data: bytes, ours: Callable[[Path], bool], option: str) -> None:
    """``data`` as ``path`` (its folder made), after :func:`check_free`; a failed write (a read-only
    or full disk) is one line and leaves no partial file."""
    check_free(path, ours, option)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FedtuneError(f"{option} {str(path)!r}: cannot be written ({exc.strerror or exc})") from None
