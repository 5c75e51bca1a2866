"""CPU-scale counterparts of the FSLoRA paper's experiments (Fang et al. 2025, Section 5 and
Appendix C) on MiniLM, written to ``benchmarks/results/fslora/``.

Experiments (each a list of named runs on :mod:`fedtune.harness`; a run is the recipe
``configs/benchmarks/fslora-suite.toml`` plus overlays from ``fslora-suite-overlays.toml`` plus
the experiment's own settings):

- ``table51``: Table 5.1. FedIT (uniform rank = the smallest k_i, see below), FSLoRA, HeteroLoRA,
  FlexLoRA, FedStackLoRA on SST-2 and AG News: final accuracy mean +- std over seeds, MB uploaded,
  client compute seconds. Global rank r = 64, k_i / r drawn per device from {0.125, 0.25, 0.5, 0.75}
  (the baselines use r_i = k_i from the same draw).
- ``fig3``: FSLoRA with (k/r = 0.5) vs without (k/r = 1) sketching at an equal per-device upload
  budget: the sketched run gets R rounds, the unsketched one R/2, for r in {16, 64}.
- ``fig4b``: global rank r in {8, 16, 32, 64, 128} at a fixed k = 8 (k/r = 8/r; r = 8 is k/r = 1,
  the paper's Figure 6 reference point).
- ``fig4c``: k/r in {0.125, 0.25, 0.5, 1} at r = 64.
- ``fig7``: top-k upload compression (``federation.upload_topk``) with k/r in {0.125, 0.25, 0.5, 1},
  accuracy vs per-device upload MB, with fig4c's uncompressed runs as the reference.
- ``horizon``: not in the paper. Table 5.1's FedIT and FSLoRA runs on SST-2, continued to 3 R rounds,
  to test whether FSLoRA's gap to FedIT at R rounds is a short-run effect (the first R rounds are
  the very same computation as Table 5.1's runs, which the report checks).
- ``alpha``: not in the paper, which does not state lora_alpha. Table 5.1 (SST-2) and Figure 4(b)
  again with a fixed lora_alpha = 16 instead of 2 r. With 2 r, a device training k of r ranks
  scales its update by (alpha / r)(r / k) = 2 r / k, so the r = 64 methods train with up to 8x
  FedIT's (r = 8) scale and fig4b's scale grows with r; with a fixed alpha it is alpha / k for all.

The figures run on SST-2 only; Table 5.1 on SST-2 and AG News. Every set is split over 20 devices
with Dirichlet(0.5) label skew. Identical configs are run once and shared between experiments
(e.g. fig4b's r = 64 point is fig4c's k/r = 0.125 point). A run whose ``summary.json`` exists is
skipped, so an interrupted suite resumes where it stopped. Runs go to a pool of ``--workers``
processes (default 2, one torch thread each).

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data \\
        .venv/bin/python benchmarks/fslora/run_suite.py [--only table51,fig3] [--seeds 0,1] [--quick]
    ... --plan           # the runs and the time estimate, nothing run
    ... --calibrate      # measure step / evaluation / per-run costs here first (a few minutes)
    ... --report-only    # rewrite the markdown and plots from the run folders that exist

``--quick`` is a smoke test (tiny-bert, 2 rounds, a few hundred examples) written to
``benchmarks/results/_scratch/fslora-quick/`` (git-ignored).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from fedtune.config import RunConfig, load_config
from fedtune.harness import (
    Costs,
    RunSpec,
    SuiteError,
    accuracy_cell,
    assignments,
    averaged_curve,
    build_plan,
    calibrate,
    curve,
    distinct_runs,
    estimate_minutes,
    estimate_s,
    figure,
    final_accuracy,
    load_summary,
    mean_text,
    offline_data,
    output_dir,
    parse_selection,
    percent,
    probe,
    pyplot,
    read_overlays,
    run_suite,
    runs_section,
    suite_command,
    suite_parser,
    table_lines,
    upload_cell,
    with_labels,
)
from fedtune.process import setup_process

REPO = Path(__file__).resolve().parents[2]

RECIPE = REPO / "configs" / "benchmarks" / "fslora-suite.toml"
OVERLAYS = read_overlays(REPO / "configs" / "benchmarks" / "fslora-suite-overlays.toml")
RESULTS = REPO / "benchmarks" / "results" / "fslora"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "fslora-quick"
EXPERIMENTS = ["table51", "fig3", "fig4b", "fig4c", "fig7", "horizon", "alpha"]  # also the order that owns shared runs
METHODS = ["fedit", "fslora", "heterolora", "flexlora", "fedstacklora"]
ALPHA_PER_RANK = 2.0  # lora_alpha = 2 r at every global rank (configs/*.toml: alpha / r = 2)
TEST_SET_SIZES = {"sst2": 872, "agnews": 7600}  # for the cost model

MODEL_NOTES = {
    "minilm": "pretrained all-MiniLM-L6-v2, 6 layers, hidden 384, 22.7M parameters",
    "tiny-bert": "random 2-layer BERT, hidden 32: smoke test only",
}

PAPER = {  # Table A.1, RoBERTa & GLUE, and Section 5
    "model": "RoBERTa-base (125M)",
    "rounds": 200,
    "local_steps": 50,
    "devices": 20,
    "seeds": 3,
}


@dataclass(frozen=True)
class Scale:
    """The experiment grid (it names the runs) and the suite's recipe after ``overrides`` (the
    ``--quick`` overlay and the ``--rounds``-style options), which sets everything else."""

    overrides: tuple[str, ...] = ()
    table_data: tuple = ("sst2", "agnews")
    fig_data: tuple = ("sst2",)
    rank: int = 64  # global rank r of Table 5.1, fig4c, fig7
    fig3_ranks: tuple = (16, 64)
    fig3_ratio: float = 0.5
    fig4b_ranks: tuple = (8, 16, 32, 64, 128)
    fig4b_k: int = 8
    ratios: tuple = (0.125, 0.25, 0.5, 1.0)  # fig4c and fig7
    topk: float = 0.5
    horizon_factor: int = 3  # horizon: rounds = factor x R
    horizon_methods: tuple = ("fedit", "fslora")
    fixed_alpha: float = 16.0  # alpha: lora_alpha at every rank (elsewhere 2 r)

    def run_overrides(self, data: str, method: str, *extra: str) -> list[str]:
        """A run's overrides of the recipe: ``data``'s overlay, this scale's, ``method``'s, ``extra``."""
        return [*OVERLAYS[data], *self.overrides, *OVERLAYS[method], *extra]

    def config(self, data: str, method: str = "fslora", *extra: str) -> RunConfig:
        return load_config(RECIPE, self.run_overrides(data, method, *extra))

    @cached_property
    def base(self) -> RunConfig:
        """The settings every run shares (those of a figure run before its own settings)."""
        return self.config(self.fig_data[0])

    @cached_property
    def hetero_ratios(self) -> list[float]:
        """The k_i / r that Table 5.1's devices draw from (the ``hetero`` overlay)."""
        return self.config(self.fig_data[0], "fslora", *OVERLAYS["hetero"]).federation.profile_choices["sketch_ratio"]


