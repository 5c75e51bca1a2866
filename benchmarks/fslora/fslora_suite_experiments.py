"""The FSLoRA suite's experiments (see run_suite.py): the scale and the runs each experiment needs."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fedtune.config import RunConfig, load_config
from fedtune.harness import (
    RunSpec,
    assignments,
    build_plan,
    suite_files,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE, OVERLAYS, RESULTS, QUICK_RESULTS = suite_files(REPO, "fslora-suite", "fslora")
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
    labels = dict(method=method, data=data, seed=seed, rank=rank, rounds=rounds or scale.base.rounds, alpha=alpha)
    return RunSpec(name or f"{method}-{data}-s{seed}", scale.run_overrides(data, method, *extra), labels)


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
