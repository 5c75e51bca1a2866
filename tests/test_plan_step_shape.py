"""Issue 41: the planner prices a LoRA client's step at the shape its task's batches take
(:meth:`fedtune.tasks.base.Task.step_shape`): rows padded to the longest training row (the
instruction task's prompt, prefix slots and answer run past ``data.max_length``) and the LM
head's logits over the answer span only, not ``data.max_length`` x every position."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from fedtune.config import load_config
from fedtune.planning.memory import COEFFICIENTS, Shape, predict
from fedtune.planning.planner import lora_workload, metered_fit, plan_budgets
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks import get_task_class

#: predicted against measured peak of one real FedIT client fit (2 steps, rank 4, tiny-llama):
#: instruction batch 4 -3.1 %, batch 16 -5.4 %; causal-LM batch 4 -8.8 %, batch 16 -9.5 %.
#: At data.max_length x every position: -4.5 %, -9.0 %, +17.3 %, +18.7 %. With model.lora_dropout 0.1,
#: causal-LM batch 16: -8.0 % (-38 % without the dropout term).
TOLERANCE = 0.10


def context(tmp_path, kind: str, batch: int, *extra: str) -> RunContext:
    overrides = get_task_class(kind).test_overrides
    config = load_config(
        None,
        [
            "method=fedit",
            f"task.kind={kind}",
            *overrides,
            "model.lora_rank=4",
            f"train.batch_size={batch}",
            "train.local_steps=2",
            "federation.num_clients=2",
            f"output_dir={tmp_path}",
            *extra,
        ],
    )
    return RunContext(resolve_run(config))


def predicted(ctx: RunContext, work) -> int:
    """The rank-4 prediction of ``work`` on the run's base, as the planner makes it."""
    return predict(ctx.workspace.base, ctx.task.lora_targets(), ctx.task.head_modules(), 4, work).peak


@pytest.mark.parametrize("kind", ["instruction", "causal-lm"])
def test_the_planner_prices_the_tasks_padded_rows_and_answer_logits(tmp_path, kind):
    ctx = context(tmp_path, kind, 4)
    task, base = ctx.task, ctx.workspace.base
    # one batch of the whole training pool: padded to its longest row; the loss's LM head runs
    # over its longest answer and the position before it
    labels = next(task.train_batches(np.arange(len(task.train)), len(task.train), 1, np.random.default_rng(0)))[
        "labels"
    ]
    width = labels.shape[1]
    first = int((labels != -100).float().argmax(-1).min())
    work = lora_workload(ctx, base)
    assert (work.length, work.logits) == (width, width - first + 1)
    max_length = ctx.config.data.max_length
    if kind == "instruction":
        assert work.length > max_length  # image prefix + prompt + answer: longer than data.max_length
    else:
        assert work.logits < work.length == max_length  # rows cut to data.max_length, logits the response's
    # the logits term shrinks by exactly the positions the head does not compute
    every = replace(work, logits=None)
    vocab_term = COEFFICIENTS["llama"][3] * 4 * work.batch * (work.length - work.logits) * Shape.of(base).vocab
    assert predicted(ctx, every) - predicted(ctx, work) == pytest.approx(vocab_term, abs=2)
    assert plan_budgets(ctx, always=True).clients[0].peak_bytes == predicted(ctx, work)


def test_text_classification_keeps_max_length_and_has_no_vocabulary_logits(tiny_config):
    ctx = RunContext(resolve_run(tiny_config("method=fedit")))
    work = lora_workload(ctx, ctx.workspace.base)
    assert (work.length, work.logits) == (ctx.config.data.max_length, None)
    assert Shape.of(ctx.workspace.base).vocab == 0


@pytest.mark.parametrize("kind, batch", [("instruction", 4), ("instruction", 16), ("causal-lm", 4), ("causal-lm", 16)])
def test_a_fedit_clients_measured_peak_is_within_the_tolerance_of_its_prediction(tmp_path, kind, batch):
    """One real client fit under the meter; ``data.max_length`` x every position is further off."""
    ctx = context(tmp_path, kind, batch)
    planned, measured = planned_and_measured(ctx)
    work = lora_workload(ctx, ctx.workspace.base)
    fallback = predicted(ctx, replace(work, length=ctx.config.data.max_length, logits=None))
    assert abs(fallback / measured - 1) > abs(planned / measured - 1), (fallback, planned, measured)