def quick_scale() -> Scale:
    return Scale(overrides=tuple(OVERLAYS["quick"]))


# -- run specifications ----------------------------------------------------------------------


def lora(rank: int, alpha: float | None = None) -> list[str]:
    return assignments({"model.lora_rank": rank, "model.lora_alpha": ALPHA_PER_RANK * rank if alpha is None else alpha})


def fair_fedit_rank(scale: Scale, seed: int) -> int:
    """min_i k_i of the seed's heterogeneous draw: the largest uniform rank every device affords."""
    from fedtune.methods.base.lora import client_rank
    from fedtune.protocol.profiles import build_profiles

    profiles = build_profiles(scale.base.federation.num_clients, None, {"sketch_ratio": scale.hetero_ratios}, seed)
    return min(client_rank(p, scale.rank) for p in profiles)


def table51_spec(
    scale: Scale,
    method: str,
    data: str,
    seed: int,
    rounds: int | None = None,
    alpha: float | None = None,
    name: str = "",
) -> RunSpec:
    """One Table 5.1 run: heterogeneous k_i / r for every method but FedIT (uniform r = min k_i)."""
    rank = fair_fedit_rank(scale, seed) if method == "fedit" else scale.rank
    extra = [
        f"seed={seed}",
        *lora(rank, alpha),
        *([] if method == "fedit" else OVERLAYS["hetero"]),
        *([f"rounds={rounds}"] if rounds else []),
    ]
    return RunSpec(
        name or f"{method}-{data}-s{seed}",
        scale.run_overrides(data, method, *extra),
        {
            "method": method,
            "data": data,
            "seed": seed,
            "rank": rank,
            "rounds": rounds or scale.base.rounds,
            "alpha": alpha,
        },
    )


