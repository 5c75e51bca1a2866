"""The BoMM suite's setup section and Tables 1-3 with their notes."""

from __future__ import annotations

from pathlib import Path

from bomm_experiments import ABLATIONS, CLOUD_METHODS, LABEL, LAST, METHODS, PAPER_TABLE1, Scale, cell, mean_value

from fedtune import harness


def setup_section(scale: Scale, seeds: list[int], command: str) -> str:
    b = scale.base
    t, o = b.task.options, b.options
    lines = [
        "## Setup",
        "",
        *harness.produced_by(command),
        "| | paper (Sec. 5.1, App. A) | here |",
        "|---|---|---|",
        "| data | MS COCO / CUB-200 image + captions | paired-multimodal: "
        f"`{b.data.name}` digit images + FSDD spoken digits (audio plays 'text'), 10 classes |",
        f"| parties | 2 | {b.federation.num_clients} |",
        f"| samples | 0 or 200 aligned + 1,000 unaligned per party | {' or '.join(map(str, scale.aligned))} aligned + "
        f"{t.get('unaligned')} unaligned per party, {t.get('labeled_fraction')} of each party's rows labeled |",
        f"| missing rate Delta | 0.5 | {t.get('delta')} (Figure 3: {', '.join(f'{d:g}' for d in scale.deltas)}) |",
        "| party models | CLIP-base / CLIP-large | the task's fusion CNN (0.05M parameters), initialized per party |",
        "| cloud model | LLaVA-1.5-7B | frozen ImageNet MobileNetV2 (phi, 1280-d, inputs "
        f"{o.get('backbone_size', 32)}px) + MLP classifier psi_1 (0.73M) + generator psi_2 |",
        f"| rounds x training | 3 rounds x 20 epochs, Adam 5e-4 / 5e-5 | {b.rounds} rounds; parties "
        f"{b.train.local_steps} steps of batch {b.train.batch_size} ({b.train.optimizer}, lr {b.train.lr:g}); cloud "
        f"{o.get('cloud_epochs', 3)} classifier + {o.get('generator_epochs', 3)} generator epochs (Adam 1e-3) |",
        "| BoMM | beta, gamma, lambda, N_global not stated; mu = 0.4 best | beta 1, gamma 1, lambda 0.1, delta 0.1, "
        "mu 0.4, N_global 100 (+20 per round) |",
        f"| evaluation | accuracy, CLIPScore | accuracy on the complete test pairs (mean of the last {LAST} rounds), "
        "generation cosine |",
        f"| seeds | not stated | {', '.join(map(str, seeds))} |",
        "",
        "Nothing is tuned per method: every method runs with the same recipe and options. Accuracies: mean ± "
        "sample std over seeds of each run's mean over its last evaluations.",
    ]
    return "\n".join(lines) + "\n"


def triple_row(specs: list[harness.RunSpec], method: str) -> list[str]:
    group = harness.with_labels(specs, method=method)
    return [
        cell(group, "party0_accuracy"),
        cell(group, "party1_accuracy"),
        cell(group, "cloud_accuracy") if method in CLOUD_METHODS else "–",
    ]


def improvement_row(specs: list[harness.RunSpec]) -> list[str]:
    """BoMM minus the best baseline, per column (percentage points)."""
    out = []
    for metric, methods in (
        ("party0_accuracy", METHODS),
        ("party1_accuracy", METHODS),
        ("cloud_accuracy", CLOUD_METHODS),
    ):
        ours = mean_value(harness.with_labels(specs, method="bomm"), metric)
        best = [mean_value(harness.with_labels(specs, method=m), metric) for m in methods if m != "bomm"]
        best = [b for b in best if b is not None]
        out.append("–" if ours is None or not best else f"{ours - max(best):+.2f}")
    return out


def report_table1(specs: list[harness.RunSpec], scale: Scale, head: str, out: Path) -> str:
    lines = [
        "# Table 1 (CPU scale): scenarios 1 and 2",
        "",
        "P1, P2: the small models of parties 0 and 1; C: the cloud model; accuracy (%) on the complete test "
        "pairs. Scenario 1: audio missing with probability Delta at both parties; scenario 2: party 0 "
        "complete, audio missing at party 1. Imp.: BoMM minus the best baseline (points).",
        "",
        head,
        "## Results",
        "",
    ]
    for scenario in (1, 2):
        for a in scale.aligned:
            group = harness.with_labels(specs, scenario=scenario, aligned=a)
            rows = [[LABEL[m], *triple_row(group, m)] for m in METHODS] + [["Imp.", *improvement_row(group)]]
            lines += [
                f"### Scenario {scenario}, {a} aligned",
                "",
                *harness.table_lines(["Method", "P1", "P2", "C"], rows),
                "",
            ]
            paper = PAPER_TABLE1.get(scenario, {}).get(200 if a else 0)
            if paper:
                lines += [
                    "Paper (MS COCO, same scenario, #"
                    + ("200" if a else "0")
                    + "): "
                    + "; ".join(
                        f"{LABEL[m]} {p[0]:.2f} / {p[1]:.2f}" + (f" / {p[2]:.2f}" if p[2] else "")
                        for m, p in paper.items()
                    ),
                    "",
                ]
    lines += missing_section(specs, [(sc, a) for sc in (1, 2) for a in scale.aligned])
    lines += ordering_notes(specs, scale)
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


COMPLETING = ("bomm-mm-local", "bomm-mm-ac", "bomm-mm-uc", "bomm")


