"""Issue 27's two causal-LM benchmark tables on :mod:`fedtune.harness`, written to
``benchmarks/results/<name>/{results.json, README.md, <name>.png}``:

- ``table52`` (``benchmarks/results/commonsense-table52/``): the counterpart of FSLoRA's Table 5.2
  (Fang et al. 2025, Section 5.1) at CPU scale: FSLoRA (global rank r = 64, sketching ratios k_i / r
  drawn per device from {0.125, 0.25, 0.5, 0.75}) against HeteroLoRA, FlexLoRA and FedStackLoRA
  with heterogeneous ranks r_i = k_i from the same draw, FedIT at the smallest rank (0.125 r = 8,
  every device affords it) as a reference, and the untuned model; per-set accuracy (options ranked
  by log-likelihood, ``acc``), the average over the sets, client compute seconds (the paper's
  "GPU hours"). Every run is ``configs/benchmarks/commonsense-suite.toml`` (= the recipe
  ``configs/commonsense-fslora.toml``'s data, model and schedule) plus the method's overlay of
  ``configs/benchmarks/fslora-suite-overlays.toml``.
- ``dolly`` (``benchmarks/results/dolly-fedit/``): FedIT / Shepherd's setting (10 clients, FedIT's
  own split, ``configs/benchmarks/dolly-suite.toml`` = ``configs/dolly.toml``'s): FedIT against
  each client alone (``local``: the mean over the clients of their own adapters' scores) and the
  untuned model; ROUGE-L of the greedy answers and the response-token loss on FedIT's 80-record
  global test set.

Each method runs at its own learning rate: with ``--lr-grid`` the ``sweep`` experiment runs every
(benchmark, method) at each rate on ``--sweep-seed``; the rate with the best mean of the run's last
:data:`LAST` evaluations (commonsense: the set-average accuracy; Dolly: the lowest response loss,
since ROUGE-L barely moves at this scale, configs/dolly.toml) is its choice, and the tables run it on
``--seeds``. Without a grid every method runs at the suite recipe's rate. A table cell is the mean
+- sample std over seeds of each run's mean of its last :data:`LAST` evaluations. The untuned rows
evaluate the base model once with the same task code and test subset (cached in
``<out>/untuned-<benchmark>.json``). A run with a ``summary.json`` of the same config is skipped, so
an interrupted suite resumes.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data .venv/bin/python benchmarks/llm_tables.py \\
        [--only table52,dolly] [--seeds 1,2,3] [--lr-grid 3e-4,1e-3,3e-3] [--workers 1]
    ... --plan | --report-only | --quick
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from fedtune.harness import (
    RunSpec,
    SuiteError,
    Sweep,
    add_sweep_options,
    biased_seed_warning,
    build_plan,
    choice_text,
    choose,
    distinct_runs,
    figure,
    load_rounds,
    load_summary,
    mean_of_last,
    mean_std,
    offline_data,
    output_dir,
    parse_selection,
    produced_by,
    read_overlays,
    run_suite,
    runs_section,
    suite_command,
    suite_parser,
    sweep_first,
    sweep_selection,
    table_lines,
    with_labels,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "benchmarks"
OVERLAYS = read_overlays(CONFIGS / "fslora-suite-overlays.toml")  # the methods' options, [hetero]
EXPERIMENTS = ["sweep", "table52", "dolly"]
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "llm-tables-quick"
LAST = 2  # a run's figure: the mean of its last 2 evaluations


@dataclass(frozen=True)
class Bench:
    """One table: its suite recipe, results folder, methods (name -> overrides), the metric its
    cells report and the one its sweep maximises (``sign`` -1: minimised)."""

    name: str
    recipe: Path
    results: Path
    methods: dict[str, list[str]]
    metric: str
    sweep_metric: str
    sign: float
    quick: tuple[str, ...]


GLOBAL_RANK, SMALLEST_RANK = 64, 8  # r and 0.125 r (FedIT's uniform rank: every device affords it)
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
        ("model.name=tiny-llama", "rounds=2", "eval_every=1", "task.test_per_set=4", "train.local_steps=1"),
    ),
    "dolly": Bench(
        "dolly-fedit",
        CONFIGS / "dolly-suite.toml",
        REPO / "benchmarks" / "results" / "dolly-fedit",
        {"fedit": OVERLAYS["fedit"], "local": ['method="local"']},
        "rouge_l",
        "loss",
        -1.0,
        ("model.name=tiny-llama", "rounds=2", "eval_every=1", "task.max_new_tokens=4", "train.local_steps=1"),
    ),
}
TABLES = ["table52", "dolly"]


def last_mean(spec: RunSpec, metric: str) -> float | None:
    """The finished run's mean of ``metric`` over its last :data:`LAST` evaluations (None before)."""
    return mean_of_last(load_rounds(spec), LAST, metric) if load_summary(spec) else None


