"""The fair FSLoRA benchmark's table at each row's chosen setting, its paired comparisons, the
winners and the report writer."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fslora_sweep_experiments import (
    BASELINES,
    FAMILIES,
    FAMILY_LABELS,
    LABELS,
    LAST,
    ROWS,
    Scale,
    federation_values,
    train_values,
)
from fslora_sweep_setup import pct, report_sweep, setup_section

from fedtune import harness


def paired(table: list[harness.RunSpec], family: str, a: str, b: str, family_b: str | None = None) -> dict[str, Any]:
    """``a`` minus ``b`` (points, mean of the last LAST evaluations) in ``family`` (``b`` in
    ``family_b`` when given): both means and stds, the per-seed differences and their mean and
    std, and the per-device upload ratio."""
    ga = harness.with_labels(table, row=a, family=family)
    gb = harness.with_labels(table, row=b, family=family_b or family)
    va = {s.labels["seed"]: harness.run_accuracy(s, LAST) for s in ga}
    vb = {s.labels["seed"]: harness.run_accuracy(s, LAST) for s in gb}
    seeds = sorted(k for k in va if va[k] is not None and vb.get(k) is not None)
    diffs = [100 * (va[k] - vb[k]) for k in seeds]
    ma, sa = harness.mean_std([100 * va[k] for k in seeds])
    mb, sb = harness.mean_std([100 * vb[k] for k in seeds])
    md, sd = harness.mean_std(diffs)
    up = [upload_per_device(s) for s in ga], [upload_per_device(s) for s in gb]
    ua, ub = (sum(x for x in u if x is not None) / max(1, sum(x is not None for x in u)) for u in up)
    return {
        "seeds": seeds,
        "a": (ma, sa),
        "b": (mb, sb),
        "diffs": diffs,
        "diff": (md, sd),
        "upload_ratio": ua / ub if ua and ub else None,
    }


def upload_per_device(spec: harness.RunSpec) -> float | None:
    summary = harness.load_summary(spec)
    return None if summary is None else summary["total_bytes_up"] / 1e6 / spec.config.federation.num_clients


def verdict(a: str, b: str, p: dict[str, Any], majority: float | None = None) -> str:
    """One plain sentence: is ``a`` >= ``b`` (on the seed means), and is the gap outside the spread
    (the mean paired difference beyond twice its standard error); flagged when both sit at the
    majority-class rate (``majority``, a fraction), where the comparison says nothing."""
    if not p["seeds"]:
        return f"{a} >= {b}: not yet known (runs pending)."
    (ma, sa), (mb, sb), (md, sd) = p["a"], p["b"], p["diff"]
    n = len(p["seeds"])
    holds = "yes" if md >= 0 else "no"
    seeds = f"seed{'s' if n > 1 else ''} {', '.join(map(str, p['seeds']))}"
    if n > 1:
        clear = abs(md) > 2 * sd / math.sqrt(n)
        spread = (
            f"{md:+.2f} ± {sd:.2f} points over {seeds}: "
            + ("outside" if clear else "within")
            + " twice its standard error"
        )
    else:
        spread = f"{md:+.2f} points on {seeds} alone: no spread to judge it by"
    upload = "" if p["upload_ratio"] is None else f"; upload per device {a}/{b} = {p['upload_ratio']:.3f}"
    flat = (
        " Both are at the majority-class rate: this comparison says nothing."
        if majority is not None and max(ma, mb) < 100 * majority + 2
        else ""
    )
    return (
        f"{a} >= {b}: **{holds}** ({ma:.2f} ± {sa:.2f} vs {mb:.2f} ± {sb:.2f}; paired difference "
        f"{spread}{upload}).{flat}"
    )


def best_family(table: list[harness.RunSpec], row: str) -> str | None:
    """The family in which ``row``'s table runs have the higher seed mean (all finished), or None."""
    means = {}
    for family in FAMILIES:
        group = harness.with_labels(table, row=row, family=family)
        m, _, n = harness.final_accuracy(group, LAST) if group else (None, None, 0)
        if m is None or n < len(group):
            return None
        means[family] = m
    return max(FAMILIES, key=lambda f: means[f])


