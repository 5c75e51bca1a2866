"""What every ``fedtune`` command shares: the app (an unexpected error is one redacted line and
the last frames), the console and the one-line failure."""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager

import typer
from rich.console import Console

HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{30,}")  # a token: 34 letters and digits (not hf_transfer)
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)


#: values of secret-named variables that are switches, not secrets (``USE_AUTH_TOKEN=true``)
SWITCHES = {"true", "false", "yes", "no", "on", "off", "none", "null"}


def redact(text: str) -> str:
    """``text`` with Hugging Face tokens (``hf_...``) and the values of secret-named environment
    variables (``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*KEY*``) replaced by ``[redacted]``: a
    value of 6 characters or more wherever it occurs, a shorter one of 3 or more (``k3y55``) where it
    stands alone (not inside a longer word or number: a short value is found inside unrelated text),
    but a switch (:data:`SWITCHES`). Values of 1-2 characters are not secrets anyone could keep."""
    for name, value in sorted(os.environ.items(), key=lambda item: -len(item[1])):  # longest first
        if not SECRET_NAME.search(name) or len(value) < 3 or value.lower() in SWITCHES:
            continue
        if len(value) >= 6:
            text = text.replace(value, "[redacted]")
        else:
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", "[redacted]", text)
    return HF_TOKEN.sub("[redacted]", text)


class _App(typer.Typer):
    """The command line: an unexpected error (a bug: anything but a :class:`FedtuneError`, which a
    command turns into its one line) prints one line and the last frames of its traceback, never
    local variables, with secrets redacted (:func:`redact`), and exits 1."""

    def __call__(self, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the last stop before the user's terminal
            first = (str(exc).strip().splitlines() or [""])[0]
            import click

            internal = (os.path.dirname(typer.__file__), os.path.dirname(click.__file__))
            stack = [f for f in traceback.extract_tb(exc.__traceback__.tb_next) if not f.filename.startswith(internal)]
            frames = "".join(traceback.StackSummary.from_list(stack[-6:]).format())
            text = f"error: unexpected {type(exc).__name__}: {first} (a fedtune bug; its last frames:)\n{frames}"
            sys.stderr.write(redact(text))
            sys.exit(1)


app = _App(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    help="Resource-adaptive federated fine-tuning.",
)
console = Console(stderr=True)


@app.callback()
def _options(
    verbose: bool = typer.Option(
        False, "--verbose", help="also the libraries' warnings, log lines and progress bars (fedtune --verbose run ...)"
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="no progress display (bars, spinners, progress lines); results still print"
    ),
) -> None:
    if verbose:
        from fedtune.process import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    if quiet:
        from fedtune.progress import QUIET_ENV

        os.environ[QUIET_ENV] = "1"


def steps_shown(before_live: Callable[[], None] = lambda: None) -> AbstractContextManager[None]:
    """Show the long steps of :mod:`fedtune.steps` on the console (bars on a terminal, plain lines
    elsewhere, nothing with ``--quiet``: :class:`fedtune.progress.StepDisplay`) while the context lasts."""
    from fedtune.progress import StepDisplay, quiet
    from fedtune.steps import showing

    return showing(None if quiet() else StepDisplay(console, before_live))


def fail(message: str, code: int = 2) -> None:
    console.print("[bold red]error:[/]", end=" ")
    console.print(redact(message), markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)
