"""CPU-scale counterparts of the RABO paper's experiments (Li et al., "Distributed Bilevel
Optimization with Dual Pruning for Resource-limited Clients", Sec. V), written to
``benchmarks/results/rabo/``.

Experiments (named runs on :mod:`fedtune.harness`; a few-shot run is
``configs/benchmarks/rabo-suite.toml`` + its N-way K-shot and method overlays from
``rabo-suite-overlays.toml`` + the experiment's settings; a loss-tuning run starts from
``rabo-losstune-suite.toml``):

- ``sweep`` (with ``--lr-factors``): each method on 5-way 1-shot at every multiple of its own step
  size (the bilevel methods' outer step ``options.outer_lr``, the single-level methods' AdamW
  ``train.lr``) on ``--sweep-seed`` (default 3, outside the table seeds); the multiple with the
  highest Table II figure (mean of the last 3 evaluations at multiples of 10 updates) is that
  method's choice, which Table II (every column) and Table III then run. Factor 1 is the recipe's
  rate, so its table runs are the unswept suite's. The swept protocol writes its reports to the
  same ``benchmarks/results/rabo/`` (replacing the unswept ``table2.md`` / ``table3.md``; each
  says which protocol it reports) so that factor-1 runs are not run twice. Figure 5's loss-tuning
  problem has its own sweep on the same seed over ``--lt-factors`` (default 0.1, 0.3, 1, 3, 10,
  30), scored by the mean of the last 3 evaluations' balanced accuracy: there a factor scales every
  step size the method takes (bilevel: the VS-loss step ``options.outer_lr`` and the model step
  ``options.inner_lr`` together; single-level: ``train.lr``).
- ``table2``: Table II. RABO, RAFBO, full-model bilevel (FedMBO style), FedAvg, Static (HeteroFL),
  FedRolex, FIARSE on Omniglot 5-way / 20-way, 1-shot / 5-shot; capacities two clients each of
  {1, 1/2, 1/4, 1/8, 1/16} (FedMBO and FedAvg: full model). Accuracy on held-out alphabets.
- ``fig4``: Figure 4. Client computation (FLOPs counted by torch, per client and round, short
  runs with ``options.count_flops``) and communication (bytes up + down per client and round, from
  Table II's 5-way 1-shot runs) of RABO and RAFBO against the full-model bilevel baseline.
- ``fig3``: Figure 3. Every client at capacity 1/4 on contiguous segments of every layer assigned
  so that the least-covered segment has C_x^* = 1 or 2 clients, 5-way 5-shot.
- ``table3``: Table III. RABO and RAFBO with 10, 20, 30, 50 clients (10 sampled per round beyond
  10), 5-way 1-shot and 5-shot, the same capacity mix.
- ``fig5``: Figure 5. VS-loss tuning on long-tailed Fashion-MNIST (all clients at capacity 1/2):
  the three bilevel methods against the single-level ones (plain cross-entropy, no tuning); with
  ``--lr-factors``, each method at its factor chosen by the loss-tuning sweep.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/rabo/run_suite.py \
        [--only table2] [--seeds 0,1,2]
    ... --plan          # the runs and the time estimate, nothing run
    ... --quick         # smoke test into benchmarks/results/_scratch/rabo-quick/
    ... --report-only   # rewrite the markdown and plots from the run folders that exist
    ... --settings w5s1,w5s5   # only these N-way K-shot columns of Table II
    ... --updates 30    # 30 backbone updates per client instead of 60 (every method's rounds alike)
    ... --methods rabo,fedmbo   # only these methods' runs
    ... --lr-factors 0.3,1,3 --only table2 --settings w5s1 --updates 30   # each method at its own rate
    ... --lr-factors 0.3,1,3,10,30,100 --lt-factors 0.1,0.3,1,3,10,30 --only fig5   # Figure 5 at its own rates

Identical configs are run once and shared (Table III's 10-client runs are Table II's).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from fedtune.config import RunConfig, load_config
from fedtune.harness import (
    Choice,
    RunSpec,
    SuiteError,
    Sweep,
    accuracy_cell,
    add_sweep_options,
    averaged_curve,
    biased_seed_warning,
    build_plan,
    choose,
    distinct_runs,
    estimate_minutes,
    eval_rounds,
    figure,
    load_rounds,
    load_summary,
    mean,
    mean_text,
    offline_data,
    output_dir,
    parse_grid,
    parse_selection,
    percent,
    read_overlays,
    run_accuracy,
    run_suite,
    runs_section,
    suite_command,
    suite_parser,
    sweep_first,
    sweep_note,
    sweep_sections,
    sweep_selection,
    table_lines,
    toml_value,
    with_labels,
)

REPO = Path(__file__).resolve().parents[2]

FEW_SHOT_RECIPE = REPO / "configs" / "benchmarks" / "rabo-suite.toml"
LOSS_RECIPE = REPO / "configs" / "benchmarks" / "rabo-losstune-suite.toml"
OVERLAYS = read_overlays(REPO / "configs" / "benchmarks" / "rabo-suite-overlays.toml")
RESULTS = REPO / "benchmarks" / "results" / "rabo"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "rabo-quick"
EXPERIMENTS = ["sweep", "table2", "fig4", "fig3", "table3", "fig5"]  # also the order that owns shared runs
SWEPT = ("table2", "table3", "fig5")  # with --lr-factors: each method at its chosen multiple of its own rate
LT_FACTORS = "0.1,0.3,1,3,10,30"  # --lt-factors' default: the loss-tuning sweep's multiples
SWEEP_SETTING = "w5s1"
METHODS = ["rabo", "rafbo", "fedmbo", "fedavg", "static", "fedrolex", "fiarse"]
BILEVEL = ["rabo", "rafbo", "fedmbo"]
SETTINGS = {"w5s1": "5-way 1-shot", "w5s5": "5-way 5-shot", "w20s1": "20-way 1-shot", "w20s5": "20-way 5-shot"}
LAST = 3  # accuracies: the mean of a run's last 3 evaluations, then mean ± std over seeds

PAPER_TABLE2 = {  # Table II (%)
    "fedmbo": (82.66, 93.69, 63.18, 81.64),
    "static": (72.34, 85.09, 42.99, 51.01),
    "fedrolex": (73.74, 86.95, 47.25, 55.29),
    "fiarse": (74.33, 87.78, 49.52, 55.87),
    "rabo": (76.05, 89.12, 54.97, 77.41),
    "rafbo": (75.09, 88.57, 51.37, 71.16),
}
PAPER_TABLE3 = {  # Table III (%), clients 10, 20, 30, 50
    ("rabo", "w5s1"): (76.05, 75.81, 74.39, 72.76),
    ("rafbo", "w5s1"): (75.09, 74.85, 73.04, 71.80),
    ("rabo", "w5s5"): (89.12, 88.52, 87.76, 86.58),
    ("rafbo", "w5s5"): (88.57, 87.53, 87.03, 86.44),
}
LABEL = {
    "rabo": "RABO",
    "rafbo": "RAFBO",
    "fedmbo": "full bilevel (FedMBO style)",
    "fedavg": "FedAvg (full model)",
    "static": "Static (HeteroFL)",
    "fedrolex": "FedRolex",
    "fiarse": "FIARSE",
}
CAPACITY_MIX = [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.0625, 0.0625]
SEGMENTS = {1: [0, 0, 0, 1, 1, 1, 2, 2, 2, 3], 2: [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]}  # C_x^* = 1, 2 at capacity 1/4


@dataclass(frozen=True)
class Scale:
    quick: bool = False
    settings: tuple = tuple(SETTINGS)
    clients: tuple = (10, 20, 30, 50)
    table3_settings: tuple = ("w5s1", "w5s5")
    per_round: int = 10  # clients sampled per round beyond 10 clients (Table III)
    updates: int | None = None  # backbone updates per client (default the recipe's 60; --updates)
    sweep: Sweep | None = None  # --lr-factors: multiples of each method's own step size
    lt_grid: tuple = tuple(map(float, LT_FACTORS.split(",")))  # --lt-factors (used with sweep)

    def budget(self, method: str) -> list[str]:
        """``updates`` backbone updates per client: bilevel, one outer step a round, evaluated 6 times;
        single-level, updates / local_steps rounds of 10 local steps, evaluated every round."""
        if self.updates is None or self.quick:
            return []
        if method in BILEVEL:
            return [f"rounds={self.updates}", f"eval_every={max(1, self.updates // 6)}"]
        return [f"rounds={max(1, self.updates // 10)}", "eval_every=1"]

    def few_shot(self, setting: str, method: str, *extra: str, factor: float | None = None) -> list[str]:
        """A few-shot run's overrides; ``factor`` scales the method's own step size (:func:`rate_key`)."""
        out = [
            *OVERLAYS[setting],
            *OVERLAYS[method],
            *self.budget(method),
            *(OVERLAYS["quick"] if self.quick else []),
            *extra,
        ]
        if factor is None or factor == 1.0:
            return out
        return out + [f"{rate_key(method)}={factor * base_rate(load_config(FEW_SHOT_RECIPE, out), method)!r}"]

    def loss_tuning(self, method: str, *extra: str, factor: float | None = None) -> list[str]:
        """A loss-tuning run's overrides; ``factor`` scales each of :func:`lt_rate_keys`."""
        out = [*OVERLAYS[f"lt_{method}"], *(OVERLAYS["quick_lt"] if self.quick else []), *extra]
        if factor is None or factor == 1.0:
            return out
        config = load_config(LOSS_RECIPE, out)
        return out + [f"{key}={factor * rate_value(config, key)!r}" for key in lt_rate_keys(method)]


