"""The FedPFT suite's setup section, rate sweep and Table 1 (accuracy and costs)."""

from __future__ import annotations

from pathlib import Path

from fedpft_experiments import LABEL, LAST, METHODS, PAPER, PROXY_METHODS, RECIPE, TEXT, Scale, choices_of, last_mean

from fedtune import harness
from fedtune.config import load_config
from fedtune.harness.stats import mean


def proxy_cell(specs: list[harness.RunSpec]) -> str:
    if not any(s.config.method in PROXY_METHODS for s in specs):
        return "(full model)"
    return harness.percent([last_mean(s, "proxy_accuracy") for s in specs])


def run_costs(spec_: harness.RunSpec) -> dict[str, float] | None:
    """Per-run cost figures from ``metrics.jsonl`` (None while unfinished)."""
    rounds = harness.load_rounds(spec_)
    if not rounds:
        return None
    client_rounds = sum(len(r["clients"]) for r in rounds)
    proxy_bytes = sum(r.get("proxy_download_bytes", 0) for r in rounds)
    downloads = sum(r.get("proxy_downloads", 0) for r in rounds)
    per_round = sum(r["bytes_up"] + r["bytes_down"] for r in rounds) - proxy_bytes
    computes = [v for r in rounds for v in r["client_compute_s"].values()]
    last = rounds[-1]
    return {
        "trainable": last.get("client_trainable_params"),
        "model": last.get("client_model_params"),
        "round_mb": per_round / client_rounds / 1e6,
        "proxy_mb": proxy_bytes / downloads / 1e6 if downloads else 0.0,
        "compute_s": sum(computes) / len(computes) if computes else None,
        "peak_mb": max((r.get("client_peak_mem_mb", 0) for r in rounds), default=None),
    }


def cost_cells(specs: list[harness.RunSpec]) -> list[str]:
    runs = [c for c in map(run_costs, specs) if c]

    def m(key, fmt):
        return harness.mean_text([c[key] for c in runs if c[key] is not None], fmt)

    millions = harness.mean_text([c["trainable"] / 1e6 for c in runs if c["trainable"]], ".3f")
    model = harness.mean_text([c["model"] / 1e6 for c in runs if c["model"]], ".2f")
    return [millions, model, m("round_mb", ".3f"), m("proxy_mb", ".1f"), m("compute_s", ".2f"), m("peak_mb", ".0f")]


COST_COLUMNS = [
    "trainable params (M)",
    "client model params (M)",
    "MB / client-round (up + down, w/o proxy)",
    "proxy download MB / client (once)",
    "client compute s / round",
    "peak client train MB",
]


def ordering_note(values: dict[str, list[float | None]], label: str) -> str:
    """Whether the paper's ordering (FedPFT > FedOT, FedPFT close to FedPETuning) holds here."""
    means = {m: mean([v for v in vals if v is not None]) for m, vals in values.items()}
    if any(v is None for v in means.values()):
        return f"{label}: pending."
    pft, ot, pet = 100 * means["fedpft"], 100 * means["fedot"], 100 * means["fedpetuning"]
    above = "above" if pft > ot else "not above"
    return (
        f"{label}: FedPFT {pft:.2f} is {above} FedOT {ot:.2f} ({pft - ot:+.2f}) and {abs(pet - pft):.2f} points "
        f"{'below' if pet >= pft else 'above'} FedPETuning {pet:.2f}"
        + ("" if pft > ot else " — the paper's FedPFT > FedOT does not reproduce here")
        + "."
    )


def head(scale: Scale, seeds: list[int], command: str, note: str) -> str:
    base = load_config(RECIPE, scale.overrides("sst2", "fedpft"))
    return "\n".join(
        [
            "## Setup",
            "",
            *harness.produced_by(command),
            f"Model `{base.model.name}`; {base.federation.num_clients} clients, {base.federation.sample_size()} "
            "sampled per "
            f"round, {base.rounds} rounds of {base.train.local_steps} local steps (batch {base.train.batch_size}, "
            "AdamW, "
            + ("lr chosen per data set and method, see below" if scale.sweep else f"lr {base.train.lr:g}")
            + f"); LoRA rank {base.model.lora_rank} (alpha {base.model.lora_alpha:g}) on query / value + the "
            f"head; seeds {', '.join(map(str, seeds))}. At full scale (MiniLM; --quick runs tiny random models): "
            "FedPFT keeps 25 % of the FFN neurons of layers 1-4, 200 "
            "distillation steps before FL, t = 10, p = 0.5, 20 alignment steps; FedOT's adapter = layers 0 and 5 "
            "(LoRA rank "
            "24, the same trainable budget), emulator = layers 1 and 4 (uniform drop of 4 to 2), 200 distillation "
            "steps. "
            "Public sets: AG News for SST-2, SST-2 for AG News, Fashion-MNIST for digits. Accuracy: mean of each run's "
            f"last {LAST} evaluations, then mean ± sample std over seeds; `accuracy` is the full model's with the "
            "adapter plugged back, `proxy` the proxy's with the same adapter.",
            "",
            *rates_text(scale, seeds),
            note,
            "",
        ]
    )


