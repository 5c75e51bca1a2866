"""The ``fedtune`` command line: run, methods, tasks, report, plan, export, eval; deploy
(:mod:`fedtune.cli.deploy`); new (:mod:`fedtune.cli.new`); what they share in :mod:`fedtune.cli.common`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from fedtune.cli.common import app, console, fail, redact, steps_shown
from fedtune.cli.deploy import deploy_app
from fedtune.cli.new import new_app
from fedtune.errors import FedtuneError

if TYPE_CHECKING:
    from fedtune.runtime import ResolvedRun

__all__ = ["app", "console", "main", "redact"]


@app.command()
def run(
    recipe: Path | None = typer.Argument(None, help="TOML recipe (see configs/)"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override: key=value (dotted keys, e.g. data.alpha=0.1)"),
    resume: Path | None = typer.Option(
        None, "--resume", help="continue this run folder from its last checkpointed round (its config.toml, plus --set)"
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="when the run folder holds an earlier run, move it aside to <name>.old-<n> first"
    ),
) -> None:
    """Run one federated fine-tuning experiment and write runs/<name>/ (Ctrl-C: stop after the
    current round's checkpoint; --resume continues it). --set engine=embedded (default, in this
    process), flower-sim (Flower's Ray simulation) or flower (a loopback Flower deployment:
    SuperLink, SuperNodes and workers on 127.0.0.1, stopped at the end)."""
    from fedtune.config import ConfigError, load_config
    from fedtune.engines.rounds import RunInterrupted
    from fedtune.process import setup_process

    setup_process()
    run: ResolvedRun | None = None
    try:
        if resume is not None:
            if recipe is not None:
                raise ConfigError("--resume: give a run folder or a recipe, not both")
            if not (resume / "config.toml").is_file():
                raise ConfigError(f"--resume {str(resume)!r}: not a run folder (no config.toml)")
            set_ = [f"output_dir={resume.parent}", f"name={resume.name}", *set_]
            recipe = resume / "config.toml"
            if overwrite:
                raise ConfigError("--overwrite: a fresh run's option, not one for --resume")
        config = load_config(recipe, set_, run_folder=resume is not None)
        from fedtune.progress import RoundPrinter

        printer = RoundPrinter(console, config)
        from fedtune.launch import launch
        from fedtune.runtime import resolve_run

        printer.begin()
        try:
            with steps_shown(before_live=lambda: printer.working(None)):
                run = resolve_run(config)  # this process's one resolution: launch and the engine take it
                summary = launch(
                    run, on_round=printer, on_start=printer.start, resume=resume is not None, overwrite=overwrite
                )
        finally:
            printer.working(None)
    except FedtuneError as exc:
        fail(_run_failure(exc, run), code=exc.exit_code)
    except RunInterrupted as exc:  # raised by a launched run: `run` is resolved
        fail(f"{exc}; continue with: fedtune run --resume {run and run.run_dir}", code=130)
    printer.finish(summary)
    if summary.get("stopped"):
        console.print(summary["stopped"], markup=False, highlight=False, soft_wrap=True)


def _run_failure(exc: FedtuneError, run: ResolvedRun | None) -> str:
    """The one line for a run that stopped on ``exc`` (``run``: None when it stopped resolving): a
    failed round says whether there is a checkpoint to resume from; a deployment failure names the
    engine."""
    from fedtune.engines.rounds import RoundFailed
    from fedtune.process import DeploymentError

    if isinstance(exc, RoundFailed) and run is not None:
        run_dir = run.run_dir
        if (run_dir / "checkpoint.npz").is_file():
            return f"{exc}; the last complete round is checkpointed: fedtune run --resume {run_dir}"
        return f"{exc}; no round completed, so there is nothing to resume"
    if isinstance(exc, DeploymentError) and run is not None:
        return f"engine {run.config.engine}: {exc}"
    return str(exc)


@app.command()
def methods(
    verbose: bool = typer.Option(
        False,
        "--verbose",
        "-v",
        help="also each method's task kinds, options, and the settings that depart from its paper",
    ),
) -> None:
    """List the registered methods: fedtune's own, then those installed packages declare (entry
    point group fedtune.methods); -v imports them all and names each one's source."""
    from fedtune import catalog
    from fedtune.plugins import METHODS, declared, source

    pad = " " * 15
    if not verbose:  # without importing the methods (torch)
        for method, description in catalog.read()["methods"]:
            typer.echo(f"{method:<14} {description}")
        for ep in declared(METHODS):
            typer.echo(f"{ep.name:<14} (from {source(ep)})")
        return
    from fedtune.methods import list_methods

    try:
        specs = list_methods(plugins=True)
    except FedtuneError as exc:
        fail(str(exc), code=exc.exit_code)
    for spec in specs:
        typer.echo(f"{spec.name:<14} {spec.description}")
        own = spec.module.startswith("fedtune.")
        typer.echo(f"{pad}source: {'fedtune' if own else spec.module + ' (your package)'}")
        typer.echo(f"{pad}tasks: {', '.join(spec.supported_tasks())}")
        for name, field in spec.options.model_fields.items():
            about = f"  ({field.description})" if field.description else ""
            typer.echo(f"{pad}options.{name} = {field.default!r}{about}")
        for key, text in spec.options.deviations.items():
            typer.echo(f"{pad}deviation: {key}: {text}")


