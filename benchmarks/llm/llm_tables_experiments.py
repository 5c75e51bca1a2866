"""The runs of benchmarks/llm/llm_tables.py (issue 27's two causal-LM tables; its docstring says what
they are and what is cut): the tables, their methods' overrides, the sweep and the plan, the untuned
rows, the final evaluation of each table run's adapter, and the cost model behind ``--plan``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fedtune import harness

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "benchmarks"
OVERLAYS = harness.read_overlays(CONFIGS / "fslora-suite-overlays.toml")  # the methods' options, [hetero]
EXPERIMENTS = ["sweep", "table52", "dolly"]
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "llm-tables-quick"
LAST = 2  # a run's figure: the mean of its last 2 evaluations
FINAL_PER_SET, QUICK_FINAL_PER_SET = 300, 6  # questions per set of the final evaluation (table52)
FINAL_EVAL = "final_eval.json"  # a table run's final evaluation, in its run folder


@dataclass(frozen=True)
class Bench:
    """One table: its suite recipe, results folder, methods (name -> overrides), the metric its
    cells report and the one its sweep maximises (``sign`` -1: minimised), the overrides of its
    sweep runs only (``sweep``), and whether its final adapters are scored again on a larger subset
    (``final``; otherwise the final round's evaluation already covers the whole test set)."""

    name: str
    recipe: Path
    results: Path
    methods: dict[str, list[str]]
    metric: str
    sweep_metric: str
    sign: float
    quick: tuple[str, ...]
    sweep: tuple[str, ...] = ()
    final: bool = False


GLOBAL_RANK, SMALLEST_RANK = 64, 8  # r and 0.125 r (FedIT's uniform rank: every device affords it)
DOLLY_ROUNDS = 4  # configs/benchmarks/dolly-suite.toml's rounds (a test checks)
DOLLY_SWEEP_TEST = 40  # the Dolly sweep's test records (of 80): its loss needs no more to pick a rate
BENCHES = {
    "table52": Bench(
        "commonsense-table52",
        CONFIGS / "commonsense-suite.toml",
        REPO / "benchmarks" / "results" / "commonsense-table52",
        {
            "fslora": [*OVERLAYS["fslora"], *OVERLAYS["hetero"]],
            "heterolora": [*OVERLAYS["heterolora"], *OVERLAYS["hetero"]],
            "flexlora": [*OVERLAYS["flexlora"], *OVERLAYS["hetero"]],
            "fedstacklora": [*OVERLAYS["fedstacklora"], *OVERLAYS["hetero"]],
            "fedit": [
                *OVERLAYS["fedit"],
                f"model.lora_rank={SMALLEST_RANK}",
                f"model.lora_alpha={2.0 * SMALLEST_RANK}",
            ],
        },
        "accuracy",
        "accuracy",
        1.0,
        (
            "model.name=tiny-llama",
            "model.lora_rank=16",  # tiny-llama's k_proj allows 16; FedIT's 8 stays
            "model.lora_alpha=32.0",
            "rounds=2",
            "eval_every=1",
            "task.test_per_set=4",
            "train.local_steps=1",
            "data.max_train_samples=200",
            "federation.num_clients=4",
            "federation.clients_per_round=2",
        ),
        final=True,
    ),
    "dolly": Bench(
        "dolly-fedit",
        CONFIGS / "dolly-suite.toml",
        REPO / "benchmarks" / "results" / "dolly-fedit",
        # local: every client's adapter generates the 80 answers at each evaluation (10x FedIT's
        # cost), so it evaluates at the final round only (eval_every = the recipe's 4 rounds)
        {"fedit": OVERLAYS["fedit"], "local": ['method="local"', f"eval_every={DOLLY_ROUNDS}"]},
        "rouge_l",
        "loss",
        -1.0,
        ("model.name=tiny-llama", "rounds=2", "eval_every=1", "task.max_new_tokens=4", "train.local_steps=1"),
        # the sweep chooses by the response loss: no answers generated, on a seed-0 half of the test set
        sweep=("task.generate=false", f"data.max_test_samples={DOLLY_SWEEP_TEST}"),
    ),
}
TABLES = ["table52", "dolly"]


def last_mean(spec: harness.RunSpec, metric: str) -> float | None:
    """The finished run's mean of ``metric`` over its last :data:`LAST` evaluations (None before)."""
    return harness.mean_of_last(harness.load_rounds(spec), LAST, metric) if harness.load_summary(spec) else None


def spec(table: str, method: str, seed: int, quick: bool, lr: float | None, swept: bool = False) -> harness.RunSpec:
    """One run of ``table``'s ``method``: the method's overrides (and the table's sweep overrides
    for a sweep run, ``swept``), the quick scale, the seed and the rate."""
    b = BENCHES[table]
    tag = "" if lr is None else f"-lr{lr:g}"
    return harness.RunSpec(
        f"{method}{tag}-s{seed}",
        [
            *(b.quick if quick else ()),  # first: a method's own rank or schedule stays its own
            *b.methods[method],
            *(b.sweep if swept else ()),
            f"seed={seed}",
            *([] if lr is None else [f"train.lr={lr}"]),
        ],
        {"table": table, "method": method, "seed": seed, "lr": lr},
    )


def sweep_specs(tables: list[str], sweep: harness.Sweep | None, quick: bool) -> dict[str, list[harness.RunSpec]]:
    if sweep is None:
        return {t: [] for t in tables}
    return {
        t: [spec(t, m, sweep.seed, quick, lr, swept=True) for m in BENCHES[t].methods for lr in sweep.grid]
        for t in tables
    }


def choices(table: str, runs: list[harness.RunSpec]):
    """{method: its Choice (or None while its sweep runs)}."""
    b = BENCHES[table]
    return {
        m: harness.choose(
            harness.with_labels(runs, method=m),
            lambda s: {"lr": s.labels["lr"]},
            lambda s: None if (v := last_mean(s, b.sweep_metric)) is None else b.sign * v,
        )
        for m in b.methods
    }


def build(tables: list[str], seeds: list[int], sweep: harness.Sweep | None, quick: bool, out: dict[str, Path]):
    """{table: (sweep plan, table plan, choices, waiting)}: the sweep's runs, then each method on
    ``seeds`` at its chosen rate, or at the recipe's rate without a sweep. ``waiting``: the runs of
    the methods whose sweep has not finished, planned at the grid's first rate, only for the cost
    estimate (a run's cost does not depend on its rate); they run once the sweep has chosen."""
    plans = {}
    for t in tables:
        swept = harness.build_plan({"sweep": sweep_specs([t], sweep, quick)[t]}, BENCHES[t].recipe, out[t])
        chosen = choices(t, swept["sweep"]) if sweep else {}
        runs, waiting = [], []
        for m in BENCHES[t].methods:
            if sweep is not None and chosen.get(m) is None:
                waiting += [spec(t, m, s, quick, sweep.grid[0]) for s in seeds]
                continue
            lr = chosen[m].setting["lr"] if sweep else None
            runs += [spec(t, m, s, quick, lr) for s in seeds]
        waiting = harness.build_plan({t: waiting}, BENCHES[t].recipe, out[t])[t]
        plans[t] = (swept, harness.build_plan({t: runs}, BENCHES[t].recipe, out[t]), chosen, waiting)
    return plans


def untuned(table: str, recipe: Path, quick: bool, out: Path) -> dict[str, float]:
    """The base model's metrics on the table's test subset (same task code), cached in ``out``."""
    path = out / f"untuned-{table}.json"
    if path.is_file():
        return json.loads(path.read_text())
    import torch

    from fedtune.config import load_config
    from fedtune.runtime import RunContext, resolve_run

    torch.set_num_threads(1)
    ctx = RunContext(resolve_run(load_config(recipe, list(BENCHES[table].quick) if quick else [])))
    model = ctx.task.build_model(ctx.config.seed)
    metrics = ctx.task.evaluate(model, ctx.config.train.eval_batch_size)
    metrics["test_examples"] = len(ctx.task.test)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=1))
    return metrics