def rates_text(scale: Scale, seeds: list[int]) -> list[str]:
    """The setup's paragraph on how the rates were chosen (nothing without a sweep)."""
    if scale.sweep is None:
        return []
    sw = scale.sweep
    return [
        f"**Rates.** Each method's learning rate is chosen per data set on seed {sw.seed} from "
        f"{{{', '.join(f'{lr:g}' for lr in sw.grid)}}}: the rate with the highest mean of its last {LAST} "
        "evaluations' full-model accuracy (`sweep.md`; ties: the smaller rate). Table 1 runs each (data set, "
        "method) at its choice, Tables 3-5 each method at its SST-2 choice (the ablations and the t / p settings "
        f"at FedPFT's), on seeds {', '.join(map(str, seeds))}"
        + (
            " (the sweep seed among them: its run is the one that chose the rate, a biased figure)."
            if sw.seed in seeds
            else ", which played no part in the choice."
        )
        + " Table 2 (random ViT) runs at the recipe's rate.",
        "",
    ]


def rate_cell(specs: list[harness.RunSpec]) -> str:
    """The learning rate the specs ran at (one value, or the distinct ones)."""
    rates = sorted({s.config.train.lr for s in specs})
    return ", ".join(f"{lr:g}" for lr in rates) if rates else "waiting for the sweep"


def write_sweep(specs, scale, hd, out: Path) -> str:
    """Each (data set, method)'s accuracy at every grid rate on the sweep seed, and its choice."""
    choices = choices_of(specs)
    lines = [
        "# Learning-rate sweep (CPU scale): each method's own rate",
        "",
        f"Each cell: the run's mean of its last {LAST} evaluations' full-model accuracy (%), one seed; **bold**: "
        "the chosen rate (automatic argmax).",
        "",
        hd,
    ]
    panels = {d: {LABEL[m]: harness.with_labels(specs, data=d, method=m) for m in METHODS} for d in TEXT}
    lines += harness.sweep_sections(
        panels,
        {d: {LABEL[m]: choices.get((d, m)) for m in METHODS} for d in TEXT},
        lambda s: last_mean(s, "accuracy"),
        out / "sweep.png",
        ylabel=f"accuracy, mean of last {LAST} (%)",
    )
    return "\n".join([*lines, "![sweep](sweep.png)", ""]) + "\n" + harness.runs_section(specs, out)


def write_table1(specs, scale, hd, out: Path) -> str:
    lines = [
        "# Table 1 (CPU scale): FedPETuning, FedOT, FedPFT on SST-2 and AG News (MiniLM, I.I.D.)",
        "",
        hd,
        "## Results",
        "",
    ]
    what = ("lr", "acc (%)", "proxy acc (%)") if scale.sweep else ("acc (%)", "proxy acc (%)")
    cols = ["method"] + [f"{d} {w}" for d in TEXT for w in what] + [f"sst2 {c}" for c in COST_COLUMNS]
    rows = []
    for m in METHODS:
        row = [LABEL[m]]
        for d in TEXT:
            g = harness.with_labels(specs, method=m, data=d)
            row += ([rate_cell(g)] if scale.sweep else []) + [harness.accuracy_cell(g, LAST), proxy_cell(g)]
        rows.append(row + cost_cells(harness.with_labels(specs, method=m, data="sst2")))
    lines += harness.table_lines(cols, rows)
    lines += [""] + [
        ordering_note(
            {m: [last_mean(s, "accuracy") for s in harness.with_labels(specs, method=m, data=d)] for m in METHODS}, d
        )
        for d in TEXT
    ]
    lines += [
        "",
        f"Paper (BERT-base, SST-2): FedPETuning {PAPER['table1']['sst2']['fedpetuning']}, FedOT "
        f"{PAPER['table1']['sst2']['fedot']}, FedPFT {PAPER['table1']['sst2']['fedpft']}.",
        "",
        "Cost columns (SST-2 runs): trainable = LoRA + head values a client trains; client model = parameters of "
        "the model it holds; MB / client-round = bytes of the encoded messages per client and round, the "
        "one-time whole-proxy download left out (next column; FedPETuning's clients are assumed to hold the "
        "full model, as the paper's); compute = wall seconds of a client's fit call (two runs share two "
        "cores: ratios only); peak train MB = weights + LoRA gradients and AdamW states + autograd-saved "
        "activations (`fedtune.models.train_memory`).",
        "",
        "![table1](table1.png)",
        "",
    ]
    with harness.figure(out / "table1.png", 1, len(TEXT), figsize=(11, 4), squeeze=False) as (fig, axes):
        for ax, d in zip(axes[0], TEXT):
            for m in METHODS:
                for metric, style in (("accuracy", "-"), ("proxy_accuracy", ":")):
                    if metric == "accuracy" or m in PROXY_METHODS:
                        label = LABEL[m] + (" (proxy)" if metric != "accuracy" else "")
                        harness.plot_curve(
                            ax, harness.with_labels(specs, method=m, data=d), style, metric=metric, label=label
                        )
            harness.finish_axes(
                ax, title=f"{d}: accuracy vs round (mean over seeds)", xlabel="round", ylabel="accuracy (%)"
            )
    return "\n".join(lines) + "\n" + harness.runs_section(specs, out)
