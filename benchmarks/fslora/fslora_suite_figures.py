"""The FSLoRA suite's Figures 4b, 4c and 7, the horizon and alpha studies, and the report writer."""

from __future__ import annotations

from pathlib import Path

from fslora_suite_experiments import METHODS, Scale
from fslora_suite_tables import fedit_label, report_fig3, report_table51, scale_section, sweep_report

from fedtune import harness


def report_fig4b(specs: list[harness.RunSpec], scale: Scale, head: str, out: Path) -> str:
    k = scale.fig4b_k
    intro = (
        f"FSLoRA with every device updating k = {k} ranks (uniform k/r = {k}/r, "
        "`federation.profiles = [{sketch_ratio = k/r}]`): each device's upload and compute stay those of "
        f"a rank-{k} adapter while the global rank grows. r = {k} is k/r = 1 "
        "(no sketching; the paper's Figure 6 reference point). lora_alpha = 2 r at every r."
    )
    return sweep_report(
        "fig4b",
        "# Figure 4(b) (CPU scale): global rank r at a fixed k",
        intro,
        specs,
        scale,
        head,
        out,
        "rank",
        scale.fig4b_ranks,
        ["r", "k/r"],
        lambda r: [str(r), f"{min(1.0, k / r):g}"],
        "global rank r",
        f"{scale.fig_data[0]}: FSLoRA, k = {k}",
    )


def report_fig4c(specs: list[harness.RunSpec], scale: Scale, head: str, out: Path) -> str:
    intro = (
        f"FSLoRA, global rank r = {scale.rank}, uniform k/r for every device "
        "(`federation.profiles = [{sketch_ratio = k/r}]`); k/r = 1 is no sketching."
    )
    return sweep_report(
        "fig4c",
        f"# Figure 4(c) (CPU scale): sketching ratio at r = {scale.rank}",
        intro,
        specs,
        scale,
        head,
        out,
        "ratio",
        scale.ratios,
        ["k/r", "k"],
        lambda x: [f"{x:g}", str(round(x * scale.rank))],
        "sketching ratio k/r",
        f"{scale.fig_data[0]}: FSLoRA, r = {scale.rank}",
    )


def report_fig7(specs: list[harness.RunSpec], ref: list[harness.RunSpec], scale: Scale, head: str, out: Path) -> str:
    data = scale.fig_data[0]
    lines = [
        "# Figure 7 (CPU scale): top-k compression with and without sketching",
        "",
        f"FSLoRA at r = {scale.rank}, uniform k/r, every upload top-k sparsified "
        f"(`federation.upload_topk = {scale.topk:g}`: each uploaded array keeps its {scale.topk:g} "
        "largest-magnitude entries); k/r = 1 is top-k without sketching. The dashed reference curves "
        "are fig4c's runs (same configs, no top-k). x: cumulative upload per device (all devices' "
        "bytes / number of devices).",
        "",
    ]
    if scale.topk >= 0.5:
        lines += [
            f"**Bytes.** fedtune sends a top-k array as int32 indices + float32 values, so keeping "
            f"{scale.topk:g} of the entries costs {2 * scale.topk:g}x the dense bytes: at 0.5 top-k "
            "saves nothing on the wire here (the paper's 'compression ratio 0.5' reads as half the "
            "communication). Run with `--topk 0.25` for a byte compression of 0.5.",
            "",
        ]
    lines += [head, "## Results", ""]
    rows = []
    for x in scale.ratios:
        g, r = harness.with_labels(specs, ratio=x, data=data), harness.with_labels(ref, ratio=x, data=data)
        rows.append(
            [
                f"{x:g}",
                harness.accuracy_cell(g),
                harness.upload_cell(g),
                harness.accuracy_cell(r),
                harness.upload_cell(r),
            ]
        )
    lines += harness.table_lines(
        ["k/r", "top-k acc (%)", "top-k MB up / device", "no top-k acc (%)", "no top-k MB up / device"], rows
    )
    lines += ["", f"Data: {', '.join(scale.fig_data)} only.", "", "![fig7](fig7.png)", ""]
    with harness.figure(out / "fig7.png", figsize=(6.5, 4.5)) as (fig, ax):
        colors = harness.pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
        for i, x in enumerate(scale.ratios):
            for group, style, tag in [(specs, "-", f"top-k {scale.topk:g}"), (ref, "--", "no top-k")]:
                label = f"k/r = {x:g}" + (" (no sketch)" if x == 1 else "") + f", {tag}"
                group = harness.with_labels(group, ratio=x, data=data)
                harness.plot_curve(ax, group, style, upload=True, color=colors[i % len(colors)], label=label)
        harness.finish_axes(
            ax,
            title=f"{data}: accuracy vs per-device upload (r = {scale.rank})",
            xlabel="MB uploaded per device",
            ylabel="accuracy (%)",
        )
    return "\n".join(lines) + "\n" + harness.runs_section(specs + harness.with_labels(ref, data=data), out)


