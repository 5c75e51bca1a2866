"""What planning buys (issue 41, item 5): a federation of three device classes on AG News with MiniLM,
each method with its own knob (HeteroLoRA: the rank; FSLoRA: the sketch ratio) in three arms;
written to ``benchmarks/results/budgets/three-classes/`` (README.md, results.json, three_classes.png).

Arms: ``planned`` (the planner gives each client the largest setting its budget fits),
``smallest`` (every client states the setting the plan gives the smallest class) and ``drop``
(every client states the largest setting; the clients whose class the plan does not give it never
answer: ``failure_prob = 1``, so they are dropped every round and their data is lost).

Device classes (:data:`CLASSES`), 2 of each in 6 clients, assigned by client id (``cid % 3``) in
explicit ``federation.profiles``, not drawn: a 12-client draw of seed 0 gave 9 / 1 / 2. Budgets are
multiples of the model's predicted cost at the largest setting (rank r): memory 1.15 / 2.3 / 6.9 x
its predicted peak (the README's 4 / 8 / 24 GiB classes, scaled), upload 0.08 / 0.3 / 2 x its
predicted MB per round, speed 0.5 / 1 / 2. The GiB figures are therefore scaled to the model, not
real devices. On MiniLM with LoRA on query/value the rank moves the predicted peak by 3 % and the
upload 59-fold, so the upload decides each class's setting; the memory budgets bind no plan, but the
run measures each fit and drops a client over its budget (a simulated out-of-memory): here the
measured peaks exceed the predicted ones, and phones are dropped so (README).

Every run: ``configs/benchmarks/budgets-three-classes.toml`` plus the method's overrides, the arm's
profiles and the seed. Learning rate: AdamW 3e-3 for both, the recipes' (configs/heterolora.toml;
FSLoRA's plain eq. (5) row in configs/fslora.toml), chosen by benchmarks/fslora/sweep.py on SST-2;
not swept here. AG News, not SST-2: on SST-2 neither method left the majority rate in the 10
rounds this CPU affords (README). Figure: a run's mean of its last :data:`LAST` evaluations, mean
+- sample std over seeds; per class, from metrics.jsonl, the mean over the client-rounds that
trained of ``client_peak_bytes``, ``client_compute_s`` and ``client_bytes_up``.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/budgets/three_classes.py --plan
    ... (run; resumable: rerun the same command) | --report-only | --quick (tiny-bert, a scratch folder)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from fedtune.config import load_config
from fedtune.harness import (
    RunSpec,
    build_plan,
    distinct_runs,
    figure,
    final_accuracy,
    load_rounds,
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
from fedtune.harness.stats import mean, mean_of_last, mean_std
from fedtune.planning.planner import GIB, KNOBS, plan_budgets
from fedtune.runtime import RunContext, resolve_run

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "benchmarks" / "budgets-three-classes.toml"
RESULTS = REPO / "benchmarks" / "results" / "budgets" / "three-classes"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "budgets-three-classes-quick"
EXPERIMENTS = ["agnews"]
#: class -> (memory, upload) as multiples of the largest setting's predicted peak and MB per round; speed
CLASSES = {"phone": (1.15, 0.08, 0.5), "laptop": (2.3, 0.3, 1.0), "workstation": (6.9, 2.0, 2.0)}
#: method -> its overrides (the recipes' options and rates); RABO is left out (README)
METHODS = {
    "heterolora": ['method="heterolora"', 'options={weighting="uniform", padding="zeros", scaling="rank"}'],
    "fslora": ['method="fslora"', 'options={weighting="uniform", download="dense", per_module_sketch=false}'],
}
ARMS = ("planned", "smallest", "drop")
LAST = 2
MEANS = ("peak_gib", "compute_s", "mb_up", "trained", "dropped", "peak_pred", "s_pred", "mb_pred")  # per class
RUN_S, QUICK_RUN_S = 110.0, 15.0  # one run's CPU seconds (the timing run: README)
QUICK = ["model.name=tiny-bert", "rounds=2", "eval_every=1", "data.max_train_samples=300"]
QUICK += ["data.max_test_samples=64", "train.local_steps=1"]


def class_of(cid: int) -> str:
    return list(CLASSES)[cid % len(CLASSES)]


def budgets(largest) -> dict[str, dict]:
    """Each class's profile fields, from ``largest`` (the :class:`ClientPlan` of rank r, no budget).
    The upload codec is pinned to dense float32, so the planner meets a bandwidth budget with the
    method's own knob (rank, sketch ratio), not with top-k or bfloat16 (which it tries first)."""
    return {
        name: {
            "device_class": name,
            "memory_gib": round(m * largest.peak_bytes / GIB, 4),
            "bandwidth_mb": round(b * largest.upload_mb, 4),
            "speed": s,
            "wire_dtype": "float32",
        }
        for name, (m, b, s) in CLASSES.items()
    }