def one_line(table: list[harness.RunSpec], family: str, row: str) -> str:
    """``row`` >= all of BASELINES in ``family``? One sentence, or None while runs are pending."""
    results = {b: paired(table, family, row, b) for b in BASELINES}
    if any(not p["seeds"] for p in results.values()):
        return f"{row} >= {', '.join(BASELINES)}: not yet known (runs pending)."
    below = [b for b, p in results.items() if p["diff"][0] < 0]
    return (
        f"{row} >= {', '.join(BASELINES)}: **"
        + ("yes, all three" if not below else f"no: below {', '.join(below)}")
        + "** (on the seed means; spreads below)."
    )


def report_table(plan, choices, scale: Scale, seeds: list[int], head: str, out: Path) -> str:
    table = plan["table"]
    lines = [
        "# Table 5.1 again, each method at its chosen learning rate (fair FSLoRA benchmark, stage 2)",
        "",
        f"SST-2. Accuracy: each run's mean of its last {LAST} evaluations, then mean ± sample std over seeds "
        f"{', '.join(map(str, seeds))} (not the sweep seed); final: the last evaluation alone. MB: per device, "
        "the whole run (all devices' bytes / number of devices).",
        "",
        head,
        "## Results",
        "",
    ]
    majority = next((x["majority_accuracy"] for x in map(harness.load_summary, table) if x), None)
    clients = scale.base.federation.num_clients
    for family in FAMILIES:
        lines += [f"### {FAMILY_LABELS[family]}", ""]
        rows = []
        for row in ROWS:
            group = harness.with_labels(table, row=row, family=family)
            choice = choices.get((row, family))
            sums = [x for x in map(harness.load_summary, group) if x]
            n = len(group)
            rank = ", ".join(sorted({str(s.labels["rank"]) for s in group})) if row == "fedit" else str(scale.rank)
            rows.append(
                [
                    LABELS[row],
                    rank,
                    "waiting for the sweep" if choice is None else harness.setting_text(choice.setting),
                    "–"
                    if choice is None
                    else pct(choice.score) + ("" if choice.margin is None else f" (+{choice.margin:.2f})"),
                    harness.accuracy_cell(group, LAST) if group else "–",
                    harness.accuracy_cell(group) if group else "–",
                    "–" if not sums else f"{sum(x['total_bytes_up'] for x in sums) / len(sums) / 1e6 / clients:.2f}",
                    "–" if not sums else f"{sum(x['total_bytes_down'] for x in sums) / len(sums) / 1e6 / clients:.2f}",
                    f"{len(sums)}/{n}",
                ]
            )
        lines += harness.table_lines(
            [
                "method",
                "r",
                "chosen rate",
                "sweep score (+ margin)",
                f"mean of last {LAST} (%)",
                "final (%)",
                "MB up / device",
                "MB down / device",
                "runs",
            ],
            rows,
        )
        lines.append("")
    if majority is not None:
        lines += [f"Majority-class rate of the test set: {100 * majority:.2f} %.", ""]
    lines += [
        "## Does FSLoRA beat the baselines at equal upload?",
        "",
        "FSLoRA, HeteroLoRA, FlexLoRA and FedStackLoRA upload the same k_i-rank slices or factors per "
        "device (the upload ratio is printed); pairs share the seed, hence the partition, the device budgets "
        "and the data order. '>=' is read on the seed means; the gap is called clear only when the mean "
        "paired difference exceeds twice its standard error (sample std / sqrt(seeds)).",
        "",
    ]
    for family in FAMILIES:
        lines += [
            f"**{FAMILY_LABELS[family]}.** In one line: "
            + one_line(table, family, "fslora")
            + " With the server-Adam option: "
            + one_line(table, family, "fslora-sadam"),
            "",
        ]
        for b in BASELINES:
            lines.append("- " + verdict("fslora", b, paired(table, family, "fslora", b), majority))
        for b in BASELINES:
            lines.append("- " + verdict("fslora-sadam", b, paired(table, family, "fslora-sadam", b), majority))
        lines.append(
            "- "
            + verdict("fslora", "fedit", paired(table, family, "fslora", "fedit"), majority)
            + " (FedIT uploads rank min k_i from every device: less.)"
        )
        lines.append("")
    best = {row: best_family(table, row) for row in ROWS}
    if all(best[r] for r in ["fslora", "fslora-sadam", *BASELINES]):
        lines += [
            "**Each method in its better family** (by its table mean): "
            + ", ".join(f"{r} {FAMILY_LABELS[best[r]]}" for r in ROWS if best[r])
            + ".",
            "",
        ]
        for a in ("fslora", "fslora-sadam"):
            for b in BASELINES:
                lines.append("- " + verdict(a, b, paired(table, best[a], a, b, best[b]), majority))
        lines.append("")
    lines += ["![accuracy vs round](table51.png)", ""]
    with harness.figure(out / "table51.png", 1, len(FAMILIES), figsize=(6 * len(FAMILIES), 4), squeeze=False) as (
        fig,
        axes,
    ):
        for ax, family in zip(axes[0], FAMILIES):
            for row in ROWS:
                harness.plot_curve(ax, harness.with_labels(table, row=row, family=family), ms=2, label=row)
            if majority is not None:
                ax.axhline(100 * majority, color="gray", ls=":", lw=1, label="majority class")
            harness.finish_axes(
                ax,
                title=f"{FAMILY_LABELS[family]} at the chosen rates (mean over seeds)",
                xlabel="round",
                ylabel="accuracy (%)",
            )
    return "\n".join(lines) + "\n" + harness.runs_section(table, out)


