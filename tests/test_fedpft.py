"""FedPFT's model-level pieces (fedtune.methods.fedpft.ffn_proxy, proxy_distill, train_memory): saliency
(eq. 8) by hand and against the published ``construct_sub_model``'s selection, the FFN layouts,
keep-ratio 1.0 = the full model, eq. (13)'s normalization and its distillation on held-out
inputs, APoZ counts (eq. 14) on controlled activations, Offsite-Tuning's uniform layer drop and
the training-memory meter.

Unfaithful variants these tests catch: neurons kept in saliency order instead of their original
order (``test_selection_matches_published_construct_sub_model``), a saliency without W2's columns
(``test_saliency_is_eq8_on_a_hand_built_layer``), padding counted in APoZ
(``test_apoz_counts_follow_controlled_activations``). Tiny random models: seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedtune.methods.fedpft.distill import (
    DistillPairs,
    LayerTap,
    count_zero_activations,
    distill,
    distill_error,
    normalized_mse,
)
from fedtune.methods.fedpft.ffn_proxy import (
    ProxyShape,
    SubmodelError,
    apply_shape,
    compress_ffns,
    find_stack,
    keep_layers,
    saliency,
    top_neurons,
    uniform_choose,
    weight_product,
)
from fedtune.models.train_memory import ActivationMeter, training_peak_bytes, weight_bytes

#: the tiny transformers' shared sizes (a text model adds its vocabulary and positions)
SMALL = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
TEXT_SHAPE = {"vocab_size": 60, "max_position_embeddings": 32}


def tiny_bert(layers: int = 2, hidden: int = 16, ff: int = 32, seed: int = 0, ffn_std: float | None = None):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=60,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=ff,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertModel(cfg).eval()
    if ffn_std is not None:  # FFNs that matter (a random BERT's are tiny next to the residual)
        for layer in model.encoder.layer:
            nn.init.normal_(layer.intermediate.dense.weight, std=ffn_std)
            nn.init.normal_(layer.output.dense.weight, std=ffn_std)
    return model


def tiny_llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, num_key_value_heads=2, **TEXT_SHAPE, **SMALL)
    return LlamaModel(cfg).eval()


def tiny_vit():
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    return ViTModel(ViTConfig(image_size=8, patch_size=4, num_channels=3, num_hidden_layers=2, **SMALL)).eval()


def forward(model, batch):
    return model(**batch) if isinstance(batch, dict) else model(batch)


def token_batches(n: int, seed: int, batch: int = 8, length: int = 12, pad: bool = False):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(1, 60, (batch, length), generator=g)
        mask = torch.ones_like(ids)
        if pad:  # the last tokens of every other example are padding
            mask[::2, length // 2 :] = 0
            ids = ids * mask
        yield {"input_ids": ids, "attention_mask": mask}


# -- eq. (8) and the sub-FM ---------------------------------------------------------------------------


def test_saliency_is_eq8_on_a_hand_built_layer():
    model = tiny_bert(layers=1, hidden=2, ff=3)
    stack = find_stack(model)
    ffn = stack.ffn(0)
    with torch.no_grad():
        ffn.up.weight.copy_(torch.tensor([[1.0, 2.0], [0.0, 0.0], [2.0, 0.0]]))  # rows u_i
        ffn.up.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
        ffn.down.weight.copy_(torch.tensor([[2.0, 0.0, 1.0], [0.0, 4.0, 0.0]]))  # columns w_i
    # Saliency(i) = sqrt(sum_j u_ij^2 + w_ij^2): sqrt(1 + 4 + 4), sqrt(16), sqrt(4 + 1)
    assert torch.allclose(saliency(ffn), torch.tensor([3.0, 4.0, math.sqrt(5.0)], dtype=torch.float64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = compress_ffns(model, [0], 2 / 3)
    # the two most salient, in their original order; a saliency of W1 alone (an unfaithful
    # variant: norms sqrt 5, 0, 2) would keep neurons 0 and 2
    assert kept[0].tolist() == [0, 1]
    assert top_neurons(torch.tensor([3.0, 1.0, 3.0, 3.0]), 2).tolist() == [0, 2]  # ties: the lower index first
    ffn = find_stack(model).ffn(0)
    assert torch.equal(ffn.up.weight, before["encoder.layer.0.intermediate.dense.weight"][[0, 1]])
    assert torch.equal(ffn.up.bias, torch.tensor([0.1, 0.2]))
    assert torch.equal(ffn.down.weight, before["encoder.layer.0.output.dense.weight"][:, [0, 1]])
    after = model.state_dict()
    for name, value in before.items():  # b2, attention, LayerNorms, embeddings: copied unchanged
        if "intermediate.dense" not in name and "layer.0.output.dense.weight" not in name:
            assert torch.equal(after[name], value), name


def published_selection(model, intermediate_rank: int, layers_retained: list[int]) -> dict[int, tuple]:
    """The neuron selection of the published ``construct_sub_model`` (pzp-dzd/FedPFT,
    sub_model_construct/distill.py, BertModel branch), transcribed line by line: the published
    module does not import under transformers 5 (``find_pruneable_heads_and_indices`` is gone);
    its list of indices is stacked into a tensor, which recent torch needs for the same indexing."""
    out = {}
    for i in range(model.config.num_hidden_layers):
        if i in layers_retained:
            continue
        intermediate_weight = model.encoder.layer[i].intermediate.dense.weight.data
        intermediate_bias = model.encoder.layer[i].intermediate.dense.bias.data
        layer_output_weight = model.encoder.layer[i].output.dense.weight.data
        layer_output_bias = model.encoder.layer[i].output.dense.bias.data
        neuron_saliency = torch.cat([intermediate_weight, layer_output_weight.transpose(0, 1)], dim=1).norm(dim=1)
        neuron_retained = sorted(neuron_saliency.sort(descending=True)[1][:intermediate_rank])
        neuron_retained = torch.stack(neuron_retained)  # a list of 0-d tensors: torch >= 2.9 needs a tensor
        out[i] = (
            intermediate_weight[neuron_retained],
            intermediate_bias[neuron_retained],
            layer_output_weight[:, neuron_retained],
            layer_output_bias,
        )
    return out


def test_selection_matches_published_construct_sub_model():
    full = tiny_bert(layers=4, hidden=16, ff=64, seed=3)
    reference = published_selection(full, 16, [0, 3])
    import copy

    proxy = copy.deepcopy(full)
    compress_ffns(proxy, [1, 2], 0.25)
    stack = find_stack(proxy)
    for i, (w1, b1, w2, b2) in reference.items():
        ffn = stack.ffn(i)
        assert torch.equal(ffn.up.weight, w1) and torch.equal(ffn.up.bias, b1)
        assert torch.equal(ffn.down.weight, w2) and torch.equal(ffn.down.bias, b2)
        # the unfaithful variant "neurons re-ordered by saliency" (same function) fails this check
        by_saliency = torch.argsort(saliency(find_stack(full).ffn(i)), descending=True)[:16]
        assert not torch.equal(full.encoder.layer[i].intermediate.dense.weight[by_saliency], w1)
    for i in (0, 3):  # retained layers untouched
        assert stack.ffn(i).width == 64


@pytest.mark.parametrize("build", [tiny_bert, tiny_llama, tiny_vit], ids=["bert", "llama-gated", "vit"])
def test_keep_ratio_one_gives_the_full_model(build):
    import copy

    full = build()
    proxy = copy.deepcopy(full)
    stack = find_stack(proxy)
    kept = compress_ffns(proxy, list(range(len(stack))), 1.0)
    assert all(torch.equal(k, torch.arange(stack.ffn(0).width)) for k in kept.values())
    x = torch.rand(2, 3, 8, 8) if build is tiny_vit else next(token_batches(1, 0))
    with torch.no_grad():
        assert torch.equal(forward(full, x).last_hidden_state, forward(proxy, x).last_hidden_state)
        compress_ffns(proxy, [0], 0.5)  # and a real compression changes them
        assert not torch.allclose(forward(full, x).last_hidden_state, forward(proxy, x).last_hidden_state)


def test_gated_saliency_counts_the_gate_and_layouts_are_found():
    model = tiny_llama()
    stack = find_stack(model)
    ffn = stack.ffn(1)
    expected = (
        ffn.up.weight.double().pow(2).sum(1)
        + ffn.gate.weight.double().pow(2).sum(1)
        + ffn.down.weight.double().pow(2).sum(0)
    ).sqrt()
    assert stack.layout.name == "gated" and torch.allclose(saliency(ffn), expected)
    assert find_stack(tiny_vit()).layout.name == "mlp"
    assert find_stack(tiny_bert()).layout.name == "bert"
    with pytest.raises(SubmodelError, match="no transformer FFN found; supported layouts: BERT"):
        find_stack(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))


def test_skeleton_takes_the_proxy_shape():
    full = tiny_bert(layers=4, ff=32)
    shape = ProxyShape(layers=(0, 2, 3), widths=((1, 8),))
    skeleton = apply_shape(tiny_bert(layers=4, ff=32, seed=9), shape)
    stack = find_stack(skeleton)
    assert len(stack) == 3 and stack.ffn(1).width == 8 and stack.ffn(0).width == 32
    assert ProxyShape.from_meta(shape.to_meta()) == shape
    assert len(find_stack(full)) == 4


# -- eq. (13) ------------------------------------------------------------------------------------------


def test_distillation_loss_is_the_published_normalized_mse():
    teacher, student = tiny_bert(ffn_std=0.3), tiny_bert(ffn_std=0.3)
    compress_ffns(student, [0, 1], 0.25)
    t, s = find_stack(teacher), find_stack(student)
    pairs = DistillPairs(
        teacher, student, t.layers, s.layers, [(weight_product(t.ffn(i)).detach(), s.ffn(i)) for i in (0, 1)], mu=0.5
    )
    batch = next(token_batches(1, 1))
    loss, out_term = pairs.loss(forward, batch)
    with torch.no_grad():
        to, so = teacher(**batch, output_hidden_states=True), student(**batch, output_hidden_states=True)
        outs, weights = [], []
        for i in (0, 1):
            T, S = to.hidden_states[i + 1], so.hidden_states[i + 1]
            outs.append(((T - S) ** 2).mean() / (T**2).mean())
            WT = teacher.encoder.layer[i].output.dense.weight @ teacher.encoder.layer[i].intermediate.dense.weight
            WS = student.encoder.layer[i].output.dense.weight @ student.encoder.layer[i].intermediate.dense.weight
            weights.append(((WT - WS) ** 2).mean() / (WT**2).mean())
    assert math.isclose(float(out_term), float(sum(outs) / 2), rel_tol=1e-5)
    assert math.isclose(float(loss.detach()), float((sum(outs) + 0.5 * sum(weights)) / 2), rel_tol=1e-5)
    assert float(normalized_mse(T, T)) == 0.0


def test_distillation_lowers_its_loss_and_the_heldout_error_and_trains_only_the_ffns():
    teacher, student = tiny_bert(ffn_std=0.3), tiny_bert(ffn_std=0.3)
    compress_ffns(student, [0, 1], 0.25)
    t, s = find_stack(teacher), find_stack(student)
    student.requires_grad_(False)
    params = [p for i in (0, 1) for p in s.ffn(i).parameters()]
    for p in params:
        p.requires_grad_(True)
    pairs = DistillPairs(
        teacher, student, t.layers, s.layers, [(weight_product(t.ffn(i)).detach(), s.ffn(i)) for i in (0, 1)], mu=1.0
    )
    frozen = {
        k: v.clone()
        for k, v in student.state_dict().items()
        if "intermediate.dense" not in k and "output.dense" not in k or "attention" in k
    }
    before = distill_error(pairs, token_batches(4, 100), forward)
    losses = distill(pairs, params, token_batches(150, 1), forward, 150, lr=1e-2)
    after = distill_error(pairs, token_batches(4, 100), forward)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    assert after[0] < 0.6 * before[0] and after[1] < 0.6 * before[1]  # held-out batches (another seed)
    now = student.state_dict()
    assert all(torch.equal(now[k], v) for k, v in frozen.items())


def test_masked_distillation_leaves_other_entries_bit_identical():
    teacher, student = tiny_bert(ffn_std=0.3), tiny_bert(ffn_std=0.3)
    compress_ffns(student, [0, 1], 0.25)
    t, s = find_stack(teacher), find_stack(student)
    ffn = s.ffn(0)
    sel = torch.zeros(ffn.width, dtype=torch.bool)
    sel[[1, 5]] = True
    masks = {
        ffn.up.weight: sel[:, None].expand_as(ffn.up.weight).clone(),
        ffn.up.bias: sel.clone(),
        ffn.down.weight: sel[None, :].expand_as(ffn.down.weight).clone(),
    }
    before = {p: p.detach().clone() for p in masks}
    for p in masks:
        p.requires_grad_(True)
    distill(
        DistillPairs(teacher, student, t.layers, s.layers),
        list(masks),
        token_batches(10, 2),
        forward,
        10,
        lr=1e-2,
        masks=masks,
    )
    for p, mask in masks.items():
        assert torch.equal(p[~mask], before[p][~mask])
        assert not torch.equal(p[mask], before[p][mask])


def test_layer_tap_stops_after_the_last_tapped_layer():
    model = tiny_bert(layers=3)
    stack = find_stack(model)
    ran = []
    handle = stack.layers[2].register_forward_hook(lambda *a: ran.append(2))
    outs = LayerTap([stack.layers[0], stack.layers[1]]).run(forward, model, next(token_batches(1, 0)))
    handle.remove()
    assert len(outs) == 2 and ran == []


# -- eq. (14) ------------------------------------------------------------------------------------------


def test_apoz_counts_follow_controlled_activations():
    """W1 = 0 and a chosen b1 make every neuron's activation gelu(b1_i) at every token: neurons
    with b1 < 0 are off (a <= 0) everywhere, the others never; padding is left out."""
    model = tiny_bert(ff=8)
    stack = find_stack(model)
    ffn = stack.ffn(1)
    bias = torch.tensor([-1.0, 1.0, -2.0, 0.5, 2.0, -0.1, 3.0, 1.0])
    with torch.no_grad():
        ffn.up.weight.zero_()
        ffn.up.bias.copy_(bias)
    batches = list(token_batches(3, 5, pad=True))
    zeros, tokens = count_zero_activations(model, [ffn], stack.layers[1], batches, forward, 0.0)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    assert tokens == [real] and real < sum(b["input_ids"].numel() for b in batches)
    assert zeros[0].tolist() == [real if b < 0 else 0 for b in bias.tolist()]
    # the threshold: gelu(0.5) = 0.35 and gelu(1) = 0.84 count at 0.9, gelu(2) = 1.95 does not
    zeros, _ = count_zero_activations(model, [ffn], stack.layers[1], batches, forward, 0.9)
    assert zeros[0].tolist() == [real if b <= 1.0 else 0 for b in bias.tolist()]


# -- Offsite-Tuning's layer drop -------------------------------------------------------------------------


def test_uniform_layer_drop_is_offsite_tunings():
    # uniform_choose_layers (mit-han-lab/offsite-tuning, offsite_tuning/utils.py): round(i (n-1)/(k-1))
    assert uniform_choose(8, 3) == [0, 4, 7]  # BERT-base's middle 8 -> 3 (paper Sec. 4.1.3)
    assert uniform_choose(10, 4) == [0, 3, 6, 9] and uniform_choose(4, 2) == [0, 3] and uniform_choose(5, 1) == [0]
    from fedtune.methods.fedpft.fedot import layer_plan

    assert layer_plan(12, 2, 2, None) == [0, 1, 2, 6, 9, 10, 11]
    assert layer_plan(6, 1, 1, None) == [0, 1, 4, 5]  # MiniLM: 4 middle -> 2
    model = tiny_bert(layers=4)
    layers = list(find_stack(model).layers)
    stack = keep_layers(model, [0, 2, 3])
    assert stack.layers == [layers[0], layers[2], layers[3]]
    assert forward(model, next(token_batches(1, 0))).last_hidden_state.shape[-1] == 16


# -- training memory -------------------------------------------------------------------------------------


def test_activation_meter_counts_saved_activations_once_and_not_weights():
    lin = nn.Linear(8, 4)
    x = torch.rand(5, 8)
    with ActivationMeter(lin) as meter:
        y = torch.relu(lin(x))  # saves x (for W's gradient) and relu's output; W is a weight
        y.sum().backward()
    assert meter.peak == 5 * 8 * 4 + 5 * 4 * 4 and meter.current == 0
    assert weight_bytes(lin) == (8 * 4 + 4) * 4
    assert training_peak_bytes(lin, [lin.weight], 2, meter.peak) == weight_bytes(lin) + 3 * 32 * 4 + meter.peak


# -- review additions (paste into tests/test_fedpft.py) ----------------------------------------------------


def test_apoz_counts_exact_relu_zeros_at_threshold_zero():
    """Eq. (14) counts O == 0. With ReLU an off neuron outputs exactly 0, which must count at
    threshold 0 (a strict ``a < threshold`` counts nothing on ReLU models); a neuron with b1 = 0
    (relu(0) = 0) is off too."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(
        BertConfig(num_hidden_layers=2, hidden_act="relu", **TEXT_SHAPE, **{**SMALL, "intermediate_size": 8})
    ).eval()
    stack = find_stack(model)
    ffn = stack.ffn(1)
    bias = torch.tensor([-1.0, 1.0, 0.0, 0.5, -2.0, 3.0, -0.1, 1.0])
    with torch.no_grad():
        ffn.up.weight.zero_()
        ffn.up.bias.copy_(bias)
    batches = list(token_batches(2, 7))
    zeros, tokens = count_zero_activations(model, [ffn], stack.layers[1], batches, forward, 0.0)
    assert tokens == [2 * 8 * 12]
    assert zeros[0].tolist() == [tokens[0] if b <= 0 else 0 for b in bias.tolist()]


