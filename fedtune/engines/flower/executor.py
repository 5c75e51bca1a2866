"""A node's long-lived ClientApp executor: one process per SuperNode that keeps the model and data
warm and answers every message of every run in place, instead of Flower's ``flwr-clientapp``
process per message.

A SuperNode started with ``--isolation process`` starts no SuperExec: its Runtime API (HTTP, on
``127.0.0.1:<--port>``) waits for an outside process to claim each message's task. This is that
process. It does what Flower's SuperExec and ``flwr-clientapp`` do together, through the same
Runtime API calls and Flower's own client functions: claim a task (``AcquireTask``, signed with
the SuperNode's ``--superexec-auth-secret-file`` secret, so no other local process can claim one),
pull its input (the node's Context, the run, the FAB) and its message, run fedtune's ClientApp
(:data:`fedtune.engines.flower.clientapp.client_app`) on it in this process, push the reply and
the Context (the clients' state) back, and mark the task done. A FAB naming another ClientApp is
answered with an error reply: this executor runs fedtune's app only (it installs no code).

Nothing of Flower is patched; the module uses the Runtime API client and message helpers Flower's
own ``flwr-clientapp`` uses (Flower 1.41: ``flwr.supercore.runtime``,
``flwr.supernode.runtime.run_clientapp``).

    python -m fedtune.engines.flower.executor --runtime-api-address 127.0.0.1:9094 \\
        --secret-file node.secret [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import threading
import time
from pathlib import Path

#: the component of fedtune's ClientApp in a FAB (``[tool.flwr.app.components] clientapp``)
CLIENT_APP_REF = "fedtune.engines.flower.clientapp:client_app"
STOP_WAIT_S = 60.0  # how long a node served in place may finish its task when the deployment stops


def write_secret(path: Path) -> Path:
    """A fresh random SuperExec secret at ``path`` (mode 0600 from the start; an existing file is
    replaced): a SuperNode's or SuperLink's ``--superexec-auth-secret-file`` and its executor's."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_hex(32).encode())
    return path