def context(base: list[str], profiles: list[dict] | None = None, recipe: Path = RECIPE) -> RunContext:
    extra = [] if profiles is None else [f"federation.profiles={toml_value(profiles)}"]
    return RunContext(resolve_run(load_config(recipe, [*base, *extra])))


def arm_profiles(method: str, base: list[str], recipe: Path = RECIPE) -> tuple[dict[str, list[dict]], dict]:
    """Each arm's explicit profiles and each arm's setting by class (from the planned arm's plan)."""
    n = load_config(recipe, base).federation.num_clients
    largest = plan_budgets(context(base, recipe=recipe), always=True).clients[0]
    fields = budgets(largest)
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
    }
    label = (lambda v: f"sketch ratio {v:g}") if knob == "sketch_ratio" else (lambda v: f"rank {v}")
    settings = {
        "planned": setting,
        "smallest": dict.fromkeys(CLASSES, label(small)),
        "drop": {k: label(top) if k in fits else "dropped" for k in CLASSES},
    }
    return profiles, settings


def specs(seeds: list[int], quick: bool, recipe: Path = RECIPE, quick_set: list[str] = QUICK) -> tuple[list, dict]:
    """Every run (seed, method, arm) of ``recipe`` (``quick``: with ``quick_set``) and each method's
    settings by arm and class."""
    out, settings = [], {}
    for method, overrides in METHODS.items():
        base = [*(quick_set if quick else []), *overrides]
        profiles, settings[method] = arm_profiles(method, base, recipe)
        for seed in seeds:
            for arm in ARMS:
                extra = [f"federation.profiles={toml_value(profiles[arm])}", f"seed={seed}"]
                labels = {"method": method, "arm": arm, "seed": seed}
                out.append(RunSpec(f"{method}-{arm}-s{seed}", [*base, *extra], labels))
    return sorted(out, key=lambda s: s.labels["seed"]), settings


def class_costs(spec: RunSpec) -> dict[str, dict]:
    """Per class, over the run's client-rounds: how many trained (their fit measured, kept or then
    dropped as over its memory) and how many were dropped (any reason), and the means over the
    trained ones of the measured peak (GiB), compute seconds and MB up."""
    acc = {k: {"trained": 0, "dropped": 0, "peak": [], "s": [], "mb": []} for k in CLASSES}
    for line in load_rounds(spec):
        for c in line.get("clients", []):
            a = acc[class_of(c)]
            a["dropped"] += str(c) in line.get("dropped", {})
            peak = line.get("client_peak_bytes", {}).get(str(c))
            if peak is None:  # never trained (it did not answer)
                continue
            a["trained"] += 1
            a["peak"].append(peak / GIB)
            a["s"].append(line["client_compute_s"].get(str(c), 0.0))
            a["mb"].append(line["client_bytes_up"].get(str(c), 0) / 1e6)
    plan = spec.run_dir / "plan.json" if spec is not None else None
    predicted = {k: {} for k in CLASSES}
    for c in json.loads(plan.read_text())["clients"] if plan is not None and plan.is_file() else []:
        predicted[class_of(c["cid"])] = {
            "peak_pred": c["peak_bytes"] / GIB,
            "s_pred": c["seconds"],
            "mb_pred": c["upload_mb"],
        }
    out = {}
    for k, a in acc.items():
        means = {"peak_gib": mean(a["peak"]), "compute_s": mean(a["s"]), "mb_up": mean(a["mb"])}
        out[k] = {
            "trained": a["trained"],
            "dropped": a["dropped"],
            **means,
            "peak_gib_max": max(a["peak"], default=None),
            **{f: predicted[k].get(f) for f in ("peak_pred", "s_pred", "mb_pred")},
        }
    return out


