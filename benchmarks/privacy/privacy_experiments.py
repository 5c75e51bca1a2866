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
- ``secagg``: SecAgg+'s byte overhead (:mod:`privacy_secagg`): one round of the suite's FedIT
  config without DP on Flower's simulation (``engine = "flower-sim"``, Ray), with
  ``secure_aggregation.enabled = true`` and without, on :data:`SECAGG_CLIENTS` = 10 clients all
  sampled (200 examples each, as in the suite; one Ray ClientApp per client, so 10 rather than 100
  nodes), run on the harness's worker pool like the others; writes ``secagg.json`` (MB up and down
  per client each way, their ratio, and how far the two runs' global adapters are apart against
  SecAgg+'s quantization bound), which the report quotes. Central DP cannot run with SecAgg+ (its
  server clips each update, which it cannot see); local DP can, and adds no bytes. Measured: 160 s
  wall for both runs on the loaded 2-core machine; 0.606 MB up per client with SecAgg+ against 0.300
  MB plain (2.02x; the masked vector is 8 bytes a coordinate, the float32 update 4), down 0.310
  against 0.300 MB.

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
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fedtune.checkpoint import load_state
from fedtune.harness import RunSpec, build_plan, suite_files
from fedtune.harness.choice import Choice, choose
from fedtune.harness.report import run_accuracy

REPO = Path(__file__).resolve().parents[2]
RECIPE, _, RESULTS, QUICK_RESULTS = suite_files(REPO, "privacy-suite", "privacy")
DP_RUNS = ["sweep", "table", "fslora-sweep", "fslora-table"]  # the DP runs: the table, its sweeps
SECAGG = "secagg"  # SecAgg+'s byte overhead: two one-round runs on the Flower simulation
EXPERIMENTS = [*DP_RUNS, SECAGG]
SECAGG_CLIENTS = 10
#: the two secagg runs' seconds on one core (160 s wall for both on the loaded 2-core machine)
SECAGG_S = 80.0
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
    'server.optimizer="adam"',
    "server.lr=0.003",
    "server.weight_decay=0.01",
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


def secagg_runs(quick: bool) -> list[RunSpec]:
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
    return [
        RunSpec("plain", scale, {"secure": False}),
        RunSpec("secagg", [*scale, "secure_aggregation.enabled=true"], {"secure": True}),
    ]


def secagg_specs(quick: bool, out: Path) -> list[RunSpec]:
    """The planned ``secagg`` runs (in ``out/runs/secagg/``)."""
    return build_plan({SECAGG: secagg_runs(quick)}, RECIPE, out)[SECAGG]


def build(seeds: list[int], sweep_seed: int, quick: bool, out: Path):
    """The plan (each method's sweep, and its table of the epsilons whose sweep is done), each
    (method, epsilon)'s choice (None while its sweep runs), and the (method, epsilon) still waiting.
    Every experiment is planned whatever ``--only`` selects (FedIT's first, ``secagg`` last), so the
    folders do not depend on the selection."""
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
    plan = build_plan({**{e: experiments[e] for e in DP_RUNS}, SECAGG: secagg_runs(quick)}, RECIPE, out)
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


def table_runs(plan) -> list[RunSpec]:
    """Every method's table runs."""
    return [s for m in METHODS for s in plan[METHODS[m][4]]]


def sweep_runs(plan) -> list[RunSpec]:
    """Every method's sweep runs."""
    return [s for m in METHODS for s in plan[METHODS[m][3]]]


def costs(plan, quick: bool) -> dict[str, float]:
    """Estimated seconds of each run (:data:`RUN_S`, :data:`SECAGG_S`; ``quick``: :data:`QUICK_RUN_S`)."""
    dp = QUICK_RUN_S if quick else RUN_S
    return {s.key: SECAGG_S if s.owner == SECAGG else dp for e in EXPERIMENTS for s in plan[e]}
