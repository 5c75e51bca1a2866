"""What planning buys (issue 41, item 5): a federation of three device classes on AG News with MiniLM
and on Omniglot with Conv4, each method with its own knob (HeteroLoRA: the rank; FSLoRA: the sketch
ratio; RABO: the capacity); written to ``benchmarks/results/budgets/three-classes/`` (README.md,
results.json, three_classes.png).

Arms: ``planned`` (the planner gives each client the largest setting its budget fits),
``smallest`` (every client states the setting the plan gives the smallest class; HeteroLoRA's
global adapter at that rank too, :func:`global_rank`), ``drop``
(every client states the largest setting; the clients whose class the plan does not give it never
answer: ``failure_prob = 1``, so they are dropped every round and their data is lost) and
``compressed`` (the planned arm's budgets without its dense float32 wire: the planner may meet a
bandwidth budget with bfloat16 on the wire and top-k before the method's own knob; AG News only).

Device classes (:data:`CLASSES`), 2 of each in 6 clients, assigned by client id (``cid % 3``) in
explicit ``federation.profiles``, not drawn: a 12-client draw of seed 0 gave 9 / 1 / 2. Budgets are
multiples of the model's predicted cost at the largest setting (rank r): memory 1.15 / 2.3 / 6.9 x
its predicted peak (the README's 4 / 8 / 24 GiB classes, scaled), upload 0.08 / 0.3 / 2 x its
predicted MB per round, speed 0.5 / 1 / 2, pinned at the full scale as the model priced them for
the eleventh session's runs (:data:`PINNED`: a device's budget does not move when the memory model
is refit). The GiB figures are therefore scaled to the model, not real devices. On MiniLM with
LoRA on query/value the rank moves the predicted peak by 3 % and the upload 59-fold, so the upload
decides each class's setting; the memory budgets bind no plan, but the run measures each fit and
drops a client over its budget (a simulated out-of-memory; README).

RABO (experiment ``omniglot``): ``configs/rabo.toml`` (5-way 1-shot, its rates) scaled to 6 clients
and :data:`RABO_SCALE`; the planned profiles state budgets only (RABO's uploads are no codec's, so
no wire field and no compressed arm). Memory decides its capacity: budgets 0.5 / 0.9 / 2 x capacity
1's predicted peak give 1/4, 1/2 and 1 (:data:`RABO_CLASSES`); upload 2 x binds none.

AG News: ``configs/benchmarks/budgets-three-classes.toml`` plus the method's overrides, the arm's
profiles and the seed. Learning rate: AdamW 3e-3 for both, the recipes' (configs/heterolora.toml;
FSLoRA's plain eq. (5) row in configs/fslora.toml), chosen by benchmarks/fslora/sweep.py on SST-2;
not swept here. AG News, not SST-2: on SST-2 neither method left the majority rate in the 10
rounds this CPU affords (README). Figure: a run's mean of its last :data:`LAST` evaluations, mean
+- sample std over seeds; per class, from metrics.jsonl, the mean over the client-rounds that
trained of ``client_peak_bytes``, ``client_compute_s`` and ``client_bytes_up``.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/budgets/three_classes.py --plan
    ... (run; resumable: rerun the same command) | --report-only | --quick (tiny-bert, RABO 2 rounds; a scratch folder)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from class_table import CLASSES, COST_HEADER, LAST, accuracy, cell, class_of, paired, paired_section, ratio, rows

from fedtune.config import load_config
from fedtune.harness import (
    RunSpec,
    build_plan,
    distinct_runs,
    figure,
    load_summary,
    offline_data,
    output_dir,
    parse_selection,
    produced_by,
    run_suite,
    runs_section,
    suite_command,
    suite_parser,
    table_lines,
    toml_value,
)
from fedtune.planning.planner import GIB, KNOBS, plan_budgets
from fedtune.runtime import RunContext, resolve_run

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "benchmarks" / "budgets-three-classes.toml"
RESULTS = REPO / "benchmarks" / "results" / "budgets" / "three-classes"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "budgets-three-classes-quick"
RECIPES = {"agnews": RECIPE, "omniglot": REPO / "configs" / "rabo.toml"}
RABO_CLASSES = {"phone": (0.5, 2.0, 0.5), "laptop": (0.9, 2.0, 1.0), "workstation": (2.0, 2.0, 2.0)}
#: RABO's scale on this CPU (the timing run: README); capacity 1 stated for the largest setting's cost
RABO_SCALE = ["federation.num_clients=6", "federation.profiles=[{capacity=1.0}]", "rounds=30", "eval_every=5"]
#: method -> its overrides (the recipes' options and rates)
METHODS = {
    "heterolora": ['method="heterolora"', 'options={weighting="uniform", padding="zeros", scaling="rank"}'],
    "fslora": ['method="fslora"', 'options={weighting="uniform", download="dense", per_module_sketch=false}'],
    "rabo": RABO_SCALE,
}
EXPERIMENT = {"heterolora": "agnews", "fslora": "agnews", "rabo": "omniglot"}
ARMS = ("planned", "smallest", "drop", "compressed")
#: method -> its arms (RABO: no upload codec to plan)
METHOD_ARMS = {"heterolora": ARMS, "fslora": ARMS, "rabo": ARMS[:3]}
#: experiment -> one run's CPU seconds, full and --quick (the timing runs: README)
RUN_S = {"agnews": (215.0, 15.0), "omniglot": (380.0, 15.0)}
QUICK = ["model.name=tiny-bert", "model.lora_rank=32", "rounds=2", "eval_every=1", "data.max_train_samples=300"]
QUICK += ["data.max_test_samples=64", "train.local_steps=1"]
QUICK_RABO = ["rounds=2", "eval_every=1", "task.eval_episodes=20"]


@dataclass(frozen=True)
class Suite:
    """One task's benchmark: its script's docstring and path, results and ``--quick`` scratch
    folders, what it reads from the data folder, each method's experiment and arms, each
    experiment's recipe, ``--quick`` overrides and one run's estimated seconds (full, quick), and
    whether its report gives the held-out loss; ``pinned``: each experiment's class budgets at the
    full scale (memory GiB, upload MB a round), fixed as a device's are (:data:`PINNED`)."""

    doc: str
    script: str
    results: Path
    quick_results: Path
    reads: str
    experiment: dict[str, str]
    arms: dict[str, tuple[str, ...]]
    recipes: dict[str, Path]
    quick: dict[str, list[str]]
    run_s: dict[str, tuple[float, float]]
    loss: bool = False
    pinned: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)

    def recipe(self, method: str) -> Path:
        return self.recipes[self.experiment[method]]

    def names(self) -> list[str]:
        return list(self.recipes)

    def plan(
        self, seeds: list[int], quick: bool, out: Path, extra: tuple[str, ...] = (), methods: list[str] | None = None
    ) -> tuple[dict, dict]:
        """The suite's plan (:func:`specs` by experiment, ``extra`` overrides on every run; ``methods``:
        only theirs) and each method's settings by arm and class."""
        runs, settings = specs(seeds, quick, self, extra, methods)
        plan = {}
        for e, recipe in self.recipes.items():
            plan |= build_plan({e: [s for s in runs if self.experiment[s.labels["method"]] == e]}, recipe, out)
        return plan, settings


