"""``fedtune eval --backend lm-eval``: any lm-evaluation-harness task (the ``lm-eval`` extra)
scored on the model :mod:`fedtune.trained.evaluate` builds (a run's adapter on its prepared
base, or a bare base), handed to lm-eval as an already-built model object (``HFLM(pretrained=
model)``), so a packaged GGUF-read base works offline. Tasks are lm-eval's by name (its data from
the hub) or custom task YAMLs under ``include_path`` (lm-eval's ``--include_path``: e.g. a task
with ``dataset_path: json`` and ``dataset_kwargs: {data_files: ...}`` reads local files).

The result has :func:`~fedtune.trained.evaluate.evaluate`'s ``eval.json`` shape: per task (and
group) its size and metrics (``acc``, ``acc_norm``, ...; a metric under a filter other than
``none`` is named ``metric_filter``) with lm-eval's standard errors, each question's metrics and
pick (the option with the highest log-likelihood) for its leaf tasks, lm-eval's own results per
task under ``metrics``, and the protocol ``lm-eval:<task,...>`` with lm-eval's version, task
versions and shots. ``baseline``: the same tasks scored again with the adapter disabled, and the
per-question paired differences.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from fedtune.config import ConfigError
from fedtune.trained.evaluate import PAIRED, Target, average, describe_target, paired, versions
from fedtune.trained.loader import make_task, open_run, prepared_base

BACKEND = "lm-eval"
BACKENDS = ("fedtune", BACKEND)
INSTALL = "pip install 'fedtune[lm-eval]'"


def check_backend_options(lm_eval: bool, tasks: str | None, protocol, generate: bool, include_path) -> None:
    """One line for options the chosen backend does not take."""
    if not lm_eval:
        if include_path is not None:
            raise ConfigError("--include-path: lm-eval's custom task folder, for --backend lm-eval")
        return
    if not tasks:
        raise ConfigError("--tasks: name the lm-eval tasks to score (e.g. arc_easy,mmlu)")
    if protocol is not None:
        raise ConfigError("--protocol: fedtune's protocols; --backend lm-eval scores with lm-eval's own tasks")
    if generate:
        raise ConfigError("--generate: fedtune's generation metric; lm-eval's generation tasks score their own")
    if include_path is not None and not include_path.is_dir():
        raise ConfigError(f"--include-path: {str(include_path)!r} is not a folder")


def task_manager(include_path: str | None = None):
    """lm-eval's task index (its own tasks, and ``include_path``'s YAMLs, each checked first:
    :func:`check_include_path`); one line when lm-eval is not installed."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(f"--backend lm-eval: lm-eval is not installed ({INSTALL})") from None
    if include_path is not None:
        check_include_path(Path(include_path))
    return TaskManager(include_path=include_path)


def check_include_path(folder: Path) -> None:
    """One line naming the first task YAML under ``folder`` that lm-eval cannot read (lm-eval's
    index skips such a file without a word, and the task then seems not to exist)."""
    from lm_eval.tasks._yaml_loader import load_yaml  # the loader lm-eval's index reads them with

    for path in sorted(folder.glob("**/*.yaml")):
        try:
            config = load_yaml(path, resolve_func=False, recursive=True)
        except Exception as exc:  # noqa: BLE001 - whatever the YAML holds: one line naming it
            first = (str(exc).strip().splitlines() or [""])[0]
            raise ConfigError(
                f"--include-path: {str(path)!r} is not a task YAML lm-eval can read ({type(exc).__name__}: "
                f"{first}): fix it, or move it out of the folder"
            ) from None
        if not isinstance(config, dict):
            raise ConfigError(f"--include-path: {str(path)!r} holds no YAML mapping (a task's keys): fix it")


def _data_error(exc: Exception) -> ConfigError:
    """The one line for a task whose data set lm-eval cannot get (``exc``: datasets' error)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, FileNotFoundError):
        return ConfigError(
            f"--backend lm-eval: a task's data file is missing ({first}): fix the data_files of its task YAML "
            "(--include-path)"
        )
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    why = "HF_HUB_OFFLINE is set and it is not in the datasets cache" if offline else "the hub cannot be reached"
    return ConfigError(
        f"--backend lm-eval: a task's data set is not available ({first}): {why}; download it once online, or "
        "give a task YAML that reads local files (dataset_path: json, dataset_kwargs.data_files) with --include-path"
    )


def check_tasks(manager, names: list[str]) -> None:
    """One line naming a task lm-eval does not know."""
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"--tasks: expected distinct lm-eval task names, got {','.join(names)!r}")
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"--tasks: lm-eval has no task {unknown[0]!r} (its tasks, groups and tags: `lm-eval ls tasks`; "
            "custom task YAMLs: --include-path)"
        )


def _row(result: dict, n: int) -> dict:
    """lm-eval's ``{"metric,filter": value, "metric_stderr,filter": se}`` of one task as a set row."""
    row: dict = {"n": n}
    for key, value in result.items():
        metric, _, filt = key.partition(",")
        if not filt or metric.endswith("_stderr") or not isinstance(value, int | float):
            continue
        name = metric if filt == "none" else f"{metric}_{filt}"
        row[name] = float(value)
        se = result.get(f"{metric}_stderr,{filt}")
        if isinstance(se, int | float):
            row[f"{name}_se"] = float(se)
    return row


