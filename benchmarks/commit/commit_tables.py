"""The CoMMIT suite's setup section and tables (Table 1, the rate sweep) with their notes."""

from __future__ import annotations

from pathlib import Path

from commit_experiments import (
    LABEL,
    LAST_EVALS,
    MODALITIES,
    PAPER_TABLE1,
    TABLE1,
    choices_of,
    evaluated,
    finite,
    metric_cell,
    metric_mean,
    metric_values,
    questions,
    run_metric,
    step_curve,
)

from fedtune import harness


def setup_section(plan, seeds: list[int], command: str, sweep: harness.Sweep | None = None) -> str:
    specs = [s for exp in plan.values() for s in exp]
    base = specs[0].config
    o = base.options
    data = {m: harness.with_labels(specs, modality=m)[0].config.data.name for m in MODALITIES}
    lines = [
        "## Setup",
        "",
        *harness.produced_by(command),
        "| | paper (Sec. 7) | here |",
        "|---|---|---|",
        "| models | BLIP-2 (Q-Former + OPT-2.7B), SALMONN (audio Q-Former + Vicuna-7B) | "
        f"`{base.model.name}` with LoRA rank {base.model.lora_rank} on q_proj / v_proj (T); a projector (S) over a "
        "frozen MobileNetV2 (image) or fixed log-mel features (audio), "
        f"{base.task.options.get('prefix_tokens')} prefix tokens |",
        "| tasks | A-OKVQA, IconQA, TextVQA; ClothoAQA, MACS, SDD | "
        + "; ".join(f"{m}: `{data[m]}`, {' + '.join(questions(specs, m))} questions" for m in MODALITIES)
        + " (describe answers run to several words: ROUGE-L) |",
        "| training | Adam, lr 1e-4 (Constant LR) | AdamW, "
        + ("lr swept per trainer and modality (Table 1, Figs. 4/5)" if sweep else f"lr {base.train.lr:g}")
        + f", {base.rounds} x "
        f"{base.train.local_steps} steps of batch {base.train.batch_size}, one party (centralized)"
        + (", one optimizer throughout, evaluated after each round" if base.rounds > 1 else "")
        + " |",
        f"| CoMMIT | alpha, gamma, N_kappa, L_lr, lambda, d not stated | alpha = 2 x lr, gamma {o.get('gamma', 1.0)}, "
        f"N_kappa {o['n_kappa']}, L_lr {o['l_lr']}, lambda {o['reg_weight']}, d = total variation |",
        f"| Language / Vision LR up | 1e-3 vs 1e-4 | {o['lr_up']:g} x lr for that component |",
        f"| Feature / Language CD | 'until weights stabilize' | switch when the relative weight change over "
        f"{o['cd_window']} steps is below {o['cd_tolerance']}, at the latest after {o['cd_max_fraction']:g} of the "
        "steps |",
        f"| seeds | not stated | {', '.join(map(str, seeds))} |",
        "",
        (
            "**Rates.** Each trainer's learning rate (train.lr: both components' base rate; CoMMIT's alpha = 2 x "
            "lr) is "
            f"chosen per modality on seed {sweep.seed} from {{{', '.join(f'{lr:g}' for lr in sweep.grid)}}}: the rate "
            f"with the highest mean of its last {LAST_EVALS} evaluations' exact match (`sweep.md`; ties: the "
            "smaller rate). "
            f"Table 1 and Figs. 4/5 run it on seeds {', '.join(map(str, seeds))}"
            + (
                " (the sweep seed among them: its run is the one that chose the rate, a biased figure)"
                if sweep.seed in seeds
                else ", which played no part in the choice"
            )
            + f"; the other figures run at lr {base_lr(specs):g} for every trainer. "
            if sweep
            else "Nothing is tuned per trainer: every trainer runs with the same recipe. "
        )
        + f"Cells: mean ± sample std over seeds of {evaluated(base)} (exact match and ROUGE-L in %, "
        f"{base.data.max_test_samples} test questions).",
        "",
    ]
    distinct = {s.key: s for s in specs}.values()
    done = sum(harness.load_summary(s) is not None for s in distinct)
    if done < len(distinct):
        lines += [
            f"Finished so far: {done} of the suite's {len(distinct)} distinct runs (cells say n= where seeds are "
            "missing, pending where none finished). The command above, run again, resumes its own selection "
            "(--only, --modalities); every experiment and modality at this scale: the same command with "
            "`--only table1,fig45,fig6,fig3,federated --modalities image,audio`.",
            "",
        ]
    return "\n".join(lines)


