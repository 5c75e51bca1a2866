"""The FedPFT suite's experiments (see run_suite.py): the runs each needs, the rate choices and their cost."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedtune import harness

REPO = Path(__file__).resolve().parents[2]
RECIPE, OVERLAYS, RESULTS, QUICK_RESULTS = harness.suite_files(REPO, "fedpft-suite", "fedpft")
SWEPT_RESULTS = REPO / "benchmarks" / "results" / "fedpft-swept"  # --lr-grid: every method at its own rate
EXPERIMENTS = ["sweep", "table1", "table2", "table3", "table4", "table5"]  # also the order that owns shared runs
SWEPT = ("table1", "table3", "table4", "table5")  # with --lr-grid: at each (data set, method)'s chosen rate
METHODS = ["fedpetuning", "fedot", "fedpft"]
LABEL = {
    "fedpetuning": "FedPETuning",
    "fedot": "FedOT",
    "fedpft": "FedPFT",
    "fedpft_n": "FedPFT_N",
    "fedpft_b": "FedPFT_B",
    "fedpft_d": "FedPFT_D",
}
PROXY_METHODS = ("fedot", "fedpft")
PUBLIC = {"sst2": "agnews", "agnews": "sst2", "digits": "fashion-mnist"}  # each set distills on another domain
TEXT = ("sst2", "agnews")
ALPHAS = (1.0, 5.0, 10.0)
ABLATIONS = {
    "fedpft_n": ["options.distill_before=false", "options.distill_during=false"],
    "fedpft_b": ["options.distill_during=false"],
    "fedpft_d": ["options.distill_before=false"],
    "fedpft": [],
}
T_VALUES, P_VALUES = (5, 10, 20), (0.3, 0.5, 0.8)
LAST = 3  # evaluations averaged per run
TEST_SIZES = {"sst2": 872, "agnews": 7600, "digits": 180}
VIT = "vit-random-4l"
MODELS = REPO / "benchmarks" / "results" / "_scratch" / "fedpft-models"  # git-ignored; rewritten on demand

# Costs on one free core of this VM (one torch thread): the MiniLM numbers are the FSLoRA suite's
# --calibrate (batch 16, max_length 64, load average ~3); the ViT's are rough guesses (tiny).
COSTS = {
    "sst2": harness.Costs(0.189, 0.0091, 1.7, 0.17),
    "agnews": harness.Costs(0.534, 0.0150, 5.1, 0.17),
    "digits": harness.Costs(0.03, 0.0005, 2.0, 0.05),
}

PAPER = {  # Tables 1-5 (BERT), App. F (SST-2 ablation)
    "table1": {"sst2": {"fedpetuning": 91.6, "fedot": 90.4, "fedpft": 91.6}},
    "table2": {"cifar10": {"fedpetuning": 98.2, "fedot": 95.5, "fedpft": 97.2}},
    "table3": {
        1.0: {"fedpetuning": 90.6, "fedot": 89.1, "fedpft": 89.7},
        5.0: {"fedpetuning": 90.9, "fedot": 89.9, "fedpft": 91.1},
        10.0: {"fedpetuning": 91.1, "fedot": 90.1, "fedpft": 91.6},
    },
    "table4": {"fedot": 90.4, "fedpft_n": 84.2, "fedpft_b": 90.8, "fedpft_d": 88.4, "fedpft": 91.6},
    "table5": {"t": {5: 87.3, 10: 87.5, 20: 87.1}, "p": {0.3: 87.4, 0.5: 87.5, 0.8: 87.1}},  # QNLI
}


@dataclass(frozen=True)
class Scale:
    quick: bool
    out: Path
    sweep: harness.Sweep | None = None

    def overrides(self, data: str, method: str, *extra: str) -> list[str]:
        """A run's overrides: its data set's overlay, --quick's, the model, its method's (and, for
        FedPFT / FedOT, the public set and the shared proxy cache), ``extra``."""
        base = method if method in OVERLAYS else "fedpft"  # ablations are FedPFT runs
        out = [*OVERLAYS[data], *(OVERLAYS["quick"] if self.quick else [])]
        if data == "digits":
            out.append(f'model.name="{"tiny-vit" if self.quick else str(MODELS / VIT)}"')
        elif self.quick:
            out.append('model.name="tiny-bert"')
        out += OVERLAYS[base]
        if base in PROXY_METHODS:
            out += [f'options.distill_data="{PUBLIC[data]}"', f'options.proxy_cache_dir="{self.out / "proxy-cache"}"']
            if self.quick:
                out += ["options.distill_steps=5", "options.distill_samples=128", "options.distill_batch_size=8"]
                if base == "fedpft":
                    out += ["options.align_interval=1", "options.align_steps=2", "options.apoz_max_examples=32"]
        return out + list(extra)


WAIT = object()  # Rates.of: the (data set, method)'s sweep is not finished


@dataclass(frozen=True)
class Rates:
    """The learning rate of each (data set, method): the recipe's (None) without a sweep; with one,
    the chosen rate of the swept data sets (:data:`TEXT`), :data:`WAIT` while not chosen."""

    chosen: dict[tuple[str, str], float] | None = None

    def of(self, data: str, method: str):
        if self.chosen is None or data not in TEXT:
            return None
        return self.chosen.get((data, method), WAIT)


def spec(
    scale: Scale, name: str, data: str, method: str, seed: int, *extra: str, lr: float | None = None, **labels
) -> harness.RunSpec:
    """One run; ``lr`` (a swept or chosen rate, named in the run) overrides the recipe's."""
    rate = [] if lr is None else [f"train.lr={lr!r}"]
    return harness.RunSpec(
        name + ("" if lr is None else f"-lr{lr:g}"),
        scale.overrides(data, method, f"seed={seed}", *extra, *rate),
        {"method": method, "data": data, "seed": seed, "lr": lr, **labels},
    )