def test_weight_term_of_eq13_carries_gradient():
    """Eq. (13)'s mu ||W1 W2 - W1' W2'||^2 is part of the objective: its gradient reaches the
    student's FFN weights (the published code reads ``.data``, so its term has none)."""
    teacher, student = tiny_bert(ffn_std=0.3), tiny_bert(ffn_std=0.3)
    compress_ffns(student, [0, 1], 0.25)
    t, s = find_stack(teacher), find_stack(student)
    batch = next(token_batches(1, 1))
    grads = {}
    for mu in (0.0, 1.0):
        student.zero_grad(set_to_none=True)
        pairs = DistillPairs(
            teacher, student, t.layers, s.layers, [(weight_product(t.ffn(i)).detach(), s.ffn(i)) for i in (0, 1)], mu=mu
        )
        pairs.loss(forward, batch)[0].backward()
        grads[mu] = s.ffn(0).up.weight.grad.clone()
    # the difference is exactly mu * d(weight term)/dW1 of layer 0, computed by autograd on its own
    w1 = s.ffn(0).up.weight.detach().clone().requires_grad_(True)
    wt = weight_product(t.ffn(0)).detach()
    (normalized_mse(wt, s.ffn(0).down.weight.detach() @ w1) / 2).backward()
    assert w1.grad.abs().max() > 0
    assert torch.allclose(grads[1.0] - grads[0.0], w1.grad, atol=1e-6, rtol=1e-4)