def short_question(specs: list[harness.RunSpec], modality: str) -> str | None:
    """The modality's short-answer question (None: no run of it planned yet)."""
    return next(iter(questions(specs, modality)), None)


def base_lr(specs: list[harness.RunSpec]) -> float:
    """The learning rate of the runs that are not swept (the recipe's, or ``--lr``)."""
    return next(s.config.train.lr for s in specs if s.labels["lr"] is None)


def report_table1(specs: list[harness.RunSpec], head: str, out: Path, sweep: harness.Sweep | None = None) -> str:
    cols, rows = ["Trainer"], []
    for m in MODALITIES:
        cols += [f"{m}: lr (swept)"] if sweep else []
        cols += [f"{m}: exact match", f"{m}: {short_question(specs, m) or 'short-answer'} question", f"{m}: ROUGE-L"]
    cols.append("average")
    for t in TABLE1:
        row = [LABEL[t]]
        means = []
        for m in MODALITIES:
            group = harness.with_labels(specs, modality=m, trainer=t)
            if sweep:
                row.append(f"{group[0].labels['lr']:g}" if group else "waiting for the sweep")
            row += [
                metric_cell(group, "accuracy"),
                metric_cell(group, f"accuracy_{short_question(specs, m)}"),
                metric_cell(group, "rouge_l"),
            ]
            means += [metric_mean(group, "accuracy"), metric_mean(group, "rouge_l")]
        row.append("pending" if None in means else f"{sum(means) / len(means):.2f}")
        rows.append(row)
    paper = [[LABEL[t], *(f"{v:.2f}" for v in PAPER_TABLE1[t])] for t in TABLE1]
    lines = [
        "# Table 1 (CPU scale): five trainers, two modalities",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(cols, rows),
        "",
        reference_line(specs),
        "",
        "Paper (accuracy for A-OKVQA, IconQA, TextVQA, ClothoAQA; ROUGE-L for MACS, SDD):",
        "",
        *harness.table_lines(["Method", "A-OKVQA", "IconQA", "TextVQA", "ClothoAQA", "MACS", "SDD", "Average"], paper),
        "",
        *ordering_notes(specs),
        *cd_switches(specs),
    ]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def report_sweep(specs: list[harness.RunSpec], head: str, out: Path, sweep: harness.Sweep | None = None) -> str:
    """Each (modality, trainer)'s exact match at every grid rate on the sweep seed, and its choice."""
    choices = choices_of(specs)
    lines = [
        "# Learning-rate sweep (CPU scale): each trainer's own rate",
        "",
        f"Each cell: the run's mean of its last (up to) {LAST_EVALS} evaluations' exact match (%), one seed; "
        "**bold**: the chosen rate (automatic argmax), which Table 1 and Figures 4/5 then run on the table seeds.",
        "",
        head,
    ]
    panels = {m: {LABEL[t]: harness.with_labels(specs, modality=m, trainer=t) for t in TABLE1} for m in MODALITIES}
    lines += harness.sweep_sections(
        panels,
        {m: {LABEL[t]: choices.get((m, t)) for t in TABLE1} for m in MODALITIES},
        lambda s: run_metric(s, "accuracy"),
        out / "sweep.png",
        row_title="Trainer",
        reference_name="majority-answer rate",
        ylabel=f"exact match, mean of last {LAST_EVALS} (%)",
    )
    return "\n".join([*lines, "![sweep](sweep.png)", ""]) + "\n" + harness.runs_section(specs, out)


def reference_line(specs: list[harness.RunSpec]) -> str:
    """The task's reference (exact match of always giving the test set's most frequent answer) per modality."""
    cells = []
    for m in MODALITIES:
        done = [harness.load_summary(s) for s in harness.with_labels(specs, modality=m) if harness.load_summary(s)]
        cells.append(f"{m} {100 * done[0]['majority_accuracy']:.1f}%" if done else f"{m} pending")
    return "Reference, exact match of always giving the most frequent answer: " + ", ".join(cells) + "."


