"""The options every proxy method (FedPFT, FedOT) has, apart so that the proxy's construction and
alignment (:mod:`fedtune.methods.fedpft.construction`, :mod:`fedtune.methods.fedpft.alignment`)
read them typed."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from fedtune.methods.base.averaging import Weighting
from fedtune.registry import MethodOptions


class ProxyOptions(MethodOptions):
    """Options every proxy method has: FedAvg weights, the public data set and the distillation."""

    weighting: Weighting = Field("examples", description="p_i: data size (FedAvg) or 1/N")
    distill_before: bool = Field(True, description="distill the proxy from the full model before FL")
    distill_data: str | None = Field(
        None,
        description="public data set (a data.name of the task's kind, e.g. agnews for SST-2) for distillation; "
        "None: the examples of the task's own training source outside the clients' pool (data.max_train_samples)",
    )
    distill_samples: int = Field(4000, gt=0, description="examples of the public set loaded")
    distill_steps: int = Field(200, ge=0, description="distillation steps before FL")
    distill_batch_size: int = Field(32, gt=0, description="examples per distillation step")
    distill_lr: float = Field(6e-4, gt=0, description="AdamW lr, linear warm-up 6 % then decay (paper C.2: 6e-4)")
    distill_weight_decay: float = Field(0.01, ge=0, description="paper C.2: 0.01")
    distill_seed: int | None = Field(
        None,
        description="seed of the distillation's data draw and order (None: the run's seed); runs that differ only "
        "in their seed then share one proxy (options.proxy_cache_dir)",
    )
    eval_proxy: bool = Field(True, description="also evaluate the proxy with the global adapter (proxy_accuracy)")
    proxy_cache_dir: str | None = Field(
        None, description="folder shared by runs for distilled proxies (also cached in the run folder)"
    )

    #: options that change the proxy built before FL (its cache key); subclasses add theirs
    proxy_fields: ClassVar[tuple[str, ...]] = (
        "distill_before",
        "distill_data",
        "distill_samples",
        "distill_steps",
        "distill_batch_size",
        "distill_lr",
        "distill_weight_decay",
    )

    def distill_seed_of(self, run_seed: int) -> int:
        return run_seed if self.distill_seed is None else self.distill_seed
