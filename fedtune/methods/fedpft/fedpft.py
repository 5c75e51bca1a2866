"""FedPFT: federated proxy fine-tuning of foundation models (Peng et al., IJCAI 2024).

1. **Sub-FM construction** (Sec. 3.4): in every compressed layer (``options.retained_layers``
   are left whole; default: the first and the last, as the paper compresses the intermediate 10
   of 12 layers), keep the ``options.keep_ratio`` most salient FFN neurons (eq. 8:
   sqrt(||W1[i,:]||^2 + ||W2[:,i]||^2)) in their original order, with their b1 entries; b2, the
   attention, every norm and the embeddings are copied unchanged
   (:func:`~fedtune.methods.fedpft.ffn_proxy.compress_ffns`; steps 1-2: :class:`CompressedFfnBuilder`).
2. **Layer-level distillation before FL** (Sec. 3.5.1, eq. 13): the server trains the compressed
   FFNs' W1, b1, W2, b2 (nothing else) so that every compressed layer's output matches the full
   model's on a public data set (``options.distill_data``), loss = mean over the compressed
   layers of the normalized MSE of the outputs plus ``options.distill_mu`` times the normalized
   MSE of W1 W2 (:mod:`fedtune.methods.fedpft.distill`, as the published ``DistillBertModel``).
   (The published code also trains the LayerNorm after the FFN; here only the FFN trains, and
   teacher and student run in eval mode, without dropout, so the target is deterministic.)
3. **FL on the proxy**: clients tune LoRA on the proxy's attention (the task's LoRA targets; a
   target inside a compressed FFN is refused) and the head; FedAvg (:mod:`.proxy`).
4. **Neuron-level distillation during FL** (Sec. 3.5.2, eq. 14): in every round t with
   t % ``align_interval`` == 0 (not the last), each sampled client counts, before training, on
   its own data (at most ``apoz_max_examples`` examples, eval mode, the received adapter), per
   compressed FFN neuron, the positions where its activation a <= ``apoz_threshold`` and the
   positions seen, and uploads them (``apoz/<layer>`` int32 (d_ff',), ``apoz/tokens`` int64
   (layers,)). The server sums them over the replies, APoZ = zeros / positions (eq. 14 over the
   round's clients' data), and in each compressed layer selects the ``align_fraction`` (p) of
   neurons with the **highest** APoZ, ties broken at random (seeded). It then distills, for
   ``align_steps`` public batches, only those neurons' W1 rows, b1 entries and W2 columns, and
   b2 (the published code's split layer also trains b2), the teacher being the full model and
   the student the proxy, both with the current global adapter (active LoRA, the same function
   as merged weights), eq. (13) with ``align_mu`` (the published alignment uses mu = 0). Every
   other neuron stays bit-identical. The proxy's version goes up by one; a client gets the
   neurons changed since the version it holds (``delta/<layer>/idx`` and the new rows /
   columns, b2) with its next training message, bytes counted (:class:`NeuronLevelAlignment`).
5. **Plug-back**: the adapter trained on the proxy is the full model's (same module names):
   ``accuracy`` is the full model's with it, ``proxy_accuracy`` the proxy's.

**APoZ on GELU.** Eq. (14) counts activations equal to 0, which the published code does
literally (``output == 0``): with ReLU that is the neuron being off, with GELU it almost never
happens, APoZ is 0 everywhere and its shuffle-then-sort selection is a random one. Here an
activation counts as zero when a <= ``apoz_threshold`` (default 0): with ReLU exactly eq. (14),
with GELU / SiLU exactly when the pre-activation is <= 0, i.e. the neuron is in its off regime
(GELU's output there is in [-0.17, 0]). On MiniLM / SST-2 this gives APoZ about 0.5-0.98 per
neuron (mean 0.8), not a constant. Gated FFNs count the gate's activation.

**Selection direction.** The paper updates "only a subset of neurons with low saliency in local
fine-tuning" and picks them by APoZ: a high APoZ means the neuron is mostly off on the clients'
data, so re-aligning it disturbs local adaptation least. The published ``align_model`` sorts APoZ
ascending, freezes the lowest ``int(align_retained_ratio * d_ff')`` and trains the rest, i.e.
the highest-APoZ neurons; with its default 0.5 that is p = 0.5 updated. ``align_fraction`` is
the paper's p (the fraction *updated*).

**APoZ sample.** Eq. (14) averages over a client's whole local set M_DT; a client here counts
at most ``apoz_max_examples`` (default 512; rounded up to whole batches) of its examples, in its
round's seeded batch order, to bound the extra forward passes on a large client; raise it to
count everything.

Ablations (Table 4): ``distill_before = false, distill_during = false`` (FedPFT_N),
``distill_during = false`` (FedPFT_B), ``distill_before = false`` (FedPFT_D).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field

from fedtune.config import ConfigError
from fedtune.methods.base.averaging import SECURE_AGGREGATION, WEIGHTED_SUM_OPTIONS
from fedtune.methods.base.lora import LORA, SERVER_DEVIATIONS
from fedtune.methods.fedpft.alignment import ProxyAligner
from fedtune.methods.fedpft.construction import ProxyBuilder
from fedtune.methods.fedpft.distill import DistillPairs, count_zero_activations
from fedtune.methods.fedpft.ffn_proxy import (
    ProxyShape,
    Stack,
    compress_ffns,
    find_stack,
    kept_width,
    shrink_ffn,
    weight_product,
)
from fedtune.methods.fedpft.plan import ProxyCut, proxy_plan
from fedtune.methods.fedpft.proxy import (
    GlobalAdapter,
    ProxyClient,
    ProxyOptions,
    ProxyStrategy,
    RoundAlignment,
    check_layers,
)
from fedtune.methods.fedpft.support import load_tensors, lora_target_modules, state_tensors, task_model
from fedtune.models.tensors import to_numpy
from fedtune.models.training import seed_for
from fedtune.planning.spec import PlanningContext
from fedtune.protocol.context import ServerContext, options_as
from fedtune.protocol.messages import Message
from fedtune.protocol.validation import ArraySpec
from fedtune.registry import register

APOZ, DELTA = "apoz/", "delta/"
TOKENS = APOZ + "tokens"


class FedPFTOptions(ProxyOptions):
    keep_ratio: float = Field(
        0.25, gt=0, le=1, description="fraction of FFN neurons a compressed layer keeps (paper: 0.25)"
    )
    retained_layers: list[int] | None = Field(
        None,
        description="layers left uncompressed (None: the first and the last; none for a model of at most 2 layers)",
    )
    distill_mu: float = Field(1.0, ge=0, description="mu of eq. (13) before FL (published distill_alpha default 1)")
    distill_during: bool = Field(True, description="neuron-level distillation during FL (eq. 14)")
    align_interval: int = Field(10, gt=0, description="t: align every t rounds (paper 10)")
    align_fraction: float = Field(
        0.5, gt=0, le=1, description="p: fraction of each compressed FFN's neurons updated (paper 0.5)"
    )
    align_steps: int = Field(20, ge=0, description="public batches per neuron-level distillation")
    align_mu: float = Field(0.0, ge=0, description="mu of eq. (13) during FL (published alignment: 0)")
    apoz_threshold: float = Field(0.0, description="an activation a <= this counts as zero in APoZ (eq. 14)")
    apoz_max_examples: int = Field(512, gt=0, description="examples of a client's data its APoZ counts (at most)")

    proxy_fields: ClassVar[tuple[str, ...]] = ProxyOptions.proxy_fields + (
        "keep_ratio",
        "retained_layers",
        "distill_mu",
    )
    deviations: ClassVar[dict[str, str]] = {
        **SERVER_DEVIATIONS,
        "options.distill_data": "None (default) distills on the task's own held-out examples, not a public corpus of "
        "another domain (the paper: BookCorpus + Wikipedia for text, ImageNet for images)",
        "options.weighting": "'uniform' departs from FedAvg's data-size weights",
        "options.align_mu": "> 0 adds eq. (13)'s weight term to the neuron-level step (the published code's is 0)",
    }

    def secure_refusal(self) -> str | None:
        """FedPFT's round is FedAvg of the adapter (a weighted sum SecAgg+ computes), but an
        alignment round also pools each client's APoZ counts, an unweighted sum of integers that
        the masked vector (each entry times w_i/W, clipped to [-c, c]) does not carry."""
        if self.distill_during and self.align_steps > 0:
            return (
                "options.distill_during: not with secure_aggregation.enabled (the neuron-level alignment pools "
                "each client's APoZ counts); fedpft's secure form has distill_during = false"
            )
        return None


def compressed_layers(n_layers: int, retained: list[int] | None) -> list[int]:
    """The layers FedPFT compresses: all but ``retained`` (None: the first and the last, or none
    when the model has at most 2 layers)."""
    if retained is None:
        retained = [0, n_layers - 1] if n_layers > 2 else []
    check_layers(n_layers, retained, "options.retained_layers")
    return [i for i in range(n_layers) if i not in retained]


def select_neurons(apoz: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """The d - int((1 - fraction) d) neurons (at least 1) with the highest APoZ, as the published
    ``align_model`` counts them (it freezes the lowest ``int(align_retained_ratio * d)`` and trains
    the rest; p = 0.5 of 13 neurons trains 7), ties in random order (the published code shuffles
    before sorting), as ascending indices."""
    d = len(apoz)
    n = max(1, d - int((1.0 - fraction) * d))
    perm = rng.permutation(len(apoz))
    order = perm[np.argsort(-apoz[perm], kind="stable")]
    return np.sort(order[:n])


def neuron_masks(stack: Stack, i: int, selected: np.ndarray) -> dict[torch.Tensor, torch.Tensor]:
    """Which entries of layer ``i``'s FFN parameters belong to the ``selected`` neurons (b2: all)."""
    ffn = stack.ffn(i)
    sel = torch.zeros(ffn.width, dtype=torch.bool, device=ffn.up.weight.device)
    sel[torch.as_tensor(selected, dtype=torch.long, device=sel.device)] = True
    masks = {
        ffn.up.weight: sel[:, None].expand_as(ffn.up.weight).clone(),
        ffn.down.weight: sel[None, :].expand_as(ffn.down.weight).clone(),
    }
    if ffn.up.bias is not None:
        masks[ffn.up.bias] = sel.clone()
    if ffn.down.bias is not None:
        masks[ffn.down.bias] = torch.ones_like(ffn.down.bias, dtype=torch.bool)
    if ffn.gate is not None:
        masks[ffn.gate.weight] = sel[:, None].expand_as(ffn.gate.weight).clone()
        if ffn.gate.bias is not None:
            masks[ffn.gate.bias] = sel.clone()
    return masks


