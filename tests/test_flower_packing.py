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
