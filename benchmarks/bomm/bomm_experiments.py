"""The BoMM suite's experiments (see run_suite.py): the runs each needs, their cost, and reading them back."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fedtune import harness
from fedtune.config import RunConfig, load_config
from fedtune.methods.bomm.options import BommOptions

REPO = Path(__file__).resolve().parents[2]
RECIPE, OVERLAYS, RESULTS, QUICK_RESULTS = harness.suite_files(REPO, "bomm-suite", "bomm")
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
) -> harness.RunSpec:
    """One run: ``method`` in ``scenario`` with ``aligned`` aligned ids (Delta from the recipe unless given)."""
    delta = scale.base.task.options["delta"] if delta is None else delta
    values = {"method": method, "seed": seed, "task.scenario": scenario, "task.aligned": aligned, "task.delta": delta}
    name = f"{method}{tag}-s{scenario}-a{aligned}-d{delta:g}-seed{seed}"
    return harness.RunSpec(
        name,
        [*scale.overrides, *harness.assignments(values), *extra],
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


def specs_table1(scale: Scale, seeds: list[int]) -> list[harness.RunSpec]:
    return [
        spec(scale, m, seed, scenario, a)
        for scenario in (1, 2)
        for a in scale.aligned
        for seed in seeds
        for m in METHODS
    ]


def specs_table2(scale: Scale, seeds: list[int]) -> list[harness.RunSpec]:
    return [spec(scale, m, seed, 3, 0) for seed in seeds for m in METHODS]


def specs_table3(scale: Scale, seeds: list[int]) -> list[harness.RunSpec]:
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


def specs_fig3(scale: Scale, seeds: list[int]) -> list[harness.RunSpec]:
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
            extra=[] if mu == default else harness.assignments({"options.mu": mu}),
            tag=f"-mu{mu:g}",
            part="mu",
            mu=mu,
        )
        for mu in scale.mus
        for seed in seeds
    ]
    return deltas + mus


def specs_cost(scale: Scale, seeds: list[int]) -> list[harness.RunSpec]:
    return [spec(scale, m, seed, 1, max(scale.aligned)) for seed in seeds for m in METHODS]


BUILDERS = {
    "table1": specs_table1,
    "table2": specs_table2,
    "table3": specs_table3,
    "fig3": specs_fig3,
    "cost": specs_cost,
}


def build_suite_plan(scale: Scale, seeds: list[int], out: Path) -> dict[str, list[harness.RunSpec]]:
    """Every experiment's runs (all of them, so that which folder owns a shared run never depends on
    ``--only``), resolved to their configs and canonical run folders."""
    return harness.build_plan({exp: BUILDERS[exp](scale, seeds) for exp in EXPERIMENTS}, RECIPE, out)


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
    costs = harness.Costs(
        step_s=c["step_s"],
        eval_s_per_example=c["eval_s"] / 300,
        run_setup_s=c["setup_s"],
        client_overhead_s=c["round_s"].get(config.method, 5.0) / parties,
    )
    return harness.estimate_s(config, costs, 300)


# -- reading runs ----------------------------------------------------------------------------
def value(spec_: harness.RunSpec, metric: str) -> float | None:
    """The run's ``metric`` averaged over its last ``LAST`` evaluations (None while unfinished or absent)."""
    return harness.mean_of_last(harness.load_rounds(spec_), LAST, metric) if harness.load_rounds(spec_) else None


def cell(specs: list[harness.RunSpec], metric: str, scale: float = 100.0, digits: int = 2) -> str:
    values = [v for v in (value(s, metric) for s in specs) if v is not None]
    m, s = harness.mean_std([scale * v for v in values])
    if m is None:  # nothing yet, or finished runs that do not report the metric
        return "pending" if any(harness.load_summary(x) is None for x in specs) else "–"
    more = f" (n={len(values)})" if len(values) < len(specs) else ""
    return f"{m:.{digits}f} ± {s:.{digits}f}{more}"


def mean_value(specs: list[harness.RunSpec], metric: str) -> float | None:
    values = [v for v in (value(s, metric) for s in specs) if v is not None]
    return 100 * sum(values) / len(values) if values else None
