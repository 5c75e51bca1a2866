"""Proxy sub-models of a transformer: FFN compression by neuron saliency (FedPFT, Sec. 3.4) and
uniform layer drop (Offsite-Tuning's emulator, FedOT).

The transformer's layers are found generically (:func:`find_stack`): the modules whose children
hold a feed-forward network of a known layout, siblings in one ``nn.ModuleList``:

- ``intermediate.dense`` / ``output.dense``: BERT, RoBERTa, ViT (transformers 4), DeiT, ...;
- ``mlp.fc1`` / ``mlp.fc2``: ViT (transformers 5), CLIP, ...;
- ``feed_forward.intermediate_dense`` / ``feed_forward.output_dense``: wav2vec2, HuBERT;
- ``mlp.gate_proj`` / ``mlp.up_proj`` / ``mlp.down_proj``: Llama-style gated FFNs (Llama, Mistral,
  Qwen): ``down(act(gate(x)) * up(x))``.

Anything else stops with :class:`SubmodelError`, naming these layouts.

Notation (FedPFT eqs. 6-8): FFN(x) = sum_i act(x u_i + b1_i) w_i + b2, with u_i the i-th row of
W1 (torch layout: ``up.weight[i, :]``, shape (d_ff, d_model)) and w_i the i-th column of W2
(``down.weight[:, i]``, shape (d_model, d_ff)). A gated FFN's neuron i also owns the gate row
``gate.weight[i, :]``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedtune.errors import FedtuneError


class SubmodelError(FedtuneError, ValueError):
    """The model's transformer layers or FFNs cannot be located or compressed as asked."""


@dataclass(frozen=True)
class FfnLayout:
    """Where a layer's FFN lives, relative to the layer module."""

    name: str
    up: str  # W1 (d_model -> d_ff)
    down: str  # W2 (d_ff -> d_model)
    act: str  # the activation module (its output is the neurons' activation, eq. 14)
    gate: str | None = None  # gated FFNs: the gate projection (d_model -> d_ff)


