"""``fedtune eval``: a run's adapter, or a bare base model, scored on commonsense sets and Dolly
with the causal-LM task's own evaluation (:meth:`fedtune.tasks.causal_lm.CausalLM.evaluate`, the
code every run evaluates with).

Each requested set is one evaluation unit: the run's config (a bare model: the defaults) with
``data.name`` and the set swapped in: a commonsense set (``task.sets = [set]``, at most
``limit`` questions drawn with seed 0, as runs draw ``task.test_per_set``; the log-likelihood
protocol, ``acc`` / ``acc_norm``, and greedy generation's ``gen_acc`` when ``generate``) or
``dolly`` (FedIT's 80-example test set, a seed-0 subset of ``limit``: ROUGE-L of greedy
generations and the response loss). Without sets, a run is scored on its own test set, as its
rounds were. The model is built once: the run's base prepared as the run's (dtype, quantization,
device), its adapter loaded on top (:mod:`fedtune.trained.loader`).

The result (:func:`evaluate`) gives per set its size, each metric and each accuracy's binomial
standard error sqrt(p (1 - p) / n), and the average over the commonsense sets (its standard error:
sqrt(sum of the sets' squared errors) / number of sets).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedtune.config import ConfigError, RunConfig, load_config
from fedtune.data.llm_text import COMMONSENSE_SETS
from fedtune.models.hub_ids import fedtune_name, hub_id
from fedtune.trained.loader import evaluation_task, open_run, prepared_base

DOLLY = "dolly"
SETS = (*COMMONSENSE_SETS, DOLLY)
ACCURACIES = ("acc", "acc_norm", "gen_acc")  # the binomial metrics (a standard error each)
KIND = "causal-lm"


def parse_sets(text: str | None) -> list[str]:
    """``--tasks`` as a list of set names (each known, no repeats)."""
    if text is None:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in SETS:
            raise ConfigError(f"--tasks: unknown set {name!r}; expected some of {', '.join(SETS)}")
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"--tasks: expected distinct set names, got {text!r}")
    return names


@dataclass(frozen=True)
class Target:
    """What is scored: ``config`` (the run's, or defaults around a bare model), ``adapter_dir``
    (None: the bare base), ``label`` (the run folder or model name)."""

    config: RunConfig
    adapter_dir: Path | None
    label: str
    run_dir: Path | None


def target_of(arg: str) -> Target:
    """A run folder (it holds ``config.toml``) or a model name, hub id or model folder."""
    path = Path(arg).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        run = open_run(path)
        if run.config.task.kind != KIND:
            raise ConfigError(
                f"{str(path / 'config.toml')!r}: task.kind is {run.config.task.kind!r}; fedtune eval scores {KIND} runs"
            )
        return Target(run.config, run.adapter_dir, str(path), path)
    a_path = (
        arg.startswith(("/", ".", "~")) or arg.count("/") > 1 or (path.parent != Path(".") and path.parent.is_dir())
    )
    if a_path and not path.exists():  # a hub id is org/name, with no folder org/ here
        raise ConfigError(f"{arg!r}: no such folder (expected a run folder, a model folder or a model name)")
    name = fedtune_name(arg)
    return Target(load_config(None, [f"task.kind={KIND}", f"model.name={name}"]), None, name, None)


def unit_config(config: RunConfig, name: str, limit: int | None, generate: bool) -> RunConfig:
    """``config`` evaluating set ``name`` (see the module docstring)."""
    tree = config.model_dump(mode="json")
    if name == DOLLY:
        tree["data"].update(name=DOLLY, max_test_samples=limit, test_path=None)
        tree["task"].update(sets=None, test_per_set=None, generate=True)
    else:
        tree["data"].update(name="commonsense", max_test_samples=None, test_path=None)
        tree["task"].update(sets=[name], test_per_set=limit, generate=generate)
    return RunConfig.model_validate(tree)


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def set_rows(task, metrics: dict[str, float], unit: str) -> dict[str, dict]:
    """{set: its size, metrics and standard errors} from one unit's metrics: on commonsense data
    one row per set (a run's own test set may span several: their ``<metric>_<set>`` values),
    elsewhere (Dolly, a run's local file) one row for the unit."""
    ds = task.test
    if task.config.data.name != "commonsense":
        groups = [(unit, len(ds), "")]
    else:
        present = [int(s) for s in np.unique(ds.labels)]
        suffix = len(present) > 1
        groups = [
            (ds.label_names[s], int((ds.labels == s).sum()), f"_{ds.label_names[s]}" if suffix else "") for s in present
        ]
    rows = {}
    for name, n, suffix in groups:
        row: dict = {"n": n}
        for key in ("loss", "rouge_l", *ACCURACIES):
            value = metrics.get(key + suffix)
            if value is not None:
                row[key] = value
                if key in ACCURACIES:
                    row[f"{key}_se"] = _se(value, n)
        rows[name] = row
    return rows


def average(rows: dict[str, dict]) -> dict[str, float]:
    """Mean of each accuracy over the multiple-choice sets, with its standard error."""
    out: dict[str, float] = {}
    for key in ACCURACIES:
        values = [r for name, r in rows.items() if name != DOLLY and key in r]
        if values:
            out[key] = float(np.mean([r[key] for r in values]))
            out[f"{key}_se"] = math.sqrt(sum(r[f"{key}_se"] ** 2 for r in values)) / len(values)
            out["sets"] = len(values)
    return out


@contextmanager
def counting_forwards(model, on_forward: Callable[[], None]):
    """Call ``on_forward`` after each forward pass of ``model``'s language model (progress)."""
    from fedtune.models.lm_scoring import language_model

    handle = language_model(model).register_forward_hook(lambda *_: on_forward())
    try:
        yield
    finally:
        handle.remove()


def evaluate(
    target: Target,
    sets: list[str],
    limit: int | None = None,
    batch_size: int | None = None,
    generate: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> dict:
    """Score ``target`` on ``sets`` (none: a run's own test set); the result as ``eval.json`` holds
    it. ``progress(unit, forward passes so far)`` is called as the evaluation advances."""
    if not sets and target.run_dir is None:
        raise ConfigError("--tasks: name the sets to score a bare model on (e.g. arc_easy,boolq,dolly)")
    units = [(s, unit_config(target.config, s, limit, generate)) for s in sets] or [("run test set", target.config)]
    first = evaluation_task(units[0][1])
    if target.adapter_dir is None:
        model = prepared_base(first)
    else:
        model = open_run(target.run_dir).model(first)
    batch = batch_size or target.config.train.eval_batch_size
    rows, raw = {}, {}
    for unit, config in units:
        task = first if config is units[0][1] else evaluation_task(config)
        passes = [0]

        def tick(unit=unit, passes=passes):
            passes[0] += 1
            if progress is not None:
                progress(unit, passes[0])

        with counting_forwards(model, tick):
            raw[unit] = task.evaluate(model, batch)
        rows.update(set_rows(task, raw[unit], unit))
    model_cfg = target.config.model
    return {
        "target": target.label,
        "base": hub_id(str(model_cfg.name)),
        "adapter": None if target.adapter_dir is None else str(target.adapter_dir),
        "dtype": model_cfg.dtype,
        "quantization": model_cfg.quantization,
        "limit": limit,
        "batch_size": batch,
        "generate": generate,
        "sets": rows,
        "average": average(rows),
        "metrics": raw,
    }


def is_eval_result(path: Path) -> bool:
    """Whether ``path`` holds an earlier :func:`evaluate` result (``fedtune eval`` may replace it)."""
    import json

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(value, dict) and {"target", "sets", "average", "metrics"} <= value.keys()


def evaluate_to_file(job: tuple[Target, list[str], int | None, Path, dict]) -> dict:
    """Worker job (one picklable argument, for :func:`fedtune.harness.pool.imap_unordered`):
    ``(target, sets, limit, path, extra)`` -> :func:`evaluate` of ``target`` on ``sets`` at
    ``limit`` examples per set, with ``extra``'s entries added, written to ``path`` as JSON (the
    file appears only once the evaluation is complete) and returned."""
    import json

    target, sets, limit, path, extra = job
    result = {**evaluate(target, sets, limit), **extra}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(path)
    return result