#: experiment -> class -> (memory GiB, upload MB a round) at the full scale: CLASSES' (RABO_CLASSES')
#: multiples of the predicted cost at the largest setting, as the memory model priced it at the
#: eleventh session's runs. Fixed, as a device's budget is: a later refit of the model changes what
#: the planner predicts and picks inside them (each run's plan.json), not the devices, so it does
#: not void the runs; ``--quick`` (other models) still derives them from the multiples.
PINNED = {
    "agnews": {"phone": (0.21, 0.1892), "laptop": (0.4201, 0.7096), "workstation": (1.2603, 4.7309)},
    "omniglot": {"phone": (0.0368, 0.9022), "laptop": (0.0662, 0.9022), "workstation": (0.1471, 0.9022)},
}

AGNEWS = Suite(
    __doc__,
    "benchmarks/budgets/three_classes.py",
    RESULTS,
    QUICK_RESULTS,
    "agnews/omniglot",
    EXPERIMENT,
    METHOD_ARMS,
    RECIPES,
    {"agnews": QUICK, "omniglot": QUICK_RABO},
    RUN_S,
    pinned=PINNED,
)


def budgets(largest, method: str, pinned: dict[str, tuple[float, float]] | None = None) -> dict[str, dict]:
    """Each class's profile fields: its ``pinned`` (memory GiB, upload MB), else the class's
    multiples of ``largest`` (the :class:`ClientPlan` of rank r or capacity 1, no budget). The LoRA
    methods' upload codec is pinned to dense float32, so the planner meets a bandwidth budget with
    the method's own knob (rank, sketch ratio), not with top-k or bfloat16 (which it tries first;
    the ``compressed`` arm unpins it)."""
    lora = KNOBS[method] != "capacity"
    classes = CLASSES if lora else RABO_CLASSES
    if pinned is None:
        pinned = {
            k: (round(m * largest.peak_bytes / GIB, 4), round(b * largest.upload_mb, 4))
            for k, (m, b, _) in classes.items()
        }
    return {
        name: {
            "device_class": name,
            "memory_gib": pinned[name][0],
            "bandwidth_mb": pinned[name][1],
            "speed": s,
            **({"wire_dtype": "float32"} if lora else {}),
        }
        for name, (_, _, s) in classes.items()
    }


