"""The CoMMIT suite's figures (3-6) and the federated mode's report."""

from __future__ import annotations

import math
from pathlib import Path

from commit_experiments import (
    FEDERATED,
    FIG3,
    FIG6,
    FIG45,
    LABEL,
    MODALITIES,
    SMOOTH,
    finite,
    kappa_stats,
    metric_cell,
    questions,
    seed_mean_curve,
    smooth,
    stat_cell,
    step_curve,
)

from fedtune import harness


def plot_curves(
    path: Path, specs: list[harness.RunSpec], trainers: list[str], panels: list[tuple[str, str]], title: str
):
    """One row per modality, one column per (curve key, y label); seed means smoothed over SMOOTH steps."""
    with harness.figure(
        path, len(MODALITIES), len(panels), figsize=(5 * len(panels), 3.6 * len(MODALITIES)), squeeze=False
    ) as (fig, axes):
        for i, m in enumerate(MODALITIES):
            for j, (key, ylabel) in enumerate(panels):
                ax = axes[i][j]
                for t in trainers:
                    ys = smooth(seed_mean_curve(harness.with_labels(specs, modality=m, trainer=t), key))
                    if ys and any(math.isfinite(y) for y in ys):
                        ax.plot(range(1, len(ys) + 1), ys, label=LABEL[t])
                ax.set(title=f"{m}: {ylabel}", xlabel="step", ylabel=ylabel)
                if key in ("kappa", "grad_S", "grad_T"):
                    ax.set_yscale("log")
                harness.finish_axes(ax)
        fig.suptitle(title)


