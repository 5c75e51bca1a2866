"""The RABO suite's setup section, its rate sweep and Table 2."""

from __future__ import annotations

from pathlib import Path

from rabo_experiments import (
    LABEL,
    LAST,
    METHODS,
    PAPER_TABLE2,
    SETTINGS,
    SWEEP_SETTING,
    Scale,
    base_rate,
    budget_accuracy,
    choices_of,
    lt_rate_keys,
    rate_key,
    rate_value,
    sweep_score,
    updates_per_round,
)

from fedtune import harness


# -- reports ----------------------------------------------------------------------------------------
def setup_section(scale: Scale, seeds: list[int], command: str, estimate: str) -> str:
    u = scale.updates or 60
    return "\n".join(
        [
            "## Setup",
            "",
            *harness.produced_by(command),
            "| | paper (Sec. V) | here |",
            "|---|---|---|",
            "| few-shot model x | ResNet-12 | 4-block conv net, 32 filters (`task.filters`) |",
            "| y | an MLP classifier | a linear head per episode, fitted on its support set (T = 30 steps of 0.02, "
            "lambda = 1) |",
            "| data | Omniglot, 30 / 20 of the 50 alphabets | the 8 background alphabets of the small sets: 6 train "
            "(x 4 rotations = 804 classes) / 2 test (Balinese, Tagalog) |",
            "| episodes | N-way K-shot, 20 - K queries | same for evaluation (300 episodes); training 5 queries per "
            "class "
            "(20-way: 2) |",
            "| clients | 10, capacities from {1, 1/2, 1/4, 1/8, 1/16} | 10, two of each capacity (width ratios) |",
            f"| rounds | not stated (Fig. 2: a few hundred) | bilevel: {u} outer steps; single-level: {u // 10} "
            "rounds x 10 "
            f"local AdamW steps ({u} backbone updates per client) |",
            f"| Table II columns | 5/20-way, 1/5-shot | {', '.join(SETTINGS[s] for s in scale.settings)} |",
            "| loss tuning | CIFAR-10 long-tailed, ResNet-18 | Fashion-MNIST, imbalance 100, 29k-parameter CNN, "
            "60 rounds |",
            f"| seeds | not stated | {', '.join(map(str, seeds))} |",
            "",
            "Accuracy: each run's mean of its last 3 evaluations (Table II: its last 3 evaluations at a multiple of 10 "
            "backbone updates per client, the same update counts for every method), then mean ± sample std over the "
            "seeds. "
            + (
                f"Step sizes: each method's own (bilevel: the outer step; single-level: the AdamW learning rate) times "
                f"the factor chosen on seed {scale.sweep.seed} from "
                f"{{{', '.join(f'{f:g}' for f in scale.sweep.grid)}}} "
                f"({SETTINGS[SWEEP_SETTING]}, `sweep.md`) for Tables II and III, and from "
                f"{{{', '.join(f'{f:g}' for f in scale.lt_grid)}}} on the loss-tuning problem for Figure 5 (there "
                f"the bilevel methods' outer and inner steps together); Figures 3 and 4 at factor 1. "
                if scale.sweep
                else "Nothing is tuned per method; the bilevel methods share their step sizes. "
            )
            + estimate,
            "",
        ]
    )


def curve_plot(
    path: Path,
    groups: list[tuple[str, list[harness.RunSpec]]],
    title: str,
    metric: str = "accuracy",
    updates: bool = False,
) -> None:
    """Seed-averaged curves against the round (``updates``: against backbone updates per client)."""
    with harness.figure(path, figsize=(6.5, 4.2)) as (fig, ax):
        for label, specs in groups:
            pts = harness.averaged_curve(specs, metric)
            if pts:
                per = updates_per_round(specs[0]) if updates else 1
                ax.plot([per * p[0] for p in pts], [100 * p[2] for p in pts], marker="o", ms=3, label=label)
        harness.finish_axes(
            ax, title=title, xlabel="backbone updates per client" if updates else "round", ylabel=f"{metric} (%)"
        )


def budget_cell(specs: list[harness.RunSpec]) -> str:
    """mean ± std over the seeds of :func:`budget_accuracy`, ``(n=…)`` while some are unfinished."""
    values = [budget_accuracy(s) for s in specs]
    n = sum(v is not None for v in values)
    return harness.percent(values) + (f" (n={n})" if 0 < n < len(specs) else "")