def _examples(samples: list[dict]) -> dict[str, list]:
    """Each question's metrics (in document order) and, for log-likelihood tasks, its pick."""
    samples = sorted(samples, key=lambda s: s["doc_id"])
    keys = [k for k in samples[0].get("metrics", []) if isinstance(samples[0].get(k), int | float)]
    out: dict[str, list] = {k: [float(s[k]) for s in samples] for k in keys}
    if all(isinstance(r, list | tuple) and isinstance(r[0], float) for r in samples[0]["filtered_resps"]):
        out["pick"] = [int(np.argmax([r[0] for r in s["filtered_resps"]])) for s in samples]
    return out


def _score(lm, tasks: list[str], manager, limit: int | None, num_fewshot: int | None) -> dict:
    from lm_eval.evaluator import simple_evaluate

    try:
        out = simple_evaluate(
            model=lm, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=True
        )
    except (ConnectionError, FileNotFoundError) as exc:  # datasets': a hub set offline, a missing data file
        raise _data_error(exc) from None
    n = {name: v.get("effective", v.get("original")) for name, v in out.get("n-samples", {}).items()}
    examples = {name: _examples(s) for name, s in out["samples"].items() if s}
    for group, members in out.get("group_subtasks", {}).items():
        n.setdefault(group, sum(n.get(m, 0) for m in members))
    rows = {name: _row(result, n.get(name, 0)) for name, result in out["results"].items()}
    return {
        "sets": rows,
        "average": average({t: rows[t] for t in tasks if t in rows}),
        "metrics": out["results"],
        "examples": examples,
        "tasks": {
            name: {"version": out["versions"].get(name), "num_fewshot": out["n-shot"].get(name)}
            for name in out["results"]
        },
    }


def evaluate_lm_eval(
    target: Target,
    tasks: list[str],
    limit: int | None = None,
    batch_size: int | None = None,
    num_fewshot: int | None = None,
    baseline: bool = False,
    include_path: str | None = None,
) -> dict:
    """Score ``target`` on lm-eval's ``tasks`` (the first ``limit`` documents of each,
    ``num_fewshot`` shots: None is each task's default); the result as ``eval.json`` holds it."""
    import torch

    manager = task_manager(include_path)
    check_tasks(manager, tasks)
    if baseline and target.adapter_dir is None:
        raise ConfigError(f"--baseline: {target.label!r} is a bare model; --baseline compares a run with its base")
    from lm_eval.models.huggingface import HFLM

    if target.config.train.threads:
        torch.set_num_threads(target.config.train.threads)
    task: Any = make_task(target.config)  # a causal-LM task (its tokenizer)
    run_dir = target.run_dir
    model: Any = prepared_base(task) if target.adapter_dir is None or run_dir is None else open_run(run_dir).model(task)
    batch = batch_size or target.config.train.eval_batch_size
    lm = HFLM(pretrained=model, tokenizer=task.tokenizer, backend="causal", batch_size=batch)
    scored = _score(lm, tasks, manager, limit, num_fewshot)
    result = {
        **describe_target(target),
        "protocol": {
            "name": f"{BACKEND}:{','.join(tasks)}",
            "backend": BACKEND,
            "description": "lm-evaluation-harness's own tasks (prompts, shots, metrics), the model handed to it",
            "num_fewshot": num_fewshot,
            "max_length": lm.max_length,
            "include_path": include_path,
            "tasks": scored.pop("tasks"),
        },
        "limit": limit,
        "limit_takes": "the first N of each task (lm-eval's --limit)",
        "batch_size": batch,
        "generate": False,
        "truncated": {},
        "warnings": [],
        "versions": versions(),
        **scored,
    }
    if baseline:
        with model.disable_adapter():
            base = _score(lm, tasks, manager, limit, num_fewshot)
        base.pop("tasks")
        result["baseline"] = {"target": f"{result['base']} (the run's base, adapter disabled)", **base}
        diffs = paired({t: e for t, e in result["examples"].items() if "acc" in e}, base["examples"])
        result["paired"] = {"sets": diffs, "average": average({t: diffs[t] for t in tasks if t in diffs}, PAIRED)}
    return result
