"""FlexLoRA: heterogeneous ranks through the SVD of the averaged full-size update (Bai et al.
2024, official FederatedScope code), FSLoRA's baseline of Section 2.2 / 5.2.

Round t: client i receives a rank-r_i pair (B_i, A_i) (+ head), trains it with PEFT's scale
s_i = alpha / r_i for H steps and uploads its update; the server rebuilds the trained pair
exactly (what it sent plus the update; with ``federation.upload_topk`` the update is the
sparsified one) and forms, per adapted module,

    Delta W^{t+1} = sum_i p_i s_i B_i A_i                       (m, n), p_i proportional to data size

(``weighting = "uniform"``: p_i = 1/N). Delta W replaces the previous one: clients started from the
previous global, so their products carry it (a ``server.optimizer`` other than plain SGD
at lr 1, a deviation, steps from the old Delta W toward the new one instead; the head likewise).
Redistribution (round t+1): each client gets the truncated SVD at its own rank, U_{r_i} S_{r_i}
V_{r_i}^T, as B = U_{r_i} S_{r_i} / s_i, A = V_{r_i}^T, so s_i B A is the best rank-r_i
approximation of Delta W (Eckart-Young). One SVD per module and round serves every client. Round 1
(no Delta W yet) sends the truncation of the common rank-r PEFT initialization (B = 0). The head is
averaged FedAvg-style.

Differential privacy: refused (``privacy.mode`` stops the run in one line naming the method). The
server step is not a sum of clipped updates: Delta W^{t+1} is a data-weighted sum of the clients'
whole products s_i B_i A_i, each carrying the previous global. A central form would clip each
client's change of its product, s_i (B_i A_i - B_i^0 A_i^0), in W space and put dense (m, n) noise on
their sum (the SVD is then post-processing), a different algorithm (weights summing to one over a
fixed m, a full-rank noisy Delta W); a local form has none (noise on B_i, A_i is not Gaussian on the
product). Neither is implemented.

Global model. ``global_model = "svd"`` (default): the rank-r truncated SVD of Delta W as a
standard PEFT rank-r adapter (scale alpha/r), the best adapter of the global rank (what is
evaluated and saved with ``save_pretrained``). ``"merged"``: evaluate W0 + Delta W exactly,
Delta W merged reversibly into the base weights (its rank can reach sum_i r_i > r); the saved
adapter stays the rank-r SVD.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedtune.methods.base.averaging import (
    SERVER_STEP_AND_UPLOAD_CODEC,
    Weighting,
    client_weights,
    decode_update,
    mean_train_loss,
)
from fedtune.methods.base.lora import (
    LORA,
    MERGING_SCALE_OPTIONS,
    SERVER_DEVIATIONS,
    GlobalAdapterStrategy,
    client_rank,
)
from fedtune.methods.base.lora_arrays import (
    a_name,
    array_rank,
    b_name,
    head_arrays,
    is_head,
    is_lora_b,
    lora_scale,
    shaped_like,
    svd_factors_from,
    thin_svd,
    truncate_rank,
    weighted_product_sum,
)
from fedtune.methods.base.ranked import RankedAdapterClient, merged_into_base
from fedtune.methods.base.robust import weighted_average
from fedtune.planning.lora_plan import lora_plan
from fedtune.protocol.messages import Message
from fedtune.registry import MethodOptions, register


class FlexLoRAOptions(MethodOptions):
    weighting: Weighting = Field("examples", description="p_i: data size (FlexLoRA) or 1/N")
    global_model: Literal["svd", "merged"] = Field(
        "svd", description="evaluate the rank-r SVD of Delta W (a PEFT adapter) or W0 + Delta W exactly"
    )

    deviations: ClassVar[dict[str, str]] = {
        **SERVER_DEVIATIONS,
        "options.weighting": "'uniform' departs from FlexLoRA's data-size weights",
    }


class FlexLoRAStrategy(GlobalAdapterStrategy):
    """FlexLoRA: average full-size B_i A_i, redistribute by truncated SVD (Bai et al. 2024)."""

    options: FlexLoRAOptions  # the method's registered options class (resolve_run validated them)

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        self.alpha_cfg = float(self.config.model.lora_alpha)
        self.init_arrays = self.context.workspace.state(self.rank)  # common rank-r init, B = 0
        self.global_arrays = {k: v.copy() for k, v in self.init_arrays.items()}
        self.delta: dict[str, np.ndarray] = {}  # module path -> Delta W (m, n), float64
        self._svd: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._sent: dict[int, dict[str, np.ndarray]] = {}

    # -- redistribution ---------------------------------------------------------------------
    def _refresh_svd(self) -> None:
        """Top-r SVD of every module's Delta W, and the rank-r global adapter from it."""
        self._svd = {}
        for path, delta in self.delta.items():
            u, s, vt = thin_svd(delta)
            self._svd[path] = (u[:, : self.rank], s[: self.rank], vt[: self.rank])
        self.global_arrays = {**self.client_adapter(self.rank), **head_arrays(self.global_arrays)}

    def client_adapter(self, rank: int) -> dict[str, np.ndarray]:
        """The LoRA pairs a rank-``rank`` client starts from (without the head)."""
        if not self.delta:
            return {k: v for k, v in truncate_rank(self.init_arrays, rank).items() if not is_head(k)}
        scale = lora_scale(self.alpha_cfg, rank)
        out = {}
        for path, (u, s, vt) in self._svd.items():
            b, a = svd_factors_from(u, s, vt, rank, scale)
            shapes = self.init_arrays[b_name(path)].shape, self.init_arrays[a_name(path)].shape
            out[b_name(path)], out[a_name(path)] = shaped_like(b, a, *shapes)  # a convolution's 4-D factors
        return out

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        self._sent = {}
        head = head_arrays(self.global_arrays)
        by_rank: dict[int, dict[str, np.ndarray]] = {}
        out = {}
        for cid in client_ids:
            rank = client_rank(self.context.profiles[cid], self.rank)
            if rank not in by_rank:
                by_rank[rank] = {**self.client_adapter(rank), **head}
            self._sent[cid] = by_rank[rank]
            out[cid] = Message(by_rank[rank], {"round": rnd, "rank": rank})
        return out

    # -- aggregation ------------------------------------------------------------------------
    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        trained = []
        for cid, message in replies.items():
            update, sent = decode_update(message.arrays), self._sent[cid]
            trained.append({k: sent[k] + update[k] for k in sent})  # B_i, A_i exactly
        weights = client_weights(replies, self.options.weighting)
        scales = [lora_scale(self.alpha_cfg, array_rank(t)) for t in trained]
        delta = weighted_product_sum(trained, weights, scales)
        head = weighted_average([head_arrays(t) for t in trained], weights)
        # the new Delta W and head replace the old ones (through the server optimizer, if any)
        old = {**self.delta, **head_arrays(self.global_arrays)}
        new = self.aggregation.server_opt.move_to(old, {**delta, **head})
        self.delta = {path: new[path] for path in delta}
        self.global_arrays = {**self.global_arrays, **{k: new[k] for k in head}}
        self._refresh_svd()
        self._sent = {}
        return mean_train_loss(replies)

    # -- evaluation and state ---------------------------------------------------------------
    def evaluate(self, rnd: int) -> dict[str, float]:
        if self.options.global_model == "svd" or not self.delta:
            return super().evaluate(rnd)
        ws = self.context.workspace
        zero_b = {k: (np.zeros_like(v) if is_lora_b(k) else v) for k, v in self.global_arrays.items()}
        ws.load(zero_b, self.rank)
        with merged_into_base(ws, self.delta):
            return self.context.task.evaluate(ws.peft_model, self.config.train.eval_batch_size)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "init": dict(self.init_arrays), "delta": dict(self.delta)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.alpha_cfg = float(self.config.model.lora_alpha)
        self.init_arrays = {k: np.asarray(v, dtype=np.float32) for k, v in state["init"].items()}
        self.delta = {k: np.asarray(v, dtype=np.float64) for k, v in state.get("delta", {}).items()}
        self._sent = {}
        if self.delta:
            self._refresh_svd()


register(
    "flexlora",
    FlexLoRAStrategy,
    RankedAdapterClient,
    FlexLoRAOptions,
    requires=LORA,
    supports=(*SERVER_STEP_AND_UPLOAD_CODEC, *MERGING_SCALE_OPTIONS),
    plan=lora_plan("rank"),
)
