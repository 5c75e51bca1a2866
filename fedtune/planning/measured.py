"""The LoRA planner's knob on a model the memory model cannot price (no transformer config, a CNN
such as MobileNetV2): each rank measured on the run's workspace (:func:`measured_lora_knob`)."""

from __future__ import annotations

import numpy as np
import torch

from fedtune.planning.knob import Knob, rank_knob
from fedtune.planning.spec import PlanningContext
from fedtune.protocol.context import ClientContext


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
#: bytes of real plain LoRA client fits (:func:`~fedtune.planning.planner.metered_fit`): MobileNetV2 on
#: Fashion-MNIST, 2 local steps, 1.017 at rank 8 / batch 32 and 1.055 at rank 2 / batch 16; with 1.04 the
#: predicted peak is +1.8 % / -1.0 % of the measured there, and -3 % .. -14 % on the tests' small-cnn
#: (whose fit holds ~90 KB more)
MEASURED_LORA_FACTOR = 1.04


def measured_lora_knob(context: PlanningContext, knob: str | None) -> Knob:
    """The LoRA methods' knob on a model the memory model cannot price (no transformer config):
    each rank of r, r/2, ..., 1 priced by measuring the run's workspace with that rank's adapter,
    as the sub-model methods' plan prices a sub-model: peak = the base's
    weights and the adapter's + trainable values x 4 x (1 gradient + optimizer states) +
    :data:`MEASURED_LORA_FACTOR` x the saved bytes of one forward; seconds = 3 x its FLOPs x the
    local steps at float32's ``REFERENCE_FLOPS``. The run's quantization and checkpointing only."""
    from fedtune.models.train_memory import optimizer_states
    from fedtune.planning.memory import REFERENCE_FLOPS, Prediction, base_weight_bytes

    config = context.config
    cfg, train, ws = config.model, config.train, context.workspace

    def cost(rank: int, *_) -> tuple:
        params = ws.activate(rank).values()
        model = ws.peft_model
        # the run's base: its batch-norm statistics, its mode and the global RNG left as they were
        buffers, training = [b.clone() for b in model.buffers()], model.training
        with torch.random.fork_rng():
            saved, flops = measure_forward(context, model)
        with torch.no_grad():
            for b, kept in zip(model.buffers(), buffers):
                b.copy_(kept)
        model.train(training)
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


def measure_forward(context: ClientContext, model: torch.nn.Module) -> tuple[int, int]:
    """(the bytes autograd saves at most, the FLOPs) of one forward of ``context``'s task loss of
    ``model`` (put in training mode) on one batch of client 0's data
    (:class:`~fedtune.models.train_memory.ActivationMeter`, torch's FLOP counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fedtune.models.train_memory import ActivationMeter

    config = context.config
    model.train()
    rng = np.random.default_rng(config.seed)
    batch = next(iter(context.task.train_batches(context.partitions[0], config.train.batch_size, 1, rng)))
    with ActivationMeter(model) as meter, FlopCounterMode(display=False) as flops:
        context.task.loss(model, batch)
    return meter.peak, flops.get_total_flops()
