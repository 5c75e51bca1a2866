"""What crosses between fedtune and Flower: a fedtune Message as Flower records (one ArrayRecord, one
ConfigRecord), the record and node_config keys, client-id lists, and the client failure error."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedtune.engines.flower.packing import pack_arrays, unpack_arrays
from fedtune.errors import FedtuneError
from fedtune.protocol.messages import Message

if TYPE_CHECKING:
    from fedtune.config import RunConfig

RECORD = "fedtune"  # RecordDict key of the ConfigRecord: meta and transport scalars
ARRAYS = "fedtune-arrays"  # RecordDict key of the ArrayRecord: the message's arrays
META = "meta"  # ConfigRecord key: JSON of Message.meta
LAYOUT = "layout"  # ConfigRecord key: JSON of the packed arrays' names, dtypes, shapes (.packing)
CID = "cid"  # ConfigRecord key: the fedtune client id the message is for / from
ROUND = "round"  # ConfigRecord key: the round a message belongs to (request) or claims (reply)
ATTEMPT = "attempt"  # ConfigRecord key of a request: the round's attempt (fault injection draws)
PHASE = "phase"  # ConfigRecord key of a request: the Strategy phase it belongs to (sent as "train")
COMPUTE_S = "compute_s"  # ConfigRecord key of a reply: seconds the Client call took on the node (not private)
CLIENTS = "clients"  # ConfigRecord key of a query reply: the client ids the node plays
CLIPPING_NORM = "clipping_norm"  # ConfigRecord key read by Flower's clipping mods (KEY_CLIPPING_NORM)
AS_WEIGHTS = "update-as-weights"  # ConfigRecord key of a request: reply with received + update
STATE = "fedtune-state"  # context.state key prefix: f"{STATE}-{cid}" holds a client's state
BUNDLE = "fedtune-bundle"  # ConfigRecord of a bundle: CLIENTS (request); CLIENTS, errors, TIMES (reply)
TIMES = ("t-process", "t-enter", "t-exit")  # reply: ClientApp process start, handler entry and exit (epoch s)
TIMING_FILE = "flower_timing.jsonl"  # run folder: where the Flower engine's time went, per exchange (not under DP)

PARTITION_ID = "partition-id"  # node_config: the one client id a node plays (Flower's convention)
NODE_CLIENTS = "fedtune-clients"  # node_config: the client ids a node plays, "0-9" or "0,3,5-7"
NODE_THREADS = "fedtune-threads"  # node_config: torch threads of the node's training

ENGINE_KEYS = ("resume", "timeout", "clipping-norm")  # Flower run config keys for the ServerApp
POLL_S = 0.05  # seconds between two pulls of replies from the grid, right after a push or a reply
POLL_MAX_S = 0.25  # ... growing to this while none arrives (each pull costs the server's process time)


def sends_compute_s(config: RunConfig) -> bool:
    """Whether a client's reply in run ``config`` carries :data:`COMPUTE_S`, its seconds on the node: not under local
    DP or SecAgg+, where the server must learn nothing of a client but the mechanism's output (a
    client's compute time depends on its data); the node then enforces its own deadline
    (:func:`~fedtune.engines.flower.worker.serve_request`). Under central DP without SecAgg+ the
    server is trusted with each update and uses it for the deadlines, but never writes or prints it."""
    return config.privacy.mode != "local" and not config.secure_aggregation.enabled


def keeps_timing(config: RunConfig) -> bool:
    """Whether replies of run ``config`` carry :data:`TIMES` and the server writes :data:`TIMING_FILE`: only without
    DP and without SecAgg+. Under DP the file would be a release outside the mechanism: its lines
    are keyed by the clients asked (the secret sample) and hold each one's data-dependent seconds,
    and even a round's total wall time depends on who was sampled, so no form of it is written."""
    return config.privacy.mode == "none" and not config.secure_aggregation.enabled


class FlowerClientError(FedtuneError, RuntimeError):
    """A ClientApp failed (or never answered); names the client ``cid`` (None: unknown), its node
    ``node_id``, the round ``rnd``, the request's ``kind`` and the ``reason``."""

    exit_code = 1

    def __init__(self, cid: int | None, node_id: int, rnd: int, kind: str, reason: str | None) -> None:
        who = f"client {cid}" if cid is not None else "a client"
        super().__init__(f"{who} (Flower node {node_id}) failed in round {rnd} ({kind}): {reason}")
        self.cid, self.node_id, self.round, self.kind, self.reason = cid, node_id, rnd, kind, reason


# -- conversion --------------------------------------------------------------------------------
def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Named ``arrays`` as an ArrayRecord (names, order, dtypes and shapes kept)."""
    return ArrayRecord({str(k): Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def from_array_record(record: ArrayRecord | None) -> dict[str, np.ndarray]:
    """Inverse of :func:`to_array_record`: the named arrays of ``record`` (None: none)."""
    return {} if record is None else {k: record[k].numpy() for k in record}


state_to_record, state_from_record = to_array_record, from_array_record  # a client's persistent state


def pack(
    message: Message,
    cid: int,
    arrays: tuple[ArrayRecord, str] | None = None,
    suffix: str = "",
    into: RecordDict | None = None,
    **extra: Any,
) -> tuple[RecordDict, int]:
    """Flower content carrying ``message`` for/from client ``cid`` (plus transport scalars such
    as ``compute_s``, not part of the accounted bytes) and the accounted bytes,
    ``message.nbytes``. The arrays travel packed, one Array per dtype, their layout in the
    ConfigRecord (:func:`.packing.pack_arrays`); ``arrays``: that packing when already built (a
    broadcast); ``suffix``/``into``: add the records, their keys suffixed, to a bundle's content;
    ``extra``: the transport scalars."""
    packed, layout = pack_arrays(message.arrays) if arrays is None else arrays
    record = ConfigRecord(
        {META: json.dumps(message.meta, separators=(",", ":")), LAYOUT: layout, CID: int(cid), **extra}
    )
    content = RecordDict() if into is None else into
    content[ARRAYS + suffix] = packed
    content[RECORD + suffix] = record
    return content, message.nbytes


def unpack(content: RecordDict, suffix: str = "") -> tuple[int, Message, int]:
    """Inverse of :func:`pack`: (client id, message, accounted bytes ``message.nbytes``) of ``content``
    (its records' keys suffixed with ``suffix``)."""
    if RECORD + suffix not in content or ARRAYS + suffix not in content:
        raise ValueError(
            f"Flower message carries no {RECORD + suffix!r} / {ARRAYS + suffix!r} records (keys: {sorted(content)})"
        )
    record = cast(ConfigRecord, content[RECORD + suffix])
    arrays = unpack_arrays(cast(ArrayRecord, content[ARRAYS + suffix]), cast(str, record[LAYOUT]))
    message = Message(arrays, json.loads(cast(str, record[META])))
    return int(cast(int, record[CID])), message, message.nbytes


def parse_clients(text: str | int) -> list[int]:
    """The client ids ``text`` names: ``"0-3,7"`` -> [0, 1, 2, 3, 7] (node_config ``fedtune-clients``)."""
    out: list[int] = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi if hi else lo) + 1))
    return out


def format_clients(ids: Iterable[int]) -> str:
    """Inverse of :func:`parse_clients`: sorted ids as ranges, ``"0-3,7"``."""
    ids = sorted(set(ids))
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)