def report_horizon(
    specs: list[harness.RunSpec], table51: list[harness.RunSpec], scale: Scale, head: str, out: Path
) -> str:
    data = scale.fig_data[0]
    methods = list(scale.horizon_methods)
    short = scale.base.rounds
    rounds = scale.horizon_factor * short
    lines = [
        f"# Longer horizon (not in the paper): Table 5.1's {' and '.join(methods)} runs to {rounds} rounds",
        "",
        f"Table 5.1 stops at R = {short} rounds, about 1 % of the paper's 200 x 50 local steps. These "
        f"runs continue the very same {data} configurations (same seeds, devices, sketches and data order) "
        f"to {scale.horizon_factor} R = {rounds} rounds, to see whether the gap between the methods closes "
        "with more training. Nothing else changes, so the accuracy at round R must equal Table 5.1's final "
        "accuracy; the last column checks that.",
        "",
        head,
        "## Results",
        "",
    ]
    curves = {id(s): harness.curve(s) for s in specs}
    evals = sorted(set.intersection(*[{p[0] for p in c} for c in curves.values()]) if all(curves.values()) else set())

    def at(spec: harness.RunSpec, rnd: int) -> float | None:
        return next((p[2] for p in curves[id(spec)] if p[0] == rnd), None)

    rows = []
    for method in methods:
        group = harness.with_labels(specs, method=method, data=data)
        checks = []
        for s in group:
            ref = next(iter(harness.with_labels(table51, method=method, data=data, seed=s.labels["seed"])), None)
            here, there = at(s, short), (harness.load_summary(ref) or {}).get("final_accuracy") if ref else None
            if here is None or there is None:
                checks.append(f"s{s.labels['seed']}: –")
            else:
                checks.append(
                    f"s{s.labels['seed']}: "
                    + ("yes" if here == there else f"no ({100 * here:.2f} vs {100 * there:.2f})")
                )
        rows.append(
            [
                fedit_label(method),
                *(harness.percent([at(s, r) for s in group]) for r in evals),
                harness.upload_cell(group),
                ", ".join(checks),
            ]
        )
    lines += harness.table_lines(
        ["method", *(f"acc @ {r} (%)" for r in evals), "MB up / device", f"round {short} = Table 5.1?"], rows
    )
    lines += [
        "",
        "Accuracy: mean ± sample std over the seeds at each evaluated round. MB up / device: the "
        f"whole {rounds} rounds.",
        "",
        "![horizon](horizon.png)",
        "",
    ]
    with harness.figure(out / "horizon.png", figsize=(6, 4)) as (fig, ax):
        for method in methods:
            harness.plot_curve(ax, harness.with_labels(specs, method=method, data=data), label=method)
        ax.axvline(short, color="gray", ls=":", lw=1, label=f"Table 5.1 stops (R = {short})")
        ax.set(title=f"{data}: accuracy vs round (mean over seeds)", xlabel="round", ylabel="accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def report_alpha(
    specs: list[harness.RunSpec], plan: dict[str, list[harness.RunSpec]], scale: Scale, head: str, out: Path
) -> str:
    data = scale.fig_data[0]
    a, k, ratios = scale.fixed_alpha, scale.fig4b_k, scale.hetero_ratios
    table, sweep = (
        harness.with_labels(specs, part="table51", data=data),
        harness.with_labels(specs, part="fig4b", data=data),
    )
    ref_table, ref_sweep = (
        harness.with_labels(plan["table51"], data=data),
        harness.with_labels(plan["fig4b"], data=data),
    )
    lines = [
        f"# LoRA scaling (not in the paper): lora_alpha = 2 r vs a fixed lora_alpha = {a:g}",
        "",
        "The paper does not state lora_alpha. The suite's main runs use lora_alpha = 2 r. PEFT scales a "
        "rank-k adapter by alpha / k, which for a device that trains k of the r global ranks is exactly "
        "FSLoRA's (alpha / r)(r / k), and HeteroLoRA, FlexLoRA and FedStackLoRA scale a rank-r_i device by "
        f"alpha / r_i. With alpha = 2 r the scale is 2 r / k: at r = {scale.rank} the devices train at "
        f"{2 * scale.rank / round(max(ratios) * scale.rank):.3g} to {1 / min(ratios) * 2:g}, "
        f"while FedIT at r = {k} trains at 2, and in Figure 4(b) the scale grows with r (2 r / {k}). "
        f"With a fixed alpha = {a:g} every device's scale is {a:g} / k_i, the same function of its own "
        f"rank for every method and every global r; FedIT (r = {k}, alpha = {a:g}) and r = {k} in "
        "Figure 4(b) are the same runs in both settings.",
        "",
        "Same runs otherwise (seeds, devices, sketches, data order, lr); nothing else was tried.",
        "",
        head,
        "## Table 5.1 on " + data,
        "",
    ]
    lines += harness.table_lines(
        ["method", "alpha = 2 r acc (%)", f"alpha = {a:g} acc (%)"],
        [
            [
                fedit_label(m),
                harness.accuracy_cell(harness.with_labels(ref_table, method=m)),
                harness.accuracy_cell(harness.with_labels(table, method=m)),
            ]
            for m in METHODS
        ],
    )
    lines += ["", f"## Figure 4(b): global rank r at k = {k}", ""]
    lines += harness.table_lines(
        ["r", "k/r", "alpha = 2 r: device scale", "acc (%)", f"alpha = {a:g}: device scale", "acc (%)"],
        [
            [
                str(r),
                f"{min(k, r) / r:g}",
                f"{2 * r / min(k, r):g}",
                harness.accuracy_cell(harness.with_labels(ref_sweep, rank=r)),
                f"{a / min(k, r):g}",
                harness.accuracy_cell(harness.with_labels(sweep, rank=r)),
            ]
            for r in scale.fig4b_ranks
        ],
    )
    lines += ["", "Accuracy: final, mean ± sample std over the seeds.", "", "![alpha](alpha.png)", ""]
    with harness.figure(out / "alpha.png", 1, 2, figsize=(11, 4)) as (fig, (ax1, ax2)):
        width = 0.38
        for j, (group, label) in enumerate([(ref_table, "alpha = 2 r"), (table, f"alpha = {a:g}")]):
            finals = [harness.final_accuracy(harness.with_labels(group, method=m)) for m in METHODS]
            ax1.bar(
                [i + (j - 0.5) * width for i in range(len(METHODS))],
                [m or 0.0 for m, _, _ in finals],
                width,
                yerr=[s or 0.0 for _, s, _ in finals],
                capsize=3,
                label=label,
            )
        ax1.set_xticks(range(len(METHODS)), METHODS, fontsize=8)
        ax1.set(title=f"{data}: Table 5.1 methods", ylabel="final accuracy (%)")
        ax1.set_ylim(40, None)
        ax1.grid(alpha=0.3, axis="y")
        ax1.legend(fontsize=8)
        for group, label in [(ref_sweep, "alpha = 2 r"), (sweep, f"alpha = {a:g}")]:
            pts = [(r, *harness.final_accuracy(harness.with_labels(group, rank=r))[:2]) for r in scale.fig4b_ranks]
            pts = [pt for pt in pts if pt[1] is not None]
            if pts:
                ax2.errorbar(
                    [pt[0] for pt in pts],
                    [pt[1] for pt in pts],
                    yerr=[pt[2] for pt in pts],
                    marker="o",
                    capsize=3,
                    label=label,
                )
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(list(scale.fig4b_ranks), [str(r) for r in scale.fig4b_ranks])
        ax2.set(title=f"{data}: FSLoRA, k = {k}", xlabel="global rank r", ylabel="final accuracy (%)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def write_reports(
    plan: dict[str, list[harness.RunSpec]],
    selected: list[str],
    scale: Scale,
    seeds: list[int],
    out: Path,
    command: str,
    calibration_note: str,
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    reports = {
        "table51": lambda specs, head: report_table51(specs, scale, seeds, head, out),
        "fig3": lambda specs, head: report_fig3(specs, scale, head, out),
        "fig4b": lambda specs, head: report_fig4b(specs, scale, head, out),
        "fig4c": lambda specs, head: report_fig4c(specs, scale, head, out),
        "fig7": lambda specs, head: report_fig7(specs, plan["fig4c"], scale, head, out),
        "horizon": lambda specs, head: report_horizon(specs, plan["table51"], scale, head, out),
        "alpha": lambda specs, head: report_alpha(specs, plan, scale, head, out),
    }
    written = []
    for exp in selected:
        data_sets = scale.table_data if exp == "table51" else scale.fig_data
        head = "## Setup\n\n" + scale_section(scale, seeds, data_sets, command, [calibration_note])
        path = out / f"{exp}.md"
        path.write_text(reports[exp](plan[exp], head), encoding="utf-8")
        written += [path, out / f"{exp}.png"]
    return written
