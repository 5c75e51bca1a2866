"""The privacy-utility benchmark's report (``README.md``, ``results.json``, ``accuracy_vs_epsilon.png``):
one row per (method, epsilon) with its clip, z, delta, noise / C, accuracy and cost; the clip sweep;
the SecAgg+ section (:mod:`privacy_secagg`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import privacy_experiments
from privacy_experiments import (
    CLIP_GRID,
    DP_RUNS,
    LAST,
    METHODS,
    noise_to_clip,
    noised_coordinates,
    score,
    sweep_runs,
    table_runs,
)
from privacy_secagg import secagg_lines

from fedtune.harness import (
    RunSpec,
    distinct_runs,
    finish_axes,
    load_rounds,
    load_summary,
    produced_by,
    runs_section,
    table_lines,
)
from fedtune.harness.choice import choice_text
from fedtune.harness.report import figure, final_accuracy, per_device_mb
from fedtune.harness.stats import mean as mean_of

DOC_PARAGRAPHS = privacy_experiments.__doc__.split("\n\n")


def floats_up(spec: RunSpec) -> float | None:
    """The finished run's mean upload of a client in a round, in wire floats: ``client_bytes_up`` /
    the wire dtype's size (the message header included); None while unfinished."""
    sizes = [b for r in load_rounds(spec) for b in r.get("client_bytes_up", {}).values()]
    itemsize = np.dtype(spec.config.federation.wire_dtype).itemsize
    return sum(sizes) / len(sizes) / itemsize if sizes else None


def method_coordinates(plan) -> dict[str, int | None]:
    """Each method's d (:func:`noised_coordinates`, the same for all its runs): from its first run
    with a checkpoint, else from the config of its first finished run, else None."""
    runs = table_runs(plan) + sweep_runs(plan)
    found: dict[str, int | None] = {}
    for m in METHODS:
        mine = [s for s in runs if s.labels["method"] == m]
        found[m] = next((d for s in mine if (d := noised_coordinates(s)) is not None), None)
        finished = [s for s in mine if load_summary(s)]
        if found[m] is None and finished:
            found[m] = noised_coordinates(finished[0], from_config=True)
    return found


def row_keys() -> list[tuple[str, float]]:
    """The report's rows, (method, epsilon), by epsilon (infinity first), FSLoRA's next to FedIT's."""
    keys = [(m, e) for m in METHODS for e in (math.inf, *METHODS[m][0])]
    order = [math.inf, *sorted({e for _, e in keys if not math.isinf(e)})]
    return sorted(keys, key=lambda k: (order.index(k[1]), list(METHODS).index(k[0])))


def rows(plan, choices) -> list[dict]:
    """results.json's rows: one per (method, epsilon), in :func:`row_keys` order, with its clip, z,
    delta, the per-seed accuracies (the mean of each run's last evaluations, %), their mean and std
    and the cost in points against the same method without DP."""
    table = table_runs(plan)
    no_dp = {m: [s for s in table if s.labels["method"] == m and math.isinf(s.labels["epsilon"])] for m in METHODS}
    baselines = {m: final_accuracy(runs, LAST)[0] for m, runs in no_dp.items()}
    coordinates = method_coordinates(plan)
    out = []
    for method, epsilon in row_keys():
        runs = [s for s in table if s.labels["method"] == method and s.labels["epsilon"] == epsilon]
        summaries = [x for x in map(load_summary, runs) if x]
        per_seed = {s.labels["seed"]: (None if (a := score(s)) is None else 100 * a) for s in runs}
        acc, std, n = final_accuracy(runs, LAST)
        baseline = baselines[method]
        dp = next((x["privacy"] for x in summaries if "privacy" in x), None)
        choice = choices.get((method, epsilon))
        d, m = coordinates[method], runs[0].config.federation.sample_size() if runs else None
        out.append(
            {
                "method": method,
                "epsilon": None if math.isinf(epsilon) else epsilon,
                "delta": None if dp is None else dp["delta"],
                "epsilon_spent": None if dp is None else dp["epsilon"],
                "noise_multiplier": None if dp is None else dp["noise_multiplier"],
                "clients_per_round": m,
                "d_noised": d,
                "d_up_floats": mean_of([floats_up(s) for s in runs]),
                "noise_to_clip": None if dp is None or d is None else noise_to_clip(dp["noise_multiplier"], d, m),
                "clip": None if choice is None else choice.setting["clip"],
                "accuracy_per_seed": per_seed,
                "accuracy_mean": acc,
                "accuracy_std": std,
                "finished": n,
                "cost_points": None if acc is None or baseline is None else baseline - acc,
                "mb_up_per_client": mean_of([per_device_mb(s, x) for s in runs if (x := load_summary(s))]),
            }
        )
    return out


