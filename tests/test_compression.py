"""Tests for top-k upload compression (fedtune.protocol.compression, Kuo et al. 2024): the kept
entries, the exact encoded bytes, decoding, and its composition with FedIT and FSLoRA uploads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fedtune.config import load_config
from fedtune.engines.embedded import run_rounds
from fedtune.methods.base.averaging import decode_update
from fedtune.methods.base.lora_arrays import lora_pairs
from fedtune.methods.fslora import SHARED_SKETCH, read_indices
from fedtune.protocol.compression import IDX, SHAPE, VAL, is_topk_encoded, topk_count, topk_decode, topk_encode
from fedtune.protocol.messages import Message
from fedtune.runtime import RunContext, resolve_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HAS_SST2 = (Path(os.environ.get("FEDTUNE_DATA_DIR", "data")) / "sst2" / "train.tsv").is_file()
DATA = "sst2" if HAS_SST2 else "tweets"
RANK = 8


def distinct_magnitudes(shape, seed=0) -> np.ndarray:
    """Random signs and a random order of distinct magnitudes: no ties by construction."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    magnitudes = (rng.permutation(size) + 1).astype(np.float32) / size
    return (magnitudes * rng.choice([-1.0, 1.0], size)).astype(np.float32).reshape(shape)


def header_len(meta: dict, specs: list[list]) -> int:
    return len(json.dumps({"meta": meta, "arrays": specs}, separators=(",", ":")).encode())


# -- the codec -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(32, 8), (8, 32), (2,), (3, 4, 5), (1,)])
@pytest.mark.parametrize("ratio", [0.05, 0.25, 0.5, 1.0])
def test_topk_keeps_exactly_the_k_largest_magnitudes(shape, ratio):
    x = distinct_magnitudes(shape, seed=len(shape) + int(ratio * 100))
    k = topk_count(x.size, ratio)
    enc = topk_encode({"w": x}, ratio)
    reference = np.sort(np.argsort(-np.abs(x).ravel(), kind="stable")[:k])  # sort-based top-k
    assert enc["w" + IDX].dtype == np.int32 and enc["w" + VAL].dtype == np.float32
    np.testing.assert_array_equal(enc["w" + IDX], reference)
    np.testing.assert_array_equal(enc["w" + VAL], x.ravel()[reference])
    np.testing.assert_array_equal(enc["w" + SHAPE], np.array(shape, dtype=np.int64))
    dense = topk_decode(enc)["w"]
    kept = np.zeros(x.size, dtype=bool)
    kept[reference] = True
    np.testing.assert_array_equal(dense.ravel()[kept], x.ravel()[kept])
    assert np.all(dense.ravel()[~kept] == 0)
    assert np.abs(x).ravel()[~kept].max(initial=0) < np.abs(x).ravel()[kept].min()


def test_topk_count_is_ceil_of_ratio_times_size_at_least_one():
    assert topk_count(30, 0.1) == 3  # 0.1 * 30 = 3.0000000000000004 in floating point
    assert topk_count(10, 0.25) == 3
    assert topk_count(1000, 0.001) == 1 and topk_count(5, 0.01) == 1
    assert topk_count(7, 1.0) == 7 and topk_count(0, 0.5) == 0
    with pytest.raises(ValueError):
        topk_count(10, 0.0)


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5])
def test_topk_bytes_are_the_encoded_bytes_and_match_the_formula(ratio):
    """len(Message.encode()) = 8 + header + sum over arrays of k * (4 + 4) + 8 * ndim."""
    arrays = {
        "a.lora_A.weight": distinct_magnitudes((8, 32), 1),
        "a.lora_B.weight": distinct_magnitudes((32, 8), 2),
        "classifier.bias": distinct_magnitudes((2,), 3),
        "t": distinct_magnitudes((3, 4, 5), 4),
    }
    meta = {"train_loss": 0.5, "num_examples": 12}
    message = Message(topk_encode(arrays, ratio), meta)
    encoded = message.encode()
    assert len(encoded) == message.nbytes
    specs, payload = [], 0
    for name, x in arrays.items():
        k = topk_count(x.size, ratio)
        specs += [[name + IDX, "<i4", [k]], [name + VAL, "<f4", [k]], [name + SHAPE, "<i8", [x.ndim]]]
        payload += k * (4 + 4) + 8 * x.ndim
    assert len(encoded) == 8 + header_len(meta, specs) + payload
    decoded = topk_decode(Message.decode(encoded).arrays)
    assert decoded.keys() == arrays.keys()
    assert all(decoded[n].shape == x.shape for n, x in arrays.items())