# -- the final evaluation: each table run's final adapter on a larger fixed subset of each set ---
def eval_sets(config) -> list[str]:
    """The commonsense sets a run of ``config`` trains and evaluates on (``task.sets``)."""
    from fedtune.data.llm_text import check_sets

    return check_sets(config.task.options.get("sets"))


def untuned_target(table: str, quick: bool):
    """The untuned row as :mod:`fedtune.trained.evaluate` scores it: the table's recipe (its task
    options: templates, choice scoring) around the bare base model."""
    from fedtune.config import load_config
    from fedtune.trained.evaluate import Target

    return Target(
        load_config(BENCHES[table].recipe, list(BENCHES[table].quick) if quick else []), None, "untuned", None
    )


def final_file(path: Path, key: str, limit: int | None) -> dict | None:
    """The final evaluation saved at ``path`` if it scored the config ``key`` at ``limit``
    questions per set (else None: absent, cut short, another limit or another run)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(saved, dict) and saved.get("config_key") == key and saved.get("limit") == limit
    return saved if ok else None


def final_targets(table: str, runs: list[harness.RunSpec], quick: bool, out: Path) -> list[tuple]:
    """(target, sets, result path, config key) of every final evaluation ``table`` reports: each
    planned run (scored once finished) and the untuned base (``<out>/untuned-<table>-final.json``)."""
    from fedtune.trained.evaluate import Target

    base = untuned_target(table, quick)
    targets = [(base, eval_sets(base.config), out / f"untuned-{table}-final.json", harness.config_key(base.config))]
    for s in runs:
        target = Target(s.config, s.run_dir / "adapter", str(s.run_dir), s.run_dir)
        targets.append((target, eval_sets(s.config), s.run_dir / FINAL_EVAL, s.key))
    return targets


def final_jobs(table: str, runs: list[harness.RunSpec], limit: int | None, quick: bool, out: Path) -> list[tuple]:
    """The final evaluations still to do (jobs of :func:`fedtune.trained.evaluate.evaluate_to_file`):
    the finished runs and the untuned base without a saved result at ``limit``."""
    if not BENCHES[table].final:
        return []
    finished = [s for s in runs if harness.load_summary(s)]
    return [
        (target, sets, limit, path, {"config_key": key})
        for target, sets, path, key in final_targets(table, finished, quick, out)
        if final_file(path, key, limit) is None
    ]


def run_final_evaluations(jobs: list[tuple], workers: int) -> list[str]:
    """Run the final-evaluation jobs (``workers`` > 1: in the harness's spawned pool, one torch
    thread each; else here); returns the failures, one line each (rerun the suite to retry)."""
    from fedtune.trained.evaluate import evaluate_to_file

    failures = []
    if workers <= 1:
        import torch

        torch.set_num_threads(1)
        results = []
        for job in jobs:
            try:
                results.append((job, evaluate_to_file(job), None))
            except Exception as exc:  # a run whose adapter does not load: reported, the others go on
                results.append((job, None, f"{type(exc).__name__}: {exc}"))
    else:
        results = harness.imap_unordered(evaluate_to_file, jobs, workers)
    for job, result, error in results:
        where = f"final evaluation of {job[0].label} ({job[2] or 'all'} per set)"
        if error is not None:
            failures.append(f"{where}: {error.strip().splitlines()[-1]}")
        print(f"{where}: " + ("FAILED" if error else f"acc {result['average'].get('acc', math.nan):.4f}"), flush=True)
    return failures


def untuned_final(table: str, limit: int | None, quick: bool, out: Path) -> dict | None:
    """The untuned base's saved final evaluation (None: the table has none, or not yet)."""
    if not BENCHES[table].final:
        return None
    _, _, path, key = final_targets(table, [], quick, out)[0]
    return final_file(path, key, limit)


