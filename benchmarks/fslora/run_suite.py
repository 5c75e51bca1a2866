"""CPU-scale counterparts of the FSLoRA paper's experiments (Fang et al. 2025, Section 5 and
Appendix C) on MiniLM, written to ``benchmarks/results/fslora/``.

Experiments (each a list of named run configs built with ``fedtune.config.load_config``):

- ``table51``: Table 5.1. FedIT (uniform rank = the smallest k_i, see below), FSLoRA, HeteroLoRA,
  FlexLoRA, FedStackLoRA on SST-2 and AG News: final accuracy mean +- std over seeds, MB uploaded,
  client compute seconds. Global rank r = 64, k_i / r drawn per device from {0.125, 0.25, 0.5, 0.75}
  (the baselines use r_i = k_i from the same draw).
- ``fig3``: FSLoRA with (k/r = 0.5) vs without (k/r = 1) sketching at an equal per-device upload
  budget: the sketched run gets R rounds, the unsketched one R/2, for r in {16, 64}.
- ``fig4b``: global rank r in {8, 16, 32, 64, 128} at a fixed k = 8 (k/r = 8/r; r = 8 is k/r = 1,
  the paper's Figure 6 reference point).
- ``fig4c``: k/r in {0.125, 0.25, 0.5, 1} at r = 64.
- ``fig7``: top-k upload compression (``federation.upload_topk``) with k/r in {0.125, 0.25, 0.5, 1},
  accuracy vs per-device upload MB, with fig4c's uncompressed runs as the reference.
- ``horizon``: not in the paper. Table 5.1's FedIT and FSLoRA runs on SST-2, continued to 3 R rounds,
  to test whether FSLoRA's gap to FedIT at R rounds is a short-run effect (the first R rounds are
  the very same computation as Table 5.1's runs, which the report checks).
- ``alpha``: not in the paper, which does not state lora_alpha. Table 5.1 (SST-2) and Figure 4(b)
  again with a fixed lora_alpha = 16 instead of 2 r. With 2 r, a device training k of r ranks
  scales its update by (alpha / r)(r / k) = 2 r / k, so the r = 64 methods train with up to 8x
  FedIT's (r = 8) scale and fig4b's scale grows with r; with a fixed alpha it is alpha / k for all.

The figures run on SST-2 only; Table 5.1 on SST-2 and AG News. Every set is split over 20 devices
with Dirichlet(0.5) label skew. Identical configs are run once and shared between experiments
(e.g. fig4b's r = 64 point is fig4c's k/r = 0.125 point). A run whose ``summary.json`` exists is
skipped, so an interrupted suite resumes where it stopped. Runs go to a pool of ``--workers``
processes (default 2, one torch thread each).

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data \\
        .venv/bin/python benchmarks/fslora/run_suite.py [--only table51,fig3] [--seeds 0,1] [--quick]
    ... --plan           # the runs and the time estimate, nothing run
    ... --calibrate      # measure step / evaluation / per-run costs here first (about 2 minutes)
    ... --report-only    # rewrite the markdown and plots from the run folders that exist

``--quick`` is a smoke test (tiny-bert, 2 rounds, a few hundred examples) written to
``benchmarks/results/_scratch/fslora-quick/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # inherited by the spawned workers before torch loads
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=FutureWarning)

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fedtune.config import RunConfig, load_config  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "fslora"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "fslora-quick"
EXPERIMENTS = ["table51", "fig3", "fig4b", "fig4c", "fig7", "horizon", "alpha"]  # also the order that owns shared runs
METHODS = ["fedit", "fslora", "heterolora", "flexlora", "fedstacklora"]
HETERO_RATIOS = [0.125, 0.25, 0.5, 0.75]  # paper Sec. 5.2: k_i / r drawn per device from this set

# Training settings shared by every run of every method (paper Table A.1 where it applies).
DIRICHLET_ALPHA = 0.5
LR = 1e-3  # paper 5e-4 (Table A.1) is for 200 x 50 steps; at ~1% of them 5e-4 left FedIT/FSLoRA at chance (pilot)
BATCH = 16
DROPOUT = 0.1
ALPHA_PER_RANK = 2.0  # lora_alpha = 2 r at every global rank (configs/*.toml: alpha / r = 2)
TARGETS = ["query", "value"]

# Each method's options, as in its recipe configs/<method>.toml (the methods' defaults).
METHOD_OPTIONS = {
    "fedit": {"weighting": "examples"},
    "fslora": {"weighting": "uniform", "download": "dense", "per_module_sketch": False},
    "heterolora": {"weighting": "uniform", "padding": "zeros", "scaling": "rank"},
    "flexlora": {"weighting": "examples", "global_model": "svd"},
    "fedstacklora": {"weighting": "examples", "transport": "dense"},
}

MODEL_NOTES = {"minilm": "pretrained all-MiniLM-L6-v2, 6 layers, hidden 384, 22.7M parameters",
               "tiny-bert": "random 2-layer BERT, hidden 32: smoke test only"}

PAPER = {  # Table A.1, RoBERTa & GLUE, and Section 5
    "model": "RoBERTa-base (125M)",
    "rounds": 200,
    "local_steps": 50,
    "devices": 20,
    "seeds": 3,
}


@dataclass(frozen=True)
class Scale:
    """Everything the suite scales down from the paper."""

    model: str = "minilm"
    rounds: int = 24  # R (paper T = 200)
    local_steps: int = 4  # H (paper 50)
    num_clients: int = 20
    clients_per_round: int = 8
    eval_every: int = 6
    max_length: int = 64
    train_samples: dict = field(default_factory=lambda: {"sst2": 20000, "agnews": None})  # None: all
    test_samples: dict = field(default_factory=lambda: {"sst2": None, "agnews": 2000})
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


QUICK = Scale(
    model="tiny-bert", rounds=2, local_steps=2, clients_per_round=4, eval_every=1,
    train_samples={"sst2": 600, "agnews": 600}, test_samples={"sst2": 100, "agnews": 100},
)


# -- run specifications ----------------------------------------------------------------------


@dataclass
class RunSpec:
    experiment: str
    name: str
    overrides: list[str]
    labels: dict[str, Any]
    config: RunConfig | None = None
    key: str = ""
    run_dir: Path | None = None  # canonical folder (another experiment's when shared)
    owner: str = ""  # experiment whose folder holds the run

    @property
    def shared(self) -> bool:
        return self.owner != self.experiment


def q(value: Any) -> str:
    """A TOML value for a ``key=value`` override."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(q(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {q(v)}" for k, v in value.items()) + "}"
    return repr(value)


def common_overrides(scale: Scale, data: str, seed: int, rank: int, rounds: int | None = None,
                     alpha: float | None = None) -> list[str]:
    out = {
        "seed": seed,
        "rounds": rounds or scale.rounds,
        "eval_every": scale.eval_every,
        "data.name": data,
        "data.partition": "dirichlet",
        "data.alpha": DIRICHLET_ALPHA,
        "data.max_length": scale.max_length,
        "model.name": scale.model,
        "model.lora_rank": rank,
        "model.lora_alpha": ALPHA_PER_RANK * rank if alpha is None else alpha,
        "model.lora_dropout": DROPOUT,
        "model.target_modules": TARGETS,
        "train.local_steps": scale.local_steps,
        "train.batch_size": BATCH,
        "train.lr": LR,
        "train.optimizer": "adamw",
        "federation.num_clients": scale.num_clients,
        "federation.clients_per_round": scale.clients_per_round,
    }
    if scale.train_samples.get(data):
        out["data.max_train_samples"] = scale.train_samples[data]
    if scale.test_samples.get(data):
        out["data.max_test_samples"] = scale.test_samples[data]
    return [f"{k}={q(v)}" for k, v in out.items()]


