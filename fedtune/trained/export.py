"""``fedtune export``: a run's adapter (or its base with the adapter merged in) and tokenizer, as a
folder that plain transformers / PEFT code loads, and optionally pushed to the hub.

- **Adapter** (default): ``adapter_config.json`` (the base named by its hub id,
  :mod:`fedtune.models.hub_ids`), ``adapter_model.safetensors``, the model card, the tokenizer and
  the run's ``prompt_template.json``: ``AutoPeftModelForCausalLM.from_pretrained(folder)``. Where
  the base is a packaged model, its hub id is made to resolve offline here
  (:func:`fedtune.models.hub_cache.link_packaged`). A base built in code (``tiny-llama``) exists on
  no hub: it is written into ``base/`` and the adapter names that folder's absolute path.
- **Merged** (``merged=True``): the base in ``model.dtype`` with the adapter added into its weights
  (PEFT ``merge_and_unload``), saved as a plain model with the tokenizer: for serving (a base
  read from a packaged GGUF file is saved as the plain float32 model it was de-quantized to). A
  quantized base (``model.quantization``) is refused: merging into 4/8-bit weights would round
  the update away (export the adapter and merge onto the unquantized base where it is served).
- **Model card**: ``README.md`` (:func:`model_card`) in either form: the base's hub id and its
  exact weights (a packaged GGUF base: the de-quantized file, not the hub's originals), the
  method, rounds, clients, data, template and the evaluations the run folder holds.
- **Where**: the export never deletes or overwrites what it did not write in this call. An existing
  non-empty ``out`` is refused, or with ``overwrite`` moved aside to ``<name>.old-<n>`` (the run
  folder's ``--overwrite`` rule); a target that is, holds or lies inside a run folder is refused (but
  the run's own default, ``RUN/export[-merged]``), and so is the current folder or one holding it;
  a symbolic link is followed to the folder it names. Everything is written into a temporary folder
  beside ``out`` and renamed to ``out`` at the end: a failure leaves nothing half-written. A damaged
  run file the model card reads (``metrics.jsonl``, ``eval.json``) is one line, before anything loads.
- **Hub** (``push_to_hub``): uploads the folder to that repository, only with a token
  (``HF_TOKEN`` or ``huggingface-cli login``) and a network, and only with a base another
  machine can resolve.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from fedtune.config import ConfigError
from fedtune.models import prefix_lm as plm
from fedtune.models.hub_ids import BUILT_IN_CODE, hub_id, is_portable
from fedtune.process import offline_hint
from fedtune.run_folder import holds_run, rename_aside, run_folder_around
from fedtune.steps import step
from fedtune.trained.loader import ADAPTER_CONFIG, TrainedRun

if TYPE_CHECKING:
    from fedtune.tasks import Task

RUN_FILES = ("prompt_template.json",)  # run files a user of the export needs beside the weights


def _save_tokenizer(task: Task, out: Path) -> None:
    tokenizer = task.tokenizer
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _export_adapter(run: TrainedRun, task, out: Path, final: Path) -> list[str]:
    """Copy the adapter into ``out`` (renamed to ``final`` at the end); notes on how its base resolves."""
    from fedtune.models.hub_cache import link_packaged

    for path in run.adapter_dir.iterdir():
        if path.is_file():
            shutil.copy2(path, out / path.name)
    base = run.adapter_config.get("base_model_name_or_path")
    notes = []
    if str(task.config.model.name) in BUILT_IN_CODE:
        task.build_model(task.config.seed).save_pretrained(out / "base")
        _save_tokenizer(task, out / "base")
        info = dict(run.adapter_config, base_model_name_or_path=str((final / "base").resolve()))
        (out / ADAPTER_CONFIG).write_text(json.dumps(info, indent=2, sort_keys=True))
        notes.append(f"base {task.config.model.name!r} is built in code: written to {final / 'base'}")
    elif base and (snapshot := link_packaged(base)) is not None:
        notes.append(f"hub id {base} resolves offline here to the packaged copy ({snapshot})")
    return notes


def _export_merged(task, run: TrainedRun, out: Path) -> None:
    from peft import PeftModel

    cfg = task.config.model
    if cfg.quantization != "none":
        raise ConfigError(
            f"--merged: the run's base is quantized (model.quantization = {cfg.quantization!r}); merging into "
            "quantized weights would round the update away: export the adapter instead"
        )
    model = PeftModel.from_pretrained(task.build_model(task.config.seed), str(run.adapter_dir))
    merged = plm.saveable(model.merge_and_unload())  # a GGUF-read base: its weights in a plain model
    merged.config._name_or_path = run.adapter_config.get("base_model_name_or_path") or str(cfg.name)
    merged.save_pretrained(out)


def _final_metrics(run: TrainedRun) -> dict:
    """The last round's metrics of the run (``metrics.jsonl``), or {}; a damaged file is one line."""
    from fedtune.run import read_metrics

    path = run.run_dir / "metrics.jsonl"
    rows = read_metrics(path, "export") if path.is_file() else []
    return rows[-1] if rows else {}


