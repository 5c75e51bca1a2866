"""CPU-scale counterparts of the CoMMIT paper's experiments (Sections 4 and 7: Table 1, Figures 3-6),
written to ``benchmarks/results/commit/``.

Every run is the recipe ``configs/benchmarks/commit-suite.toml`` (centralized: one party, one optimizer,
120 steps of batch 8; SmolLM2-135M-Instruct with LoRA as T, a projector as S) plus a modality overlay
(``configs/benchmarks/commit-suite-overlays.toml``: ``image`` Fashion-MNIST "What item of clothing is
this?" / "Describe the picture." over a frozen MobileNetV2; ``audio`` FSDD "Which digit is spoken?" /
"Describe the recording." over fixed log-mel features) and the trainer (``options.trainer``).
Identical configs run once and are shared between experiments. Experiments:

- ``sweep`` (with ``--lr-grid``): each (modality, trainer) of Table 1 on the grid's learning rates
  (``train.lr``: both components' base rate; CoMMIT's alpha = 2 x lr) on ``--sweep-seed``; the rate
  with the highest mean of the run's last 3 evaluations (exact match) is chosen for that (modality,
  trainer), and ``table1`` / ``fig45`` then run it on ``--seeds`` (written to
  ``benchmarks/results/commit-swept/``; a group whose sweep is unfinished has no table runs yet).
- ``table1``: Table 1. Constant LR, Feature CD, Language CD, CoMMIT-CLR and CoMMIT on both modalities:
  exact match over all questions, exact match of the short-answer question (the paper's QA accuracy),
  and ROUGE-L (its captioning metric: the describe answers run to several words).
- ``fig45``: Figures 4 and 5. Training-loss curves (per step, mean over seeds) of Constant LR,
  CoMMIT-CLR and CoMMIT, image (Fig. 4) and audio (Fig. 5); Table 1's runs.
- ``fig6``: Figure 6. kappa_t curves of Synced (Constant) LR, Language LR up, Vision LR up, CoMMIT-CLR and
  CoMMIT, and the standard deviation of kappa_t over the steps of each run.
- ``fig3``: Figure 3 (Section 4.2). Normalized gradient norms ||G^S|| / ||theta_S||, ||G^T|| / ||theta_T||
  and the training loss of Synced LR, Language LR up and Vision LR up; Figure 6's runs.
- ``federated``: the federated mode (not in the paper): FedAvg of S and T over 4 clients each holding
  one question type, 2 per round, 5 rounds x 12 local steps; Constant LR, CoMMIT-CLR and CoMMIT, image.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=/path/to/shared/data .venv/bin/python benchmarks/commit/run_suite.py
    ... --plan           # the runs and the time estimate, nothing run
    ... --quick          # smoke test: tiny-llama, 64 examples, 6 steps, to benchmarks/results/_scratch/commit-quick/
    ... --report-only    # rewrite the markdown and plots from the run folders that exist
    ... --steps 40 --test-samples 100 --modalities image --only table1   # a scaled-down slice
    ... --lr-grid 3e-4,1e-3,3e-3 --seeds 1,2,3 --only table1,fig45 --steps 80 --evals 4   # per-trainer rates

``--steps`` / ``--test-samples`` scale every run (centralized: ``train.local_steps``; federated: the
same client steps spread over its 5 rounds x 2 clients); ``--lr`` sets every run's base rate
(a rate sweep: one ``--out`` folder per rate); ``--evals N`` splits a centralized run's
steps into N rounds with one optimizer throughout (``options.carry_optimizer``) and an evaluation
after each, and the tables report the mean of the last (up to) 3 evaluations instead of the single
final one; ``--modalities`` runs only those modalities' runs (the reports keep the others' cells
as "pending").
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from fedtune.config import RunConfig, load_config
from fedtune.harness import (
    Choice,
    RunSpec,
    SuiteError,
    Sweep,
    add_sweep_options,
    biased_seed_warning,
    build_plan,
    choose,
    clearly_above,
    distinct_runs,
    estimate_minutes,
    eval_rounds,
    figure,
    load_rounds,
    load_summary,
    mean_of_last,
    mean_std,
    offline_data,
    output_dir,
    parse_selection,
    read_overlays,
    run_suite,
    runs_section,
    suite_command,
    suite_parser,
    sweep_first,
    sweep_note,
    sweep_sections,
    sweep_selection,
    table_lines,
    with_labels,
)

REPO = Path(__file__).resolve().parents[2]

RECIPE = REPO / "configs" / "benchmarks" / "commit-suite.toml"
OVERLAYS = read_overlays(REPO / "configs" / "benchmarks" / "commit-suite-overlays.toml")
RESULTS = REPO / "benchmarks" / "results" / "commit"
SWEPT_RESULTS = REPO / "benchmarks" / "results" / "commit-swept"  # --lr-grid: every trainer at its own rate
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "commit-quick"
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
) -> RunSpec:
    """One run; ``lr`` (a swept or chosen rate, named in the run) overrides the scale's base rate."""
    mode, rate = "fed-" if federated else "", "" if lr is None else f"-lr{lr:g}"
    return RunSpec(
        f"{mode}{modality}-{trainer}{rate}-seed{seed}",
        [
            *scale.overrides(modality, federated),
            f'options.trainer="{trainer}"',
            f"seed={seed}",
            *([] if lr is None else [f"train.lr={lr!r}"]),
        ],
        {"modality": modality, "trainer": trainer, "seed": seed, "federated": federated, "lr": lr},
    )