def test_select_neurons_takes_the_highest_apoz_and_breaks_ties_at_random():
    from fedtune.methods.fedpft.fedpft import select_neurons

    apoz = np.array([0.1, 0.9, 0.5, 0.9, 0.2, 0.7, 0.0, 0.3])
    assert select_neurons(apoz, 0.25, np.random.default_rng(0)).tolist() == [1, 3]
    assert select_neurons(apoz, 0.5, np.random.default_rng(0)).tolist() == [1, 2, 3, 5]
    ties = np.full(16, 0.5)
    picks = {tuple(select_neurons(ties, 0.25, np.random.default_rng(seed)).tolist()) for seed in range(10)}
    assert len(picks) > 1 and all(list(p) == sorted(p) and len(p) == 4 for p in picks)


def test_distillation_clips_the_gradient_norm_at_one_every_step(monkeypatch):
    """Appendix C.2: gradient clipping with max grad norm 1 (Adam hides its absence on a toy run)."""
    teacher, student = tiny_bert(ffn_std=0.3), tiny_bert(ffn_std=0.3)
    compress_ffns(student, [0, 1], 0.25)
    t, s = find_stack(teacher), find_stack(student)
    params = [p for i in (0, 1) for p in s.ffn(i).parameters()]
    calls, real = [], torch.nn.utils.clip_grad_norm_

    def spy(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        calls.append((max_norm, {id(p) for p in parameters}))
        return real(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    distill(DistillPairs(teacher, student, t.layers, s.layers), params, token_batches(3, 2), forward, 3, lr=1e-3)
    assert [c[0] for c in calls] == [1.0] * 3 and all(c[1] == {id(p) for p in params} for c in calls)


@pytest.mark.parametrize(("d", "p", "count"), [(13, 0.5, 7), (15, 0.5, 8), (14, 0.5, 7), (10, 0.25, 3), (4, 0.1, 1)])
def test_fedpft_apoz_alignment_count_is_the_published_one(d, p, count):
    """Mistake: the number of re-aligned neurons floored (floor(p d)): the published align_model
    freezes int((1 - p) d) and trains the rest, so p = 0.5 of 13 neurons trains 7 (floor: 6; Python's
    round, half to even: 6)."""
    from fedtune.methods.fedpft.fedpft import select_neurons

    apoz = np.random.default_rng(0).random(d)
    chosen = select_neurons(apoz, p, np.random.default_rng(1))
    assert len(chosen) == count
    assert set(chosen) == set(np.argsort(-apoz)[:count])  # the highest APoZ (no ties here)
