"""A message's arrays cross Flower as one Array per dtype (fedtune/engines/flower/packing.py): exact
round trips, Flower's clipping mod sees the same norm, few objects per message, and a peer's
record or layout that does not match is refused before its arrays are read."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.app import Message as FlowerMessage

from fedtune.engines.flower import codec
from fedtune.engines.flower.packing import pack_arrays, unpack_arrays
from fedtune.protocol.messages import Message
from tests.test_flower import task_identity  # noqa: F401 - fixture


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "a.lora_A": rng.normal(size=(8, 16)).astype(np.float32),
        "a.lora_B": rng.normal(size=(16, 8)).astype(np.float32),
        "mask": np.array([True, False, True]),
        "ranks": np.array([[3, 1], [2, 7]], dtype=np.int64),
        "scalar": np.array(0.5, dtype=np.float32),
    }


def test_packed_arrays_round_trip_exactly_with_one_array_per_dtype():
    arrays = _arrays()
    record, layout = pack_arrays(arrays)
    assert sorted(record) == ["<f4", "<i8", "|b1"]
    back = unpack_arrays(record, layout)
    assert list(back) == list(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)


def test_a_message_is_a_handful_of_flower_objects_whatever_its_arrays(task_identity):  # noqa: F811
    """What crosses each hop: Flower moves every object of a message in its own request."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    rng = np.random.default_rng(0)
    many = {f"layer{i}.lora_{ab}": rng.normal(size=(8, 64)).astype(np.float32) for i in range(30) for ab in "AB"}
    content, _ = codec.pack(Message(many, {"round": 1}), cid=0)
    message = FlowerMessage(content, dst_node_id=1, message_type="train", group_id="1")
    packed = len(get_all_nested_objects(message))
    per_array = RecordDict({"a": ArrayRecord({k: Array(v) for k, v in many.items()}), "c": ConfigRecord({})})
    unpacked = len(get_all_nested_objects(FlowerMessage(per_array, dst_node_id=1, message_type="train")))
    assert packed <= 6 < 120 < unpacked  # 60 arrays: an Array and a chunk each when sent one by one


def test_flowers_clipping_mod_clips_the_packed_update_to_the_same_norm(task_identity):  # noqa: F811
    from flwr.clientapp.mod import fixedclipping_mod

    floats = {k: v for k, v in _arrays().items() if v.dtype == np.float32}  # the mod scales in place: floats
    request = Message(floats | {"half": np.ones(5, np.float16)}, {"round": 1})
    update = {k: np.full_like(v, 0.5) for k, v in request.arrays.items()}
    norm = float(np.sqrt(sum(np.sum(u.astype(np.float64) ** 2) for u in update.values())))
    content, _ = codec.pack(request, 0, clipping_norm=norm / 4)
    incoming = FlowerMessage(content, dst_node_id=1, message_type="train", group_id="1")

    def app(message, context):  # replies received + update, as fedtune's ClientApp does under clipping
        reply = Message({k: request.arrays[k] + v for k, v in update.items()}, {})
        return FlowerMessage(codec.pack(reply, 0)[0], reply_to=message)

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    out = fixedclipping_mod(incoming, context, app)
    assert not out.has_error()
    _, clipped, _ = codec.unpack(out.content)
    got = {k: clipped.arrays[k] - request.arrays[k] for k in update}
    got_norm = float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in got.values())))
    np.testing.assert_allclose(got_norm, norm / 4, rtol=1e-5)
    for k, u in update.items():  # the direction kept: every coordinate scaled alike
        np.testing.assert_allclose(got[k], u / 4, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda r, lay: (r, "{}"), "expected a list of"),
        (lambda r, lay: (r, json.dumps([["x", "<f4"]])), "expected a list of"),
        (lambda r, lay: (r, json.dumps([["x", "<f4", [-1]]])), "expected a list of"),
        (lambda r, lay: (r, json.dumps([["x", "<f4", [2.5]]])), "expected a list of"),
        (lambda r, lay: (r, json.dumps([["x", "<f4", [1]], ["x", "<f4", [1]]])), "appears twice"),
        (lambda r, lay: (r, json.dumps([["x", "|O", [1]]])), "not a number type"),
        (lambda r, lay: (r, json.dumps([["x", "no-such-type", [1]]])), "not a number type"),
        (lambda r, lay: (r, json.dumps([["x", "<f4", [10**6]]])), r"the layout \(1000000,\)"),  # longer than sent
        (lambda r, lay: (ArrayRecord({"<f8": Array(np.ones(4))}), lay), "holds dtypes"),
        (lambda r, lay: (ArrayRecord({"<f4": Array(np.ones((2, 2), np.float32))}), lay), "the layout"),
        (lambda r, lay: (ArrayRecord({"<f4": Array(np.ones(4, np.float64))}), lay), "holds <f8"),
    ],
)
def test_a_record_that_does_not_match_its_layout_is_refused(edit, expected):
    record, layout = pack_arrays({"x": np.ones(4, np.float32)})
    record, layout = edit(record, layout)
    with pytest.raises(ValueError, match=expected):
        unpack_arrays(record, layout)