def choices_of(sweep_runs: list[RunSpec]) -> dict[tuple[str, str], Choice | None]:
    """Each (modality, trainer)'s chosen rate: the argmax over its finished sweep runs of the mean of
    the last :data:`LAST_EVALS` evaluations' exact match (None while any of its runs is unfinished)."""
    return {
        (m, t): choose(
            with_labels(sweep_runs, modality=m, trainer=t),
            lambda s: {"lr": s.labels["lr"]},
            lambda s: run_metric(s, "accuracy"),
        )
        for m in MODALITIES
        for t in TABLE1
        if with_labels(sweep_runs, modality=m, trainer=t)
    }


def questions(specs: list[RunSpec], modality: str) -> list[str]:
    """The question types of the modality's runs (the first: the short-answer one, the last: describe)."""
    group = with_labels(specs, modality=modality)
    return list(group[0].config.task.options["questions"]) if group else []


def build_suite_plan(seeds: list[int], scale: Scale, out: Path, sweep: Sweep | None = None) -> dict[str, list[RunSpec]]:
    """Every experiment's runs (all of them, so that which folder owns a shared run never depends on
    ``--only`` or ``--modalities``), resolved to their configs and canonical run folders. With a
    ``sweep``, Table 1's and Figures 4/5's runs of a (modality, trainer) use its chosen rate, and
    wait (are not planned) until its sweep runs are all finished."""
    grid = lambda trainers: [spec(m, t, s, scale) for m in MODALITIES for t in trainers for s in seeds]  # noqa: E731
    swept, chosen = [], grid
    if sweep is not None:
        swept = [spec(m, t, sweep.seed, scale, lr=lr) for m in MODALITIES for t in TABLE1 for lr in sweep.grid]
        choices = choices_of(build_plan({"sweep": swept}, RECIPE, out)["sweep"])

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
    plan = build_plan({e: experiments[e] for e in order}, RECIPE, out)
    return {e: plan[e] for e in EXPERIMENTS}


def restrict(plan: dict[str, list[RunSpec]], modalities: list[str]) -> dict[str, list[RunSpec]]:
    """The plan's runs of ``modalities`` only (what ``--modalities`` runs)."""
    return {exp: [s for s in specs if s.labels["modality"] in modalities] for exp, specs in plan.items()}


