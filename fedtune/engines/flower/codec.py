"""What crosses between fedtune and Flower: a fedtune Message as Flower records (one ArrayRecord, one
ConfigRecord), the record and node_config keys, client-id lists, and the client failure error."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from math import prod
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedtune.engines.flower.packing import KINDS, pack_arrays, unpack_arrays
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
BUNDLE_ARRAYS = "fedtune-bundle-arrays"  # ArrayRecord of a compact bundle: its clients' arrays (compact_bundle)
SLICES = "slices"  # BUNDLE key of a compact bundle: where each client's arrays lie in BUNDLE_ARRAYS (JSON)
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


def compact_bundle(content: RecordDict) -> RecordDict:
    """A bundle's ``content`` (each client's records as :func:`pack` adds them, keys suffixed
    ``-<cid>``, and :data:`BUNDLE`) in the fewest Flower objects: Flower moves every record, Array and
    chunk of a message as an object of its own, one HTTP request per hop (server -> SuperLink ->
    SuperNode -> ClientApp and back), and a SuperNode that finds a reply's object not yet pushed by
    its ClientApp waits 0.5 s for it; a bundle of 4 clients' replies was 19 objects, pushed over
    0.2-0.5 s. Here every client's arrays share one Array per dtype in :data:`BUNDLE_ARRAYS` (an Array
    two clients share, as a broadcast, once), their places in :data:`BUNDLE` under :data:`SLICES`,
    and every client's ConfigRecord entries move into :data:`BUNDLE` as ``<cid>:<key>``: 4 objects and
    an Array and chunk per dtype whatever the clients (6 for LoRA adapters). :func:`expand_bundle` is
    the inverse."""
    head = dict(cast(ConfigRecord, content[BUNDLE]))
    cids = [int(c) for c in cast(list[int], head[CLIENTS])]
    pools: dict[str, list[np.ndarray]] = {}
    sizes: dict[str, int] = {}
    placed: dict[str, list[object]] = {}  # an Array's object id -> its place [pool, start, shape]
    slices: dict[str, dict[str, list[object]]] = {}
    for cid in cids:
        if ARRAYS + f"-{cid}" not in content:
            continue  # a client that failed: its error is in the head
        slices[str(cid)] = {}
        for key, array in cast(ArrayRecord, content[ARRAYS + f"-{cid}"]).items():
            if array.object_id not in placed:
                value = array.numpy()
                pool = value.dtype.str
                pools.setdefault(pool, []).append(value.reshape(-1))
                placed[array.object_id] = [pool, sizes.get(pool, 0), list(value.shape)]
                sizes[pool] = sizes.get(pool, 0) + value.size
            slices[str(cid)][key] = placed[array.object_id]
        record = cast(ConfigRecord, content[RECORD + f"-{cid}"])
        head.update({f"{cid}:{key}": value for key, value in record.items()})
    head[SLICES] = json.dumps(slices, separators=(",", ":"))
    compact = RecordDict({BUNDLE: ConfigRecord(head)})
    compact[BUNDLE_ARRAYS] = ArrayRecord({pool: Array(np.concatenate(parts)) for pool, parts in pools.items()})
    return compact


def expand_bundle(content: RecordDict) -> RecordDict:
    """Inverse of :func:`compact_bundle`: the bundle ``content`` (a peer's: checked first, a ValueError
    names what does not match) with each client's records under its suffixed keys again, and
    :data:`BUNDLE` without theirs."""
    if BUNDLE not in content.config_records or BUNDLE_ARRAYS not in content.array_records:
        raise ValueError(f"a bundle carries {BUNDLE!r} and {BUNDLE_ARRAYS!r} records (keys: {sorted(content)})")
    head = dict(cast(ConfigRecord, content[BUNDLE]))
    pools = {key: array.numpy() for key, array in cast(ArrayRecord, content[BUNDLE_ARRAYS]).items()}
    try:
        slices = json.loads(str(head.pop(SLICES, "{}")))
    except json.JSONDecodeError as exc:
        raise ValueError(f"bundle: {SLICES!r} is not JSON ({exc})") from None
    clients = head.get(CLIENTS)
    if not isinstance(clients, list) or not all(isinstance(c, int) for c in clients) or not isinstance(slices, dict):
        raise ValueError(f"bundle: expected {CLIENTS!r} as a list of client ids and {SLICES!r} as a JSON object")
    cids = [int(c) for c in clients]
    if set(slices) - {str(c) for c in cids}:
        raise ValueError(f"bundle: arrays for clients {sorted(set(slices) - set(map(str, cids)))} it does not carry")
    for pool, value in pools.items():
        if value.ndim != 1 or value.dtype.str != pool or value.dtype.kind not in KINDS:
            raise ValueError(f"bundle: array {pool!r} holds {value.dtype.str} of shape {value.shape}, not flat {pool}")
    expanded = RecordDict()
    for cid in cids:
        prefix = f"{cid}:"
        record = {k.removeprefix(prefix): head.pop(k) for k in [k for k in head if k.startswith(prefix)]}
        places = slices.get(str(cid))
        if not record and places is None:
            continue  # a client that failed
        if not record or not isinstance(places, dict):
            raise ValueError(f"bundle: client {cid} has {'a record' if record else 'arrays'} only")
        arrays = {}
        for key, place in places.items():
            pool, start, shape = _place(place, key)
            if pool not in pools or start + prod(shape) > pools[pool].size:
                raise ValueError(f"bundle: client {cid}'s {key!r} lies outside the bundle's arrays")
            arrays[key] = Array(pools[pool][start : start + prod(shape)].reshape(shape))
        expanded[ARRAYS + f"-{cid}"] = ArrayRecord(arrays)
        expanded[RECORD + f"-{cid}"] = ConfigRecord(record)
    expanded[BUNDLE] = ConfigRecord(head)
    return expanded


def _place(place: object, key: str) -> tuple[str, int, list[int]]:
    """A :data:`SLICES` entry ``[pool, start, shape]`` checked (``key``: the array's, for the error)."""
    if (
        isinstance(place, list)
        and len(place) == 3
        and isinstance(place[0], str)
        and isinstance(place[1], int)
        and place[1] >= 0
        and isinstance(place[2], list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in place[2])
    ):
        return place[0], place[1], place[2]
    raise ValueError(f"bundle: the place of {key!r} is not [array, start, shape]: {place!r}")


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