#: seconds on one core (a worker of 2 on a 2-core machine, load about 2): a client step, an
#: evaluated question (table52: its 4 options ranked; Dolly: the response loss plus a generated
#: answer of up to 48 tokens; :data:`LOSS_EVAL_S`: the loss only, ``task.generate = false``) and a
#: run's setup (loading the model and data, saving). Measured on 2026-11-25 as CPU time of one
#: thread (``time.process_time``, so other jobs' load does not inflate it) on SmolLM2 with the
#: suite recipes' batches: table52 3.84 s a step (mean of 5; r = 32), 0.47 s a question (50);
#: Dolly 4.99 s a step (mean of 5, 1.9-8.7 s as the lengths vary; r = 8), 2.34 s an answer with
#: generation (16 answers; 2.32 s at 32 new tokens), 1.35 s the loss alone. They agree with the
#: wall time of the partial table's seed-1 runs (one worker at load about 2): fslora-s1 took 499 s
#: against the model's 514 s (3.4-4.3 s a step, 0.41 s a question). A busier machine is slower
#: (the earlier model, at load 6-12, was 2.8x these).
STEP_S = {"table52": 3.8, "dolly": 5.0}
EVAL_S = {"table52": 0.45, "dolly": 2.35}
LOSS_EVAL_S = 1.35
SETUP_S = 60.0