def context(base: list[str], profiles: list[dict] | None = None, recipe: Path = RECIPE) -> RunContext:
    extra = [] if profiles is None else [f"federation.profiles={toml_value(profiles)}"]
    return RunContext(resolve_run(load_config(recipe, [*base, *extra])))


def arm_profiles(
    method: str, base: list[str], suite: Suite = AGNEWS, pin: bool = False
) -> tuple[dict[str, list[dict]], dict]:
    """Each of the method's arms (``suite.arms``): its explicit profiles and its setting by class
    (from the planned arm's plan); ``pin``: the class budgets are the suite's pinned ones for the
    method's experiment (the full scale)."""
    recipe = suite.recipe(method)
    n = load_config(recipe, base).federation.num_clients
    pinned = suite.pinned.get(suite.experiment[method]) if pin else None
    largest = None if pinned else plan_budgets(context(base, recipe=recipe), always=True).clients[0]
    fields = budgets(largest, method, pinned)
    planned = [fields[class_of(c)] for c in range(n)]
    plan = plan_budgets(context(base, planned, recipe))
    knob = KNOBS[method]
    top = max(getattr(p, knob) for p in plan.profiles)
    value = {class_of(c.cid): getattr(p, knob) for c, p in zip(plan.clients, plan.profiles)}
    setting = {class_of(c.cid): c.setting for c in plan.clients}
    small = value[min(CLASSES, key=lambda k: fields[k]["memory_gib"] * fields[k]["bandwidth_mb"])]
    fits = {k for k, v in value.items() if v == top}
    profiles = {
        "planned": planned,
        "smallest": [{**p, knob: small} for p in planned],
        "drop": [{**p, knob: top, **({} if p["device_class"] in fits else {"failure_prob": 1.0})} for p in planned],
        "compressed": [{k: v for k, v in p.items() if k != "wire_dtype"} for p in planned],
    }
    label = (lambda v: f"{knob.replace('_', ' ')} {v:g}") if knob != "rank" else (lambda v: f"rank {v}")
    settings = {
        "planned": setting,
        "smallest": dict.fromkeys(CLASSES, label(small)),
        "drop": {k: label(top) if k in fits else "dropped" for k in CLASSES},
    }
    if "compressed" in suite.arms[method]:
        compressed = plan_budgets(context(base, profiles["compressed"], recipe)).clients
        settings["compressed"] = {class_of(c.cid): c.setting for c in compressed}
    else:
        del profiles["compressed"]
    return profiles, settings


def global_rank(method: str, arm: str, profiles: list[dict]) -> list[str]:
    """The smallest arm of a rank knob sets the global adapter to the clients' rank
    (``model.lora_rank``), as a federation of such devices would. Left at r, HeteroLoRA's ``scaling
    = "rank"`` would train each rank-4 client at alpha/4 and evaluate the global model at alpha/r:
    every update r/4 times weaker than it trained (the causal-LM runs before this measured that arm
    1.5 nats worse). The clients still train at alpha/4; the evaluated model now uses it too."""
    if arm != "smallest" or KNOBS[method] != "rank":
        return []
    return [f"model.lora_rank={profiles[0]['rank']}"]