def scale_line(plan) -> str:
    """What these runs are (the full scale, or --quick's)."""
    c = next(s.config for s in plan["sweep"])
    f = next(s.config for s in plan["fslora-sweep"])
    return (
        f"These runs: model {c.model.name}, {c.federation.num_clients} clients, {c.federation.sample_size()} per "
        f"round, {c.rounds} rounds of {c.train.local_steps} local steps, {c.data.max_test_samples} test examples; "
        f"FedIT rank {c.model.lora_rank}, FSLoRA rank {f.model.lora_rank} with sketching ratios "
        f"{', '.join(f'{r:g}' for r in f.federation.profile_choices['sketch_ratio'])}."
    )


LABEL = {"fedit": "FedIT", "fslora": "FSLoRA"}


def report(plan, choices, out: Path, command: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    table = rows(plan, choices)
    (out / "results.json").write_text(json.dumps({"last_evaluations": LAST, "rows": table}, indent=2) + "\n")
    png = out / "accuracy_vs_epsilon.png"
    with figure(png, 1, 1, figsize=(5, 3.5)) as (_, ax):
        for method, (marker, color) in zip(METHODS, (("o", "C0"), ("s", "C1"))):
            mine = [r for r in table if r["method"] == method and r["accuracy_mean"] is not None]
            finite = [r for r in mine if r["epsilon"] is not None]
            if finite:
                ax.errorbar(
                    [r["epsilon"] for r in finite],
                    [r["accuracy_mean"] for r in finite],
                    yerr=[r["accuracy_std"] or 0 for r in finite],
                    marker=marker,
                    color=color,
                    capsize=3,
                    label=f"{LABEL[method]}, central DP, chosen clip",
                )
            for r in mine:
                if r["epsilon"] is None:
                    ax.axhline(r["accuracy_mean"], color=color, ls="--", label=f"{LABEL[method]}, no DP")
        ax.set_xscale("log")
        finish_axes(ax, xlabel="epsilon (the run's delta)", ylabel="accuracy (%)", title="SST-2, MiniLM, q = 0.1")

    def cell(r, key, spec=".2f"):
        return "pending" if r[key] is None else format(r[key], spec)

    lines = [
        "# Privacy-utility: FedIT and FSLoRA with client-level central DP",
        "",
        " ".join(DOC_PARAGRAPHS[1].split()),
        "",
        " ".join(DOC_PARAGRAPHS[2].split()),
        "",
        *produced_by(command),
        scale_line(plan),
        "",
        f"Accuracy (%): each run's mean of its last {LAST} evaluations, mean ± sample std over the table seeds "
        "(n: runs finished); cost: points below the same method without DP. d noised: the coordinates the "
        "central noise covers (the global arrays); d up: a client's mean upload in a round, bytes / 4 (header "
        "included); noise / C = z sqrt(d noised) / m: the norm of the noise on the averaged update over the clip, "
        "which bounds the average's signal.",
        "",
        " ".join(next(p for p in DOC_PARAGRAPHS if p.startswith("Noise to signal")).split()),
        "",
        *table_lines(
            [
                "method",
                "epsilon",
                "delta",
                "clip C",
                "noise z",
                "d noised",
                "d up",
                "noise / C",
                "accuracy (%)",
                "cost (points)",
                "MB up / client",
            ],
            [
                [
                    LABEL[r["method"]],
                    "∞ (no DP)" if r["epsilon"] is None else f"{r['epsilon']:g}",
                    *(
                        ["–", "–", "–"]
                        if r["epsilon"] is None
                        else [cell(r, "delta", ".2g"), cell(r, "clip", "g"), cell(r, "noise_multiplier", ".3f")]
                    ),
                    cell(r, "d_noised", ","),
                    cell(r, "d_up_floats", ",.0f"),
                    "–" if r["epsilon"] is None else cell(r, "noise_to_clip", ".1f"),
                    "pending"
                    if r["accuracy_mean"] is None
                    else f"{r['accuracy_mean']:.2f} ± {r['accuracy_std'] or 0:.2f} (n={r['finished']})",
                    "–" if r["epsilon"] is None else cell(r, "cost_points"),
                    cell(r, "mb_up_per_client", ".3f"),
                ]
                for r in table
            ],
        ),
        "",
        "## Clip sweep (sweep seed)",
        "",
        *table_lines(
            ["method", "epsilon", *(f"C = {c:g}" for c in CLIP_GRID), "chosen"],
            [
                [
                    LABEL[m],
                    f"{e:g}",
                    *(
                        "pending" if (a := score(s)) is None else f"{100 * a:.2f}"
                        for s in sweep_runs(plan)
                        if s.labels["method"] == m and s.labels["epsilon"] == e
                    ),
                    choice_text(choices[(m, e)]).replace("a rate beyond", "a clip beyond"),
                ]
                for m in METHODS
                for e in METHODS[m][0]
            ],
        ),
        "",
    ]
    lines += secagg_lines(out)
    (out / "README.md").write_text("\n".join(lines) + "\n" + runs_section(distinct_runs(plan, DP_RUNS), out))
    return [out / "README.md", out / "results.json", png]
