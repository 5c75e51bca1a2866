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
    resume: Optional[Path] = typer.Option(
        None, "--resume", help="continue this run folder from its last checkpointed round (its config.toml, plus --set)"
    ),
) -> None:
    """Run one federated fine-tuning experiment and write runs/<name>/ (Ctrl-C: stop after the
    current round's checkpoint; --resume continues it)."""
    from fedtune.config import ConfigError, load_config
    from fedtune.engines.rounds import RoundFailed, RunInterrupted
    from fedtune.process import setup_process

    setup_process()
    try:
        if resume is not None:
            if recipe is not None:
                raise ConfigError("--resume: give a run folder or a recipe, not both")
            if not (resume / "config.toml").is_file():
                raise ConfigError(f"--resume {str(resume)!r}: not a run folder (no config.toml)")
            set_ = [f"output_dir={resume.parent}", f"name={resume.name}", *set_]
            recipe = resume / "config.toml"
        config = load_config(recipe, set_)
        from fedtune.progress import RoundPrinter
        from fedtune.run import run_dir_of, run_experiment

        printer = RoundPrinter(console, config)
        summary = run_experiment(config, on_round=printer, on_start=printer.start, resume=resume is not None)
    except ConfigError as exc:
        _fail(str(exc))
    except RoundFailed as exc:
        _fail(f"{exc}; the last complete round is checkpointed: fedtune run --resume {run_dir_of(config)}", code=1)
    except RunInterrupted as exc:
        _fail(f"{exc}; continue with: fedtune run --resume {run_dir_of(config)}", code=130)
    printer.finish(summary)


@app.command()
def methods(
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="also each method's task kinds, options, and the settings that depart from its paper"
    ),
) -> None:
    """List the registered methods."""
    from fedtune.registry import list_methods

    pad = " " * 15
    for spec in list_methods():
        typer.echo(f"{spec.name:<14} {spec.description}")
        if not verbose:
            continue
        typer.echo(f"{pad}tasks: {', '.join(spec.supported_tasks())}")
        for name, field in spec.options.model_fields.items():
            about = f"  ({field.description})" if field.description else ""
            typer.echo(f"{pad}options.{name} = {field.default!r}{about}")
        for key, text in getattr(spec.options, "deviations", {}).items():
            typer.echo(f"{pad}deviation: {key}: {text}")


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