def evaluated_questions(config) -> int:
    """Questions one evaluation of ``config`` scores per adapter: ``task.test_per_set`` of each
    set (commonsense), else Dolly's 80-record test set or its ``data.max_test_samples``."""
    if config.data.name == "commonsense":
        return config.task.options.get("test_per_set", 100) * len(eval_sets(config))
    return min(80, config.data.max_test_samples or 80)


def run_cost(s: harness.RunSpec) -> float:
    """Estimated seconds of one run: its setup, client steps and evaluations at the measured rates
    (``local`` evaluates every client's adapter; Dolly without generation scores the loss only)."""
    c, t = s.config, s.labels["table"]
    steps = c.rounds * c.federation.sample_size() * c.train.local_steps
    rate = EVAL_S[t] if t == "table52" or c.task.options.get("generate", True) else LOSS_EVAL_S
    evaluators = c.federation.num_clients if c.method == "local" else 1
    return (
        SETUP_S
        + steps * STEP_S[t]
        + harness.eval_rounds(c.rounds, c.eval_every) * evaluated_questions(c) * rate * evaluators
    )


def final_cost(table: str, limit: int | None, quick: bool) -> float:
    """Estimated seconds of one final evaluation: at most ``limit`` questions of each set."""
    from fedtune.data.llm_text import eval_split, read_jsonl
    from fedtune.data.text import data_dir

    config = untuned_target(table, quick).config
    root = data_dir(config.data)
    n = 0
    for name in eval_sets(config):
        size = len(read_jsonl(root / "commonsense" / f"{name}_{eval_split(root, name)}.jsonl.gz"))
        n += size if limit is None else min(limit, size)
    return SETUP_S + n * EVAL_S[table]


def total_lines(plans, tables, limit, quick, out, workers, budget) -> list[str]:
    """``--plan``'s total: the sweep's pending runs, then the tables' (those still waiting for the
    sweep counted at any rate: a run's cost does not depend on it), then the final and untuned
    evaluations, each stage's schedule over ``workers`` (they run one after the other)."""
    sweep = harness.unfinished([s for t in tables for s in plans[t][0]["sweep"]])
    runs = harness.unfinished([s for t in tables for s in [*plans[t][1][t], *plans[t][3]]])
    evals = []
    for t in tables:
        if BENCHES[t].final:  # the finished runs' missing ones (and the untuned base's), then one per run to do
            todo = final_jobs(t, plans[t][1][t], limit, quick, out[t])
            todo += [s for s in [*plans[t][1][t], *plans[t][3]] if not harness.load_summary(s)]
            evals += [final_cost(t, limit, quick)] * len(todo)
        if not (out[t] / f"untuned-{t}.json").is_file():
            evals.append(SETUP_S + evaluated_questions(untuned_target(t, quick).config) * EVAL_S[t])
    minutes = [
        harness.makespan([run_cost(s) for s in sweep], workers) / 60,
        harness.makespan([run_cost(s) for s in runs], workers) / 60,
    ]
    minutes.append(harness.makespan(evals, workers) / 60)
    total = sum(minutes)
    lines = [
        f"total still to do on {workers} workers: ~{total:.0f} min ({total / 60:.1f} h): the sweep {len(sweep)} runs "
        f"~{minutes[0]:.0f} min, then the tables {len(runs)} runs ~{minutes[1]:.0f} min, then {len(evals)} final and "
        f"untuned evaluations (final: {'every question' if limit is None else f'at most {limit} questions'} per set) "
        f"~{minutes[2]:.0f} min"
    ]
    if total > budget:
        lines.append(f"warning: the total {total:.0f} min exceeds --budget-minutes {budget:g}")
    return lines
