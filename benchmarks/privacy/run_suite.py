"""The privacy-utility benchmark (issue 28, item 5): FedIT on SST-2 with MiniLM, 100 clients, 10
sampled per round (q = 0.1), client-level central DP (DP-FedAvg, ``fedtune.methods.base.privacy``) at
a target epsilon of 1, 3 and 8, and without DP (epsilon infinity), plus an FSLoRA row at epsilon 8
and without DP; written to ``benchmarks/results/privacy/`` (README.md, results.json,
accuracy_vs_epsilon.png).

Every run is ``configs/benchmarks/privacy-suite.toml`` (configs/fedit.toml's data, model, rate and
H; 100 clients with 200 SST-2 examples each, Dirichlet 0.5; 30 rounds, evaluated every 5 on 500
test examples; uniform client weights, DP-FedAvg's 1/m) plus, for a finite epsilon,
``privacy.mode = "central"``, ``privacy.epsilon`` (z calibrated by the accountant so that epsilon
after the 30 rounds is at most the target) and ``privacy.clip``. delta is the default of the run's
fedtune: the committed table (benchmarks/results/privacy/README.md, 2026-11-26, before issue 37)
was measured with the former mechanism, 1/N^1.1 = 0.0063 under an RDP accountant of a sample drawn
without replacement from a public seed; today's default is min(1/N^2, 1e-5) = 1e-5 under the PLD
accountant of a secret Poisson sample (``fedtune.methods.base.accounting``), so a rerun calibrates
other z. The clip sweep runs on the same federation and data as the table (another seed), and is
not accounted for: its choice of clip leaks through the table's runs (``privacy.adaptive_clip``
removes the sweep).

FSLoRA (``fedtune/methods/fslora.py``, its DP form: the server clips each sketched upload U_i,
puts it back at its ranks I_i and adds one N(0, (zC)^2) on every coordinate of the dense global
pair, sensitivity 2C as for FedIT) runs the same recipe (data, 100 clients, 10 per round, uniform
weights, 30 rounds of H = 5 steps, batch 16, evaluation) with configs/fslora.toml's FSLoRA settings
(:data:`FSLORA`): the rank-64 global pair (lora_alpha 128, dropout 0.1, query/value), sketching
ratios k_i/r drawn per client from {0.125, 0.25, 0.5, 0.75}, and that recipe's tuned optimizers
(client SGD lr 0.1 with momentum 0.9; server Adam lr 3e-3, weight decay 0.01, on the averaged,
noised update: post-processing, so the guarantee is unchanged). Those rates were swept for 20
clients all taking part (benchmarks/results/fslora-sweep), not re-swept here; only the clip is.
Runs are named ``fslora-...`` (FedIT's names are unchanged).

Experiments (``--only``; default ``sweep,table``, FedIT's):

- ``sweep``: each finite epsilon at every clip of :data:`CLIP_GRID` on the sweep seed
  (``--sweep-seed``, default 0); each epsilon's clip is the argmax of a run's mean of its last
  :data:`LAST` evaluations (ties: the smaller clip).
- ``table``: each finite epsilon at its chosen clip, and the run without DP (no clipping, no noise),
  on ``--seeds`` (default 1, 2, 3: not the sweep seed, so a reported figure is not the maximum the
  selection picked). An epsilon whose sweep is unfinished has no table runs yet.
- ``fslora-sweep``, ``fslora-table``: the same for FSLoRA at :data:`FSLORA_EPSILONS` (epsilon 8) and
  without DP (6 + 3 + 3 runs).
- ``secagg``: SecAgg+'s byte overhead (:func:`secagg_stage`): one round of the suite's FedIT
  config without DP on Flower's simulation (``engine = "flower-sim"``, Ray), with
  ``federation.secure_aggregation = true`` and without, on :data:`SECAGG_CLIENTS` = 10 clients all
  sampled (200 examples each, as in the suite; one Ray ClientApp per client, so 10 rather than 100
  nodes); writes ``secagg.json`` (MB up and down per client each way, their ratio, and how far the
  two runs' global adapters are apart against SecAgg+'s quantization bound), which the report
  quotes. Central DP cannot run with SecAgg+ (its server clips each update, which it cannot see);
  local DP can, and adds no bytes. Measured: 160 s wall for both runs on the loaded 2-core machine;
  0.606 MB up per client with SecAgg+ against 0.300 MB plain (2.02x; the masked vector is 8 bytes
  a coordinate, the float32 update 4), down 0.310 against 0.300 MB.

Reported: accuracy (%) as the mean +- sample std over the seeds of each run's mean of its last
:data:`LAST` evaluations (rounds 25 and 30), the cost of privacy in points against the same method
without DP, the noise multiplier z, the noise-to-signal ratio :func:`noise_to_clip` and the MB
uploaded per client (central DP adds no bytes; SecAgg+ runs on the Flower engines, not in this
suite's runs).

Noise to signal: the central mechanism adds xi ~ N(0, (zC)^2 I_d) to the sum and divides by m, so
the noise on the averaged update has L2 norm z C sqrt(d) / m (root mean square), while the
average of m updates clipped to C has norm at most C: the ratio z sqrt(d) / m (the column
``noise / C``) says by how much the noise outweighs the largest possible signal. d is the number of
coordinates the noise covers, read from the run's ``checkpoint.npz`` (its global arrays:
:func:`noised_coordinates`). For FedIT that is exactly what one client uploads (every LoRA pair at
rank 8 and the head: d = 74,498 for MiniLM; the upload's bytes / 4 are 74,980 floats, the message
header included). For FSLoRA the noise covers the dense rank-64 pair, although a client uploads
only its k_i of the 64 ranks (``d up``: the run's mean ``client_bytes_up`` / 4 bytes, the header
included; :func:`floats_up`). Example: at m = 10 (q = 0.1, 30 rounds, delta = 100^-1.1) the former
accountant calibrated z = 5.55, 2.67 and 1.40 for epsilon 1, 3 and 8, so FedIT's noise / C is 5.55 sqrt(74,498) / 10 =
152, 73 and 38, and FSLoRA's at epsilon 8 (d = 6 layers x 2 modules x 2 x 64 x 384 + 770 =
590,594) is 107: the noise is tens of times the largest possible signal, and a finite epsilon
staying near chance at m = 10 is expected (the ratio falls like 1/m: McMahan et al. 2018 sample
hundreds to thousands of clients a round).

Budget: FedIT's 18 sweep + 12 table runs of about 6 min of one core each (:data:`RUN_S`, measured),
about 95 min on 2 free cores (``--workers 2``); FSLoRA's 6 + 6 runs, estimated at the same cost (its
clients train k_i <= 48 of 64 ranks on query/value; not yet measured at this scale), about 40 min.
Scaled down from the issue's ask only in length: 30 rounds of H = 5 steps (30 x 10 = 300 client
updates of the 100 clients), 200 examples a client, 500 test examples.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/privacy/run_suite.py --plan
    ... --only sweep | --only table | (both: the table is planned once the sweep is done)
    ... --only fslora-sweep,fslora-table (FSLoRA's part, the same way)
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 ... --only secagg (2 runs of one round, Ray)
    ... --report-only | --quick (tiny-bert, 2 rounds, 40 clients, a scratch folder)
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from fedtune.checkpoint import load_state
from fedtune.harness import (
    RunSpec,
    build_plan,
    distinct_runs,
    offline_data,
    output_dir,
    parse_selection,
    produced_by,
    run_suite,
    runs_section,
    suite_command,
    suite_parser,
    table_lines,
)
from fedtune.harness.choice import Choice, choice_text, choose
from fedtune.harness.report import figure, final_accuracy, per_device_mb, run_accuracy
from fedtune.harness.runs import load_rounds, load_summary
from fedtune.harness.stats import mean as mean_of

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "benchmarks" / "privacy-suite.toml"
RESULTS = REPO / "benchmarks" / "results" / "privacy"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "privacy-quick"
RUNS = ["sweep", "table", "fslora-sweep", "fslora-table"]  # the harness's experiments (its worker pool)
SECAGG = "secagg"  # run here, on the Flower simulation (the pool runs the embedded engine)
EXPERIMENTS = [*RUNS, SECAGG]
SECAGG_CLIENTS = 10
DEFAULT_ONLY = "sweep,table"  # FedIT's part; FSLoRA's is selected with --only
EPSILONS = (1.0, 3.0, 8.0)  # and infinity: the run without DP
FSLORA_EPSILONS = (8.0,)
#: FSLoRA's overrides of the suite's recipe: configs/fslora.toml's method, model and optimizer
#: settings (tests/test_privacy_suite.py checks them against that recipe)
FSLORA = [
    'method="fslora"',
    "model.lora_rank=64",
    "model.lora_alpha=128.0",
    "model.lora_dropout=0.1",
    'model.target_modules=["query", "value"]',
    'train.optimizer="sgd"',
    "train.lr=0.1",
    "train.momentum=0.9",
    "federation.profile_choices={sketch_ratio = [0.125, 0.25, 0.5, 0.75]}",
    'federation.server_optimizer="adam"',
    "federation.server_lr=0.003",
    "federation.server_weight_decay=0.01",
]
#: --quick's FSLoRA: tiny-bert's layers allow a rank of at most 32
QUICK_FSLORA = ["model.lora_rank=16", "model.lora_alpha=32.0"]
#: method -> (its finite epsilons, its overrides, its run-name prefix, its sweep and table experiments,
#: its --quick overrides after its own)
METHODS = {
    "fedit": (EPSILONS, [], "", "sweep", "table", []),
    "fslora": (FSLORA_EPSILONS, FSLORA, "fslora-", "fslora-sweep", "fslora-table", QUICK_FSLORA),
}
#: 0.01 and 0.03 were added after the first sweep chose 0.1, then the grid's smallest, at every epsilon
CLIP_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
LAST = 2  # a run's figure: the mean of its last 2 evaluations
SWEEP_SEED = 0
#: one run's seconds on one free core (30 rounds x 10 clients x 5 steps, 6 evaluations of 500 examples):
#: measured, the run at epsilon 8, C = 1, seed 0 took 362 s of CPU (user + system, one torch thread; 25.5
#: min wall on the shared, loaded 2-core machine); quick runs take seconds
RUN_S, QUICK_RUN_S = 370.0, 20.0
QUICK = [
    "model.name=tiny-bert",
    "rounds=2",
    "eval_every=1",
    "train.local_steps=2",
    "federation.num_clients=40",
    "federation.clients_per_round=4",
    "data.max_train_samples=800",
    "data.max_test_samples=64",
]


def privacy(epsilon: float, clip: float | None) -> list[str]:
    """The overrides of one epsilon (infinity: none, the run without DP)."""
    if math.isinf(epsilon):
        return []
    return ['privacy.mode="central"', f"privacy.epsilon={epsilon}", f"privacy.clip={clip}"]


def spec(epsilon: float, clip: float | None, seed: int, quick: bool, method: str = "fedit") -> RunSpec:
    """One run: FedIT's name and overrides as before the FSLoRA row; FSLoRA's prefixed ``fslora-``
    with :data:`FSLORA` (with ``quick``: after :data:`QUICK`, then :data:`QUICK_FSLORA`)."""
    _, overrides, prefix, _, _, quick_overrides = METHODS[method]
    eps = "inf" if math.isinf(epsilon) else f"{epsilon:g}"
    name = prefix + f"eps{eps}" + ("" if clip is None else f"-clip{clip:g}") + f"-s{seed}"
    labels = {"method": method, "epsilon": epsilon, "clip": clip, "seed": seed}
    scale = [*QUICK, *overrides, *quick_overrides] if quick else overrides
    return RunSpec(name, [*scale, *privacy(epsilon, clip), f"seed={seed}"], labels)


def score(run: RunSpec) -> float | None:
    return run_accuracy(run, LAST)


def sweep_specs(sweep_seed: int, quick: bool, method: str = "fedit") -> list[RunSpec]:
    return [spec(e, c, sweep_seed, quick, method) for e in METHODS[method][0] for c in CLIP_GRID]


def build(seeds: list[int], sweep_seed: int, quick: bool, out: Path):
    """The plan (each method's sweep, and its table of the epsilons whose sweep is done), each
    (method, epsilon)'s choice (None while its sweep runs), and the (method, epsilon) still waiting.
    Every experiment is planned whatever ``--only`` selects (FedIT's first), so the folders do not
    depend on the selection."""
    sweeps = {m: sweep_specs(sweep_seed, quick, m) for m in METHODS}
    swept = build_plan({METHODS[m][3]: specs for m, specs in sweeps.items()}, RECIPE, out)
    choices: dict[tuple[str, float], Choice | None] = {
        (m, e): choose(
            [s for s in swept[METHODS[m][3]] if s.labels["epsilon"] == e], lambda s: {"clip": s.labels["clip"]}, score
        )
        for m in METHODS
        for e in METHODS[m][0]
    }
    experiments: dict[str, list[RunSpec]] = {}
    for m, (_, _, _, sweep, table, _) in METHODS.items():
        runs = [spec(math.inf, None, seed, quick, m) for seed in seeds]
        runs += [
            spec(e, c.setting["clip"], seed, quick, m)
            for (n, e), c in choices.items()
            if n == m and c
            for seed in seeds
        ]
        experiments[sweep], experiments[table] = sweep_specs(sweep_seed, quick, m), runs
    plan = build_plan({e: experiments[e] for e in RUNS}, RECIPE, out)
    return plan, choices, [key for key, c in choices.items() if c is None]


def noise_to_clip(z: float, d: int, m: int) -> float:
    """||xi / m||_2 / C for the central noise xi ~ N(0, (zC)^2 I_d) on the sum of m clipped updates:
    z sqrt(d) / m, its root mean square (E||xi||^2 = d (zC)^2; the norm concentrates there, relative
    std about 1/sqrt(2d)). The average of m updates clipped to C has norm at most C, so this is the
    noise over the largest possible signal. Example: z = 1, d = 74,498 (FedIT, MiniLM), m = 10 gives
    27.29."""
    return z * math.sqrt(d) / m


def noised_coordinates(spec: RunSpec, from_config: bool = False) -> int | None:
    """d: the coordinates the central noise covers, the global arrays of the run's
    ``checkpoint.npz`` (every LoRA pair at the global rank, and the head); without one, None, or
    with ``from_config`` those of the strategy its config builds (the folders in git have no
    ``.npz``: .gitignore)."""
    path = spec.run_dir / "checkpoint.npz"
    if path.is_file():
        arrays = load_state(path)["global"]
    elif from_config:
        from fedtune.runtime import RunContext, resolve_run

        strategy = RunContext(resolve_run(spec.config)).strategy()
        strategy.initialize()
        arrays = strategy.global_arrays
    else:
        return None
    return int(sum(np.asarray(v).size for v in arrays.values()))


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


def table_runs(plan) -> list[RunSpec]:
    """Every method's table runs."""
    return [s for m in METHODS for s in plan[METHODS[m][4]]]


def sweep_runs(plan) -> list[RunSpec]:
    """Every method's sweep runs."""
    return [s for m in METHODS for s in plan[METHODS[m][3]]]


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
        ax.set(xlabel="epsilon (the run's delta)", ylabel="accuracy (%)", title="SST-2, MiniLM, q = 0.1")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)

    def cell(r, key, spec=".2f"):
        return "pending" if r[key] is None else format(r[key], spec)

    lines = [
        "# Privacy-utility: FedIT and FSLoRA with client-level central DP",
        "",
        " ".join(__doc__.split("\n\n")[1].split()),
        "",
        " ".join(__doc__.split("\n\n")[2].split()),
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
        " ".join(next(p for p in __doc__.split("\n\n") if p.startswith("Noise to signal")).split()),
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
    (out / "README.md").write_text("\n".join(lines) + "\n" + runs_section(distinct_runs(plan, RUNS), out))
    return [out / "README.md", out / "results.json", png]


def secagg_specs(quick: bool, out: Path) -> list[RunSpec]:
    """``secagg``'s two runs, ``plain`` and ``secagg``: one round of the suite's FedIT recipe (no DP)
    on ``engine = "flower-sim"`` with :data:`SECAGG_CLIENTS` clients, all sampled, 200 examples each,
    and SecAgg+'s default options (``docs/flower.md``)."""
    scale = [
        *(QUICK if quick else []),
        'engine="flower-sim"',
        f"federation.num_clients={SECAGG_CLIENTS}",
        f"federation.clients_per_round={SECAGG_CLIENTS}",
        f"data.max_train_samples={200 * SECAGG_CLIENTS}",
        "rounds=1",
        "seed=0",
    ]
    specs = [
        RunSpec("plain", scale, {"secure": False}),
        RunSpec("secagg", [*scale, "federation.secure_aggregation=true"], {"secure": True}),
    ]
    return build_plan({SECAGG: specs}, RECIPE, out)[SECAGG]


def client_bytes(spec: RunSpec) -> dict | None:
    """The finished one-round run's bytes per client: the mean over its clients of
    ``client_bytes_up`` / ``client_bytes_down`` (in MB), and how many clients that is."""
    rounds = load_rounds(spec)
    if not rounds:
        return None
    up, down = (list(rounds[0][f"client_bytes_{way}"].values()) for way in ("up", "down"))
    return {
        "clients": len(up),
        "mb_up_per_client": sum(up) / len(up) / 1e6,
        "mb_down_per_client": sum(down) / len(down) / 1e6,
        "wall_s": (load_summary(spec) or {}).get("wall_s"),
    }


def secagg_result(specs: list[RunSpec], command: str) -> dict | None:
    """``secagg.json``: both runs' bytes per client, SecAgg+'s ratios over plain, its options, and the
    largest difference between the two global adapters after the round against SecAgg+'s bound on
    the uniform mean, 2c/T (each coordinate of the sum within k (2c/T) W, W = 1, divided by k:
    ``fedtune/engines/flower/secagg.py``); None until both runs are finished."""
    plain, secure = specs
    a, b = client_bytes(plain), client_bytes(secure)
    if a is None or b is None:
        return None
    fed, c = secure.config.federation, secure.config
    paths = [s.run_dir / "checkpoint.npz" for s in specs]
    diff = None
    if all(p.is_file() for p in paths):
        x, y = (load_state(p)["global"] for p in paths)
        diff = max(float(np.max(np.abs(np.asarray(x[k], np.float64) - np.asarray(y[k], np.float64)))) for k in x)
    return {
        "what": (
            f"one round of the suite's FedIT recipe without DP (model {c.model.name}, rank {c.model.lora_rank}, "
            f"{c.train.local_steps} local steps) on engine {c.engine}, {fed.num_clients} clients all sampled, "
            "with federation.secure_aggregation = true (SecAgg+) and without"
        ),
        "command": command,
        "adapter_coordinates": noised_coordinates(plain),
        "secagg_options": {
            "clipping_range": fed.secagg_clipping_range,
            "quantization_range": fed.secagg_quantization_range,
            "modulus_range": fed.secagg_modulus_range,
            "num_shares": fed.secagg_shares(),
            "threshold": fed.secagg_reconstruction_threshold(),
        },
        "plain": a,
        "secagg": b,
        "ratio_up": b["mb_up_per_client"] / a["mb_up_per_client"],
        "ratio_down": b["mb_down_per_client"] / a["mb_down_per_client"],
        "max_abs_difference": diff,
        "quantization_bound": 2 * fed.secagg_clipping_range / fed.secagg_quantization_range,
    }


def secagg_stage(args, out: Path, command: str) -> int:
    """``secagg``: list its two runs (``--plan`` stops there), run the unfinished ones in this process
    on the Flower simulation (one torch thread here; Flower's runtime dependency installation off),
    and write ``out/secagg.json`` once both are finished (the report quotes it)."""
    from fedtune.harness.pool import setup_worker
    from fedtune.harness.runs import run_state

    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    specs = secagg_specs(args.quick, out)
    print(f"  {SECAGG}: {len(specs)} runs (engine flower-sim, {SECAGG_CLIENTS} clients all sampled, 1 round)")
    for spec in specs:
        print(f"    [{run_state(spec)}] {spec.name}")
    if args.plan:
        return 0
    if not args.report_only:
        from fedtune.launch import launch

        setup_worker(1)
        for spec in specs:
            if run_state(spec) != "done":
                launch(spec.config, overwrite=True)
    result = secagg_result(specs, command)
    if result is None:
        print(f"{SECAGG}: unfinished, no secagg.json")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "secagg.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{SECAGG}: MB up per client {result['plain']['mb_up_per_client']:.4f} plain, "
        f"{result['secagg']['mb_up_per_client']:.4f} SecAgg+ ({result['ratio_up']:.2f}x); wrote "
        + os.path.relpath(out / "secagg.json", REPO)
    )
    return 0


def secagg_lines(out: Path) -> list[str]:
    """The report's SecAgg+ section, from ``out/secagg.json`` (none without it)."""
    path = out / "secagg.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    o = r["secagg_options"]
    diff = "not measured" if r["max_abs_difference"] is None else f"{r['max_abs_difference']:.2g}"
    return [
        "## SecAgg+ byte overhead",
        "",
        f"{r['what'][0].upper()}{r['what'][1:]}; SecAgg+ options c = {o['clipping_range']:g}, "
        f"T = {o['quantization_range']}, M = {o['modulus_range']}, {o['num_shares']} shares, threshold "
        f"{o['threshold']}. Bytes per client in the round (its fedtune messages, plus every SecAgg+ payload: "
        "keys, encrypted shares, the masked int64 vector).",
        "",
        *produced_by(r["command"]),
        *table_lines(
            ["aggregation", "MB up / client", "MB down / client"],
            [
                [name, f"{r[key]['mb_up_per_client']:.4f}", f"{r[key]['mb_down_per_client']:.4f}"]
                for name, key in (("plain", "plain"), ("SecAgg+", "secagg"))
            ],
        ),
        "",
        f"SecAgg+ over plain: {r['ratio_up']:.2f}x up, {r['ratio_down']:.2f}x down (adapter: "
        f"{r['adapter_coordinates']:,} coordinates). The two runs' global adapters after the round differ by at "
        f"most {diff} (SecAgg+'s quantization bound on the mean: 2c/T = {r['quantization_bound']:.2g}). Central "
        "DP cannot run with SecAgg+; local DP can and adds no bytes, so under SecAgg+ the table's MB up / client "
        "would grow by about this factor (the key and share payloads are a small fixed part per client and round).",
        "",
    ]


def first_sweeps(stage, selected: list[str], args) -> int:
    """``stage`` over the selected sweeps first, then the rest (planned from the finished sweeps),
    as :func:`fedtune.harness.sweep_first` does for one sweep; one call for ``--plan`` and
    ``--report-only``. Returns the worse exit status."""
    sweeps = [METHODS[m][3] for m in METHODS]
    first, rest = [e for e in selected if e in sweeps], [e for e in selected if e not in sweeps]
    if first and rest and not (args.plan or args.report_only):
        return max(stage(first), stage(rest))
    return stage(list(selected))


def main(argv: list[str] | None = None) -> int:
    p = suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="1,2,3", budget_minutes=300.0)
    p.set_defaults(only=DEFAULT_ONLY)
    p.add_argument("--sweep-seed", type=int, default=SWEEP_SEED, help=f"the seed that chooses each clip ({SWEEP_SEED})")
    args = p.parse_args(argv)
    selected, seeds = parse_selection(args, EXPERIMENTS)
    out = output_dir(args, RESULTS, QUICK_RESULTS)
    offline_data("sst2")
    command = suite_command("benchmarks/privacy/run_suite.py", argv)

    def stage(selection: list[str]) -> int:
        plan, choices, waiting = build(seeds, args.sweep_seed, args.quick, out)
        cost = QUICK_RUN_S if args.quick else RUN_S
        costs = {s.key: cost for s in distinct_runs(plan, RUNS)}
        notes = [
            f"{METHODS[m][4]}: {sum(n == m for n, _ in waiting) * len(seeds)} runs wait for the sweep (epsilon "
            + (", ".join(f"{e:g}" for n, e in waiting if n == m) or "none")
            + ")"
            for m in METHODS
            if METHODS[m][4] in selection
        ]
        return run_suite(
            plan, selection, args, costs, lambda: report(plan, choices, out, command), root=REPO, notes=notes
        )

    runs = [e for e in selected if e in RUNS]
    status = first_sweeps(stage, runs, args) if runs else 0
    if SECAGG in selected:
        status = max(status, secagg_stage(args, out, command))
    return status


if __name__ == "__main__":
    sys.exit(main())
