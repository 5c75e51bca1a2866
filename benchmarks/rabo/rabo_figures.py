"""The RABO suite's figures (3-5), Table 3 and the report writer."""

from __future__ import annotations

from pathlib import Path

from rabo_experiments import BILEVEL, LABEL, LAST, METHODS, PAPER_TABLE3, SEGMENTS, SETTINGS, lt_rate_keys
from rabo_tables import curve_plot, report_sweep, report_table2, setup_section, step_size

from fedtune import harness


def stats_mean(values) -> float | None:
    return harness.mean([v for v in values if v is not None])


def per_client_round(spec: harness.RunSpec, key: str) -> float | None:
    rounds = harness.load_rounds(spec)
    if not rounds:
        return None
    if key in ("bytes", "compute_s"):
        vals = [
            sum(r["client_bytes_up"].values()) + sum(r["client_bytes_down"].values())
            if key == "bytes"
            else r["compute_s"]
            for r in rounds
        ]
        return sum(vals) / sum(len(r["clients"]) for r in rounds)
    vals = [r[key] for r in rounds if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def report_fig4(specs, table2, head, out) -> str:
    rows, bars = [], {}
    for m in BILEVEL:
        flops = [per_client_round(s, "client_gflops") for s in harness.with_labels(specs, method=m)]
        comm = [per_client_round(s, "bytes") for s in harness.with_labels(table2, method=m, setting="w5s1")]
        secs = [per_client_round(s, "compute_s") for s in harness.with_labels(table2, method=m, setting="w5s1")]
        bars[m] = [stats_mean(v) for v in (flops, comm, secs)]
    for m in BILEVEL:
        cells = []
        for value, base, spec in zip(bars[m], bars["fedmbo"], (".4f", ",.0f", ".3f")):
            ratio = f" ({100 * value / base:.1f} %)" if value is not None and base else ""
            cells.append("–" if value is None else format(value, spec) + ratio)
        rows.append([LABEL[m], *cells])
    lines = [
        "# Figure 4 (CPU scale): client computation and communication against the full-model bilevel baseline",
        "",
        "Per client and round, mean over clients, rounds and seeds, 5-way 1-shot; in brackets the share of "
        "the full-model bilevel baseline. GFLOPs: torch's FLOP counter over both phases (short runs with "
        "`options.count_flops`); bytes: encoded messages up + down (Table II's runs); seconds: the client's "
        "measured compute (shared cores: rough). Paper: RABO 26.7 % and RAFBO 17.8 % of FedMBO's "
        'computation, both 26.7 % of its communication ("5x and 4x reduction").',
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(
            ["method", "GFLOPs / client / round", "bytes / client / round", "compute s / client / round"], rows
        ),
        "",
        "![fig4](fig4.png)",
        "",
    ]
    with harness.figure(out / "fig4.png", 1, 2, figsize=(9, 3.6)) as (fig, (a1, a2)):
        for ax, i, title in ((a1, 0, "computation (GFLOPs)"), (a2, 1, "communication (bytes)")):
            vals = [bars[m][i] or 0.0 for m in BILEVEL]
            ax.bar([LABEL[m].split(" ")[0] for m in BILEVEL], vals)
            ax.set(title=f"{title} per client and round")
            ax.grid(alpha=0.3, axis="y")
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def report_fig3(specs, head, out) -> str:
    def best(group):  # each run's best evaluation: the segment runs can peak and fall back
        values = [
            max((r["accuracy"] for r in harness.load_rounds(s) if r.get("accuracy") is not None), default=None)
            for s in group
        ]
        return harness.percent(values)

    rows = [
        [
            LABEL[m],
            *(
                f(harness.with_labels(specs, method=m, cstar=c))
                for c in (1, 2)
                for f in (lambda g: harness.accuracy_cell(g, LAST), best)
            ),
        ]
        for m in ("rabo", "rafbo")
    ]
    lines = [
        "# Figure 3 (CPU scale): the minimum coverage C_x^*",
        "",
        "Every client at capacity 1/4; the units of every layer are cut into 4 contiguous segments and client i "
        f"trains segment `segments[i]`: C_x^* = 1 with {SEGMENTS[1]}, C_x^* = 2 with {SEGMENTS[2]} (the runs' "
        "metrics report the C_x^* they reached). 5-way 5-shot. A segment's sub-model holds only its own "
        "channels, so weights between channels of different segments are never trained.",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(
            ["method", "C_x^* = 1 acc (%)", "C_x^* = 1 best (%)", "C_x^* = 2 acc (%)", "C_x^* = 2 best (%)"], rows
        ),
        "",
        "Paper: C_x^* = 2 above C_x^* = 1 for both methods.",
        "",
        "![fig3](fig3.png)",
        "",
    ]
    curve_plot(
        out / "fig3.png",
        [
            (f"{LABEL[m]}, C* = {c}", harness.with_labels(specs, method=m, cstar=c))
            for m in ("rabo", "rafbo")
            for c in (1, 2)
        ],
        "5-way 5-shot, capacity 1/4",
    )
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def report_table3(specs, scale, head, out) -> str:
    rows = []
    for s in scale.table3_settings:
        for m in ("rabo", "rafbo"):
            paper = PAPER_TABLE3.get((m, s), ())
            rows.append(
                [
                    f"{LABEL[m]}, {SETTINGS[s]}",
                    *(
                        f"{harness.accuracy_cell(harness.with_labels(specs, method=m, setting=s, clients=n), LAST)}"
                        + (
                            f" (paper {paper[(10, 20, 30, 50).index(n)]:.2f})"
                            if n in (10, 20, 30, 50) and paper
                            else ""
                        )
                        for n in scale.clients
                    ),
                ]
            )
    lines = [
        "# Table III (CPU scale): scalability in the number of clients",
        "",
        f"The training characters split over n clients (so each holds fewer); beyond 10 clients "
        f"{scale.per_round} are sampled per round (paper: not stated), the capacity mix repeated.",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(["method, setting", *(f"{n} clients (%)" for n in scale.clients)], rows),
        "",
    ]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def report_fig5(specs, scale, head, out) -> str:
    rows = [
        [
            LABEL[m],
            *([step_size(harness.with_labels(specs, method=m), lt_rate_keys)] if scale.sweep else []),
            harness.accuracy_cell(harness.with_labels(specs, method=m), LAST),
            harness.mean_text(
                [s.get("final_loss") for s in map(harness.load_summary, harness.with_labels(specs, method=m)) if s],
                ".3f",
            ),
        ]
        for m in METHODS
    ]
    lines = [
        "# Figure 5 (CPU scale): loss-function tuning on long-tailed Fashion-MNIST",
        "",
        "Accuracy on the balanced 10,000-image test set (= balanced accuracy). Bilevel methods tune the VS "
        "loss (x) of the model (y) with an 80/20 train/validation split per client; single-level methods "
        "train with plain cross-entropy on all the client's data. Every client at capacity 1/2 (the full "
        "bilevel baseline and FedAvg: the full model). Paper: RABO above the single-level sub-model methods "
        "and competitive with full-model FedAvg.",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(
            ["method", *(["step size"] if scale.sweep else []), "balanced acc (%)", "final test loss"], rows
        ),
        "",
        "![fig5](fig5.png)",
        "",
    ]
    curve_plot(
        out / "fig5.png",
        [(LABEL[m], harness.with_labels(specs, method=m)) for m in METHODS],
        "long-tailed Fashion-MNIST: balanced accuracy",
        "balanced_accuracy",
    )
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def write_reports(plan, selected, scale, seeds, out, command, estimate) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    head = setup_section(scale, seeds, command, estimate)
    reports = {
        "sweep": lambda: report_sweep(plan["sweep"], scale, head, out),
        "table2": lambda: report_table2(plan["table2"], scale, head, out),
        "fig4": lambda: report_fig4(plan["fig4"], plan["table2"], head, out),
        "fig3": lambda: report_fig3(plan["fig3"], head, out),
        "table3": lambda: report_table3(plan["table3"], scale, head, out),
        "fig5": lambda: report_fig5(plan["fig5"], scale, head, out),
    }
    written = []
    for exp in selected:
        path = out / f"{exp}.md"
        path.write_text(reports[exp](), encoding="utf-8")
        written += [path, *sorted(out.glob(f"{exp}*.png"))]
    return written