def loss_table(specs: list[harness.RunSpec], trainers: list[str]) -> list[str]:
    """Mean training loss over the first and the last quarter of the steps (seed mean ± std)."""
    rows = []
    for t in trainers:
        row = [LABEL[t]]
        for m in MODALITIES:
            firsts, lasts = [], []
            for s in harness.with_labels(specs, modality=m, trainer=t):
                loss = finite(step_curve(s, "loss")) if harness.load_summary(s) else []
                q = max(1, len(loss) // 4)
                firsts.append(sum(loss[:q]) / q if loss else None)
                lasts.append(sum(loss[-q:]) / q if loss else None)
            row += [stat_cell(firsts), stat_cell(lasts)]
        rows.append(row)
    cols = ["Trainer"] + [c for m in MODALITIES for c in (f"{m}: loss, first quarter", f"{m}: loss, last quarter")]
    return harness.table_lines(cols, rows)


def page(intro: list[str], head: str, results: list[str], figure: str, specs: list[harness.RunSpec], out: Path) -> str:
    """A figure's report: its ``intro`` lines, the setup ``head``, the results table, the plot
    ``<figure>.png`` and the runs section."""
    lines = [*intro, "", head, "## Results", "", *results, "", f"![{figure}]({figure}.png)", ""]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def report_fig45(specs: list[harness.RunSpec], head: str, out: Path) -> str:
    plot_curves(
        out / "fig45.png",
        specs,
        FIG45,
        [("loss", "training loss")],
        f"Figs. 4/5: training loss\n(seed mean, {SMOOTH}-step average)",
    )
    lines = [
        "# Figures 4 and 5 (CPU scale): training-loss curves",
        "",
        "Per-step training loss (the answer cross-entropy of each step's batch), mean over seeds, smoothed over "
        f"{SMOOTH} steps; image is Figure 4's counterpart, audio Figure 5's. The paper: CoMMIT-CLR and CoMMIT "
        "reach lower losses earlier than Constant LR.",
    ]
    return page(lines, head, loss_table(specs, FIG45), "fig45", specs, out)


def report_fig6(specs: list[harness.RunSpec], head: str, out: Path) -> str:
    plot_curves(
        out / "fig6.png", specs, FIG6, [("kappa", "kappa_t")], f"Fig. 6: kappa_t\n(seed mean, {SMOOTH}-step average)"
    )
    rows = []
    for t in FIG6:
        row = [LABEL[t]]
        for m in MODALITIES:
            stats = [kappa_stats(s) for s in harness.with_labels(specs, modality=m, trainer=t)]
            row += [stat_cell([x[0] if x else None for x in stats]), stat_cell([x[1] if x else None for x in stats])]
        rows.append(row)
    cols = ["Trainer"] + [c for m in MODALITIES for c in (f"{m}: mean kappa_t", f"{m}: std of kappa_t")]
    lines = [
        "# Figure 6 (CPU scale): the learning balance kappa_t",
        "",
        "kappa_t = d_T / d_S (eq. (3)): how far one step of the LM's LoRA alone, against one step of the projector "
        "alone, moves the answer tokens' next-token distributions (total variation). Per run: the mean and the "
        "standard deviation of kappa_t over its steps; cells: mean ± sample std over seeds. The paper: CoMMIT and "
        "CoMMIT-CLR have the smallest std of kappa_t, Language LR up is also stable.",
    ]
    return page(lines, head, harness.table_lines(cols, rows), "fig6", specs, out)


def report_fig3(specs: list[harness.RunSpec], head: str, out: Path) -> str:
    plot_curves(
        out / "fig3.png",
        specs,
        FIG3,
        [("grad_S", "||G^S|| / ||theta_S||"), ("grad_T", "||G^T|| / ||theta_T||"), ("loss", "training loss")],
        f"Figure 3 (CPU scale): normalized gradient norms and loss, mean over seeds, {SMOOTH}-step moving average",
    )
    rows = []
    for t in FIG3:
        row = [LABEL[t]]
        for m in MODALITIES:
            for key in ("grad_S", "grad_T"):
                vals = []
                for s in harness.with_labels(specs, modality=m, trainer=t):
                    c = finite(step_curve(s, key)) if harness.load_summary(s) else []
                    q = max(1, len(c) // 4)
                    vals.append(sum(c[-q:]) / q if c else None)
                row.append(stat_cell(vals, 4))
        rows.append(row)
    cols = ["Trainer"] + [
        f"{m}: {k}, last quarter" for m in MODALITIES for k in ("||G^S||/||theta_S||", "||G^T||/||theta_T||")
    ]
    lines = [
        "# Figure 3 (CPU scale): normalized gradient norms of S and T",
        "",
        "||G|| / ||theta|| of the loss gradient of each component at each step (S: the projector; T: the LoRA "
        "matrices). The paper (Sec. 4.2): imbalanced learning (Vision LR up) slows convergence and shrinks both "
        "components' gradients.",
    ]
    return page(lines, head, harness.table_lines(cols, rows), "fig3", specs, out)


def report_federated(specs: list[harness.RunSpec], head: str, out: Path) -> str:
    rows, asked = [], questions(specs, "image")
    for t in FEDERATED:
        group = harness.with_labels(specs, trainer=t)
        stats = [kappa_stats(s) for s in group]
        rows.append(
            [
                LABEL[t],
                metric_cell(group, "accuracy"),
                *(metric_cell(group, f"accuracy_{q}") for q in asked),
                metric_cell(group, "rouge_l"),
                stat_cell([x[0] if x else None for x in stats]),
                stat_cell([x[1] if x else None for x in stats]),
            ]
        )
    with harness.figure(out / "federated.png", 1, len(FEDERATED), figsize=(5 * len(FEDERATED), 3.6), squeeze=False) as (
        fig,
        axes,
    ):
        for j, t in enumerate(FEDERATED):
            ax = axes[0][j]
            group = [s for s in harness.with_labels(specs, trainer=t) if harness.load_summary(s)]
            labeled: set[str] = set()
            if group:  # the first seed's per-client kappa curves, each client at the rounds it took part in
                for line in harness.load_rounds(group[0]):
                    for cid, c in sorted(line.get("client_curves", {}).items(), key=lambda kv: int(kv[0])):
                        h = len(c["kappa"])
                        xs = [(line["round"] - 1) * h + k + 1 for k in range(h)]
                        ax.plot(
                            xs,
                            [v if v is not None else math.nan for v in c["kappa"]],
                            color=f"C{int(cid)}",
                            label=None if cid in labeled else f"client {cid}",
                        )
                        labeled.add(cid)
            ax.set(
                title=f"{LABEL[t]}: per-client kappa_t ({group[0].name if group else 'pending'})",
                xlabel="local step",
                ylabel="kappa_t",
                yscale="log",
            )
            ax.grid(alpha=0.3)
            if labeled:
                ax.legend(fontsize=7)
    cols = ["Trainer", "exact match", *asked, "ROUGE-L", "mean kappa_t", "std of kappa_t"]
    lines = [
        "# Federated mode (not in the paper)",
        "",
        "FedAvg of S (projector) and T (LoRA) over 4 clients holding one question type each (label-sorted "
        "shards of the question labels: clients 0-1 the first type, 2-3 the second), 2 per round; each client "
        "runs the trainer on its own batches and measures its own kappa; the server averages the updates and "
        "the clients' kappa windows and rates (FedAvg weights).",
    ]
    return page(lines, head, harness.table_lines(cols, rows), "federated", specs, out)