def rated(rates: Rates, data: str, method: str, make) -> list[harness.RunSpec]:
    """``[make(lr)]`` at the (data set, method)'s rate, or ``[]`` while it waits for the sweep."""
    lr = rates.of(data, method)
    return [] if lr is WAIT else [make(lr)]


def specs_sweep(scale: Scale, seeds: list[int], rates: Rates) -> list[harness.RunSpec]:
    if scale.sweep is None:
        return []
    s = scale.sweep.seed
    return [spec(scale, f"{m}-{d}-s{s}", d, m, s, lr=lr) for d in TEXT for m in METHODS for lr in scale.sweep.grid]


def specs_table1(scale: Scale, seeds: list[int], rates: Rates) -> list[harness.RunSpec]:
    return [
        r
        for d in TEXT
        for s in seeds
        for m in METHODS
        for r in rated(rates, d, m, lambda lr: spec(scale, f"{m}-{d}-s{s}", d, m, s, lr=lr))
    ]


def specs_table2(scale: Scale, seeds: list[int], rates: Rates) -> list[harness.RunSpec]:
    return [spec(scale, f"{m}-vit-digits-s{s}", "digits", m, s) for s in seeds for m in METHODS]


def specs_table3(scale: Scale, seeds: list[int], rates: Rates) -> list[harness.RunSpec]:
    return [
        r
        for a in ALPHAS
        for s in seeds
        for m in METHODS
        for r in rated(
            rates,
            "sst2",
            m,
            lambda lr: spec(
                scale,
                f"{m}-sst2-dir{a:g}-s{s}",
                "sst2",
                m,
                s,
                'data.partition="dirichlet"',
                f"data.alpha={a}",
                lr=lr,
                alpha=a,
            ),
        )
    ]


def specs_table4(scale: Scale, seeds: list[int], rates: Rates) -> list[harness.RunSpec]:
    variants = {"fedot": ("fedot", []), **{v: ("fedpft", o) for v, o in ABLATIONS.items()}}
    return [
        r
        for s in seeds
        for v, (m, o) in variants.items()
        for r in rated(rates, "sst2", m, lambda lr: spec(scale, f"{v}-sst2-s{s}", "sst2", m, s, *o, lr=lr, variant=v))
    ]


def specs_table5(scale: Scale, seeds: list[int], rates: Rates) -> list[harness.RunSpec]:
    """Table 5: FedPFT on SST-2 at each alignment interval T (p = 0.5), then at each fraction p (T = 10)."""

    def runs(tag: str, override: str, **labels) -> list[harness.RunSpec]:
        return [
            r
            for s in seeds
            for r in rated(
                rates,
                "sst2",
                "fedpft",
                lambda lr: spec(scale, f"fedpft-sst2-{tag}-s{s}", "sst2", "fedpft", s, override, lr=lr, **labels),
            )
        ]

    t_runs = [r for t in T_VALUES for r in runs(f"t{t}", f"options.align_interval={t}", part="t", t=t, p=0.5)]
    return t_runs + [r for p in P_VALUES for r in runs(f"p{p:g}", f"options.align_fraction={p}", part="p", t=10, p=p)]