def parse_args(argv=None):
    parser = suite_parser(
        "CoMMIT suite (Table 1, Figures 3-6, federated mode)", EXPERIMENTS, seeds="0,1,2", budget_minutes=240.0
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default: the recipe's 120)")
    parser.add_argument("--test-samples", type=int, default=None, help="test questions (default: the recipe's 200)")
    parser.add_argument(
        "--evals",
        type=int,
        default=None,
        help="centralized runs: evaluations, one per round of steps/evals steps with one optimizer "
        "throughout (default: one, at the end); cells: the mean of the last 3",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="every run's base learning rate train.lr (default: the recipe's; CoMMIT's alpha "
        "follows as 2 x lr); for a rate sweep, one --out folder per rate",
    )
    parser.add_argument(
        "--modalities", default=",".join(MODALITIES), help="comma-separated subset of image,audio to run"
    )
    add_sweep_options(
        parser,
        EXPERIMENTS,
        "each (modality, trainer) of Table 1 (for table1 / fig45; results to benchmarks/results/commit-swept/)",
    )
    return parser.parse_args(argv)


def selection(args) -> tuple[Scale, list[str]]:
    """The scale and the modalities to run; :class:`SuiteError` naming the option when bad."""
    modalities = [m.strip() for m in args.modalities.split(",") if m.strip()]
    unknown = [m for m in modalities if m not in MODALITIES]
    if unknown or not modalities:
        raise SuiteError(f"--modalities: expected a subset of {MODALITIES}, got {args.modalities!r}")
    for name in ("steps", "test_samples", "evals"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SuiteError(f"--{name.replace('_', '-')}: expected a positive number, got {value}")
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise SuiteError(f"--lr: expected a positive number, got {args.lr}")
    scale = Scale(args.quick, args.steps, args.test_samples, args.evals, args.lr)
    if args.evals is not None and scale.centralized_steps(modalities[0]) % args.evals:
        raise SuiteError(
            f"--evals: expected a divisor of the {scale.centralized_steps(modalities[0])} steps per "
            f"run, got {args.evals}"
        )
    return scale, modalities


# -- cost model ------------------------------------------------------------------------------
# Seconds of one step of SmolLM2 (batch 8) by trainer, measured here with one thread under the shared
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
    evals = eval_rounds(config.rounds, config.eval_every) * (config.data.max_test_samples or 200)
    return (5.0 if tiny else 40.0) + steps * step + evals * (0.01 if tiny else 0.3)


# -- reading runs ----------------------------------------------------------------------------
def step_curve(spec_: RunSpec, key: str, client: str | None = None) -> list[float | None]:
    """The run's per-step ``key`` (client ``client``'s, else every client's in round order)."""
    out: list[float | None] = []
    for line in load_rounds(spec_):
        curves = line.get("client_curves", {})
        for cid in sorted(curves, key=int):
            if client is None or cid == client:
                out += curves[cid].get(key, [])
    return out


def finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def seed_mean_curve(specs: list[RunSpec], key: str) -> list[float]:
    """Step by step mean over the finished runs (nan where none has a value)."""
    curves = [step_curve(s, key) for s in specs if load_summary(s)]
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


def run_metric(spec_: RunSpec, metric: str) -> float | None:
    """The finished run's ``metric``: the mean of its last (up to) :data:`LAST_EVALS` evaluations."""
    return mean_of_last(load_rounds(spec_), LAST_EVALS, metric) if load_summary(spec_) else None


def metric_values(specs: list[RunSpec], metric: str, scale: float = 100.0) -> list[float]:
    """:func:`run_metric` of each finished run that has it, times ``scale``."""
    return [scale * v for v in (run_metric(s, metric) for s in specs) if v is not None]


def metric_cell(specs: list[RunSpec], metric: str, scale: float = 100.0) -> str:
    values = metric_values(specs, metric, scale)
    m, s = mean_std(values)
    if m is None:
        return "pending"
    return f"{m:.2f} ± {s:.2f}" + (f" (n={len(values)})" if len(values) < len(specs) else "")


def metric_mean(specs: list[RunSpec], metric: str) -> float | None:
    values = metric_values(specs, metric)
    return sum(values) / len(values) if values else None


def kappa_stats(spec_: RunSpec) -> tuple[float, float] | None:
    """(mean, std) of the run's kappa_t over its steps (None while unfinished or unmeasured)."""
    if not load_summary(spec_):
        return None
    vals = finite(step_curve(spec_, "kappa"))
    if not vals:
        return None
    m = sum(vals) / len(vals)
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))


def stat_cell(values: list[float | None], digits: int = 3) -> str:
    """Mean ± sample std of the values present (None: a run not finished), with their number when some are missing."""
    present = [v for v in values if v is not None]
    m, s = mean_std(present)
    if m is None:
        return "pending"
    return f"{m:.{digits}f} ± {s:.{digits}f}" + (f" (n={len(present)})" if len(present) < len(values) else "")


# -- reports ---------------------------------------------------------------------------------
def evaluated(config: RunConfig) -> str:
    """What a cell averages for a run of ``config`` (its evaluations: every ``eval_every`` rounds and the last)."""
    n = min(LAST_EVALS, eval_rounds(config.rounds, config.eval_every))
    return "the final evaluation" if n == 1 else f"each run's mean of its last {n} evaluations"


