"""The ``fedtune`` command line: run, methods, tasks, report."""

from __future__ import annotations

import sys
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
    from fedtune.process import setup_process

    setup_process()
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
def methods(verbose: bool = typer.Option(False, "--verbose", "-v", help="also the task kinds each runs on")) -> None:
    """List the registered methods."""
    from fedtune.registry import list_methods

    for spec in list_methods():
        typer.echo(f"{spec.name:<14} {spec.description}")
        if verbose:
            typer.echo(f"{'':<14} tasks: {', '.join(spec.supported_tasks())}")


@app.command()
def tasks() -> None:
    """List the task kinds (``task.kind``) with their default data set and model."""
    from fedtune.tasks import list_tasks

    for task in list_tasks():
        defaults = ", ".join(f"{k} {v}" for k, v in task.defaults.items())
        typer.echo(f"{task.kind:<22} {task.description} [{defaults}]")


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