@app.command()
def tasks() -> None:
    """List the task kinds (``task.kind``) with their default data set and model."""
    from fedtune import catalog
    from fedtune.plugins import TASKS, declared, source

    for kind, description, defaults in catalog.read()["tasks"]:  # without importing the tasks (torch)
        shown = ", ".join(f"{k} {v}" for k, v in defaults.items())
        typer.echo(f"{kind:<22} {description} [{shown}]")
    for ep in declared(TASKS):  # a package's own (entry point group fedtune.tasks)
        typer.echo(f"{ep.name:<22} (from {source(ep)})")


@app.command()
def combiners() -> None:
    """List the combiners (``robust.aggregation``): fedtune's own, then those installed packages
    declare (entry point group fedtune.combiners), each with its source."""
    from fedtune.methods.base.robust import list_combiners

    try:
        specs = list_combiners(plugins=True)
    except FedtuneError as exc:
        fail(str(exc), code=exc.exit_code)
    for spec in specs:
        own = spec.module.startswith("fedtune.")
        typer.echo(f"{spec.name:<14} {spec.description} (source: {'fedtune' if own else spec.module})")


@app.command()
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run folders (runs/<name>)"),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="folder for report.md and plots (replaces only an earlier report's files)"
    ),
) -> None:
    """Markdown table of final metrics and PNG plots (accuracy vs round, vs MB uploaded)."""
    from fedtune.report import make_report

    try:
        markdown, paths = make_report(list(run_dirs), out)
    except FedtuneError as exc:
        fail(str(exc), code=exc.exit_code)
    typer.echo(markdown)
    for path in paths:
        console.print(f"wrote {path}")


