"""A suite's run plan: named run specs, each a recipe TOML plus ``key=value`` overrides.

Every :class:`RunSpec` becomes a :class:`~fedtune.config.RunConfig` through
:func:`fedtune.config.load_config`. A config listed by several experiments (the same run seen from
two figures) runs once, in the folder of the first experiment that lists it: ``out/runs/<that
experiment>/<its name>``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import tomllib

from fedtune.config import RunConfig, flat_keys, load_config

#: experiment name -> its specs, in the suite's experiment order (the order that owns shared runs)
Plan = dict[str, list["RunSpec"]]


@dataclass
class RunSpec:
    """One run an experiment reports: its name, the overrides that make its config from the
    suite's recipe, and the labels its report selects runs by (method, data, seed, ...).
    :func:`build_plan` fills in the rest."""

    name: str
    overrides: list[str]
    labels: dict[str, Any] = field(default_factory=dict)
    experiment: str = ""  # the experiment that lists it
    config: RunConfig | None = None  # resolved; carries the owner's name and folder when shared
    key: str = ""  # config_key(config)
    run_dir: Path | None = None  # canonical folder (another experiment's when shared)
    owner: str = ""  # experiment whose folder holds the run

    @property
    def resolved(self) -> RunConfig:
        """``config``, which :func:`build_plan` resolves; an error for a spec it has not planned."""
        if self.config is None:
            raise RuntimeError(f"run {self.name!r}: not planned (build_plan resolves its config)")
        return self.config

    @property
    def folder(self) -> Path:
        """``run_dir``, which :func:`build_plan` sets; an error for a spec it has not planned."""
        if self.run_dir is None:
            raise RuntimeError(f"run {self.name!r}: not planned (build_plan names its folder)")
        return self.run_dir

    @property
    def shared(self) -> bool:
        """True when another experiment's folder holds this run."""
        return self.owner != self.experiment


def toml_value(value: Any) -> str:
    """``value`` in TOML syntax, for the right-hand side of a ``key=value`` override."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def assignments(values: Mapping[str, Any]) -> list[str]:
    """``{"model.lora_rank": 8}`` as the overrides ``["model.lora_rank=8"]``."""
    return [f"{key}={toml_value(value)}" for key, value in values.items()]


def read_overlays(path: str | Path) -> dict[str, list[str]]:
    """Named overlays from a TOML file: each top-level table is a partial recipe, returned as
    overrides, one per value (``[quick.model] name = "tiny-bert"`` gives ``quick`` the override
    ``model.name="tiny-bert"``), so tables merge into the recipe's like ``--set`` does."""
    tree = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    return {name: assignments(flat_keys(table)) for name, table in tree.items()}


class SuiteFiles(NamedTuple):
    """A suite's files (:func:`suite_files`): its recipe, its named overlays, its results folder and
    ``--quick``'s scratch folder."""

    recipe: Path
    overlays: dict[str, list[str]]
    results: Path
    quick_results: Path


def suite_files(repo: Path, recipe: str, results: str, quick: str | None = None) -> SuiteFiles:
    """The files of a suite in checkout ``repo``: ``configs/benchmarks/<recipe>.toml``, the overlays of
    ``<recipe>-overlays.toml`` beside it (none without one), ``benchmarks/results/<results>/`` and
    ``benchmarks/results/_scratch/<quick>/`` (default ``<results>-quick``)."""
    configs, out = repo / "configs" / "benchmarks", repo / "benchmarks" / "results"
    overlays = configs / f"{recipe}-overlays.toml"
    return SuiteFiles(
        configs / f"{recipe}.toml",
        read_overlays(overlays) if overlays.is_file() else {},
        out / results,
        out / "_scratch" / (quick or f"{results}-quick"),
    )


def config_key(config: RunConfig) -> str:
    """Identity of a run for sharing and resuming: the whole resolved config but its name and folder."""
    dump = config.model_dump(mode="json", exclude={"name", "output_dir"})
    return hashlib.sha1(json.dumps(dump, sort_keys=True).encode()).hexdigest()[:16]


def build_plan(experiments: Mapping[str, Iterable[RunSpec]], recipe: str | Path | None, out: Path) -> Plan:
    """Resolve every spec to ``load_config(recipe, spec.overrides)`` named ``spec.name`` under
    ``out/runs/<experiment>/``; a config seen before is shared with (and kept in the folder of)
    the first spec that had it. List every experiment, not only the selected ones, so that which
    folder owns a shared run never depends on the selection."""
    plan: Plan = {}
    owners: dict[str, RunSpec] = {}
    for experiment, specs in experiments.items():
        plan[experiment] = []
        for spec in specs:
            spec.experiment = experiment
            folder = out / "runs" / experiment
            config = load_config(
                recipe, [*spec.overrides, f"name={toml_value(spec.name)}", f"output_dir={toml_value(str(folder))}"]
            )
            spec.key = config_key(config)
            first = owners.setdefault(spec.key, spec)
            if first is spec:
                spec.config, spec.run_dir, spec.owner = config, folder / spec.name, experiment
            else:
                spec.config, spec.run_dir, spec.owner = first.config, first.run_dir, first.owner
            plan[experiment].append(spec)
    return plan


def with_labels(specs: Iterable[RunSpec], **labels: Any) -> list[RunSpec]:
    """The specs whose labels have all the given values (``with_labels(specs, method="fedit", seed=0)``)."""
    return [s for s in specs if all(s.labels[key] == value for key, value in labels.items())]


def distinct_runs(plan: Plan, selected: Iterable[str]) -> list[RunSpec]:
    """One spec per distinct config of the selected experiments (shared specs carry their
    owner's config and folder), in plan order."""
    runs: dict[str, RunSpec] = {}
    for experiment in selected:
        for spec in plan[experiment]:
            runs.setdefault(spec.key, spec)
    return list(runs.values())