def test_decode_passes_through_arrays_outside_the_codec_and_rejects_malformed_triples():
    enc = topk_encode({"w": distinct_magnitudes((4, 4))}, 0.25)
    index = np.array([1, 5, 6], dtype=np.int32)
    out = topk_decode({**enc, SHARED_SKETCH: index})
    assert out.keys() == {"w", SHARED_SKETCH} and out[SHARED_SKETCH] is index
    assert not is_topk_encoded({"w": np.zeros(3)}) and is_topk_encoded(enc)
    with pytest.raises(ValueError, match="outside"):
        topk_decode({**enc, "w" + IDX: np.array([0, 1, 2, 99], dtype=np.int32)})
    with pytest.raises(ValueError, match="as many values"):
        topk_decode({**enc, "w" + VAL: np.zeros(3, dtype=np.float32)})
    with pytest.raises(ValueError, match="lacks"):
        topk_decode({"w" + IDX: enc["w" + IDX]})
    with pytest.raises(TypeError):
        topk_encode({"i": np.arange(4)}, 0.5)  # index sets are not updates: never compressed


# -- composition with the methods' uploads --------------------------------------------------------------


def run_one_round(method: str, *overrides: str):
    config = load_config(
        None,
        [
            "model.name=tiny-bert",
            f"data={DATA}",
            "data.max_train_samples=120",
            "data.max_test_samples=16",
            f"model.lora_rank={RANK}",
            "train.local_steps=2",
            "train.batch_size=8",
            f"method={method}",
            "federation.num_clients=2",
            *overrides,
        ],
    )
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    strategy = server.strategy()
    strategy.initialize()
    before = {k: v.copy() for k, v in strategy.global_arrays.items()}
    replies = {}

    class Spy:
        def __init__(self, cid, state):
            self.cid, self.client = cid, clients.client(cid, state)

        def __getattr__(self, name):  # everything else (state, evaluate) is the client's
            return getattr(self.client, name)

        def fit(self, message):
            reply = self.client.fit(message)
            replies[self.cid] = Message.decode(reply.encode())
            return reply

    history = run_rounds(strategy, Spy, 2, 2, 1, config.seed, eval_every=1)
    return strategy, before, history[0], replies