def serve_task(address: str, token: str, identify: bool = True, stop: threading.Event | None = None) -> bool:
    """Run one claimed task (``token``) of the SuperNode at ``address``: pull the Context, run and
    message, answer it with fedtune's ClientApp in this process, push the reply and the Context
    back and mark the task completed (failed, with an error reply, when the app raised or the FAB
    names another ClientApp), as ``flwr-clientapp`` does. A standby (:mod:`.standby`) leaves the
    Context as it was (not pushed back), sends no task heartbeat (one request fewer of the dozen a
    standby costs; it ends long before Flower's heartbeat deadline) and is answered no sooner than
    :data:`.standby.REPLY_AFTER_S` after the claim (:func:`.standby.hold_reply`). ``identify``: set
    Flower's process-wide task identity to the task's (False in the server's process:
    :class:`NodeThread`); ``stop``: once set, a call to the SuperNode that fails is not retried
    (:func:`.runtime_api.retry_invoker`). Returns whether the task was a standby."""
    from flwr.app import Error
    from flwr.app import Message as FlowerMessage
    from flwr.common.config import get_fab_config
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    from fedtune.engines.flower.clientapp import client_app
    from fedtune.engines.flower.runtime_api import pull_task_input, runtime_client, task_heartbeat
    from fedtune.engines.flower.standby import STANDBY, hold_reply

    claimed = time.monotonic()
    client = runtime_client(address, token=token, stop=stop)
    heartbeat = message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed"
    try:
        message, context, _, fab = pull_task_input(client, identify)
        if message.metadata.message_type != STANDBY:  # a standby ends within a second: no heartbeat
            heartbeat = task_heartbeat(client)
        ref = get_fab_config(fab.content)["tool"]["flwr"]["app"]["components"]["clientapp"]
        if ref != CLIENT_APP_REF:
            raise RuntimeError(f"this node's fedtune executor runs {CLIENT_APP_REF} only; the run's app names {ref}")
        reply = client_app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # noqa: BLE001 - answered as Flower answers a failing ClientApp
        details = f"{type(exc)}:<'{exc}'>"
        if message is not None:
            reply = FlowerMessage(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        standby = message is not None and message.metadata.message_type == STANDBY
        try:
            if reply is not None and context is not None:
                if standby:
                    hold_reply(claimed, stop)
                push_message(client, reply, context)
        finally:
            push_task_output(client, None if standby else context, status, details)
            if heartbeat is not None:
                heartbeat.stop()
            client.close()
    return standby


def serve_tasks(address: str, secret: bytes, stop: threading.Event | None = None, identify: bool = True) -> None:
    """Claim and serve the ClientApp tasks of the SuperNode at ``address`` (signed with ``secret``),
    one at a time, until the SuperNode goes away or ``stop`` is set (asked while no task waits):
    every message of the node in this process (:func:`serve_task`; a task that fails on the way,
    its reply or output refused, is reported on stderr and the next one served); the next claim
    after a standby waits :data:`.standby.CLAIM_AFTER_S` (no task can come sooner). ``identify``,
    ``stop``: as :func:`serve_task`'s."""
    from flwr.supercore.constant import TaskType

    from fedtune.engines.flower.runtime_api import claim_tasks, runtime_client, task_claimed_at
    from fedtune.engines.flower.standby import CLAIM_AFTER_S

    idle = (lambda: True) if stop is None else (lambda: not stop.is_set())
    pause = time.sleep if stop is None else stop.wait
    for token in claim_tasks(runtime_client(address, secret=secret, stop=stop), TaskType.CLIENT_APP, idle):
        task_claimed_at[0] = time.time()
        standby = False
        try:
            standby = serve_task(address, token, identify, stop)
        except Exception as exc:  # noqa: BLE001 - a task the SuperNode dropped meanwhile: serve the next
            print(f"fedtune executor: task not completed ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        finally:
            task_claimed_at[0] = None
        if standby:
            pause(CLAIM_AFTER_S)


def run_executor(address: str, secret: bytes, threads: int | None = None) -> None:
    """A node's executor process: :func:`serve_tasks` of the SuperNode at ``address`` (signed with
    ``secret``) until it goes away. ``threads``: torch threads (a run's ``train.threads`` first)."""
    from fedtune.process import setup_process

    setup_process(threads)
    import peft  # noqa: F401

    import fedtune.engines.flower.clientapp  # noqa: F401
    import fedtune.runtime  # noqa: F401 - torch, transformers, PEFT: imported before the first message

    serve_tasks(address, secret)


class NodeThread:
    """A node's executor as a thread of the server's process (the loopback deployment's first node):
    :func:`serve_tasks` of the SuperNode at ``address`` (``secret``) between :meth:`start` and
    :meth:`stop`, its requests trained on the server's base in turn with the server
    (:func:`~fedtune.engines.flower.worker.serving_in_place`): one process and one base fewer than an
    executor process, the embedded engine's memory plus the SuperLink's and SuperNodes'. It leaves
    Flower's process-wide task identity to the server (the instruction messages it pushes)."""

    def __init__(self, address: str, secret: bytes) -> None:
        self.address, self.secret = address, secret
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> NodeThread:
        """Start serving (idempotent); the process's threads share their malloc arenas from now on
        (:func:`~fedtune.process.limit_malloc_arenas`: the node's freed training buffers reused by the
        server's evaluation, as in the embedded engine's one thread)."""
        from fedtune.process import limit_malloc_arenas

        limit_malloc_arenas()
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, daemon=True, name="fedtune-node-in-place")
            self.thread.start()
        return self

    def _serve(self) -> None:
        from fedtune.engines.flower.worker import serving_in_place

        with serving_in_place():
            try:
                serve_tasks(self.address, self.secret, self.done, identify=False)
            except Exception:
                if not self.done.is_set():  # the SuperNode went away while the deployment runs: say so
                    raise

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop claiming tasks and wait up to ``timeout`` s for the one in progress (a straggler's, past
        its round's timeout: it ends on its own, its reply refused by the stopped SuperNode); from
        now on a call to the SuperNode that fails gives up instead of retrying."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(timeout)
            self.thread = None


def main(argv: list[str] | None = None) -> None:
    """``python -m fedtune.engines.flower.executor``: :func:`run_executor` from the command line
    (``argv``: its arguments; None: ``sys.argv``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, HOST:PORT")
    parser.add_argument("--secret-file", required=True, type=Path, help="the SuperNode's SuperExec secret file")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    args = parser.parse_args(argv)
    run_executor(args.runtime_api_address, args.secret_file.read_bytes(), args.threads or None)


if __name__ == "__main__":
    main()