# neuron delta: per part, the axis along which neurons are indexed (None: the whole array, b2)
DELTA_AXES = {"up.weight": 0, "up.bias": 0, "gate.weight": 0, "gate.bias": 0, "down.weight": 1, "down.bias": None}


def neuron_delta(stack: Stack, i: int, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Layer ``i``'s neurons ``idx`` as sent to a client: their W1 rows, b1 entries, W2 columns
    (gate rows) and b2, plus the indices."""
    ffn = stack.ffn(i)
    out = {f"{DELTA}{i}/idx": idx.astype(np.int32)}
    for part in stack.param_names(i):
        module, pname = part.split(".")
        a = to_numpy(getattr(getattr(ffn, module), pname))
        axis = DELTA_AXES[part]
        out[f"{DELTA}{i}/{part}"] = a.copy() if axis is None else np.take(a, idx, axis=axis)
    return out


def apply_neuron_delta(
    arrays: dict[str, np.ndarray], names: dict[str, str], delta: dict[str, np.ndarray], idx: np.ndarray
) -> None:
    """Write one layer's neuron ``delta`` (parts -> values) into ``arrays`` (state-dict names ->
    arrays, ``names``: part -> state-dict name), replacing the arrays it changes."""
    for part, value in delta.items():
        name, axis = names[part], DELTA_AXES[part]
        new = arrays[name].copy()
        if axis is None:
            new[...] = value
        elif axis == 0:
            new[idx] = value
        else:
            new[:, idx] = value
        arrays[name] = new


class CompressedFfnBuilder(ProxyBuilder):
    """FedPFT's proxy: the task's model with the FFNs of the compressed layers cut to their most
    salient neurons (Sec. 3.4, eq. 8), distilled layer by layer from the full model (eq. 13).
    It also keeps the proxy's versions: the neurons each neuron-level alignment changed
    (:meth:`new_version`), from which a client's delta is made (:meth:`delta`)."""

    def __init__(self, context: ServerContext, aligner: ProxyAligner, method_name: str) -> None:
        super().__init__(context, aligner, method_name)
        self.layers: list[int] = []
        self.kept: dict[int, np.ndarray] = {}
        self.changes: dict[int, dict[int, np.ndarray]] = {}  # version -> layer -> neurons changed

    def construct(self):
        o = self.options
        model = task_model(self.context)
        full_params = sum(p.numel() for p in model.parameters())
        self.layers = compressed_layers(len(find_stack(model)), o.retained_layers)
        self.kept = {i: to_numpy(idx) for i, idx in compress_ffns(model, self.layers, o.keep_ratio).items()}
        self.check_targets(model)
        record = {
            "layers": self.layers,
            "full_params": full_params,
            "proxy_params": sum(p.numel() for p in model.parameters()),
        }
        if o.distill_before and o.distill_steps and self.layers:
            teacher = self.aligner.teacher()
            t_stack, s_stack = find_stack(teacher), find_stack(model)
            model.requires_grad_(False)
            params = [p for i in self.layers for p in s_stack.ffn(i).parameters()]
            for p in params:
                p.requires_grad_(True)
            record["distill"] = self.aligner.run_distillation(
                layer_pairs(teacher, model, t_stack, s_stack, self.layers, o.distill_mu),
                params,
                o.distill_steps,
                0,
                "fedpft: layer-level distillation (eq. 13)",
            )
            model.requires_grad_(False)
        return model, record

    def check_targets(self, model: torch.nn.Module) -> None:
        stack = find_stack(model)
        ffn = {
            f"{stack.path}.{i}.{p}"
            for i in self.layers
            for p in (stack.layout.up, stack.layout.down, stack.layout.gate)
            if p
        }
        bad = sorted(set(lora_target_modules(self.context.task, model)) & ffn)
        if bad:
            raise ConfigError(f"model.target_modules: FedPFT adapts attention, not the compressed FFNs ({bad[0]} ...)")

    def restore(self, state: dict) -> None:
        self.layers = [int(i) for i in np.asarray(state["layers"]).ravel()]
        self.kept = {int(i): np.asarray(v) for i, v in state["kept"].items()}
        self.version = int(state.get("version", 0))
        self.changes = {
            int(v): {int(i): np.asarray(idx) for i, idx in c.items()} for v, c in state.get("changes", {}).items()
        }

    def rebuild(self, state: dict) -> torch.nn.Module:
        model = task_model(self.context)
        stack = find_stack(model)
        for i, idx in self.kept.items():
            shrink_ffn(stack, i, torch.as_tensor(idx))
        load_tensors(state_tensors(model), state["ffn"], strict=False)
        return model

    def describe(self) -> dict:
        stack = find_stack(self.proxy)
        ffn = {name: to_numpy(self.clean_tensors[name]) for i in self.layers for name in stack.param_names(i).values()}
        return {
            "layers": np.asarray(self.layers, dtype=np.int64),
            "kept": {str(i): v for i, v in self.kept.items()},
            "ffn": ffn,
            "version": self.version,
            "changes": {str(v): {str(i): idx for i, idx in c.items()} for v, c in self.changes.items()},
        }

    @property
    def shape(self) -> ProxyShape:
        return ProxyShape(widths=tuple((i, len(self.kept[i])) for i in self.layers))

    def new_version(self, changed: dict[int, np.ndarray]) -> None:
        """The proxy's next version, whose FFNs differ from the last one in the ``changed`` neurons."""
        self.version += 1
        self.changes[self.version] = changed

    def delta(self, base: int) -> dict[str, np.ndarray]:
        stack = find_stack(self.proxy)
        out: dict[str, np.ndarray] = {}
        for i in self.layers:
            changed = [self.changes[v][i] for v in range(base + 1, self.version + 1) if i in self.changes.get(v, {})]
            if changed:
                out.update(neuron_delta(stack, i, np.unique(np.concatenate(changed))))
        return out