def rows(runs: list[RunSpec], settings: dict) -> list[dict]:
    out = []
    for method in METHODS:
        for arm in ARMS:
            mine = [s for s in runs if s.labels["method"] == method and s.labels["arm"] == arm]
            done = [s for s in mine if load_summary(s)]
            m, sd, n = final_accuracy(mine, LAST)
            loss = mean_std([x for s in mine if (x := mean_of_last(load_rounds(s), LAST, "loss")) is not None])
            costs = [class_costs(s) for s in done]
            per_class = {
                k: {
                    "setting": settings[method][arm][k],
                    **{f: mean([c[k][f] for c in costs]) for f in MEANS},
                    "peak_gib_max": max((x for c in costs if (x := c[k]["peak_gib_max"]) is not None), default=None),
                }
                for k in CLASSES
            }
            out.append({"method": method, "arm": arm, "accuracy_mean": m, "accuracy_std": sd, "finished": n,
                        "loss_mean": loss[0], "loss_std": loss[1], "classes": per_class})  # fmt: skip
    return out


def cell(v, spec=".3f"):
    return "–" if v is None else format(v, spec)


def accuracy(row: dict, field: str = "accuracy", spec: str = ".2f") -> str:
    if row[f"{field}_mean"] is None:
        return "pending"
    return f"{row[f'{field}_mean']:{spec}} ± {row[f'{field}_std']:{spec}} (n={row['finished']})"


def plot(table: list[dict], path: Path, majority: float, memory: dict[str, float], loss: bool = False) -> None:
    """Accuracy (with ``loss`` also the held-out loss) by method and arm (the majority rate dashed);
    MB up and measured peak per class (each class's memory budget dashed)."""
    with figure(path, 1, 3 + loss, figsize=(13 + 4 * loss, 3.8)) as (_, axes):
        labels = [f"{r['method']}\n{r['arm']}" for r in table]
        xs = range(len(table))
        axes[0].bar(xs, [r["accuracy_mean"] or 0 for r in table], yerr=[r["accuracy_std"] or 0 for r in table])
        axes[0].axhline(majority, color="grey", linestyle="--", label="majority rate")
        axes[0].set_ylim(0, 100)
        axes[0].legend(fontsize=7)
        axes[0].set_ylabel(f"accuracy (%), mean of last {LAST} evals")
        if loss:
            axes[1].bar(xs, [r["loss_mean"] or 0 for r in table], yerr=[r["loss_std"] or 0 for r in table])
            axes[1].set_ylabel(f"held-out loss (nats), mean of last {LAST} evals")
        for ax, field, name in zip(
            axes[1 + loss :], ("mb_up", "peak_gib"), ("MB up per client-round", "measured peak GiB")
        ):
            for i, k in enumerate(CLASSES):
                ax.bar([x + (i - 1) * 0.27 for x in xs], [r["classes"][k][field] or 0 for r in table], 0.27, label=k)
            ax.set_ylabel(name)
        for i, k in enumerate(CLASSES):
            axes[-1].axhline(memory[k], color=f"C{i}", linestyle="--", linewidth=0.8)
            ax.legend(fontsize=7)
        for ax in axes:
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7)