def winners(plan, choices, scale: Scale) -> dict:
    """Machine-readable results: every (family, row)'s chosen setting, its sweep scores and its
    table figure (fractions)."""
    majority = next((x["majority_accuracy"] for x in map(harness.load_summary, plan["sweep"]) if x), None)
    out: dict = {"last": LAST, "majority": majority, "families": {}}
    for family in FAMILIES:
        fam = out["families"][family] = {}
        for row in ROWS:
            choice = choices.get((row, family))
            group = harness.with_labels(plan["table"], row=row, family=family)
            m, s, n = harness.final_accuracy(group, LAST) if group else (None, None, 0)
            fam[row] = {
                "train": train_values(family, choice.setting) if choice else None,
                "federation": federation_values(row, choice.setting) if choice else None,
                "sweep_score": choice.score if choice else None,
                "margin_points": choice.margin if choice else None,
                "grid": [{**st, "score": v} for st, v in choice.scores] if choice else None,
                "table_mean": None if m is None else m / 100,
                "table_std": None if s is None else s / 100,
                "table_runs": n,
                "table_seeds": len(group),
            }
    return out


def write_reports(
    plan, choices, scale: Scale, sweep_seed: int, seeds: list[int], out: Path, command: str, cost_note: str
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    head = "## Setup\n\n" + setup_section(scale, sweep_seed, seeds, command, cost_note)
    (out / "sweep.md").write_text(report_sweep(plan, choices, scale, head, out), encoding="utf-8")
    (out / "table51.md").write_text(report_table(plan, choices, scale, seeds, head, out), encoding="utf-8")
    (out / "winners.json").write_text(json.dumps(winners(plan, choices, scale), indent=2) + "\n", encoding="utf-8")
    return [out / "sweep.md", out / "sweep.png", out / "table51.md", out / "table51.png", out / "winners.json"]
