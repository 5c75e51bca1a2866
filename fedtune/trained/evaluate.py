"""``fedtune eval``: a run's adapter, or a bare base model, scored on commonsense sets and Dolly
with the causal-LM task's own evaluation (:meth:`fedtune.tasks.causal_lm.CausalLM.example_metrics`,
the code every run evaluates with), under one named protocol (:data:`PROTOCOLS`) for a bare
model and a run alike:

- ``lm-eval`` (the default for named sets): lm-evaluation-harness's task format of each set
  (:mod:`fedtune.data.lm_eval_formats`: raw text, no chat template, ``" " + option``;
  ``num_fewshot`` solved examples, the first of the set's training split, before each question),
  whole prompts (up to the model's context, at most 4,096 tokens), ``acc`` / ``acc_norm``;
- ``run`` (the default for a run's own test set): the run's config as it evaluated each round
  (its prompt template, ``task.choice_scoring``, ``data.max_length`` and truncation side); for a
  bare model, a run's defaults around it.

Each requested set is one evaluation unit: the target's config with ``data.name`` and the set
swapped in: a commonsense set (``task.sets = [set]``), ``mmlu``, a local ``.jsonl`` / ``.csv``
file of ``{question, choices, gold}`` rows (asked as ARC is; the whole file) or ``dolly`` (FedIT's 80-example test set:
ROUGE-L of greedy generations and the response loss, through the prompt template under either
protocol). ``limit`` keeps the first N questions of each set (as lm-eval's ``--limit``; the
benchmarks' ``draw = "seed0"``: a seed-0 draw, nested in the one a run evaluates on). Without
sets, a run is scored on its own test set, drawn as its rounds drew it. The model is built once:
the run's base prepared as the run's (dtype, quantization, device, ``train.threads``), its
adapter loaded on top (:mod:`fedtune.trained.loader`). ``baseline``: the same units scored
again with the adapter disabled (the run's base, on the run's protocol), and each metric's
paired difference (run - base, per question) with its standard error.

The result (:func:`evaluate`, ``eval.json``) gives per set its size, each metric and each
accuracy's binomial standard error sqrt(p (1 - p) / n), the average over the multiple-choice sets
(its standard error: sqrt(sum of the sets' squared errors) / number of sets), each question's
metrics and chosen option (``examples``), the protocol (its name, prompt template, chat
template, scoring, few-shot count, token limit and truncation side), how many examples each set
had cut to that limit (cut examples also warn), and the fedtune and library versions.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedtune.config import ConfigError, RunConfig, load_config
from fedtune.data.llm_text import ALL_SETS, MMLU, MMLU_GROUPS, MMLU_SUBJECTS
from fedtune.data.lm_eval_formats import WITH_ACC_NORM
from fedtune.models.hub_ids import fedtune_name, hub_id
from fedtune.trained.loader import evaluation_task, open_run, prepared_base

if TYPE_CHECKING:
    from peft import PeftModel
    from torch import nn

    from fedtune.tasks.causal_lm import CausalLM

DOLLY = "dolly"
FILE_SUFFIXES = (".jsonl", ".csv")  # a local file as a set: {question, choices, gold} (or prompt/response) rows
SETS = (*ALL_SETS, MMLU, DOLLY)
ACCURACIES = ("acc", "acc_norm", "gen_acc")  # the binomial metrics (a standard error each)
PAIRED = ("acc", "acc_norm", "gen_acc", "rouge_l", "loss")  # the metrics --baseline compares per question
KIND = "causal-lm"
LM_EVAL = "lm-eval"
RUN = "run"
PROTOCOLS = {
    LM_EVAL: "lm-evaluation-harness's task formats: raw text (no chat template), ' ' + option, whole prompts",
    RUN: "the run's own evaluation: its prompt template, choice scoring, data.max_length and truncation side",
}
FIRST, SEEDED = "first", "seed0"
DRAWS = {
    FIRST: "the first N of each set (lm-eval's --limit)",
    SEEDED: "N of each named set drawn with seed 0 (as runs draw task.test_per_set: nested in a run's subset)",
}
LM_EVAL_MAX_LENGTH = 4096  # the most tokens a prompt keeps under lm-eval (data.max_length's ceiling)
LM_EVAL_TEMPLATE = "lm-eval task format (raw text: fedtune.data.lm_eval_formats)"
LIBRARIES = ("torch", "transformers", "peft", "lm_eval")


def is_file_set(name: str) -> bool:
    """Whether a ``--tasks`` entry names a local question file (``.jsonl`` / ``.csv``)."""
    return Path(name).suffix in FILE_SUFFIXES


def parse_sets(text: str | None) -> list[str]:
    """``--tasks`` as a list of set names (each known, or an existing local file; no repeats)."""
    if text is None:
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if is_file_set(name) and not Path(name).expanduser().is_file():
            raise ConfigError(f"--tasks: {name!r} is not a file")
        if name not in SETS and not is_file_set(name):
            raise ConfigError(
                f"--tasks: unknown set {name!r}; expected some of {', '.join(SETS)}, or a .jsonl / .csv file"
            )
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


def _scored_task(config: RunConfig) -> CausalLM:
    """The :data:`KIND` task of ``config`` for scoring (:func:`evaluation_task`); one line for another kind."""
    from fedtune.tasks.causal_lm import CausalLM

    task = evaluation_task(config)
    if not isinstance(task, CausalLM):
        raise ConfigError(f"task.kind: fedtune eval scores {KIND} tasks, got {config.task.kind!r}")
    return task


def _models(target: Target, task: CausalLM) -> tuple[PeftModel | None, nn.Module]:
    """(the run's adapter on its base, None for a bare model; the model scored: that, else the
    bare base prepared as a run prepares it)."""
    if target.run_dir is None or target.adapter_dir is None:
        return None, prepared_base(task)
    adapted = open_run(target.run_dir).model(task)
    return adapted, adapted


def unit_config(
    config: RunConfig,
    name: str | None,
    generate: bool,
    protocol: str = RUN,
    num_fewshot: int = 0,
    max_length: int | None = None,
    drawn: int | None = None,
) -> RunConfig:
    """``config`` evaluating set ``name`` (None: its own test set) under ``protocol`` (see the
    module docstring; ``max_length``: the lm-eval protocol's token limit; ``drawn``: at most that
    many questions of a named set, drawn with seed 0 as runs draw ``task.test_per_set``)."""
    tree = config.model_dump(mode="json")
    if name in (DOLLY, MMLU):
        tree["data"].update(name=name, max_test_samples=drawn, test_path=None)
        tree["task"].update(sets=None, test_per_set=None, generate=name == DOLLY or generate)
    elif name is not None and is_file_set(name):
        path = str(Path(name).expanduser().resolve())
        tree["data"].update(name=path, max_test_samples=drawn, test_path=path)
        tree["task"].update(sets=None, test_per_set=None, columns=None, generate=generate)
    elif name is not None:
        tree["data"].update(name="commonsense", max_test_samples=None, test_path=None)
        tree["task"].update(sets=[name], test_per_set=drawn, generate=generate)
    if protocol == LM_EVAL:
        tree["data"].update(max_length=max_length or LM_EVAL_MAX_LENGTH)
        if name != DOLLY:
            tree["task"].update(choice_scoring=LM_EVAL, num_fewshot=num_fewshot, generate=False)
    return RunConfig.model_validate(tree)


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def set_groups(task, unit: str) -> list[tuple[str, np.ndarray]]:
    """(set name, its examples' indices) of a unit's test set: on commonsense data one per set (a
    run's own test set may span several); on MMLU one per subject group (``mmlu_stem``, ...,
    parts of the whole) and ``mmlu``, all questions (lm-eval's groups: means over their
    questions); elsewhere (Dolly, a run's local file) the unit."""
    ds = task.test
    if task.config.data.name == MMLU:
        subjects = np.array([MMLU_SUBJECTS[s] for s in ds.labels])
        parts = [(f"{MMLU}_{g}", np.flatnonzero(np.isin(subjects, members))) for g, members in MMLU_GROUPS.items()]
        return [*((name, idx) for name, idx in parts if len(idx)), (MMLU, np.arange(len(ds)))]
    if task.config.data.name != "commonsense":
        return [(unit, np.arange(len(ds)))]
    return [(ds.label_names[s], np.flatnonzero(ds.labels == s)) for s in np.unique(ds.labels)]


def is_part(name: str) -> bool:
    """Whether a set row is a part of another (an MMLU subject group), left out of averages."""
    return name.startswith(f"{MMLU}_")


def set_rows(task, per: dict[str, np.ndarray], unit: str) -> dict[str, dict]:
    """{set: its size, metrics (means over its questions) and standard errors} from one unit's
    per-question metrics (:meth:`~fedtune.tasks.causal_lm.CausalLM.example_metrics`); under the
    lm-eval protocol ``acc_norm`` only where lm-eval's task reports it."""
    rows = {}
    lm_eval = task.options.choice_scoring == LM_EVAL
    for name, idx in set_groups(task, unit):
        row: dict = {"n": len(idx)}
        keys = [k for k in ("loss", "rouge_l", *ACCURACIES) if not (lm_eval and k == "acc_norm")]
        for key in [*keys, *(["acc_norm"] if lm_eval and name in WITH_ACC_NORM else [])]:
            values = per[key][idx] if key in per else np.full(1, np.nan)
            if not np.isnan(values).all():
                row[key] = float(np.nanmean(values))
                if key in ACCURACIES:
                    row[f"{key}_se"] = _se(row[key], len(idx))
        rows[name] = row
    return rows


def average(rows: dict[str, dict], keys=ACCURACIES) -> dict[str, float]:
    """Mean of each of ``keys`` over the multiple-choice sets, with its standard error."""
    out: dict[str, float] = {}
    for key in keys:
        values = [r for name, r in rows.items() if name != DOLLY and not is_part(name) and f"{key}_se" in r]
        if values:
            out[key] = float(np.mean([r[key] for r in values]))
            out[f"{key}_se"] = math.sqrt(sum(r[f"{key}_se"] ** 2 for r in values)) / len(values)
            out["sets"] = len(values)
    return out


def paired(run: dict[str, dict], base: dict[str, dict]) -> dict[str, dict]:
    """{set: {metric: run - base, metric_se: the paired standard error}} from two ``examples``
    records of the same questions: the mean of the per-question differences and their standard
    deviation / sqrt(n)."""
    out = {}
    for name, mine in run.items():
        row: dict = {"n": len(mine["acc"] if "acc" in mine else mine["loss"])}
        for key in PAIRED:
            if key in mine and key in base[name]:
                d = np.asarray(mine[key], dtype=float) - np.asarray(base[name][key], dtype=float)
                d = d[~np.isnan(d)]
                if len(d):
                    row[key] = float(d.mean())
                    row[f"{key}_se"] = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
        out[name] = row
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


def first_per_set(task, limit: int | None) -> None:
    """Keep the first ``limit`` test examples of each set (each MMLU subject) of ``task``
    (lm-eval's ``--limit``)."""
    if limit is None:
        return
    train, test = task.data
    labels = test.labels if task.config.data.name in ("commonsense", MMLU) else np.zeros(len(test), dtype=np.int64)
    keep = np.sort(np.concatenate([np.flatnonzero(labels == s)[:limit] for s in np.unique(labels)]))
    task.__dict__["data"] = (train, test.subset(keep))


def versions() -> dict[str, str | None]:
    """fedtune's version and those of the libraries that score (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    import fedtune

    out: dict[str, str | None] = {"fedtune": fedtune.__version__}
    for name in LIBRARIES:
        try:
            out[name] = version(name.replace("_", "-"))
        except PackageNotFoundError:
            out[name] = None
    return out


def describe_protocol(task, protocol: str) -> dict:
    """What a unit was scored with: the protocol, its prompt and chat templates, scoring,
    few-shot count, token limit and truncation side."""
    opts, tok = task.options, task.tokenizer
    lm_eval = opts.choice_scoring == LM_EVAL
    fmt = task.prompt_format.describe(tok)
    return {
        "name": protocol,
        "description": PROTOCOLS[protocol],
        "choice_scoring": opts.choice_scoring,
        "num_fewshot": opts.num_fewshot,
        "prompt_template": LM_EVAL_TEMPLATE if lm_eval else fmt["template"],
        "chat_template": None if lm_eval or fmt["template"] != "chat" else fmt["text"],
        "system_prompt": None if lm_eval else fmt["system"],
        "bos_prefix": fmt["bos_prefix"],
        "max_length": task.config.data.max_length,
        "truncation_side": opts.truncation_side,
    }


def describe_target(target: Target) -> dict:
    """What was scored: the target, its base's hub id, the adapter folder, dtype and quantization."""
    model_cfg = target.config.model
    return {
        "target": target.label,
        "base": hub_id(str(model_cfg.name)),
        "adapter": None if target.adapter_dir is None else str(target.adapter_dir),
        "dtype": model_cfg.dtype,
        "quantization": model_cfg.quantization,
    }


def _examples(task, per: dict[str, np.ndarray], unit: str) -> dict[str, dict]:
    """{set: {metric: each question's value}} (``pick``: the option ranked first)."""
    out = {}
    for name, idx in set_groups(task, unit):
        row = {}
        for key, values in per.items():
            v = values[idx]
            if not np.isnan(v).all():
                row[key] = [None if np.isnan(x) else (int(x) if key == "pick" else float(x)) for x in v]
        out[name] = row
    return out


def _score(units, model, batch: int, progress, label: str) -> tuple[dict, dict, dict]:
    """(rows, raw metrics, examples) of ``units`` (unit, task) scored with ``model``."""
    rows, raw, examples = {}, {}, {}
    for unit, task in units:
        passes = [0]

        def tick(unit=unit, passes=passes):
            passes[0] += 1
            if progress is not None:
                progress(f"{label}{unit}", passes[0])

        with counting_forwards(model, tick):
            per = task.example_metrics(model, batch)
        raw[unit] = task.summarize(per)
        rows.update(set_rows(task, per, unit))
        examples.update(_examples(task, per, unit))
    return rows, raw, examples


def _lm_eval_length(model) -> int:
    """The lm-eval protocol's token limit: the model's context, at most :data:`LM_EVAL_MAX_LENGTH`."""
    from fedtune.models.lm_scoring import language_model

    positions = getattr(language_model(model).config, "max_position_embeddings", None)
    return min(LM_EVAL_MAX_LENGTH, positions or LM_EVAL_MAX_LENGTH)


def evaluate(
    target: Target,
    sets: list[str],
    limit: int | None = None,
    batch_size: int | None = None,
    generate: bool = False,
    progress: Callable[[str, int], None] | None = None,
    protocol: str | None = None,
    num_fewshot: int = 0,
    baseline: bool = False,
    draw: str = FIRST,
) -> dict:
    """Score ``target`` on ``sets`` (none: a run's own test set) under ``protocol`` (None:
    ``lm-eval`` for named sets, ``run`` for a run's own test set); the result as ``eval.json``
    holds it. ``progress(unit, forward passes so far)`` is called as the evaluation advances.
    ``draw``: which ``limit`` questions (:data:`DRAWS`)."""
    import torch

    if not sets and target.run_dir is None:
        raise ConfigError("--tasks: name the sets to score a bare model on (e.g. arc_easy,boolq,dolly)")
    protocol = protocol or (LM_EVAL if sets else RUN)
    if protocol not in PROTOCOLS:
        raise ConfigError(f"--protocol: unknown protocol {protocol!r}; expected one of {', '.join(PROTOCOLS)}")
    if num_fewshot and protocol != LM_EVAL:
        raise ConfigError("--num-fewshot: few-shot prompts are part of the lm-eval protocol (--protocol lm-eval)")
    if num_fewshot and any(is_file_set(s) for s in sets):
        raise ConfigError("--num-fewshot: a local file as a set has no split to draw shots from; drop it or the shots")
    if generate and protocol == LM_EVAL:
        raise ConfigError("--generate: the lm-eval protocol ranks options only; use --protocol run")
    if baseline and target.adapter_dir is None:
        raise ConfigError(f"--baseline: {target.label!r} is a bare model; --baseline compares a run with its base")
    if target.config.train.threads:
        torch.set_num_threads(target.config.train.threads)
    names: list[str | None] = list(sets) if sets else [None]
    first = _scored_task(unit_config(target.config, names[0], generate, protocol, num_fewshot))
    adapted, model = _models(target, first)
    length = _lm_eval_length(model) if protocol == LM_EVAL else None
    units = []
    for name in names:
        drawn = limit if draw == SEEDED else None
        task = _scored_task(unit_config(target.config, name, generate, protocol, num_fewshot, length, drawn))
        first_per_set(task, limit if draw == FIRST else None)
        units.append((name or "run test set", task))
    batch = batch_size or target.config.train.eval_batch_size
    notes, truncated = [], {}
    for unit, task in units:
        cut = task.truncated(task.test)
        for name, idx in set_groups(task, unit):
            truncated[name] = int(cut[idx].sum())
            if truncated[name] and not is_part(name):
                notes.append(
                    f"{name}: {truncated[name]} of {len(idx)} examples cut to {task.config.data.max_length} tokens "
                    f"(from the {task.options.truncation_side}; protocol {protocol})"
                )
    for note in notes:
        warnings.warn(note, stacklevel=2)
    rows, raw, examples = _score(units, model, batch, progress, "")
    result = {
        **describe_target(target),
        "protocol": describe_protocol(next((t for u, t in units if u != DOLLY), units[0][1]), protocol),
        "limit": limit,
        "limit_takes": DRAWS[draw],
        "batch_size": batch,
        "generate": generate,
        "truncated": truncated,
        "warnings": notes,
        "versions": versions(),
        "sets": rows,
        "average": average(rows),
        "metrics": raw,
        "examples": examples,
    }
    if baseline and adapted is not None:  # a bare model's --baseline is refused above
        with adapted.disable_adapter():
            base_rows, base_raw, base_examples = _score(units, model, batch, progress, "base: ")
        diffs = paired(examples, base_examples)
        result["baseline"] = {
            "target": f"{result['base']} (the run's base, adapter disabled)",
            "sets": base_rows,
            "average": average(base_rows),
            "metrics": base_raw,
            "examples": base_examples,
        }
        result["paired"] = {"sets": diffs, "average": average(diffs, PAIRED)}
    return result


def is_eval_result(path: Path) -> bool:
    """Whether ``path`` holds an earlier :func:`evaluate` result (``fedtune eval`` may replace it)."""
    import json

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(value, dict) and {"target", "sets", "average", "metrics"} <= value.keys()


def evaluate_to_file(job: tuple[Target, list[str], int | None, Path, dict]) -> dict:
    """Worker job (one picklable argument, for :func:`fedtune.harness.pool.imap_unordered`):
    ``(target, sets, limit, path, extra)`` -> :func:`evaluate` of ``target`` on ``sets`` at
    ``limit`` examples per set (a seed-0 draw) under the ``run`` protocol (the recipe's own),
    with ``extra``'s entries added, written to ``path`` as JSON (the file appears only once the
    evaluation is complete) and returned."""
    import json

    target, sets, limit, path, extra = job
    result = {**evaluate(target, sets, limit, protocol=RUN, draw=SEEDED), **extra}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(result, indent=1))
    partial.replace(path)
    return result
