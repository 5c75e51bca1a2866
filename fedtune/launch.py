"""Run a config on the engine it names: the one entry point of ``fedtune run`` and of a library user.

Every engine runs the same Strategy and Client objects and writes the same run folder; a launcher
is a function ``(config, on_round=, on_start=, resume=, overwrite=) -> summary``. To add an engine, write its
launcher and name it in :data:`ENGINES` (and in ``RunConfig.engine``'s choices, :mod:`fedtune.config`).
The launchers import their engine when called, so that ``fedtune`` starts without loading Flower.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedtune.run_folder import check_free, move_aside
from fedtune.runtime import resolve_run


def _embedded(config: Any, overwrite: bool = False, **kw: Any) -> dict:
    from fedtune.run import run_experiment

    return run_experiment(config, overwrite=overwrite, **kw)  # claims the folder once every input is checked


def _claim_run_folder(config: Any, resume: bool, overwrite: bool) -> None:
    """Before any Flower process starts: a fresh run's folder is free, or its earlier run moved aside."""
    if not resume:
        run_dir = resolve_run(config).run_dir
        if overwrite:
            move_aside(run_dir)
        else:
            check_free(run_dir)


def _flower_simulation(config: Any, overwrite: bool = False, **kw: Any) -> dict:
    from fedtune.engines.flower.simulation import run_flower_simulation

    _claim_run_folder(config, kw["resume"], overwrite)
    return run_flower_simulation(config, **kw)


def _flower_deployment(config: Any, overwrite: bool = False, **kw: Any) -> dict:
    from fedtune.engines.flower.deployment import run_flower_deployment

    _claim_run_folder(config, kw["resume"], overwrite)
    return run_flower_deployment(config, **kw)


#: ``config.engine`` -> its launcher: clients in this process; a Flower simulation (Ray); a loopback
#: Flower deployment (SuperLink, SuperNodes, ``flwr run``).
ENGINES: dict[str, Callable[..., dict]] = {
    "embedded": _embedded,
    "flower-sim": _flower_simulation,
    "flower": _flower_deployment,
}


def launch(
    config: Any,
    on_round: Callable[[Any], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict:
    """Run ``config`` on ``config.engine`` and return the summary (also in the run folder's
    ``summary.json``); ``on_round`` gets each round's record, ``on_start`` the resolved run.

    A fresh run never writes into a folder holding an earlier run: ``overwrite`` moves that run
    aside (:func:`~fedtune.run_folder.move_aside`), else the run stops with one line
    (:class:`~fedtune.run_folder.RunFolderTaken`); in-process once every input is checked
    (:func:`~fedtune.run.run_experiment`), on Flower before any process starts."""
    return ENGINES[config.engine](config, on_round=on_round, on_start=on_start, resume=resume, overwrite=overwrite)