def specs(
    seeds: list[int], quick: bool, suite: Suite = AGNEWS, extra: tuple[str, ...] = (), methods: list[str] | None = None
) -> tuple[list[RunSpec], dict]:
    """Every run (seed, method, arm) of ``suite`` (``extra`` overrides on each; ``methods``: only
    theirs, None: all) and each method's settings by arm and class."""
    out, settings = [], {}
    for method, experiment in suite.experiment.items():
        if methods is not None and method not in methods:
            continue
        base = [*METHODS[method], *(suite.quick[experiment] if quick else []), *extra]
        profiles, settings[method] = arm_profiles(method, base, suite, pin=not quick)
        for seed in seeds:
            for arm in suite.arms[method]:
                own = [f"federation.profiles={toml_value(profiles[arm])}", f"seed={seed}"]
                own += global_rank(method, arm, profiles[arm])
                labels = {"method": method, "arm": arm, "seed": seed}
                out.append(RunSpec(f"{method}-{arm}-s{seed}", [*base, *own], labels))
    return sorted(out, key=lambda s: s.labels["seed"]), settings


def plot(table: list[dict], path: Path, majority: float | None, loss: bool = False) -> None:
    """Accuracy (``loss``: and the held-out loss) by method and arm (the majority rate dashed,
    Omniglot's chance dotted where RABO ran); per class, MB up and the measured over the predicted
    peak (1 dashed)."""
    with figure(path, 1, 3 + loss, figsize=(15 + 4 * loss, 4.6)) as (_, axes):
        labels = [f"{r['method']}\n{r['arm']}" for r in table]
        xs = range(len(table))
        axes[0].bar(xs, [r["accuracy_mean"] or 0 for r in table], yerr=[r["accuracy_std"] or 0 for r in table])
        if majority is not None:
            axes[0].axhline(majority, color="grey", linestyle="--", label="majority rate")
        if any(r["method"] == "rabo" for r in table):
            axes[0].axhline(20.0, color="grey", linestyle=":", label="Omniglot 5-way chance")
        axes[0].set_ylim(0, 100)
        axes[0].legend(fontsize=7)
        axes[0].set_ylabel(f"accuracy (%), mean of last {LAST} evals")
        if loss:
            axes[1].bar(xs, [r["loss_mean"] or 0 for r in table], yerr=[r["loss_std"] or 0 for r in table])
            axes[1].set_ylabel(f"held-out loss (nats), mean of last {LAST} evals")
        for ax, value, name in zip(
            axes[1 + loss :],
            (lambda x: x["mb_up"] or 0, ratio),
            ("MB up per client-round", "measured / predicted peak"),
        ):
            for i, k in enumerate(CLASSES):
                ax.bar([x + (i - 1) * 0.27 for x in xs], [value(r["classes"][k]) for r in table], 0.27, label=k)
            ax.set_ylabel(name)
            ax.legend(fontsize=7)
        axes[-1].axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        for ax in axes:
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7, rotation=60)