def report(runs: list, settings: dict, out: Path, command: str, doc: str = __doc__, loss: bool = False) -> list[Path]:
    """README.md, results.json and a plot named after ``out`` in ``out``; the first 4 paragraphs of
    ``doc`` head the README; ``loss``: the held-out loss beside the accuracy (table and plot)."""
    out.mkdir(parents=True, exist_ok=True)
    png = out.name.replace("-", "_") + ".png"
    table = rows(runs, settings)
    summaries = [x for s in runs if (x := load_summary(s))]
    majority = 100 * summaries[0]["majority_accuracy"] if summaries else None
    c = runs[0].config
    profiles = c.federation.profiles
    classes = {k: profiles[i].model_dump(exclude_defaults=True) for i, k in enumerate(CLASSES)}
    result = {"last_evaluations": LAST, "majority_rate": majority, "classes": classes, "rows": table}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    acc_rows = [
        [r["method"], r["arm"], *(r["classes"][k]["setting"] for k in CLASSES), accuracy(r)]
        + ([accuracy(r, "loss", ".3f")] if loss else [])
        for r in table
    ]
    cost_rows = [
        [r["method"], r["arm"], k, x["setting"], cell(x["trained"], ".1f"), cell(x["dropped"], ".1f"),
         f"{cell(x['peak_pred'])} / {cell(x['peak_gib'])} / {cell(x['peak_gib_max'])}",
         f"{cell(x['s_pred'], '.2f')} / {cell(x['compute_s'], '.2f')}", f"{cell(x['mb_pred'])} / {cell(x['mb_up'])}"]
        for r in table for k, x in r["classes"].items()
    ]  # fmt: skip
    budget_rows = [
        [k, *(cell(v, ".4g") for v in (x.memory_gib, x.bandwidth_mb, x.speed))] for k, x in zip(CLASSES, profiles)
    ]
    lines = [
        "# What planning buys: three device classes, planned vs smallest setting vs dropped",
        "",
        *(" ".join(p.split()) + "\n" for p in doc.split("\n\n")[:4]),
        *produced_by(command),
        f"These runs: model {c.model.name}, {c.federation.num_clients} clients (all in every round), {c.rounds} rounds "
        f"of {c.train.local_steps} local steps of batch {c.train.batch_size} x {c.data.max_length} tokens, rank "
        f"r = {c.model.lora_rank}, {c.data.max_train_samples or 'all'} training and "
        f"{summaries[0]['test_examples'] if summaries else c.data.max_test_samples} test examples, "
        f"evaluated every {c.eval_every} rounds; majority rate {cell(majority, '.2f')} %.",
        "",
        "Class budgets (scaled to the model):",
        "",
        *table_lines(["class", "memory_gib", "bandwidth_mb", "speed"], budget_rows),
        "",
        f"Accuracy (%){' and held-out loss (nats per answer token)' if loss else ''}: each run's mean of its last "
        f"{LAST} evaluations, mean ± sample std over seeds.",
        "",
        *table_lines(["method", "arm", *CLASSES, "accuracy (%)", *(["loss"] if loss else [])], acc_rows),
        "",
        "Per class, mean over seeds: client-rounds per run that trained (fit measured; kept, or then dropped "
        "over its memory) and that were dropped (any reason); the plan's prediction (`plan.json`) against the "
        "measured over the trained client-rounds: peak GiB (predicted / mean / max), compute seconds and MB up "
        "(predicted / mean).",
        "",
        *table_lines(["method", "arm", "class", "setting", "trained", "dropped", "peak GiB", "s", "MB up"], cost_rows),
        "",
        f"![accuracy and per-class costs]({png})",
        "",
    ]
    paths = [out / "README.md", out / "results.json"]
    if summaries:
        plot(table, out / png, majority, {k: x.memory_gib for k, x in zip(CLASSES, profiles)}, loss)
        paths.append(out / png)
    (out / "README.md").write_text("\n".join(lines) + "\n" + runs_section(runs, out))
    return paths


@dataclass(frozen=True)
class Suite:
    """One task's benchmark: its script's docstring and path, recipe, results and ``--quick`` scratch
    folders and overrides, one run's estimated seconds (full, quick), what it reads from the data
    folder, its experiments (``None``: one per method, so ``--only heterolora`` runs that method
    first) and whether its report gives the held-out loss."""

    doc: str
    script: str
    recipe: Path
    results: Path
    quick_results: Path
    quick: list[str]
    run_s: tuple[float, float]
    reads: str
    experiments: list[str] | None = None
    loss: bool = False

    def names(self) -> list[str]:
        return self.experiments or list(METHODS)

    def plan(self, seeds: list[int], quick: bool, out: Path) -> tuple[dict, dict]:
        """The suite's plan (:func:`specs` by experiment) and each method's settings by arm and class."""
        runs, settings = specs(seeds, quick, self.recipe, self.quick)
        group = {e: [s for s in runs if self.experiments or s.labels["method"] == e] for e in self.names()}
        return build_plan(group, self.recipe, out), settings


AGNEWS = Suite(
    __doc__,
    "benchmarks/budgets/three_classes.py",
    RECIPE,
    RESULTS,
    QUICK_RESULTS,
    QUICK,
    (RUN_S, QUICK_RUN_S),
    "agnews",
    EXPERIMENTS,
)


def main(argv: list[str] | None = None, suite: Suite = AGNEWS) -> int:
    names = suite.names()
    p = suite_parser(suite.doc.split("\n\n")[0], names, seeds="0,1,2", workers=2, budget_minutes=70.0)
    args = p.parse_args(argv)
    selected, seeds = parse_selection(args, names)
    out = output_dir(args, suite.results, suite.quick_results)
    offline_data(suite.reads)
    command = suite_command(suite.script, argv)
    plan, settings = suite.plan(seeds, args.quick, out)
    costs = {s.key: suite.run_s[args.quick] for s in distinct_runs(plan, names)}
    every = [s for e in names for s in plan[e]]
    write = lambda: report(every, settings, out, command, suite.doc, suite.loss)  # noqa: E731
    return run_suite(plan, selected, args, costs, write, root=REPO)


if __name__ == "__main__":
    sys.exit(main())
