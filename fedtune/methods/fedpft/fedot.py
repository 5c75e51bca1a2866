"""FedOT: Offsite-Tuning (Xiao et al. 2023) with many clients, FedPFT's baseline (Peng et al. 2024, Sec. 4.1.2).

The model's layers split into the bottom ``adapter_bottom`` and top ``adapter_top`` layers (the
*adapter*) and the middle ones, which the server compresses by **uniform layer drop** into an
*emulator* of ``emulator_layers`` of them (Offsite-Tuning's ``uniform_choose_layers``: indices
round(i (n-1)/(k-1)) of the n middle layers, both ends kept; default k = round(3/8 n), the
paper's 8 -> 3 for BERT-base) and distills it before FL: the emulator's output must match the
full middle block's on a public data set, as Offsite-Tuning's ``get_kd_loss`` (normalized MSE,
:func:`~fedtune.methods.fedpft.distill.normalized_mse`), every emulator parameter training, the
adapter (identical in both) frozen. The emulator then stays frozen.

FL: clients get the proxy (adapter + emulator + embeddings + head) once through Messages
(:mod:`.proxy`), tune LoRA on the adapter layers' attention (the task's LoRA targets restricted
to those layers) and the head, FedAvg. The paper keeps "the number of trainable parameters the
same for all three methods": LoRA sits on fewer layers here, so its rank is ``adapter_rank``
(default lora_rank x layers / adapter layers, with lora_alpha scaled alike so alpha / r is
unchanged). Evaluation plugs the adapter into the full model (its LoRA renamed from the proxy's
layer positions to the full model's), ``accuracy``; the proxy's is ``proxy_accuracy``.
``distill_before = false`` is FedOT without emulator distillation (plain layer drop).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from pydantic import Field

from fedtune.config import ConfigError
from fedtune.methods.base.averaging import SECURE_AGGREGATION, WEIGHTED_SUM_OPTIONS
from fedtune.methods.base.lora import LORA, SERVER_DEVIATIONS
from fedtune.methods.fedpft.alignment import ProxyAligner
from fedtune.methods.fedpft.construction import ProxyBuilder
from fedtune.methods.fedpft.distill import DistillPairs
from fedtune.methods.fedpft.ffn_proxy import ProxyShape, Stack, find_stack, keep_layers, uniform_choose
from fedtune.methods.fedpft.options import ProxyOptions
from fedtune.methods.fedpft.plan import ProxyCut, proxy_plan
from fedtune.methods.fedpft.proxy import ProxyClient, ProxyStrategy, rename_layers
from fedtune.methods.fedpft.support import ModelTask, load_tensors, lora_target_modules, state_tensors, task_model
from fedtune.models.lora import LoraWorkspace
from fedtune.models.tensors import to_numpy
from fedtune.planning.spec import PlanningContext
from fedtune.protocol.context import ServerContext, options_as
from fedtune.registry import register


class FedOTOptions(ProxyOptions):
    adapter_bottom: int = Field(1, ge=0, description="bottom layers of the adapter (paper: 2 of 12)")
    adapter_top: int = Field(1, ge=0, description="top layers of the adapter (paper: 2 of 12)")
    emulator_layers: int | None = Field(
        None, ge=0, description="middle layers kept (None: round(3/8 of them), paper 8 -> 3)"
    )
    adapter_rank: int | None = Field(
        None, gt=0, description="LoRA rank on the adapter (None: lora_rank x layers / adapter layers)"
    )

    proxy_fields: ClassVar[tuple[str, ...]] = ProxyOptions.proxy_fields + (
        "adapter_bottom",
        "adapter_top",
        "emulator_layers",
    )
    deviations: ClassVar[dict[str, str]] = {
        **SERVER_DEVIATIONS,
        "options.distill_data": "None (default) distills on the task's own held-out examples, not a public corpus",
        "options.weighting": "'uniform' departs from FedAvg's data-size weights",
    }


def layer_plan(n_layers: int, bottom: int, top: int, emulator: int | None) -> list[int]:
    """The full model's layers the proxy keeps: the bottom adapter, the emulator (uniform drop of
    the middle), the top adapter."""
    middle = n_layers - bottom - top
    if middle < 0:
        raise ConfigError(
            f"options.adapter_bottom + adapter_top = {bottom + top} exceeds the model's {n_layers} layers"
        )
    k = (max(1, round(3 * middle / 8)) if middle else 0) if emulator is None else emulator
    if k > middle:
        raise ConfigError(f"options.emulator_layers = {k}: the model has only {middle} middle layers")
    emulator_idx = [bottom + j for j in uniform_choose(middle, k)] if k else []
    return list(range(bottom)) + emulator_idx + list(range(n_layers - top, n_layers))


def adapter_budget(o: FedOTOptions, cfg, n_layers: int) -> tuple[int, float]:
    """(rank, alpha) of the adapter: FedPETuning's trainable parameters on fewer layers, rank x
    ``n_layers`` / adapter layers (``cfg``: the run's model config), alpha / r kept."""
    n_adapter = o.adapter_bottom + o.adapter_top
    if n_adapter == 0:
        raise ConfigError("options.adapter_bottom + adapter_top: the adapter needs at least one layer")
    rank = o.adapter_rank or max(1, round(cfg.lora_rank * n_layers / n_adapter))
    return rank, cfg.lora_alpha * rank / cfg.lora_rank


def adapter_positions(n_proxy_layers: int, bottom: int, top: int) -> list[int]:
    """Positions, in a proxy of ``n_proxy_layers`` layers, of the adapter's: the first ``bottom``, the last ``top``."""
    return list(range(bottom)) + list(range(n_proxy_layers - top, n_proxy_layers))


def adapter_targets(task, model: torch.nn.Module, stack_path: str, positions: list[int]) -> list[str]:
    """The task's LoRA targets in ``model`` that lie in layers ``positions`` of its stack."""
    inside = tuple(f"{stack_path}.{p}." for p in positions)
    return [n for n in lora_target_modules(task, model) if n.startswith(inside)]


class LayerDropBuilder(ProxyBuilder):
    """FedOT's proxy: the adapter layers around an emulator, a uniform layer drop of the middle
    layers distilled from the full middle block (module docstring)."""

    options: FedOTOptions

    def __init__(self, context: ServerContext, aligner: ProxyAligner, method_name: str) -> None:
        super().__init__(context, aligner, method_name)
        self.options = options_as(context, FedOTOptions)
        self.keep: list[int] = []
        self.n_layers = 0

    @property
    def adapter_positions(self) -> list[int]:
        """Positions, in the proxy, of the adapter's layers."""
        return adapter_positions(len(self.keep), self.options.adapter_bottom, self.options.adapter_top)

    @property
    def emulator_positions(self) -> list[int]:
        o = self.options
        return list(range(o.adapter_bottom, len(self.keep) - o.adapter_top))

    def construct(self):
        o = self.options
        model = task_model(self.context)
        full_params = sum(p.numel() for p in model.parameters())
        self.n_layers = len(find_stack(model))
        self.keep = layer_plan(self.n_layers, o.adapter_bottom, o.adapter_top, o.emulator_layers)
        stack = keep_layers(model, self.keep)
        record = {
            "layers": self.keep,
            "full_params": full_params,
            "proxy_params": sum(p.numel() for p in model.parameters()),
        }
        emulator = self.emulator_positions
        if o.distill_before and o.distill_steps and emulator:
            teacher = self.aligner.teacher()
            t_stack = find_stack(teacher)
            model.requires_grad_(False)
            params = [p for i in emulator for p in stack.layers[i].parameters()]
            for p in params:
                p.requires_grad_(True)
            pairs = DistillPairs(
                teacher, model, [t_stack.layers[self.n_layers - o.adapter_top - 1]], [stack.layers[emulator[-1]]]
            )
            record["distill"] = self.aligner.run_distillation(
                pairs, params, o.distill_steps, 0, "fedot: emulator distillation"
            )
            model.requires_grad_(False)
        return model, record

    def restore(self, state: dict) -> None:
        self.keep = [int(i) for i in np.asarray(state["layers"]).ravel()]
        self.n_layers = int(state["n_layers"])

    def rebuild(self, state: dict) -> torch.nn.Module:
        model = task_model(self.context)
        keep_layers(model, self.keep)
        load_tensors(state_tensors(model), state["emulator"], strict=False)
        return model

    def describe(self) -> dict:
        path = find_stack(self.proxy).path
        inside = tuple(f"{path}.{i}." for i in self.emulator_positions)
        emulator = {k: to_numpy(t) for k, t in self.clean_tensors.items() if k.startswith(inside)}
        return {"layers": np.asarray(self.keep, dtype=np.int64), "n_layers": self.n_layers, "emulator": emulator}

    @property
    def shape(self) -> ProxyShape:
        return ProxyShape(layers=tuple(self.keep))

    def lora_targets(self) -> list[str]:
        return adapter_targets(self.context.task, self.proxy, find_stack(self.proxy).path, self.adapter_positions)


class FedOTStrategy(ProxyStrategy):
    """FedOT: Offsite-Tuning in FL, adapter layers tuned around a frozen layer-drop emulator (Xiao et al. 2023)."""

    method_name = "fedot"
    options: FedOTOptions  # the method's registered options class (resolve_run validated them)
    builder: LayerDropBuilder  # what __init__ builds

    def __init__(self, context: ServerContext) -> None:
        super().__init__(context, LayerDropBuilder(context, ProxyAligner(context), self.method_name))

    # -- the adapter --------------------------------------------------------------------------------------
    def adapter_budget(self) -> tuple[int, float]:
        return adapter_budget(self.options, self.config.model, self.builder.n_layers)

    def to_full(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The adapter's arrays named by the full model's layers (proxy position p -> layer keep[p])."""
        return rename_layers(arrays, find_stack(self.builder.proxy).path, self.builder.keep)

    @cached_property
    def full_ws(self) -> LoraWorkspace:
        """LoRA on the full model's adapter layers only (plug-back)."""
        task, seed, builder = self.context.task, self.config.seed, self.builder
        model = task.build_model(seed)
        stack = find_stack(model)
        targets = adapter_targets(task, model, stack.path, [builder.keep[p] for p in builder.adapter_positions])
        return LoraWorkspace(ModelTask(task, lambda: task.build_model(seed), targets), seed)

    def evaluate_full(self) -> dict[str, float]:
        ws = self.full_ws
        ws.load(self.to_full(self.global_arrays), self.rank, self.alpha)
        return self.context.task.evaluate(ws.peft_model, self.config.train.eval_batch_size)

    def save(self, run_dir: Path) -> None:
        self.full_ws.save_pretrained(run_dir / "adapter", self.to_full(self.global_arrays), self.rank, self.alpha)

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.__dict__.pop("full_ws", None)


class FedOTClient(ProxyClient):
    options: FedOTOptions  # the method's registered options class (resolve_run validated them)

    def proxy_targets(self, model: torch.nn.Module) -> list[str]:
        o = self.options
        positions = adapter_positions(len(self.store["shape"].layers), o.adapter_bottom, o.adapter_top)
        return adapter_targets(self.context.task, model, find_stack(model).path, positions)


def proxy_cut(context: PlanningContext, base: torch.nn.Module, stack: Stack) -> ProxyCut:
    """FedOT's proxy as the planner prices it: the emulator's kept layers, the adapter layers whole at
    their proxy positions (the full model's layers ``keep[p]``) (:mod:`fedtune.methods.fedpft.plan`)."""
    o, task, n = options_as(context, FedOTOptions), context.task, len(stack)
    keep = layer_plan(n, o.adapter_bottom, o.adapter_top, o.emulator_layers)
    positions = adapter_positions(len(keep), o.adapter_bottom, o.adapter_top)
    rank = adapter_budget(o, context.config.model, n)[0]
    full = adapter_targets(task, base, stack.path, [keep[p] for p in positions])
    shape = ProxyShape(layers=tuple(keep))
    return ProxyCut(rank, shape, full, lambda model, stack: adapter_targets(task, model, stack.path, positions))


register(
    "fedot",
    FedOTStrategy,
    FedOTClient,
    FedOTOptions,
    requires=(*LORA, "transformer"),
    supports=(*WEIGHTED_SUM_OPTIONS, *SECURE_AGGREGATION, "device"),
    plan=proxy_plan(proxy_cut),
)
