"""Do the recipes learn? Runs every recipe in ``configs/*.toml`` (not ``configs/benchmarks/``) as
written, on its own data and (where cheap) on similar data, and writes
``benchmarks/results/recipes.md`` and ``recipes.json`` (issue 13, item 6).

Experiments (named runs on :mod:`fedtune.harness`, resumable: a run whose ``summary.json`` holds the
very same config is skipped):

- ``own``: each recipe exactly as written (its data, model, method, rounds, seed), except for the
  options below, which the report states.
- ``similar``: the same recipe on a similar data set (:data:`SIMILAR`: a sentiment recipe on the
  other sentiment set and on AG News, an image recipe on digits as well as Fashion-MNIST), since a
  recipe is a promise on similar data too. Only the data set changes (plus a test subsample for
  the large test sets, named in the table).

Each row: recipe, task, method, rounds run (of the rounds written), final accuracy, the mean of the
last :data:`LAST` evaluations, the reference rate the task names (majority class; chance 1/N for
few-shot; majority answer for instruction tasks), and whether the run is **clearly above** it
(:func:`clearly_above`).

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/recipes.py --plan
    ... [--only own] [--recipes fslora,fedit] [--rounds 10] [--workers 2]
    ... --report-only              # rewrite recipes.md / recipes.json from the run folders
    ... --quick                    # smoke test: 2 rounds, 2 local steps, small data, scratch folder
    ... --set key=value            # an extra override on every run (stated in the report)

``--rounds`` shortens every recipe (the report says so); ``--quick`` writes to
``benchmarks/results/_scratch/recipes-quick/``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from fedtune.config import ConfigError, RunConfig, flat_keys, load_config
from fedtune.harness import (
    MIN_MARGIN,
    RunSpec,
    SuiteError,
    Z,
    build_plan,
    clearly_above,
    distinct_runs,
    load_rounds,
    load_summary,
    mean_of_last,
    output_dir,
    run_suite,
    suite_command,
    suite_parser,
    table_lines,
    toml_value,
)

REPO = Path(__file__).resolve().parents[1]

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


def row_values(spec: RunSpec) -> dict[str, Any]:
    """The finished run's figures (fractions), or Nones."""
    summary = load_summary(spec)
    if summary is None:
        return {
            "done": False,
            "rounds": None,
            "first": None,
            "final": None,
            "mean_last": None,
            "evaluations": 0,
            "reference": None,
            "reference_name": None,
            "test_examples": None,
            "clearly_above": None,
            "margin": None,
            "wall_s": None,
        }
    rounds = load_rounds(spec)
    evaluated = [r for r in rounds if r.get("accuracy") is not None]
    mean_last = mean_of_last(rounds, LAST)
    ok, margin = clearly_above(
        mean_last, summary.get("final_accuracy"), summary.get("majority_accuracy"), summary.get("test_examples")
    )
    return {
        "done": True,
        "rounds": len(rounds),
        "first": evaluated[0]["accuracy"] if evaluated else None,
        "final": summary.get("final_accuracy"),
        "mean_last": mean_last,
        "evaluations": min(LAST, len(evaluated)),
        "reference": summary.get("majority_accuracy"),
        "reference_name": summary.get("reference_name", "majority-class rate"),
        "test_examples": summary.get("test_examples"),
        "clearly_above": ok,
        "margin": margin,
        "wall_s": summary.get("wall_s"),
    }


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def verdict_text(v: dict[str, Any]) -> str:
    if not v["done"]:
        return "pending"
    return ("**yes**" if v["clearly_above"] else "**no**") + f" (needs +{100 * v['margin']:.1f})"


def table_rows(plan) -> list[dict[str, Any]]:
    """One entry per recipe (own run, with its similar-data runs), in recipe order."""
    rows = []
    for spec in plan["own"]:
        similar = [
            s
            for s in plan["similar"]
            if s.labels["recipe"] == spec.labels["recipe"] and s.labels["seed"] == spec.labels["seed"]
        ]
        rows.append({"spec": spec, "own": row_values(spec), "similar": [(s, row_values(s)) for s in similar]})
    return rows


