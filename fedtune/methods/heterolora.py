"""HeteroLoRA: heterogeneous ranks by truncation and zero padding (Cho et al. 2024), as
described in FSLoRA Section 2.2 and run as its baseline (Section 5.2).

Round t: the server holds a rank-r global adapter (B^t (m, r), A^t (r, n) per module, plus
the classifier head). Client i gets the truncation B^t[:, :r_i], A^t[:r_i, :] (and the head),
trains a rank-r_i adapter for H steps, and uploads its update Delta_i (same shapes). The server
zero-pads every Delta_i to rank r and averages:

    theta^{t+1} = theta^t + sum_i p_i pad_r(Delta_i),      sum over the clients that replied,

so a rank index j >= r_i counts client i as a zero (zero-padding aggregation; it is what
damps the high-rank components and what FSLoRA criticizes). Default p_i = 1/N (``weighting =
"uniform"``), as in FSLoRA's public baseline code; ``"examples"`` weights by data size.
``padding = "coverage"`` instead averages each rank index over the clients covering it.

Scaling. PEFT computes W0 + (alpha/rank) B A. With ``scaling = "rank"`` (default) a client
trains its rank-r_i adapter with PEFT's own scale alpha/r_i while the global model is evaluated
at rank r with alpha/r: the client's model is W0 + (alpha/r_i) B[:, :r_i] A[:r_i], i.e. its
truncated part is amplified by r / r_i relative to the global model. This is how the FSLoRA
comparison runs HeteroLoRA (each client adds a rank-r_i adapter with the same lora_alpha) and
it matches FSLoRA's own sketch, whose r/k entries give a k-rank device the same alpha/k scale.
``scaling = "global"`` gives client i alpha_i = alpha r_i / r, so every model uses alpha/r and
a client's starting model is exactly the global model's leading r_i components.
"""

from __future__ import annotations

from typing import Literal

from fedtune.protocol.messages import Message
from fedtune.methods.hetero_common import RankedAdapterClient, truncate_rank, zero_pad_average
from fedtune.methods.lora_common import (
    LORA,
    GlobalAdapterStrategy,
    Weighting,
    client_rank,
    client_weights,
    decode_update,
    mean_train_loss,
)
from fedtune.registry import MethodOptions, register


class HeteroLoRAOptions(MethodOptions):
    weighting: Weighting = "uniform"
    padding: Literal["zeros", "coverage"] = "zeros"
    scaling: Literal["rank", "global"] = "rank"


class HeteroLoRAStrategy(GlobalAdapterStrategy):
    """HeteroLoRA: rank truncation down, zero-padding averaging up (Cho et al. 2024)."""

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        self.global_arrays = self.context.workspace.state(self.rank)

    def client_alpha(self, rank: int) -> float | None:
        """The alpha client of rank ``rank`` trains with (None: the config's lora_alpha)."""
        if self.options.scaling == "global" and rank != self.rank:
            return self.config.model.lora_alpha * rank / self.rank
        return None

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        out = {}
        for cid in client_ids:
            rank = client_rank(self.context.profiles[cid], self.rank)
            meta = {"round": rnd, "rank": rank}
            if self.client_alpha(rank) is not None:
                meta["alpha"] = self.client_alpha(rank)
            out[cid] = Message(truncate_rank(self.global_arrays, rank), meta)
        return out

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        updates = [decode_update(m.arrays) for m in replies.values()]
        weights = client_weights(replies, self.options.weighting)
        mean = zero_pad_average(updates, weights, self.rank, coverage=self.options.padding == "coverage")
        self.global_arrays = {k: v + mean[k] for k, v in self.global_arrays.items()}
        return mean_train_loss(replies)


register("heterolora", HeteroLoRAStrategy, RankedAdapterClient, HeteroLoRAOptions, requires=LORA)