def method_overrides(method: str) -> list[str]:
    return [f"method={q(method)}"] + [f"options.{k}={q(v)}" for k, v in METHOD_OPTIONS[method].items()]


def uniform_profile(ratio: float) -> str:
    return f"federation.profiles={q([{'sketch_ratio': ratio}])}"


def hetero_choices() -> str:
    return f"federation.profile_choices={q({'sketch_ratio': HETERO_RATIOS})}"


def fair_fedit_rank(scale: Scale, seed: int) -> int:
    """min_i k_i of the seed's heterogeneous draw: the largest uniform rank every device affords."""
    from fedtune.federation.profiles import build_profiles
    from fedtune.methods.lora_common import client_rank

    profiles = build_profiles(scale.num_clients, None, {"sketch_ratio": HETERO_RATIOS}, seed)
    return min(client_rank(p, scale.rank) for p in profiles)


def table51_spec(experiment: str, scale: Scale, method: str, data: str, seed: int,
                 rounds: int | None = None, alpha: float | None = None, name: str = "") -> RunSpec:
    """One Table 5.1 run: heterogeneous k_i / r for every method but FedIT (uniform r = min k_i)."""
    rank = fair_fedit_rank(scale, seed) if method == "fedit" else scale.rank
    ov = common_overrides(scale, data, seed, rank, rounds, alpha) + method_overrides(method)
    if method != "fedit":
        ov.append(hetero_choices())
    return RunSpec(experiment, name or f"{method}-{data}-s{seed}", ov,
                   {"method": method, "data": data, "seed": seed, "rank": rank, "rounds": rounds or scale.rounds,
                    "alpha": alpha})


