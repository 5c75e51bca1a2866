"""The CoMMIT suite's experiments (see run_suite.py): the runs each needs, their cost, and reading them back."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from fedtune import harness
from fedtune.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[2]
RECIPE, OVERLAYS, RESULTS, QUICK_RESULTS = harness.suite_files(REPO, "commit-suite", "commit")
SWEPT_RESULTS = REPO / "benchmarks" / "results" / "commit-swept"  # --lr-grid: every trainer at its own rate
EXPERIMENTS = ["sweep", "table1", "fig45", "fig6", "fig3", "federated"]  # also the order that owns shared runs
SWEPT = ("table1", "fig45")  # with --lr-grid: run at each (modality, trainer)'s chosen rate
MODALITIES = ["image", "audio"]
LABEL = {
    "constant": "Constant LR",
    "language-lr-up": "Language LR up",
    "vision-lr-up": "Vision LR up",
    "feature-cd": "Feature CD",
    "language-cd": "Language CD",
    "commit-clr": "CoMMIT-CLR",
    "commit": "CoMMIT",
}
TABLE1 = ["constant", "feature-cd", "language-cd", "commit-clr", "commit"]
FIG45 = ["constant", "commit-clr", "commit"]
FIG6 = ["constant", "language-lr-up", "vision-lr-up", "commit-clr", "commit"]
FIG3 = ["constant", "language-lr-up", "vision-lr-up"]
FEDERATED = ["constant", "commit-clr", "commit"]
SMOOTH = 10  # steps in the moving average of the plotted curves
LAST_EVALS = 3  # a table cell is the mean of each run's last (up to) LAST_EVALS evaluations

PAPER_TABLE1 = {  # accuracy (QA) / ROUGE-L (captioning), BLIP-2 (vision) and SALMONN (audio)
    "constant": (54.06, 37.16, 26.48, 42.49, 24.60, 15.10, 33.32),
    "feature-cd": (57.99, 35.48, 18.00, 45.80, 22.41, 5.70, 30.90),
    "language-cd": (49.87, 34.47, 19.44, 38.52, 23.64, 15.74, 30.28),
    "commit-clr": (60.44, 39.09, 27.66, 52.86, 23.81, 15.07, 36.49),
    "commit": (64.37, 38.65, 28.12, 50.55, 25.06, 15.33, 37.01),
}


# -- run specifications ----------------------------------------------------------------------
@dataclass(frozen=True)
class Scale:
    """What every run adds to the recipe: ``--quick``, and ``--steps`` / ``--test-samples`` / ``--evals``
    / ``--lr`` (None: the recipe's 120 steps, 200 test questions, one evaluation at the end, lr)."""

    quick: bool = False
    steps: int | None = None
    test_samples: int | None = None
    evals: int | None = None
    lr: float | None = None

    def _overlays(self, modality: str) -> list[str]:
        return [*OVERLAYS[modality], *([*OVERLAYS["quick"], *OVERLAYS[f"quick-{modality}"]] if self.quick else [])]

    def centralized_steps(self, modality: str) -> int:
        """A centralized run's training steps in all: ``--steps``, else the recipe's."""
        return self.steps if self.steps is not None else load_config(RECIPE, self._overlays(modality)).train.local_steps

    def overrides(self, modality: str, federated: bool = False) -> list[str]:
        out = self._overlays(modality)
        if federated:
            out += [*OVERLAYS["federated"], *(OVERLAYS["quick-federated"] if self.quick else [])]
        if self.steps is not None:
            if federated:  # the same client steps over the federated overlay's rounds x sampled clients
                fed = load_config(RECIPE, out)
                per_round = fed.rounds * fed.federation.sample_size()
                out.append(f"train.local_steps={max(1, round(self.steps / per_round))}")
            else:
                out.append(f"train.local_steps={self.steps}")
        if self.evals is not None and not federated:  # the run's steps over `evals` rounds, one optimizer
            out += [
                f"rounds={self.evals}",
                f"train.local_steps={self.centralized_steps(modality) // self.evals}",
                "eval_every=1",
                "options.carry_optimizer=true",
            ]
        if self.test_samples is not None:
            out.append(f"data.max_test_samples={self.test_samples}")
        if self.lr is not None:
            out.append(f"train.lr={self.lr!r}")
        return out


def spec(
    modality: str, trainer: str, seed: int, scale: Scale, federated: bool = False, lr: float | None = None
) -> harness.RunSpec:
    """One run; ``lr`` (a swept or chosen rate, named in the run) overrides the scale's base rate."""
    mode, rate = "fed-" if federated else "", "" if lr is None else f"-lr{lr:g}"
    return harness.RunSpec(
        f"{mode}{modality}-{trainer}{rate}-seed{seed}",
        [
            *scale.overrides(modality, federated),
            f'options.trainer="{trainer}"',
            f"seed={seed}",
            *([] if lr is None else [f"train.lr={lr!r}"]),
        ],
        {"modality": modality, "trainer": trainer, "seed": seed, "federated": federated, "lr": lr},
    )


def choices_of(sweep_runs: list[harness.RunSpec]) -> dict[tuple[str, str], harness.Choice | None]:
    """Each (modality, trainer)'s chosen rate: the argmax over its finished sweep runs of the mean of
    the last :data:`LAST_EVALS` evaluations' exact match (None while any of its runs is unfinished)."""
    return {
        (m, t): harness.choose(
            harness.with_labels(sweep_runs, modality=m, trainer=t),
            lambda s: {"lr": s.labels["lr"]},
            lambda s: run_metric(s, "accuracy"),
        )
        for m in MODALITIES
        for t in TABLE1
        if harness.with_labels(sweep_runs, modality=m, trainer=t)
    }


def questions(specs: list[harness.RunSpec], modality: str) -> list[str]:
    """The question types of the modality's runs (the first: the short-answer one, the last: describe)."""
    group = harness.with_labels(specs, modality=modality)
    return list(group[0].config.task.options["questions"]) if group else []


def build_suite_plan(
    seeds: list[int], scale: Scale, out: Path, sweep: harness.Sweep | None = None
) -> dict[str, list[harness.RunSpec]]:
    """Every experiment's runs (all of them, so that which folder owns a shared run never depends on
    ``--only`` or ``--modalities``), resolved to their configs and canonical run folders. With a
    ``sweep``, Table 1's and Figures 4/5's runs of a (modality, trainer) use its chosen rate, and
    wait (are not planned) until its sweep runs are all finished."""
    grid = lambda trainers: [spec(m, t, s, scale) for m in MODALITIES for t in trainers for s in seeds]  # noqa: E731
    swept, chosen = [], grid
    if sweep is not None:
        swept = [spec(m, t, sweep.seed, scale, lr=lr) for m in MODALITIES for t in TABLE1 for lr in sweep.grid]
        choices = choices_of(harness.build_plan({"sweep": swept}, RECIPE, out)["sweep"])

        def chosen(trainers):
            return [
                spec(m, t, s, scale, lr=c.setting["lr"])
                for m in MODALITIES
                for t in trainers
                if (c := choices[(m, t)])
                for s in seeds
            ]

    experiments = {
        "sweep": swept,
        "table1": chosen(TABLE1),
        "fig45": chosen(FIG45),
        "fig6": grid(FIG6),
        "fig3": grid(FIG3),
        "federated": [spec("image", t, s, scale, federated=True) for t in FEDERATED for s in seeds],
    }
    # ownership: the experiments planned from the sweep come last when sweeping, so that a run they
    # share with another one (a rate chosen equal to the base rate) keeps that one's folder
    order = [e for e in EXPERIMENTS if sweep is None or e not in SWEPT] + ([*SWEPT] if sweep else [])
    plan = harness.build_plan({e: experiments[e] for e in order}, RECIPE, out)
    return {e: plan[e] for e in EXPERIMENTS}


def restrict(plan: dict[str, list[harness.RunSpec]], modalities: list[str]) -> dict[str, list[harness.RunSpec]]:
    """The plan's runs of ``modalities`` only (what ``--modalities`` runs)."""
    return {exp: [s for s in specs if s.labels["modality"] in modalities] for exp, specs in plan.items()}


# machine's load (4 steps each, image): 1.9 s a plain step, +1.6 s for kappa's two extra forwards,
# 5.0 s for CoMMIT (the provisional step, two forward-backward passes for the regularizer); tiny-llama
# steps take ~0.05 s. Evaluation: ~0.3 s per test question (greedy answers, KV cache), setup ~40 s.
STEP_S = {
    "constant": 3.5,
    "language-lr-up": 3.5,
    "vision-lr-up": 3.5,
    "feature-cd": 1.9,
    "language-cd": 1.9,
    "commit-clr": 3.5,
    "commit": 5.0,
}


def run_cost(config: RunConfig) -> float:
    tiny = config.model.name == "tiny-llama"
    step = 0.05 if tiny else STEP_S[config.options["trainer"]]
    steps = config.rounds * config.federation.sample_size() * config.train.local_steps
    evals = harness.eval_rounds(config.rounds, config.eval_every) * (config.data.max_test_samples or 200)
    return (5.0 if tiny else 40.0) + steps * step + evals * (0.01 if tiny else 0.3)


# -- reading runs ----------------------------------------------------------------------------
def step_curve(spec_: harness.RunSpec, key: str, client: str | None = None) -> list[float | None]:
    """The run's per-step ``key`` (client ``client``'s, else every client's in round order)."""
    out: list[float | None] = []
    for line in harness.load_rounds(spec_):
        curves = line.get("client_curves", {})
        for cid in sorted(curves, key=int):
            if client is None or cid == client:
                out += curves[cid].get(key, [])
    return out


def finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def seed_mean_curve(specs: list[harness.RunSpec], key: str) -> list[float]:
    """Step by step mean over the finished runs (nan where none has a value)."""
    curves = [step_curve(s, key) for s in specs if harness.load_summary(s)]
    n = max((len(c) for c in curves), default=0)
    out = []
    for i in range(n):
        vals = finite(c[i] for c in curves if i < len(c))
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def smooth(values: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing moving average over the last ``window`` finite values."""
    out = []
    for i in range(len(values)):
        vals = finite(values[max(0, i - window + 1) : i + 1])
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def run_metric(spec_: harness.RunSpec, metric: str) -> float | None:
    """The finished run's ``metric``: the mean of its last (up to) :data:`LAST_EVALS` evaluations."""
    return harness.mean_of_last(harness.load_rounds(spec_), LAST_EVALS, metric) if harness.load_summary(spec_) else None


def metric_values(specs: list[harness.RunSpec], metric: str, scale: float = 100.0) -> list[float]:
    """:func:`run_metric` of each finished run that has it, times ``scale``."""
    return [scale * v for v in (run_metric(s, metric) for s in specs) if v is not None]


def metric_cell(specs: list[harness.RunSpec], metric: str, scale: float = 100.0) -> str:
    values = metric_values(specs, metric, scale)
    m, s = harness.mean_std(values)
    if m is None:
        return "pending"
    return f"{m:.2f} ± {s:.2f}" + (f" (n={len(values)})" if len(values) < len(specs) else "")


def metric_mean(specs: list[harness.RunSpec], metric: str) -> float | None:
    values = metric_values(specs, metric)
    return sum(values) / len(values) if values else None


def kappa_stats(spec_: harness.RunSpec) -> tuple[float, float] | None:
    """(mean, std) of the run's kappa_t over its steps (None while unfinished or unmeasured)."""
    if not harness.load_summary(spec_):
        return None
    vals = finite(step_curve(spec_, "kappa"))
    if not vals:
        return None
    m = sum(vals) / len(vals)
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))


def stat_cell(values: list[float | None], digits: int = 3) -> str:
    """Mean ± sample std of the values present (None: a run not finished), with their number when some are missing."""
    present = [v for v in values if v is not None]
    m, s = harness.mean_std(present)
    if m is None:
        return "pending"
    return f"{m:.{digits}f} ± {s:.{digits}f}" + (f" (n={len(present)})" if len(present) < len(values) else "")


# -- reports ---------------------------------------------------------------------------------
def evaluated(config: RunConfig) -> str:
    """What a cell averages for a run of ``config`` (its evaluations: every ``eval_every`` rounds and the last)."""
    n = min(LAST_EVALS, harness.eval_rounds(config.rounds, config.eval_every))
    return "the final evaluation" if n == 1 else f"each run's mean of its last {n} evaluations"