def test_a_reply_with_a_bad_layout_is_a_drop_naming_it(task_identity):  # noqa: F811
    from fedtune.engines.flower.transport import GridTransport

    sent = Message({"w": np.ones(2, dtype=np.float32)}, {"round": 1})
    content, _ = codec.pack(sent, 4, **{codec.ROUND: 1})
    content[codec.RECORD][codec.LAYOUT] = json.dumps([["w", "<f4", [3]]])  # claims more than it carries
    reply = FlowerMessage(content, dst_node_id=1, message_type="train")
    got = GridTransport._delivery(reply, 4, "", sent, 10, {})
    assert got.reply is None and got.error.startswith("undecodable reply") and "(3,)" in got.error


# -- bundles: a node's clients of one exchange in one message, in the fewest Flower objects ----------
def _bundle(cids: list[int], failed: tuple[int, ...] = (), broadcast: dict | None = None) -> RecordDict:
    """A bundle as GridTransport (``broadcast``: one Message for every client) or fedtune's ClientApp
    (each client its own arrays; ``failed``: clients that raised) build it before compaction."""
    content = RecordDict()
    shared = codec.pack_arrays(broadcast) if broadcast is not None else None
    for cid in cids:
        if cid in failed:
            continue
        arrays = broadcast or {
            "lora_A": np.full((2, 3), cid, np.float32),
            "lora_B": np.arange(4, dtype=np.float32) * cid,
            "steps": np.array([cid, cid + 1], np.int64),
            "half": np.full(5, 0.5 * cid, np.float16),
        }
        extra = {codec.ROUND: 3, codec.COMPUTE_S: 0.25 * cid, codec.PHASE: "train", "flag": cid % 2 == 0}
        codec.pack(Message(arrays, {"n": cid}), cid, shared, f"-{cid}", content, **extra)
    errors = {f"error-{c}": "ValueError: boom" for c in failed}
    content[codec.BUNDLE] = ConfigRecord({codec.CLIENTS: cids, **errors, "t-enter": 1.5})
    return content


def _objects(content: RecordDict) -> int:
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return len(get_all_nested_objects(FlowerMessage(content, dst_node_id=1, message_type="train", group_id="1")))