def _json_of(path: Path) -> dict:
    """The JSON object in the run's ``path`` (``eval.json``, ``prompt_template.json``); one line
    when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"export: {str(path)!r} is not readable JSON ({exc}): restore it, or move it away") from None
    if not isinstance(value, dict):
        raise ConfigError(f"export: {str(path)!r} holds a {type(value).__name__}, not a JSON object: move it away")
    return value


def _eval_rows(path: Path) -> tuple[str, str]:
    """(protocol name, "set acc a (n=n), ...") of a ``fedtune eval`` result at ``path``; one line
    naming the first value that is not what ``fedtune eval`` writes."""
    result = _json_of(path)
    protocol, sets = result.get("protocol", {}), result.get("sets", {})
    name = protocol.get("name", "run") if isinstance(protocol, dict) else protocol
    bad = None if isinstance(name, str) else "protocol.name"
    if not isinstance(sets, dict):
        bad = bad or "sets"
        sets = {}
    rows = []
    for key, row in sets.items():
        if not isinstance(row, dict):
            bad = bad or f"sets.{key}"
        elif "acc" in row:
            acc, n = row["acc"], row.get("n")
            if isinstance(acc, bool) or not isinstance(acc, int | float):
                bad = bad or f"sets.{key}.acc = {acc!r:.30}"
            elif isinstance(n, bool) or not isinstance(n, int):
                bad = bad or f"sets.{key}.n = {n!r:.30}"
            else:
                rows.append(f"{key} acc {acc:.4f} (n={n})")
    if bad is not None:
        raise ConfigError(
            f"export: {str(path)!r} is not a fedtune eval result ({bad}): run fedtune eval again, or move it away"
        )
    return str(name), ", ".join(rows)


def model_card(run: TrainedRun, merged: bool) -> str:
    """The export's ``README.md``: the base (its hub id and exact weights), the method, rounds,
    clients, data and template, and the evaluations the run folder holds (its last round on its
    own test set; ``fedtune eval``'s ``eval.json`` with its protocol)."""
    import fedtune

    cfg = run.config
    name = str(cfg.model.name)
    base = run.adapter_config.get("base_model_name_or_path") or hub_id(name)
    kind = "the base model with the LoRA adapter merged into its weights" if merged else "a LoRA adapter (PEFT)"
    sets = cfg.task.options.get("sets")
    lines = ["---", *([f"base_model: {base}"] if is_portable(base) else [])]
    lines += [f"library_name: {'transformers' if merged else 'peft'}", "tags: [fedtune, federated-learning, lora]"]
    lines += [
        "---",
        "",
        f"# {run.run_dir.name}",
        "",
        f"{kind.capitalize()}, trained with fedtune {fedtune.__version__}.",
        "",
    ]
    lines += ["## Base model", "", f"- name: `{base}` (fedtune `model.name = {name}`)"]
    lines += [f"- exact weights: {plm.weights_source(name, cfg.model.dtype)}"]
    lines += [f"- dtype: {cfg.model.dtype}; quantization in training: {cfg.model.quantization}", ""]
    lines += ["## Training", "", f"- method: {cfg.method}; rounds: {cfg.rounds}; clients: {cfg.federation.num_clients}"]
    lines += [f"- LoRA rank {cfg.model.lora_rank}, alpha {cfg.model.lora_alpha:g}; seed {cfg.seed}"]
    chosen = f" (sets: {', '.join(sets)})" if sets else ""
    lines += [f"- data: {cfg.data.name}{chosen}; partition {cfg.data.partition}"]
    template = run.run_dir / "prompt_template.json"
    if template.is_file():
        info = _json_of(template)
        lines += [
            f"- prompt template: {info.get('template')} (`prompt_template.json`), max_length {info.get('max_length')}"
        ]
    lines += ["", "## Evaluation", ""]
    final = {k: v for k, v in _final_metrics(run).items() if isinstance(v, float)}
    if final:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items()))
        lines += [f"- last round, the run's own test set and protocol (`metrics.jsonl`): {shown}"]
    saved = run.run_dir / "eval.json"
    if saved.is_file():
        protocol, rows = _eval_rows(saved)
        lines += [f"- `fedtune eval` (`eval.json`, protocol {protocol}): {rows or 'see the file'}"]
    if not final and not saved.is_file():
        lines += ["- none recorded in the run folder"]
    return "\n".join(lines) + "\n"