def spec(table: str, method: str, seed: int, quick: bool, lr: float | None) -> RunSpec:
    b = BENCHES[table]
    tag = "" if lr is None else f"-lr{lr:g}"
    return RunSpec(
        f"{method}{tag}-s{seed}",
        [*b.methods[method], *(b.quick if quick else ()), f"seed={seed}", *([] if lr is None else [f"train.lr={lr}"])],
        {"table": table, "method": method, "seed": seed, "lr": lr},
    )


def sweep_specs(tables: list[str], sweep: Sweep | None, quick: bool) -> dict[str, list[RunSpec]]:
    if sweep is None:
        return {t: [] for t in tables}
    return {t: [spec(t, m, sweep.seed, quick, lr) for m in BENCHES[t].methods for lr in sweep.grid] for t in tables}


def choices(table: str, runs: list[RunSpec]):
    """{method: its Choice (or None while its sweep runs)}."""
    b = BENCHES[table]
    return {
        m: choose(
            with_labels(runs, method=m),
            lambda s: {"lr": s.labels["lr"]},
            lambda s: None if (v := last_mean(s, b.sweep_metric)) is None else b.sign * v,
        )
        for m in b.methods
    }


def build(tables: list[str], seeds: list[int], sweep: Sweep | None, quick: bool, out: dict[str, Path]):
    """{table: (sweep plan, table plan, choices)}: the sweep's runs, then each method on ``seeds`` at
    its chosen rate (none yet: it waits), or at the recipe's rate without a sweep."""
    plans = {}
    for t in tables:
        swept = build_plan({"sweep": sweep_specs([t], sweep, quick)[t]}, BENCHES[t].recipe, out[t])
        chosen = choices(t, swept["sweep"]) if sweep else {}
        runs = []
        for m in BENCHES[t].methods:
            if sweep is not None and chosen.get(m) is None:
                continue
            lr = chosen[m].setting["lr"] if sweep else None
            runs += [spec(t, m, s, quick, lr) for s in seeds]
        plans[t] = (swept, build_plan({t: runs}, BENCHES[t].recipe, out[t]), chosen)
    return plans


def untuned(table: str, recipe: Path, quick: bool, out: Path) -> dict[str, float]:
    """The base model's metrics on the table's test subset (same task code), cached in ``out``."""
    path = out / f"untuned-{table}.json"
    if path.is_file():
        return json.loads(path.read_text())
    import torch

    from fedtune.config import load_config
    from fedtune.runtime import RunContext

    torch.set_num_threads(1)
    ctx = RunContext(load_config(recipe, list(BENCHES[table].quick) if quick else []))
    model = ctx.task.build_model(ctx.config.seed)
    metrics = ctx.task.evaluate(model, ctx.config.train.eval_batch_size)
    metrics["test_examples"] = len(ctx.task.test)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=1))
    return metrics


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def rows_of(table: str, plan_runs: list[RunSpec], base: dict[str, float]) -> list[dict]:
    """One row per method (and the untuned one): each metric's mean and std over seeds of the
    runs' last-evaluation means, the seeds counted, client compute seconds."""
    b = BENCHES[table]
    keys = sorted(k for k in base if k.startswith(("acc_", "rouge_l", "loss")) and not k.startswith("acc_norm"))
    keys = [k for k in (b.metric, "loss", *keys) if k in base or k == b.metric]
    keys = list(dict.fromkeys(keys))
    rows = [{"method": "untuned", "seeds": 0, **{k: [base.get(k), 0.0] for k in keys}, "compute_s": 0.0}]
    for m in b.methods:
        runs = [s for s in with_labels(plan_runs, method=m) if load_summary(s)]
        row = {"method": m, "seeds": len(runs), "lr": runs[0].config.train.lr if runs else None}
        for k in keys:
            row[k] = list(mean_std([v for s in runs if (v := last_mean(s, k)) is not None]))
        row["compute_s"] = mean_std([load_summary(s)["total_compute_s"] for s in runs])[0]
        rows.append(row)
    return rows