def fslora_spec(
    name: str,
    scale: Scale,
    data: str,
    seed: int,
    rank: int,
    ratio: float,
    rounds: int | None = None,
    topk: float | None = None,
    alpha: float | None = None,
    **labels,
) -> RunSpec:
    """One FSLoRA run with every device at sketching ratio ``ratio``."""
    extra = [
        f"seed={seed}",
        *lora(rank, alpha),
        *assignments({"federation.profiles": [{"sketch_ratio": ratio}]}),
        *([f"rounds={rounds}"] if rounds else []),
        *([f"federation.upload_topk={topk!r}"] if topk is not None else []),
    ]
    return RunSpec(
        name,
        scale.run_overrides(data, "fslora", *extra),
        {
            "method": "fslora",
            "data": data,
            "seed": seed,
            "rank": rank,
            "ratio": ratio,
            "rounds": rounds or scale.base.rounds,
            "topk": topk,
            "alpha": alpha,
            **labels,
        },
    )


def specs_table51(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        table51_spec(scale, method, data, seed) for data in scale.table_data for seed in seeds for method in METHODS
    ]


def fig3_short_rounds(scale: Scale) -> int:
    """Rounds of fig3's unsketched runs: equal per-device upload (they upload 1/ratio times more per round)."""
    return max(1, round(scale.base.rounds * scale.fig3_ratio))


def specs_fig3(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        spec
        for data in scale.fig_data
        for seed in seeds
        for rank in scale.fig3_ranks
        for spec in (
            fslora_spec(
                f"r{rank}-nosketch-{data}-s{seed}",
                scale,
                data,
                seed,
                rank,
                1.0,
                rounds=fig3_short_rounds(scale),
                sketch=False,
            ),
            fslora_spec(
                f"r{rank}-sketch{scale.fig3_ratio:g}-{data}-s{seed}",
                scale,
                data,
                seed,
                rank,
                scale.fig3_ratio,
                sketch=True,
            ),
        )
    ]


def specs_fig4b(scale: Scale, seeds: list[int], alpha: float | None = None, tag: str = "") -> list[RunSpec]:
    return [
        fslora_spec(
            f"{tag}r{rank}-k{scale.fig4b_k}-{data}-s{seed}",
            scale,
            data,
            seed,
            rank,
            min(1.0, scale.fig4b_k / rank),
            alpha=alpha,
            part="fig4b",
        )
        for data in scale.fig_data
        for seed in seeds
        for rank in scale.fig4b_ranks
    ]


def specs_fig4c(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        fslora_spec(f"ratio{ratio:g}-{data}-s{seed}", scale, data, seed, scale.rank, ratio)
        for data in scale.fig_data
        for seed in seeds
        for ratio in scale.ratios
    ]


def specs_fig7(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        fslora_spec(
            f"topk{scale.topk:g}-ratio{ratio:g}-{data}-s{seed}", scale, data, seed, scale.rank, ratio, topk=scale.topk
        )
        for data in scale.fig_data
        for seed in seeds
        for ratio in scale.ratios
    ]


def specs_horizon(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        table51_spec(scale, method, data, seed, rounds=scale.horizon_factor * scale.base.rounds)
        for data in scale.fig_data
        for seed in seeds
        for method in scale.horizon_methods
    ]


