"""Run a config on the engine it names: the one entry point of ``fedtune run`` and of a library user.

Every engine runs the same Strategy and Client objects and writes the same run folder. :func:`launch`
resolves the config once (:func:`~fedtune.runtime.resolve_run`) and hands the
:class:`~fedtune.runtime.ResolvedRun` to a launcher, a function
``(run, on_round=, on_start=, resume=, overwrite=) -> summary``. To add an engine, write its
launcher and name it in :data:`ENGINES` (and in ``RunConfig.engine``'s choices, :mod:`fedtune.config`).
The launchers import their engine when called, so that ``fedtune`` starts without loading Flower.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fedtune.config import RunConfig
from fedtune.run_folder import check_free, check_unlocked, claimed
from fedtune.runtime import ResolvedRun, as_resolved
from fedtune.tracking import check_installed


def _embedded(run: ResolvedRun, overwrite: bool = False, **kw: Any) -> dict:
    from fedtune.run import run_experiment

    return run_experiment(run, overwrite=overwrite, **kw)  # claims the folder once every input is checked


@contextmanager
def _claimed_for_flower(run: ResolvedRun, resume: bool, overwrite: bool) -> Iterator[None]:
    """Before any Flower process starts, in the order :func:`~fedtune.run.run_experiment` keeps
    in-process: the folder is not in use and a fresh run's is free (a refusal costs nothing), every
    input is read and checked (:func:`~fedtune.run.check_inputs`: the data, the model, the budget
    plan, a resume's checkpoint: a bad one stops in one line with nothing written), then the run
    folder is claimed (:func:`~fedtune.run_folder.claimed`: locked, an earlier run moved aside with
    ``overwrite``) while the engine runs; the ServerApp (this process, or a process it starts) works
    under that lock."""
    from fedtune.run import check_inputs

    check_unlocked(run.run_dir)
    if not (resume or overwrite):
        check_free(run.run_dir)
    check_inputs(run, resume)
    with claimed(run.run_dir, resume, overwrite):
        yield


def _flower_simulation(run: ResolvedRun, overwrite: bool = False, **kw: Any) -> dict:
    from fedtune.engines.flower.simulation import run_flower_simulation

    with _claimed_for_flower(run, kw["resume"], overwrite):
        return run_flower_simulation(run, **kw)


def _flower_deployment(run: ResolvedRun, overwrite: bool = False, **kw: Any) -> dict:
    from fedtune.engines.flower.deployment import run_flower_deployment

    with _claimed_for_flower(run, kw["resume"], overwrite):
        return run_flower_deployment(run, **kw)


#: ``config.engine`` -> its launcher: clients in this process; a Flower simulation (Ray); a loopback
#: Flower deployment (SuperLink, SuperNodes, ``flwr run``).
ENGINES: dict[str, Callable[..., dict]] = {
    "embedded": _embedded,
    "flower-sim": _flower_simulation,
    "flower": _flower_deployment,
}


def launch(
    config: RunConfig | ResolvedRun,
    on_round: Callable[[Any], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict:
    """Run ``config`` (resolved here unless it is already) on ``config.engine`` and return the
    summary (also in the run folder's ``summary.json``); ``on_round`` gets each round's record,
    ``on_start`` the server's :class:`~fedtune.runtime.RunContext`.

    A fresh run never writes into a folder holding an earlier run: ``overwrite`` moves that run
    aside (:func:`~fedtune.run_folder.claimed`, which also locks it), else the run stops with one line
    (:class:`~fedtune.run_folder.RunFolderTaken`); in-process once every input is checked
    (:func:`~fedtune.run.run_experiment`), on Flower before any process starts."""
    run = as_resolved(config)
    check_installed(run.config)  # a tracker's package, before any engine process starts
    return ENGINES[run.config.engine](run, on_round=on_round, on_start=on_start, resume=resume, overwrite=overwrite)