LAYOUTS = (
    FfnLayout("bert", "intermediate.dense", "output.dense", "intermediate.intermediate_act_fn"),
    FfnLayout("mlp", "mlp.fc1", "mlp.fc2", "mlp.activation_fn"),
    FfnLayout(
        "wav2vec2", "feed_forward.intermediate_dense", "feed_forward.output_dense", "feed_forward.intermediate_act_fn"
    ),
    FfnLayout("gated", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", gate="mlp.gate_proj"),
)
SUPPORTED = (
    "BERT / RoBERTa / ViT (intermediate.dense, output.dense), ViT / CLIP (mlp.fc1, mlp.fc2), wav2vec2 / "
    "HuBERT (feed_forward.intermediate_dense, feed_forward.output_dense), Llama-style gated FFNs "
    "(mlp.gate_proj, mlp.up_proj, mlp.down_proj)"
)


def _get(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


@dataclass
class Ffn:
    """One layer's FFN: its linear layers (and activation module, when it is one)."""

    up: nn.Linear
    down: nn.Linear
    gate: nn.Linear | None
    act: nn.Module | None

    @property
    def width(self) -> int:
        """d_ff: the number of neurons."""
        return self.up.out_features

    def linears(self) -> list[nn.Linear]:
        return [m for m in (self.up, self.down, self.gate) if m is not None]

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.linears() for p in m.parameters()]


def _match(layer: nn.Module, layout: FfnLayout) -> bool:
    up, down = _get(layer, layout.up), _get(layer, layout.down)
    gate = _get(layer, layout.gate) if layout.gate else None
    if not (isinstance(up, nn.Linear) and isinstance(down, nn.Linear)):
        return False
    if layout.gate and not isinstance(gate, nn.Linear):
        return False
    ok = up.out_features == down.in_features and up.in_features == down.out_features
    return ok and (gate is None or (gate.out_features == up.out_features and gate.in_features == up.in_features))


@dataclass
class Stack:
    """The transformer layers of a model: ``model.get_submodule(path)`` is their ``nn.ModuleList``."""

    path: str
    layers: list[nn.Module]
    layout: FfnLayout

    def __len__(self) -> int:
        return len(self.layers)

    def ffn(self, i: int) -> Ffn:
        layer, lay = self.layers[i], self.layout
        act = _get(layer, lay.act)
        return Ffn(
            layer.get_submodule(lay.up),
            layer.get_submodule(lay.down),
            layer.get_submodule(lay.gate) if lay.gate else None,
            act if isinstance(act, nn.Module) else None,
        )

    def param_names(self, i: int) -> dict[str, str]:
        """``{"up.weight": full state-dict name, ...}`` of layer ``i``'s FFN parameters."""
        lay, ffn = self.layout, self.ffn(i)
        out = {}
        for part, path in (("up", lay.up), ("down", lay.down), ("gate", lay.gate)):
            module = getattr(ffn, part)
            if module is None:
                continue
            for pname, _ in module.named_parameters():
                out[f"{part}.{pname}"] = f"{self.path}.{i}.{path}.{pname}"
        return out


def find_stack(model: nn.Module) -> Stack:
    """The model's transformer layers, located by their FFN layout (see the module docstring)."""
    found: dict[str, list[tuple[int, nn.Module, FfnLayout]]] = {}
    for name, module in model.named_modules():
        for layout in LAYOUTS:
            if _match(module, layout):
                parent, _, leaf = name.rpartition(".")
                if leaf.isdigit():
                    found.setdefault(parent, []).append((int(leaf), module, layout))
                break
    if not found:
        raise SubmodelError(f"{type(model).__name__}: no transformer FFN found; supported layouts: {SUPPORTED}")
    if len(found) > 1:
        raise SubmodelError(
            f"{type(model).__name__}: FFN layers in more than one stack ({', '.join(found)}); "
            "compressing one of several stacks is not supported"
        )
    path, items = next(iter(found.items()))
    container = model.get_submodule(path)
    layouts = {layout.name for _, _, layout in items}
    if (
        not isinstance(container, nn.ModuleList)
        or len(layouts) != 1
        or sorted(i for i, _, _ in items) != list(range(len(container)))
    ):
        raise SubmodelError(
            f"{path}: expected an nn.ModuleList of transformer layers that all hold an FFN of one layout"
        )
    items.sort(key=lambda t: t[0])
    return Stack(path, [m for _, m, _ in items], items[0][2])


# -- FedPFT: saliency and FFN compression (Sec. 3.4) -------------------------------------------------


def saliency(ffn: Ffn) -> torch.Tensor:
    """Neuron saliency, FedPFT eq. (8): sqrt(sum_j u_ij^2 + w_ij^2), shape (d_ff,); a gated FFN's
    neuron also counts its gate row."""
    with torch.no_grad():
        s = ffn.up.weight.double().pow(2).sum(1) + ffn.down.weight.double().pow(2).sum(0)
        if ffn.gate is not None:
            s = s + ffn.gate.weight.double().pow(2).sum(1)
        return s.sqrt()


def top_neurons(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices of the ``keep`` highest ``scores`` (ties: lower index first), in ascending index
    order: the kept neurons keep their original order (as the published ``construct_sub_model``)."""
    if not 0 < keep <= len(scores):
        raise SubmodelError(f"cannot keep {keep} of {len(scores)} neurons")
    order = torch.argsort(scores, descending=True, stable=True)[:keep]
    return torch.sort(order).values


def _sub_linear(old: nn.Linear, rows: torch.Tensor | None, cols: torch.Tensor | None) -> nn.Linear:
    """A copy of ``old`` keeping output ``rows`` and input ``cols`` (None: all); the bias
    follows the rows."""
    w = old.weight.detach()
    w = w[rows] if rows is not None else w
    w = w[:, cols] if cols is not None else w
    new = nn.Linear(w.shape[1], w.shape[0], bias=old.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if old.bias is not None:
            new.bias.copy_(old.bias.detach()[rows] if rows is not None else old.bias.detach())
    new.requires_grad_(old.weight.requires_grad)
    return new


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def shrink_ffn(stack: Stack, i: int, keep: torch.Tensor) -> None:
    """Keep only neurons ``keep`` (ascending) of layer ``i``'s FFN, in place: W1 rows, b1 entries,
    W2 columns (and gate rows); b2, the attention and every norm are untouched."""
    layer, lay = stack.layers[i], stack.layout
    keep = torch.as_tensor(keep, dtype=torch.long)
    ffn = stack.ffn(i)
    _replace(layer, lay.up, _sub_linear(ffn.up, keep, None))
    _replace(layer, lay.down, _sub_linear(ffn.down, None, keep))
    if lay.gate:
        _replace(layer, lay.gate, _sub_linear(ffn.gate, keep, None))


def kept_width(d_ff: int, keep_ratio: float) -> int:
    """Neurons a compressed FFN keeps: round(keep_ratio * d_ff), at least 1 (the paper removes
    75 %: d_ff' = d_ff / 4 = d_model)."""
    return max(1, min(d_ff, int(round(keep_ratio * d_ff))))


def compress_ffns(model: nn.Module, layers: Sequence[int], keep_ratio: float) -> dict[int, torch.Tensor]:
    """FedPFT's sub-FM (Sec. 3.4), in place: in each layer of ``layers``, keep the
    ``kept_width(d_ff, keep_ratio)`` most salient FFN neurons (eq. 8) in their original order.
    Returns the kept indices per layer."""
    stack = find_stack(model)
    kept = {}
    for i in layers:
        if not 0 <= i < len(stack):
            raise SubmodelError(f"layer {i} does not exist (the model has {len(stack)} layers)")
        ffn = stack.ffn(i)
        kept[i] = top_neurons(saliency(ffn), kept_width(ffn.width, keep_ratio))
        shrink_ffn(stack, i, kept[i])
    return kept


def weight_product(ffn: Ffn) -> torch.Tensor:
    """W1 W2 of eq. (13) in torch layout, ``down.weight @ up.weight`` (d_model, d_model); for a
    gated FFN the gate is left out (Theorem 2 ignores the non-linearity)."""
    return ffn.down.weight @ ffn.up.weight


# -- FedOT: uniform layer drop (Offsite-Tuning's emulator) ---------------------------------------------


def uniform_choose(n: int, k: int) -> list[int]:
    """Offsite-Tuning's ``uniform_choose_layers``: k of n layers at indices round(i (n-1)/(k-1))
    (both ends kept; Python's round, half to even)."""
    if not 0 < k <= n:
        raise SubmodelError(f"cannot choose {k} of {n} layers")
    if k == 1:
        return [0]
    stride = (n - 1) / (k - 1)
    return [round(i * stride) for i in range(k)]


def keep_layers(model: nn.Module, keep: Sequence[int]) -> Stack:
    """Replace the model's layer list by its layers ``keep`` (in that order), in place; modules
    with a ``layer_idx`` (KV caches) are renumbered to their new position. Returns the new stack."""
    stack = find_stack(model)
    if len(set(keep)) != len(keep) or not all(0 <= i < len(stack) for i in keep):
        raise SubmodelError(f"layers {list(keep)}: expected distinct indices of the {len(stack)} layers")
    new = nn.ModuleList([stack.layers[i] for i in keep])
    _replace(model, stack.path, new)
    for pos, layer in enumerate(new):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = pos
    return find_stack(model)


# -- skeletons: the architecture a client builds before loading a proxy's arrays ----------------------


@dataclass(frozen=True)
class ProxyShape:
    """How a proxy differs from the full model in shape: the full model's layers it keeps (None:
    all) and the FFN width of each compressed layer (by position in the proxy)."""

    layers: tuple[int, ...] | None = None
    widths: tuple[tuple[int, int], ...] = ()

    def to_meta(self) -> dict:
        return {"layers": None if self.layers is None else list(self.layers), "widths": [list(w) for w in self.widths]}

    @classmethod
    def from_meta(cls, meta: dict) -> ProxyShape:
        layers = meta.get("layers")
        return cls(
            None if layers is None else tuple(int(i) for i in layers),
            tuple((int(i), int(w)) for i, w in meta.get("widths", [])),
        )


def apply_shape(model: nn.Module, shape: ProxyShape) -> nn.Module:
    """``model`` (in place) in the proxy's shape, weights not yet meaningful where compressed:
    the skeleton into which a client loads the proxy it downloads."""
    stack = keep_layers(model, shape.layers) if shape.layers is not None else find_stack(model)
    for i, width in shape.widths:
        shrink_ffn(stack, i, torch.arange(width))
    return model


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
