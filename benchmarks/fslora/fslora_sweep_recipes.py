"""The sweep's winners as recipe values: what they change in configs/*.toml, written with tomlkit
(comments and layout kept)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomlkit
from fslora_sweep_experiments import FAMILIES, FAMILY_LABELS, REPO

from fedtune.config import ConfigError, RunConfig, load_config
from fedtune.harness import (
    table_lines,
)

# -- the winners as recipe values (issue 13, item 6) -------------------------------------------

#: a recipe's method -> the benchmark rows that may set its [train] (and for FSLoRA [server])
RECIPE_ROWS = {
    "fslora": ["fslora", "fslora-sadam"],
    **{m: [m] for m in ("heterolora", "flexlora", "fedstacklora", "fedit")},
}


@dataclass
class RecipeChange:
    recipe: Path
    method: str
    row: str | None
    family: str | None
    basis: str  # why this row/family: "table" (seed means) or "sweep" (sweep seed only) or a reason
    train: dict[str, Any] | None
    federation: dict[str, Any] | None
    note: str = ""


def best_for_recipe(method: str, results: dict) -> tuple[str, str, str] | None:
    """(row, family, basis) with the highest table mean among the method's rows and both families;
    the sweep scores decide while any candidate's table is unfinished. None: no candidate chosen."""
    cands = [
        (row, fam, results["families"][fam][row])
        for row in RECIPE_ROWS.get(method, [])
        for fam in FAMILIES
        if results["families"].get(fam, {}).get(row, {}).get("train")
    ]
    if not cands:
        return None
    complete = all(c[2]["table_runs"] and c[2]["table_runs"] == c[2]["table_seeds"] for c in cands)
    key = "table_mean" if complete else "sweep_score"
    row, fam, _ = max(cands, key=lambda c: c[2][key] if c[2][key] is not None else -1.0)
    return row, fam, "table" if complete else "sweep"


#: a recipe whose text holds this keeps its rate: the sweep's was tried on it and did not learn
PINNED = "measured on this recipe"


def recipe_changes(results: dict, configs: Path = REPO / "configs") -> list[RecipeChange]:
    """What the winners change in every recipe of ``configs/*.toml``: recipes of a swept method on
    text classification with MiniLM take the best row's [train] values (and, for FSLoRA, its server
    step); other recipes (and those :data:`PINNED` to a rate measured on the recipe itself) are
    listed with the reason they are left alone."""
    changes = []
    for path in sorted(configs.glob("*.toml")):
        try:
            config = load_config(path)
        except ConfigError as exc:
            changes.append(RecipeChange(path, "?", None, None, f"does not load: {exc}", None, None))
            continue
        method, task = config.method, config.task.kind
        reason = ""
        if PINNED in path.read_text(encoding="utf-8"):
            reason = f"its rate is {PINNED} (benchmarks/recipes/recipes.py): the sweep's does not learn there"
        elif method not in RECIPE_ROWS:
            reason = f"method {method} was not swept"
        elif task != "text-classification" or (config.model.name or "minilm") != "minilm":
            reason = f"{task} / {config.model.name}: not the swept task and model"
        best = None if reason else best_for_recipe(method, results)
        if best is None:
            changes.append(RecipeChange(path, method, None, None, reason or "waiting for the sweep", None, None))
            continue
        row, family, basis = best
        chosen = results["families"][family][row]
        data = config.data.name or "tweets"
        notes = [] if data == "sst2" else [f"swept on sst2, recipe trains on {data}: transferred"]
        value = chosen["table_mean"] if basis == "table" else chosen["sweep_score"]
        if results.get("majority") is not None and value is not None and value < results["majority"] + 0.02:
            notes.append("the winner did not learn (within 2 points of the majority class): do not apply")
        note = "; ".join(notes)
        changes.append(
            RecipeChange(
                path,
                method,
                row,
                family,
                basis,
                chosen["train"],
                chosen["federation"] if method == "fslora" else None,
                note,
            )
        )
    return changes


COMMENT_COLUMN = 31  # where the recipes' end-of-line comments start


def set_toml_values(text: str, table: str, values: dict[str, Any], comment: str) -> str:
    """``text`` with ``table``'s keys set to ``values`` (None removes the key), each set key carrying
    ``comment`` at :data:`COMMENT_COLUMN` as the recipes align theirs; a key that already holds its
    value and comment, the other keys, comments and layout are kept (tomlkit edits the document in
    place); a missing table is added at the file's end."""
    doc = tomlkit.parse(text)
    if table not in doc:
        doc[table] = tomlkit.table()
    section = doc[table]
    for key, value in values.items():
        if value is None:
            section.pop(key, None)
        elif section.get(key) != value or comment not in (section[key].trivia.comment or ""):
            item = tomlkit.item(value)
            item.comment(comment)
            item.trivia.comment_ws = " " * max(1, COMMENT_COLUMN - len(f"{key} = {item.as_string()}"))
            section[key] = item
    return tomlkit.dumps(doc)


def apply_change(change: RecipeChange) -> str:
    """The recipe's new text (validated with :func:`load_config`; the file itself is not written)."""
    text = change.recipe.read_text()
    comment = f"benchmarks/fslora/sweep.py: {change.row}, {FAMILY_LABELS[change.family]} ({change.basis})"
    text = set_toml_values(text, "train", change.train, comment)
    if change.federation is not None:  # the sweep's server_* records: the recipe's [server] table
        server = {k.removeprefix("server_"): v for k, v in change.federation.items()}
        text = set_toml_values(text, "server", server, comment)
    load_config_text(text)
    return text


def load_config_text(text: str) -> RunConfig:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return load_config(f.name)
    finally:
        os.unlink(f.name)


def recipe_changes_report(changes: list[RecipeChange]) -> str:
    rows = []
    for c in changes:
        if c.method == "?":
            rows.append([c.recipe.name, "?", "–", "unchanged", c.basis])
            continue
        now = load_config(c.recipe)
        current = f"{now.train.optimizer}, lr {now.train.lr:g}" + (
            f", momentum {now.train.momentum:g}" if now.train.momentum else ""
        )
        if now.method == "fslora":
            current += f"; server {now.server.optimizer}" + (f" lr {now.server.lr:g}" if now.server.lr else "")
        if c.train is None:
            rows.append([c.recipe.name, c.method, current, "unchanged", c.basis])
            continue
        proposed = f"{c.train['optimizer']}, lr {c.train['lr']:g}" + (
            f", momentum {c.train['momentum']:g}" if c.train.get("momentum") else ""
        )
        if c.federation is not None:
            proposed += f"; server {c.federation['server_optimizer'] or 'sgd'}" + (
                f" lr {c.federation['server_lr']:g}" if c.federation.get("server_lr") else ""
            )
        rows.append(
            [
                c.recipe.name,
                c.method,
                current,
                proposed,
                f"{c.row}, {FAMILY_LABELS[c.family]} ({c.basis} winner)" + (f"; {c.note}" if c.note else ""),
            ]
        )
    lines = [
        "# What the sweep's winners change in configs/*.toml",
        "",
        "Produced by `benchmarks/fslora/sweep.py --recipe-changes` from `winners.json`; "
        "`--apply-recipes` writes them (each changed line says where it came from). The sweep ran on "
        "SST-2 with MiniLM at the benchmark's scale (H = 5, 10 devices); a recipe with more local steps or "
        "devices, or another data set, takes the rate as a transfer, which `benchmarks/recipes/recipes.py` then "
        "checks.",
        "",
        *table_lines(["recipe", "method", "now", "proposed", "from"], rows),
        "",
    ]
    return "\n".join(lines)