def cell(value: list, scale: float = 100.0) -> str:
    m, s = value
    return "pending" if m is None else f"{scale * m:.1f} ± {scale * (s or 0):.1f}"


def write_report(table: str, plans, seeds: list[int], sweep: Sweep | None, base, out: Path, command: str, scale_note):
    """results.json, README.md and <name>.png of one table."""
    b = BENCHES[table]
    swept, plan, chosen = plans[table]
    runs = plan[table]
    rows = rows_of(table, runs, base)
    keys = [k for k in rows[0] if k not in ("method", "seeds", "compute_s", "lr")]
    n_test = int(base.get("test_examples", 0))
    header = ["method", "lr", "seeds", *keys, "client compute s"]
    body = []
    for r in rows:
        pct = [cell(r[k], 1.0 if k.startswith("loss") else 100.0) for k in keys]
        lr = "–" if r.get("lr") is None else f"{r['lr']:g}"
        comp = "–" if r["compute_s"] is None else f"{r['compute_s']:.0f}"
        body.append([r["method"], lr, str(r["seeds"]), *pct, comp])
    partial = any(r["seeds"] < len(seeds) for r in rows[1:])
    se = binomial_se(base[b.metric], n_test) if b.metric != "rouge_l" else None
    lines = [
        f"# {b.name}: {'PARTIAL, ' if partial else ''}issue 27's {table} benchmark",
        "",
        *produced_by(command),
        f"Scale: {scale_note}",
        "",
        f"Cells: mean ± sample std over the finished seeds (of {len(seeds)}: {seeds}) of each run's mean of its last "
        f"{LAST} evaluations; accuracies and ROUGE-L in percent, loss in nats per response token. Test set: "
        f"{n_test} examples (the recipe's fixed subset, seed 0)"
        + (f"; binomial SE of the untuned average about {100 * se:.1f} points." if se is not None else "."),
        "",
        *table_lines(header, body),
        "",
    ]
    lines += [ordering_line(table, rows), ""]
    if sweep is not None:
        lines += ["Learning rates (sweep seed " + str(sweep.seed) + "):", ""]
        lines += [f"- {m}: {choice_text(chosen.get(m))}" for m in b.methods]
        lines.append("")
    if partial:
        lines += ["PARTIAL: rows with fewer seeds than listed are not finished; `pending` cells have no run yet.", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text("\n".join(lines) + "\n" + runs_section([*swept["sweep"], *runs], out))
    (out / "results.json").write_text(json.dumps({"table": table, "seeds": seeds, "rows": rows}, indent=1))
    png = out / f"{b.name}.png"
    with figure(png, 1, 1, figsize=(6, 3.5)) as (fig, ax):
        done = [r for r in rows if r[b.metric][0] is not None]
        ax.bar(
            [r["method"] for r in done],
            [100 * r[b.metric][0] for r in done],
            yerr=[100 * (r[b.metric][1] or 0) for r in done],
            color=["grey", *["C0"] * (len(done) - 1)],
        )
        ax.set(ylabel=f"{b.metric} (%)", title=f"{b.name}{' (partial)' if partial else ''}")
    return [out / "README.md", out / "results.json", png]


def ordering_line(table: str, rows: list[dict]) -> str:
    """Whether the paper's ordering holds: FSLoRA above every other method (Table 5.2), FedIT above
    its clients alone (FedIT); "not comparable yet" while a row has no finished run."""
    metric = BENCHES[table].metric
    score = {r["method"]: r[metric][0] for r in rows}
    if any(v is None for v in score.values()):
        return "Paper's ordering: not comparable yet (a row has no finished run)."
    top = "fslora" if table == "table52" else "fedit"
    best = max(score, key=score.get)
    holds = best == top
    return f"Paper's ordering ({top} first): {'reproduces' if holds else f'does NOT reproduce ({best} first)'}."


def main(argv: list[str] | None = None) -> int:
    p = suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="1,2,3", workers=1, budget_minutes=240)
    add_sweep_options(p, EXPERIMENTS, "every method of each table")
    args = p.parse_args(argv)
    try:
        selected, seeds = parse_selection(args, EXPERIMENTS)
        sweep, selected = sweep_selection(args, selected, TABLES)
    except SuiteError as exc:
        print(exc)
        return 2
    tables = [t for t in TABLES if t in selected] or TABLES
    out = {t: output_dir(args, BENCHES[t].results, QUICK_RESULTS / BENCHES[t].name) for t in tables}
    if args.out is not None:
        out = {t: args.out.resolve() / BENCHES[t].name for t in tables}
    offline_data("commonsense/dolly15k")
    biased_seed_warning(sweep, seeds, selected, TABLES)
    command = suite_command("benchmarks/llm_tables.py", argv)

    def stage(experiments: list[str]) -> int:
        plans = build(tables, seeds, sweep, args.quick, out)
        plan = {"sweep": [s for t in tables for s in plans[t][0]["sweep"]]}
        plan.update({t: plans[t][1][t] for t in tables})
        costs = {s.key: run_cost(s) for s in distinct_runs(plan, experiments)}

        def write_reports() -> list[Path]:
            written = []
            for t in tables:
                if t in experiments or "sweep" in experiments:
                    base = untuned(t, BENCHES[t].recipe, args.quick, out[t])
                    written += write_report(t, plans, seeds, sweep, base, out[t], command, scale_note(t))
            return written

        return run_suite(plan, experiments, args, costs, write_reports, root=REPO)

    return sweep_first(stage, [e for e in selected if e in EXPERIMENTS], args)


