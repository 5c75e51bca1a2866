"""FedIT: FedAvg over LoRA adapters of one uniform rank (Zhang et al. 2024).

Round t: the server sends the global adapter (every LoRA pair B, A and the classifier head); each
client trains it for H local steps and uploads its update Delta_i = theta_i - theta^t; the server
sets theta^{t+1} = theta^t + sum_i p_i Delta_i, p_i proportional to the client's data size
(FedAvg; ``options.weighting = "uniform"`` gives p_i = 1/N), through the server optimizer
(``server.optimizer``; default: exactly this sum).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from fedtune.methods.base.averaging import SECURE_AGGREGATION, WEIGHTED_SUM_OPTIONS, BroadcastAverage, Weighting
from fedtune.methods.base.lora import LORA, SCALE_OPTIONS, SERVER_DEVIATIONS, GlobalAdapterStrategy, LoraClient
from fedtune.methods.base.privacy import PRIVACY_OPTIONS
from fedtune.planning.lora_plan import lora_plan
from fedtune.protocol.messages import Message
from fedtune.registry import MethodOptions, register


class FedITOptions(MethodOptions):
    weighting: Weighting = Field("examples", description="p_i: data size (FedAvg) or 1/N")

    deviations: ClassVar[dict[str, str]] = {
        **SERVER_DEVIATIONS,
        "options.weighting": "'uniform' departs from FedAvg's data-size weights",
    }


class FedITStrategy(BroadcastAverage, GlobalAdapterStrategy):
    """FedIT: FedAvg of LoRA adapters with a uniform rank (Zhang et al. 2024)."""

    options: FedITOptions  # the method's registered options class (resolve_run validated them)

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        self.global_arrays = self.context.workspace.state(self.rank)

    def fit_meta(self, rnd: int) -> dict:
        return {"round": rnd, "rank": self.rank}


class FedITClient(LoraClient):
    def fit(self, message: Message) -> Message:
        received = message.arrays
        trained, result = self.train_adapter(received, message.meta["round"], message.meta["rank"])
        return self.upload({k: trained[k] - received[k] for k in trained}, result, rnd=message.meta["round"])


register(
    "fedit",
    FedITStrategy,
    FedITClient,
    FedITOptions,
    requires=LORA,
    supports=(*WEIGHTED_SUM_OPTIONS, *SCALE_OPTIONS, *PRIVACY_OPTIONS, *SECURE_AGGREGATION),
    plan=lora_plan(None),
)