def quick_scale() -> Scale:
    return Scale(quick=True, clients=(10, 20))


def rate_key(method: str) -> str:
    """The step size a method's sweep scales: the bilevel outer step (x's hypergradient step), or the
    single-level methods' AdamW learning rate."""
    return "options.outer_lr" if method in BILEVEL else "train.lr"


def base_rate(config: RunConfig, method: str) -> float:
    return rate_value(config, rate_key(method))


def lt_rate_keys(method: str) -> tuple[str, ...]:
    """The step sizes a loss-tuning factor scales: all the method takes. Bilevel: the VS-loss
    parameters' step (outer) and the model's SGD step (inner), together, as the model's step is the
    one the single-level methods' factor scales; single-level: the AdamW learning rate."""
    return ("options.outer_lr", "options.inner_lr") if method in BILEVEL else ("train.lr",)


def rate_value(config: RunConfig, key: str) -> float:
    """The value of a step-size key (``train.lr`` or ``options.<name>``) in ``config``."""
    return config.train.lr if key == "train.lr" else config.options[key.split(".", 1)[1]]


WAIT = object()  # a method whose sweep is not finished


def factor_of(chosen: dict[str, float] | None, method: str):
    """The method's step-size factor for the tables: None (the recipe's) without a sweep, its chosen
    factor, or :data:`WAIT`."""
    return None if chosen is None else chosen.get(method, WAIT)