def step_size(specs: list[harness.RunSpec], keys_of=lambda m: (rate_key(m),)) -> str:
    """The step sizes ``keys_of(method)`` the method's runs used (Figure 5: :func:`lt_rate_keys`),
    with ``x factor`` where swept; or that they wait for the sweep."""
    if not specs:
        return "waiting for the sweep"
    s = specs[0]
    rates = ", ".join(f"{key.split('.')[-1]} {rate_value(s.config, key):g}" for key in keys_of(s.labels["method"]))
    return rates if s.labels.get("factor") is None else f"{rates} (x{s.labels['factor']:g})"


def report_sweep(specs, scale, head, out) -> str:
    """Each method's figure at every factor of its own step size on the sweep seed: Table II's on
    the few-shot problem, Figure 5's on the loss-tuning one."""
    panels, choices = {}, {}
    for problem, title in (("few-shot", SETTINGS[SWEEP_SETTING]), ("loss-tuning", "loss tuning (Figure 5)")):
        runs = harness.with_labels(specs, problem=problem)
        rows = {
            m: f"{LABEL[m]} ({sweep_rates(group[0], problem)})"
            for m in METHODS
            if (group := harness.with_labels(runs, method=m))
        }
        if rows:
            panels[title] = {rows[m]: harness.with_labels(runs, method=m) for m in rows}
            picked = choices_of(runs, problem)
            choices[title] = {rows[m]: picked.get(m) for m in rows}
    lines = [
        "# Step-size sweep (CPU scale): each method at its own rate",
        "",
        f"One seed. Each cell: the run's figure (%) at a factor of the method's own step size; **bold**: the "
        f"chosen factor (automatic argmax), which the tables then run. {SETTINGS[SWEEP_SETTING]}: Table II's "
        f"figure (mean of the last {LAST} evaluations at multiples of 10 backbone updates per client), for "
        f"Tables II and III. Loss tuning: Figure 5's (mean of the last {LAST} evaluations' balanced accuracy), "
        "for Figure 5.",
        "",
        head,
        "## Results",
        "",
        *harness.sweep_sections(
            panels,
            choices,
            sweep_score,
            out / "sweep.png",
            key="factor",
            reference_name="chance rate (1/N)",
            ylabel=f"mean of last {LAST} evaluations (%)",
        ),
        "![sweep](sweep.png)",
        "",
    ]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def sweep_rates(spec: harness.RunSpec, problem: str) -> str:
    """The step sizes factor 1 stands for: ``options.outer_lr x 1 = 0.05``."""
    m, f = spec.labels["method"], spec.labels["factor"]
    if problem == "few-shot":
        return f"`{rate_key(m)}` x 1 = {base_rate(spec.config, m) / f:g}"
    return ", ".join(f"`{key}` x 1 = {rate_value(spec.config, key) / f:g}" for key in lt_rate_keys(m))


def report_table2(specs, scale, head, out) -> str:
    settings = [s for s in scale.settings if harness.with_labels(specs, setting=s)]
    rows = []
    for m in METHODS:
        row = [LABEL[m]] + ([step_size(harness.with_labels(specs, method=m))] if scale.sweep else [])
        for s in settings:
            paper = PAPER_TABLE2.get(m)
            group = harness.with_labels(specs, method=m, setting=s)
            row += [
                budget_cell(group),
                harness.accuracy_cell(group),
                f"{paper[list(SETTINGS).index(s)]:.2f}" if paper else "–",
            ]
        rows.append(row)
    cols = ["method", *(["step size"] if scale.sweep else [])] + [
        c for s in settings for c in (f"{SETTINGS[s]} (%)", "final (%)", "paper")
    ]
    lines = [
        "# Table II (CPU scale): N-way K-shot accuracy on held-out Omniglot alphabets",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(cols, rows),
        "",
        "First column: each run's mean of its last 3 evaluations at a multiple of 10 backbone updates per "
        "client; final: its last evaluation (at the full update budget, the same for every method). "
        "Chance: 20 % (5-way), 5 % (20-way). The paper's column ordering (RABO > RAFBO > FIARSE > FedRolex > "
        "Static among sub-model methods) is to be read off the table above; where it does not hold, it does "
        "not reproduce at this scale.",
        "",
    ]
    for s in settings:
        curve_plot(
            out / f"table2-{s}.png",
            [(LABEL[m], harness.with_labels(specs, method=m, setting=s)) for m in METHODS],
            f"{SETTINGS[s]}: accuracy vs updates (mean over seeds)",
            updates=True,
        )
        lines += [f"![{s}](table2-{s}.png)", ""]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)
