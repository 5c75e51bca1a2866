"""The ``fedtune`` command line: run, methods, report."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Resource-adaptive federated fine-tuning.")
console = Console(stderr=True)


def _fail(message: str, code: int = 2) -> None:
    console.print("[bold red]error:[/]", end=" ")
    console.print(message, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def run(
    recipe: Optional[Path] = typer.Argument(None, help="TOML recipe (see configs/)"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override: key=value (dotted keys, e.g. data.alpha=0.1)"),
) -> None:
    """Run one federated fine-tuning experiment and write runs/<name>/."""
    from fedtune.config import ConfigError, load_config

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        config = load_config(recipe, set_)
        from fedtune.progress import RoundPrinter
        from fedtune.run import run_experiment

        printer = RoundPrinter(console, config)
        summary = run_experiment(config, on_round=printer, on_start=printer.start)
    except ConfigError as exc:
        _fail(str(exc))
    printer.finish(summary)


@app.command()
def methods() -> None:
    """List the registered methods."""
    from fedtune.registry import list_methods

    for spec in list_methods():
        typer.echo(f"{spec.name:<14} {spec.description}")


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run folders (runs/<name>)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="folder for report.md and plots"),
) -> None:
    """Markdown table of final metrics and PNG plots (accuracy vs round, vs MB uploaded)."""
    from fedtune.report import ReportError, make_report

    try:
        markdown, paths = make_report(list(run_dirs), out)
    except ReportError as exc:
        _fail(str(exc))
    typer.echo(markdown)
    for path in paths:
        console.print(f"wrote {path}")


def main() -> None:  # pragma: no cover
    sys.exit(app())