def _through_flower(content: RecordDict) -> RecordDict:
    """``content`` deflated into Flower's objects and inflated back, as it crosses a hop."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    message = FlowerMessage(content, dst_node_id=1, message_type="train", group_id="1")
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    return inflate_object_from_contents(message.object_id, contents).content


def test_a_compact_bundle_is_six_flower_objects_and_expands_to_every_clients_records(task_identity):  # noqa: F811
    """A bundle was a ConfigRecord, an ArrayRecord and an Array and chunk per dtype for every client,
    each object an HTTP request per hop (4 float32 LoRA replies: 19); compact, 4 and an Array and chunk
    per dtype whatever the clients, and exactly the same records back."""
    original = _bundle([0, 1, 2, 5], failed=(2,))
    compact = codec.compact_bundle(_bundle([0, 1, 2, 5], failed=(2,)))
    assert _objects(original) == 3 + 3 * (2 + 2 * 3) and _objects(compact) == 4 + 2 * 3  # 3 dtypes
    assert _objects(codec.compact_bundle(_bundle(list(range(12))))) == 4 + 2 * 3
    back = codec.expand_bundle(_through_flower(compact))
    assert sorted(back) == sorted(original)
    assert dict(back[codec.BUNDLE]) == dict(original[codec.BUNDLE])  # clients, the error, the times
    for cid in (0, 1, 5):
        record, sent = dict(back[f"{codec.RECORD}-{cid}"]), dict(original[f"{codec.RECORD}-{cid}"])
        assert record == sent and [type(v) for v in record.values()] == [type(v) for v in sent.values()]
        got, want = codec.unpack(back, f"-{cid}"), codec.unpack(original, f"-{cid}")
        assert got[0] == want[0] == cid and got[1].encode() == want[1].encode()  # arrays, dtypes, shapes, meta


def test_a_broadcast_travels_once_in_a_compact_bundle(task_identity):  # noqa: F811
    adapter = {"lora_A": np.linspace(0, 1, 600, dtype=np.float32).reshape(20, 30), "scale": np.ones(1, np.float32)}
    compact = codec.compact_bundle(_bundle(list(range(8)), broadcast=adapter))
    assert [a.numpy().size for a in compact[codec.BUNDLE_ARRAYS].values()] == [601]  # one copy, not 8
    back = codec.expand_bundle(_through_flower(compact))
    for cid in range(8):
        arrays = codec.unpack(back, f"-{cid}")[1].arrays
        assert list(arrays) == list(adapter) and all(np.array_equal(arrays[k], adapter[k]) for k in adapter)


def _edit_slices(edit):
    def apply(content: RecordDict) -> None:
        head = content[codec.BUNDLE]
        slices = json.loads(head[codec.SLICES])
        edit(slices)
        head[codec.SLICES] = json.dumps(slices)

    return apply


def _set_head(key, value):
    def apply(content: RecordDict) -> None:
        content[codec.BUNDLE][key] = value

    return apply


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_edit_slices(lambda s: s["0"]["<f4"].__setitem__(1, 10**6)), "lies outside"),  # reads past its pool
        (_edit_slices(lambda s: s["0"]["<f4"].__setitem__(2, [10**6])), "lies outside"),
        (_edit_slices(lambda s: s["0"]["<f4"].__setitem__(0, "<f8")), "lies outside"),  # a pool not there
        (_edit_slices(lambda s: s["0"]["<f4"].__setitem__(1, -2)), r"not \[array, start, shape\]"),
        (_edit_slices(lambda s: s["0"].__setitem__("<f4", [["<f4"], 0, [2]])), r"not \[array, start, shape\]"),
        (_edit_slices(lambda s: s["0"]["<f4"].__setitem__(2, [2.5])), r"not \[array, start, shape\]"),
        (_edit_slices(lambda s: s.__setitem__("9", {})), "clients .'9'. it does not carry"),
        (_edit_slices(lambda s: s.pop("1")), "client 1 has a record only"),
        (_set_head(codec.SLICES, "{not json"), "'slices' is not JSON"),
        (_set_head(codec.SLICES, "[]"), "JSON object"),
        (_set_head(codec.CLIENTS, "0,1"), "list of client ids"),
        (lambda c: c[codec.BUNDLE_ARRAYS].__setitem__("<f4", Array(np.ones((2, 2), np.float32))), "not flat"),
        (lambda c: c[codec.BUNDLE_ARRAYS].__setitem__("<f4", Array(np.ones(40))), "holds <f8"),
        (lambda c: c.__delitem__(codec.BUNDLE_ARRAYS), "carries"),
    ],
)
def test_a_peers_compact_bundle_that_does_not_add_up_is_refused(task_identity, edit, expected):  # noqa: F811
    compact = _through_flower(codec.compact_bundle(_bundle([0, 1])))
    edit(compact)
    with pytest.raises(ValueError, match=expected):
        codec.expand_bundle(compact)


class _Grid:
    """A grid whose nodes answer each bundle as fedtune's ClientApp would (every array + its client id),
    ``tamper(node, content)`` editing a node's compact reply as a hostile peer would."""

    def __init__(self, tamper=lambda node, content: None):
        self.replies, self.sent, self.tamper = {}, [], tamper

    def push_messages(self, messages):
        import uuid

        ids = []
        for message in messages:
            self.sent.append(message)
            message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            asked = codec.expand_bundle(message.content)
            content = RecordDict()
            for cid in asked[codec.BUNDLE][codec.CLIENTS]:
                _, request, _ = codec.unpack(asked, f"-{cid}")
                reply = Message({k: v + cid for k, v in request.arrays.items()}, {"cid": cid})
                codec.pack(reply, cid, suffix=f"-{cid}", into=content, **{codec.ROUND: 1, codec.COMPUTE_S: 0.5})
            times = dict(zip(codec.TIMES, (10.0, 10.5, 12.0)))
            content[codec.BUNDLE] = ConfigRecord({codec.CLIENTS: asked[codec.BUNDLE][codec.CLIENTS], **times})
            content = codec.compact_bundle(content)
            self.tamper(message.metadata.dst_node_id, content)
            self.replies[message.metadata.message_id] = FlowerMessage(content, reply_to=message)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def test_a_bundle_reply_that_does_not_decode_drops_its_clients_only(task_identity):  # noqa: F811
    """GridTransport over a grid whose node 2 answers its bundle with slices past its arrays: clients 2
    and 3 are drops naming why, clients 0 and 1 (node 1's bundle) are delivered."""
    from fedtune.engines.flower.transport import GridTransport

    def past_its_arrays(node, content):
        if node == 2:
            _edit_slices(lambda s: s["2"]["<f4"].__setitem__(1, 10**6))(content)

    grid = _Grid(past_its_arrays)
    transport = GridTransport(grid, {0: 1, 1: 1, 2: 2, 3: 2}, timeout=5)
    sent = Message({"w": np.arange(3, dtype=np.float32)}, {"round": 1})
    got = transport("train", 1, dict.fromkeys(range(4), sent))
    assert [_objects(m.content) for m in grid.sent] == [6, 6]  # the request bundles: compact, the broadcast once
    for cid in (0, 1):
        assert got[cid].error is None and got[cid].sender == cid
        np.testing.assert_array_equal(got[cid].reply.arrays["w"], sent.arrays["w"] + cid)
    for cid in (2, 3):
        assert got[cid].reply is None and got[cid].error.startswith("undecodable reply") and "outside" in got[cid].error


