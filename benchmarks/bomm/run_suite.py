"""CPU-scale counterparts of the BoMM paper's experiments (Section 5, Tables 1-3, Figure 3), written
to ``benchmarks/results/bomm/``.

Every run is the recipe ``configs/benchmarks/bomm-suite.toml`` (paired digit images + spoken digits,
two parties, the cloud on a frozen MobileNetV2) plus the experiment's settings; identical configs run
once and are shared between experiments. Experiments:

- ``table1``: Table 1. BoMM and the five baselines (LOCAL, MM-LOCAL, Vanilla, MM-AC, MM-UC) in
  scenarios 1 and 2 (audio, the paper's "text", missing with probability Delta = 0.5: at both parties;
  at party 1 only) with 0 and 200 aligned ids: P1 / P2 (parties 0 and 1's small models) and C (the
  cloud model) accuracy on the complete test pairs.
- ``table2``: Table 2. Scenario 3 (images missing at both parties), 0 aligned ids: accuracy and, in
  place of CLIPScore, the completions' mean cosine to the real representations (``gen_cosine``).
- ``table3``: Table 3. Ablations in scenario 2 with 0 aligned ids: w/o preference loss (L_G =
  gamma L_special), w/o special loss (gamma = 0), w/o scheduler as the paper runs it (mu = 0), plus
  every generation used (scheduler off).
- ``fig3``: Figure 3. (A) accuracy over rounds (Table 1's scenario-1, 0-aligned runs); (B) accuracy
  against the missing rate Delta (BoMM, MM-UC, LOCAL; scenario 1, 0 aligned) and against the
  scheduler threshold mu (BoMM).
- ``cost``: communication (MB up / down per party) and compute seconds (per party, and the cloud's)
  of every method, from Table 1's scenario-1 runs with 200 aligned ids (no extra runs).

Accuracies are the mean of each run's last ``LAST`` evaluations, then mean +- sample std over seeds.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data .venv/bin/python benchmarks/bomm/run_suite.py
    ... --plan           # the runs and the time estimate, nothing run
    ... --quick          # smoke test: digits, 40 rows per party, 2 rounds, to benchmarks/results/_scratch/bomm-quick/
    ... --report-only    # rewrite the markdown and plots from the run folders that exist
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from fedtune.config import RunConfig, load_config
from fedtune.harness import (
    Costs,
    RunSpec,
    SuiteError,
    assignments,
    averaged_curve,
    build_plan,
    distinct_runs,
    estimate_minutes,
    estimate_s,
    figure,
    load_rounds,
    load_summary,
    mean_of_last,
    mean_std,
    offline_data,
    output_dir,
    parse_selection,
    read_overlays,
    run_suite,
    runs_section,
    suite_command,
    suite_parser,
    table_lines,
    with_labels,
)
from fedtune.methods.bomm.options import BommOptions

REPO = Path(__file__).resolve().parents[2]

RECIPE = REPO / "configs" / "benchmarks" / "bomm-suite.toml"
OVERLAYS = read_overlays(REPO / "configs" / "benchmarks" / "bomm-suite-overlays.toml")
RESULTS = REPO / "benchmarks" / "results" / "bomm"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "bomm-quick"
EXPERIMENTS = ["table1", "table2", "table3", "fig3", "cost"]  # also the order that owns shared runs
METHODS = ["bomm-local", "bomm-mm-local", "bomm-vanilla", "bomm-mm-ac", "bomm-mm-uc", "bomm"]
LABEL = {
    "bomm-local": "LOCAL",
    "bomm-mm-local": "MM-LOCAL",
    "bomm-vanilla": "Vanilla",
    "bomm-mm-ac": "MM-AC",
    "bomm-mm-uc": "MM-UC",
    "bomm": "BoMM",
}
CLOUD_METHODS = ["bomm-vanilla", "bomm-mm-ac", "bomm-mm-uc", "bomm"]
ABLATIONS = {  # Table 3's rows: the overlay (of bomm-suite-overlays.toml) each adds; "" for BoMM itself
    "BoMM": "",
    "w/o preference loss": "no-prefer",
    "w/o special loss": "no-special",
    "w/o scheduler (mu = 0)": "mu0",
    "every generation (scheduler off)": "no-scheduler",
    "align on phi features": "align-phi",
    "align without completion": "align-real",
    "no label transfer": "no-label-transfer",
}
LAST = 3  # evaluations averaged per run

PAPER_TABLE1 = {  # MS COCO, (P1, P2, C); scenario -> aligned -> method
    1: {
        0: {
            "bomm-local": (38.67, 38.28, None),
            "bomm-mm-local": (36.13, 36.52, None),
            "bomm-vanilla": (38.88, 37.11, 27.19),
            "bomm-mm-ac": (39.06, 37.40, 27.64),
            "bomm-mm-uc": (38.18, 36.33, 26.27),
            "bomm": (40.17, 39.78, 32.39),
        },
        200: {
            "bomm-local": (39.47, 37.41, None),
            "bomm-mm-local": (39.14, 36.10, None),
            "bomm-vanilla": (39.06, 38.82, 28.61),
            "bomm-mm-ac": (38.15, 39.80, 28.45),
            "bomm-mm-uc": (37.17, 38.81, 27.80),
            "bomm": (41.22, 40.41, 35.21),
        },
    },
    2: {
        0: {
            "bomm-local": (50.48, 34.96, None),
            "bomm-mm-local": (50.68, 36.52, None),
            "bomm-vanilla": (51.26, 35.74, 24.80),
            "bomm-mm-ac": (50.20, 35.84, 26.26),
            "bomm-mm-uc": (50.68, 33.98, 25.78),
            "bomm": (52.75, 33.69, 32.90),
        },
        200: {
            "bomm-local": (50.98, 37.41, None),
            "bomm-mm-local": (51.97, 36.10, None),
            "bomm-vanilla": (52.79, 36.75, 26.15),
            "bomm-mm-ac": (51.94, 36.84, 25.65),
            "bomm-mm-uc": (52.78, 34.53, 25.25),
            "bomm": (54.32, 37.89, 30.10),
        },
    },
}


@dataclass(frozen=True)
class Scale:
    """The experiment grid and the overrides every run adds to the recipe (``--quick``)."""

    overrides: tuple[str, ...] = ()
    aligned: tuple[int, ...] = (0, 200)
    deltas: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    delta_methods: tuple[str, ...] = ("bomm-local", "bomm-mm-uc", "bomm")
    mus: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)

    def config(self, *extra: str) -> RunConfig:
        return load_config(RECIPE, [*self.overrides, *extra])

    @cached_property
    def base(self) -> RunConfig:
        return self.config()


def quick_scale() -> Scale:
    return Scale(overrides=tuple(OVERLAYS["quick"]), aligned=(0, 8), deltas=(0.3, 0.5), mus=(0.0, 0.4))


# -- run specifications ----------------------------------------------------------------------
def spec(
    scale: Scale,
    method: str,
    seed: int,
    scenario: int,
    aligned: int,
    delta: float | None = None,
    extra: list[str] = (),
    tag: str = "",
    **labels,
) -> RunSpec:
    """One run: ``method`` in ``scenario`` with ``aligned`` aligned ids (Delta from the recipe unless given)."""
    delta = scale.base.task.options["delta"] if delta is None else delta
    values = {"method": method, "seed": seed, "task.scenario": scenario, "task.aligned": aligned, "task.delta": delta}
    name = f"{method}{tag}-s{scenario}-a{aligned}-d{delta:g}-seed{seed}"
    return RunSpec(
        name,
        [*scale.overrides, *assignments(values), *extra],
        {
            "method": method,
            "seed": seed,
            "scenario": scenario,
            "aligned": aligned,
            "delta": delta,
            "variant": tag,
            **labels,
        },
    )


def specs_table1(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        spec(scale, m, seed, scenario, a)
        for scenario in (1, 2)
        for a in scale.aligned
        for seed in seeds
        for m in METHODS
    ]


def specs_table2(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [spec(scale, m, seed, 3, 0) for seed in seeds for m in METHODS]


def specs_table3(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        spec(
            scale,
            "bomm",
            seed,
            2,
            0,
            extra=OVERLAYS[overlay] if overlay else [],
            tag=f"-{overlay}" if overlay else "",
            row=row,
        )
        for row, overlay in ABLATIONS.items()
        for seed in seeds
    ]


def specs_fig3(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    deltas = [
        spec(scale, m, seed, 1, 0, delta=d, part="delta")
        for d in scale.deltas
        for seed in seeds
        for m in scale.delta_methods
    ]
    default = BommOptions.model_fields["mu"].default  # the default's run is Table 1's (same config)
    mus = [
        spec(
            scale,
            "bomm",
            seed,
            1,
            0,
            extra=[] if mu == default else assignments({"options.mu": mu}),
            tag=f"-mu{mu:g}",
            part="mu",
            mu=mu,
        )
        for mu in scale.mus
        for seed in seeds
    ]
    return deltas + mus


def specs_cost(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [spec(scale, m, seed, 1, max(scale.aligned)) for seed in seeds for m in METHODS]


BUILDERS = {
    "table1": specs_table1,
    "table2": specs_table2,
    "table3": specs_table3,
    "fig3": specs_fig3,
    "cost": specs_cost,
}


def build_suite_plan(scale: Scale, seeds: list[int], out: Path) -> dict[str, list[RunSpec]]:
    """Every experiment's runs (all of them, so that which folder owns a shared run never depends on
    ``--only``), resolved to their configs and canonical run folders."""
    return build_plan({exp: BUILDERS[exp](scale, seeds) for exp in EXPERIMENTS}, RECIPE, out)


# -- cost model ------------------------------------------------------------------------------
# Seconds of one party's local step, the cloud's (and scheduler's) extra work per round by method, a
# round's evaluation (parties and cloud) and a run's setup (data, log-mels, phi features).
DEFAULT_COSTS = {  # one free core; from 6-round runs here (user CPU seconds, the cores being shared)
    "mnist": {
        "step_s": 0.045,
        "setup_s": 8.0,
        "eval_s": 0.6,
        "round_s": {
            "bomm-local": 0.0,
            "bomm-mm-local": 1.5,
            "bomm-vanilla": 0.2,
            "bomm-mm-ac": 0.3,
            "bomm-mm-uc": 1.2,
            "bomm": 3.5,
        },
    },
    "digits": {
        "step_s": 0.02,
        "setup_s": 5.0,
        "eval_s": 0.3,
        "round_s": {
            "bomm-local": 0.0,
            "bomm-mm-local": 0.8,
            "bomm-vanilla": 0.2,
            "bomm-mm-ac": 0.3,
            "bomm-mm-uc": 0.8,
            "bomm": 2.5,
        },
    },
}


def run_cost(config: RunConfig) -> float:
    """Estimated seconds of ``config`` on one free core: the harness's cost model with the cloud's
    per-round work spread over the parties as a per-client overhead."""
    c = DEFAULT_COSTS.get(config.data.name, DEFAULT_COSTS["mnist"])
    parties = config.federation.sample_size()
    costs = Costs(
        step_s=c["step_s"],
        eval_s_per_example=c["eval_s"] / 300,
        run_setup_s=c["setup_s"],
        client_overhead_s=c["round_s"].get(config.method, 5.0) / parties,
    )
    return estimate_s(config, costs, 300)


# -- reading runs ----------------------------------------------------------------------------
def value(spec_: RunSpec, metric: str) -> float | None:
    """The run's ``metric`` averaged over its last ``LAST`` evaluations (None while unfinished or absent)."""
    return mean_of_last(load_rounds(spec_), LAST, metric) if load_rounds(spec_) else None