def test_topk_composes_with_fslora_sliced_uploads_and_never_touches_the_index():
    ratio = 0.25
    strategy, before, record, replies = run_one_round(
        "fslora", f"federation.upload_topk={ratio}", "federation.profiles=[{sketch_ratio=0.5},{sketch_ratio=0.25}]"
    )
    pairs = strategy.pairs
    shapes = {k: v.shape for k, v in before.items()}
    for cid, k in ((0, 4), (1, 2)):
        reply = replies[cid]
        assert reply.arrays[SHARED_SKETCH].dtype == np.int32 and reply.arrays[SHARED_SKETCH].shape == (k,)
        # the index arrives whole (read_indices raises unless it holds k distinct ranks in 0..r-1)
        assert len(read_indices(reply.arrays, pairs, RANK)[pairs[0][0]]) == k
        # the encoded shapes are the sliced ones: top-k runs on Delta B[:, I], Delta A[I, :], the head
        sliced = dict(shapes)
        for a_name, b_name in pairs:
            sliced[a_name], sliced[b_name] = (k, shapes[a_name][1]), (shapes[b_name][0], k)
            assert tuple(reply.arrays[a_name + SHAPE]) == sliced[a_name]
            assert tuple(reply.arrays[b_name + SHAPE]) == sliced[b_name]
        specs, payload = [[SHARED_SKETCH, "<i4", [k]]], 4 * k
        for name, shape in sliced.items():
            n = topk_count(int(np.prod(shape)), ratio)
            specs += [[name + IDX, "<i4", [n]], [name + VAL, "<f4", [n]], [name + SHAPE, "<i8", [len(shape)]]]
            payload += n * 8 + 8 * len(shape)
        assert record.client_bytes_up[cid] == 8 + header_len(reply.meta, specs) + payload
        update = decode_update({n: v for n, v in reply.arrays.items() if n != SHARED_SKETCH})
        for a_name, _ in pairs:
            assert update[a_name].shape == sliced[a_name]
            assert np.count_nonzero(update[a_name]) <= topk_count(update[a_name].size, ratio)
    # aggregation: only the union of the two index sets moved, and at most the kept entries
    sets = [read_indices(replies[c].arrays, pairs, RANK)[pairs[0][0]] for c in (0, 1)]
    untouched = np.setdiff1d(np.arange(RANK), np.union1d(*sets))
    for a_name, b_name in pairs:
        assert np.array_equal(strategy.global_arrays[a_name][untouched, :], before[a_name][untouched, :])
        assert np.array_equal(strategy.global_arrays[b_name][:, untouched], before[b_name][:, untouched])
        changed = np.count_nonzero(strategy.global_arrays[b_name] != before[b_name])
        assert 0 < changed <= sum(topk_count(shapes[b_name][0] * len(s), ratio) for s in sets)


def test_topk_composes_with_fedit_uploads():
    ratio = 0.1
    strategy, before, record, replies = run_one_round("fedit", f"federation.upload_topk={ratio}")
    for cid, reply in replies.items():
        assert is_topk_encoded(reply.arrays)
        assert {n.removesuffix(IDX) for n in reply.arrays if n.endswith(IDX)} == before.keys()
        payload = sum(topk_count(v.size, ratio) * 8 + 8 * v.ndim for v in before.values())
        assert record.client_bytes_up[cid] == Message(reply.arrays, reply.meta).nbytes
        assert record.client_bytes_up[cid] - payload == Message(reply.arrays, reply.meta).header_nbytes
    for name, v in before.items():
        changed = np.count_nonzero(strategy.global_arrays[name] != v)
        assert changed <= 2 * topk_count(v.size, ratio)
    assert any(
        np.count_nonzero(strategy.global_arrays[n] != v) for n, v in before.items() if n in dict(lora_pairs(before))
    )


# -- the bfloat16 wire dtype --------------------------------------------------------------------------
NAN_BITS = [0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001, 0xFFC00001, 0x7F80FFFF]


def test_bfloat16_bits_equal_torchs_rounding_and_every_nan_bit_pattern_stays_nan():
    """The encoder against torch's float32 -> bfloat16 on ordinary values, ties, subnormals, the
    largest floats and infinities (bit for bit), and every NaN bit pattern (signalling, negative,
    all payloads) decodes to NaN, which the reply check rejects: without the NaN branch the
    rounding carry turns them into inf, -0.0 or +0.0, and +0.0 passes as finite."""
    import torch

    from fedtune.protocol.compression import bfloat16_bits, from_bfloat16_bits, wire_decode, wire_encode
    from fedtune.protocol.validation import ArraySpec, check_arrays

    rng = np.random.default_rng(0)
    special = np.array([0x00000001, 0x007FFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x80000000])
    values = np.concatenate([rng.standard_normal(4096).astype(np.float32), special.astype(np.uint32).view(np.float32)])
    want = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bfloat16_bits(values), want)
    nans = np.array(NAN_BITS, dtype=np.uint32).view(np.float32)
    assert np.isnan(from_bfloat16_bits(bfloat16_bits(nans))).all()
    decoded = wire_decode(wire_encode({"a": nans}, "bfloat16"))
    assert check_arrays(decoded, {"a": ArraySpec((len(NAN_BITS),))}) == "array 'a': non-finite values"