@pytest.mark.parametrize("bad", ["soon", float("nan"), float("inf")])
def test_a_peers_timing_field_that_is_not_a_number_leaves_the_timing_file_only(task_identity, tmp_path, bad):  # noqa: F811
    """The times a node's reply carries for the timing file are a peer's: node 2's ``t-enter`` that is
    not a finite number must neither crash the server nor reach the file; its clients' updates, which
    do not depend on it, are delivered, and node 1's times are written as measured."""
    from fedtune.engines.flower.transport import GridTransport

    def bad_time(node, content):
        if node == 2:
            content[codec.BUNDLE]["t-enter"] = bad

    timing = tmp_path / "flower_timing.jsonl"
    transport = GridTransport(_Grid(bad_time), {0: 1, 1: 1, 2: 2, 3: 2}, timeout=5, timing_path=timing)
    got = transport("train", 1, dict.fromkeys(range(4), Message({"w": np.zeros(3, np.float32)}, {"round": 1})))
    assert all(got[cid].error is None and got[cid].sender == cid for cid in range(4))
    (line,) = [json.loads(x) for x in timing.read_text().splitlines()]
    assert list(line["clients"]) == ["0+1"]
    entry = line["clients"]["0+1"]
    assert (entry["startup_s"], entry["handler_s"], entry["compute_s"]) == (0.5, 1.5, 1.0)


@pytest.mark.parametrize(("bad", "expected"), [(float("nan"), "not finite"), (-3.0, "negative"), ("1s", "1s")])
def test_a_peers_compute_seconds_that_would_dodge_a_deadline_is_a_drop(task_identity, tmp_path, bad, expected):  # noqa: F811
    """A client's ``compute_s`` decides its deadline (``seconds > deadline_s``, which a NaN never is):
    one that is not a finite, non-negative number makes that client's reply a drop, its bundle mate's not."""
    from fedtune.engines.flower.transport import GridTransport

    def bad_seconds(node, content):
        if node == 2:
            content[codec.BUNDLE][f"3:{codec.COMPUTE_S}"] = bad

    transport = GridTransport(_Grid(bad_seconds), {0: 1, 1: 1, 2: 2, 3: 2}, timeout=5, timing_path=tmp_path / "t")
    got = transport("train", 1, dict.fromkeys(range(4), Message({"w": np.zeros(3, np.float32)}, {"round": 1})))
    assert [got[cid].error is None for cid in range(4)] == [True, True, True, False]
    assert got[3].error.startswith("undecodable reply") and expected in got[3].error
    assert [got[cid].seconds for cid in range(3)] == [0.5, 0.5, 0.5]
