"""The reports of benchmarks/llm/llm_tables.py: each table's rows (the mean of the last evaluations and the
final evaluation over seeds), its README.md, results.json and plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

from llm_tables_experiments import (
    BENCHES,
    FINAL_EVAL,
    LAST,
    eval_sets,
    final_file,
    last_mean,
)

from fedtune import harness


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / max(n, 1))


def final_metrics(result: dict | None) -> dict[str, float]:
    """``final_accuracy`` (the average over the sets) and ``final_acc_<set>`` of one saved final
    evaluation (:func:`fedtune.trained.evaluate.evaluate`'s result); {} without one."""
    if result is None:
        return {}
    out = {"final_accuracy": result["average"]["acc"]}
    out.update({f"final_acc_{name}": row["acc"] for name, row in result["sets"].items()})
    return out


def final_sizes(results: list[dict | None]) -> dict[str, int]:
    """{set: questions} of the final evaluations (the same subset for every run of a table)."""
    for result in results:
        if result is not None:
            return {name: int(row["n"]) for name, row in result["sets"].items()}
    return {}


def run_final(table: str, spec: harness.RunSpec, limit: int | None) -> dict[str, float]:
    """The finished run's ``final_`` metrics: its saved final evaluation (a table with ``final``),
    else its final round's evaluation, which covers the whole test set (Dolly's 80 records)."""
    b = BENCHES[table]
    if b.final:
        return final_metrics(final_file(spec.run_dir / FINAL_EVAL, spec.key, limit))
    rounds = harness.load_rounds(spec)
    return {f"final_{k}": v for k in (b.metric, "loss") if (v := harness.mean_of_last(rounds, 1, k)) is not None}


def rows_of(
    table: str,
    plan_runs: list[harness.RunSpec],
    base: dict[str, float],
    base_final: dict | None = None,
    limit: int | None = None,
) -> list[dict]:
    """One row per method (and the untuned one): each metric's mean and std over seeds of the
    runs' last-evaluation means, the seeds counted, client compute seconds; then the ``final_``
    columns, the mean and std over seeds of each run's final evaluation (:func:`run_final`; the
    untuned row's: ``base_final``, its saved final evaluation, or ``base`` without one), and
    ``final_se``, the binomial SE of one run's final average at the row's mean:
    sqrt(sum_s p_s (1 - p_s) / n_s) / S over the S sets of n_s questions."""
    b = BENCHES[table]
    keys = sorted(k for k in base if k.startswith(("acc_", "rouge_l", "loss")) and not k.startswith("acc_norm"))
    keys = [k for k in (b.metric, "loss", *keys) if k in base or k == b.metric]
    keys = list(dict.fromkeys(keys))
    if b.final:
        untuned_final = final_metrics(base_final)
        sets = list(final_sizes([base_final])) or (eval_sets(plan_runs[0].config) if plan_runs else [])
        finals = ["final_accuracy", *(f"final_acc_{name}" for name in sets), "final_se"]
    else:
        untuned_final = {f"final_{k}": base[k] for k in (b.metric, "loss") if k in base}
        finals = [f"final_{b.metric}", "final_loss"]
    sizes = final_sizes([base_final])
    rows = [{"method": "untuned", "seeds": 0, **{k: [base.get(k), 0.0] for k in keys}, "compute_s": 0.0}]
    rows[0].update({k: [untuned_final.get(k), 0.0] for k in finals})
    for m in b.methods:
        runs = [s for s in harness.with_labels(plan_runs, method=m) if harness.load_summary(s)]
        row = {"method": m, "seeds": len(runs), "lr": runs[0].config.train.lr if runs else None}
        for k in keys:
            row[k] = list(harness.mean_std([v for s in runs if (v := last_mean(s, k)) is not None]))
        row["compute_s"] = harness.mean_std([harness.load_summary(s)["total_compute_s"] for s in runs])[0]
        run_finals = [run_final(table, s, limit) for s in runs]
        for k in finals:
            row[k] = list(harness.mean_std([f[k] for f in run_finals if k in f]))
        rows.append(row)
    for row in rows if b.final else []:
        per_set = [(row[f"final_acc_{name}"][0], n) for name, n in sizes.items()]
        done = per_set and all(p is not None for p, _ in per_set)
        row["final_se"] = [math.sqrt(sum(p * (1 - p) / n for p, n in per_set)) / len(per_set) if done else None, 0.0]
    return rows


def cell(value: list, scale: float = 100.0) -> str:
    m, s = value
    return "pending" if m is None else f"{scale * m:.1f} ± {scale * (s or 0):.1f}"


def final_note(table: str, base_final: dict | None, limit: int | None) -> str:
    """What the ``final_`` columns are, with the sizes of the sets they score."""
    if not BENCHES[table].final:
        return (
            "`final_` columns: the final round's evaluation, which scores the final adapter on FedIT's whole "
            "80-record global test set (no larger set exists; `local`: the mean over the 10 clients' own adapters). "
            "ROUGE-L and the loss are not proportions: no binomial SE; the ± is the spread over seeds, and the "
            "ordering line's noise is the seed spread alone (it leaves out the sampling of the 80 test records, "
            "so it understates the noise)."
        )
    sizes = final_sizes([base_final])
    cap = "every question" if limit is None else f"at most {limit} questions"
    shown = ", ".join(f"{name} {n}" for name, n in sizes.items()) or "pending"
    return (
        f"`final_` columns: each run's final adapter (and the untuned base) scored once more on a larger fixed "
        f"subset of each set's evaluation split, {cap} per set drawn with seed 0 (the whole split where it is "
        f"smaller): {shown} questions; with `benchmarks/llm/llm_tables.py`'s `--final-per-set`, through "
        "`fedtune.trained.evaluate` (`fedtune eval`'s code, the task's own evaluation), saved as each run's "
        f"`{FINAL_EVAL}`. `final_se`: the binomial SE of one run's final average at the row's mean, "
        "sqrt(sum_s p_s (1 - p_s) / n_s) / S, in points (the seeds score the same questions, so it does not "
        "shrink with them)."
    )


def write_report(
    table: str,
    plans,
    seeds: list[int],
    sweep: harness.Sweep | None,
    base,
    out: Path,
    command: str,
    scale_note,
    base_final: dict | None = None,
    limit: int | None = None,
):
    """results.json, README.md and <name>.png of one table."""
    b = BENCHES[table]
    swept, plan, chosen = plans[table][:3]
    runs = plan[table]
    rows = rows_of(table, runs, base, base_final, limit)
    keys = [k for k in rows[0] if k not in ("method", "seeds", "compute_s", "lr")]
    n_test = int(base.get("test_examples", 0))
    header = ["method", "lr", "seeds", *keys, "client compute s"]
    body = []
    for r in rows:
        pct = [
            ("pending" if r[k][0] is None else f"{100 * r[k][0]:.1f}")
            if k == "final_se"
            else cell(r[k], 1.0 if k.startswith(("loss", "final_loss")) else 100.0)
            for k in keys
        ]
        lr = "–" if r.get("lr") is None else f"{r['lr']:g}"
        comp = "–" if r["compute_s"] is None else f"{r['compute_s']:.0f}"
        body.append([r["method"], lr, str(r["seeds"]), *pct, comp])
    partial = any(r["seeds"] < len(seeds) for r in rows[1:])
    se = binomial_se(base[b.metric], n_test) if b.metric != "rouge_l" else None
    lines = [
        f"# {b.name}: {'PARTIAL, ' if partial else ''}issue 27's {table} benchmark",
        "",
        *harness.produced_by(command),
        f"Scale: {scale_note}",
        "",
        f"Cells: mean ± sample std over the finished seeds (of {len(seeds)}: {seeds}) of each run's mean of its last "
        f"{LAST} evaluations; accuracies and ROUGE-L in percent, loss in nats per response token. Test set: "
        f"{n_test} examples (the recipe's fixed subset, seed 0)"
        + (f"; binomial SE of the untuned average about {100 * se:.1f} points." if se is not None else "."),
        "",
        final_note(table, base_final, limit),
        "",
        *harness.table_lines(header, body),
        "",
    ]
    lines += [ordering_line(table, rows, se=None if se is None else lambda r: binomial_se(r[b.metric][0], n_test))]
    if b.final:
        lines += ["", ordering_line(table, rows, "final_accuracy", lambda r: r["final_se"][0], "final evaluation")]
    if b.sign < 0:  # the sweep minimises the loss: the ordering on it too
        lines += ["", ordering_line(table, rows, "final_loss", label="response loss at the final round", lower=True)]
    lines.append("")
    if sweep is not None:
        lines += ["Learning rates (sweep seed " + str(sweep.seed) + "):", ""]
        lines += [f"- {m}: {harness.choice_text(chosen.get(m))}" for m in b.methods]
        lines.append("")
    if partial:
        lines += ["PARTIAL: rows with fewer seeds than listed are not finished; `pending` cells have no run yet.", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text("\n".join(lines) + "\n" + harness.runs_section([*swept["sweep"], *runs], out))
    sizes = final_sizes([base_final])
    (out / "results.json").write_text(
        json.dumps(
            {"table": table, "seeds": seeds, "final_per_set": limit, "final_sizes": sizes, "rows": rows}, indent=1
        )
    )
    png = out / f"{b.name}.png"
    with harness.figure(png, 1, 1, figsize=(6, 3.5)) as (fig, ax):
        done = [r for r in rows if r[b.metric][0] is not None]
        ax.bar(
            [r["method"] for r in done],
            [100 * r[b.metric][0] for r in done],
            yerr=[100 * (r[b.metric][1] or 0) for r in done],
            color=["grey", *["C0"] * (len(done) - 1)],
        )
        ax.set(ylabel=f"{b.metric} (%)", title=f"{b.name}{' (partial)' if partial else ''}")
    return [out / "README.md", out / "results.json", png]


def ordering_line(
    table: str, rows: list[dict], key: str | None = None, se=None, label: str = "", lower: bool = False
) -> str:
    """Whether the paper's ordering holds on ``key`` (the table's metric by default): FSLoRA above
    every other method (Table 5.2), FedIT above its clients alone and the untuned model (FedIT).
    The top method's gap to the best other row counts only beyond twice the noise of a difference
    of two rows, sqrt(sd_a^2 / S_a + sd_b^2 / S_b + se_a^2 + se_b^2): each row mean's seed spread
    (sample std sd over its S seeds) and each row's evaluation SE (``se(row)``, the binomial SE of
    its average; None for ROUGE-L); a smaller gap either way is "not distinguishable". ``lower``:
    lower is better (a loss, in its own units; else points). "not comparable yet" while a row has
    no finished run."""
    key = key or BENCHES[table].metric
    top = "fslora" if table == "table52" else "fedit"
    head = f"Paper's ordering ({top} first{', ' + label if label else ''})"
    by = {r["method"]: r for r in rows}
    if any(r[key][0] is None for r in rows):
        return f"{head}: not comparable yet (a row has no finished run)."
    sign, scale, unit = (-1.0, 1.0, "") if lower else (1.0, 100.0, " points")
    rival = max((m for m in by if m != top), key=lambda m: sign * by[m][key][0])

    def variance(row: dict) -> float:
        seeds, (_, sd) = row.get("seeds", 0), row[key]
        spread = (sd or 0.0) ** 2 / seeds if seeds > 1 else 0.0
        return spread + ((se(row) if se else 0.0) or 0.0) ** 2

    diff = by[top][key][0] - by[rival][key][0]
    noise = math.sqrt(variance(by[top]) + variance(by[rival]))
    digits = 3 if lower else 1
    figures = f"{top} - {rival} = {scale * diff:+.{digits}f}{unit}, noise of the difference {scale * noise:.{digits}f}"
    figures += "" if se else " (seed spread only: the test records' sampling is not in it)"
    if abs(diff) <= 2 * noise:
        return f"{head}: not distinguishable ({figures}; a gap counts beyond twice the noise)."
    if sign * diff > 0:
        return f"{head}: reproduces ({figures})."
    return f"{head}: does NOT reproduce ({rival} first; {figures})."


def scale_note(table: str) -> str:
    return {
        "table52": "SmolLM2-135M-Instruct (paper: LLaMA-3.2-3B); the recipe's rounds, devices and steps "
        "(configs/benchmarks/commonsense-suite.toml; paper Table A.1: 750 rounds x H = 20 on 20 devices); "
        "training and evaluation sets as in the recipe, the per-set evaluation subset of the recipe.",
        "dolly": "SmolLM2-135M-Instruct (FedIT: LLaMA-7B), configs/dolly.toml's 4 rounds of 3 sampled clients x 5 "
        "steps; FedIT's 80-record global test set.",
    }[table]
