"""FedPFT's and FedOT's per-client knob: whether a client trains the adapter on the full model or
on the proxy (``profile.trains_on``).

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
count and mean FFN width in the activation term. The adapter, and so the upload, is the same in
both; the proxy's one-off download is not a per-round upload and is not in the plan.
"""

from __future__ import annotations

from dataclasses import replace

#: the methods whose clients train on a proxy or on the full model
PROXY_METHODS = ("fedpft", "fedot")
#: the settings, largest first
SETTINGS = ("full", "proxy")


def predict_settings(context, work) -> dict[str, tuple]:
    """Each setting's (:class:`~fedtune.planning.memory.Prediction`, upload values) for a client of
    ``context``'s run (FedPFT or FedOT) training with ``work`` (a
    :class:`~fedtune.planning.memory.Workload`)."""
    from fedtune.config import ConfigError
    from fedtune.methods.fedpft.fedot import adapter_budget, adapter_positions, adapter_targets, layer_plan
    from fedtune.methods.fedpft.fedpft import compressed_layers
    from fedtune.methods.fedpft.ffn_proxy import ProxyShape, SubmodelError, apply_shape, find_stack, kept_width
    from fedtune.methods.fedpft.support import lora_target_modules
    from fedtune.models.precision import prepare_base
    from fedtune.planning.memory import Shape, predict

    config, task, o = context.config, context.task, context.options
    base = context.workspace.base
    heads = task.head_modules()
    try:
        stack = find_stack(base)
        n = len(stack)
        if config.method == "fedot":
            keep = layer_plan(n, o.adapter_bottom, o.adapter_top, o.emulator_layers)
            positions = adapter_positions(len(keep), o.adapter_bottom, o.adapter_top)
            rank = adapter_budget(o, config.model, n)[0]
            shape = ProxyShape(layers=tuple(keep))
            full_targets = adapter_targets(task, base, stack.path, [keep[p] for p in positions])
        else:
            layers = compressed_layers(n, o.retained_layers)
            rank, positions = config.model.lora_rank, list(range(n))
            shape = ProxyShape(widths=tuple((i, kept_width(stack.ffn(i).width, o.keep_ratio)) for i in layers))
            full_targets = lora_target_modules(task, base)
        proxy = prepare_base(apply_shape(task.build_model(config.seed), shape), config, heads)
        p_stack = find_stack(proxy)
    except SubmodelError as exc:
        raise ConfigError(f"method {config.method!r}: {exc}") from None
    widths = [p_stack.ffn(i).width for i in range(len(p_stack))]
    proxy_shape = replace(Shape.of(base), layers=len(p_stack), intermediate=round(sum(widths) / len(widths)))
    proxy_targets = (
        adapter_targets(task, proxy, p_stack.path, positions)
        if config.method == "fedot"
        else lora_target_modules(task, proxy)
    )
    out = {
        "full": predict(base, full_targets, heads, rank, work),
        "proxy": predict(proxy, proxy_targets, heads, rank, work, shape=proxy_shape),
    }
    return {k: (p, p.trainable) for k, p in out.items()}
