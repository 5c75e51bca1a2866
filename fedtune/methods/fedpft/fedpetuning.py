"""FedPETuning: LoRA FL on the full model (Zhang et al. 2023), FedPFT's upper reference.

Every client holds the full model and tunes the LoRA adapter of the task's targets (attention)
and the head, ``model.lora_rank``: the same trainable parameters as FedPFT (whose adapter has the
same names and shapes), so the two differ only in the model the client trains on. The algorithm
is FedIT's (FedAvg of the adapter, ``options.weighting``, through the server optimizer); the
client also reports its training memory (``client_peak_mem_mb``, :mod:`fedtune.models.train_memory`)
and the strategy the sizes a client holds and trains, measured as FedPFT's and FedOT's are.
"""

from __future__ import annotations

from fedtune.methods.base.averaging import SECURE_AGGREGATION, WEIGHTED_SUM_OPTIONS, UpdateClient
from fedtune.methods.base.lora import LORA
from fedtune.methods.fedit import FedITOptions, FedITStrategy
from fedtune.methods.fedpft.support import base_params, memory_metrics, size_metrics, train_lora
from fedtune.planning.lora_plan import lora_plan
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SecureSum
from fedtune.registry import register


class FedPETuningStrategy(FedITStrategy):
    """FedPETuning: LoRA FL on the full model (Zhang et al. 2023), FedPFT's reference."""

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        return {**super().aggregate_fit(rnd, replies), **self.cost_metrics(replies)}

    def aggregate_secure_fit(self, rnd: int, replies: dict[int, Message], total: SecureSum) -> dict[str, float]:
        """FedIT's round from the secure sum (replies: metadata only, which holds the memory)."""
        return {**super().aggregate_secure_fit(rnd, replies, total), **self.cost_metrics(replies)}

    def cost_metrics(self, replies: dict[int, Message]) -> dict[str, float]:
        base = base_params(self.context.workspace.base)
        return {**memory_metrics(replies), **size_metrics(base, self.global_arrays)}


class FedPETuningClient(UpdateClient):
    def fit(self, message: Message) -> Message:
        received, meta = message.arrays, message.meta
        trained, result, peak = train_lora(
            self.context.workspace,
            received,
            int(meta["rank"]),
            None,
            self.context.task,
            self.context.partitions[self.cid],
            self.config,
            self.train_seed(int(meta["round"])),
        )
        return self.upload({k: trained[k] - received[k] for k in trained}, result, peak_mem_bytes=int(peak))


register(
    "fedpetuning",
    FedPETuningStrategy,
    FedPETuningClient,
    FedITOptions,
    requires=LORA,
    supports=(*WEIGHTED_SUM_OPTIONS, *SECURE_AGGREGATION, "device"),
    plan=lora_plan(None),
)