def choices_of(sweep_runs: list[harness.RunSpec]) -> dict[tuple[str, str], harness.Choice | None]:
    """Each swept (data set, method)'s choice: the argmax over its finished sweep runs of the mean of
    the last :data:`LAST` evaluations' full-model accuracy (None while any of its runs is unfinished)."""
    return {
        (d, m): harness.choose(
            harness.with_labels(sweep_runs, data=d, method=m),
            lambda s: {"lr": s.labels["lr"]},
            lambda s: last_mean(s, "accuracy"),
        )
        for d in TEXT
        for m in METHODS
        if harness.with_labels(sweep_runs, data=d, method=m)
    }


def build_suite_plan(scale: Scale, seeds: list[int], out: Path):
    """Every experiment's runs (all of them, so that which folder owns a shared run never depends on
    ``--only``), with the sweep's choices where ``scale.sweep`` is set."""
    rates = Rates()
    if scale.sweep is not None:
        sweep = harness.build_plan({"sweep": specs_sweep(scale, seeds, rates)}, RECIPE, out)["sweep"]
        rates = Rates({k: c.setting["lr"] for k, c in choices_of(sweep).items() if c})
    return harness.build_plan({e: BUILDERS[e](scale, seeds, rates) for e in EXPERIMENTS}, RECIPE, out)


BUILDERS = {
    "sweep": specs_sweep,
    "table1": specs_table1,
    "table2": specs_table2,
    "table3": specs_table3,
    "table4": specs_table4,
    "table5": specs_table5,
}


def ensure_random_vit() -> Path:
    """The random ViT of Table 2 (seed 0), written once as a Hugging Face folder."""
    path = MODELS / VIT
    if not (path / "config.json").is_file():
        import torch
        from transformers import ViTConfig, ViTForImageClassification

        torch.manual_seed(0)
        shape = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 256}
        cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, num_labels=10, **shape)
        ViTForImageClassification(cfg).save_pretrained(str(path))
    return path


# -- cost model -----------------------------------------------------------------------------------


def run_cost(spec_: harness.RunSpec, distills: bool) -> float:
    """Seconds on one free core: the harness's model (client steps, evaluations, setup) plus what
    the proxy methods add: the proxy's evaluation beside the full model's, FedPFT's APoZ passes and
    alignments, and (``distills``: the first run of a proxy) the distillation before FL."""
    c = spec_.config
    costs = COSTS[spec_.labels["data"]]
    test = min(TEST_SIZES[spec_.labels["data"]], c.data.max_test_samples or 10**9)
    total = harness.estimate_s(c, costs, test)
    if c.method in PROXY_METHODS:
        o = c.options
        total += harness.eval_rounds(c.rounds, c.eval_every) * test * costs.eval_s_per_example  # proxy_accuracy
        step32 = 2 * costs.step_s  # a distillation step: batch 32, teacher forward + student step
        if distills and o.get("distill_before", True):
            total += o.get("distill_steps", 200) * step32
        if c.method == "fedpft" and o.get("distill_during", True):
            aligns = len([r for r in range(1, c.rounds) if r % o.get("align_interval", 10) == 0])
            apoz = c.federation.sample_size() * o.get("apoz_max_examples", 512) / c.train.batch_size * costs.step_s / 3
            total += aligns * (o.get("align_steps", 20) * step32 + apoz)
    return total


def plan_costs(runs: list[harness.RunSpec]) -> dict[str, float]:
    seen: set[tuple] = set()
    costs = {}
    for s in runs:
        o = s.config.options
        proxy = (s.config.method, s.labels["data"], o.get("distill_before", True))
        costs[s.key] = run_cost(s, proxy not in seen)
        seen.add(proxy)
    return costs


# -- reports --------------------------------------------------------------------------------------


def last_mean(spec_: harness.RunSpec, metric: str) -> float | None:
    rounds = harness.load_rounds(spec_)
    return harness.mean_of_last(rounds, LAST, metric) if rounds else None
