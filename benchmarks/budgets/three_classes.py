"""What planning buys (issue 41, item 5): a federation of three device classes on AG News with MiniLM
and on Omniglot with Conv4, each method with its own knob (HeteroLoRA: the rank; FSLoRA: the sketch
ratio; RABO: the capacity); written to ``benchmarks/results/budgets/three-classes/`` (README.md,
results.json, three_classes.png).

Arms: ``planned`` (the planner gives each client the largest setting its budget fits),
``smallest`` (every client states the setting the plan gives the smallest class), ``drop``
(every client states the largest setting; the clients whose class the plan does not give it never
answer: ``failure_prob = 1``, so they are dropped every round and their data is lost) and
``compressed`` (the planned arm's budgets without its dense float32 wire: the planner may meet a
bandwidth budget with bfloat16 on the wire and top-k before the method's own knob; AG News only).

Device classes (:data:`CLASSES`), 2 of each in 6 clients, assigned by client id (``cid % 3``) in
explicit ``federation.profiles``, not drawn: a 12-client draw of seed 0 gave 9 / 1 / 2. Budgets are
multiples of the model's predicted cost at the largest setting (rank r): memory 1.15 / 2.3 / 6.9 x
its predicted peak (the README's 4 / 8 / 24 GiB classes, scaled), upload 0.08 / 0.3 / 2 x its
predicted MB per round, speed 0.5 / 1 / 2. The GiB figures are therefore scaled to the model, not
real devices. On MiniLM with LoRA on query/value the rank moves the predicted peak by 3 % and the
upload 59-fold, so the upload decides each class's setting; the memory budgets bind no plan, but the
run measures each fit and drops a client over its budget (a simulated out-of-memory): here the
measured peaks exceed the predicted ones, and phones are dropped so (README).

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
from fedtune.harness.stats import mean
from fedtune.planning.planner import GIB, KNOBS, plan_budgets
from fedtune.report import client_rows
from fedtune.runtime import RunContext, resolve_run

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "benchmarks" / "budgets-three-classes.toml"
RESULTS = REPO / "benchmarks" / "results" / "budgets" / "three-classes"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "budgets-three-classes-quick"
EXPERIMENTS = ["agnews", "omniglot"]
RECIPES = {"agnews": RECIPE, "omniglot": REPO / "configs" / "rabo.toml"}
#: class -> (memory, upload) as multiples of the largest setting's predicted peak and MB per round; speed
CLASSES = {"phone": (1.15, 0.08, 0.5), "laptop": (2.3, 0.3, 1.0), "workstation": (6.9, 2.0, 2.0)}
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
LAST = 2
#: per class, averaged over seeds (``*_pred``: the run's plan.json, predicted)
MEANS = ("peak_gib", "compute_s", "mb_up", "trained", "dropped", "peak_gib_pred", "s_pred", "mb_pred")
RUN_S = {"agnews": 110.0, "omniglot": 380.0}  # one run's CPU seconds (the timing runs: README)
QUICK_RUN_S = 15.0
QUICK = ["model.name=tiny-bert", "model.lora_rank=32", "rounds=2", "eval_every=1", "data.max_train_samples=300"]
QUICK += ["data.max_test_samples=64", "train.local_steps=1"]
QUICK_RABO = ["rounds=2", "eval_every=1", "task.eval_episodes=20"]


def class_of(cid: int) -> str:
    return list(CLASSES)[cid % len(CLASSES)]


def budgets(largest, method: str) -> dict[str, dict]:
    """Each class's profile fields, from ``largest`` (the :class:`ClientPlan` of rank r or capacity
    1, no budget). The LoRA methods' upload codec is pinned to dense float32, so the planner meets a
    bandwidth budget with the method's own knob (rank, sketch ratio), not with top-k or bfloat16
    (which it tries first; the ``compressed`` arm unpins it)."""
    lora = EXPERIMENT[method] == "agnews"
    return {
        name: {
            "device_class": name,
            "memory_gib": round(m * largest.peak_bytes / GIB, 4),
            "bandwidth_mb": round(b * largest.upload_mb, 4),
            "speed": s,
            **({"wire_dtype": "float32"} if lora else {}),
        }
        for name, (m, b, s) in (CLASSES if lora else RABO_CLASSES).items()
    }


def context(method: str, base: list[str], profiles: list[dict] | None = None) -> RunContext:
    extra = [] if profiles is None else [f"federation.profiles={toml_value(profiles)}"]
    return RunContext(resolve_run(load_config(RECIPES[EXPERIMENT[method]], [*base, *extra])))


def arm_profiles(method: str, base: list[str]) -> tuple[dict[str, list[dict]], dict[str, dict[str, str]]]:
    """Each arm's explicit profiles and each arm's setting by class (from the planned arm's plan)."""
    n = load_config(RECIPES[EXPERIMENT[method]], base).federation.num_clients
    largest = plan_budgets(context(method, base), always=True).clients[0]
    fields = budgets(largest, method)
    planned = [fields[class_of(c)] for c in range(n)]
    plan = plan_budgets(context(method, base, planned))
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
    if "compressed" in METHOD_ARMS[method]:
        compressed = plan_budgets(context(method, base, profiles["compressed"])).clients
        settings["compressed"] = {class_of(c.cid): c.setting for c in compressed}
    else:
        del profiles["compressed"]
    return profiles, settings


def specs(seeds: list[int], quick: bool) -> tuple[list[RunSpec], dict]:
    """Every run (seed, method, arm) and each method's settings by arm and class."""
    out, settings = [], {}
    for method, overrides in METHODS.items():
        base = [*overrides, *((QUICK if EXPERIMENT[method] == "agnews" else QUICK_RABO) if quick else [])]
        profiles, settings[method] = arm_profiles(method, base)
        for seed in seeds:
            for arm in METHOD_ARMS[method]:
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
    out = {}
    for k, a in acc.items():
        means = {"peak_gib": mean(a["peak"]), "compute_s": mean(a["s"]), "mb_up": mean(a["mb"])}
        out[k] = {
            "trained": a["trained"],
            "dropped": a["dropped"],
            **means,
            "peak_gib_max": max(a["peak"], default=None),
        }
    return out


def class_predictions(spec: RunSpec) -> dict[str, dict]:
    """Per class, the run's plan.json prediction (the mean over the class's clients) of the peak
    (GiB), seconds and MB up per round."""
    planned = client_rows(spec.run_dir, []) or []
    keys = ("peak_gib_pred", "s_pred", "mb_pred")
    return {
        k: {key: mean([r.predicted[i] for r in planned if r.device_class == k]) for i, key in enumerate(keys)}
        for k in CLASSES
    }


def rows(runs: list[RunSpec], settings: dict) -> list[dict]:
    out = []
    for method in METHODS:
        for arm in METHOD_ARMS[method]:
            mine = [s for s in runs if s.labels["method"] == method and s.labels["arm"] == arm]
            done = [s for s in mine if load_summary(s)]
            m, sd, n = final_accuracy(mine, LAST)
            preds = [class_predictions(s) for s in done]
            costs = [{k: {**c[k], **p[k]} for k in CLASSES} for c, p in zip(map(class_costs, done), preds)]
            per_class = {
                k: {
                    "setting": settings[method][arm][k],
                    **{f: mean([c[k][f] for c in costs]) for f in MEANS},
                    "peak_gib_max": max((x for c in costs if (x := c[k]["peak_gib_max"]) is not None), default=None),
                }
                for k in CLASSES
            }
            out.append({"method": method, "arm": arm, "accuracy_mean": m, "accuracy_std": sd, "finished": n,
                        "classes": per_class})  # fmt: skip
    return out


COST_HEADER = ["method", "arm", "class", "setting", "trained", "dropped"]
COST_HEADER += ["peak GiB pred / mean / max", "s pred / meas", "MB up pred / meas"]


def cell(v, spec=".3f"):
    return "–" if v is None else format(v, spec)


def accuracy(row: dict) -> str:
    if row["accuracy_mean"] is None:
        return "pending"
    return f"{row['accuracy_mean']:.2f} ± {row['accuracy_std']:.2f} (n={row['finished']})"


def ratio(x: dict) -> float:
    """A class's measured over predicted mean peak (0 where either is missing)."""
    return x["peak_gib"] / x["peak_gib_pred"] if x["peak_gib"] and x["peak_gib_pred"] else 0


def plot(table: list[dict], path: Path, majority: float | None) -> None:
    """Accuracy by method and arm (AG News's majority rate dashed, Omniglot's chance dotted); per
    class, MB up and the measured over the predicted peak (1 dashed)."""
    with figure(path, 1, 3, figsize=(15, 4.6)) as (_, axes):
        labels = [f"{r['method']}\n{r['arm']}" for r in table]
        xs = range(len(table))
        axes[0].bar(xs, [r["accuracy_mean"] or 0 for r in table], yerr=[r["accuracy_std"] or 0 for r in table])
        if majority is not None:
            axes[0].axhline(majority, color="grey", linestyle="--", label="AG News majority rate")
        axes[0].axhline(20.0, color="grey", linestyle=":", label="Omniglot 5-way chance")
        axes[0].set_ylim(0, 100)
        axes[0].legend(fontsize=7)
        axes[0].set_ylabel(f"accuracy (%), mean of last {LAST} evals")
        for ax, value, name in zip(
            axes[1:], (lambda x: x["mb_up"] or 0, ratio), ("MB up per client-round", "measured / predicted peak")
        ):
            for i, k in enumerate(CLASSES):
                ax.bar([x + (i - 1) * 0.27 for x in xs], [value(r["classes"][k]) for r in table], 0.27, label=k)
            ax.set_ylabel(name)
            ax.legend(fontsize=7)
        axes[2].axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        for ax in axes:
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7, rotation=60)


