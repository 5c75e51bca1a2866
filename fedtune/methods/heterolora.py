"""HeteroLoRA: heterogeneous ranks by truncation and zero padding. By default the baseline as the
FSLoRA paper runs it (Section 2.2 / 5.2 and its public ``LoRA_Zero_Padding.py``); with options,
HetLoRA as Cho et al. (2024) define it (rank self-pruning, sparsity-weighted aggregation).

Round t: the server holds a rank-r global adapter (B^t (m, r), A^t (r, n) per module, plus the
classifier head). Client i gets the truncation B^t[:, :r_i], A^t[:r_i, :] (and the head), i.e.
:func:`~fedtune.methods.base.lora_arrays.take_ranks` with I = 0..r_i-1, trains a rank-r_i adapter for
H steps, and uploads its update Delta_i (same shapes).

**Default: zero-padded update averaging** (``aggregate = "updates"``, ``weighting = "uniform"``,
no pruning). The server zero-pads every Delta_i to rank r and adds the average:

    theta^{t+1} = theta^t + sum_i p_i pad_r(Delta_i),     p_i = 1/N over the clients that replied,

so a rank index j >= r_i counts client i as a zero *update* (this damps the high-rank components,
what FSLoRA criticizes). This is exactly the FSLoRA authors' baseline code (``delta_average``: the
padded server-minus-client difference summed and divided by the number of clients).
``weighting = "examples"`` weights by data size; ``padding = "coverage"`` averages each rank index
over the clients covering it instead (parameter-wise averaging).

**HetLoRA (Cho et al. 2024)**: ``self_pruning = true, weighting = "sparsity", aggregate =
"modules"``.

- *Sparsity-weighted aggregation* (``weighting = "sparsity"``): p_i = ||S_i|| / Z, Z = sum_j ||S_j||,
  with ||S_i|| = ||Delta W_i||_F the Frobenius norm of client i's reconstructed adapter, taken
  here over all adapted modules, ||S_i||^2 = sum_modules ||s_i B_i A_i||_F^2, (B_i, A_i) the
  client's trained pair (what the server sent plus the update) and s_i its PEFT scale. (All zero:
  uniform.)
- *Module aggregation* (``aggregate = "modules"``): the global adapter is the weighted average of
  the clients' zero-padded *modules*, theta^{t+1} = sum_i p_i pad_r(theta_i), instead of theta^t
  plus the averaged update: a rank index j no replying client covers becomes zero. (With equal
  ranks and weights summing to 1 both forms coincide.) Goes through the server optimizer's
  :meth:`~fedtune.methods.base.server_optimizer.ServerOptimizer.move_to`.
- *Rank self-pruning* (``self_pruning = true``): client i of rank r_i adds
  lambda sum_modules ||B[:, t:]||_F ||A[t:, :]||_F to its training loss, t = max(1, floor(gamma r_i))
  (``prune_lambda``, ``prune_gamma``: the decay factor); if that tail norm product is smaller after
  local training than before, the client drops ranks t..r_i-1 from its upload and keeps rank t
  from then on (the server records it and sends rank t next time; under ``scaling = "rank"`` its
  PEFT scale becomes alpha/t). The reported training loss includes the penalty.

What could not be checked against the HetLoRA paper itself (only secondary descriptions were
readable): the exact norm for ||S_i|| over several modules, whether the prune decision compares
with the start of the round (done here) or with the first round, and the defaults gamma = 0.99,
lambda = 0.01 (those of public re-implementations, not verified against the paper).

**Client-level DP** (``privacy.mode``; DP-FedAvg, McMahan et al. 2018, as in
:mod:`fedtune.methods.base.privacy`), for the default form only. The zero-padded mean divides by the
number of replies, |R|, for every rank index (a rank j >= r_i counts client i as a zero), so it is a
plain sum of padded updates; pad_r only adds zeros, ||pad_r(Delta_i)|| = ||Delta_i||, and r_i comes
from the public profile. The DP form is theta^{t+1} = theta^t + (sum_i pad_r(clip_C(Delta_i)) + xi) / m
with m = ``federation.sample_size()`` fixed (not |R|) and xi ~ N(0, (zC)^2 I) on every coordinate
(central; local: each client clips and noises its rank-r_i upload): replacing one client's data moves
the sum by at most 2C, the accountant's assumption. Refused in one line (:meth:`HeteroLoRAOptions.
privacy_refusal`): ``padding = "coverage"`` divides rank j by the n_j clients covering it (replace-one
sensitivity 2C / n_j, n_j as small as 1 and different per rank, which one noise scale on the sum does
not match); ``weighting = "sparsity"`` (p_i ~ ||B_i A_i||_F: a weight that depends on the data, and Z
on everyone's) and ``"examples"``; ``aggregate = "modules"`` (a weighted mean of modules over the
replies, whose weights sum to one over |R|, not a fixed m); ``self_pruning`` (whether a client drops
its tail ranks is decided on its data and shows in the upload's shape, neither clipped nor noised).

**Secure aggregation** (``secure_aggregation.enabled``, SecAgg+ on Flower,
:meth:`~fedtune.methods.base.aggregation.Aggregation.secure_sum`). Both forms are weighted sums of per-client
vectors: client i masks v_i = pad_r(Delta_i) (``aggregate = "modules"``: pad_r(theta_i), its trained
module) with weight w_i (1, or its data size), and the server divides sum_i w_i v_i by sum_i w_i
(local DP: by m). With ``padding = "coverage"`` client i also masks the r entries c 1[j < r_i] (c:
``secure_aggregation.clipping_range``), whose sum over c is rank j's coverage weight sum_i w_i 1[j <
r_i], the denominator of rank j (:data:`COVERED`). Refused in one line
(:meth:`HeteroLoRAOptions.secure_refusal`): ``weighting = "sparsity"`` (a weight is the client's own
adapter norm) and ``self_pruning`` (the server reads each upload's rank).

Scaling. PEFT computes W0 + (alpha/rank) B A. With ``scaling = "rank"`` (default) a client trains
its rank-r_i adapter with PEFT's own scale alpha/r_i while the global model is evaluated at rank r
with alpha/r: the client's model is W0 + (alpha/r_i) B[:, :r_i] A[:r_i], i.e. its truncated part is
amplified by r / r_i relative to the global model. This is how the FSLoRA comparison runs
HeteroLoRA (each client adds a rank-r_i adapter with the same lora_alpha) and it matches FSLoRA's
own sketch, whose r/k entries give a k-rank device the same alpha/k scale. ``scaling = "global"``
gives client i alpha_i = alpha r_i / r, so every model uses alpha/r and a client's starting model
is exactly the global model's leading r_i components.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from fedtune.methods.base.aggregation import layout_of
from fedtune.methods.base.averaging import (
    SECURE_AGGREGATION,
    SERVER_STEP_AND_UPLOAD_CODEC,
    BroadcastAverage,
    client_weights,
    decode_update,
    update_of,
)
from fedtune.methods.base.lora import (
    LORA,
    SCALE_OPTIONS,
    SERVER_DEVIATIONS,
    GlobalAdapterStrategy,
    LoraClient,
    client_rank,
)
from fedtune.methods.base.lora_arrays import (
    array_rank,
    is_head,
    is_lora_a,
    is_lora_b,
    lora_pairs,
    lora_paths,
    lora_scale,
    pad_rank,
    pair_product,
    truncate_rank,
    zero_pad_average,
)
from fedtune.methods.base.privacy import PRIVACY_OPTIONS
from fedtune.methods.base.ranked import fit_at_sent_rank
from fedtune.planning.lora_plan import lora_plan
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SecureSum, secure_layout_of
from fedtune.protocol.validation import ArraySpec, spec_like
from fedtune.registry import MethodOptions, register


class HeteroLoRAOptions(MethodOptions):
    weighting: Literal["uniform", "examples", "sparsity"] = Field(
        "uniform", description="client weights: 1/N, data size, or HetLoRA's sparsity ||B_i A_i||_F / Z"
    )
    aggregate: Literal["updates", "modules"] = Field(
        "updates", description="average the padded updates (FSLoRA's baseline code) or the padded modules (HetLoRA)"
    )
    padding: Literal["zeros", "coverage"] = Field(
        "zeros", description="zero padding, or average each rank index over the clients covering it"
    )
    scaling: Literal["rank", "global"] = Field(
        "rank", description="client scale alpha/r_i (rank) or alpha/r (global, alpha_i = alpha r_i / r)"
    )
    self_pruning: bool = Field(False, description="HetLoRA's rank self-pruning on the clients")
    prune_gamma: float = Field(0.99, gt=0, lt=1, description="self-pruning decay factor: keep floor(gamma r_i) ranks")
    prune_lambda: float = Field(0.01, ge=0, description="weight of the tail-norm penalty in the local loss")

    deviations: ClassVar[dict[str, str]] = {
        **SERVER_DEVIATIONS,
        "options.padding": "'coverage' departs from both HeteroLoRA forms (zero padding)",
        "options.weighting": "the default 'uniform' (FSLoRA's baseline code) departs from HetLoRA's 'sparsity'",
        "options.aggregate": "the default 'updates' (FSLoRA's baseline code) departs from HetLoRA's 'modules'",
        "options.self_pruning": "the default false (FSLoRA's baseline code) departs from HetLoRA's rank self-pruning",
    }

    def privacy_refusal(self) -> str | None:
        """privacy.mode has a DP form only for the default zero-padded update mean (module docstring)."""
        why = {
            "weighting": (self.weighting == "sparsity", "'sparsity' weighs a client by its adapter's norm"),
            "aggregate": (self.aggregate == "modules", "'modules' averages over the replies, not a fixed m"),
            "padding": (self.padding == "coverage", "'coverage' divides rank j by its n_j clients: sensitivity 2C/n_j"),
            "self_pruning": (self.self_pruning, "true uploads a data-dependent shape, neither clipped nor noised"),
        }
        for option, (refused, reason) in why.items():
            if refused:
                return f"options.{option}: not with privacy.mode ({reason}); heterolora's DP form is the default one"
        return None

    def secure_refusal(self) -> str | None:
        """secure_aggregation.enabled sums the padded updates (or modules) with data-size or
        uniform weights, per rank index with ``padding = "coverage"`` (module docstring)."""
        if self.weighting == "sparsity":
            return (
                "options.weighting: 'sparsity' is not with secure_aggregation.enabled (a client's weight is "
                "its own adapter's norm, which the server would have to see)"
            )
        if self.self_pruning:
            return (
                "options.self_pruning: not with secure_aggregation.enabled (the server must learn each "
                "client's pruned rank from its upload's shape)"
            )
        return None


def tail_start(rank: int, gamma: float) -> int:
    """First pruned rank index t = max(1, floor(gamma rank)) (t = rank: nothing to prune)."""
    return min(rank, max(1, int(np.floor(gamma * rank))))


def tail_norm_product(arrays: Mapping, start: int, norm=np.linalg.norm):
    """sum over modules of ||B[:, start:]||_F ||A[start:, :]||_F (numpy arrays or, with
    ``norm=torch.linalg.norm``, torch parameters): HetLoRA's self-pruning term."""
    return sum(norm(arrays[b][:, start:]) * norm(arrays[a][start:, :]) for a, b in lora_pairs(arrays))


