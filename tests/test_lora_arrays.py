"""Tests for the one home of LoRA array algebra (fedtune.methods.base.lora_arrays): names, rank
selections (FSLoRA's slices and scatters; truncation and zero padding as their I = 0..k-1 case)."""

from __future__ import annotations

import numpy as np
import pytest

from fedtune.methods.base.lora_arrays import (
    a_name,
    add_ranks,
    array_rank,
    b_name,
    head_arrays,
    leading,
    lora_pairs,
    lora_paths,
    module_path,
    pad_rank,
    put,
    take,
    take_ranks,
    truncate_rank,
)

PATHS = ["enc.0.query", "enc.0.value"]


def adapter(rng, rank=6, m=5, n=4) -> dict[str, np.ndarray]:
    out = {}
    for p in PATHS:
        out[a_name(p)] = rng.normal(size=(rank, n)).astype(np.float32)
        out[b_name(p)] = rng.normal(size=(m, rank)).astype(np.float32)
    out["classifier.weight"] = rng.normal(size=(2, 3)).astype(np.float32)
    return out


def test_names():
    arrays = adapter(np.random.default_rng(0))
    assert lora_paths(arrays) == PATHS
    assert lora_pairs(arrays) == [(f"{p}.lora_A.weight", f"{p}.lora_B.weight") for p in PATHS]
    assert module_path("enc.0.query.lora_B.weight") == "enc.0.query"
    assert set(head_arrays(arrays)) == {"classifier.weight"} and array_rank(arrays) == 6
    with pytest.raises(ValueError):
        module_path("classifier.weight")


def test_take_is_B_columns_and_A_rows_and_put_is_its_inverse_scatter():
    rng = np.random.default_rng(1)
    arrays = adapter(rng)
    index = np.array([1, 4, 5])
    sliced = take_ranks(arrays, index)
    for p in PATHS:
        np.testing.assert_array_equal(sliced[a_name(p)], arrays[a_name(p)][[1, 4, 5], :])
        np.testing.assert_array_equal(sliced[b_name(p)], arrays[b_name(p)][:, [1, 4, 5]])
        for name in (a_name(p), b_name(p)):
            back = put(name, sliced[name], index, 6)
            kept = take(name, back, index)
            np.testing.assert_array_equal(kept, sliced[name])  # put then take: identity
            outside = take(name, back, np.setdiff1d(np.arange(6), index))
            assert np.all(outside == 0)  # zeros outside I
    assert sliced["classifier.weight"] is arrays["classifier.weight"]
    per_module = take_ranks(arrays, {a_name(PATHS[0]): index, a_name(PATHS[1]): np.array([0])})
    assert per_module[b_name(PATHS[1])].shape == (5, 1)


def test_truncation_and_zero_padding_are_the_leading_index_case():
    arrays = adapter(np.random.default_rng(2))
    trunc = truncate_rank(arrays, 2)
    for p in PATHS:
        np.testing.assert_array_equal(trunc[a_name(p)], arrays[a_name(p)][:2])
        np.testing.assert_array_equal(trunc[b_name(p)], arrays[b_name(p)][:, :2])
        padded = pad_rank(b_name(p), trunc[b_name(p)], 6)
        assert padded.dtype == np.float64 and np.all(padded[:, 2:] == 0)
        np.testing.assert_array_equal(padded, put(b_name(p), trunc[b_name(p)], leading(2), 6, np.float64))


def test_add_ranks_adds_a_weighted_slice_in_place():
    rng = np.random.default_rng(3)
    total = np.zeros((6, 4), dtype=np.float32)
    x = rng.normal(size=(2, 4)).astype(np.float32)
    add_ranks(total, a_name("m"), x, np.array([0, 3]), 0.5)
    np.testing.assert_array_equal(total, put(a_name("m"), 0.5 * x, np.array([0, 3]), 6))
    head = np.ones(3, dtype=np.float32)
    add_ranks(head, "classifier.bias", np.ones(3, dtype=np.float32), None, 2.0)
    np.testing.assert_array_equal(head, np.full(3, 3.0))


def test_convolution_lora_product_is_what_peft_computes(tiny_config):
    """A convolution's LoRA (A (r, c_in, kh, kw), B (c_out, r, 1, 1)): W0 + s B A with the product
    taken as matrices and reshaped onto the conv weight gives the adapted model's outputs
    exactly; put / take keep the trailing dimensions; a fresh A has PEFT's conv fan-in bound."""
    import torch

    from fedtune.methods.base.lora_arrays import fresh_lora_a, is_head, lora_scale, pair_product
    from fedtune.methods.base.ranked import merged_into_base
    from fedtune.runtime import RunContext, resolve_run

    config = tiny_config(
        "task=image-classification",
        "model.name=small-cnn",
        "data.name=digits",
        "data.max_train_samples=40",
        "data.max_test_samples=16",
        "model.lora_rank=3",
        "model.lora_alpha=6",
    )
    ctx = RunContext(resolve_run(config))
    ws = ctx.workspace
    rng = np.random.default_rng(0)
    arrays = {k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in ws.state(3).items()}
    convs = [p for p in lora_paths(arrays) if arrays[a_name(p)].ndim == 4]
    assert convs, "the small CNN's LoRA targets are convolutions"
    batch = next(ctx.task.train_batches(np.arange(8), 8, 1, np.random.default_rng(0)))
    ws.load(arrays, 3)
    ws.model.eval()
    with torch.no_grad():
        adapted = ctx.task.loss(ws.model, batch)
    zero = {k: (v if is_head(k) else np.zeros_like(v)) for k, v in arrays.items()}
    ws.load(zero, 3)
    deltas = {p: lora_scale(6, 3) * pair_product(arrays, p) for p in lora_paths(arrays)}
    with merged_into_base(ws, deltas), torch.no_grad():
        merged = ctx.task.loss(ws.model, batch)
    assert torch.allclose(adapted, merged, atol=1e-5)
    a = arrays[a_name(convs[0])]
    assert put(a_name(convs[0]), take(a_name(convs[0]), a, np.array([2, 0])), np.array([2, 0]), 3).shape == a.shape
    fresh = fresh_lora_a(a_name(convs[0]), a.shape, 0, 1, 0)
    assert np.abs(fresh).max() <= 1 / np.sqrt(np.prod(a.shape[1:])) and fresh.shape == a.shape