def report(runs: list[RunSpec], settings: dict, out: Path, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    table = rows(runs, settings)
    summaries = [x for s in runs if (x := load_summary(s))]
    text = [x for s in runs if EXPERIMENT[s.labels["method"]] == "agnews" and (x := load_summary(s))]
    majority = 100 * text[0]["majority_accuracy"] if text else None
    first = {e: next(s.config for s in runs if EXPERIMENT[s.labels["method"]] == e) for e in EXPERIMENTS}
    dumps = {e: [p.model_dump(exclude_defaults=True) for p in c.federation.profiles] for e, c in first.items()}
    classes = {e: {k: d[i] for i, k in enumerate(CLASSES)} for e, d in dumps.items()}
    result = {"last_evaluations": LAST, "majority_rate": majority, "classes": classes, "rows": table}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    acc_rows = [[r["method"], r["arm"], *(r["classes"][k]["setting"] for k in CLASSES), accuracy(r)] for r in table]
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
    c, r = first["agnews"], first["omniglot"]
    lines = [
        "# What planning buys: three device classes, planned vs smallest setting vs dropped",
        "",
        *(" ".join(p.split()) + "\n" for p in __doc__.split("\n\n")[:5]),
        *produced_by(command),
        f"These runs: model {c.model.name}, {c.federation.num_clients} clients (all in every round), {c.rounds} rounds "
        f"of {c.train.local_steps} local steps of batch {c.train.batch_size} x {c.data.max_length} tokens, rank "
        f"r = {c.model.lora_rank}, {c.data.max_train_samples} training and {c.data.max_test_samples} test examples, "
        f"evaluated every {c.eval_every} rounds; majority rate {cell(majority, '.2f')} %.",
        "",
        f"Omniglot (RABO): model {r.model.name}, {r.federation.num_clients} clients (all in every round), {r.rounds} "
        f"rounds of {r.train.batch_size} {r.task.n_way}-way {r.task.k_shot}-shot episodes a client, evaluated every "
        f"{r.eval_every} rounds on {r.task.eval_episodes} held-out episodes; chance 20 %.",
        "",
        "Class budgets (scaled to each model):",
        "",
        *table_lines(["experiment", "class", "memory_gib", "bandwidth_mb", "speed"], budget_rows),
        "",
        f"Accuracy (%): each run's mean of its last {LAST} evaluations, mean ± sample std over seeds.",
        "",
        *table_lines(["method", "arm", *CLASSES, "accuracy (%)"], acc_rows),
        "",
        "Per class, mean over seeds: client-rounds per run that trained (fit measured; kept, or then dropped "
        "over its memory) and that were dropped (any reason); over the trained client-rounds, the measured "
        "peak GiB (mean / max), compute seconds and MB up (mean), each after the plan's prediction for the "
        "class (plan.json; its seconds are at the class's speed, the measured ones this CPU's).",
        "",
        *table_lines(COST_HEADER, cost_rows),
        "",
        "![accuracy and per-class costs](three_classes.png)",
        "",
    ]
    paths = [out / "README.md", out / "results.json"]
    if summaries:
        plot(table, out / "three_classes.png", majority)
        paths.append(out / "three_classes.png")
    (out / "README.md").write_text("\n".join(lines) + "\n" + runs_section(runs, out))
    return paths


def main(argv: list[str] | None = None) -> int:
    p = suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="0,1,2", workers=2, budget_minutes=70.0)
    args = p.parse_args(argv)
    selected, seeds = parse_selection(args, EXPERIMENTS)
    out = output_dir(args, RESULTS, QUICK_RESULTS)
    offline_data("agnews/omniglot")
    command = suite_command("benchmarks/budgets/three_classes.py", argv)
    runs, settings = specs(seeds, args.quick)
    plan = {}
    for e in EXPERIMENTS:
        plan |= build_plan({e: [s for s in runs if EXPERIMENT[s.labels["method"]] == e]}, RECIPES[e], out)
    costs = {s.key: QUICK_RUN_S if args.quick else RUN_S[s.experiment] for s in distinct_runs(plan, EXPERIMENTS)}
    every = [s for e in EXPERIMENTS for s in plan[e]]
    return run_suite(plan, selected, args, costs, lambda: report(every, settings, out, command), root=REPO)


if __name__ == "__main__":
    sys.exit(main())
