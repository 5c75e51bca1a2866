"""Embedded engine: every client in this process, sequential, deterministic under the run's seed.

Every message crosses as bytes (encode, then decode on the other side), and the bytes accounted
are the bytes that crossed. The clients get a RunContext of their own (:class:`EmbeddedEngine`):
server and clients exchange nothing but Messages; given the server's context, the clients' shares
its frozen LoRA base (one base per process, see :class:`~fedtune.runtime.RunContext`). With
several client devices the clients run in one worker process per device instead
(:mod:`fedtune.engines.device_pool`), through the same :meth:`LocalTransport.deliver`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fedtune.engines.local import LocalTransport, exchange
from fedtune.engines.rounds import Engine, RoundPolicy, RoundRecord, Transport, drive_rounds
from fedtune.protocol.client import Client
from fedtune.protocol.strategy import Strategy
from fedtune.runtime import ResolvedRun, RunContext

__all__ = ["EmbeddedEngine", "LocalTransport", "exchange", "run_rounds"]  # LocalTransport, exchange: from engines.local


def run_rounds(
    strategy: Strategy,
    make_client: Callable[[int, dict[str, np.ndarray]], Client],
    num_clients: int,
    sample_size: int,
    rounds: int,
    seed: int,
    eval_every: int = 1,
    on_round: Callable[[RoundRecord], None] | None = None,
    start_round: int = 1,
    policy: RoundPolicy = RoundPolicy(),
) -> list[RoundRecord]:
    """The embedded engine's rounds: :func:`drive_rounds` of ``strategy`` with in-process clients from
    ``make_client`` (:class:`LocalTransport`); ``num_clients``, ``sample_size``, ``rounds``, ``seed``,
    ``eval_every``, ``on_round``, ``start_round`` and ``policy`` as there."""
    return drive_rounds(
        strategy,
        LocalTransport(make_client, seed),
        num_clients,
        sample_size,
        rounds,
        seed,
        eval_every,
        on_round,
        start_round,
        policy,
    )


class EmbeddedEngine(Engine):
    """The default engine of :func:`fedtune.run.run_experiment`: every client in this process, on
    a RunContext of its own; or, with two or more client devices
    (:func:`~fedtune.engines.device_pool.client_devices`), in one worker process per device
    (:class:`~fedtune.engines.device_pool.DevicePool`), stopped when the run ends. Its client
    states are part of the run's checkpoint."""

    name = "embedded"

    def __init__(self, run: ResolvedRun, server: RunContext | None = None) -> None:
        """``server``: the server's RunContext, whose LoRA workspace in-process clients share."""
        from fedtune.engines.device_pool import DevicePool, client_devices

        config = run.config
        super().__init__(config)
        devices = client_devices(config)
        if devices:
            self.local: LocalTransport | DevicePool = DevicePool(config, devices, config.train.threads)
        else:
            self.local = LocalTransport(RunContext(run, shares_base=server).client, config.seed)

    def transport(self) -> Transport:
        """The in-process clients, or the device pool's."""
        return self.local

    def run(self, *args: Any, **kwargs: Any) -> list[RoundRecord]:
        """:meth:`Engine.run` with its ``args`` and ``kwargs``; the client workers, if any, are stopped
        when it returns or raises."""
        try:
            return super().run(*args, **kwargs)
        finally:
            close = getattr(self.local, "close", None)
            if close is not None:
                close()

    def state_dict(self) -> dict[str, Any]:
        """The clients' states by client id (a string: the checkpoint's key)."""
        return {str(cid): dict(state) for cid, state in self.local.states.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the clients' states from ``state`` (:meth:`state_dict`)."""
        self.local.states = {int(cid): dict(s) for cid, s in state.items()}
