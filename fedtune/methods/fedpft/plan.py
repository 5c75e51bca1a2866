"""FedPFT's and FedOT's plan: whether a client trains the adapter on the full model or on the proxy
(``profile.trains_on``), each priced by the method's own cost model (issue 52 item 4).

Both methods train one adapter that lives in the full model and in the proxy alike: FedPFT keeps
every layer and cuts only the FFN neurons of its compressed layers, so the adapter (attention and
head) has the same names and shapes in both; FedOT keeps the adapter layers whole, at other
positions (proxy position p is the full model's layer ``keep[p]``). A full-model client's update is
renamed into the proxy's positions and averaged with the others
(:class:`~fedtune.methods.fedpft.proxy.ProxyClient`), so a federation may mix the two.

Each setting is priced with the LoRA memory model (:func:`~fedtune.planning.memory.predict`) on
the model the client would hold: the full model as the run loads it, or the proxy's skeleton (the
task's model in the proxy's shape, built here from the options as the server's construction
shapes it, without its distillation, which changes values, not sizes), with the proxy's layer
count and mean FFN width in the activation term. Each method states its proxy's cut
(:class:`ProxyCut`: rank, shape and the adapter's modules) with its own code; the adapter, and so
the upload, is the same in both settings; the proxy's one-off download is not a per-round upload
and is not in the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from fedtune.config import ConfigError
from fedtune.methods.fedpft.ffn_proxy import ProxyShape, Stack, SubmodelError, apply_shape, find_stack
from fedtune.models.precision import prepare_base
from fedtune.planning.memory import Shape, predict
from fedtune.planning.spec import Knob, PlanningContext, PlanSpec
from fedtune.planning.workload import lora_workload

if TYPE_CHECKING:
    from fedtune.planning.memory import Workload


#: the settings, largest first
SETTINGS = ("full", "proxy")
LABELS = {"full": "full model", "proxy": "proxy"}


@dataclass
class ProxyCut:
    """A method's proxy of the run's base as the planner prices it: the adapter's rank, the proxy's
    shape, the adapter's modules in the full model, and in a proxy (given it and its layer stack)."""

    rank: int
    shape: ProxyShape
    full_targets: list[str]
    proxy_targets: Callable[[torch.nn.Module, Stack], list[str]]


#: a method's cut: (the run's context, its base, the base's layer stack) -> its :class:`ProxyCut`
Cut = Callable[[PlanningContext, torch.nn.Module, Stack], ProxyCut]


def proxy_plan(cut: Cut) -> PlanSpec:
    """The plan a proxy method registers: ``profile.trains_on`` on :data:`SETTINGS`, priced by
    :func:`predict_settings` with the method's ``cut``; a client's measured peak is the one its
    reply reports (the process cuts a proxy client's skeleton from the full model)."""
    return PlanSpec("trains_on", partial(proxy_knob, cut=cut), peak="reported")


def proxy_knob(context: PlanningContext, cut: Cut) -> tuple[Knob, str]:
    """The knob of a proxy method's run: each setting priced once (:func:`predict_settings`); a
    client that states no setting trains on the proxy."""
    settings = predict_settings(context, lora_workload(context, context.skeleton), cut)
    knob = Knob(list(SETTINGS), lambda p: p.trains_on, lambda v, *_: settings[v], LABELS.__getitem__, unstated="proxy")
    return knob, ""


def predict_settings(context: PlanningContext, work: Workload, cut: Cut) -> dict[str, tuple]:
    """Each setting's (:class:`~fedtune.planning.memory.Prediction`, upload values) for a client of
    ``context``'s run training with ``work`` (a :class:`~fedtune.planning.memory.Workload`), the
    proxy cut as the method's ``cut`` says."""
    config, task = context.config, context.task
    base = context.workspace.base
    heads = task.head_modules()
    try:
        stack = find_stack(base)
        c = cut(context, base, stack)
        proxy = prepare_base(apply_shape(task.build_model(config.seed), c.shape), config, heads)
        p_stack = find_stack(proxy)
    except SubmodelError as exc:
        raise ConfigError(f"method {config.method!r}: {exc}") from None
    widths = [p_stack.ffn(i).width for i in range(len(p_stack))]
    proxy_shape = replace(Shape.of(base), layers=len(p_stack), intermediate=round(sum(widths) / len(widths)))
    out = {
        "full": predict(base, c.full_targets, heads, c.rank, work),
        "proxy": predict(proxy, c.proxy_targets(proxy, p_stack), heads, c.rank, work, shape=proxy_shape),
    }
    return {k: (p, p.trainable) for k, p in out.items()}