def named(name: str, factor: float | None) -> str:
    return name if factor is None or factor == 1.0 else f"{name}-x{factor:g}"


# -- run specifications ----------------------------------------------------------------------------
def specs_sweep(scale: Scale, seeds: list[int], chosen=None) -> list[RunSpec]:
    if scale.sweep is None:
        return []
    seed, s = scale.sweep.seed, SWEEP_SETTING
    return [
        RunSpec(
            named(f"{m}-{s}-s{seed}", f),
            scale.few_shot(s, m, f"seed={seed}", factor=f),
            {"problem": "few-shot", "method": m, "setting": s, "seed": seed, "factor": f},
        )
        for m in METHODS
        for f in scale.sweep.grid
    ]


def specs_lt_sweep(scale: Scale) -> list[RunSpec]:
    """Figure 5's sweep: each method on the loss-tuning problem at every ``scale.lt_grid`` factor."""
    if scale.sweep is None:
        return []
    seed = scale.sweep.seed
    return [
        RunSpec(
            named(f"lt-{m}-s{seed}", f),
            scale.loss_tuning(m, f"seed={seed}", factor=f),
            {"problem": "loss-tuning", "method": m, "seed": seed, "factor": f},
        )
        for m in METHODS
        for f in scale.lt_grid
    ]


def specs_table2(scale: Scale, seeds: list[int], chosen=None) -> list[RunSpec]:
    return [
        RunSpec(
            named(f"{m}-{s}-s{seed}", f),
            scale.few_shot(s, m, f"seed={seed}", factor=f),
            {"method": m, "setting": s, "seed": seed, "factor": f},
        )
        for s in scale.settings
        for seed in seeds
        for m in METHODS
        if (f := factor_of(chosen, m)) is not WAIT
    ]


def specs_fig4(scale: Scale, seeds: list[int], chosen=None) -> list[RunSpec]:
    rounds = ["rounds=2", "eval_every=2"] if scale.quick else ["rounds=3", "eval_every=3"]
    return [
        RunSpec(
            f"flops-{m}-w5s1-s{seed}",
            scale.few_shot("w5s1", m, f"seed={seed}", *rounds, "options.count_flops=true"),
            {"method": m, "setting": "w5s1", "seed": seed},
        )
        for seed in seeds
        for m in BILEVEL
    ]


