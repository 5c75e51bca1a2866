"""The recipes benchmark's runs (see recipes.py): every recipe on its own data and on similar data,
and their rough cost."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from fedtune.config import RunConfig, flat_keys, load_config
from fedtune.harness import (
    RunSpec,
    SuiteError,
    build_plan,
    toml_value,
)

REPO = Path(__file__).resolve().parents[2]

CONFIGS = REPO / "configs"
RESULTS = REPO / "benchmarks" / "results"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "recipes-quick"
EXPERIMENTS = ["own", "similar"]
LAST = 3
SIMILAR_MAX_MINUTES = 15.0  # "where cheap": similar-data runs of recipes estimated at most this long
QUICK = ["rounds=2", "eval_every=1", "train.local_steps=2"]
QUICK_DATA = ["data.max_train_samples=200", "data.max_test_samples=64"]  # tasks that take sample caps
QUICK_DATA_TASKS = ("text-classification", "image-classification")

#: (task, data) -> similar data sets: (data name, extra overrides)
SIMILAR: dict[tuple[str, str], list[tuple[str, list[str]]]] = {
    ("text-classification", "sst2"): [
        ("tweets", ["data.max_test_samples=2000"]),
        ("agnews", ["data.max_test_samples=2000"]),
    ],
    ("text-classification", "tweets"): [
        ("sst2", ["data.max_test_samples=872"]),
        ("agnews", ["data.max_test_samples=2000"]),
    ],
    ("text-classification", "agnews"): [
        ("sst2", ["data.max_test_samples=872"]),
        ("tweets", ["data.max_test_samples=2000"]),
    ],
    ("image-classification", "fashion-mnist"): [("digits", [])],
    ("image-classification", "digits"): [("fashion-mnist", ["data.max_test_samples=2000"])],
}

#: rough seconds per local step on one core by model (for --plan only; a finished run's own time wins)
STEP_S = {
    "minilm": 0.19,
    "tiny-bert": 0.005,
    "mobilenet-v2": 0.15,
    "small-cnn": 0.02,
    "conv4": 0.05,
    "audio-cnn": 0.02,
    "fusion-cnn": 0.02,
    "smollm2": 1.5,
}
EVAL_S = {"minilm": 0.0091, "tiny-bert": 0.0002, "smollm2": 0.3}  # per test example


# -- the plan ---------------------------------------------------------------------------------


def recipes(configs: Path = CONFIGS) -> list[Path]:
    """Every recipe of ``configs/*.toml``, sorted (``configs/benchmarks/`` is not read)."""
    return sorted(configs.glob("*.toml"))


def recipe_overrides(path: Path) -> list[str]:
    """The recipe as ``key=value`` overrides of an empty config, with the data set and model the
    task would fill in named (the run folder's config names them; resume compares configs), and
    checked: they give exactly ``load_config(path)`` (but the names)."""
    from fedtune.tasks import resolve_config

    tree = tomllib.loads(path.read_text(encoding="utf-8"))
    tree.pop("name", None)
    tree.pop("output_dir", None)
    overrides = [f"{k}={toml_value(v)}" for k, v in flat_keys(tree).items()]
    written = load_config(path)
    resolved = resolve_config(written)
    for section in ("data", "model"):
        if getattr(written, section).name is None and getattr(resolved, section).name is not None:
            overrides.append(f"{section}.name={toml_value(getattr(resolved, section).name)}")
    rebuilt = load_config(None, overrides)
    if rebuilt.model_dump(exclude={"name", "output_dir"}) != resolved.model_dump(exclude={"name", "output_dir"}):
        raise SuiteError(f"{path.name}: its flattened overrides do not rebuild the recipe")
    return overrides


@dataclass(frozen=True)
class Options:
    rounds: int | None = None  # short-round override
    eval_every: int | None = None
    seeds: tuple[int, ...] | None = None  # None: each recipe's own seed
    extra: tuple[str, ...] = ()  # --set, and --quick's overrides
    similar_max_minutes: float = math.inf  # similar-data runs only for recipes estimated this short
    quick: bool = False  # --quick: also QUICK_DATA for the tasks that take sample caps

    def overrides(self, written_rounds: int | None = None) -> list[str]:
        """The overrides of a recipe written with ``written_rounds`` rounds: ``rounds`` caps them
        (a recipe already shorter keeps its own); None: the statement for the report."""
        out = list(self.extra)
        if self.rounds is not None and (written_rounds is None or written_rounds > self.rounds):
            out.append(f"rounds={self.rounds}")
        if self.eval_every is not None:
            out.append(f"eval_every={self.eval_every}")
        return out


def spec_for(
    path: Path, options: Options, data: str | None = None, data_overrides: list[str] = (), seed: int | None = None
) -> RunSpec:
    """One run of the recipe at ``path`` (on ``data`` instead of its own set when given)."""
    written = load_config(path)
    overrides = recipe_overrides(path)
    if data is not None:
        overrides += [f"data.name={toml_value(data)}", *data_overrides]
    overrides += options.overrides(written.rounds)
    if options.quick and written.task.kind in QUICK_DATA_TASKS:
        overrides += QUICK_DATA
    if seed is not None:
        overrides.append(f"seed={seed}")
    own = data is None
    name = path.stem + ("" if own else f"-on-{data}") + ("" if seed is None else f"-s{seed}")
    config = load_config(None, overrides)
    return RunSpec(
        name,
        overrides,
        {
            "recipe": path.name,
            "task": written.task.kind,
            "method": written.method,
            "data": config.data.name,
            "own": own,
            "written_rounds": written.rounds,
            "seed": config.seed,
            "path": str(path),
            "data_overrides": list(data_overrides),
        },
    )


def specs_own(paths: list[Path], options: Options) -> list[RunSpec]:
    seeds = options.seeds or (None,)
    return [spec_for(p, options, seed=s) for p in paths for s in seeds]


def similar_sets(path: Path) -> list[tuple[str, list[str]]]:
    from fedtune.tasks import resolve_config

    config = resolve_config(load_config(path))
    return SIMILAR.get((config.task.kind, config.data.name), [])


def specs_similar(paths: list[Path], options: Options) -> list[RunSpec]:
    seeds = options.seeds or (None,)
    return [spec_for(p, options, data, extra, seed=s) for p in paths for data, extra in similar_sets(p) for s in seeds]


def cheap(paths: list[Path], options: Options, max_minutes: float) -> list[Path]:
    """The recipes whose own run is estimated (guesses only, so the plan does not change as runs
    finish) at most ``max_minutes`` on one core: those get similar-data runs."""
    return [p for p in paths if rough_cost_s(load_config(None, spec_for(p, options).overrides)) <= 60 * max_minutes]


def build_recipes_plan(paths: list[Path], options: Options, out: Path, similar_max_minutes: float = math.inf):
    """``own``: every recipe; ``similar``: the similar-data runs of the recipes that are cheap enough."""
    return build_plan(
        {
            "own": specs_own(paths, options),
            "similar": specs_similar(cheap(paths, options, similar_max_minutes), options),
        },
        None,
        out,
    )


# -- the table --------------------------------------------------------------------------------


# -- cost (rough: for --plan) -----------------------------------------------------------------


def rough_cost_s(config: RunConfig, previous: dict[str, Any] | None = None) -> float:
    """Seconds on one core: a finished run's own wall time scaled by rounds when there is one,
    else the step and evaluation guesses of :data:`STEP_S` / :data:`EVAL_S`."""
    if previous and previous.get("wall_s") and previous.get("rounds"):
        return previous["wall_s"] * config.rounds / previous["rounds"]
    name = config.model.name or ""
    step = STEP_S.get(name, 0.1) * config.train.batch_size / 16
    if name in ("minilm", "tiny-bert"):
        step *= config.data.max_length / 64
    evals = len({r for r in range(1, config.rounds + 1) if r % config.eval_every == 0} | {config.rounds})
    test = config.data.max_test_samples or 2000
    return (
        10
        + config.rounds * config.federation.sample_size() * config.train.local_steps * step
        + evals * test * EVAL_S.get(name, 0.002)
    )


# -- command line -----------------------------------------------------------------------------