#: seconds per client step and per evaluated question, measured with one thread on a 2-core machine
#: that other jobs kept at load 6-12 (so upper bounds): configs/commonsense-fslora.toml's run (60 steps
#: in 629 s, 200 questions in about 265 s) and configs/dolly.toml's (60 steps in 505 s; 80 answers of
#: up to 48 generated tokens, with the loading, in about 600 s)
STEP_S, EVAL_S = {"table52": 10.5, "dolly": 8.5}, {"table52": 1.3, "dolly": 7.0}


def run_cost(s: RunSpec) -> float:
    """Estimated seconds of one run: its client steps and its evaluations at the measured rates
    (``local`` evaluates every client's adapter)."""
    c, t = s.config, s.labels["table"]
    steps = c.rounds * c.federation.sample_size() * c.train.local_steps
    evals = len([r for r in range(1, c.rounds + 1) if r % c.eval_every == 0 or r == c.rounds])
    opts = c.task.options
    per_eval = opts.get("test_per_set", 100) * len(opts.get("sets", [1])) if t == "table52" else 80
    evaluators = c.federation.num_clients if c.method == "local" else 1
    return steps * STEP_S[t] + evals * per_eval * EVAL_S[t] * evaluators


def scale_note(table: str) -> str:
    return {
        "table52": "SmolLM2-135M-Instruct (paper: LLaMA-3.2-3B); the recipe's rounds, devices and steps "
        "(configs/benchmarks/commonsense-suite.toml; paper Table A.1: 750 rounds x H = 20 on 20 devices); "
        "training and evaluation sets as in the recipe, the per-set evaluation subset of the recipe.",
        "dolly": "SmolLM2-135M-Instruct (FedIT: LLaMA-7B), configs/dolly.toml's 4 rounds of 3 sampled clients x 5 "
        "steps; FedIT's 80-record global test set.",
    }[table]


if __name__ == "__main__":
    sys.exit(main())