def test_lora_dropouts_inputs_and_masks_are_priced(tmp_path):
    """Each adapted layer keeps its dropped input and mask: without that term the prediction of a
    causal-LM client's fit with ``model.lora_dropout`` 0.1 was 38 % short (LoRA on all 7 projections)."""
    ctx = context(tmp_path, "causal-lm", 16, "model.lora_dropout=0.1")
    planned, measured = planned_and_measured(ctx)
    work = lora_workload(ctx, ctx.workspace.base)
    assert work.dropout
    without = predicted(ctx, replace(work, dropout=False))
    assert abs(without / measured - 1) > 3 * TOLERANCE, (without, measured)


def planned_and_measured(ctx: RunContext) -> tuple[int, int]:
    """The plan's peak of client 0 and the peak measured over one real fit of it, within the tolerance."""
    planned = plan_budgets(ctx, always=True).clients[0].peak_bytes
    strategy = ctx.strategy()
    strategy.initialize()
    measured = metered_fit(ctx.client(0), strategy.configure_fit(1, [0])[0]).meta["peak_bytes"]
    assert abs(planned / measured - 1) < TOLERANCE, (planned, measured)
    return planned, measured


@pytest.mark.parametrize(("optimizer", "momentum", "states"), [("sgd", 0.0, 0), ("sgd", 0.9, 1), ("adamw", 0.0, 2)])
def test_the_planner_counts_the_optimizer_states_torch_keeps(tiny_config, optimizer, momentum, states):
    """The states per trainable value the planner prices (its workload for the run's optimizer) are
    the tensors of a trainable's shape that torch's optimizer, built as a client builds it, holds
    after a step: plain SGD none, heavy-ball SGD its momentum buffer, AdamW its two moments."""
    import torch

    from fedtune.models.training import make_optimizer

    config = tiny_config("method=fedit", f'train.optimizer="{optimizer}"', f"train.momentum={momentum}")
    ctx = RunContext(resolve_run(config))
    weight = torch.nn.Parameter(torch.randn(5, 3))
    step = make_optimizer([weight], config.train)
    weight.square().sum().backward()
    step.step()
    held = [v for v in step.state[weight].values() if torch.is_tensor(v) and v.shape == weight.shape]
    assert len(held) == states
    assert lora_workload(ctx, ctx.workspace.base).states == states


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_dropout_is_priced_for_one_layer_under_checkpointing(tiny_config, checkpointing):
    """The planned peak with ``model.lora_dropout`` 0.1 exceeds the one without by the dropped
    inputs (float32: 4 bytes) and their masks (1 byte) of the adapted layers that are held at once:
    every transformer layer's without checkpointing, one layer's with it (the others' are recomputed
    in the backward). Counted here from the model: tiny-bert's layer 0 adapts query and value, 32
    inputs each, and it has 2 layers."""
    from fedtune.planning.planner import plan_budgets

    peaks = []
    for dropout in (0.0, 0.1):
        config = tiny_config(
            "method=fedit",
            f"model.lora_dropout={dropout}",
            f"train.gradient_checkpointing={str(checkpointing).lower()}",
        )
        ctx = RunContext(resolve_run(config))
        peaks.append(plan_budgets(ctx, always=True).clients[0].peak_bytes)
    base, targets = ctx.workspace.base, ctx.task.lora_targets()
    layer_inputs: Counter[str] = Counter()  # transformer layer -> its adapted modules' inputs
    for name, module in base.named_modules():
        if name.split(".")[-1] in targets:
            layer_inputs[name.split(".layer.")[1].split(".")[0]] += module.in_features
    assert layer_inputs == {"0": 64, "1": 64}
    held = sum(layer_inputs.values()) if not checkpointing else layer_inputs["0"]
    batch, length = config.train.batch_size, config.data.max_length
    assert peaks[1] - peaks[0] == (4 + 1) * batch * length * held
