"""The server side on Flower: the engine over a Grid, and the ServerApp that runs a fedtune run
(:func:`fedtune.run.run_experiment`) with it."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import HttpGrid

from fedtune.config import RunConfig
from fedtune.engines.flower.budgets import adopt_reports
from fedtune.engines.flower.codec import CLIPPING_NORM, TIMING_FILE, keeps_timing
from fedtune.engines.flower.runconfig import config_from_run_config
from fedtune.engines.flower.standby import Standby
from fedtune.engines.flower.transport import GridTransport, discover_nodes
from fedtune.engines.flower.worker import SHARED
from fedtune.engines.rounds import Engine, RoundFailed, RoundRecord, RunInterrupted
from fedtune.process import setup_process
from fedtune.runtime import ResolvedRun, as_resolved, resolve_run


class FlowerEngine(Engine):
    """Rounds over a Flower Grid: nodes are discovered on first use (:func:`discover_nodes`);
    client state lives on the nodes (``context.state``), not in the server's checkpoint. ``run``: the
    resolved run; ``grid``: the ServerApp's; ``timeout``: the wait for nodes and, without
    ``federation.round_timeout_s``, for a round's replies; ``request_config``: sent with every
    request; ``resume``: the run folder's timing file is kept (:data:`TIMING_FILE`: written only
    without DP and SecAgg+, :func:`~fedtune.engines.flower.codec.keeps_timing`). On a deployment
    (Flower's ``HttpGrid``) idle nodes get standby messages between their requests (:mod:`.standby`).
    ``shares_base``: a node served in this process trains on the server's base (:data:`.worker.SHARED`
    gets the server's context)."""

    name = "flower"

    def __init__(
        self,
        run: ResolvedRun,
        grid: Grid,
        timeout: float | None = None,
        request_config: Mapping[str, Any] | None = None,
        resume: bool = False,
        shares_base: bool = False,
    ) -> None:
        super().__init__(run.config)
        self.shares_base = shares_base
        self.run_dir = run.run_dir
        self.grid, self.timeout, self.request_config, self.resume = grid, timeout, request_config, resume
        # a deployment's ServerApp (not the simulation's) keeps its SuperNodes from Flower's 3 s idle
        # sleep from the nodes' discovery on
        self.standby = Standby(grid) if isinstance(grid, HttpGrid) else None
        self._transport: GridTransport | None = None
        self._reports: dict[int, tuple[str, Any]] = {}  # client id -> (its node, the budget it reported)

    def prepare(self, context: Any) -> None:
        """Discover the nodes, plan ``context`` from the budgets they report (the other clients' from
        the config) and send each node-budgeted client its planned setting with every request
        (:func:`~fedtune.engines.flower.budgets.adopt_reports`)."""
        if self.shares_base:
            SHARED.server = context
        transport = self.transport()
        transport.settings = adopt_reports(context, self._reports)

    def transport(self) -> GridTransport:
        """The Grid transport (SecAgg+ under ``secure_aggregation.enabled``), built on first use."""
        if self._transport is None:
            fed = self.config.federation
            if self.standby is not None:
                self.standby.start()
            node_of = discover_nodes(self.grid, fed.num_clients, self.timeout, self._reports, self.standby)
            timing = self.run_dir / TIMING_FILE if keeps_timing(self.config) else None  # never under DP
            if timing is not None and not self.resume:
                timing.unlink(missing_ok=True)
            wait = fed.round_timeout_s or self.timeout
            if self.config.secure_aggregation.enabled:  # SecAgg+: the server sees only the sum of the updates
                from fedtune.engines.flower.secagg import SecAggPlusTransport

                self._transport = SecAggPlusTransport(
                    self.grid, node_of, self.config, self.config.seed, wait, self.request_config
                )
            else:
                self._transport = GridTransport(self.grid, node_of, wait, self.request_config, timing)
            self._transport.standby = self.standby
        return self._transport

    def run(self, strategy: Any, *args: Any, **kwargs: Any) -> list[RoundRecord]:
        """The rounds of ``strategy`` (:meth:`Engine.run`, with its ``args`` and ``kwargs``); a
        deployment's standby messages stop with them."""
        try:
            return super().run(strategy, *args, **kwargs)
        finally:
            self.close()

    def close(self) -> None:
        """Stop a deployment's standby messages (idempotent): after the rounds, or where the run
        ends before them (the nodes' discovery timed out, the budget plan or an input refused)."""
        if self.standby is not None:
            self.standby.stop()


def serve(
    grid: Grid,
    run: RunConfig | ResolvedRun,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
    request_config: Mapping[str, Any] | None = None,
    shares_base: bool = False,
) -> dict[str, Any]:
    """Run ``run``'s method (a resolved run, or a config resolved here) over ``grid`` and write the
    run folder exactly as the embedded engine does (:func:`fedtune.run.run_experiment`, summary
    marked ``"engine": "flower"``); ``on_round``, ``on_start``, ``resume`` as there; ``timeout``,
    ``request_config`` and ``shares_base`` as :class:`FlowerEngine`'s: with ``shares_base`` the run
    holds the base's turn but while it waits for replies (:class:`.worker.SharedBase`)."""
    from fedtune.run import run_experiment

    run = as_resolved(run)
    setup_process(run.config.train.threads)
    engine = FlowerEngine(run, grid, timeout, request_config, resume, shares_base)
    with SHARED.turn() if shares_base else nullcontext():
        try:
            return run_experiment(run, on_round, on_start, engine=engine, resume=resume)
        finally:
            engine.close()
            if shares_base:
                SHARED.server = None


STATUS_FILE = "server_status.json"  # run folder: how the ServerApp's run ended (read by a deployment)


def write_status(path: Path, status: str, **detail: Any) -> None:
    """The ServerApp's outcome ``status`` (``ok``, ``round_failed``, ``interrupted`` or ``error``, with
    its message or round: ``detail``) as JSON at ``path``, written atomically: what a deployment
    reports, not log text. Not written where the run folder (``path``'s) does not exist: a run that
    stopped on its inputs writes nothing."""
    if not path.parent.is_dir():
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"status": status, **detail}))
    tmp.replace(path)


