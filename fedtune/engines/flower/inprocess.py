"""The loopback deployment's ServerApp, run in fedtune's own process.

Stock Flower runs a ServerApp as ``flower-superlink`` -> SuperExec -> ``flwr-serverapp``: two more
processes, the second importing torch and loading the model again beside the ``fedtune run``
process that already has them. The loopback deployment starts its SuperLink with ``--isolation
process`` instead, and this process claims the run's ServerApp task from the SuperLink's Runtime
API itself (signed with the SuperLink's SuperExec secret), as Flower's SuperExec would, and runs
fedtune's server (:func:`fedtune.engines.flower.serverapp.serve`) on a Flower ``HttpGrid`` with
the task's token: the same Grid, messages and SuperNodes as ``flwr-serverapp``, in this process.
The run's rounds are reported to ``on_round`` as they end, and Ctrl-C stops the run after its
round's checkpoint as on the embedded engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from fedtune.engines.rounds import RoundRecord
from fedtune.process import DeploymentError
from fedtune.runtime import ResolvedRun

CLAIM_WAIT_S = 120.0  # how long the submitted run's ServerApp task may take to appear


def serve_run(
    address: str,
    secret: bytes,
    root_certificates: bytes | None,
    run: ResolvedRun,
    on_round: Callable[[RoundRecord], None] | None = None,
    resume: bool = False,
    timeout: float | None = None,
    request_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Claim the ServerApp task of the run just submitted to the SuperLink at ``address`` (its
    Runtime API; TLS with ``root_certificates``, PEM bytes) with its SuperExec ``secret``, serve
    ``run`` on it in this process and mark the task completed (failed when the run raised);
    the summary. ``on_round``, ``resume``, ``timeout``, ``request_config``: as
    :func:`~fedtune.engines.flower.serverapp.serve`'s."""
    from flwr.common.constant import SubStatus
    from flwr.common.serde import context_from_proto, run_from_proto
    from flwr.proto.runtime_pb2 import PullTaskInputRequest, PushTaskOutputRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.superlink.grid import HttpGrid

    from fedtune.engines.flower.runtime_api import claim_tasks, runtime_client, task_heartbeat
    from fedtune.engines.flower.serverapp import serve

    claims = runtime_client(address, root_certificates, secret=secret)
    deadline = time.monotonic() + CLAIM_WAIT_S
    try:
        token = next(claim_tasks(claims, TaskType.SERVER_APP, idle=lambda: time.monotonic() < deadline), None)
    finally:
        claims.close()
    if token is None:
        raise DeploymentError(f"the SuperLink at {address} handed out no ServerApp task within {CLAIM_WAIT_S:.0f} s")
    task = runtime_client(address, root_certificates, token=token)
    heartbeat = task_heartbeat(task)
    grid = HttpGrid(address, insecure=root_certificates is None, root_certificates=root_certificates, token=token)
    status, details = SubStatus.FAILED, "ServerApp failed"
    try:
        given = task.PullTaskInput(PullTaskInputRequest())
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = (
            given.task_id,
            given.run.run_id,
            context_from_proto(given.context).node_id,
        )
        grid.set_run(run_from_proto(given.run))
        summary = serve(grid, run, timeout, on_round, resume=resume, request_config=request_config)
        status, details = SubStatus.COMPLETED, ""
        return summary
    except BaseException as exc:
        details = f"ServerApp failed: {type(exc).__name__}: {exc}"
        raise
    finally:
        try:
            task.PushTaskOutput(PushTaskOutputRequest(sub_status=status, details=details))
        finally:
            heartbeat.stop()
            grid.close()
            task.close()
