"""Message encoding and exact byte accounting."""

import numpy as np
import pytest

from fedtune.protocol.messages import Message


def test_roundtrip_preserves_arrays_dtypes_and_meta():
    msg = Message(
        {
            "a": np.arange(6, dtype=np.float32).reshape(2, 3),
            "i": np.array([3, 1], dtype=np.int32),
            "e": np.zeros((0, 4)),
            "s": np.float64(2.5),
        },
        {"round": 3, "name": "x", "nested": {"k": [1, 2]}},
    )
    back = Message.decode(msg.encode())
    assert back.meta == msg.meta
    assert list(back.arrays) == ["a", "i", "e", "s"] and back.arrays["s"].shape == ()
    for k in msg.arrays:
        assert back.arrays[k].dtype == msg.arrays[k].dtype
        assert np.array_equal(back.arrays[k], msg.arrays[k])


def test_reported_bytes_equal_encoding_length():
    rng = np.random.default_rng(0)
    msg = Message({f"w{i}": rng.normal(size=(i + 1, 7)).astype(np.float32) for i in range(5)}, {"round": 1})
    data = msg.encode()
    assert msg.nbytes == len(data)
    assert msg.payload_nbytes == sum(4 * (i + 1) * 7 for i in range(5))
    assert msg.header_nbytes == len(data) - msg.payload_nbytes


def test_decoded_arrays_do_not_alias_the_sender():
    src = np.ones(4, dtype=np.float32)
    back = Message.decode(Message({"x": src}).encode())
    back.arrays["x"][0] = 5
    assert src[0] == 1


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    msg = Message({"t": torch.ones(2, 2)})
    assert msg.arrays["t"].dtype == np.float32


@pytest.mark.parametrize("bad", [b"", b"XXXX\x00\x00\x00\x00", Message({"a": np.ones(2)}).encode() + b"!"])
def test_decode_rejects_malformed_bytes(bad):
    with pytest.raises(ValueError):
        Message.decode(bad)