def specs_table51(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [table51_spec("table51", scale, method, data, seed)
            for data in scale.table_data for seed in seeds for method in METHODS]


def specs_horizon(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [table51_spec("horizon", scale, method, data, seed, rounds=scale.horizon_factor * scale.rounds)
            for data in scale.fig_data for seed in seeds for method in scale.horizon_methods]


def fslora_spec(experiment: str, name: str, scale: Scale, data: str, seed: int, rank: int, ratio: float,
                rounds: int | None = None, topk: float | None = None, alpha: float | None = None,
                **labels) -> RunSpec:
    ov = (common_overrides(scale, data, seed, rank, rounds, alpha) + method_overrides("fslora")
          + [uniform_profile(ratio)])
    if topk is not None:
        ov.append(f"federation.upload_topk={q(topk)}")
    return RunSpec(experiment, name, ov, {"method": "fslora", "data": data, "seed": seed, "rank": rank,
                                          "ratio": ratio, "rounds": rounds or scale.rounds, "topk": topk,
                                          "alpha": alpha, **labels})


def specs_fig3(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    out = []
    for data in scale.fig_data:
        for seed in seeds:
            for rank in scale.fig3_ranks:
                # equal per-device upload: the unsketched run uploads 1/ratio times more per round
                short = max(1, round(scale.rounds * scale.fig3_ratio))
                out.append(fslora_spec("fig3", f"r{rank}-nosketch-{data}-s{seed}", scale, data, seed, rank, 1.0,
                                       rounds=short, sketch=False))
                out.append(fslora_spec("fig3", f"r{rank}-sketch{scale.fig3_ratio:g}-{data}-s{seed}", scale, data,
                                       seed, rank, scale.fig3_ratio, sketch=True))
    return out


def specs_fig4b(scale: Scale, seeds: list[int], experiment: str = "fig4b", alpha: float | None = None,
                tag: str = "") -> list[RunSpec]:
    return [
        fslora_spec(experiment, f"{tag}r{rank}-k{scale.fig4b_k}-{data}-s{seed}", scale, data, seed, rank,
                    min(1.0, scale.fig4b_k / rank), alpha=alpha, part="fig4b")
        for data in scale.fig_data for seed in seeds for rank in scale.fig4b_ranks
    ]


def specs_fig4c(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        fslora_spec("fig4c", f"ratio{ratio:g}-{data}-s{seed}", scale, data, seed, scale.rank, ratio)
        for data in scale.fig_data for seed in seeds for ratio in scale.ratios
    ]


def specs_fig7(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    return [
        fslora_spec("fig7", f"topk{scale.topk:g}-ratio{ratio:g}-{data}-s{seed}", scale, data, seed, scale.rank,
                    ratio, topk=scale.topk)
        for data in scale.fig_data for seed in seeds for ratio in scale.ratios
    ]


def specs_alpha(scale: Scale, seeds: list[int]) -> list[RunSpec]:
    """Table 5.1 (figure data sets) and fig4b at ``lora_alpha = scale.fixed_alpha`` for every rank."""
    tag = f"alpha{scale.fixed_alpha:g}-"
    table = [table51_spec("alpha", scale, method, data, seed, alpha=scale.fixed_alpha,
                          name=f"{tag}{method}-{data}-s{seed}")
             for data in scale.fig_data for seed in seeds for method in METHODS]
    for spec in table:
        spec.labels["part"] = "table51"
    return table + specs_fig4b(scale, seeds, "alpha", scale.fixed_alpha, tag)


BUILDERS = {"table51": specs_table51, "fig3": specs_fig3, "fig4b": specs_fig4b, "fig4c": specs_fig4c,
            "fig7": specs_fig7, "horizon": specs_horizon, "alpha": specs_alpha}


def config_key(config: RunConfig) -> str:
    """Identity of a run for deduplication: the whole resolved config but its name and folder."""
    dump = config.model_dump(mode="json", exclude={"name", "output_dir"})
    return hashlib.sha1(json.dumps(dump, sort_keys=True).encode()).hexdigest()[:16]


def build_plan(scale: Scale, seeds: list[int], out: Path) -> dict[str, list[RunSpec]]:
    """Every experiment's specs (all five, so that which folder owns a shared run never depends
    on ``--only``), each resolved to its config and canonical run folder."""
    plan: dict[str, list[RunSpec]] = {}
    owners: dict[str, RunSpec] = {}
    for exp in EXPERIMENTS:
        plan[exp] = []
        for spec in BUILDERS[exp](scale, seeds):
            base = load_config(None, spec.overrides)
            spec.key = config_key(base)
            if spec.key in owners:
                first = owners[spec.key]
                spec.config, spec.run_dir, spec.owner = first.config, first.run_dir, first.owner
            else:
                spec.owner = exp
                spec.config = load_config(None, spec.overrides + [f"name={q(spec.name)}",
                                                                  f"output_dir={q(str(out / 'runs' / exp))}"])
                spec.run_dir = out / "runs" / exp / spec.name
                owners[spec.key] = spec
            plan[exp].append(spec)
    return plan


def check_methods(plan: dict[str, list[RunSpec]], selected: list[str]) -> list[str]:
    """Validate each selected config against its method (registered, options valid)."""
    from fedtune.config import ConfigError
    from fedtune.runtime import RunContext

    problems = []
    for exp in selected:
        for spec in plan[exp]:
            try:
                RunContext(spec.config)  # resolves the method, its options and the profiles; loads nothing
            except (ConfigError, ValueError) as exc:
                problems.append(f"{exp}/{spec.name}: {exc}")
    return problems


# -- cost model and calibration ---------------------------------------------------------------

# What --calibrate measured on the 2-core VM (one torch thread, CPU seconds; load average ~3 from
# other jobs), used when <out>/calibration.json is absent.
DEFAULT_CALIBRATION = {
    "minilm": {
        "sst2": {"step_s": 0.189, "eval_s_per_example": 0.0091, "run_setup_s": 1.7},
        "agnews": {"step_s": 0.534, "eval_s_per_example": 0.0150, "run_setup_s": 5.1},
        "method_client_overhead_s": {"fedit": 0.17, "fslora": 0.16, "heterolora": 0.35, "flexlora": 0.26,
                                     "fedstacklora": 0.35},
    },
}


def load_calibration(out: Path) -> tuple[dict, str]:
    path = out / "calibration.json"
    if path.is_file():
        return json.loads(path.read_text()), str(path.relative_to(REPO))
    return DEFAULT_CALIBRATION, "built-in defaults (measured for minilm; run --calibrate)"


def eval_rounds(rounds: int, every: int) -> int:
    return len({r for r in range(1, rounds + 1) if r % every == 0} | {rounds})


def test_size(config: RunConfig) -> int:
    full = {"sst2": 872, "agnews": 7600}.get(config.data.name, 2000)
    return min(full, config.data.max_test_samples or full)


def estimate_s(config: RunConfig, calibration: dict, clock: str = "cpu") -> float:
    """Seconds one run takes on one free core, from the calibration (``clock``: cpu or wall)."""
    model = calibration.get(config.model.name) or calibration.get("minilm") or DEFAULT_CALIBRATION["minilm"]
    data = model.get(config.data.name) or model["sst2"]
    suffix = "" if clock == "cpu" else "_wall"
    step = data.get("step_s" + suffix, data["step_s"])
    per_example = data.get("eval_s_per_example" + suffix, data["eval_s_per_example"])
    setup = data.get("run_setup_s" + suffix, data["run_setup_s"])
    overhead = model["method_client_overhead_s"].get(config.method, 0.1)
    fed = config.federation
    client_rounds = config.rounds * fed.sample_size()
    train = client_rounds * (config.train.local_steps * step + overhead)
    evals = eval_rounds(config.rounds, config.eval_every) * test_size(config) * per_example
    return setup + train + evals


def calibrate(scale: Scale, out: Path) -> dict:
    """Measure, with one torch thread: one local step (batch 16, max_length 64) at ranks 8 and 64,
    one evaluation pass, a run's setup (two model loads, tokenization), and each method's
    per-client overhead beyond its training steps (mini runs). Writes ``calibration.json``."""
    import tempfile

    _init_worker()  # one torch thread, quiet transformers
    from fedtune.models.training import evaluate_model, train_local
    from fedtune.run import run_experiment
    from fedtune.runtime import RunContext

    def timed(fn):
        w, c = time.perf_counter(), time.process_time()
        value = fn()
        return value, time.perf_counter() - w, time.process_time() - c

    result: dict[str, Any] = {}
    for data in sorted(set(scale.table_data) | set(scale.fig_data)):
        config = load_config(None, common_overrides(scale, data, 0, scale.rank) + method_overrides("fslora")
                             + [hetero_choices()])

        def setup(config=config):
            a, b = RunContext(config), RunContext(config)
            a.workspace, a.train, a.test, b.workspace, b.test  # noqa: B018 - load and tokenize
            return a

        ctx, setup_w, setup_c = timed(setup)
        steps = 10
        step_w, step_c = [], []
        for rank in (8, scale.rank):
            params = list(ctx.workspace.activate(rank).values())
            cfg = config.train.model_copy(update={"local_steps": 2})
            train_local(ctx.workspace.model, params, ctx.train, ctx.partitions[0], cfg, 1)  # warm-up
            cfg = config.train.model_copy(update={"local_steps": steps})
            _, w, c = timed(lambda: train_local(ctx.workspace.model, params, ctx.train, ctx.partitions[0], cfg, 2))
            step_w.append(w / steps)
            step_c.append(c / steps)
        _, eval_w, eval_c = timed(lambda: evaluate_model(ctx.workspace.model, ctx.test, config.train.eval_batch_size))
        n = len(ctx.test)
        result[data] = {
            "step_s": sum(step_c) / len(step_c), "step_s_wall": sum(step_w) / len(step_w),
            "eval_s_per_example": eval_c / n, "eval_s_per_example_wall": eval_w / n, "eval_examples": n,
            "eval_pass_s": eval_c, "eval_pass_s_wall": eval_w,
            "run_setup_s": setup_c, "run_setup_s_wall": setup_w,
        }
        print(f"calibration {data}: step {result[data]['step_s']:.3f} s (wall {result[data]['step_s_wall']:.3f}), "
              f"eval pass over {n} {eval_c:.1f} s (wall {eval_w:.1f}), run setup {setup_c:.1f} s", flush=True)
        del ctx

    # per-client overhead of each method beyond its steps: mini runs on the first data set, rounds 1-2
    data = sorted(result)[0]
    step = result[data]["step_s_wall"]
    overhead = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            rank = 8 if method == "fedit" else scale.rank
            ov = common_overrides(scale, data, 0, rank, rounds=3) + method_overrides(method)
            ov += [] if method == "fedit" else [hetero_choices()]
            ov += ["train.local_steps=2", "federation.clients_per_round=3", "eval_every=3",
                   "data.max_test_samples=16", f"output_dir={q(tmp)}", f"name={q(method)}"]
            records = []
            run_experiment(load_config(None, ov), on_round=records.append)
            per_client = [r.wall_s / len(r.clients) - 2 * step for r in records[:2]]
            overhead[method] = max(0.0, sum(per_client) / len(per_client))
            print(f"calibration {method}: {overhead[method]:.3f} s per client and round beyond its steps", flush=True)
    calibration = {scale.model: {**result, "method_client_overhead_s": overhead},
                   "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": 1,
                   "loadavg_1min": os.getloadavg()[0], "cpu_count": os.cpu_count()}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "calibration.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    previous.update(calibration)
    path.write_text(json.dumps(previous, indent=2) + "\n")
    return previous


def makespan(costs: list[float], workers: int) -> float:
    """Longest-processing-time-first schedule length over ``workers``."""
    loads = [0.0] * max(1, workers)
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads) if costs else 0.0


# -- running --------------------------------------------------------------------------------


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - logging niceties only
        pass


def _run_one(overrides: list[str]) -> tuple[dict | None, str | None, float]:
    """Worker: one run from its overrides; (summary, error, seconds)."""
    start = time.perf_counter()
    try:
        from fedtune.run import run_experiment

        config = load_config(None, overrides)
        # a stale summary must not outlive the config.toml the new run writes first
        (Path(config.output_dir) / config.run_name / "summary.json").unlink(missing_ok=True)
        summary = run_experiment(config)
        return summary, None, time.perf_counter() - start
    except Exception:
        return None, traceback.format_exc(limit=8), time.perf_counter() - start


def run_pending(pending: list[RunSpec], costs: dict[str, float], workers: int) -> tuple[list[str], bool]:
    """Run the specs (longest first) in a spawned pool; print progress. Returns the failures and
    whether the suite was interrupted (Ctrl-C: finished runs are kept, rerun to resume)."""
    failures: list[str] = []
    if not pending:
        return failures, False
    total, start, done = len(pending), time.perf_counter(), 0
    remaining = sum(costs[s.key] for s in pending)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), initializer=_init_worker)
    futures = {}
    try:
        for spec in sorted(pending, key=lambda s: -costs[s.key]):
            overrides = spec.overrides + [f"name={q(spec.config.name)}", f"output_dir={q(spec.config.output_dir)}"]
            futures[pool.submit(_run_one, overrides)] = spec
        waiting = set(futures)
        while waiting:
            finished, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            for fut in finished:
                spec = futures[fut]
                try:
                    summary, error, seconds = fut.result()
                except Exception as exc:  # a worker died (killed, out of memory): the pool is broken
                    summary, error, seconds = None, f"{type(exc).__name__}: {exc}", 0.0
                done += 1
                remaining -= costs[spec.key]
                elapsed = time.perf_counter() - start
                where = f"{spec.owner}/{spec.config.name}"
                if error is None:
                    acc = summary.get("final_accuracy")
                    acc_s = "–" if acc is None else f"{acc:.4f}"
                    print(f"[{done}/{total}] {where}  acc {acc_s}  {seconds:.0f} s  "
                          f"(elapsed {elapsed / 60:.1f} min, ~{max(0.0, remaining) / workers / 60:.0f} min of estimate left)",
                          flush=True)
                else:
                    failures.append(f"{where}: {error.strip().splitlines()[-1]}")
                    print(f"[{done}/{total}] {where}  FAILED after {seconds:.0f} s\n{error}", flush=True)
    except KeyboardInterrupt:
        print(f"\ninterrupted after {done}/{total} runs; finished runs are kept: rerun the same command to resume",
              flush=True)
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()  # the runs in flight restart from scratch next time
            proc.join(timeout=10)
        return failures, True
    pool.shutdown(wait=True)
    return failures, False


# -- reports ---------------------------------------------------------------------------------


def run_state(spec: RunSpec) -> str:
    """``done`` (summary.json of this very config), ``stale`` (a finished run of another config
    under the same name: rerun, overwritten) or ``todo``."""
    try:
        json.loads((spec.run_dir / "summary.json").read_text())
    except (OSError, ValueError):  # absent, or cut short by a kill
        return "todo"
    import tomllib

    try:
        saved = RunConfig.model_validate(tomllib.loads((spec.run_dir / "config.toml").read_text()))
    except Exception:
        return "stale"
    return "done" if config_key(saved) == spec.key else "stale"


def load_summary(spec: RunSpec) -> dict | None:
    """The run's summary, or None unless it is done with this spec's config."""
    if run_state(spec) != "done":
        return None
    return json.loads((spec.run_dir / "summary.json").read_text())


def load_rounds(spec: RunSpec) -> list[dict]:
    path = spec.run_dir / "metrics.jsonl"
    if not path.is_file() or load_summary(spec) is None:
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (ddof = 1; 0 for one value)."""
    if not values:
        return None, None
    m = sum(values) / len(values)
    if len(values) == 1:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def pct(values: list[float]) -> str:
    m, s = mean_std([100 * v for v in values if v is not None])
    return "pending" if m is None else f"{m:.2f} ± {s:.2f}"


def mean_of(values: list[float], spec: str = ".2f") -> str:
    vals = [v for v in values if v is not None]
    return "–" if not vals else format(sum(vals) / len(vals), spec)


def per_device_mb(spec: RunSpec, summary: dict) -> float:
    return summary["total_bytes_up"] / 1e6 / spec.config.federation.num_clients


def curve(spec: RunSpec) -> list[tuple[int, float, float]]:
    """(round, cumulative per-device upload MB, accuracy) at the evaluated rounds."""
    total, pts = 0, []
    n = spec.config.federation.num_clients
    for r in load_rounds(spec):
        total += r.get("bytes_up") or 0
        if r.get("accuracy") is not None:
            pts.append((r["round"], total / 1e6 / n, r["accuracy"]))
    return pts


def mean_curve(specs: list[RunSpec]) -> list[tuple[float, float, float]]:
    """Seed-averaged curve over the rounds every finished run evaluated: (round, MB, accuracy)."""
    curves = [curve(s) for s in specs]
    curves = [c for c in curves if c]
    if not curves:
        return []
    rounds = sorted(set.intersection(*[{p[0] for p in c} for c in curves]))
    out = []
    for rnd in rounds:
        pts = [next(p for p in c if p[0] == rnd) for c in curves]
        out.append((rnd, sum(p[1] for p in pts) / len(pts), sum(p[2] for p in pts) / len(pts)))
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def figure(path: Path, *args, **kwargs):
    """``plt.subplots(*args, **kwargs)`` as ``(fig, axes)``, saved to ``path`` on success and closed."""
    plt = _plt()
    fig, axes = plt.subplots(*args, **kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def scale_section(scale: Scale, seeds: list[int], data_sets: tuple, command: str, extra: list[str]) -> str:
    train = ", ".join(f"{d}: {scale.train_samples.get(d) or 'all'}" for d in data_sets)
    test = ", ".join(f"{d}: {scale.test_samples.get(d) or 'all'}" for d in data_sets)
    lines = [
        "Produced by",
        "",
        "```bash",
        command,
        "```",
        "",
        "| | paper (RoBERTa & GLUE, Table A.1 / Sec. 5) | here |",
        "|---|---|---|",
        f"| model | {PAPER['model']} | `{scale.model}` ({MODEL_NOTES.get(scale.model, 'see fedtune.models.loading')}) |",
        f"| LoRA | targets query/value + head, dropout 0.1, alpha not stated | query/value + classifier head, dropout {DROPOUT}, lora_alpha = {ALPHA_PER_RANK:g} r |",
        f"| devices | {PAPER['devices']} | {scale.num_clients}, Dirichlet(alpha = {DIRICHLET_ALPHA}) label skew |",
        f"| devices per round | all | {scale.clients_per_round} sampled uniformly per round |",
        f"| rounds T | {PAPER['rounds']} | {scale.rounds} |",
        f"| local steps H | {PAPER['local_steps']} | {scale.local_steps} |",
        f"| batch, optimizer, lr | 16, not stated (Algorithm 1 writes plain SGD steps), 5e-4 | {BATCH}, AdamW "
        f"(fresh state each round), {LR:g} (below) |",
        f"| training examples | full GLUE task | {train} (max_length {scale.max_length}) |",
        f"| test examples | GLUE dev | {test} (SST-2 test = the 872-sentence GLUE dev set) |",
        f"| evaluation | – | every {scale.eval_every} rounds and the last |",
        f"| seeds | {PAPER['seeds']} | {', '.join(map(str, seeds))} |",
        "",
        "Every method and run uses these same training settings (nothing is tuned per method); "
        "accuracies are mean ± sample std (ddof 1) over the seeds. The seed fixes the partition, the "
        "device sampling, the per-device ratios, the sketches and the data order.",
        "",
        f"Learning rate {LR:g} rather than the paper's 5e-4: the suite runs about 1 % of the paper's "
        f"sequential local steps (R x H = {scale.rounds * scale.local_steps} vs 200 x 50). In a pilot on "
        "SST-2 at 5e-4 (8 rounds x 5 steps, 10 of 20 devices per round) FedIT (r = 8) and FSLoRA were "
        "still at chance (51-52 %); at 1e-3 (24 rounds x 4 steps, 8 devices per round) FSLoRA reached "
        "71 % and HeteroLoRA 66 %. 1e-3 is used for every method and run. Plain SGD (Algorithm 1's update) "
        "at lr 0.02 and 0.1 left the k = r = 8 configuration at chance after 20 rounds (50.92 %, 51.83 %; "
        "seed 0, one run each), so every run uses AdamW.",
    ]
    return "\n".join(lines + ([""] + extra if extra else [])) + "\n"


def runs_section(specs: list[RunSpec], out: Path) -> str:
    lines = ["## Runs", "", "| run | folder | final acc (%) | rounds | MB up / device | wall s |", "|---|---|---|---|---|---|"]
    for spec in specs:
        s = load_summary(spec)
        folder = os.path.relpath(spec.run_dir, out)
        shared = f" (shared with {spec.owner})" if spec.shared else ""
        if s is None:
            lines.append(f"| {spec.name} | `{folder}`{shared} | pending | {spec.config.rounds} | – | – |")
            continue
        acc = "–" if s.get("final_accuracy") is None else f"{100 * s['final_accuracy']:.2f}"
        lines.append(f"| {spec.name} | `{folder}`{shared} | {acc} | {s['rounds']} | "
                     f"{per_device_mb(spec, s):.3f} | {s['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def report_table51(specs: list[RunSpec], scale: Scale, seeds: list[int], head: str, out: Path) -> str:
    data_sets = [d for d in scale.table_data if any(s.labels["data"] == d for s in specs)]
    lines = ["# Table 5.1 (CPU scale): heterogeneous LoRA methods", "",
             f"Global rank r = {scale.rank}; each device's k_i / r is drawn (with the seed) from "
             f"{{{', '.join(f'{r:g}' for r in HETERO_RATIOS)}}} (paper Sec. 5.2); HeteroLoRA, FlexLoRA and "
             "FedStackLoRA give device i the rank r_i = k_i of the same draw (`federation.profile_choices`).", "",
             "**FedIT rank.** FedIT needs one rank for every device. The fair choice under the same device "
             "budgets is the largest rank *every* device can afford, r = min_i k_i (= "
             + ", ".join(f"{fair_fedit_rank(scale, s)} for seed {s}" for s in seeds)
             + "; lora_alpha = 2 r): no device then uploads or computes more than its k_i allows. "
             f"FedIT at r = {scale.rank} would give the small devices up to {int(1 / min(HETERO_RATIOS))}x "
             "their budget (an upper reference, not a competitor under heterogeneous resources).", "",
             head, "## Results", ""]
    cols = ["Method"]
    for d in data_sets:
        cols += [f"{d} acc (%)", f"{d} MB up", f"{d} MB down", f"{d} client compute s"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for method in METHODS:
        row = [method + (" (r = min k_i)" if method == "fedit" else "")]
        for d in data_sets:
            group = [s for s in specs if s.labels["method"] == method and s.labels["data"] == d]
            sums = [load_summary(s) for s in group]
            sums = [x for x in sums if x is not None]
            n = f" (n={len(sums)})" if len(sums) not in (0, len(group)) else ""
            row += [pct([x["final_accuracy"] for x in sums]) + n,
                    mean_of([x["total_bytes_up"] / 1e6 for x in sums], ".1f"),
                    mean_of([x["total_bytes_down"] / 1e6 for x in sums], ".1f"),
                    mean_of([x["total_compute_s"] for x in sums], ".0f")]
        lines.append("| " + " | ".join(row) + " |")
    majority = {}
    for d in data_sets:
        vals = [load_summary(s) for s in specs if s.labels["data"] == d]
        vals = [v["majority_accuracy"] for v in vals if v]
        majority[d] = f"{100 * vals[0]:.2f}" if vals else "–"
    lines += ["", "Majority-class accuracy of the test sets: "
              + ", ".join(f"{d} {majority[d]} %" for d in data_sets) + ".",
              "MB up / down: totals over all devices and rounds (mean over seeds), the bytes of the encoded "
              "messages. Client compute s: summed wall seconds of the client fit calls (`total_compute_s`), "
              "measured with two runs sharing two cores, so only rough ratios between methods are meaningful.",
              "", "![accuracy vs round](table51.png)", ""]
    with figure(out / "table51.png", 1, len(data_sets), figsize=(5.5 * len(data_sets), 4), squeeze=False) as (fig, axes):
        for ax, d in zip(axes[0], data_sets):
            for method in METHODS:
                pts = mean_curve([s for s in specs if s.labels["method"] == method and s.labels["data"] == d])
                if pts:
                    ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], marker="o", ms=3, label=method)
            if majority[d] != "–":
                ax.axhline(float(majority[d]), color="gray", ls=":", lw=1, label="majority class")
            ax.set(title=f"{d}: accuracy vs round (mean over seeds)", xlabel="round", ylabel="accuracy (%)")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def _final(specs: list[RunSpec]) -> tuple[float | None, float | None, int]:
    sums = [load_summary(s) for s in specs]
    accs = [100 * x["final_accuracy"] for x in sums if x and x.get("final_accuracy") is not None]
    m, s = mean_std(accs)
    return m, s, len(accs)


def _cell(specs: list[RunSpec]) -> str:
    m, s, n = _final(specs)
    return "pending" if m is None else f"{m:.2f} ± {s:.2f}" + (f" (n={n})" if n != len(specs) else "")


def _mb(specs: list[RunSpec]) -> str:
    vals = [per_device_mb(s, x) for s in specs if (x := load_summary(s))]
    return mean_of(vals, ".3f")


def report_fig3(specs: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
    ranks = list(scale.fig3_ranks)
    lines = ["# Figure 3 (CPU scale): FSLoRA with vs without sketching at an equal upload budget", "",
             f"Uniform k/r = {scale.fig3_ratio:g} (sketch) vs k/r = 1 (no sketch: FSLoRA is then FedIT with "
             "eq. (5)'s uniform weights). The paper fixes each device's upload budget at 100x the full "
             "global LoRA modules at rank r; here the unsketched run gets "
             f"{max(1, round(scale.rounds * scale.fig3_ratio))} rounds and the sketched run {scale.rounds}, so "
             f"with {scale.clients_per_round} of {scale.num_clients} devices per round each device uploads, in "
             f"expectation, {max(1, round(scale.rounds * scale.fig3_ratio)) * scale.clients_per_round / scale.num_clients:g}x "
             "the full global LoRA modules (plus the head) in both runs. The measured per-device MB are in the table.", "",
             head, "## Results", "",
             "| r | no sketch acc (%) | no sketch MB up / device | sketch acc (%) | sketch MB up / device |",
             "|---|---|---|---|---|"]
    data = scale.fig_data[0]
    for r in ranks:
        no = [s for s in specs if s.labels["rank"] == r and not s.labels["sketch"] and s.labels["data"] == data]
        yes = [s for s in specs if s.labels["rank"] == r and s.labels["sketch"] and s.labels["data"] == data]
        lines.append(f"| {r} | {_cell(no)} | {_mb(no)} | {_cell(yes)} | {_mb(yes)} |")
    lines += ["", f"Data: {', '.join(scale.fig_data)} only.", "", "![fig3](fig3.png)", ""]
    with figure(out / "fig3.png", 1, 2, figsize=(11, 4)) as (fig, (ax1, ax2)):
        width = 0.38
        for j, (sketch, label) in enumerate([(False, "w/o sketching (k/r = 1)"),
                                             (True, f"w/ sketching (k/r = {scale.fig3_ratio:g})")]):
            ms, ss = [], []
            for r in ranks:
                m, s, _ = _final([x for x in specs if x.labels["rank"] == r and x.labels["sketch"] == sketch
                                  and x.labels["data"] == data])
                ms.append(m or 0.0)
                ss.append(s or 0.0)
            ax1.bar([i + (j - 0.5) * width for i in range(len(ranks))], ms, width, yerr=ss, capsize=3, label=label)
        ax1.set_xticks(range(len(ranks)), [f"r = {r}" for r in ranks])
        ax1.set(title=f"{data}: final accuracy at equal upload budget", ylabel="accuracy (%)")
        lo = [(_final([x for x in specs if x.labels["data"] == data])[0] or 50) - 15]
        ax1.set_ylim(max(0, min(lo)), None)
        ax1.legend(fontsize=8)
        ax1.grid(alpha=0.3, axis="y")
        for r in ranks:
            for sketch, style in [(False, "--"), (True, "-")]:
                pts = mean_curve([x for x in specs if x.labels["rank"] == r and x.labels["sketch"] == sketch
                                  and x.labels["data"] == data])
                if pts:
                    ax2.plot([p[1] for p in pts], [100 * p[2] for p in pts], style, marker="o", ms=3,
                             label=f"r = {r}, " + ("sketch" if sketch else "no sketch"))
        ax2.set(title="accuracy vs per-device upload (mean over seeds)", xlabel="MB uploaded per device",
                ylabel="accuracy (%)")
        ax2.grid(alpha=0.3)
        if ax2.get_legend_handles_labels()[0]:
            ax2.legend(fontsize=8)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def sweep_report(exp: str, title: str, intro: str, specs: list[RunSpec], scale: Scale, head: str, out: Path,
                 label: str, xs: tuple, columns: list[str], cells, xlabel: str, plot_title: str) -> str:
    """An FSLoRA sweep over ``labels[label] in xs`` (fig data set): a table with ``columns`` (from
    ``cells(x)``) plus final accuracy and MB up per device, and final accuracy vs x (log2 axis)."""
    data = scale.fig_data[0]
    groups = [[s for s in specs if s.labels[label] == x and s.labels["data"] == data] for x in xs]
    cols = columns + ["final acc (%)", "MB up / device"]
    lines = [title, "", intro, "", head, "## Results", "",
             "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for x, g in zip(xs, groups):
        lines.append("| " + " | ".join([*cells(x), _cell(g), _mb(g)]) + " |")
    lines += ["", f"Data: {', '.join(scale.fig_data)} only.", "", f"![{exp}]({exp}.png)", ""]
    with figure(out / f"{exp}.png", figsize=(5.5, 4)) as (fig, ax):
        pts = [(x, *_final(g)[:2]) for x, g in zip(xs, groups)]
        pts = [p for p in pts if p[1] is not None]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
        ax.set(title=plot_title, xlabel=xlabel, ylabel="final accuracy (%)")
        ax.grid(alpha=0.3)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig4b(specs: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
    k = scale.fig4b_k
    intro = (f"FSLoRA with every device updating k = {k} ranks (uniform k/r = {k}/r, "
             "`federation.profiles = [{sketch_ratio = k/r}]`): each device's upload and compute stay those of "
             f"a rank-{k} adapter while the global rank grows. r = {k} is k/r = 1 "
             "(no sketching; the paper's Figure 6 reference point). lora_alpha = 2 r at every r.")
    return sweep_report("fig4b", "# Figure 4(b) (CPU scale): global rank r at a fixed k", intro, specs, scale, head,
                        out, "rank", scale.fig4b_ranks, ["r", "k/r"], lambda r: [str(r), f"{min(1.0, k / r):g}"],
                        "global rank r", f"{scale.fig_data[0]}: FSLoRA, k = {k}")


def report_fig4c(specs: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
    intro = (f"FSLoRA, global rank r = {scale.rank}, uniform k/r for every device "
             "(`federation.profiles = [{sketch_ratio = k/r}]`); k/r = 1 is no sketching.")
    return sweep_report("fig4c", f"# Figure 4(c) (CPU scale): sketching ratio at r = {scale.rank}", intro, specs,
                        scale, head, out, "ratio", scale.ratios, ["k/r", "k"],
                        lambda x: [f"{x:g}", str(round(x * scale.rank))],
                        "sketching ratio k/r", f"{scale.fig_data[0]}: FSLoRA, r = {scale.rank}")


def report_fig7(specs: list[RunSpec], ref: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
    data = scale.fig_data[0]
    lines = ["# Figure 7 (CPU scale): top-k compression with and without sketching", "",
             f"FSLoRA at r = {scale.rank}, uniform k/r, every upload top-k sparsified "
             f"(`federation.upload_topk = {scale.topk:g}`: each uploaded array keeps its {scale.topk:g} "
             "largest-magnitude entries); k/r = 1 is top-k without sketching. The dashed reference curves "
             "are fig4c's runs (same configs, no top-k). x: cumulative upload per device (all devices' "
             "bytes / number of devices).", ""]
    if scale.topk >= 0.5:
        lines += [f"**Bytes.** fedtune sends a top-k array as int32 indices + float32 values, so keeping "
                  f"{scale.topk:g} of the entries costs {2 * scale.topk:g}x the dense bytes: at 0.5 top-k "
                  "saves nothing on the wire here (the paper's 'compression ratio 0.5' reads as half the "
                  "communication). Run with `--topk 0.25` for a byte compression of 0.5.", ""]
    lines += [head, "## Results", "",
              "| k/r | top-k acc (%) | top-k MB up / device | no top-k acc (%) | no top-k MB up / device |",
              "|---|---|---|---|---|"]
    for x in scale.ratios:
        g = [s for s in specs if s.labels["ratio"] == x and s.labels["data"] == data]
        r = [s for s in ref if s.labels["ratio"] == x and s.labels["data"] == data]
        lines.append(f"| {x:g} | {_cell(g)} | {_mb(g)} | {_cell(r)} | {_mb(r)} |")
    lines += ["", f"Data: {', '.join(scale.fig_data)} only.", "", "![fig7](fig7.png)", ""]
    with figure(out / "fig7.png", figsize=(6.5, 4.5)) as (fig, ax):
        colors = _plt().rcParams["axes.prop_cycle"].by_key()["color"]
        for i, x in enumerate(scale.ratios):
            for group, style, tag in [(specs, "-", f"top-k {scale.topk:g}"), (ref, "--", "no top-k")]:
                pts = mean_curve([s for s in group if s.labels["ratio"] == x and s.labels["data"] == data])
                if pts:
                    ax.plot([p[1] for p in pts], [100 * p[2] for p in pts], style, marker="o", ms=3,
                            color=colors[i % len(colors)],
                            label=f"k/r = {x:g}" + (" (no sketch)" if x == 1 else "") + f", {tag}")
        ax.set(title=f"{data}: accuracy vs per-device upload (r = {scale.rank})", xlabel="MB uploaded per device",
               ylabel="accuracy (%)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return "\n".join(lines) + "\n" + runs_section(specs + [s for s in ref if s.labels["data"] == data], out)


def report_horizon(specs: list[RunSpec], table51: list[RunSpec], scale: Scale, head: str, out: Path) -> str:
    data = scale.fig_data[0]
    methods = list(scale.horizon_methods)
    rounds = scale.horizon_factor * scale.rounds
    lines = [f"# Longer horizon (not in the paper): Table 5.1's {' and '.join(methods)} runs to {rounds} rounds", "",
             f"Table 5.1 stops at R = {scale.rounds} rounds, about 1 % of the paper's 200 x 50 local steps. These "
             f"runs continue the very same {data} configurations (same seeds, devices, sketches and data order) "
             f"to {scale.horizon_factor} R = {rounds} rounds, to see whether the gap between the methods closes "
             "with more training. Nothing else changes, so the accuracy at round R must equal Table 5.1's final "
             "accuracy; the last column checks that.", "", head, "## Results", ""]
    evals = sorted(set.intersection(*[{p[0] for p in curve(s)} for s in specs]) if all(curve(s) for s in specs)
                   else set())
    cols = ["method"] + [f"acc @ {r} (%)" for r in evals] + ["MB up / device", f"round {scale.rounds} = Table 5.1?"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for method in methods:
        group = [s for s in specs if s.labels["method"] == method and s.labels["data"] == data]
        row = [method + (" (r = min k_i)" if method == "fedit" else "")]
        for r in evals:
            row.append(pct([next(p[2] for p in curve(s) if p[0] == r) for s in group]))
        checks = []
        for s in group:
            ref = next((t for t in table51 if t.labels["method"] == method and t.labels["data"] == data
                        and t.labels["seed"] == s.labels["seed"]), None)
            here = next((p[2] for p in curve(s) if p[0] == scale.rounds), None)
            there = (load_summary(ref) or {}).get("final_accuracy") if ref else None
            if here is None or there is None:
                checks.append(f"s{s.labels['seed']}: –")
            else:
                checks.append(f"s{s.labels['seed']}: " + ("yes" if here == there else f"no ({100 * here:.2f} vs {100 * there:.2f})"))
        row += [_mb(group), ", ".join(checks)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Accuracy: mean ± sample std over the seeds at each evaluated round. MB up / device: the "
              f"whole {rounds} rounds.", "", "![horizon](horizon.png)", ""]
    with figure(out / "horizon.png", figsize=(6, 4)) as (fig, ax):
        for method in methods:
            pts = mean_curve([s for s in specs if s.labels["method"] == method and s.labels["data"] == data])
            if pts:
                ax.plot([p[0] for p in pts], [100 * p[2] for p in pts], marker="o", ms=3, label=method)
        ax.axvline(scale.rounds, color="gray", ls=":", lw=1, label=f"Table 5.1 stops (R = {scale.rounds})")
        ax.set(title=f"{data}: accuracy vs round (mean over seeds)", xlabel="round", ylabel="accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_alpha(specs: list[RunSpec], plan: dict[str, list[RunSpec]], scale: Scale, head: str, out: Path) -> str:
    data = scale.fig_data[0]
    a = scale.fixed_alpha
    k = scale.fig4b_k
    table = [s for s in specs if s.labels["part"] == "table51" and s.labels["data"] == data]
    sweep = [s for s in specs if s.labels["part"] == "fig4b" and s.labels["data"] == data]
    ref_table = [s for s in plan["table51"] if s.labels["data"] == data]
    ref_sweep = [s for s in plan["fig4b"] if s.labels["data"] == data]

    def of(group: list[RunSpec], **match) -> list[RunSpec]:
        return [s for s in group if all(s.labels[key] == v for key, v in match.items())]

    lines = [f"# LoRA scaling (not in the paper): lora_alpha = 2 r vs a fixed lora_alpha = {a:g}", "",
             "The paper does not state lora_alpha. The suite's main runs use lora_alpha = 2 r. PEFT scales a "
             "rank-k adapter by alpha / k, which for a device that trains k of the r global ranks is exactly "
             "FSLoRA's (alpha / r)(r / k), and HeteroLoRA, FlexLoRA and FedStackLoRA scale a rank-r_i device by "
             f"alpha / r_i. With alpha = 2 r the scale is 2 r / k: at r = {scale.rank} the devices train at "
             f"{2 * scale.rank / round(max(HETERO_RATIOS) * scale.rank):.3g} to {1 / min(HETERO_RATIOS) * 2:g}, "
             f"while FedIT at r = {k} trains at 2, and in Figure 4(b) the scale grows with r (2 r / {k}). "
             f"With a fixed alpha = {a:g} every device's scale is {a:g} / k_i, the same function of its own "
             f"rank for every method and every global r; FedIT (r = {k}, alpha = {a:g}) and r = {k} in "
             "Figure 4(b) are the same runs in both settings.", "",
             "Same runs otherwise (seeds, devices, sketches, data order, lr); nothing else was tried.", "",
             head, "## Table 5.1 on " + data, "",
             f"| method | alpha = 2 r acc (%) | alpha = {a:g} acc (%) |", "|---|---|---|"]
    for method in METHODS:
        label = method + (" (r = min k_i)" if method == "fedit" else "")
        lines.append(f"| {label} | {_cell(of(ref_table, method=method))} | {_cell(of(table, method=method))} |")
    lines += ["", f"## Figure 4(b): global rank r at k = {k}", "",
              f"| r | k/r | alpha = 2 r: device scale | acc (%) | alpha = {a:g}: device scale | acc (%) |",
              "|---|---|---|---|---|---|"]
    for r in scale.fig4b_ranks:
        kk = min(k, r)
        lines.append(f"| {r} | {kk / r:g} | {2 * r / kk:g} | {_cell(of(ref_sweep, rank=r))} | {a / kk:g} | "
                     f"{_cell(of(sweep, rank=r))} |")
    lines += ["", "Accuracy: final, mean ± sample std over the seeds.", "", "![alpha](alpha.png)", ""]
    with figure(out / "alpha.png", 1, 2, figsize=(11, 4)) as (fig, (ax1, ax2)):
        width = 0.38
        for j, (group, label) in enumerate([(ref_table, "alpha = 2 r"), (table, f"alpha = {a:g}")]):
            ms = [_final(of(group, method=m)) for m in METHODS]
            ax1.bar([i + (j - 0.5) * width for i in range(len(METHODS))], [m[0] or 0.0 for m in ms], width,
                    yerr=[m[1] or 0.0 for m in ms], capsize=3, label=label)
        ax1.set_xticks(range(len(METHODS)), METHODS, fontsize=8)
        ax1.set(title=f"{data}: Table 5.1 methods", ylabel="final accuracy (%)")
        ax1.set_ylim(40, None)
        ax1.grid(alpha=0.3, axis="y")
        ax1.legend(fontsize=8)
        for group, label in [(ref_sweep, "alpha = 2 r"), (sweep, f"alpha = {a:g}")]:
            pts = [(r, *_final(of(group, rank=r))[:2]) for r in scale.fig4b_ranks]
            pts = [pt for pt in pts if pt[1] is not None]
            if pts:
                ax2.errorbar([pt[0] for pt in pts], [pt[1] for pt in pts], yerr=[pt[2] for pt in pts], marker="o",
                             capsize=3, label=label)
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(list(scale.fig4b_ranks), [str(r) for r in scale.fig4b_ranks])
        ax2.set(title=f"{data}: FSLoRA, k = {k}", xlabel="global rank r", ylabel="final accuracy (%)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def write_reports(plan: dict[str, list[RunSpec]], selected: list[str], scale: Scale, seeds: list[int], out: Path,
                  command: str, calibration_note: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for exp in selected:
        data_sets = scale.table_data if exp == "table51" else scale.fig_data
        head = "## Setup\n\n" + scale_section(scale, seeds, data_sets, command, [calibration_note])
        specs = plan[exp]
        if exp == "table51":
            text = report_table51(specs, scale, seeds, head, out)
        elif exp == "fig3":
            text = report_fig3(specs, scale, head, out)
        elif exp == "fig4b":
            text = report_fig4b(specs, scale, head, out)
        elif exp == "fig4c":
            text = report_fig4c(specs, scale, head, out)
        elif exp == "fig7":
            text = report_fig7(specs, plan["fig4c"], scale, head, out)
        elif exp == "horizon":
            text = report_horizon(specs, plan["table51"], scale, head, out)
        else:
            text = report_alpha(specs, plan, scale, head, out)
        path = out / f"{exp}.md"
        path.write_text(text, encoding="utf-8")
        written += [path, out / f"{exp}.png"]
    return written


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(EXPERIMENTS), help=f"comma-separated subset of {','.join(EXPERIMENTS)}")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny-bert, 2 rounds, few examples, scratch folder")
    p.add_argument("--workers", type=int, default=2, help="parallel runs, one torch thread each (default 2)")
    p.add_argument("--budget-minutes", type=float, default=120.0,
                   help="time budget the up-front estimate is checked against (warns when exceeded)")
    p.add_argument("--calibrate", action="store_true", help="measure step/eval/setup costs here first (~2 min)")
    p.add_argument("--plan", action="store_true", help="print the runs and the estimate, run nothing")
    p.add_argument("--report-only", action="store_true", help="only rewrite the markdown and plots")
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results/fslora)")
    p.add_argument("--rounds", type=int, default=None, help="override R (rounds)")
    p.add_argument("--local-steps", type=int, default=None, help="override H (local steps)")
    p.add_argument("--clients-per-round", type=int, default=None, help="override devices sampled per round")
    p.add_argument("--eval-every", type=int, default=None, help="override the evaluation interval (rounds)")
    p.add_argument("--topk", type=float, default=None, help="fig7's federation.upload_topk (default 0.5)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = QUICK if args.quick else Scale()
    for attr, value in [("rounds", args.rounds), ("local_steps", args.local_steps), ("topk", args.topk),
                        ("clients_per_round", args.clients_per_round), ("eval_every", args.eval_every)]:
        if value is not None:
            scale = replace(scale, **{attr: value})
    out = (args.out or (QUICK_RESULTS if args.quick else RESULTS)).resolve()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    selected = [e.strip() for e in args.only.split(",") if e.strip()]
    unknown = [e for e in selected if e not in EXPERIMENTS]
    if unknown or not seeds:
        print(f"--only: unknown {unknown} (expected {EXPERIMENTS})" if unknown else "--seeds: none given")
        return 2
    selected = [e for e in EXPERIMENTS if e in selected]
    if not os.environ.get("FEDTUNE_DATA_DIR"):
        print("warning: FEDTUNE_DATA_DIR is not set (sst2/agnews are read from it)", flush=True)
    command = (f"HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR={shlex.quote(os.environ.get('FEDTUNE_DATA_DIR', '../shared/data'))} "
               ".venv/bin/python benchmarks/fslora/run_suite.py "
               + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
                          if a != "--report-only")).strip()  # the command that runs the suite

    plan = build_plan(scale, seeds, out)
    wanted: dict[str, RunSpec] = {}
    for exp in selected:
        for spec in plan[exp]:
            wanted.setdefault(spec.key, spec)  # a shared spec carries its owner's config and folder
    pending = [s for s in wanted.values() if run_state(s) != "done"]
    stale = [s for s in pending if run_state(s) == "stale"]

    if args.calibrate and not args.report_only:
        print(f"calibrating {scale.model} with one torch thread ...", flush=True)
        calibrate(scale, out)
    calibration, source = load_calibration(out)
    if scale.model not in calibration:
        source += f"; no {scale.model} entry, minilm costs used (an overestimate for tiny-bert)"
    costs = {s.key: estimate_s(s.config, calibration) for s in wanted.values()}
    wall_costs = {s.key: estimate_s(s.config, calibration, "wall") for s in wanted.values()}
    est_all = makespan(list(costs.values()), args.workers) / 60
    est = makespan([costs[s.key] for s in pending], args.workers) / 60
    est_wall = makespan([wall_costs[s.key] for s in pending], args.workers) / 60
    model_cal = calibration.get(scale.model, {})
    steps = ", ".join(f"{d} {v['step_s']:.3f} s" for d, v in model_cal.items() if isinstance(v, dict) and "step_s" in v)
    evals = []
    for d in sorted(set(scale.table_data) | set(scale.fig_data)):
        if isinstance(model_cal.get(d), dict):
            n = test_size(load_config(None, common_overrides(scale, d, 0, 8)))
            evals.append(f"{d} {model_cal[d]['eval_s_per_example'] * n:.1f} s ({n} examples)")
    evals = ", ".join(evals)
    calibration_note = (f"Cost model ({source}): one local step (batch {BATCH}, max_length {scale.max_length}, one "
                        f"thread) {steps or 'uncalibrated'}; one evaluation pass {evals or 'uncalibrated'}. "
                        f"Estimated suite time with {args.workers} workers: {est_all:.0f} min.")

    n_unique = len(wanted)
    n_listed = sum(len(plan[e]) for e in selected)
    print(f"FSLoRA suite: {', '.join(selected)}; seeds {seeds}; model {scale.model}; R={scale.rounds}, "
          f"H={scale.local_steps}, {scale.clients_per_round}/{scale.num_clients} devices per round -> {out}")
    for exp in selected:
        print(f"  {exp}: {len(plan[exp])} runs")
        for spec in plan[exp]:
            state = run_state(spec)
            shared = f" = {spec.owner}/{spec.run_dir.name}" if spec.shared else ""
            print(f"    [{state}] {spec.name}{shared}  (~{costs[spec.key] / 60:.1f} min)")
    print(f"{n_listed} runs listed, {n_unique} distinct configs, {len(pending)} to run"
          + (f" ({len(stale)} stale: finished with another config, will be overwritten)" if stale else "") + ".")
    print(f"calibration: {source}; {steps}")
    print(f"estimate: {est:.0f} min for the pending runs on {args.workers} workers with free cores "
          f"({est_wall:.0f} min at the wall-clock speed measured during calibration); whole selection {est_all:.0f} min",
          flush=True)
    if est > args.budget_minutes:
        print(f"warning: the estimate {est:.0f} min exceeds --budget-minutes {args.budget_minutes:g}", flush=True)
    if args.plan:
        return 0

    if not args.report_only:
        problems = check_methods(plan, selected)
        if problems:
            print("cannot run:\n  " + "\n  ".join(problems[:10]))
            return 2
        start = time.perf_counter()
        failures, interrupted = run_pending(pending, costs, args.workers)
        print(f"runs {'stopped' if interrupted else 'finished'} after {(time.perf_counter() - start) / 60:.1f} min; "
              f"{len(failures)} failed", flush=True)
        if interrupted:  # skip the pool's exit-time joins (they wait on the terminated workers)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
    else:
        failures = []
    written = write_reports(plan, selected, scale, seeds, out, command, calibration_note)
    print("wrote " + ", ".join(os.path.relpath(p, REPO) for p in written if p.exists()))
    if failures:
        print("failed runs:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