def layer_pairs(
    teacher: torch.nn.Module, student: torch.nn.Module, t_stack: Stack, s_stack: Stack, layers: list[int], mu: float
) -> DistillPairs:
    """Eq. (13) over the compressed ``layers`` (of the stacks ``t_stack``, ``s_stack`` of the teacher
    and the student): their outputs, and ``mu`` times their W1 W2."""
    return DistillPairs(
        teacher,
        student,
        [t_stack.layers[i] for i in layers],
        [s_stack.layers[i] for i in layers],
        [(weight_product(t_stack.ffn(i)).detach(), s_stack.ffn(i)) for i in layers],
        mu,
    )


class NeuronLevelAlignment(RoundAlignment):
    """FedPFT's alignment during FL (Sec. 3.5.2, eq. 14; module docstring, step 4): in an
    alignment round the clients count their zero activations, the server pools them into APoZ,
    picks the high-APoZ neurons and distills only those from the full model; each alignment makes
    a new proxy version (:meth:`CompressedFfnBuilder.new_version`)."""

    def __init__(self, context: ServerContext, builder: CompressedFfnBuilder, aligner: ProxyAligner) -> None:
        self.context, self.config, self.options = context, context.config, options_as(context, FedPFTOptions)
        self.builder, self.aligner = builder, aligner

    def align_round(self, rnd: int) -> bool:
        o = self.options
        return (
            o.distill_during
            and rnd % o.align_interval == 0
            and rnd < self.config.rounds
            and o.align_steps > 0
            and bool(self.builder.layers)
        )

    def fit_meta(self, rnd: int) -> dict:
        return {"apoz": True} if self.align_round(rnd) else {}

    def reply_spec(self, sent: Message) -> dict[str, ArraySpec]:
        if not sent.meta.get("apoz"):
            return {}
        layers, kept = self.builder.layers, self.builder.kept
        specs = {f"{APOZ}{i}": ArraySpec((len(kept[i]),), "int32", False) for i in layers}
        return {**specs, TOKENS: ArraySpec((len(layers),), "int64", False)}

    def after_aggregate(self, rnd: int, replies: dict[int, Message], adapter: GlobalAdapter) -> dict[str, float]:
        got = [m for m in replies.values() if TOKENS in m.arrays]
        if not self.align_round(rnd) or not got:
            return {}
        tokens = np.add.reduce([m.arrays[TOKENS].astype(np.int64) for m in got])
        rng = np.random.default_rng([self.config.seed, rnd, 0xA907])
        apoz, selected = {}, {}
        for j, i in enumerate(self.builder.layers):
            zeros = np.add.reduce([m.arrays[f"{APOZ}{i}"].astype(np.int64) for m in got])
            apoz[i] = zeros / max(int(tokens[j]), 1)  # eq. (14) over the round's clients' data
            selected[i] = select_neurons(apoz[i], self.options.align_fraction, rng)
        record = self.align(selected, rnd, adapter)
        self.builder.new_version(selected)
        uploaded = sum(m.arrays[k].nbytes for m in got for k in m.arrays if k.startswith(APOZ))
        return {
            "apoz_upload_bytes": float(uploaded),
            "apoz_mean": float(np.mean([a.mean() for a in apoz.values()])),
            "align_heldout_error_before": record["heldout_output_error_before"],
            "align_heldout_error_after": record["heldout_output_error_after"],
            "proxy_version": float(self.builder.version),
        }

    def align(self, selected: dict[int, np.ndarray], rnd: int, adapter: GlobalAdapter) -> dict:
        """Distill the ``selected`` neurons of the proxy from the full model, both with the global
        ``adapter``; every other neuron is left bit-identical."""
        full, proxy = self.context.workspace, self.builder.workspace
        full.load(*adapter)
        lora_params = list(proxy.load(*adapter).values())
        t_stack, s_stack = find_stack(full.base), find_stack(self.builder.proxy)
        masks = {p: m for i, idx in selected.items() for p, m in neuron_masks(s_stack, i, idx).items()}
        params = list(masks)
        for p in lora_params:
            p.requires_grad_(False)
        for q in params:
            q.requires_grad_(True)
        try:
            return self.aligner.run_distillation(
                layer_pairs(
                    full.peft_model, proxy.peft_model, t_stack, s_stack, self.builder.layers, self.options.align_mu
                ),
                params,
                self.options.align_steps,
                rnd,
                f"fedpft: neuron-level distillation, round {rnd}",
                masks=masks,
            )
        finally:
            for q in params:
                q.requires_grad_(False)
            for p in lora_params:
                p.requires_grad_(True)


