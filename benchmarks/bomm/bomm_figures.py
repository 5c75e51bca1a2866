"""The BoMM suite's Figure 3, the cost report and the report writer."""

from __future__ import annotations

from pathlib import Path

from bomm_experiments import CLOUD_METHODS, LABEL, METHODS, Scale, cell, mean_value
from bomm_tables import report_table1, report_table2, report_table3, setup_section

from fedtune import harness


def report_fig3(specs: list[harness.RunSpec], table1: list[harness.RunSpec], scale: Scale, head: str, out: Path) -> str:
    conv = harness.with_labels(table1, scenario=1, aligned=0)
    deltas, mus = harness.with_labels(specs, part="delta"), harness.with_labels(specs, part="mu")
    lines = [
        "# Figure 3 (CPU scale): convergence, missing rate Delta, threshold mu",
        "",
        head,
        "## Results",
        "",
        "### (B-i) accuracy against Delta (scenario 1, 0 aligned)",
        "",
    ]
    rows = []
    for m in scale.delta_methods:
        for metric, col in (("accuracy", "P mean"), ("cloud_accuracy", "C")):
            if col == "C" and m not in CLOUD_METHODS:
                continue
            rows.append(
                [
                    f"{LABEL[m]} {col}",
                    *(cell(harness.with_labels(deltas, method=m, delta=d), metric) for d in scale.deltas),
                ]
            )
    lines += harness.table_lines(["Method", *(f"Delta {d:g}" for d in scale.deltas)], rows)
    lines += ["", "### (B-ii, iii) BoMM against mu (scenario 1, 0 aligned)", ""]
    rows = [
        [
            f"{mu:g}",
            cell(harness.with_labels(mus, mu=mu), "accuracy"),
            cell(harness.with_labels(mus, mu=mu), "cloud_accuracy"),
            cell(harness.with_labels(mus, mu=mu), "selected_fraction", 1.0, 3),
        ]
        for mu in scale.mus
    ]
    lines += harness.table_lines(["mu", "P mean", "C", "selected fraction"], rows)
    lines += ["", "![fig3](fig3.png)", ""]
    with harness.figure(out / "fig3.png", 1, 3, figsize=(15, 4)) as (fig, (ax1, ax2, ax3)):
        for m in METHODS:
            harness.plot_curve(ax1, harness.with_labels(conv, method=m), label=f"{LABEL[m]} P")
            if m in CLOUD_METHODS:
                group = harness.with_labels(conv, method=m)
                harness.plot_curve(ax1, group, metric="cloud_accuracy", ls="--", marker="s", label=f"{LABEL[m]} C")
        ax1.set(title="(A) accuracy vs round (scenario 1, 0 aligned)", xlabel="round", ylabel="accuracy (%)")
        for m in scale.delta_methods:
            ys = [mean_value(harness.with_labels(deltas, method=m, delta=d), "accuracy") for d in scale.deltas]
            if any(y is not None for y in ys):
                ax2.plot(
                    scale.deltas, [y if y is not None else float("nan") for y in ys], marker="o", label=f"{LABEL[m]} P"
                )
        ax2.set(title="(B-i) party accuracy vs Delta", xlabel="Delta", ylabel="accuracy (%)")
        for metric, label in (("accuracy", "P mean"), ("cloud_accuracy", "C")):
            ys = [mean_value(harness.with_labels(mus, mu=mu), metric) for mu in scale.mus]
            if any(y is not None for y in ys):
                ax3.plot(scale.mus, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
        ax3.set(title="(B-ii) BoMM vs mu", xlabel="mu", ylabel="accuracy (%)")
        for ax in (ax1, ax2, ax3):
            harness.finish_axes(ax)
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def per_party(spec_: harness.RunSpec, key: str) -> list[float]:
    """Per party: the run's total of ``client_<key>`` over its rounds."""
    totals: dict[str, float] = {}
    for line in harness.load_rounds(spec_):
        for cid, v in line.get(f"client_{key}", {}).items():
            totals[cid] = totals.get(cid, 0.0) + v
    return [totals[c] for c in sorted(totals)]


def report_cost(specs: list[harness.RunSpec], head: str, out: Path) -> str:
    rows = []
    for m in METHODS:
        group = [s for s in harness.with_labels(specs, method=m) if harness.load_summary(s)]
        if not group:
            rows.append([LABEL[m], "pending", "", "", ""])
            continue
        up = [sum(per_party(s, "bytes_up")) / 1e6 / 2 for s in group]
        down = [sum(per_party(s, "bytes_down")) / 1e6 / 2 for s in group]
        comp = [sum(per_party(s, "compute_s")) / 2 for s in group]
        cloud = [sum(line.get("cloud_compute_s", 0.0) for line in harness.load_rounds(s)) for s in group]
        fmt = lambda xs, d=2: f"{harness.mean_std(xs)[0]:.{d}f}"  # noqa: E731
        rows.append([LABEL[m], fmt(up), fmt(down), fmt(comp, 1), fmt(cloud, 1)])
    lines = [
        "# Communication and compute (scenario 1, aligned as in Table 1's second block)",
        "",
        "Per party, totals over the run, mean over seeds: MB sent to the cloud (representations and prototypes "
        "cross once; the rest is message headers), MB received (completions every round, labels), seconds of "
        "the party's own calls; and the cloud's seconds (alignment, generator, classifier). Evaluation traffic "
        "(the test pairs' completions) is not included. Compute seconds were measured on 2 shared cores with "
        "other jobs running: compare ratios, not absolute values.",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(
            ["Method", "MB up / party", "MB down / party", "party compute s", "cloud compute s"], rows
        ),
        "",
    ]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def write_reports(plan, selected, scale: Scale, seeds: list[int], out: Path, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    head = setup_section(scale, seeds, command)
    reports = {
        "table1": lambda s: report_table1(s, scale, head, out),
        "table2": lambda s: report_table2(s, head, out),
        "table3": lambda s: report_table3(s, head, out),
        "fig3": lambda s: report_fig3(s, plan["table1"], scale, head, out),
        "cost": lambda s: report_cost(s, head, out),
    }
    written = []
    for exp in selected:
        path = out / f"{exp}.md"
        path.write_text(reports[exp](plan[exp]), encoding="utf-8")
        written.append(path)
        if exp == "fig3":
            written.append(out / "fig3.png")
    return written