def markdown(plan, command: str, options: Options, selected: list[str], out: Path) -> str:
    rows = table_rows(plan)
    changed = options.overrides() + (QUICK_DATA if options.quick else [])
    lines = [
        "# Do the recipes learn?",
        "",
        "Every recipe in `configs/*.toml` run as written on its own data (and on similar data), against "
        "the reference rate its task names: the test set's majority class (text, image, audio, paired), "
        "chance 1/N (few-shot), the majority answer (instruction).",
        "",
        "Produced by",
        "",
        "```bash",
        command,
        "```",
        "",
        (
            "**Changed from the recipes:** "
            + ", ".join(f"`{c}`" for c in changed)
            + " on every run"
            + (" (rounds: a cap; a recipe written shorter keeps its own)" if options.rounds is not None else "")
            + "."
            if changed
            else "**Every recipe ran exactly as written** (rounds, seed, data, model, method)."
        ),
        "",
        f"**Clearly above** = the mean of the last {LAST} evaluations beats the reference by at least "
        f"max({100 * MIN_MARGIN:g} points, {Z:g} binomial standard errors of an accuracy at the reference "
        "rate on that test set, sqrt(p (1 - p) / n)), *and* the final evaluation alone is above the "
        "reference. The needed margin is printed with each verdict. *First eval* is the run's first "
        "evaluation (after round 1 or its first evaluated round): where it is already far above the reference "
        "(few-shot: nearest-prototype classification on barely trained features), beating the reference says "
        "little about learning, and the gain over the first evaluation is the better reading.",
        "",
        "## Results",
        "",
    ]
    cols = [
        "recipe",
        "task",
        "method",
        "rounds run / written",
        "data",
        "first eval (%)",
        "final (%)",
        f"mean of last {LAST} (%)",
        "reference (%)",
        "clearly above?",
        "similar data",
        "final (%)",
        f"mean of last {LAST} (%)",
        "reference (%)",
        "clearly above?",
    ]
    body = []
    for r in rows:
        s, v = r["spec"], r["own"]
        ref = "–" if v["reference"] is None else f"{pct(v['reference'])} ({v['reference_name']})"
        sim = r["similar"]
        why = "no similar set" if not similar_sets(Path(s.labels["path"])) else "skipped: not cheap"
        sim_cells = (
            [why, "–", "–", "–", "–"]
            if not sim
            else [
                "<br>".join(f"{x.labels['data']}" for x, _ in sim),
                "<br>".join(pct(w["final"]) for _, w in sim),
                "<br>".join(pct(w["mean_last"]) for _, w in sim),
                "<br>".join(pct(w["reference"]) for _, w in sim),
                "<br>".join(verdict_text(w) if "similar" in selected else "not run" for _, w in sim),
            ]
        )
        body.append(
            [
                s.labels["recipe"],
                s.labels["task"],
                s.labels["method"],
                f"{v['rounds'] if v['rounds'] is not None else '–'} / {s.labels['written_rounds']}",
                s.labels["data"],
                pct(v["first"]),
                pct(v["final"]),
                pct(v["mean_last"]),
                ref,
                verdict_text(v),
                *sim_cells,
            ]
        )
    lines += table_lines(cols, body)
    own = [r["own"] for r in rows if r["own"]["done"]]
    sims = [w for r in rows for _, w in r["similar"] if w["done"]]
    lines += [
        "",
        f"Own data: {sum(bool(v['clearly_above']) for v in own)} of {len(own)} finished recipes clearly "
        f"above their reference ({len(rows) - len(own)} pending). Similar data: "
        f"{sum(bool(w['clearly_above']) for w in sims)} of {len(sims)} finished runs clearly above.",
        "",
    ]
    below = [r["spec"].labels["recipe"] for r in rows if r["own"]["done"] and not r["own"]["clearly_above"]]
    if below:
        lines += ["**Not clearly above on their own data:** " + ", ".join(f"`{b}`" for b in below) + ".", ""]
    lines += [
        f"Similar-data runs only for recipes whose own run is estimated at most {options.similar_max_minutes:g} "
        'min on one core ("where cheap"); the others say "skipped: not cheap". '
        "They change only `data.name` (and subsample a large test set: "
        + "; ".join(
            f"{t}/{d} -> " + ", ".join(f"{n} ({' '.join(x) or 'as written'})" for n, x in v)
            for (t, d), v in SIMILAR.items()
        )
        + ").",
        "",
    ]
    lines += [
        "## Runs",
        "",
        *table_lines(
            ["run", "folder", "rounds", "evaluations in the mean", "test examples", "wall s"],
            [
                [
                    s.name,
                    f"`{os.path.relpath(s.run_dir, out)}`",
                    str(v["rounds"] or "–"),
                    str(v["evaluations"]),
                    str(v["test_examples"] or "–"),
                    "–" if v["wall_s"] is None else f"{v['wall_s']:.0f}",
                ]
                for s, v in [(r["spec"], r["own"]) for r in rows] + [x for r in rows for x in r["similar"]]
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def json_report(plan, command: str, options: Options, out: Path) -> dict:
    def entry(spec: RunSpec, v: dict[str, Any]) -> dict:
        return {
            "run": spec.name,
            "recipe": spec.labels["recipe"],
            "task": spec.labels["task"],
            "method": spec.labels["method"],
            "data": spec.labels["data"],
            "own_data": spec.labels["own"],
            "written_rounds": spec.labels["written_rounds"],
            **{k: v[k] for k in v if k != "done"},
            "finished": v["done"],
            "run_dir": os.path.relpath(spec.run_dir, out),
        }

    rows = table_rows(plan)
    return {
        "command": command,
        "changed": options.overrides() + (QUICK_DATA if options.quick else []),
        "last": LAST,
        "min_margin": MIN_MARGIN,
        "z": Z,
        "runs": [entry(r["spec"], r["own"]) for r in rows] + [entry(s, w) for r in rows for s, w in r["similar"]],
    }


def write_reports(plan, out: Path, command: str, options: Options, selected: list[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipes.md").write_text(markdown(plan, command, options, selected, out), encoding="utf-8")
    (out / "recipes.json").write_text(
        json.dumps(json_report(plan, command, options, out), indent=2) + "\n", encoding="utf-8"
    )
    return [out / "recipes.md", out / "recipes.json"]


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


def parse_args(argv: list[str] | None = None):
    p = suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="recipe", budget_minutes=240.0)
    p.add_argument("--recipes", default="", help="comma-separated recipe names (file stems) to run; default all")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="short-round override: cap every recipe's rounds at this (stated in the report)",
    )
    p.add_argument("--eval-every", type=int, default=None, help="evaluation interval override (stated)")
    p.add_argument(
        "--similar-max-minutes",
        type=float,
        default=SIMILAR_MAX_MINUTES,
        help="similar-data runs only for recipes estimated at most this long on one core "
        f"(default {SIMILAR_MAX_MINUTES:g}; 'inf' for all)",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra override on every run (stated in the report); repeatable",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = [e for e in EXPERIMENTS if e in {x.strip() for x in args.only.split(",")}]
    unknown = [e for e in args.only.split(",") if e.strip() and e.strip() not in EXPERIMENTS]
    paths = recipes()
    wanted = [x.strip().removesuffix(".toml") for x in args.recipes.split(",") if x.strip()]
    missing = [w for w in wanted if w not in {p.stem for p in paths}]
    if unknown or missing or not selected:
        print(
            f"--only: unknown {unknown}"
            if unknown
            else f"--recipes: no configs/{missing[0]}.toml"
            if missing
            else "--only: nothing selected"
        )
        return 2
    if wanted:
        paths = [p for p in paths if p.stem in wanted]
    seeds = None if args.seeds.strip() in ("", "recipe") else tuple(int(s) for s in args.seeds.split(","))
    options = Options(
        args.rounds,
        args.eval_every,
        seeds,
        tuple([*(QUICK if args.quick else []), *args.sets]),
        args.similar_max_minutes,
        args.quick,
    )
    out = output_dir(args, RESULTS, QUICK_RESULTS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        # the report covers every recipe and experiment; the command runs the --recipes subset of it
        whole = build_recipes_plan(recipes(), options, out / "recipes", options.similar_max_minutes)
    except (SuiteError, ConfigError) as exc:
        print(exc)
        return 2
    names = {p.name for p in paths}
    plan = {e: [s for s in specs if s.labels["recipe"] in names] for e, specs in whole.items()}
    runs = distinct_runs(plan, selected)
    costs = {s.key: rough_cost_s(s.config, _previous(s)) for s in runs}
    command = suite_command("benchmarks/recipes.py", argv)
    print(f"recipes: {len(paths)} in configs/, experiments {', '.join(selected)} -> {out}")
    return run_suite(
        plan,
        selected,
        args,
        costs,
        lambda: write_reports(whole, out, command, options, EXPERIMENTS),
        root=REPO,
        notes=["estimate: rough (a finished run's own time, else per-model step guesses)"],
    )


def _previous(spec: RunSpec) -> dict[str, Any] | None:
    """The summary of an earlier run in the spec's folder (any config), for the cost estimate."""
    try:
        return json.loads((spec.run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