def setup_section(plan, seeds: list[int], command: str, sweep: Sweep | None = None) -> str:
    specs = [s for exp in plan.values() for s in exp]
    base = specs[0].config
    o = base.options
    data = {m: with_labels(specs, modality=m)[0].config.data.name for m in MODALITIES}
    lines = [
        "## Setup",
        "",
        "Produced by",
        "",
        "```bash",
        command,
        "```",
        "",
        "| | paper (Sec. 7) | here |",
        "|---|---|---|",
        "| models | BLIP-2 (Q-Former + OPT-2.7B), SALMONN (audio Q-Former + Vicuna-7B) | "
        f"`{base.model.name}` with LoRA rank {base.model.lora_rank} on q_proj / v_proj (T); a projector (S) over a "
        "frozen MobileNetV2 (image) or fixed log-mel features (audio), "
        f"{base.task.options.get('prefix_tokens')} prefix tokens |",
        "| tasks | A-OKVQA, IconQA, TextVQA; ClothoAQA, MACS, SDD | "
        + "; ".join(f"{m}: `{data[m]}`, {' + '.join(questions(specs, m))} questions" for m in MODALITIES)
        + " (describe answers run to several words: ROUGE-L) |",
        "| training | Adam, lr 1e-4 (Constant LR) | AdamW, "
        + ("lr swept per trainer and modality (Table 1, Figs. 4/5)" if sweep else f"lr {base.train.lr:g}")
        + f", {base.rounds} x "
        f"{base.train.local_steps} steps of batch {base.train.batch_size}, one party (centralized)"
        + (", one optimizer throughout, evaluated after each round" if base.rounds > 1 else "")
        + " |",
        f"| CoMMIT | alpha, gamma, N_kappa, L_lr, lambda, d not stated | alpha = 2 x lr, gamma {o.get('gamma', 1.0)}, "
        f"N_kappa {o['n_kappa']}, L_lr {o['l_lr']}, lambda {o['reg_weight']}, d = total variation |",
        f"| Language / Vision LR up | 1e-3 vs 1e-4 | {o['lr_up']:g} x lr for that component |",
        f"| Feature / Language CD | 'until weights stabilize' | switch when the relative weight change over "
        f"{o['cd_window']} steps is below {o['cd_tolerance']}, at the latest after {o['cd_max_fraction']:g} of the "
        "steps |",
        f"| seeds | not stated | {', '.join(map(str, seeds))} |",
        "",
        (
            "**Rates.** Each trainer's learning rate (train.lr: both components' base rate; CoMMIT's alpha = 2 x "
            "lr) is "
            f"chosen per modality on seed {sweep.seed} from {{{', '.join(f'{lr:g}' for lr in sweep.grid)}}}: the rate "
            f"with the highest mean of its last {LAST_EVALS} evaluations' exact match (`sweep.md`; ties: the "
            "smaller rate). "
            f"Table 1 and Figs. 4/5 run it on seeds {', '.join(map(str, seeds))}"
            + (
                " (the sweep seed among them: its run is the one that chose the rate, a biased figure)"
                if sweep.seed in seeds
                else ", which played no part in the choice"
            )
            + f"; the other figures run at lr {base_lr(specs):g} for every trainer. "
            if sweep
            else "Nothing is tuned per trainer: every trainer runs with the same recipe. "
        )
        + f"Cells: mean ± sample std over seeds of {evaluated(base)} (exact match and ROUGE-L in %, "
        f"{base.data.max_test_samples} test questions).",
        "",
    ]
    distinct = {s.key: s for s in specs}.values()
    done = sum(load_summary(s) is not None for s in distinct)
    if done < len(distinct):
        lines += [
            f"Finished so far: {done} of the suite's {len(distinct)} distinct runs (cells say n= where seeds are "
            "missing, pending where none finished). The command above, run again, resumes its own selection "
            "(--only, --modalities); every experiment and modality at this scale: the same command with "
            "`--only table1,fig45,fig6,fig3,federated --modalities image,audio`.",
            "",
        ]
    return "\n".join(lines)


def short_question(specs: list[RunSpec], modality: str) -> str | None:
    """The modality's short-answer question (None: no run of it planned yet)."""
    return next(iter(questions(specs, modality)), None)


def base_lr(specs: list[RunSpec]) -> float:
    """The learning rate of the runs that are not swept (the recipe's, or ``--lr``)."""
    return next(s.config.train.lr for s in specs if s.labels["lr"] is None)