@app.command()
def plan(
    recipe: Path = typer.Argument(..., help="TOML recipe (see configs/)"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override: key=value (dotted keys)"),
    calibrate_speed: bool = typer.Option(
        False, "--calibrate-speed", help="time this CPU's speed of the base's format against float32 first (seconds)"
    ),
) -> None:
    """Print each client's planned setting (rank, sketch ratio) under its budget, with its predicted
    peak memory, seconds and MB per round; excluded clients with the reason. Nothing trains."""
    from fedtune.config import load_config
    from fedtune.planning import speed
    from fedtune.planning.memory import Shape
    from fedtune.planning.planner import format_plan, plan_budgets
    from fedtune.process import setup_process
    from fedtune.runtime import RunContext, resolve_run

    setup_process()  # the libraries quiet (FedPFT / FedOT load the base: its "Loading weights" bar)
    try:
        with steps_shown():
            context = RunContext(resolve_run(load_config(recipe, set_)))
        ratios = {}
        if calibrate_speed:
            model = context.config.model
            ratios = speed.calibrate(Shape.of(context.skeleton), model.dtype, model.quantization)
        with speed.calibrated(ratios), steps_shown():
            plan = plan_budgets(context, always=True)
            if plan is None:  # always=True: a plan, whether or not a client states a budget
                raise RuntimeError("plan_budgets(always=True) gave no plan")
            text = format_plan(plan)
    except FedtuneError as exc:
        fail(str(exc), code=exc.exit_code)
    typer.echo(text)


@app.command()
def export(
    run_dir: Path = typer.Argument(..., help="run folder (runs/<name>) with an adapter/"),
    merged: bool = typer.Option(False, "--merged", help="the base with the adapter merged in (for serving)"),
    out: Path | None = typer.Option(None, "--out", "-o", help="folder to write (default: RUN_DIR/export[-merged])"),
    push_to_hub: str | None = typer.Option(
        None, "--push-to-hub", help="also upload the folder to this hub repository (needs a token)"
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="when the folder is not empty, move it aside to <name>.old-<n> first"
    ),
) -> None:
    """Write a run's adapter (or the base with it merged in) and tokenizer to a folder that
    transformers / PEFT load anywhere; the adapter names its base by hub id. Never deletes or
    overwrites: a non-empty folder is refused (--overwrite moves it aside), and so is a folder
    inside a run folder other than the default."""
    from fedtune.process import setup_process
    from fedtune.trained.export import default_folder, export_run, hub_token
    from fedtune.trained.export import push_to_hub as push
    from fedtune.trained.loader import open_run

    setup_process()
    try:
        run = open_run(run_dir)
        base = None if merged else run.adapter_config.get("base_model_name_or_path")
        token = None if push_to_hub is None else hub_token(push_to_hub, base)
        folder = out or default_folder(run_dir, merged)
        with steps_shown():
            notes = export_run(run, folder, merged, overwrite)
        for note in notes:
            console.print(note, markup=False, highlight=False, soft_wrap=True)
        console.print(f"wrote {folder}")
        if push_to_hub is not None and token is not None:  # hub_token gave one (or raised)
            console.print(f"pushed to {push(folder, push_to_hub, token)}")
    except FedtuneError as exc:
        fail(str(exc), code=exc.exit_code)


@app.command("eval")
def eval_(
    target: str = typer.Argument(..., help="run folder (its adapter on its base), or a model name / hub id / folder"),
    tasks: str | None = typer.Option(
        None,
        "--tasks",
        help="sets, comma-separated: arc_challenge, arc_easy, boolq, csqa, hellaswag, openbookqa, piqa, "
        "socialiqa, winogrande, mmlu (by subject group; needs DATA_DIR/mmlu/test.jsonl), dolly, or a local "
        ".jsonl/.csv file of question, choices, gold rows (default for a run: its own test set)",
    ),
    protocol: str | None = typer.Option(
        None,
        "--protocol",
        help="lm-eval (lm-eval's task formats; the default for --tasks) or run (the run's own evaluation; "
        "the default for a run's own test set)",
    ),
    num_fewshot: int | None = typer.Option(
        None,
        "--num-fewshot",
        min=0,
        max=25,
        help="solved examples before each question (default 0; --backend lm-eval: each task's default)",
    ),
    backend: str = typer.Option(
        "fedtune",
        "--backend",
        help="fedtune (its own scoring) or lm-eval (lm-evaluation-harness scores any of its tasks on the "
        "model, a run's adapter included; the lm-eval extra)",
    ),
    include_path: Path | None = typer.Option(
        None, "--include-path", help="--backend lm-eval: a folder of custom lm-eval task YAMLs"
    ),
    baseline: bool = typer.Option(
        False, "--baseline", help="a run: also score its base on the same protocol, and the paired difference"
    ),
    limit: int | None = typer.Option(None, "--limit", min=1, help="the first N examples of each set"),
    batch_size: int | None = typer.Option(
        None, "--batch-size", min=1, help="rows per forward pass (default: the run's)"
    ),
    generate: bool = typer.Option(False, "--generate", help="commonsense: also greedy generation's accuracy (gen_acc)"),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="result file (default: RUN_DIR/eval.json, else ./eval.json); replaces only an earlier result",
    ),
) -> None:
    """Score a run's adapter, or a bare model (the untuned row), on commonsense sets (log-likelihood
    acc / acc_norm) and Dolly (ROUGE-L, response loss), with the runs' own evaluation code, under
    one protocol for both; eval.json records it."""
    import json
    import warnings

    from fedtune.config import ConfigError
    from fedtune.output_files import check_free, write_output
    from fedtune.process import setup_process
    from fedtune.trained.evaluate import evaluate, is_eval_result, parse_sets, target_of
    from fedtune.trained.lm_eval_backend import BACKENDS, check_backend_options, evaluate_lm_eval
    from fedtune.trained.table import eval_table, paired_table

    setup_process()
    try:
        if backend not in BACKENDS:
            raise ConfigError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        lm_eval = backend == "lm-eval"
        check_backend_options(lm_eval, tasks, protocol, generate, include_path)
        sets = [t.strip() for t in (tasks or "").split(",") if t.strip()] if lm_eval else parse_sets(tasks)
        scored = target_of(target)
        path = out or (scored.run_dir / "eval.json" if scored.run_dir is not None else Path("eval.json"))
        check_free(path, is_eval_result, "--out")  # before the evaluation, which takes a while
        with steps_shown(), warnings.catch_warnings():  # loading, tokenizing, scoring: questions, rate, ETA
            warnings.simplefilter("ignore", UserWarning)  # the result's warnings are printed below
            if lm_eval:
                folder = None if include_path is None else str(include_path)
                result = evaluate_lm_eval(scored, sets, limit, batch_size, num_fewshot, baseline, folder)
            else:
                result = evaluate(scored, sets, limit, batch_size, generate, None, protocol, num_fewshot or 0, baseline)
        write_output(path, json.dumps(result, indent=1).encode(), is_eval_result, "--out")
    except FedtuneError as exc:
        fail(str(exc), code=exc.exit_code)
    for note in result["warnings"]:
        console.print(f"warning: {note}", markup=False, highlight=False, soft_wrap=True)
    Console().print(eval_table(result))
    if baseline:
        Console().print(eval_table({**result["baseline"], "protocol": result["protocol"]}))
        Console().print(paired_table(result))
    console.print(f"wrote {path} (protocol {result['protocol']['name']})")


app.add_typer(deploy_app, name="deploy")
app.add_typer(new_app, name="new")


def main() -> None:  # pragma: no cover
    sys.exit(app())
