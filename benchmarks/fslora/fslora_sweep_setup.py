"""The fair FSLoRA benchmark's setup section and its sweep report."""

from __future__ import annotations

from pathlib import Path

from fslora_sweep_experiments import FAMILIES, FAMILY_LABELS, LAST, PAPER, ROWS, SUITE, Scale

from fedtune import harness

# -- reports ----------------------------------------------------------------------------------


def pct(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f}"


def setup_section(scale: Scale, sweep_seed: int, seeds: list[int], command: str, cost_note: str) -> str:
    b = scale.base
    fed = b.federation
    train = b.data.max_train_samples or "all"
    grid = "; ".join(
        f"{FAMILY_LABELS[f]}: lr in {{{', '.join(f'{x:g}' for x in sorted(scale.lr_grid[f]))}}}" for f in FAMILIES
    )
    lines = [
        *harness.produced_by(command),
        "| | paper (RoBERTa & GLUE, Table A.1) | FSLoRA suite (`run_suite.py`) | here |",
        "|---|---|---|---|",
        f"| model | {PAPER['model']} | minilm | `{b.model.name}` |",
        f"| devices | {PAPER['devices']} | {SUITE['devices']} | {fed.num_clients}, "
        + (f"{fed.sample_size()} sampled per round" if fed.sample_size() < fed.num_clients else "all in every round")
        + f", Dirichlet({b.data.alpha}) label skew |",
        f"| rounds R | {PAPER['rounds']} | {SUITE['rounds']} | {b.rounds} |",
        f"| local steps H | {PAPER['local_steps']} | {SUITE['local_steps']} | {b.train.local_steps} |",
        f"| batch | 16 | 16 | {b.train.batch_size} |",
        f"| training examples | {PAPER['train']} | 20000 | {train} (max_length {b.data.max_length}) |",
        f"| test examples | GLUE dev | 872 | {b.data.max_test_samples or 'all'} (SST-2 test = the 872-sentence GLUE "
        "dev set) |",
        f"| learning rate | 5e-4 | {SUITE['lr']} | swept per method and family (below) |",
        f"| evaluation | – | {SUITE['eval']} | every {b.eval_every} rounds; figure = mean of the last {LAST} |",
        f"| seeds | {PAPER['seeds']} | {SUITE['seeds']} | sweep: {sweep_seed}; table: {', '.join(map(str, seeds))} |",
        "",
        f"**Same for every method.** Client weighting p_i = 1/N over the clients that replied (FSLoRA's eq. (5); "
        "FedIT, FlexLoRA and FedStackLoRA default to data-size weights, so for them this is a labelled "
        "deviation); the same devices, partition, device budgets k_i / r drawn from "
        f"{{{', '.join(f'{x:g}' for x in scale.hetero_ratios)}}} with the seed (r = {scale.rank}; the baselines "
        "train rank r_i = k_i), lora_alpha = 2 r, lora_dropout "
        f"{b.model.lora_dropout}, fresh optimizer state per client and round.",
        "",
        f"**Grid.** {grid}. `fslora-sadam` also sweeps its server AdamW learning rate over "
        f"{{{', '.join(f'{x:g}' for x in sorted(scale.server_lr_grid))}}} (weight decay 0.01, betas (0.9, 0.999), "
        f"bias correction), i.e. {len(scale.server_lr_grid)}x the grid points of the other rows.",
        "",
        f"**Selection.** On seed {sweep_seed}, each (method, family) takes the grid point with the highest mean of "
        f"its last {LAST} evaluations (ties: the smaller rate). Table 5.1 then runs that point on seeds "
        f"{', '.join(map(str, seeds))}, which played no part in the choice.",
        "",
        cost_note,
    ]
    return "\n".join(lines) + "\n"


def report_sweep(plan, choices, scale: Scale, head: str, out: Path) -> str:
    sweep = plan["sweep"]
    majority = next((x["majority_accuracy"] for x in map(harness.load_summary, sweep) if x), None)
    lines = [
        "# Learning-rate sweep (fair FSLoRA benchmark, stage 1)",
        "",
        f"Each cell: the run's mean of its last {LAST} evaluations (%), one seed; **bold**: the chosen setting "
        "(automatic argmax). Margin: points by which it beat the best other grid point.",
        "",
        head,
    ]
    for family in FAMILIES:
        lines += [f"## {FAMILY_LABELS[family]}", ""]
        rows = []
        for row in ROWS:
            choice = choices.get((row, family))
            for slr in [None] if row != "fslora-sadam" else sorted(scale.server_lr_grid):
                cells = []
                for lr in sorted(scale.lr_grid[family]):
                    spec = next(iter(harness.with_labels(sweep, row=row, family=family, lr=lr, server_lr=slr)), None)
                    value = harness.run_accuracy(spec, LAST) if spec else None
                    text = "pending" if value is None else pct(value)
                    chosen = choice and choice.setting == {"lr": lr, **({"server_lr": slr} if slr else {})}
                    cells.append(f"**{text}**" if chosen else text)
                name = row + (f" (server lr {slr:g})" if slr else "")
                won = harness.choice_text(choice, majority)
                rows.append([name, *cells, won if slr in (None, sorted(scale.server_lr_grid)[0]) else "〃"])
        lines += harness.table_lines(
            ["method", *(f"lr {lr:g}" for lr in sorted(scale.lr_grid[family])), "chosen"], rows
        )
        lines.append("")
    lines += ["![sweep](sweep.png)", ""]
    with harness.figure(out / "sweep.png", 1, len(FAMILIES), figsize=(5.5 * len(FAMILIES), 4), squeeze=False) as (
        fig,
        axes,
    ):
        for ax, family in zip(axes[0], FAMILIES):
            for row in ROWS:
                for slr in [None] if row != "fslora-sadam" else sorted(scale.server_lr_grid):
                    pts = [
                        (s.labels["lr"], harness.run_accuracy(s, LAST))
                        for s in harness.with_labels(sweep, row=row, family=family, server_lr=slr)
                    ]
                    pts = sorted((x, 100 * v) for x, v in pts if v is not None)
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            marker="o",
                            ms=3,
                            label=row + (f" slr {slr:g}" if slr else ""),
                        )
            ax.set_xscale("log")
            harness.finish_axes(
                ax,
                title=f"{FAMILY_LABELS[family]}: sweep seed",
                xlabel="client learning rate",
                ylabel=f"mean of last {LAST} evaluations (%)",
            )
    return "\n".join(lines) + "\n" + harness.runs_section(sweep, out)