def report_table1(specs: list[RunSpec], head: str, out: Path, sweep: Sweep | None = None) -> str:
    cols, rows = ["Trainer"], []
    for m in MODALITIES:
        cols += [f"{m}: lr (swept)"] if sweep else []
        cols += [f"{m}: exact match", f"{m}: {short_question(specs, m) or 'short-answer'} question", f"{m}: ROUGE-L"]
    cols.append("average")
    for t in TABLE1:
        row = [LABEL[t]]
        means = []
        for m in MODALITIES:
            group = with_labels(specs, modality=m, trainer=t)
            if sweep:
                row.append(f"{group[0].labels['lr']:g}" if group else "waiting for the sweep")
            row += [
                metric_cell(group, "accuracy"),
                metric_cell(group, f"accuracy_{short_question(specs, m)}"),
                metric_cell(group, "rouge_l"),
            ]
            means += [metric_mean(group, "accuracy"), metric_mean(group, "rouge_l")]
        row.append("pending" if None in means else f"{sum(means) / len(means):.2f}")
        rows.append(row)
    paper = [[LABEL[t], *(f"{v:.2f}" for v in PAPER_TABLE1[t])] for t in TABLE1]
    lines = [
        "# Table 1 (CPU scale): five trainers, two modalities",
        "",
        head,
        "## Results",
        "",
        *table_lines(cols, rows),
        "",
        reference_line(specs),
        "",
        "Paper (accuracy for A-OKVQA, IconQA, TextVQA, ClothoAQA; ROUGE-L for MACS, SDD):",
        "",
        *table_lines(["Method", "A-OKVQA", "IconQA", "TextVQA", "ClothoAQA", "MACS", "SDD", "Average"], paper),
        "",
        *ordering_notes(specs),
        *cd_switches(specs),
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_sweep(specs: list[RunSpec], head: str, out: Path, sweep: Sweep | None = None) -> str:
    """Each (modality, trainer)'s exact match at every grid rate on the sweep seed, and its choice."""
    choices = choices_of(specs)
    lines = [
        "# Learning-rate sweep (CPU scale): each trainer's own rate",
        "",
        f"Each cell: the run's mean of its last (up to) {LAST_EVALS} evaluations' exact match (%), one seed; "
        "**bold**: the chosen rate (automatic argmax), which Table 1 and Figures 4/5 then run on the table seeds.",
        "",
        head,
    ]
    panels = {m: {LABEL[t]: with_labels(specs, modality=m, trainer=t) for t in TABLE1} for m in MODALITIES}
    lines += sweep_sections(
        panels,
        {m: {LABEL[t]: choices.get((m, t)) for t in TABLE1} for m in MODALITIES},
        lambda s: run_metric(s, "accuracy"),
        out / "sweep.png",
        row_title="Trainer",
        reference_name="majority-answer rate",
        ylabel=f"exact match, mean of last {LAST_EVALS} (%)",
    )
    return "\n".join([*lines, "![sweep](sweep.png)", ""]) + "\n" + runs_section(specs, out)


def reference_line(specs: list[RunSpec]) -> str:
    """The task's reference (exact match of always giving the test set's most frequent answer) per modality."""
    cells = []
    for m in MODALITIES:
        done = [load_summary(s) for s in with_labels(specs, modality=m) if load_summary(s)]
        cells.append(f"{m} {100 * done[0]['majority_accuracy']:.1f}%" if done else f"{m} pending")
    return "Reference, exact match of always giving the most frequent answer: " + ", ".join(cells) + "."


def cd_switches(specs: list[RunSpec]) -> list[str]:
    """When each CD run switched components: the first step that trained the second component, and
    whether the stabilization criterion or the cap made it switch."""
    lines = ["## When did coordinate descent switch?", ""]
    for m in MODALITIES:
        for t in ("feature-cd", "language-cd"):
            cells = []
            for s in with_labels(specs, modality=m, trainer=t):
                if not load_summary(s):
                    continue
                first = "lr_S" if t == "feature-cd" else "lr_T"
                lrs, change = step_curve(s, first), step_curve(s, "cd_change")
                at = next((i for i, v in enumerate(lrs) if v == 0.0), None)
                if at is None:
                    cells.append(f"seed {s.labels['seed']}: never")
                    continue
                tol = s.config.options["cd_tolerance"]
                why = "criterion" if at > 0 and change[at - 1] is not None and change[at - 1] < tol else "cap"
                seen = finite(change[:at])
                cells.append(
                    f"seed {s.labels['seed']}: step {at + 1} ({why}; window changes {min(seen):.3f}-{max(seen):.3f})"
                    if seen
                    else f"seed {s.labels['seed']}: step {at + 1} ({why})"
                )
            lines.append(f"- {m}, {LABEL[t]}: " + ("; ".join(cells) if cells else "pending"))
    return lines + [""]


def learned_note(specs: list[RunSpec], modality: str) -> str | None:
    """How many of each trainer's finished runs are clearly above the majority-answer rate
    (:func:`~fedtune.harness.clearly_above` on the mean of the last evaluations); a modality where
    none is cannot rank the trainers. None before any run finished."""
    cells, any_above, reference = [], False, None
    for t in TABLE1:
        done = [(s, summary) for s in with_labels(specs, modality=modality, trainer=t) if (summary := load_summary(s))]
        if not done:
            continue
        above = 0
        for s, summary in done:
            reference = summary.get("majority_accuracy")
            ok, margin = clearly_above(
                run_metric(s, "accuracy"), summary.get("final_accuracy"), reference, summary.get("test_examples")
            )
            above += bool(ok)
        any_above |= above > 0
        cells.append(f"{LABEL[t]} {above}/{len(done)}")
    if not cells or reference is None:
        return None
    verdict = (
        ""
        if any_above
        else (" No run is: this modality did not learn at this scale, and its column cannot rank the trainers.")
    )
    return (
        f"- {modality}: runs clearly above the {100 * reference:.0f}% majority-answer rate (last-"
        f"{LAST_EVALS} mean at least {100 * margin:.1f} points above it, final evaluation above it): "
        + ", ".join(cells)
        + "."
        + verdict
    )


def ordering_notes(specs: list[RunSpec]) -> list[str]:
    """The paper's claims (CoMMIT-CLR and CoMMIT improve Constant LR; CoMMIT best on average), checked,
    after whether each modality learned at all (:func:`learned_note`)."""
    notes = ["## Does the paper's ordering reproduce?", ""]
    for m in MODALITIES:
        learned = learned_note(specs, m)
        if learned:
            notes.append(learned)
        for metric, name in (("accuracy", "exact match"), ("rouge_l", "ROUGE-L")):
            means = {t: metric_mean(with_labels(specs, modality=m, trainer=t), metric) for t in TABLE1}
            if any(v is None for v in means.values()):
                continue
            spread = max(
                (mean_std(metric_values(with_labels(specs, modality=m, trainer=t), metric))[1] or 0.0) for t in TABLE1
            )
            best = max(means, key=means.get)
            notes.append(
                f"- {m}, {name}: CoMMIT-CLR {means['commit-clr'] - means['constant']:+.2f} and CoMMIT "
                f"{means['commit'] - means['constant']:+.2f} points vs Constant LR; best: {LABEL[best]} "
                f"({means[best]:.2f}); largest seed std {spread:.2f} points"
                + (" (differences within it are not evidence)" if spread else "")
            )
    return notes + [""] if len(notes) > 2 else notes + ["(pending)", ""]


def plot_curves(path: Path, specs: list[RunSpec], trainers: list[str], panels: list[tuple[str, str]], title: str):
    """One row per modality, one column per (curve key, y label); seed means smoothed over SMOOTH steps."""
    with figure(
        path, len(MODALITIES), len(panels), figsize=(5 * len(panels), 3.6 * len(MODALITIES)), squeeze=False
    ) as (fig, axes):
        for i, m in enumerate(MODALITIES):
            for j, (key, ylabel) in enumerate(panels):
                ax = axes[i][j]
                for t in trainers:
                    ys = smooth(seed_mean_curve(with_labels(specs, modality=m, trainer=t), key))
                    if ys and any(math.isfinite(y) for y in ys):
                        ax.plot(range(1, len(ys) + 1), ys, label=LABEL[t])
                ax.set(title=f"{m}: {ylabel}", xlabel="step", ylabel=ylabel)
                if key in ("kappa", "grad_S", "grad_T"):
                    ax.set_yscale("log")
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
        fig.suptitle(title)


def loss_table(specs: list[RunSpec], trainers: list[str]) -> list[str]:
    """Mean training loss over the first and the last quarter of the steps (seed mean ± std)."""
    rows = []
    for t in trainers:
        row = [LABEL[t]]
        for m in MODALITIES:
            firsts, lasts = [], []
            for s in with_labels(specs, modality=m, trainer=t):
                loss = finite(step_curve(s, "loss")) if load_summary(s) else []
                q = max(1, len(loss) // 4)
                firsts.append(sum(loss[:q]) / q if loss else None)
                lasts.append(sum(loss[-q:]) / q if loss else None)
            row += [stat_cell(firsts), stat_cell(lasts)]
        rows.append(row)
    cols = ["Trainer"] + [c for m in MODALITIES for c in (f"{m}: loss, first quarter", f"{m}: loss, last quarter")]
    return table_lines(cols, rows)


def report_fig45(specs: list[RunSpec], head: str, out: Path) -> str:
    plot_curves(
        out / "fig45.png",
        specs,
        FIG45,
        [("loss", "training loss")],
        f"Figs. 4/5: training loss\n(seed mean, {SMOOTH}-step average)",
    )
    lines = [
        "# Figures 4 and 5 (CPU scale): training-loss curves",
        "",
        "Per-step training loss (the answer cross-entropy of each step's batch), mean over seeds, smoothed over "
        f"{SMOOTH} steps; image is Figure 4's counterpart, audio Figure 5's. The paper: CoMMIT-CLR and CoMMIT "
        "reach lower losses earlier than Constant LR.",
        "",
        head,
        "## Results",
        "",
        *loss_table(specs, FIG45),
        "",
        "![fig45](fig45.png)",
        "",
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig6(specs: list[RunSpec], head: str, out: Path) -> str:
    plot_curves(
        out / "fig6.png", specs, FIG6, [("kappa", "kappa_t")], f"Fig. 6: kappa_t\n(seed mean, {SMOOTH}-step average)"
    )
    rows = []
    for t in FIG6:
        row = [LABEL[t]]
        for m in MODALITIES:
            stats = [kappa_stats(s) for s in with_labels(specs, modality=m, trainer=t)]
            row += [stat_cell([x[0] if x else None for x in stats]), stat_cell([x[1] if x else None for x in stats])]
        rows.append(row)
    cols = ["Trainer"] + [c for m in MODALITIES for c in (f"{m}: mean kappa_t", f"{m}: std of kappa_t")]
    lines = [
        "# Figure 6 (CPU scale): the learning balance kappa_t",
        "",
        "kappa_t = d_T / d_S (eq. (3)): how far one step of the LM's LoRA alone, against one step of the projector "
        "alone, moves the answer tokens' next-token distributions (total variation). Per run: the mean and the "
        "standard deviation of kappa_t over its steps; cells: mean ± sample std over seeds. The paper: CoMMIT and "
        "CoMMIT-CLR have the smallest std of kappa_t, Language LR up is also stable.",
        "",
        head,
        "## Results",
        "",
        *table_lines(cols, rows),
        "",
        "![fig6](fig6.png)",
        "",
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_fig3(specs: list[RunSpec], head: str, out: Path) -> str:
    plot_curves(
        out / "fig3.png",
        specs,
        FIG3,
        [("grad_S", "||G^S|| / ||theta_S||"), ("grad_T", "||G^T|| / ||theta_T||"), ("loss", "training loss")],
        f"Figure 3 (CPU scale): normalized gradient norms and loss, mean over seeds, {SMOOTH}-step moving average",
    )
    rows = []
    for t in FIG3:
        row = [LABEL[t]]
        for m in MODALITIES:
            for key in ("grad_S", "grad_T"):
                vals = []
                for s in with_labels(specs, modality=m, trainer=t):
                    c = finite(step_curve(s, key)) if load_summary(s) else []
                    q = max(1, len(c) // 4)
                    vals.append(sum(c[-q:]) / q if c else None)
                row.append(stat_cell(vals, 4))
        rows.append(row)
    cols = ["Trainer"] + [
        f"{m}: {k}, last quarter" for m in MODALITIES for k in ("||G^S||/||theta_S||", "||G^T||/||theta_T||")
    ]
    lines = [
        "# Figure 3 (CPU scale): normalized gradient norms of S and T",
        "",
        "||G|| / ||theta|| of the loss gradient of each component at each step (S: the projector; T: the LoRA "
        "matrices). The paper (Sec. 4.2): imbalanced learning (Vision LR up) slows convergence and shrinks both "
        "components' gradients.",
        "",
        head,
        "## Results",
        "",
        *table_lines(cols, rows),
        "",
        "![fig3](fig3.png)",
        "",
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def report_federated(specs: list[RunSpec], head: str, out: Path) -> str:
    rows, asked = [], questions(specs, "image")
    for t in FEDERATED:
        group = with_labels(specs, trainer=t)
        stats = [kappa_stats(s) for s in group]
        rows.append(
            [
                LABEL[t],
                metric_cell(group, "accuracy"),
                *(metric_cell(group, f"accuracy_{q}") for q in asked),
                metric_cell(group, "rouge_l"),
                stat_cell([x[0] if x else None for x in stats]),
                stat_cell([x[1] if x else None for x in stats]),
            ]
        )
    with figure(out / "federated.png", 1, len(FEDERATED), figsize=(5 * len(FEDERATED), 3.6), squeeze=False) as (
        fig,
        axes,
    ):
        for j, t in enumerate(FEDERATED):
            ax = axes[0][j]
            group = [s for s in with_labels(specs, trainer=t) if load_summary(s)]
            labeled: set[str] = set()
            if group:  # the first seed's per-client kappa curves, each client at the rounds it took part in
                for line in load_rounds(group[0]):
                    for cid, c in sorted(line.get("client_curves", {}).items(), key=lambda kv: int(kv[0])):
                        h = len(c["kappa"])
                        xs = [(line["round"] - 1) * h + k + 1 for k in range(h)]
                        ax.plot(
                            xs,
                            [v if v is not None else math.nan for v in c["kappa"]],
                            color=f"C{int(cid)}",
                            label=None if cid in labeled else f"client {cid}",
                        )
                        labeled.add(cid)
            ax.set(
                title=f"{LABEL[t]}: per-client kappa_t ({group[0].name if group else 'pending'})",
                xlabel="local step",
                ylabel="kappa_t",
                yscale="log",
            )
            ax.grid(alpha=0.3)
            if labeled:
                ax.legend(fontsize=7)
    cols = ["Trainer", "exact match", *asked, "ROUGE-L", "mean kappa_t", "std of kappa_t"]
    lines = [
        "# Federated mode (not in the paper)",
        "",
        "FedAvg of S (projector) and T (LoRA) over 4 clients holding one question type each (label-sorted "
        "shards of the question labels: clients 0-1 the first type, 2-3 the second), 2 per round; each client "
        "runs the trainer on its own batches and measures its own kappa; the server averages the updates and "
        "the clients' kappa windows and rates (FedAvg weights).",
        "",
        head,
        "## Results",
        "",
        *table_lines(cols, rows),
        "",
        "![federated](federated.png)",
        "",
    ]
    return "\n".join(lines) + "\n" + runs_section(specs, out)


def write_reports(plan, selected, seeds, out: Path, command: str, sweep: Sweep | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    head = setup_section(plan, seeds, command, sweep)
    swept = {"sweep": report_sweep, "table1": report_table1}  # the writers that say which rates were chosen
    writers = {**swept, "fig45": report_fig45, "fig6": report_fig6, "fig3": report_fig3, "federated": report_federated}
    written = []
    for exp in selected:
        path = out / f"{exp}.md"
        extra = (sweep,) if exp in swept else ()
        path.write_text(writers[exp](plan[exp], head, out, *extra))
        written += [path] + ([out / f"{exp}.png"] if (out / f"{exp}.png").exists() else [])
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        selected, seeds = parse_selection(args, EXPERIMENTS)
        scale, modalities = selection(args)
        sweep, selected = sweep_selection(args, selected, SWEPT)
    except SuiteError as exc:
        print(exc)
        return 2
    out = output_dir(args, SWEPT_RESULTS if sweep else RESULTS, QUICK_RESULTS)
    offline_data("Fashion-MNIST and FSDD")
    command = suite_command("benchmarks/commit/run_suite.py", argv)
    biased_seed_warning(sweep, seeds, selected, SWEPT)
    base = load_config(RECIPE, scale.overrides(modalities[0]))
    print(
        f"CoMMIT suite: {', '.join(selected)}; modalities {', '.join(modalities)}; seeds {seeds}"
        + (f"; rates {', '.join(f'{lr:g}' for lr in sweep.grid)} swept on seed {sweep.seed}" if sweep else "")
        + f"; model {base.model.name}; {base.rounds} x {base.train.local_steps} steps of batch "
        f"{base.train.batch_size} per centralized run -> {out}"
    )

    def stage(experiments: list[str]) -> int:
        plan = build_suite_plan(seeds, scale, out, sweep)
        to_run = restrict(plan, modalities)
        runs = distinct_runs(to_run, experiments)
        costs = {s.key: run_cost(s.config) for s in runs}
        notes = [
            f"cost model: per-trainer step seconds measured on this machine "
            f"(~{estimate_minutes(runs, costs, 1):.0f} min of one core for the selection)"
        ]
        if sweep:
            choices = choices_of(plan["sweep"])
            groups = {f"{m}/{t}": with_labels(plan["sweep"], modality=m, trainer=t) for m in modalities for t in TABLE1}
            notes.append(
                sweep_note(
                    groups,
                    {f"{m}/{t}": choices.get((m, t)) for m in modalities for t in TABLE1},
                    "(modality, trainer) groups",
                )
            )
        return run_suite(
            to_run,
            experiments,
            args,
            costs,
            lambda: write_reports(plan, experiments, seeds, out, command, sweep),
            root=REPO,
            notes=notes,
        )

    return sweep_first(stage, selected, args)  # table1 / fig45 are planned from the sweep's finished runs


if __name__ == "__main__":
    sys.exit(main())