def missing_section(specs: list[harness.RunSpec], blocks: list[tuple[int, int]]) -> list[str]:
    """Party accuracy (mean of the two parties) on the test pairs with the scenario's modality
    removed: the small model alone, and with the missing modality completed by the method's
    generator (the cloud's, or MM-LOCAL's own)."""
    cols, rows = [], {m: [LABEL[m]] for m in METHODS}
    for scenario, a in blocks:
        alone = "accuracy_audio_only" if scenario == 3 else "accuracy_image_only"
        cols += [f"s{scenario} #{a} alone", f"s{scenario} #{a} completed"]
        for m in METHODS:
            group = harness.with_labels(specs, scenario=scenario, aligned=a, method=m)
            rows[m] += [cell(group, alone), cell(group, "accuracy_completed") if m in COMPLETING else "–"]
    return [
        "### Test pairs missing the scenario's modality (mean of P1 and P2)",
        "",
        "The scenario's missing modality (audio in scenarios 1-2, image in 3) is removed from every test pair: "
        "the small model on what is left (alone), and with the removed modality replaced by the method's "
        "completion (completed).",
        "",
        *harness.table_lines(["Method", *cols], list(rows.values())),
        "",
    ]


def ordering_notes(specs: list[harness.RunSpec], scale: Scale) -> list[str]:
    """Where BoMM is (or is not) the best method, column by column: the paper's claim, checked."""
    notes = ["## Does the paper's ordering reproduce?", ""]
    for scenario in (1, 2):
        for a in scale.aligned:
            group = harness.with_labels(specs, scenario=scenario, aligned=a)
            for metric, name, methods in (
                ("party0_accuracy", "P1", METHODS),
                ("party1_accuracy", "P2", METHODS),
                ("cloud_accuracy", "C", CLOUD_METHODS),
            ):
                means = {m: mean_value(harness.with_labels(group, method=m), metric) for m in methods}
                if any(v is None for v in means.values()):
                    continue
                best = max(means, key=means.get)
                verdict = (
                    "yes"
                    if best == "bomm"
                    else f"no: {LABEL[best]} is best ({means[best]:.2f} vs BoMM {means['bomm']:.2f})"
                )
                notes.append(f"- scenario {scenario}, {a} aligned, {name}: BoMM best? {verdict}")
    return notes + [""] if len(notes) > 2 else notes + ["(pending)", ""]


def report_table2(specs: list[harness.RunSpec], head: str, out: Path) -> str:
    rows = []
    for m in METHODS:
        group = harness.with_labels(specs, method=m)
        gen = m not in ("bomm-local", "bomm-vanilla")
        rows.append(
            [
                LABEL[m],
                cell(group, "party0_accuracy"),
                cell(group, "party0_gen_cosine") if gen else "–",
                cell(group, "party1_accuracy"),
                cell(group, "party1_gen_cosine") if gen else "–",
                cell(group, "cloud_accuracy") if m in CLOUD_METHODS else "–",
            ]
        )
    rows.append(
        ["Imp.", *improvement_row(specs)[:1], "", *improvement_row(specs)[1:2], "", *improvement_row(specs)[2:]]
    )
    lines = [
        "# Table 2 (CPU scale): scenario 3 (images missing at both parties), 0 aligned",
        "",
        "Acc: accuracy (%) on the complete test pairs. Gen: the completions of the test pairs' image "
        "representation against the real one, mean cosine x 100 (standardized with the party's statistics; "
        "the counterpart of the paper's CLIPScore). MM-AC completes aligned rows only, and there are none here, "
        "so it completes nothing (and Vanilla's cloud has no data: chance).",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(["Method", "P1 Acc", "P1 Gen", "P2 Acc", "P2 Gen", "C Acc"], rows),
        "",
        "Paper (MS COCO): LOCAL 36.13 / 34.47; MM-LOCAL 30.18 / 36.62; Vanilla 38.96 / 38.18 / 27.83; MM-AC "
        "40.79 / 39.88 / 28.04; MM-UC 50.08 / 39.72 / 44.90; BoMM 52.35 / 42.16 / 51.18 (P1 / P2 / C).",
        "",
        *missing_section(specs, [(3, 0)]),
    ]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)


def report_table3(specs: list[harness.RunSpec], head: str, out: Path) -> str:
    rows = [
        [
            row,
            *triple_row(harness.with_labels(specs, row=row), "bomm"),
            cell(harness.with_labels(specs, row=row), "diag_pair_accuracy"),
        ]
        for row in ABLATIONS
    ]
    lines = [
        "# Table 3 (CPU scale): ablations (scenario 2, 0 aligned)",
        "",
        "w/o preference loss: L_G = gamma L_special; w/o special loss: gamma = 0; w/o scheduler: mu = 0 (the "
        "paper's ablation: r_hat > 0 still filters; the selected fraction is in the runs' `selected_fraction`); "
        "scheduler off: every generation used. The last three rows are not in the paper: they ablate choices "
        "of this implementation (eq. (9) in the cloud's embedding space; aligning completed representations; "
        "parties training on their aligned partners' labels).",
        "",
        head,
        "## Results",
        "",
        *harness.table_lines(["Model", "P1", "P2", "C", "same-class pairs"], rows),
        "",
        "Same-class pairs: the share of the pairs eq. (9) accepts whose rows are of the same class (the pool's "
        "true labels, a diagnostic the method never reads), over the last evaluations.",
        "",
        "Paper (MS COCO): BoMM 40.17 / 39.78 / 32.39; w/o preference loss 37.51 / 38.13 / 30.82; w/o special "
        "loss 38.47 / 35.35 / 30.66; w/o scheduler 38.37 / 35.15 / 30.56.",
        "",
    ]
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)