def sparsity_norm(adapter: Mapping[str, np.ndarray], scale: float) -> float:
    """||S_i|| = sqrt(sum over modules of ||scale B A||_F^2)."""
    return float(np.sqrt(sum(np.sum((scale * pair_product(adapter, p)) ** 2) for p in lora_paths(adapter))))


#: Under secure aggregation with ``padding = "coverage"``: the extra entries of a client's vector,
#: c 1[j < r_i] for the rank indices j = 0..r-1 (c = ``secure_aggregation.clipping_range``, so the
#: entry stays inside the range the mod quantizes); their weighted sum over c is the coverage
#: weight of rank j, sum_i w_i 1[j < r_i].
COVERED = "secure/covered"


def per_rank(name: str, values: np.ndarray, ndim: int) -> np.ndarray:
    """``values`` (one per rank index) shaped to broadcast over a ``lora_A``'s rows or a
    ``lora_B``'s columns of ``ndim`` dimensions."""
    if is_lora_a(name):
        return values.reshape(-1, *[1] * (ndim - 1))
    if is_lora_b(name):
        return values.reshape(1, -1, *[1] * (ndim - 2))
    raise ValueError(f"{name} is not a LoRA factor")


class HeteroLoRAStrategy(BroadcastAverage, GlobalAdapterStrategy):
    """HeteroLoRA: truncation down, zero-padded update average up (FSLoRA's baseline); HetLoRA
    (Cho et al. 2024) by options."""

    # HeteroLoRAOptions.weighting adds "sparsity" to Weighted's two: this class overrides both steps of
    # BroadcastAverage that read options.weighting (configure_fit, averaged), so none sees it
    options: HeteroLoRAOptions  # type: ignore[assignment]

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        self.global_arrays = self.context.workspace.state(self.rank)
        self.pruned: dict[int, int] = {}  # client -> rank after self-pruning

    def client_rank(self, cid: int) -> int:
        """r_i: the profile's budget, or the client's self-pruned rank when lower."""
        rank = client_rank(self.context.profiles[cid], self.rank)
        return min(rank, self.pruned.get(cid, rank))

    def client_alpha(self, rank: int) -> float | None:
        """The alpha client of rank ``rank`` trains with (None: the config's lora_alpha)."""
        if self.options.scaling == "global" and rank != self.rank:
            return self.config.model.lora_alpha * rank / self.rank
        return None

    def client_scale(self, rank: int) -> float:
        alpha = self.client_alpha(rank)
        return lora_scale(self.config.model.lora_alpha if alpha is None else alpha, rank)

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        out = {}
        self.aggregation.asked(client_ids)
        bounds = (self.context.example_bound("train", cid) for cid in client_ids)
        secure = self.aggregation.secure_meta(self.secure_layout(), self.options.weighting, bounds)
        for cid in client_ids:
            rank = self.client_rank(cid)
            meta = {"round": rnd, "rank": rank, **secure}
            if self.client_alpha(rank) is not None:
                meta["alpha"] = self.client_alpha(rank)
            out[cid] = Message(truncate_rank(self.global_arrays, rank), meta)
        return out

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec] | list[dict[str, ArraySpec]]:
        """An update of the truncation sent; with ``self_pruning`` also its pruned form (ranks
        below ``tail_start``)."""
        full = update_of(sent)
        rank = int(sent.meta["rank"])
        start = tail_start(rank, self.options.prune_gamma)
        if not self.options.self_pruning or start >= rank:
            return full
        return [full, spec_like(truncate_rank(sent.arrays, start))]

    def weights(self, replies: dict[int, Message], trained: list[dict[str, np.ndarray]]) -> list[float]:
        if self.options.weighting != "sparsity":
            return client_weights(replies, self.options.weighting)
        norms = [sparsity_norm(t, self.client_scale(self.client_rank(cid))) for cid, t in zip(replies, trained)]
        return norms if sum(norms) > 0 else [1.0] * len(norms)

    def private_updates(self, rnd: int, replies: dict[int, Message]) -> list[dict[str, np.ndarray]]:
        """Under ``privacy.mode``: each update zero-padded to the global rank r, for
        (sum_i pad_r(clip(Delta_i)) + xi) / m (the module docstring)."""
        updates = [decode_update(m.arrays) for m in replies.values()]
        return [{k: pad_rank(k, v, self.rank) for k, v in u.items()} for u in updates]

    def averaged(self, rnd: int, replies: dict[int, Message]) -> dict[str, np.ndarray]:
        """The zero-padded average of the updates (or, with ``aggregate = "modules"``, of the
        trained modules), weighted by ``options.weighting``, through the server optimizer; a
        client that replied below its rank has self-pruned (``self.pruned``)."""
        updates = [decode_update(m.arrays) for m in replies.values()]
        trained: list[dict[str, np.ndarray]] = []
        if self.options.weighting == "sparsity" or self.options.aggregate == "modules":
            # B_i, A_i as trained: the truncation sent (to the rank the reply carries) plus the update
            trained = [
                {k: v + u[k] for k, v in truncate_rank(self.global_arrays, array_rank(u)).items()} for u in updates
            ]
        weights = self.weights(replies, trained)
        coverage = self.options.padding == "coverage"
        if self.options.aggregate == "modules":
            target = zero_pad_average(trained, weights, self.rank, coverage=coverage)
            moved = self.aggregation.server_opt.move_to(self.global_arrays, target)
        else:
            mean = zero_pad_average(updates, weights, self.rank, coverage=coverage)
            moved = self.aggregation.server_opt.step(self.global_arrays, mean)
        for cid, u in zip(replies, updates):
            if array_rank(u) < self.client_rank(cid):
                self.pruned[cid] = array_rank(u)
        return moved

    def secure_layout(self) -> dict[str, tuple[int, ...]]:
        """Every client's vector is padded to the global rank r; with ``padding = "coverage"``
        the r coverage entries (:data:`COVERED`) follow."""
        layout = layout_of(self.global_arrays)
        return {**layout, COVERED: (self.rank,)} if self.options.padding == "coverage" else layout

    def aggregate_secure_fit(self, rnd: int, replies: dict[int, Message], total: SecureSum) -> dict[str, float]:
        """:meth:`aggregate_fit` from the sum alone: sum_i w_i pad_r(v_i) (v_i: the update, or the
        trained module with ``aggregate = "modules"``) over sum_i w_i (DP: the mechanism's noised sum over m), or, with
        ``padding = "coverage"``, rank j over its coverage weight sum_i w_i 1[j < r_i] (summed
        securely beside it, :data:`COVERED`; a rank index whose coverage is within the sum's
        quantization error of 0 is uncovered: zero)."""
        layout = self.secure_layout()
        arrays, denominator = self.aggregation.secure_sum(total, layout)
        if self.options.padding == "coverage":
            c = self.config.secure_aggregation.clipping_range
            covered = arrays[COVERED] / c
            covered = np.where(covered > total.error / c, covered, 0.0)
            mean = {}
            for k, v in self.global_arrays.items():
                den = np.broadcast_to(denominator if is_head(k) else per_rank(k, covered, v.ndim), v.shape)
                mean[k] = np.divide(arrays[k], den, out=np.zeros(v.shape), where=den > 0).astype(v.dtype)
        else:
            mean = self.aggregation.secure_mean(rnd, total, layout, self.global_arrays)
        server_opt = self.aggregation.server_opt
        if self.options.aggregate == "modules":
            self.global_arrays = server_opt.move_to(self.global_arrays, mean)
        else:
            self.global_arrays = server_opt.step(self.global_arrays, mean)
        return self.aggregation.metrics(replies)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "pruned": {str(c): r for c, r in self.pruned.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.pruned = {int(c): int(r) for c, r in state.get("pruned", {}).items()}


class HeteroLoRAClient(LoraClient):
    """Trains the truncation it receives; with ``self_pruning``, adds HetLoRA's tail penalty and
    drops the tail ranks from its upload when their norm product shrank."""

    options: HeteroLoRAOptions  # the method's registered options class (resolve_run validated them)

    def secure_vector(self, message: Message, reply: Message) -> dict[str, np.ndarray]:
        """What the server's zero-padded mean sums: pad_r(Delta_i), or, with ``aggregate =
        "modules"``, pad_r(theta_i) of the trained module theta_i = received + Delta_i; with
        ``padding = "coverage"`` also c 1[j < r_i] (:data:`COVERED`)."""
        layout = secure_layout_of(message.meta)
        rank = next(shape[0] for name, shape in layout.items() if is_lora_a(name))
        update = dict(reply.arrays)
        if self.options.aggregate == "modules":
            update = {k: message.arrays[k] + v for k, v in update.items()}
        out = {k: pad_rank(k, v, rank) for k, v in update.items()}
        if COVERED in layout:
            c = self.config.secure_aggregation.clipping_range
            out[COVERED] = c * (np.arange(rank) < array_rank(update)).astype(np.float64)
        return out

    def fit(self, message: Message) -> Message:
        rank = int(message.meta["rank"])
        start = tail_start(rank, self.options.prune_gamma)
        if not self.options.self_pruning or start >= rank:
            return fit_at_sent_rank(self, message)
        received, lam = message.arrays, self.options.prune_lambda

        def penalty(params: Mapping[str, torch.nn.Parameter]) -> torch.Tensor:
            return lam * tail_norm_product(params, start, torch.linalg.norm)

        trained, result = self.train_adapter(received, message.meta["round"], rank, message.meta.get("alpha"), penalty)
        update = {k: trained[k] - received[k] for k in trained}
        if tail_norm_product(trained, start) < tail_norm_product(received, start):
            update = truncate_rank(update, start)  # prune ranks start..rank-1
        return self.upload(update, result, rnd=message.meta["round"])


register(
    "heterolora",
    HeteroLoRAStrategy,
    HeteroLoRAClient,
    HeteroLoRAOptions,
    requires=LORA,
    supports=(*SERVER_STEP_AND_UPLOAD_CODEC, *SCALE_OPTIONS, *PRIVACY_OPTIONS, *SECURE_AGGREGATION),
    plan=lora_plan("rank"),
)
