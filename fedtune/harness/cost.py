"""A time estimate for ``--plan``: a per-run cost model and the schedule length over the workers.

A suite measures :class:`Costs` once per machine, model and data set (its ``--calibrate``, with
:func:`calibrate`: short runs through :func:`fedtune.run.run_experiment`, so it works for any task),
and estimates each planned run from its config; :func:`makespan` turns the runs' estimates into the
suite's duration on its workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedtune.config import RunConfig
from fedtune.report import load_run


@dataclass(frozen=True)
class Costs:
    """Seconds, on one free core, of the pieces of a run."""

    step_s: float  # one local optimizer step
    eval_s_per_example: float  # evaluating one test example
    run_setup_s: float  # loading the model and the data
    client_overhead_s: float  # the method's work per client and round beyond its steps


def eval_rounds(rounds: int, every: int) -> int:
    """How many rounds evaluate: every ``every``-th and the last."""
    return len({r for r in range(1, rounds + 1) if r % every == 0} | {rounds})


def estimate_s(config: RunConfig, costs: Costs, test_examples: int) -> float:
    """Seconds ``config`` takes on one free core, evaluating ``test_examples`` per evaluation."""
    client_rounds = config.rounds * config.federation.sample_size()
    train = client_rounds * (config.train.local_steps * costs.step_s + costs.client_overhead_s)
    evals = eval_rounds(config.rounds, config.eval_every) * test_examples * costs.eval_s_per_example
    return costs.run_setup_s + train + evals


def makespan(costs: list[float], workers: int) -> float:
    """Length of the longest-processing-time-first schedule of ``costs`` over ``workers``."""
    loads = [0.0] * max(1, workers)
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads) if costs else 0.0


@dataclass(frozen=True)
class Probe:
    """What one short run measured (wall-clock seconds)."""

    client_s: float  # one client's work in a warm round without evaluation, mean over its clients
    eval_s_per_example: float  # the extra time of the round that evaluates, per test example
    setup_s: float  # the run's time beyond three warm rounds (loading the model and data, saving)
    test_examples: int


def probe(config: RunConfig, folder: Path, local_steps: int, clients: int = 2) -> Probe:
    """Run ``config`` for 3 rounds of ``clients`` clients with ``local_steps`` steps each (only the
    third round evaluates) into ``folder``, through :func:`fedtune.run.run_experiment`, and time it.
    Round 2 is the warm training round (round 1 also builds what the clients load lazily)."""
    from fedtune.run import run_experiment

    short = config.model_copy(
        update={
            "name": f"probe-{config.method}-{config.data.name}-h{local_steps}",
            "output_dir": str(folder),
            "rounds": 3,
            "eval_every": 3,
            "train": config.train.model_copy(update={"local_steps": local_steps}),
            "federation": config.federation.model_copy(update={"clients_per_round": clients, "fraction": None}),
        }
    )
    summary = run_experiment(short, overwrite=True)  # a probe folder from an earlier calibration is moved aside
    _, warm, evaluated = load_run(Path(folder) / short.run_name).rounds
    n = summary["test_examples"]
    return Probe(
        client_s=warm["compute_s"] / len(warm["clients"]),
        eval_s_per_example=max(0.0, evaluated["wall_s"] - warm["wall_s"]) / n,
        setup_s=max(0.0, summary["wall_s"] - 2 * warm["wall_s"] - evaluated["wall_s"]),
        test_examples=n,
    )


def calibrate(config: RunConfig, folder: Path, steps: tuple[int, int] = (2, 8)) -> Costs:
    """:class:`Costs` of ``config``'s model, data and method from two :func:`probe` runs with
    ``steps`` local steps: a step is the slope of a client's time over its steps, the method's
    overhead the rest; evaluation and setup are the two runs' mean. Run it with the torch threads
    the suite's workers use (:func:`fedtune.process.setup_process`)."""
    few, many = (probe(config, folder, h) for h in steps)
    step_s = max(0.0, (many.client_s - few.client_s) / (steps[1] - steps[0]))
    return Costs(
        step_s=step_s,
        eval_s_per_example=(few.eval_s_per_example + many.eval_s_per_example) / 2,
        run_setup_s=(few.setup_s + many.setup_s) / 2,
        client_overhead_s=max(0.0, few.client_s - steps[0] * step_s),
    )
