"""Flower's simulation (Ray backend, one virtual SuperNode per client) of a fedtune run."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from fedtune.config import ConfigError, RunConfig
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.serverapp import STATUS_FILE, make_server_app
from fedtune.engines.rounds import RoundRecord
from fedtune.process import ReapDescendants, setup_process
from fedtune.runtime import ResolvedRun, as_resolved


# -- simulation ----------------------------------------------------------------------------------
def ray_backend_config(num_supernodes: int, verbose: bool = False, gpus_per_client: float = 0.0) -> dict[str, Any]:
    """Flower's Ray backend config for a small offline machine: 1 CPU per ClientApp, a private
    local Ray instance (never someone else's cluster) of at most ``num_supernodes`` CPUs, no dashboard,
    its logs shown when ``verbose``; ``gpus_per_client``
    (``placement.gpus_per_client``): the GPU fraction of each ClientApp, over this machine's GPUs
    (Ray sets each actor's CUDA_VISIBLE_DEVICES), none by default."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    gpus = 0
    if gpus_per_client:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not gpus:
            raise ConfigError("placement.gpus_per_client: this machine has no CUDA device")
    return {
        "client_resources": {"num_cpus": 1, "num_gpus": float(gpus_per_client)},
        "init_args": {
            "address": "local",
            "num_cpus": max(1, min(num_supernodes, os.cpu_count() or 1)),
            "num_gpus": gpus,
            "include_dashboard": False,
            "logging_level": "INFO" if verbose else "ERROR",
            "log_to_driver": verbose,
        },
    }


def run_flower_simulation(
    run: RunConfig | ResolvedRun,
    num_supernodes: int | None = None,
    backend_config: dict[str, Any] | None = None,
    timeout: float | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    verbose: bool = False,
    on_start: Callable[[Any], None] | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run ``run`` (a resolved run, or a config resolved here) as a Flower ServerApp (in this
    process, handed the resolved run) + ClientApp (each Ray actor resolves its config once) with
    ``flwr.simulation.run_simulation`` (Ray backend, one virtual SuperNode per client,
    :func:`ray_backend_config` updated with ``backend_config``; Ray is shut down at the end);
    return the summary (``summary.json``). ``num_supernodes``: must be the number of clients (the
    default); ``timeout``, ``on_round``, ``on_start``, ``resume``: the ServerApp's
    (:func:`~fedtune.engines.flower.serverapp.make_server_app`); ``verbose``: Flower's and Ray's logs.
    A ClientApp failure is a drop; a round without ``federation.min_replies`` valid replies
    raises :class:`~fedtune.engines.rounds.RoundFailed`."""
    run = as_resolved(run)
    config = run.config
    num_clients = config.federation.num_clients
    num_supernodes = num_clients if num_supernodes is None else num_supernodes
    if num_supernodes != num_clients:
        raise ValueError(f"num_supernodes={num_supernodes}: one node plays one client, expected {num_clients}")
    setup_process()
    backend = ray_backend_config(num_supernodes, verbose, config.placement.gpus_per_client)
    for key, value in (backend_config or {}).items():
        backend[key] = {**backend.get(key, {}), **value} if isinstance(value, dict) else value

    import ray
    from flwr.simulation import run_simulation

    pythonpath = os.environ.get("PYTHONPATH")  # Flower's Ray backend overwrites it with sys.path
    with ReapDescendants():
        try:
            run_simulation(
                make_server_app(run, timeout, on_round, on_start, resume),
                make_client_app(config),
                num_supernodes,
                backend_config=backend,
                verbose_logging=verbose,
            )
        finally:
            (run.run_dir / STATUS_FILE).unlink(missing_ok=True)  # for deployments; here exceptions propagate
            if ray.is_initialized():  # the backend shuts Ray down itself unless it failed early
                ray.shutdown()
            if pythonpath is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = pythonpath
    summary: dict[str, Any] = json.loads((run.run_dir / "summary.json").read_text())
    return summary