def report(runs: list, settings: dict, out: Path, command: str, doc: str = __doc__, loss: bool = False) -> list[Path]:
    """README.md, results.json and a plot named after ``out`` in ``out``; ``doc`` (but its last
    paragraph, the commands) heads the README; ``loss``: the held-out loss beside the accuracy."""
    out.mkdir(parents=True, exist_ok=True)
    png = out.name.replace("-", "_") + ".png"
    table = rows(runs, settings)
    summaries = [x for s in runs if (x := load_summary(s))]
    text = [x for s in runs if s.labels["method"] != "rabo" and (x := load_summary(s))]
    majority = 100 * text[0]["majority_accuracy"] if text else None
    first: dict = {}  # data set -> its first run's config
    for s in runs:
        first.setdefault(s.config.data.name, s.config)
    dumps = {e: [p.model_dump(exclude_defaults=True) for p in c.federation.profiles] for e, c in first.items()}
    classes = {e: {k: d[i] for i, k in enumerate(CLASSES)} for e, d in dumps.items()}
    pairs = paired(runs)
    result = {"last_evaluations": LAST, "majority_rate": majority, "classes": classes, "rows": table, "paired": pairs}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    acc_rows = [
        [r["method"], r["arm"], *(r["classes"][k]["setting"] for k in CLASSES), accuracy(r)]
        + ([accuracy(r, "loss", ".3f")] if loss else [])
        for r in table
    ]
    cost_rows = [
        [r["method"], r["arm"], k, x["setting"], cell(x["trained"], ".1f"), cell(x["dropped"], ".1f"),
         f"{cell(x['peak_gib_pred'])} / {cell(x['peak_gib'])} / {cell(x['peak_gib_max'])}",
         f"{cell(x['s_pred'], '.2f')} / {cell(x['compute_s'], '.2f')}", f"{cell(x['mb_pred'])} / {cell(x['mb_up'])}"]
        for r in table for k, x in r["classes"].items()
    ]  # fmt: skip
    budget_rows = [
        [e, k, *(cell(getattr(x, f), ".4g") for f in ("memory_gib", "bandwidth_mb", "speed"))]
        for e, c in first.items()
        for k, x in zip(CLASSES, c.federation.profiles)
    ]
    c = runs[0].config
    r = next((s.config for s in runs if s.labels["method"] == "rabo"), None)
    omniglot = [] if r is None else [
        f"Omniglot (RABO): model {r.model.name}, {r.federation.num_clients} clients (all in every round), {r.rounds} "
        f"rounds of {r.train.batch_size} {r.task.n_way}-way {r.task.k_shot}-shot episodes a client, evaluated every "
        f"{r.eval_every} rounds on {r.task.eval_episodes} held-out episodes; chance 20 %.",
        "",
    ]  # fmt: skip
    lines = [
        "# What planning buys: three device classes, planned vs smallest setting vs dropped",
        "",
        *(" ".join(p.split()) + "\n" for p in doc.split("\n\n")[:-1]),
        *produced_by(command),
        f"These runs: model {c.model.name}, {c.federation.num_clients} clients (all in every round), {c.rounds} rounds "
        f"of {c.train.local_steps} local steps of batch {c.train.batch_size} x {c.data.max_length} tokens, rank "
        f"r = {c.model.lora_rank}, {c.data.max_train_samples or 'all'} training and "
        f"{text[0]['test_examples'] if text else c.data.max_test_samples} test examples, "
        f"evaluated every {c.eval_every} rounds; majority rate {cell(majority, '.2f')} %.",
        "",
        *omniglot,
        "Class budgets (scaled to each model):",
        "",
        *table_lines(["data", "class", "memory_gib", "bandwidth_mb", "speed"], budget_rows),
        "",
        f"Accuracy (%){' and held-out loss (nats per answer token)' if loss else ''}: each run's mean of its last "
        f"{LAST} evaluations, mean ± sample std over seeds.",
        "",
        *table_lines(["method", "arm", *CLASSES, "accuracy (%)", *(["loss"] if loss else [])], acc_rows),
        "",
        *paired_section(runs, pairs, loss),
        "Per class, mean over seeds: client-rounds per run that trained (fit measured; kept, or then dropped "
        "over its memory) and that were dropped (any reason); over the trained client-rounds, the measured "
        "peak GiB (mean / max), compute seconds and MB up (mean), each after the plan's prediction for the "
        "class (plan.json; its seconds are at the class's speed, the measured ones this CPU's).",
        "",
        *table_lines(COST_HEADER, cost_rows),
        "",
        f"![accuracy and per-class costs]({png})",
        "",
    ]
    paths = [out / "README.md", out / "results.json"]
    if summaries:
        plot(table, out / png, majority, loss)
        paths.append(out / png)
    (out / "README.md").write_text("\n".join(lines) + "\n" + runs_section(runs, out))
    return paths


def main(argv: list[str] | None = None, suite: Suite = AGNEWS) -> int:
    names = suite.names()
    p = suite_parser(suite.doc.split("\n\n")[0], names, seeds="0,1,2,3,4", workers=2, budget_minutes=240.0)
    p.add_argument("--lr", type=float, help="train.lr of every run (a sweep: give each rate its own --out)")
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(suite.experiment)} (default: all)")
    args = p.parse_args(argv)
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods is not None and not set(methods) <= set(suite.experiment):
        print(f"--methods: expected some of {', '.join(suite.experiment)}, got {args.methods!r}")
        return 2
    selected, seeds = parse_selection(args, names)
    out = output_dir(args, suite.results, suite.quick_results)
    offline_data(suite.reads)
    command = suite_command(suite.script, argv)
    lr = () if args.lr is None else (f"train.lr={args.lr}",)
    plan, settings = suite.plan(seeds, args.quick, out, lr, methods)
    costs = {s.key: suite.run_s[s.experiment][args.quick] for s in distinct_runs(plan, names)}
    every = [s for e in names for s in plan[e]]
    write = lambda: report(every, settings, out, command, suite.doc, suite.loss)  # noqa: E731
    return run_suite(plan, selected, args, costs, write, root=REPO)


if __name__ == "__main__":
    sys.exit(main())