def specs_alpha(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    """Table 5.1 (figure data sets) and fig4b at ``lora_alpha = scale.fixed_alpha`` for every rank."""
    tag = f"alpha{scale.fixed_alpha:g}-"
    table = [
        table51_spec(scale, method, data, seed, alpha=scale.fixed_alpha, name=f"{tag}{method}-{data}-s{seed}")
        for data in scale.fig_data
        for seed in seeds
        for method in METHODS
    ]
    for spec in table:
        spec.labels["part"] = "table51"
    return table + specs_fig4b(scale, seeds, scale.fixed_alpha, tag)


BUILDERS = {
    "table51": specs_table51,
    "fig3": specs_fig3,
    "fig4b": specs_fig4b,
    "fig4c": specs_fig4c,
    "fig7": specs_fig7,
    "horizon": specs_horizon,
    "alpha": specs_alpha,
}


def build_suite_plan(scale: Scale, seeds: list[int], out: Path) -> dict[str, list[RunSpec]]:
    """Every experiment's runs (all of them, so that which folder owns a shared run never depends
    on ``--only``), resolved to their configs and canonical run folders."""
    return build_plan({exp: BUILDERS[exp](scale, seeds) for exp in EXPERIMENTS}, RECIPE, out)


# -- cost model and calibration ---------------------------------------------------------------

# What --calibrate measured on the 2-core VM (one torch thread; load average ~3 from other jobs),
# used when <out>/calibration.json is absent.
DEFAULT_CALIBRATION = {
    "minilm": {
        "sst2": {"step_s": 0.189, "eval_s_per_example": 0.0091, "run_setup_s": 1.7},
        "agnews": {"step_s": 0.534, "eval_s_per_example": 0.0150, "run_setup_s": 5.1},
        "method_client_overhead_s": {
            "fedit": 0.17,
            "fslora": 0.16,
            "heterolora": 0.35,
            "flexlora": 0.26,
            "fedstacklora": 0.35,
        },
    },
}


def load_calibration(out: Path) -> tuple[dict, str]:
    path = out / "calibration.json"
    if path.is_file():
        return json.loads(path.read_text()), os.path.relpath(path, REPO)
    return DEFAULT_CALIBRATION, "built-in defaults (measured for minilm; run --calibrate)"


def test_size(config: RunConfig) -> int:
    full = TEST_SET_SIZES.get(config.data.name, 2000)
    return min(full, config.data.max_test_samples or full)


def run_costs(config: RunConfig, calibration: dict) -> Costs:
    """The calibrated costs of ``config``'s model (else minilm's), data set (else sst2's) and method."""
    model = calibration.get(config.model.name) or calibration.get("minilm") or DEFAULT_CALIBRATION["minilm"]
    data = model.get(config.data.name) or model["sst2"]
    return Costs(
        data["step_s"],
        data["eval_s_per_example"],
        data["run_setup_s"],
        model["method_client_overhead_s"].get(config.method, 0.1),
    )


def calibrate_here(scale: Scale, out: Path) -> dict:
    """Measure, with one torch thread, each data set's step, evaluation and setup costs (FSLoRA's
    Table 5.1 config) and each method's per-client overhead beyond its steps (first data set), with
    short runs; merge them into ``<out>/calibration.json`` under the model's name."""
    setup_process(1)
    data_sets = sorted(set(scale.table_data) | set(scale.fig_data))
    model: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for data in data_sets:
            costs = calibrate(scale.config(data, "fslora", *lora(scale.rank), *OVERLAYS["hetero"]), Path(tmp))
            model[data] = {
                "step_s": costs.step_s,
                "eval_s_per_example": costs.eval_s_per_example,
                "run_setup_s": costs.run_setup_s,
            }
            print(
                f"calibration {data}: step {costs.step_s:.3f} s, evaluation {costs.eval_s_per_example:.4f} s "
                f"per example, run setup {costs.run_setup_s:.1f} s",
                flush=True,
            )
        overhead = model["method_client_overhead_s"] = {}
        for method in METHODS:
            extra = lora(8) if method == "fedit" else [*lora(scale.rank), *OVERLAYS["hetero"]]
            client_s = probe(scale.config(data_sets[0], method, *extra), Path(tmp), 2).client_s
            overhead[method] = max(0.0, client_s - 2 * model[data_sets[0]]["step_s"])
            print(f"calibration {method}: {overhead[method]:.3f} s per client and round beyond its steps", flush=True)
    path = out / "calibration.json"
    calibration = json.loads(path.read_text()) if path.is_file() else {}
    calibration.update(
        {
            scale.base.model.name: model,
            "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "threads": 1,
            "loadavg_1min": os.getloadavg()[0],
            "cpu_count": os.cpu_count(),
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=2) + "\n")
    return calibration


# -- reports ---------------------------------------------------------------------------------


def scale_section(scale: Scale, seeds: list[int], data_sets: tuple, command: str, extra: list[str]) -> str:
    base = scale.base
    train = ", ".join(f"{d}: {scale.config(d).data.max_train_samples or 'all'}" for d in data_sets)
    test = ", ".join(f"{d}: {scale.config(d).data.max_test_samples or 'all'}" for d in data_sets)
    lines = [
        "Produced by",
        "",
        "```bash",
        command,
        "```",
        "",
        "| | paper (RoBERTa & GLUE, Table A.1 / Sec. 5) | here |",
        "|---|---|---|",
        f"| model | {PAPER['model']} | `{base.model.name}` "
        f"({MODEL_NOTES.get(base.model.name, 'see fedtune.models.loading')}) |",
        "| LoRA | targets query/value + head, dropout 0.1, alpha not stated | query/value + classifier head, "
        f"dropout {base.model.lora_dropout}, lora_alpha = {ALPHA_PER_RANK:g} r |",
        f"| devices | {PAPER['devices']} | {base.federation.num_clients}, Dirichlet(alpha = {base.data.alpha}) "
        "label skew |",
        f"| devices per round | all | {base.federation.clients_per_round} sampled uniformly per round |",
        f"| rounds T | {PAPER['rounds']} | {base.rounds} |",
        f"| local steps H | {PAPER['local_steps']} | {base.train.local_steps} |",
        "| batch, optimizer, lr | 16, not stated (Algorithm 1 writes plain SGD steps), 5e-4 | "
        f"{base.train.batch_size}, AdamW "
        f"(fresh state each round), {base.train.lr:g} (below) |",
        f"| training examples | full GLUE task | {train} (max_length {base.data.max_length}) |",
        f"| test examples | GLUE dev | {test} (SST-2 test = the 872-sentence GLUE dev set) |",
        f"| evaluation | – | every {base.eval_every} rounds and the last |",
        f"| seeds | {PAPER['seeds']} | {', '.join(map(str, seeds))} |",
        "",
        "Every method and run uses these same training settings (nothing is tuned per method); "
        "accuracies are mean ± sample std (ddof 1) over the seeds. The seed fixes the partition, the "
        "device sampling, the per-device ratios, the sketches and the data order.",
        "",
        f"Learning rate {base.train.lr:g} rather than the paper's 5e-4: the suite runs about 1 % of the paper's "
        f"sequential local steps (R x H = {base.rounds * base.train.local_steps} vs 200 x 50). In a pilot on "
        "SST-2 at 5e-4 (8 rounds x 5 steps, 10 of 20 devices per round) FedIT (r = 8) and FSLoRA were "
        "still at chance (51-52 %); at 1e-3 (24 rounds x 4 steps, 8 devices per round) FSLoRA reached "
        "71 % and HeteroLoRA 66 %. 1e-3 is used for every method and run. Plain SGD (Algorithm 1's update) "
        "at lr 0.02 and 0.1 left the k = r = 8 configuration at chance after 20 rounds (50.92 %, 51.83 %; "
        "seed 0, one run each), so every run uses AdamW.",
    ]
    return "\n".join(lines + ([""] + extra if extra else [])) + "\n"


def fedit_label(method: str) -> str:
    return method + (" (r = min k_i)" if method == "fedit" else "")


def report_table51(specs: list[RunSpec], scale: Scale, seeds: list[int], head: str, out: Path) -> str:
    data_sets = [d for d in scale.table_data if any(s.labels["data"] == d for s in specs)]
    ratios = scale.hetero_ratios
    lines = [
        "# Table 5.1 (CPU scale): heterogeneous LoRA methods",
        "",
        f"Global rank r = {scale.rank}; each device's k_i / r is drawn (with the seed) from "
        f"{{{', '.join(f'{r:g}' for r in ratios)}}} (paper Sec. 5.2); HeteroLoRA, FlexLoRA and "
        "FedStackLoRA give device i the rank r_i = k_i of the same draw (`federation.profile_choices`).",
        "",
        "**FedIT rank.** FedIT needs one rank for every device. The fair choice under the same device "
        "budgets is the largest rank *every* device can afford, r = min_i k_i (= "
        + ", ".join(f"{fair_fedit_rank(scale, s)} for seed {s}" for s in seeds)
        + "; lora_alpha = 2 r): no device then uploads or computes more than its k_i allows. "
        f"FedIT at r = {scale.rank} would give the small devices up to {int(1 / min(ratios))}x "
        "their budget (an upper reference, not a competitor under heterogeneous resources).",
        "",
        head,
        "## Results",
        "",
    ]
    cols = ["Method"]
    for d in data_sets:
        cols += [f"{d} acc (%)", f"{d} MB up", f"{d} MB down", f"{d} client compute s"]
    rows = []
    for method in METHODS:
        row = [fedit_label(method)]
        for d in data_sets:
            group = with_labels(specs, method=method, data=d)
            sums = [x for x in map(load_summary, group) if x is not None]
            n = f" (n={len(sums)})" if len(sums) not in (0, len(group)) else ""
            row += [
                percent([x["final_accuracy"] for x in sums]) + n,
                mean_text([x["total_bytes_up"] / 1e6 for x in sums], ".1f"),
                mean_text([x["total_bytes_down"] / 1e6 for x in sums], ".1f"),
                mean_text([x["total_compute_s"] for x in sums], ".0f"),
            ]
        rows.append(row)
    lines += table_lines(cols, rows)
    majority = {}
    for d in data_sets:
        vals = [v["majority_accuracy"] for v in map(load_summary, with_labels(specs, data=d)) if v]
        majority[d] = f"{100 * vals[0]:.2f}" if vals else "–"
    lines += [
        "",
        "Majority-class accuracy of the test sets: " + ", ".join(f"{d} {majority[d]} %" for d in data_sets) + ".",
        "MB up / down: totals over all devices and rounds (mean over seeds), the bytes of the encoded "
        "messages. Client compute s: summed wall seconds of the client fit calls (`total_compute_s`), "
        "measured with two runs sharing two cores, so only rough ratios between methods are meaningful.",
        "",
        "![accuracy vs round](table51.png)",
        "",
    ]
    size = (5.5 * len(data_sets), 4)
    with figure(out / "table51.png", 1, len(data_sets), figsize=size, squeeze=False) as (fig, axes):
        for ax, d in zip(axes[0], data_sets):
            for method in METHODS:
                pts = averaged_curve(with_labels(specs, method=method, data=d))
                if pts:
                    ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], marker="o", ms=3, label=method)
            if majority[d] != "–":
                ax.axhline(float(majority[d]), color="gray", ls=":", lw=1, label="majority class")
            ax.set(title=f"{d}: accuracy vs round (mean over seeds)", xlabel="round", ylabel="accuracy (%)")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig3(specs: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
    ranks = list(scale.fig3_ranks)
    short, base = fig3_short_rounds(scale), scale.base
    fed = base.federation
    data = scale.fig_data[0]
    specs_of = {
        (r, sketch): with_labels(specs, rank=r, sketch=sketch, data=data) for r in ranks for sketch in (False, True)
    }
    lines = [
        "# Figure 3 (CPU scale): FSLoRA with vs without sketching at an equal upload budget",
        "",
        f"Uniform k/r = {scale.fig3_ratio:g} (sketch) vs k/r = 1 (no sketch: FSLoRA is then FedIT with "
        "eq. (5)'s uniform weights). The paper fixes each device's upload budget at 100x the full "
        f"global LoRA modules at rank r; here the unsketched run gets {short} rounds and the sketched run "
        f"{base.rounds}, so with {fed.clients_per_round} of {fed.num_clients} devices per round each device "
        f"uploads, in expectation, {short * fed.clients_per_round / fed.num_clients:g}x "
        "the full global LoRA modules (plus the head) in both runs. The measured per-device MB are in the table.",
        "",
        head,
        "## Results",
        "",
    ]
    rows = [
        [
            str(r),
            accuracy_cell(specs_of[r, False]),
            upload_cell(specs_of[r, False]),
            accuracy_cell(specs_of[r, True]),
            upload_cell(specs_of[r, True]),
        ]
        for r in ranks
    ]
    lines += table_lines(
        ["r", "no sketch acc (%)", "no sketch MB up / device", "sketch acc (%)", "sketch MB up / device"], rows
    )
    lines += ["", f"Data: {', '.join(scale.fig_data)} only.", "", "![fig3](fig3.png)", ""]
    with figure(out / "fig3.png", 1, 2, figsize=(11, 4)) as (fig, (ax1, ax2)):
        width = 0.38
        for j, (sketch, label) in enumerate(
            [(False, "w/o sketching (k/r = 1)"), (True, f"w/ sketching (k/r = {scale.fig3_ratio:g})")]
        ):
            finals = [final_accuracy(specs_of[r, sketch]) for r in ranks]
            ax1.bar(
                [i + (j - 0.5) * width for i in range(len(ranks))],
                [m or 0.0 for m, _, _ in finals],
                width,
                yerr=[s or 0.0 for _, s, _ in finals],
                capsize=3,
                label=label,
            )
        ax1.set_xticks(range(len(ranks)), [f"r = {r}" for r in ranks])
        ax1.set(title=f"{data}: final accuracy at equal upload budget", ylabel="accuracy (%)")
        ax1.set_ylim(max(0, (final_accuracy(with_labels(specs, data=data))[0] or 50) - 15), None)
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3, axis="y")
        for r in ranks:
            for sketch, style in [(False, "--"), (True, "-")]:
                pts = averaged_curve(specs_of[r, sketch])
                if pts:
                    ax2.plot(
                        [p[1] for p in pts],
                        [100 * p[2] for p in pts],
                        style,
                        marker="o",
                        ms=3,
                        label=f"r = {r}, " + ("sketch" if sketch else "no sketch"),
                    )
        ax2.set(
            title="accuracy vs per-device upload (mean over seeds)",
            xlabel="MB uploaded per device",
            ylabel="accuracy (%)",
        )
        ax2.grid(alpha=0.3)
        if ax2.get_legend_handles_labels()[0]:
            ax2.legend(fontsize=8)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def sweep_report(
    exp: str,
    title: str,
    intro: str,
    specs: list[RunSpec],
    scale: Scale,
    head: str,
    out: Path,
    label: str,
    xs: tuple,
    columns: list[str],
    cells,
    xlabel: str,
    plot_title: str,
) -> str:
    """An FSLoRA sweep over ``labels[label] in xs`` (fig data set): a table with ``columns`` (from
    ``cells(x)``) plus final accuracy and MB up per device, and final accuracy vs x (log2 axis)."""
    data = scale.fig_data[0]
    groups = [with_labels(specs, **{label: x}, data=data) for x in xs]
    lines = [title, "", intro, "", head, "## Results", ""]
    lines += table_lines(
        columns + ["final acc (%)", "MB up / device"],
        [[*cells(x), accuracy_cell(g), upload_cell(g)] for x, g in zip(xs, groups)],
    )
    lines += ["", f"Data: {', '.join(scale.fig_data)} only.", "", f"![{exp}]({exp}.png)", ""]
    with figure(out / f"{exp}.png", figsize=(5.5, 4)) as (fig, ax):
        pts = [(x, *final_accuracy(g)[:2]) for x, g in zip(xs, groups)]
        pts = [p for p in pts if p[1] is not None]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
        ax.set(title=plot_title, xlabel=xlabel, ylabel="final accuracy (%)")
        ax.grid(alpha=0.3)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig4b(specs: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
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


def report_fig4c(specs: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
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


def report_fig7(specs: list[RunSpec], ref: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
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
        g, r = with_labels(specs, ratio=x, data=data), with_labels(ref, ratio=x, data=data)
        rows.append([f"{x:g}", accuracy_cell(g), upload_cell(g), accuracy_cell(r), upload_cell(r)])
    lines += table_lines(
        ["k/r", "top-k acc (%)", "top-k MB up / device", "no top-k acc (%)", "no top-k MB up / device"], rows
    )
    lines += ["", f"Data: {', '.join(scale.fig_data)} only.", "", "![fig7](fig7.png)", ""]
    with figure(out / "fig7.png", figsize=(6.5, 4.5)) as (fig, ax):
        colors = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
        for i, x in enumerate(scale.ratios):
            for group, style, tag in [(specs, "-", f"top-k {scale.topk:g}"), (ref, "--", "no top-k")]:
                pts = averaged_curve(with_labels(group, ratio=x, data=data))
                if pts:
                    ax.plot(
                        [p[1] for p in pts],
                        [100 * p[2] for p in pts],
                        style,
                        marker="o",
                        ms=3,
                        color=colors[i % len(colors)],
                        label=f"k/r = {x:g}" + (" (no sketch)" if x == 1 else "") + f", {tag}",
                    )
        ax.set(
            title=f"{data}: accuracy vs per-device upload (r = {scale.rank})",
            xlabel="MB uploaded per device",
            ylabel="accuracy (%)",
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return "\n".join(lines) + "\n" + runs_section(specs + with_labels(ref, data=data), out)


def report_horizon(specs: list[RunSpec], table51: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
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
    curves = {id(s): curve(s) for s in specs}
    evals = sorted(set.intersection(*[{p[0] for p in c} for c in curves.values()]) if all(curves.values()) else set())

    def at(spec: RunSpec, rnd: int) -> float | None:
        return next((p[2] for p in curves[id(spec)] if p[0] == rnd), None)

    rows = []
    for method in methods:
        group = with_labels(specs, method=method, data=data)
        checks = []
        for s in group:
            ref = next(iter(with_labels(table51, method=method, data=data, seed=s.labels["seed"])), None)
            here, there = at(s, short), (load_summary(ref) or {}).get("final_accuracy") if ref else None
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
                *(percent([at(s, r) for s in group]) for r in evals),
                upload_cell(group),
                ", ".join(checks),
            ]
        )
    lines += table_lines(
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
    with figure(out / "horizon.png", figsize=(6, 4)) as (fig, ax):
        for method in methods:
            pts = averaged_curve(with_labels(specs, method=method, data=data))
            if pts:
                ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], marker="o", ms=3, label=method)
        ax.axvline(short, color="gray", ls=":", lw=1, label=f"Table 5.1 stops (R = {short})")
        ax.set(title=f"{data}: accuracy vs round (mean over seeds)", xlabel="round", ylabel="accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_alpha(specs: list[RunSpec], plan: dict[str, list[RunSpec]], scale: Scale, head: str, out: Path) -> str:
    data = scale.fig_data[0]
    a, k, ratios = scale.fixed_alpha, scale.fig4b_k, scale.hetero_ratios
    table, sweep = with_labels(specs, part="table51", data=data), with_labels(specs, part="fig4b", data=data)
    ref_table, ref_sweep = with_labels(plan["table51"], data=data), with_labels(plan["fig4b"], data=data)
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
    lines += table_lines(
        ["method", "alpha = 2 r acc (%)", f"alpha = {a:g} acc (%)"],
        [
            [
                fedit_label(m),
                accuracy_cell(with_labels(ref_table, method=m)),
                accuracy_cell(with_labels(table, method=m)),
            ]
            for m in METHODS
        ],
    )
    lines += ["", f"## Figure 4(b): global rank r at k = {k}", ""]
    lines += table_lines(
        ["r", "k/r", "alpha = 2 r: device scale", "acc (%)", f"alpha = {a:g}: device scale", "acc (%)"],
        [
            [
                str(r),
                f"{min(k, r) / r:g}",
                f"{2 * r / min(k, r):g}",
                accuracy_cell(with_labels(ref_sweep, rank=r)),
                f"{a / min(k, r):g}",
                accuracy_cell(with_labels(sweep, rank=r)),
            ]
            for r in scale.fig4b_ranks
        ],
    )
    lines += ["", "Accuracy: final, mean ± sample std over the seeds.", "", "![alpha](alpha.png)", ""]
    with figure(out / "alpha.png", 1, 2, figsize=(11, 4)) as (fig, (ax1, ax2)):
        width = 0.38
        for j, (group, label) in enumerate([(ref_table, "alpha = 2 r"), (table, f"alpha = {a:g}")]):
            finals = [final_accuracy(with_labels(group, method=m)) for m in METHODS]
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
            pts = [(r, *final_accuracy(with_labels(group, rank=r))[:2]) for r in scale.fig4b_ranks]
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
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def write_reports(
    plan: dict[str, list[RunSpec]],
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


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    p = suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS)
    p.add_argument("--calibrate", action="store_true", help="measure step/eval/setup costs here first (a few minutes)")
    p.add_argument("--rounds", type=int, default=None, help="override R (rounds)")
    p.add_argument("--local-steps", type=int, default=None, help="override H (local steps)")
    p.add_argument("--clients-per-round", type=int, default=None, help="override devices sampled per round")
    p.add_argument("--eval-every", type=int, default=None, help="override the evaluation interval (rounds)")
    p.add_argument("--topk", type=float, default=None, help="fig7's federation.upload_topk (default 0.5)")
    return p.parse_args(argv)


def scale_from_args(args) -> Scale:
    """The scale a command line asks for: ``--quick``'s overlay, then the R/H/... overrides."""
    options = {
        "rounds": args.rounds,
        "train.local_steps": args.local_steps,
        "federation.clients_per_round": args.clients_per_round,
        "eval_every": args.eval_every,
    }
    scale = quick_scale() if args.quick else Scale()
    scale = replace(
        scale,
        overrides=scale.overrides
        + tuple(assignments({key: value for key, value in options.items() if value is not None})),
    )
    return scale if args.topk is None else replace(scale, topk=args.topk)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        selected, seeds = parse_selection(args, EXPERIMENTS)
    except SuiteError as exc:
        print(exc)
        return 2
    scale = scale_from_args(args)
    out = output_dir(args, RESULTS, QUICK_RESULTS)
    offline_data("sst2/agnews")
    command = suite_command("benchmarks/fslora/run_suite.py", argv)
    plan = build_suite_plan(scale, seeds, out)

    if args.calibrate and not args.report_only:
        print(f"calibrating {scale.base.model.name} with one torch thread ...", flush=True)
        calibrate_here(scale, out)
    calibration, source = load_calibration(out)
    if scale.base.model.name not in calibration:
        source += f"; no {scale.base.model.name} entry, minilm costs used (an overestimate for tiny-bert)"
    runs = distinct_runs(plan, selected)
    costs = {s.key: estimate_s(s.config, run_costs(s.config, calibration), test_size(s.config)) for s in runs}
    model_cal = calibration.get(scale.base.model.name, {})
    steps = ", ".join(f"{d} {v['step_s']:.3f} s" for d, v in model_cal.items() if isinstance(v, dict) and "step_s" in v)
    evals = ", ".join(
        f"{d} {model_cal[d]['eval_s_per_example'] * n:.1f} s ({n} examples)"
        for d in sorted(set(scale.table_data) | set(scale.fig_data))
        if isinstance(model_cal.get(d), dict)
        for n in [test_size(scale.config(d))]
    )
    calibration_note = (
        f"Cost model ({source}): one local step (batch {scale.base.train.batch_size}, max_length "
        f"{scale.base.data.max_length}, one thread) {steps or 'uncalibrated'}; one evaluation pass "
        f"{evals or 'uncalibrated'}. Estimated suite time with {args.workers} workers: "
        f"{estimate_minutes(runs, costs, args.workers):.0f} min."
    )
    base = scale.base
    print(
        f"FSLoRA suite: {', '.join(selected)}; seeds {seeds}; model {base.model.name}; R={base.rounds}, "
        f"H={base.train.local_steps}, {base.federation.clients_per_round}/{base.federation.num_clients} devices "
        f"per round -> {out}"
    )
    return run_suite(
        plan,
        selected,
        args,
        costs,
        lambda: write_reports(plan, selected, scale, seeds, out, command, calibration_note),
        root=REPO,
        notes=[f"calibration: {source}; {steps}"],
    )


if __name__ == "__main__":
    sys.exit(main())