class FedPFTStrategy(ProxyStrategy):
    """FedPFT: LoRA FL on a saliency-compressed proxy aligned by two-step distillation (Peng et al. 2024)."""

    method_name = "fedpft"

    def __init__(self, context: ServerContext) -> None:
        aligner = ProxyAligner(context)
        builder = CompressedFfnBuilder(context, aligner, self.method_name)
        super().__init__(context, builder, NeuronLevelAlignment(context, builder, aligner))

    def initial_adapter(self) -> dict[str, np.ndarray]:
        """LoRA initialized on the full model (the adapter's names and shapes are the full model's)."""
        return self.context.workspace.state(self.rank)


class FedPFTClient(ProxyClient):
    options: FedPFTOptions  # the method's registered options class (resolve_run validated them)

    def skeleton_stack(self) -> Stack:
        store = self.store
        if store.get("skeleton") is None:
            self.workspace(max(store["versions"]))
        return store["stack"]

    def compressed(self) -> list[int]:
        return [i for i, _ in self.store["shape"].widths]

    def apply_delta(self, base: dict[str, np.ndarray], message: Message) -> dict[str, np.ndarray]:
        stack, arrays = self.skeleton_stack(), dict(base)
        for i in self.compressed():
            key = f"{DELTA}{i}/idx"
            if key in message.arrays:
                delta = {k.split("/", 2)[2]: v for k, v in message.arrays.items() if k.startswith(f"{DELTA}{i}/")}
                idx = delta.pop("idx").astype(np.int64)
                apply_neuron_delta(arrays, stack.param_names(i), delta, idx)
        return arrays

    def before_training(self, ws, message: Message) -> dict[str, np.ndarray]:
        """APoZ counts (eq. 14) on this client's data, when the server asks for them."""
        if not message.meta.get("apoz"):
            return {}
        stack, layers, cfg = self.skeleton_stack(), self.compressed(), self.config.train
        pool = self.context.partitions[self.cid]
        n = min(len(pool), self.options.apoz_max_examples)
        rng = np.random.default_rng(seed_for(self.config.seed, int(message.meta["round"]), self.cid, 0xA907))
        batches = self.context.task.train_batches(pool, cfg.batch_size, math.ceil(n / cfg.batch_size), rng)
        zeros, tokens = count_zero_activations(
            ws.model,
            [stack.ffn(i) for i in layers],
            stack.layers[max(layers)],
            batches,
            self.context.task.loss,
            self.options.apoz_threshold,
        )
        out = {f"{APOZ}{i}": to_numpy(z).astype(np.int32) for i, z in zip(layers, zeros)}
        out[TOKENS] = np.asarray(tokens, dtype=np.int64)
        return out


def proxy_cut(context: PlanningContext, base: torch.nn.Module, stack: Stack) -> ProxyCut:
    """FedPFT's proxy as the planner prices it: the compressed layers' FFNs cut to ``keep_ratio``,
    the adapter on every layer at rank r (:mod:`fedtune.methods.fedpft.plan`)."""
    o, task = options_as(context, FedPFTOptions), context.task
    cut = compressed_layers(len(stack), o.retained_layers)
    shape = ProxyShape(widths=tuple((i, kept_width(stack.ffn(i).width, o.keep_ratio)) for i in cut))
    full = lora_target_modules(task, base)
    return ProxyCut(context.config.model.lora_rank, shape, full, lambda model, _: lora_target_modules(task, model))


register(
    "fedpft",
    FedPFTStrategy,
    FedPFTClient,
    FedPFTOptions,
    requires=(*LORA, "transformer"),
    supports=(*WEIGHTED_SUM_OPTIONS, *SECURE_AGGREGATION, "device"),
    plan=proxy_plan(proxy_cut),
)
