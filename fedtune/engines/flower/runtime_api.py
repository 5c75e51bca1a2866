"""Flower's Runtime API as fedtune's executors use it (a node's ClientApp executor, the loopback
deployment's in-process ServerApp): a client, task claims and heartbeats, and pulling a message and
its objects without Flower's 1 s back-off.

Flower 1.41 lists a message as soon as its sender has pushed the message itself, before its
objects (records, arrays) have arrived; whoever pulls it then retries each missing object after
1 s, 2 s, 4 s (``PULL_INITIAL_BACKOFF``). A reply pulled by the ServerApp 0.05 s after it appeared,
or a request claimed by a node's executor while its SuperNode still fetches it from the SuperLink,
so waited 1 to 3 s for objects that arrived a few milliseconds later. These functions do what
Flower's ``HttpGrid.pull_messages`` and ``flwr-clientapp``'s ``pull_task_input`` do, through the
same Flower functions, with a retry after :data:`BACKOFF_S` s (doubling up to :data:`BACKOFF_CAP_S`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

BACKOFF_S = 0.01  # first retry of an object not there yet (Flower: 1 s)
BACKOFF_CAP_S = 0.25  # longest wait between two retries (Flower: 10 s)
POLL_MIN_S = 0.01  # seconds between two task claims right after a task
POLL_MAX_S = 0.1  # ... growing to this while there is none
_ACQUIRE = "/flwr.proto.Runtime/AcquireTask"  # the Runtime API call the SuperExec secret signs

#: epoch seconds at which this process (a node's executor) claimed the task it is serving (None:
#: none), read by the ClientApp for its timing in place of a per-message process's start
task_claimed_at: list[float | None] = [None]


def retry_invoker(stop: threading.Event | None = None) -> Any:
    """Flower's HTTP retry invoker (a refused connection or a 502/503/504 retried without end, waits
    growing to 20 s); with ``stop``, one that gives up once ``stop`` is set, its wait cut short then.
    A node served in place (:class:`~.executor.NodeThread`) whose SuperNode went away while it
    pulled a message would otherwise retry for ever, and the pull's worker threads, joined at
    interpreter exit, keep the finished ``fedtune run`` from exiting."""
    from flwr.supercore.retry import make_simple_http_retry_invoker

    invoker = make_simple_http_retry_invoker()
    flower_gives_up = invoker.should_giveup
    if stop is None or flower_gives_up is None:
        return invoker

    def wait(seconds: float) -> None:
        stop.wait(seconds)

    invoker.should_giveup = lambda exc: stop.is_set() or flower_gives_up(exc)
    invoker.wait_function = wait
    return invoker


def runtime_client(
    address: str,
    root_certificates: bytes | None = None,
    token: str | None = None,
    secret: bytes | None = None,
    stop: threading.Event | None = None,
) -> Any:
    """A Flower Runtime API client of the SuperLink or SuperNode at ``address`` (TLS when
    ``root_certificates``, the CA's PEM bytes, are given): with a task's ``token``, or claiming tasks
    with the SuperExec ``secret``; its calls stop retrying once ``stop`` is set (:func:`retry_invoker`)."""
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    if secret is not None:
        interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods=[_ACQUIRE]))
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=root_certificates is None,
        root_certificates=root_certificates,
        interceptors=interceptors,
        retry_invoker=retry_invoker(stop),
    )


def claim_tasks(client: Any, task_type: str, idle: Callable[[], bool] = lambda: True) -> Iterator[str]:
    """The tokens of the ``task_type`` tasks (``flwr-clientapp``, ``flwr-serverapp``) ``client`` claims,
    as they appear: claims are polled every :data:`POLL_MIN_S` s after a task, backing off to
    :data:`POLL_MAX_S` s; ``idle()`` is asked between two polls that found none (False: stop)."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest

    request = AcquireTaskRequest(supported_task_types=[task_type])
    wait = POLL_MIN_S
    while True:
        claimed = client.AcquireTask(request)
        if claimed.HasField("task") and claimed.token:
            yield claimed.token
            wait = POLL_MIN_S
            continue
        if not idle():
            return
        time.sleep(wait)
        wait = min(POLL_MAX_S, wait * 1.5)


def task_heartbeat(client: Any) -> Any:
    """Flower's task heartbeat sender for ``client``'s task (started); unlike ``flwr-clientapp``'s, a
    task its SuperNode or SuperLink no longer knows does not interrupt this (long-lived) process."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest
    from flwr.supercore.heartbeat import HeartbeatSender

    def beat() -> bool:
        try:
            client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except httpx.TransportError:
            return False  # retried by the sender
        except httpx.HTTPStatusError:
            pass  # the task is gone: its output's push will say so
        return True

    sender = HeartbeatSender(beat)
    sender.start()
    return sender


def pull_task_input(client: Any, identify: bool = True) -> tuple[Any, Any, Any, Any]:
    """Flower's ``pull_task_input`` of ``flwr-clientapp`` (the claimed task's message, Context, run and
    FAB from the SuperNode's Runtime ``client``), its objects retried after :data:`BACKOFF_S` s;
    ``identify``: Flower's process-wide ``TaskIdentity`` set to the task's, as there (False: left
    as it is, in a process whose server pushes instruction messages under its own)."""
    from flwr.app import Message
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest, PullTaskInputRequest
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    if identify:
        TaskIdentity.task_id, TaskIdentity.run_id = res.task_id, res.run.run_id
        TaskIdentity.node_id = res.context.node_id
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message,
        initial_backoff=BACKOFF_S,
        backoff_cap=BACKOFF_CAP_S,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # the deflated message lacks its own id
    return message, context, run, fab


def pull_replies(grid: Any, message_ids: Iterable[str]) -> list[Any]:
    """The replies to ``message_ids`` that reached the SuperLink, as ``grid.pull_messages`` returns
    them; on Flower's ``HttpGrid`` (a deployment's ServerApp) their objects are retried after
    :data:`BACKOFF_S` s (a reply whose objects never arrive becomes an error reply, as there);
    another Grid (the simulation's, a test's) is asked as is."""
    from flwr.superlink.grid import HttpGrid

    if not isinstance(grid, HttpGrid):
        return list(grid.pull_messages(message_ids))
    from flwr.app import Error, Message, Metadata
    from flwr.app.message import make_message
    from flwr.common.constant import ErrorCode
    from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest
    from flwr.proto.runtime_pb2 import PullAppMessagesRequest
    from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
    from flwr.supercore.date import now
    from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
    from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
    from flwr.supercore.inflatable.inflatable_utils import (
        ObjectPullError,
        inflate_object_from_contents,
        pull_objects,
    )

    runtime, node, run_id = grid._runtime_client, grid.node, grid.run.run_id  # noqa: SLF001 - HttpGrid's own
    res = runtime.PullMessages(PullAppMessagesRequest(message_ids=list(message_ids)))
    replies: list[Any] = []
    for proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
        msg_id = proto.metadata.message_id
        try:
            contents = pull_objects(
                [t.object_id for t in iterate_object_tree(tree)],
                make_pull_object_fn_protobuf(runtime.PullObject, node, run_id),
                initial_backoff=BACKOFF_S,
                backoff_cap=BACKOFF_CAP_S,
            )
        except ObjectPullError as exc:
            metadata = Metadata(
                run_id=run_id,
                message_id="",
                src_node_id=node.node_id,
                dst_node_id=node.node_id,
                message_type=SYSTEM_MESSAGE_TYPE,
                group_id="",
                ttl=0,
                reply_to_message_id=proto.metadata.reply_to_message_id,
                created_at=now().timestamp(),
            )
            error = Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=f"Reply message objects are unavailable: {exc}")
            replies.append(make_message(metadata=metadata, error=error))
            continue
        runtime.ConfirmMessageReceived(
            ConfirmMessageReceivedRequest(node=node, run_id=run_id, message_object_id=msg_id)
        )
        message = cast(Message, inflate_object_from_contents(msg_id, contents))
        message.metadata.__dict__["_message_id"] = msg_id
        replies.append(message)
    return replies