def default_folder(run_dir: Path, merged: bool) -> Path:
    """Where ``fedtune export`` writes without ``--out``: ``RUN/export`` (``export-merged``)."""
    return run_dir / ("export-merged" if merged else "export")


def _run_inside(folder: Path) -> Path | None:
    """A run folder inside ``folder`` (symbolic links not followed), or None."""
    for root, dirs, _ in os.walk(folder):
        for name in dirs:
            if holds_run(Path(root, name)):
                return Path(root, name)
    return None


def check_target(run: TrainedRun, out: Path, merged: bool, overwrite: bool) -> Path:
    """The folder to write for ``--out out`` (a symbolic link: the folder it names), or one line
    when writing it could delete or change what the export did not write."""
    where = f"--out {str(out)!r}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{where}: exists and is not a folder; choose a folder")
    target, default = out.resolve(), default_folder(run.run_dir, merged).resolve()
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise ConfigError(f"{where}: the current folder or one holding it; choose a new folder (e.g. --out ./export)")
    holder = run_folder_around(target)
    if holder is not None and target != default:
        raise ConfigError(
            f"{where}: inside the run folder {str(holder)!r}; export there only to its default "
            f"({default.name}/): choose a folder outside every run folder"
        )
    if target in run.run_dir.resolve().parents:
        raise ConfigError(f"{where}: holds the run being exported; choose a folder outside it")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"{where}: not empty; choose another folder, or pass --overwrite to move it aside to "
                f"{target.name}.old-<n>"
            )
        inside = _run_inside(target)
        if inside is not None:
            raise ConfigError(
                f"{where}: holds the run folder {str(inside)!r}; --overwrite moves no run: choose another"
            )
    return target


def export_run(run: TrainedRun, out: Path, merged: bool = False, overwrite: bool = False) -> list[str]:
    """Write the export of ``run`` into ``out`` (see the module's **Where**); notes for the user.
    Every check (the target, the run's files the model card reads) comes before the model loads."""
    out = check_target(run, out, merged, overwrite)
    card = model_card(run, merged)
    task = run.task()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.export-{secrets.token_hex(4)}")
        tmp.mkdir()
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r}: cannot be written ({exc.strerror or exc})") from None
    try:
        notes = _write(run, task, tmp, out, merged, card)
        aside = rename_aside(out) if out.is_dir() and any(out.iterdir()) else None
        try:
            os.rename(tmp, out)  # onto nothing, or onto an empty folder
        except OSError:
            if aside is not None:
                aside.rename(out)
            raise
    except OSError as exc:
        raise ConfigError(
            f"--out {str(out)!r}: cannot be written ({exc.strerror or exc}); nothing was written"
        ) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # this call's own partial export
    return notes


def _write(run: TrainedRun, task, tmp: Path, out: Path, merged: bool, card: str) -> list[str]:
    """The export's files in ``tmp`` (to become ``out``), ``card`` its README.md."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards": the command says what it wrote
    try:
        with step("merging the adapter into the base and saving it" if merged else "saving the adapter"):
            notes = [] if merged else _export_adapter(run, task, tmp, out)
            if merged:
                _export_merged(task, run, tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    _save_tokenizer(task, tmp)
    (tmp / "README.md").write_text(card)
    for name in RUN_FILES:
        if (run.run_dir / name).is_file():
            shutil.copy2(run.run_dir / name, tmp / name)
    return notes


def hub_token(repo: str, base: str | None) -> str:
    """The token to push to ``repo`` with, checked before anything is written: one line when the
    base exists on no hub, the machine is offline or there is no token."""
    import os

    from huggingface_hub import get_token

    if base is not None and not is_portable(base):
        raise ConfigError(f"--push-to-hub {repo}: the base {base!r} exists only on this machine; nobody could load it")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(f"--push-to-hub {repo}: pushing needs the network{offline_hint()}")
    token = get_token()
    if not token:
        raise ConfigError(f"--push-to-hub {repo}: no Hugging Face token (set HF_TOKEN or run `huggingface-cli login`)")
    return token


def push_to_hub(out: Path, repo: str, token: str) -> str:
    """Upload ``out`` to hub repository ``repo`` (created if needed); the commit's URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo, exist_ok=True)
        info = api.upload_folder(folder_path=str(out), repo_id=repo)
    except Exception as exc:  # network and hub errors of every kind: one line
        raise ConfigError(f"--push-to-hub {repo}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    return str(getattr(info, "commit_url", repo))