def cd_switches(specs: list[harness.RunSpec]) -> list[str]:
    """When each CD run switched components: the first step that trained the second component, and
    whether the stabilization criterion or the cap made it switch."""
    lines = ["## When did coordinate descent switch?", ""]
    for m in MODALITIES:
        for t in ("feature-cd", "language-cd"):
            cells = []
            for s in harness.with_labels(specs, modality=m, trainer=t):
                if not harness.load_summary(s):
                    continue
                first = "lr_S" if t == "feature-cd" else "lr_T"
                lrs, change = step_curve(s, first), step_curve(s, "cd_change")
                at = next((i for i, v in enumerate(lrs) if v == 0.0), None)
                if at is None:
                    cells.append(f"seed {s.labels['seed']}: never")
                    continue
                tol = s.config.options["cd_tolerance"]
                why = "criterion" if at > 0 and change[at - 1] is not None and change[at - 1] < tol else "cap"
                seen = finite(change[:at])
                cells.append(
                    f"seed {s.labels['seed']}: step {at + 1} ({why}; window changes {min(seen):.3f}-{max(seen):.3f})"
                    if seen
                    else f"seed {s.labels['seed']}: step {at + 1} ({why})"
                )
            lines.append(f"- {m}, {LABEL[t]}: " + ("; ".join(cells) if cells else "pending"))
    return lines + [""]


def learned_note(specs: list[harness.RunSpec], modality: str) -> str | None:
    """How many of each trainer's finished runs are clearly above the majority-answer rate
    (:func:`~fedtune.harness.clearly_above` on the mean of the last evaluations); a modality where
    none is cannot rank the trainers. None before any run finished."""
    cells, any_above, reference = [], False, None
    for t in TABLE1:
        done = [
            (s, summary)
            for s in harness.with_labels(specs, modality=modality, trainer=t)
            if (summary := harness.load_summary(s))
        ]
        if not done:
            continue
        above = 0
        for s, summary in done:
            reference = summary.get("majority_accuracy")
            ok, margin = harness.clearly_above(
                run_metric(s, "accuracy"), summary.get("final_accuracy"), reference, summary.get("test_examples")
            )
            above += bool(ok)
        any_above |= above > 0
        cells.append(f"{LABEL[t]} {above}/{len(done)}")
    if not cells or reference is None:
        return None
    verdict = (
        ""
        if any_above
        else (" No run is: this modality did not learn at this scale, and its column cannot rank the trainers.")
    )
    return (
        f"- {modality}: runs clearly above the {100 * reference:.0f}% majority-answer rate (last-"
        f"{LAST_EVALS} mean at least {100 * margin:.1f} points above it, final evaluation above it): "
        + ", ".join(cells)
        + "."
        + verdict
    )


def ordering_notes(specs: list[harness.RunSpec]) -> list[str]:
    """The paper's claims (CoMMIT-CLR and CoMMIT improve Constant LR; CoMMIT best on average), checked,
    after whether each modality learned at all (:func:`learned_note`)."""
    notes = ["## Does the paper's ordering reproduce?", ""]
    for m in MODALITIES:
        learned = learned_note(specs, m)
        if learned:
            notes.append(learned)
        for metric, name in (("accuracy", "exact match"), ("rouge_l", "ROUGE-L")):
            means = {t: metric_mean(harness.with_labels(specs, modality=m, trainer=t), metric) for t in TABLE1}
            if any(v is None for v in means.values()):
                continue
            spread = max(
                (harness.mean_std(metric_values(harness.with_labels(specs, modality=m, trainer=t), metric))[1] or 0.0)
                for t in TABLE1
            )
            best = max(means, key=means.get)
            notes.append(
                f"- {m}, {name}: CoMMIT-CLR {means['commit-clr'] - means['constant']:+.2f} and CoMMIT "
                f"{means['commit'] - means['constant']:+.2f} points vs Constant LR; best: {LABEL[best]} "
                f"({means[best]:.2f}); largest seed std {spread:.2f} points"
                + (" (differences within it are not evidence)" if spread else "")
            )
    return notes + [""] if len(notes) > 2 else notes + ["(pending)", ""]