def read_status(run_dir: Path, since: float, remove: bool = False) -> dict[str, Any] | None:
    """The status a ServerApp wrote in ``run_dir`` at or after ``since`` (epoch s), else None;
    ``remove``: then delete the file (a launcher that read it: the run folder holds what the
    embedded engine writes, nothing more)."""
    path = run_dir / STATUS_FILE
    try:
        if path.stat().st_mtime < since - 1:
            return None
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    finally:
        if remove:
            path.unlink(missing_ok=True)
    return status if isinstance(status, dict) and isinstance(status.get("status"), str) else None


def make_server_app(
    run: RunConfig | ResolvedRun | None = None,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
) -> ServerApp:
    """A ServerApp running ``run`` (a resolved run or a config; default: the config in Flower's run
    config, resolved once in the ServerApp's process) with :func:`serve`;
    ``timeout`` bounds the wait for nodes and for each round's replies (None: wait forever).
    From Flower's run config it also reads ``resume`` (continue the run folder), ``timeout``
    (seconds, 0: none) and ``clipping-norm`` (> 0: ask the nodes' clipping mods for it).
    ``on_round``, ``on_start``: as :func:`serve`'s."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        rc = context.run_config
        resolved = as_resolved(run) if run is not None else resolve_run(config_from_run_config(rc))
        wait = timeout if "timeout" not in rc else (float(rc["timeout"]) or None)
        clip = float(rc.get("clipping-norm", 0) or 0)
        status = resolved.run_dir / STATUS_FILE
        try:
            serve(
                grid,
                resolved,
                wait,
                on_round,
                on_start,
                resume=resume or bool(rc.get("resume", False)),
                request_config={CLIPPING_NORM: clip} if clip > 0 else None,
            )
        except RoundFailed as exc:
            write_status(status, "round_failed", message=str(exc))
            raise
        except RunInterrupted as exc:
            write_status(status, "interrupted", round=exc.round)
            raise
        except Exception as exc:
            write_status(status, "error", message=f"{type(exc).__name__}: {exc}")
            raise
        write_status(status, "ok")

    return app


#: The module-level ServerApp of deployments (``flwr run``): the run config comes from Flower's run config.
server_app = make_server_app()
