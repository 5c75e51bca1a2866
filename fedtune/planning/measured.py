"""The LoRA planner's knob on a model the memory model cannot price (no transformer config, a CNN
such as MobileNetV2): each rank measured on the run's workspace (:func:`measured_lora_knob`)."""

from __future__ import annotations

import torch

from fedtune.planning.knob import Knob, rank_knob


def has_shape(base) -> bool:
    """Whether ``base`` has the transformer config the memory model prices (:meth:`.memory.Shape.of`)."""
    from fedtune.planning.memory import Shape

    try:
        Shape.of(base)
    except ValueError:
        return False
    return True


#: the activation term of a LoRA client on a model with no transformer config (a CNN): this factor x
#: the bytes autograd saves over one forward (:func:`measured_lora_knob`), measured against the tensor
#: bytes of real FedIT client fits (:func:`~fedtune.planning.planner.metered_fit`): MobileNetV2 on
#: Fashion-MNIST, 2 local steps, 1.017 at rank 8 / batch 32 and 1.055 at rank 2 / batch 16; with 1.04 the
#: predicted peak is +1.8 % / -1.0 % of the measured there, and -3 % .. -14 % on the tests' small-cnn
#: (whose fit holds ~90 KB more)
MEASURED_LORA_FACTOR = 1.04


def measured_lora_knob(context, knob: str | None) -> Knob:
    """The LoRA methods' knob on a model the memory model cannot price (no transformer config):
    each rank of r, r/2, ..., 1 priced by measuring the run's workspace with that rank's adapter,
    as :func:`~fedtune.planning.capacity.predict_capacity` prices a sub-model: peak = the base's
    weights and the adapter's + trainable values x 4 x (1 gradient + optimizer states) +
    :data:`MEASURED_LORA_FACTOR` x the saved bytes of one forward; seconds = 3 x its FLOPs x the
    local steps at float32's ``REFERENCE_FLOPS``. The run's quantization and checkpointing only."""
    from fedtune.models.train_memory import optimizer_states
    from fedtune.planning.capacity import measure_forward
    from fedtune.planning.memory import REFERENCE_FLOPS, Prediction, base_weight_bytes

    config = context.config
    cfg, train, ws = config.model, config.train, context.workspace

    def cost(rank: int, *_) -> tuple:
        params = ws.activate(rank).values()
        # the run's base: its batch-norm statistics, its mode and the global RNG left as they were
        buffers, training = [b.clone() for b in ws.model.buffers()], ws.model.training
        with torch.random.fork_rng():
            saved, flops = measure_forward(context, ws.model)
        with torch.no_grad():
            for b, kept in zip(ws.model.buffers(), buffers):
                b.copy_(kept)
        ws.model.train(training)
        trainable = sum(p.numel() for p in params)
        p = Prediction(
            weights=base_weight_bytes(ws.base) + sum(p.numel() * p.element_size() for p in params),
            trainable=trainable,
            states=optimizer_states(train.optimizer, train.momentum),
            activations=int(MEASURED_LORA_FACTOR * saved),
            seconds=3 * flops * train.local_steps / REFERENCE_FLOPS,
            features=(),
        )
        return p, trainable

    note = (
        f"time model: the forward's FLOPs measured (torch's counter; {cfg.name!r} has no transformer config) "
        f"at float32's {REFERENCE_FLOPS:.3g} FLOP/s"
    )
    return rank_knob(
        cfg.lora_rank, knob, cost, variants=(train.gradient_checkpointing,), formats=((cfg.quantization, cfg.dtype),),
        speed_note=note,
    )  # fmt: skip
