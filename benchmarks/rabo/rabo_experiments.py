"""The RABO suite's experiments (see run_suite.py): the runs each needs, the rate choices and their cost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedtune import harness
from fedtune.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
LOSS_RECIPE = REPO / "configs" / "benchmarks" / "rabo-losstune-suite.toml"
FEW_SHOT_RECIPE, OVERLAYS, RESULTS, QUICK_RESULTS = harness.suite_files(REPO, "rabo-suite", "rabo")
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
    sweep: harness.Sweep | None = None  # --lr-factors: multiples of each method's own step size
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
def specs_sweep(scale: Scale, seeds: list[int], chosen=None) -> list[harness.RunSpec]:
    if scale.sweep is None:
        return []
    seed, s = scale.sweep.seed, SWEEP_SETTING
    return [
        harness.RunSpec(
            named(f"{m}-{s}-s{seed}", f),
            scale.few_shot(s, m, f"seed={seed}", factor=f),
            {"problem": "few-shot", "method": m, "setting": s, "seed": seed, "factor": f},
        )
        for m in METHODS
        for f in scale.sweep.grid
    ]


def specs_lt_sweep(scale: Scale) -> list[harness.RunSpec]:
    """Figure 5's sweep: each method on the loss-tuning problem at every ``scale.lt_grid`` factor."""
    if scale.sweep is None:
        return []
    seed = scale.sweep.seed
    return [
        harness.RunSpec(
            named(f"lt-{m}-s{seed}", f),
            scale.loss_tuning(m, f"seed={seed}", factor=f),
            {"problem": "loss-tuning", "method": m, "seed": seed, "factor": f},
        )
        for m in METHODS
        for f in scale.lt_grid
    ]


def specs_table2(scale: Scale, seeds: list[int], chosen=None) -> list[harness.RunSpec]:
    return [
        harness.RunSpec(
            named(f"{m}-{s}-s{seed}", f),
            scale.few_shot(s, m, f"seed={seed}", factor=f),
            {"method": m, "setting": s, "seed": seed, "factor": f},
        )
        for s in scale.settings
        for seed in seeds
        for m in METHODS
        if (f := factor_of(chosen, m)) is not WAIT
    ]


def specs_fig4(scale: Scale, seeds: list[int], chosen=None) -> list[harness.RunSpec]:
    rounds = ["rounds=2", "eval_every=2"] if scale.quick else ["rounds=3", "eval_every=3"]
    return [
        harness.RunSpec(
            f"flops-{m}-w5s1-s{seed}",
            scale.few_shot("w5s1", m, f"seed={seed}", *rounds, "options.count_flops=true"),
            {"method": m, "setting": "w5s1", "seed": seed},
        )
        for seed in seeds
        for m in BILEVEL
    ]


def specs_fig3(scale: Scale, seeds: list[int], chosen=None) -> list[harness.RunSpec]:
    return [
        harness.RunSpec(
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
        f"federation.profiles={harness.toml_value(profiles)}",
        f"federation.clients_per_round={per_round}",
    ]


def specs_table3(scale: Scale, seeds: list[int], chosen=None) -> list[harness.RunSpec]:
    return [
        harness.RunSpec(
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


def specs_fig5(scale: Scale, seeds: list[int], chosen=None) -> list[harness.RunSpec]:
    return [
        harness.RunSpec(
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


def sweep_score(spec: harness.RunSpec) -> float | None:
    """A sweep run's figure: Table II's (:func:`budget_accuracy`) on the few-shot problem; on the
    loss-tuning one, Figure 5's, the mean of its last LAST evaluations (balanced accuracy)."""
    return budget_accuracy(spec) if spec.labels["problem"] == "few-shot" else harness.run_accuracy(spec, LAST)


def choices_of(sweep_runs: list[harness.RunSpec], problem: str = "few-shot") -> dict[str, harness.Choice | None]:
    """Each method's chosen factor on ``problem``: the argmax over its finished sweep runs of
    :func:`sweep_score` (None while any of its runs is unfinished)."""
    runs = harness.with_labels(sweep_runs, problem=problem)
    return {
        m: harness.choose(harness.with_labels(runs, method=m), lambda s: {"factor": s.labels["factor"]}, sweep_score)
        for m in METHODS
        if harness.with_labels(runs, method=m)
    }


def chosen_factors(sweep_runs: list[harness.RunSpec], problem: str) -> dict[str, float]:
    return {m: c.setting["factor"] for m, c in choices_of(sweep_runs, problem).items() if c}


def build_suite_plan(scale: Scale, seeds: list[int], out: Path) -> dict[str, list[harness.RunSpec]]:
    """Every experiment's runs, resolved (all experiments, so run ownership never depends on --only);
    with ``scale.sweep``, Tables II and III and Figure 5 at each method's chosen factor on their
    problem (a method waits until its sweep is finished)."""
    few_shot = lt = None
    if scale.sweep is not None:
        plan = harness.build_plan({e: f(scale, seeds) for e, f in FEW_SHOT.items()}, FEW_SHOT_RECIPE, out)
        few_shot = chosen_factors(plan["sweep"], "few-shot")
        lt = chosen_factors(
            harness.build_plan({"sweep": specs_lt_sweep(scale)}, LOSS_RECIPE, out)["sweep"], "loss-tuning"
        )
    plan = harness.build_plan({e: f(scale, seeds, few_shot) for e, f in FEW_SHOT.items()}, FEW_SHOT_RECIPE, out)
    loss = harness.build_plan({"sweep": specs_lt_sweep(scale), "fig5": specs_fig5(scale, seeds, lt)}, LOSS_RECIPE, out)
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
        evals = harness.eval_rounds(config.rounds, config.eval_every) * task.get("eval_episodes", 600) * 0.02 * images
        return 5 + client_rounds * per * images + evals
    scale = (config.data.max_train_samples or 15000) / 15000
    evals = (
        harness.eval_rounds(config.rounds, config.eval_every) * 2.5 * (config.data.max_test_samples or 10000) / 10000
    )
    return 10 + client_rounds * LOSS_CLIENT_ROUND_S[config.method] * max(scale, 0.2) + evals


def updates_per_round(spec: harness.RunSpec) -> int:
    """Backbone updates per client and round: one outer step (bilevel) or the local steps."""
    return 1 if spec.labels["method"] in BILEVEL else spec.config.train.local_steps


def budget_accuracy(spec: harness.RunSpec) -> float | None:
    """The mean of the run's last LAST evaluations taken at a multiple of 10 backbone updates per
    client, so that every method is read at the same update counts (bilevel runs evaluate more
    often than single-level ones when ``--updates`` scales the rounds); None while unfinished."""
    per = updates_per_round(spec)
    points = [
        r["accuracy"] for r in harness.load_rounds(spec) if r.get("accuracy") is not None and r["round"] * per % 10 == 0
    ]
    return harness.mean(points[-LAST:]) if points else None
