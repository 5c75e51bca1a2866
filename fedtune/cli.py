"""The ``fedtune`` command line: run, methods, tasks, report, export, eval, deploy."""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path

import typer
from rich.console import Console

from fedtune.errors import FedtuneError

HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{30,}")  # a token: 34 letters and digits (not hf_transfer)
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with Hugging Face tokens (``hf_...``) and the values of secret-named environment
    variables (``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*KEY*``) replaced by ``[redacted]``."""
    for name, value in os.environ.items():
        if len(value) >= 6 and SECRET_NAME.search(name):
            text = text.replace(value, "[redacted]")
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
) -> None:
    if verbose:
        import os

        from fedtune.process import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"


def _fail(message: str, code: int = 2) -> None:
    console.print("[bold red]error:[/]", end=" ")
    console.print(redact(message), markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


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
    config = None
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
        config = load_config(recipe, set_)
        from fedtune.progress import RoundPrinter

        printer = RoundPrinter(console, config)
        from fedtune.launch import launch

        printer.begin()
        try:
            summary = launch(
                config, on_round=printer, on_start=printer.start, resume=resume is not None, overwrite=overwrite
            )
        finally:
            printer.working(None)
    except FedtuneError as exc:
        _fail(_run_failure(exc, config), code=exc.exit_code)
    except RunInterrupted as exc:
        _fail(f"{exc}; continue with: fedtune run --resume {_run_dir(config)}", code=130)
    printer.finish(summary)
    if summary.get("stopped"):
        console.print(summary["stopped"], markup=False, highlight=False, soft_wrap=True)


def _run_dir(config) -> Path:
    from fedtune.runtime import resolve_run

    return resolve_run(config).run_dir


def _run_failure(exc: FedtuneError, config) -> str:
    """The one line for a run that stopped on ``exc``: a failed round says whether there is a
    checkpoint to resume from; a deployment failure names the engine."""
    from fedtune.engines.rounds import RoundFailed
    from fedtune.process import DeploymentError

    if isinstance(exc, RoundFailed):
        run_dir = _run_dir(config)
        if (run_dir / "checkpoint.npz").is_file():
            return f"{exc}; the last complete round is checkpointed: fedtune run --resume {run_dir}"
        return f"{exc}; no round completed, so there is nothing to resume"
    if isinstance(exc, DeploymentError):
        return f"engine {config.engine}: {exc}"
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
    """List the registered methods."""
    from fedtune import catalog

    pad = " " * 15
    for method, description in catalog.read()["methods"]:  # without importing the methods (torch)
        typer.echo(f"{method:<14} {description}")
        if not verbose:
            continue
        from fedtune.methods import get_method

        spec = get_method(method)
        typer.echo(f"{pad}tasks: {', '.join(spec.supported_tasks())}")
        for name, field in spec.options.model_fields.items():
            about = f"  ({field.description})" if field.description else ""
            typer.echo(f"{pad}options.{name} = {field.default!r}{about}")
        for key, text in getattr(spec.options, "deviations", {}).items():
            typer.echo(f"{pad}deviation: {key}: {text}")


@app.command()
def tasks() -> None:
    """List the task kinds (``task.kind``) with their default data set and model."""
    from fedtune import catalog

    for kind, description, defaults in catalog.read()["tasks"]:  # without importing the tasks (torch)
        shown = ", ".join(f"{k} {v}" for k, v in defaults.items())
        typer.echo(f"{kind:<22} {description} [{shown}]")


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
        _fail(str(exc), code=exc.exit_code)
    typer.echo(markdown)
    for path in paths:
        console.print(f"wrote {path}")


@app.command()
def plan(
    recipe: Path = typer.Argument(..., help="TOML recipe (see configs/)"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override: key=value (dotted keys)"),
) -> None:
    """Print each client's planned setting (rank, sketch ratio) under its budget, with its predicted
    peak memory, seconds and MB per round; excluded clients with the reason. Nothing trains."""
    from fedtune.config import load_config
    from fedtune.planning.planner import format_plan, plan_budgets
    from fedtune.runtime import RunContext

    try:
        text = format_plan(plan_budgets(RunContext(load_config(recipe, set_)), always=True))
    except FedtuneError as exc:
        _fail(str(exc), code=exc.exit_code)
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
        for note in export_run(run, folder, merged, overwrite):
            console.print(note, markup=False, highlight=False, soft_wrap=True)
        console.print(f"wrote {folder}")
        if push_to_hub is not None:
            console.print(f"pushed to {push(folder, push_to_hub, token)}")
    except FedtuneError as exc:
        _fail(str(exc), code=exc.exit_code)


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

    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

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
        sets = [t.strip() for t in tasks.split(",") if t.strip()] if lm_eval else parse_sets(tasks)
        scored = target_of(target)
        path = out or (scored.run_dir / "eval.json" if scored.run_dir is not None else Path("eval.json"))
        check_free(path, is_eval_result, "--out")  # before the evaluation, which takes a while
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the result's warnings are printed below
            shown = bar.add_task("loading the model", total=None)

            def advance(unit: str, passes: int) -> None:
                bar.update(shown, description=f"{unit}: {passes} forward passes")

            if lm_eval:
                folder = None if include_path is None else str(include_path)
                result = evaluate_lm_eval(scored, sets, limit, batch_size, num_fewshot, baseline, folder)
            else:
                result = evaluate(
                    scored, sets, limit, batch_size, generate, advance, protocol, num_fewshot or 0, baseline
                )
        write_output(path, json.dumps(result, indent=1).encode(), is_eval_result, "--out")
    except FedtuneError as exc:
        _fail(str(exc), code=exc.exit_code)
    for note in result["warnings"]:
        console.print(f"warning: {note}", markup=False, highlight=False, soft_wrap=True)
    Console().print(eval_table(result))
    if baseline:
        Console().print(eval_table({**result["baseline"], "protocol": result["protocol"]}))
        Console().print(paired_table(result))
    console.print(f"wrote {path} (protocol {result['protocol']['name']})")


# -- deploy: Flower processes for real machines -------------------------------------------------
deploy_app = typer.Typer(no_args_is_help=True, help="Flower deployment on real machines (see docs/flower.md).")
app.add_typer(deploy_app, name="deploy")
EXTRA = typer.Option([], "--flower-arg", help="passed to the Flower command as is (repeat)")


def _security(insecure: bool, certificates: Path | None, what: str) -> None:
    if insecure == (certificates is not None):
        _fail(f"deploy {what}: give --insecure or the TLS certificate option (not both, not neither)")
    if certificates is not None and not certificates.exists():
        _fail(f"deploy {what}: {certificates} not found")


def _check_port(port: int, what: str) -> None:
    if not 1 <= port <= 65535:
        _fail(f"deploy {what} --port {port}: expected a port number 1-65535")


def _wait(procs) -> int:
    """Wait until a process ends (or Ctrl-C, or SIGTERM); its exit code."""
    import signal
    import time

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 130
    return next(p.returncode for p in procs if p.poll() is not None)


@deploy_app.command("superlink")
def deploy_superlink(
    host: str = typer.Option(
        "127.0.0.1",
        help="address to listen on (Fleet, Control and runtime APIs); the default, loopback, admits this "
        "machine only; another address exposes them to its network and needs --certificates (or --insecure)",
    ),
    port: int = typer.Option(9092, help="port of the SuperLink's APIs"),
    certificates: Path | None = typer.Option(
        None, help="folder with ca.crt, server.pem, server.key (TLS; `fedtune deploy certificates` makes a test set)"
    ),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (trusted networks only)"),
    auth: bool = typer.Option(
        False, "--auth", help="admit only SuperNodes registered with `flwr supernode register` (needs TLS)"
    ),
    extra: list[str] = EXTRA,
) -> None:
    """Start a Flower SuperLink for fedtune (flower-superlink, no runtime dependency installation).
    Whoever reaches its address can submit runs, and a submitted app's code runs on the SuperNodes:
    it listens on loopback unless --host says otherwise, and then only with TLS or --insecure."""
    from fedtune.engines.flower.commands import flower_env, superlink_args
    from fedtune.process import Processes, is_loopback

    _check_port(port, "superlink")
    if certificates is None and not insecure and not is_loopback(host):
        _fail(
            f"deploy superlink --host {host}: not a loopback address, so anyone on that network could submit "
            "runs: give --certificates (and --auth), or --insecure on a network you trust"
        )
    if certificates is not None or not is_loopback(host):
        _security(insecure, certificates, "superlink")
    if auth and certificates is None:
        _fail("deploy superlink: --auth needs TLS (--certificates); Flower refuses authentication without it")
    certs = (
        None
        if certificates is None
        else {"ca": certificates / "ca.crt", "cert": certificates / "server.pem", "key": certificates / "server.key"}
    )
    for path in (certs or {}).values():
        if not path.is_file():
            _fail(f"deploy superlink --certificates: {path} not found")
    logs = Path.cwd()
    procs = Processes(logs)
    try:
        link = procs.start("superlink", superlink_args(host, port, certs, auth, extra), flower_env())
        console.print(f"SuperLink on {host}:{port} (log: {logs / 'superlink.log'}); Ctrl-C stops it")
        code = _wait([link])
    finally:
        procs.stop()
    raise typer.Exit(code)


@deploy_app.command("supernode")
def deploy_supernode(
    superlink: str = typer.Option(..., help="the SuperLink's address, HOST:PORT"),
    clients: str = typer.Option(..., help="fedtune client ids this node plays: 3, 0-4 or 0,2,5-7"),
    port: int = typer.Option(9094, help="port of this SuperNode's local runtime API"),
    root_certificates: Path | None = typer.Option(None, help="CA certificate that signed the SuperLink's (TLS)"),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (trusted networks only)"),
    auth_key: Path | None = typer.Option(None, help="this node's private key (OpenSSH EC; its .pub registered)"),
    threads: int | None = typer.Option(None, min=1, help="torch threads (default: all cores)"),
    worker: bool = typer.Option(
        True, help="a warm fedtune worker next to the node (else each message loads the model)"
    ),
    extra: list[str] = EXTRA,
) -> None:
    """Start a Flower SuperNode playing fedtune clients, with its warm worker; Ctrl-C stops both."""
    import tempfile

    from fedtune.engines.flower.codec import parse_clients
    from fedtune.engines.flower.commands import flower_env, supernode_args, wait_for_worker, worker_args
    from fedtune.process import Processes

    _check_port(port, "supernode")
    _security(insecure, root_certificates, "supernode")
    if auth_key is not None and not auth_key.is_file():
        _fail(f"deploy supernode --auth-key: {auth_key} not found")
    try:
        ids = parse_clients(clients)
    except ValueError:
        ids = []
    if not ids:
        _fail(f"deploy supernode --clients: expected ids like 3, 0-4 or 0,2,5-7 (got {clients!r})")
    home = Path(tempfile.mkdtemp(prefix="fedtune-node-"))
    procs = Processes(home)
    try:
        sock = None
        if worker:
            sock = str(home / "worker.sock")
            proc = procs.start("worker", worker_args(sock, threads), flower_env())
            wait_for_worker(sock, proc, procs.log_of(proc))
        procs.start(
            "supernode",
            supernode_args(superlink, port, ids, root_certificates, auth_key, sock, threads, extra),
            flower_env(),
        )
        console.print(f"SuperNode for clients {clients} -> {superlink} (logs: {home}); Ctrl-C stops it")
        code = _wait([p for _, p, _ in procs.started])
    finally:
        procs.stop()
    raise typer.Exit(code)


@deploy_app.command("run")
def deploy_run(
    recipe: Path | None = typer.Argument(None, help="TOML recipe (see configs/)"),
    superlink: str = typer.Option(..., help="the SuperLink's address, HOST:PORT"),
    set_: list[str] = typer.Option([], "--set", "-s", help="override: key=value"),
    root_certificates: Path | None = typer.Option(None, help="CA certificate that signed the SuperLink's (TLS)"),
    insecure: bool = typer.Option(False, "--insecure", help="no TLS (trusted networks only)"),
    timeout: float = typer.Option(0, help="seconds to wait for nodes and for each round's replies (0: no limit)"),
    clipping_norm: float = typer.Option(
        0, help="> 0: nodes clip each update to this L2 norm (Flower's fixedclipping_mod)"
    ),
) -> None:
    """Submit a recipe to a running SuperLink (flwr run) and stream its logs; the run folder is
    written on the SuperLink's machine (output_dir there)."""
    import tempfile

    from fedtune.config import load_config
    from fedtune.engines.flower.commands import write_flower_config
    from fedtune.engines.flower.deployment import run_app
    from fedtune.process import Processes

    _security(insecure, root_certificates, "run")
    procs = None
    try:
        config = load_config(recipe, set_)
        home = Path(tempfile.mkdtemp(prefix="fedtune-run-"))
        connection = write_flower_config(home, superlink, root_certificates and root_certificates.resolve())
        procs = Processes(home)
        run_app(
            config,
            home,
            connection,
            procs,
            timeout=timeout,
            clipping_norm=clipping_norm,
            local=False,
            on_output=lambda text: sys.stderr.write(text),
        )
    except FedtuneError as exc:
        _fail(str(exc), code=exc.exit_code)
    finally:
        if procs is not None:
            procs.stop()


@deploy_app.command("certificates")
def deploy_certificates(
    out: Path = typer.Argument(..., help="folder for ca.crt, server.pem, server.key"),
    host: list[str] = typer.Option(
        ["127.0.0.1", "localhost"], "--host", help="the SuperLink's IP or DNS name (repeat)"
    ),
) -> None:
    """A self-signed CA and a SuperLink certificate for trials (use your own PKI in production)."""
    from fedtune.certificates import generate_certificates

    try:
        paths = generate_certificates(out, host)
    except FedtuneError as exc:
        _fail(f"deploy certificates: {exc}")
    for path in paths.values():
        console.print(f"wrote {path}")


@deploy_app.command("node-key")
def deploy_node_key(
    out: Path = typer.Argument(..., help="folder for the key pair"),
    name: str = typer.Option("supernode", help="file name of the private key (public: NAME.pub)"),
) -> None:
    """A SuperNode authentication key pair; register NAME.pub with `flwr supernode register`."""
    from fedtune.certificates import generate_node_key

    try:
        paths = generate_node_key(out, name)
    except FedtuneError as exc:
        _fail(f"deploy node-key: {exc}")
    for path in paths:
        console.print(f"wrote {path}")


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover - `python -m fedtune.cli`
    main()