def cell(specs: list[RunSpec], metric: str, scale: float = 100.0, digits: int = 2) -> str:
    values = [v for v in (value(s, metric) for s in specs) if v is not None]
    m, s = mean_std([scale * v for v in values])
    if m is None:  # nothing yet, or finished runs that do not report the metric
        return "pending" if any(load_summary(x) is None for x in specs) else "–"
    more = f" (n={len(values)})" if len(values) < len(specs) else ""
    return f"{m:.{digits}f} ± {s:.{digits}f}{more}"


def mean_value(specs: list[RunSpec], metric: str) -> float | None:
    values = [v for v in (value(s, metric) for s in specs) if v is not None]
    return 100 * sum(values) / len(values) if values else None


def setup_section(scale: Scale, seeds: list[int], command: str) -> str:
    b = scale.base
    t, o = b.task.options, b.options
    lines = [
        "## Setup",
        "",
        "Produced by",
        "",
        "```bash",
        command,
        "```",
        "",
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


def triple_row(specs: list[RunSpec], method: str) -> list[str]:
    group = with_labels(specs, method=method)
    return [
        cell(group, "party0_accuracy"),
        cell(group, "party1_accuracy"),
        cell(group, "cloud_accuracy") if method in CLOUD_METHODS else "–",
    ]


def improvement_row(specs: list[RunSpec]) -> list[str]:
    """BoMM minus the best baseline, per column (percentage points)."""
    out = []
    for metric, methods in (
        ("party0_accuracy", METHODS),
        ("party1_accuracy", METHODS),
        ("cloud_accuracy", CLOUD_METHODS),
    ):
        ours = mean_value(with_labels(specs, method="bomm"), metric)
        best = [mean_value(with_labels(specs, method=m), metric) for m in methods if m != "bomm"]
        best = [b for b in best if b is not None]
        out.append("–" if ours is None or not best else f"{ours - max(best):+.2f}")
    return out


def report_table1(specs: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
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
            group = with_labels(specs, scenario=scenario, aligned=a)
            rows = [[LABEL[m], *triple_row(group, m)] for m in METHODS] + [["Imp.", *improvement_row(group)]]
            lines += [f"### Scenario {scenario}, {a} aligned", "", *table_lines(["Method", "P1", "P2", "C"], rows), ""]
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
    return "\n".join(lines) + "\n" + runs_section(specs, out)


COMPLETING = ("bomm-mm-local", "bomm-mm-ac", "bomm-mm-uc", "bomm")


def missing_section(specs: list[RunSpec], blocks: list[tuple[int, int]]) -> list[str]:
    """Party accuracy (mean of the two parties) on the test pairs with the scenario's modality
    removed: the small model alone, and with the missing modality completed by the method's
    generator (the cloud's, or MM-LOCAL's own)."""
    cols, rows = [], {m: [LABEL[m]] for m in METHODS}
    for scenario, a in blocks:
        alone = "accuracy_audio_only" if scenario == 3 else "accuracy_image_only"
        cols += [f"s{scenario} #{a} alone", f"s{scenario} #{a} completed"]
        for m in METHODS:
            group = with_labels(specs, scenario=scenario, aligned=a, method=m)
            rows[m] += [cell(group, alone), cell(group, "accuracy_completed") if m in COMPLETING else "–"]
    return [
        "### Test pairs missing the scenario's modality (mean of P1 and P2)",
        "",
        "The scenario's missing modality (audio in scenarios 1-2, image in 3) is removed from every test pair: "
        "the small model on what is left (alone), and with the removed modality replaced by the method's "
        "completion (completed).",
        "",
        *table_lines(["Method", *cols], list(rows.values())),
        "",
    ]


def ordering_notes(specs: list[RunSpec], scale: Scale) -> list[str]:
    """Where BoMM is (or is not) the best method, column by column: the paper's claim, checked."""
    notes = ["## Does the paper's ordering reproduce?", ""]
    for scenario in (1, 2):
        for a in scale.aligned:
            group = with_labels(specs, scenario=scenario, aligned=a)
            for metric, name, methods in (
                ("party0_accuracy", "P1", METHODS),
                ("party1_accuracy", "P2", METHODS),
                ("cloud_accuracy", "C", CLOUD_METHODS),
            ):
                means = {m: mean_value(with_labels(group, method=m), metric) for m in methods}
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


def report_table2(specs: list[RunSpec], head: str, out: Path) -> str:
    rows = []
    for m in METHODS:
        group = with_labels(specs, method=m)
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
        *table_lines(["Method", "P1 Acc", "P1 Gen", "P2 Acc", "P2 Gen", "C Acc"], rows),
        "",
        "Paper (MS COCO): LOCAL 36.13 / 34.47; MM-LOCAL 30.18 / 36.62; Vanilla 38.96 / 38.18 / 27.83; MM-AC "
        "40.79 / 39.88 / 28.04; MM-UC 50.08 / 39.72 / 44.90; BoMM 52.35 / 42.16 / 51.18 (P1 / P2 / C).",
        "",
        *missing_section(specs, [(3, 0)]),
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_table3(specs: list[RunSpec], head: str, out: Path) -> str:
    rows = [
        [row, *triple_row(with_labels(specs, row=row), "bomm"), cell(with_labels(specs, row=row), "diag_pair_accuracy")]
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
        *table_lines(["Model", "P1", "P2", "C", "same-class pairs"], rows),
        "",
        "Same-class pairs: the share of the pairs eq. (9) accepts whose rows are of the same class (the pool's "
        "true labels, a diagnostic the method never reads), over the last evaluations.",
        "",
        "Paper (MS COCO): BoMM 40.17 / 39.78 / 32.39; w/o preference loss 37.51 / 38.13 / 30.82; w/o special "
        "loss 38.47 / 35.35 / 30.66; w/o scheduler 38.37 / 35.15 / 30.56.",
        "",
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig3(specs: list[RunSpec], table1: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
    conv = with_labels(table1, scenario=1, aligned=0)
    deltas, mus = with_labels(specs, part="delta"), with_labels(specs, part="mu")
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
                [f"{LABEL[m]} {col}", *(cell(with_labels(deltas, method=m, delta=d), metric) for d in scale.deltas)]
            )
    lines += table_lines(["Method", *(f"Delta {d:g}" for d in scale.deltas)], rows)
    lines += ["", "### (B-ii, iii) BoMM against mu (scenario 1, 0 aligned)", ""]
    rows = [
        [
            f"{mu:g}",
            cell(with_labels(mus, mu=mu), "accuracy"),
            cell(with_labels(mus, mu=mu), "cloud_accuracy"),
            cell(with_labels(mus, mu=mu), "selected_fraction", 1.0, 3),
        ]
        for mu in scale.mus
    ]
    lines += table_lines(["mu", "P mean", "C", "selected fraction"], rows)
    lines += ["", "![fig3](fig3.png)", ""]
    with figure(out / "fig3.png", 1, 3, figsize=(15, 4)) as (fig, (ax1, ax2, ax3)):
        for m in METHODS:
            pts = averaged_curve(with_labels(conv, method=m), "accuracy")
            if pts:
                ax1.plot([p[0] for p in pts], [100 * p[2] for p in pts], marker="o", ms=3, label=f"{LABEL[m]} P")
            if m in CLOUD_METHODS:
                pts = averaged_curve(with_labels(conv, method=m), "cloud_accuracy")
                if pts:
                    ax1.plot(
                        [p[0] for p in pts], [100 * p[2] for p in pts], ls="--", marker="s", ms=3, label=f"{LABEL[m]} C"
                    )
        ax1.set(title="(A) accuracy vs round (scenario 1, 0 aligned)", xlabel="round", ylabel="accuracy (%)")
        for m in scale.delta_methods:
            ys = [mean_value(with_labels(deltas, method=m, delta=d), "accuracy") for d in scale.deltas]
            if any(y is not None for y in ys):
                ax2.plot(
                    scale.deltas, [y if y is not None else float("nan") for y in ys], marker="o", label=f"{LABEL[m]} P"
                )
        ax2.set(title="(B-i) party accuracy vs Delta", xlabel="Delta", ylabel="accuracy (%)")
        for metric, label in (("accuracy", "P mean"), ("cloud_accuracy", "C")):
            ys = [mean_value(with_labels(mus, mu=mu), metric) for mu in scale.mus]
            if any(y is not None for y in ys):
                ax3.plot(scale.mus, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
        ax3.set(title="(B-ii) BoMM vs mu", xlabel="mu", ylabel="accuracy (%)")
        for ax in (ax1, ax2, ax3):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def per_party(spec_: RunSpec, key: str) -> list[float]:
    """Per party: the run's total of ``client_<key>`` over its rounds."""
    totals: dict[str, float] = {}
    for line in load_rounds(spec_):
        for cid, v in line.get(f"client_{key}", {}).items():
            totals[cid] = totals.get(cid, 0.0) + v
    return [totals[c] for c in sorted(totals)]


def report_cost(specs: list[RunSpec], head: str, out: Path) -> str:
    rows = []
    for m in METHODS:
        group = [s for s in with_labels(specs, method=m) if load_summary(s)]
        if not group:
            rows.append([LABEL[m], "pending", "", "", ""])
            continue
        up = [sum(per_party(s, "bytes_up")) / 1e6 / 2 for s in group]
        down = [sum(per_party(s, "bytes_down")) / 1e6 / 2 for s in group]
        comp = [sum(per_party(s, "compute_s")) / 2 for s in group]
        cloud = [sum(line.get("cloud_compute_s", 0.0) for line in load_rounds(s)) for s in group]
        fmt = lambda xs, d=2: f"{mean_std(xs)[0]:.{d}f}"  # noqa: E731
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
        *table_lines(["Method", "MB up / party", "MB down / party", "party compute s", "cloud compute s"], rows),
        "",
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


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


def parse_args(argv=None):
    p = suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="0,1,2", budget_minutes=240.0)
    p.add_argument("--rounds", type=int, default=None, help="override the recipe's rounds")
    return p.parse_args(argv)


def scale_from_args(args) -> Scale:
    scale = quick_scale() if args.quick else Scale()
    if args.rounds is not None:
        scale = replace(scale, overrides=scale.overrides + (f"rounds={args.rounds}",))
    return scale


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        selected, seeds = parse_selection(args, EXPERIMENTS)
    except SuiteError as exc:
        print(exc)
        return 2
    scale = scale_from_args(args)
    out = output_dir(args, RESULTS, QUICK_RESULTS)
    offline_data("the FSDD recordings")
    command = suite_command("benchmarks/bomm/run_suite.py", argv)
    plan = build_suite_plan(scale, seeds, out)
    runs = distinct_runs(plan, selected)
    costs = {s.key: run_cost(s.config) for s in runs}
    base = scale.base
    print(
        f"BoMM suite: {', '.join(selected)}; seeds {seeds}; data {base.data.name}; R={base.rounds}, "
        f"H={base.train.local_steps}, {base.federation.num_clients} parties -> {out}"
    )
    note = (
        f"cost model: built-in per-run estimates measured on this machine (~{estimate_minutes(runs, costs, 1):.0f} "
        "min of one core for the selection)"
    )
    return run_suite(
        plan,
        selected,
        args,
        costs,
        lambda: write_reports(plan, selected, scale, seeds, out, command),
        root=REPO,
        notes=[note],
    )


if __name__ == "__main__":
    sys.exit(main())