def specs_fig3(scale: Scale, seeds: list[int], chosen=None) -> list[RunSpec]:
    return [
        RunSpec(
            f"{m}-cstar{c}-w5s5-s{seed}",
            scale.few_shot(
                "w5s5",
                m,
                f"seed={seed}",
                "federation.profiles=[{capacity=0.25}]",
                'options.masks="segment"',
                f"options.segments={SEGMENTS[c]}",
            ),
            {"method": m, "cstar": c, "seed": seed},
        )
        for seed in seeds
        for m in ("rabo", "rafbo")
        for c in (1, 2)
    ]


def clients_overrides(n: int, per_round: int) -> list[str]:
    if n == 10:
        return []  # Table II's configuration (shared)
    profiles = [{"capacity": c} for c in CAPACITY_MIX] * (n // 10)
    return [
        f"federation.num_clients={n}",
        f"federation.profiles={toml_value(profiles)}",
        f"federation.clients_per_round={per_round}",
    ]


def specs_table3(scale: Scale, seeds: list[int], chosen=None) -> list[RunSpec]:
    return [
        RunSpec(
            named(f"{m}-{s}-n{n}-s{seed}", f),
            scale.few_shot(s, m, f"seed={seed}", *clients_overrides(n, scale.per_round), factor=f),
            {"method": m, "setting": s, "clients": n, "seed": seed, "factor": f},
        )
        for s in scale.table3_settings
        for seed in seeds
        for m in ("rabo", "rafbo")
        for n in scale.clients
        if (f := factor_of(chosen, m)) is not WAIT
    ]


def specs_fig5(scale: Scale, seeds: list[int], chosen=None) -> list[RunSpec]:
    return [
        RunSpec(
            named(f"lt-{m}-s{seed}", f),
            scale.loss_tuning(m, f"seed={seed}", factor=f),
            {"method": m, "seed": seed, "factor": f},
        )
        for seed in seeds
        for m in METHODS
        if (f := factor_of(chosen, m)) is not WAIT
    ]


FEW_SHOT = {
    "sweep": specs_sweep,
    "table2": specs_table2,
    "fig4": specs_fig4,
    "fig3": specs_fig3,
    "table3": specs_table3,
}


def sweep_score(spec: RunSpec) -> float | None:
    """A sweep run's figure: Table II's (:func:`budget_accuracy`) on the few-shot problem; on the
    loss-tuning one, Figure 5's, the mean of its last LAST evaluations (balanced accuracy)."""
    return budget_accuracy(spec) if spec.labels["problem"] == "few-shot" else run_accuracy(spec, LAST)


def choices_of(sweep_runs: list[RunSpec], problem: str = "few-shot") -> dict[str, Choice | None]:
    """Each method's chosen factor on ``problem``: the argmax over its finished sweep runs of
    :func:`sweep_score` (None while any of its runs is unfinished)."""
    runs = with_labels(sweep_runs, problem=problem)
    return {
        m: choose(with_labels(runs, method=m), lambda s: {"factor": s.labels["factor"]}, sweep_score)
        for m in METHODS
        if with_labels(runs, method=m)
    }


def chosen_factors(sweep_runs: list[RunSpec], problem: str) -> dict[str, float]:
    return {m: c.setting["factor"] for m, c in choices_of(sweep_runs, problem).items() if c}


def build_suite_plan(scale: Scale, seeds: list[int], out: Path) -> dict[str, list[RunSpec]]:
    """Every experiment's runs, resolved (all experiments, so run ownership never depends on --only);
    with ``scale.sweep``, Tables II and III and Figure 5 at each method's chosen factor on their
    problem (a method waits until its sweep is finished)."""
    few_shot = lt = None
    if scale.sweep is not None:
        plan = build_plan({e: f(scale, seeds) for e, f in FEW_SHOT.items()}, FEW_SHOT_RECIPE, out)
        few_shot = chosen_factors(plan["sweep"], "few-shot")
        lt = chosen_factors(build_plan({"sweep": specs_lt_sweep(scale)}, LOSS_RECIPE, out)["sweep"], "loss-tuning")
    plan = build_plan({e: f(scale, seeds, few_shot) for e, f in FEW_SHOT.items()}, FEW_SHOT_RECIPE, out)
    loss = build_plan({"sweep": specs_lt_sweep(scale), "fig5": specs_fig5(scale, seeds, lt)}, LOSS_RECIPE, out)
    plan["sweep"] += loss["sweep"]
    plan["fig5"] = loss["fig5"]
    return {e: plan[e] for e in EXPERIMENTS}


# -- cost model -------------------------------------------------------------------------------------
# Seconds per client and round on one free core of the 2-core VM for the 5-way 1-shot suite
# configuration (32 filters), extrapolated from 64-filter runs on a free 16-core machine (x 2 for
# the VM, / 2 for the half width); single-level methods: per local step. Few-shot work scales with
# the images per episode, N (K + Q). Loss tuning: the clients' compute seconds per client and round
# of the factor-1 Figure 5 runs on this VM (seed 0, 2 workers), and ~2.5 s per evaluation.
CLIENT_ROUND_S = {"rabo": 0.2, "rafbo": 0.65, "fedmbo": 0.4}
LOCAL_STEP_S = {"fedavg": 0.3, "static": 0.14, "fedrolex": 0.14, "fiarse": 0.3}
LOSS_CLIENT_ROUND_S = {
    "rabo": 0.34,
    "rafbo": 0.35,
    "fedmbo": 0.83,
    "fedavg": 0.22,
    "static": 0.12,
    "fedrolex": 0.12,
    "fiarse": 0.23,
}
FLOPS_SLOWDOWN = 2.0  # torch's FLOP counter


def estimate_s(config: RunConfig) -> float:
    fed, task = config.federation, config.task.options
    client_rounds = config.rounds * fed.sample_size()
    if config.task.kind == "few-shot":
        images = task.get("n_way", 5) * (task.get("k_shot", 1) + task.get("q_query", 5)) / 30.0
        images *= (task.get("filters", 64) / 32.0) ** 1.5
        per = CLIENT_ROUND_S.get(config.method) or LOCAL_STEP_S[config.method] * config.train.local_steps
        per *= FLOPS_SLOWDOWN if config.options.get("count_flops") else 1.0
        evals = eval_rounds(config.rounds, config.eval_every) * task.get("eval_episodes", 600) * 0.02 * images
        return 5 + client_rounds * per * images + evals
    scale = (config.data.max_train_samples or 15000) / 15000
    evals = eval_rounds(config.rounds, config.eval_every) * 2.5 * (config.data.max_test_samples or 10000) / 10000
    return 10 + client_rounds * LOSS_CLIENT_ROUND_S[config.method] * max(scale, 0.2) + evals


# -- reports ----------------------------------------------------------------------------------------
def setup_section(scale: Scale, seeds: list[int], command: str, estimate: str) -> str:
    u = scale.updates or 60
    return "\n".join(
        [
            "## Setup",
            "",
            "Produced by",
            "",
            "```bash",
            command,
            "```",
            "",
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
    path: Path, groups: list[tuple[str, list[RunSpec]]], title: str, metric: str = "accuracy", updates: bool = False
) -> None:
    """Seed-averaged curves against the round (``updates``: against backbone updates per client)."""
    with figure(path, figsize=(6.5, 4.2)) as (fig, ax):
        for label, specs in groups:
            pts = averaged_curve(specs, metric)
            if pts:
                per = updates_per_round(specs[0]) if updates else 1
                ax.plot([per * p[0] for p in pts], [100 * p[2] for p in pts], marker="o", ms=3, label=label)
        ax.set(title=title, xlabel="backbone updates per client" if updates else "round", ylabel=f"{metric} (%)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)


def updates_per_round(spec: RunSpec) -> int:
    """Backbone updates per client and round: one outer step (bilevel) or the local steps."""
    return 1 if spec.labels["method"] in BILEVEL else spec.config.train.local_steps


def budget_accuracy(spec: RunSpec) -> float | None:
    """The mean of the run's last LAST evaluations taken at a multiple of 10 backbone updates per
    client, so that every method is read at the same update counts (bilevel runs evaluate more
    often than single-level ones when ``--updates`` scales the rounds); None while unfinished."""
    per = updates_per_round(spec)
    points = [r["accuracy"] for r in load_rounds(spec) if r.get("accuracy") is not None and r["round"] * per % 10 == 0]
    return mean(points[-LAST:]) if points else None


def budget_cell(specs: list[RunSpec]) -> str:
    """mean ± std over the seeds of :func:`budget_accuracy`, ``(n=…)`` while some are unfinished."""
    values = [budget_accuracy(s) for s in specs]
    n = sum(v is not None for v in values)
    return percent(values) + (f" (n={n})" if 0 < n < len(specs) else "")


def step_size(specs: list[RunSpec], keys_of=lambda m: (rate_key(m),)) -> str:
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
        runs = with_labels(specs, problem=problem)
        rows = {
            m: f"{LABEL[m]} ({sweep_rates(group[0], problem)})"
            for m in METHODS
            if (group := with_labels(runs, method=m))
        }
        if rows:
            panels[title] = {rows[m]: with_labels(runs, method=m) for m in rows}
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
        *sweep_sections(
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
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def sweep_rates(spec: RunSpec, problem: str) -> str:
    """The step sizes factor 1 stands for: ``options.outer_lr x 1 = 0.05``."""
    m, f = spec.labels["method"], spec.labels["factor"]
    if problem == "few-shot":
        return f"`{rate_key(m)}` x 1 = {base_rate(spec.config, m) / f:g}"
    return ", ".join(f"`{key}` x 1 = {rate_value(spec.config, key) / f:g}" for key in lt_rate_keys(m))


def report_table2(specs, scale, head, out) -> str:
    settings = [s for s in scale.settings if with_labels(specs, setting=s)]
    rows = []
    for m in METHODS:
        row = [LABEL[m]] + ([step_size(with_labels(specs, method=m))] if scale.sweep else [])
        for s in settings:
            paper = PAPER_TABLE2.get(m)
            group = with_labels(specs, method=m, setting=s)
            row += [budget_cell(group), accuracy_cell(group), f"{paper[list(SETTINGS).index(s)]:.2f}" if paper else "–"]
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
        *table_lines(cols, rows),
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
            [(LABEL[m], with_labels(specs, method=m, setting=s)) for m in METHODS],
            f"{SETTINGS[s]}: accuracy vs updates (mean over seeds)",
            updates=True,
        )
        lines += [f"![{s}](table2-{s}.png)", ""]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def stats_mean(values) -> float | None:
    return mean([v for v in values if v is not None])


def per_client_round(spec: RunSpec, key: str) -> float | None:
    rounds = load_rounds(spec)
    if not rounds:
        return None
    if key in ("bytes", "compute_s"):
        vals = [
            sum(r["client_bytes_up"].values()) + sum(r["client_bytes_down"].values())
            if key == "bytes"
            else r["compute_s"]
            for r in rounds
        ]
        return sum(vals) / sum(len(r["clients"]) for r in rounds)
    vals = [r[key] for r in rounds if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def report_fig4(specs, table2, head, out) -> str:
    rows, bars = [], {}
    for m in BILEVEL:
        flops = [per_client_round(s, "client_gflops") for s in with_labels(specs, method=m)]
        comm = [per_client_round(s, "bytes") for s in with_labels(table2, method=m, setting="w5s1")]
        secs = [per_client_round(s, "compute_s") for s in with_labels(table2, method=m, setting="w5s1")]
        bars[m] = [stats_mean(v) for v in (flops, comm, secs)]
    for m in BILEVEL:
        cells = []
        for value, base, spec in zip(bars[m], bars["fedmbo"], (".4f", ",.0f", ".3f")):
            ratio = f" ({100 * value / base:.1f} %)" if value is not None and base else ""
            cells.append("–" if value is None else format(value, spec) + ratio)
        rows.append([LABEL[m], *cells])
    lines = [
        "# Figure 4 (CPU scale): client computation and communication against the full-model bilevel baseline",
        "",
        "Per client and round, mean over clients, rounds and seeds, 5-way 1-shot; in brackets the share of "
        "the full-model bilevel baseline. GFLOPs: torch's FLOP counter over both phases (short runs with "
        "`options.count_flops`); bytes: encoded messages up + down (Table II's runs); seconds: the client's "
        "measured compute (shared cores: rough). Paper: RABO 26.7 % and RAFBO 17.8 % of FedMBO's "
        'computation, both 26.7 % of its communication ("5x and 4x reduction").',
        "",
        head,
        "## Results",
        "",
        *table_lines(
            ["method", "GFLOPs / client / round", "bytes / client / round", "compute s / client / round"], rows
        ),
        "",
        "![fig4](fig4.png)",
        "",
    ]
    with figure(out / "fig4.png", 1, 2, figsize=(9, 3.6)) as (fig, (a1, a2)):
        for ax, i, title in ((a1, 0, "computation (GFLOPs)"), (a2, 1, "communication (bytes)")):
            vals = [bars[m][i] or 0.0 for m in BILEVEL]
            ax.bar([LABEL[m].split(" ")[0] for m in BILEVEL], vals)
            ax.set(title=f"{title} per client and round")
            ax.grid(alpha=0.3, axis="y")
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig3(specs, head, out) -> str:
    def best(group):  # each run's best evaluation: the segment runs can peak and fall back
        values = [
            max((r["accuracy"] for r in load_rounds(s) if r.get("accuracy") is not None), default=None) for s in group
        ]
        return percent(values)

    rows = [
        [
            LABEL[m],
            *(
                f(with_labels(specs, method=m, cstar=c))
                for c in (1, 2)
                for f in (lambda g: accuracy_cell(g, LAST), best)
            ),
        ]
        for m in ("rabo", "rafbo")
    ]
    lines = [
        "# Figure 3 (CPU scale): the minimum coverage C_x^*",
        "",
        "Every client at capacity 1/4; the units of every layer are cut into 4 contiguous segments and client i "
        f"trains segment `segments[i]`: C_x^* = 1 with {SEGMENTS[1]}, C_x^* = 2 with {SEGMENTS[2]} (the runs' "
        "metrics report the C_x^* they reached). 5-way 5-shot. A segment's sub-model holds only its own "
        "channels, so weights between channels of different segments are never trained.",
        "",
        head,
        "## Results",
        "",
        *table_lines(
            ["method", "C_x^* = 1 acc (%)", "C_x^* = 1 best (%)", "C_x^* = 2 acc (%)", "C_x^* = 2 best (%)"], rows
        ),
        "",
        "Paper: C_x^* = 2 above C_x^* = 1 for both methods.",
        "",
        "![fig3](fig3.png)",
        "",
    ]
    curve_plot(
        out / "fig3.png",
        [(f"{LABEL[m]}, C* = {c}", with_labels(specs, method=m, cstar=c)) for m in ("rabo", "rafbo") for c in (1, 2)],
        "5-way 5-shot, capacity 1/4",
    )
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_table3(specs, scale, head, out) -> str:
    rows = []
    for s in scale.table3_settings:
        for m in ("rabo", "rafbo"):
            paper = PAPER_TABLE3.get((m, s), ())
            rows.append(
                [
                    f"{LABEL[m]}, {SETTINGS[s]}",
                    *(
                        f"{accuracy_cell(with_labels(specs, method=m, setting=s, clients=n), LAST)}"
                        + (
                            f" (paper {paper[(10, 20, 30, 50).index(n)]:.2f})"
                            if n in (10, 20, 30, 50) and paper
                            else ""
                        )
                        for n in scale.clients
                    ),
                ]
            )
    lines = [
        "# Table III (CPU scale): scalability in the number of clients",
        "",
        f"The training characters split over n clients (so each holds fewer); beyond 10 clients "
        f"{scale.per_round} are sampled per round (paper: not stated), the capacity mix repeated.",
        "",
        head,
        "## Results",
        "",
        *table_lines(["method, setting", *(f"{n} clients (%)" for n in scale.clients)], rows),
        "",
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig5(specs, scale, head, out) -> str:
    rows = [
        [
            LABEL[m],
            *([step_size(with_labels(specs, method=m), lt_rate_keys)] if scale.sweep else []),
            accuracy_cell(with_labels(specs, method=m), LAST),
            mean_text([s.get("final_loss") for s in map(load_summary, with_labels(specs, method=m)) if s], ".3f"),
        ]
        for m in METHODS
    ]
    lines = [
        "# Figure 5 (CPU scale): loss-function tuning on long-tailed Fashion-MNIST",
        "",
        "Accuracy on the balanced 10,000-image test set (= balanced accuracy). Bilevel methods tune the VS "
        "loss (x) of the model (y) with an 80/20 train/validation split per client; single-level methods "
        "train with plain cross-entropy on all the client's data. Every client at capacity 1/2 (the full "
        "bilevel baseline and FedAvg: the full model). Paper: RABO above the single-level sub-model methods "
        "and competitive with full-model FedAvg.",
        "",
        head,
        "## Results",
        "",
        *table_lines(["method", *(["step size"] if scale.sweep else []), "balanced acc (%)", "final test loss"], rows),
        "",
        "![fig5](fig5.png)",
        "",
    ]
    curve_plot(
        out / "fig5.png",
        [(LABEL[m], with_labels(specs, method=m)) for m in METHODS],
        "long-tailed Fashion-MNIST: balanced accuracy",
        "balanced_accuracy",
    )
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def write_reports(plan, selected, scale, seeds, out, command, estimate) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    head = setup_section(scale, seeds, command, estimate)
    reports = {
        "sweep": lambda: report_sweep(plan["sweep"], scale, head, out),
        "table2": lambda: report_table2(plan["table2"], scale, head, out),
        "fig4": lambda: report_fig4(plan["fig4"], plan["table2"], head, out),
        "fig3": lambda: report_fig3(plan["fig3"], head, out),
        "table3": lambda: report_table3(plan["table3"], scale, head, out),
        "fig5": lambda: report_fig5(plan["fig5"], scale, head, out),
    }
    written = []
    for exp in selected:
        path = out / f"{exp}.md"
        path.write_text(reports[exp](), encoding="utf-8")
        written += [path, *sorted(out.glob(f"{exp}*.png"))]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = suite_parser(__doc__.split("\n\n")[0], EXPERIMENTS, seeds="0,1,2")
    add_sweep_options(
        parser,
        EXPERIMENTS,
        f"each method's own step size on {SETTINGS[SWEEP_SETTING]} (for table2, table3; --lt-factors: fig5)",
        factors=True,
        sweep_seed=3,
    )
    parser.add_argument(
        "--lt-factors",
        default=LT_FACTORS,
        help=f"with --lr-factors: the multiples swept on Figure 5's loss-tuning problem (default {LT_FACTORS})",
    )
    parser.add_argument(
        "--updates",
        type=int,
        default=None,
        help="few-shot backbone updates per client (default 60; a multiple of 10): scales every method's rounds alike",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"run only these methods (comma-separated subset of {','.join(METHODS)}); the others' "
        "cells read 'pending'",
    )
    parser.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"Table II's N-way K-shot columns to run (comma-separated subset of {','.join(SETTINGS)})",
    )
    args = parser.parse_args(argv)
    try:
        selected, seeds = parse_selection(args, EXPERIMENTS)
        sweep, selected = sweep_selection(args, selected, SWEPT)
        lt_grid = parse_grid(args.lt_factors, "--lt-factors", "multiples of each method's own rates")
        settings = tuple(s for s in args.settings.split(",") if s)
        unknown = [s for s in settings if s not in SETTINGS]
        if args.updates is not None and (args.updates < 10 or args.updates % 10):
            raise SuiteError(f"--updates: a multiple of 10 expected, got {args.updates}")
        methods = [m for m in args.methods.split(",") if m]
        if not methods or set(methods) - set(METHODS):
            raise SuiteError(
                f"--methods: unknown {', '.join(sorted(set(methods) - set(METHODS))) or '(none given)'}; "
                f"expected a subset of {','.join(METHODS)}"
            )
        if unknown or not settings:
            raise SuiteError(
                f"--settings: unknown {', '.join(unknown) or '(none given)'}; expected a subset of {','.join(SETTINGS)}"
            )
    except SuiteError as exc:
        print(exc)
        return 2
    scale = quick_scale() if args.quick else Scale()
    scale = replace(scale, settings=settings, updates=args.updates, sweep=sweep, lt_grid=lt_grid)
    out = output_dir(args, RESULTS, QUICK_RESULTS)
    offline_data("omniglot")
    biased_seed_warning(sweep, seeds, selected, SWEPT)
    command = suite_command("benchmarks/rabo/run_suite.py", argv)
    print(
        f"RABO suite: {', '.join(selected)}; seeds {seeds}"
        + (
            f"; step-size factors {', '.join(f'{f:g}' for f in sweep.grid)} (loss tuning: "
            f"{', '.join(f'{f:g}' for f in lt_grid)}) swept on seed {sweep.seed}"
            if sweep
            else ""
        )
        + f" -> {out}"
    )

    def stage(experiments: list[str]) -> int:
        plan = build_suite_plan(scale, seeds, out)
        plan = {e: [s for s in specs if s.labels["method"] in methods] for e, specs in plan.items()}
        runs = distinct_runs(plan, experiments)
        costs = {s.key: estimate_s(s.config) for s in runs}
        estimate = (
            f"Estimated time of the selection (built-in cost model, {args.workers} workers): "
            f"{estimate_minutes(runs, costs, args.workers):.0f} min."
        )
        notes = ["cost model: built-in per-method constants (benchmarks/rabo/run_suite.py)"]
        for problem in ("few-shot", "loss-tuning") if sweep else ():
            swept = with_labels(plan["sweep"], problem=problem)
            notes.append(
                f"{problem}: "
                + sweep_note({m: with_labels(swept, method=m) for m in methods}, choices_of(swept, problem), "methods")
            )
        return run_suite(
            plan,
            experiments,
            args,
            costs,
            lambda: write_reports(plan, experiments, scale, seeds, out, command, estimate),
            root=REPO,
            notes=notes,
        )

    return sweep_first(stage, selected, args)  # tables II and III are planned from the sweep's finished runs


if __name__ == "__main__":
    sys.exit(main())
