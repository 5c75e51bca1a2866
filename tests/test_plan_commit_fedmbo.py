"""Issue 41's planner for CoMMIT (FedIT's LoRA step with the trainer's extra passes and held
tensors, :data:`fedtune.methods.commit.plan.COMMIT_STEP`) and FedMBO (RABO's full-model baseline,
priced at capacity 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedtune.config import ConfigError, load_config
from fedtune.methods.rabo.plan import predict_capacity
from fedtune.planning.lora_plan import lora_knob
from fedtune.planning.memory import Shape, frozen_values
from fedtune.planning.planner import GIB, MB, bytes_per_value, metered_fit, plan_budgets
from fedtune.planning.speed import forward_flops, reference
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.instruction import Instruction
from tests.conftest import tiny

#: predicted against measured peak of a CoMMIT client's fit on the tiny instruction task (batch 16):
#: measured -7.5 % (FedIT's own prediction on FedIT's fit: -5.4 %; FedIT's prediction against the
#: CoMMIT fit: -20 %); the issue's 15 %
TOLERANCE = 0.15


def instruction(tmp_path, method: str, *extra: str):
    return load_config(
        None,
        [
            f"method={method}",
            "task.kind=instruction",
            *Instruction.test_overrides,
            "model.lora_rank=4",
            "train.batch_size=4",
            "train.local_steps=2",
            "federation.num_clients=2",
            f"output_dir={tmp_path}",
            *extra,
        ],
    )


def context(config) -> RunContext:
    return RunContext(resolve_run(config))


def client_plan(config):
    return plan_budgets(context(config), always=True).clients[0]


def test_commit_seconds_are_fedits_step_times_the_trainers_passes(tmp_path):
    fedit_ctx = context(instruction(tmp_path, "fedit"))
    fedit = plan_budgets(fedit_ctx, always=True).clients[0].seconds

    def commit(*options: str) -> float:
        return client_plan(instruction(tmp_path, "commit", *options)).seconds

    # CoMMIT: the loss pass, then D^T's and D^S's forward-backward passes (eqs. (7)-(8))
    assert commit() == pytest.approx(3 * fedit, rel=1e-12)
    # constant LR without kappa, and coordinate descent: FedIT's step
    assert commit("options.trainer=constant", "options.measure_kappa=false") == pytest.approx(fedit, rel=1e-12)
    assert commit("options.trainer=feature-cd") == pytest.approx(fedit, rel=1e-12)
    # measuring kappa (CoMMIT-CLR; constant LR by default): two gradient-free forwards after the step
    cfg = fedit_ctx.config
    base = fedit_ctx.workspace.base
    trainable = lora_knob(fedit_ctx, None).cost(4, False, None)[0].trainable
    length, logits = fedit_ctx.task.step_shape()
    shape = Shape.of(base)  # the LM head over the answer logits only
    head = (shape.vocab * shape.hidden, cfg.train.batch_size * logits)
    forwards = 2 * forward_flops(frozen_values(base), trainable, cfg.train.batch_size * length, *head)
    forwards *= cfg.train.local_steps
    measured = fedit + forwards / reference(base, shape.hidden).flops
    assert commit("options.trainer=commit-clr") == pytest.approx(measured, rel=1e-12)
    assert commit("options.trainer=constant") == pytest.approx(measured, rel=1e-12)


def test_a_budget_that_fits_fedits_peak_but_not_commits_excludes_the_commit_client(tmp_path):
    fedit, commit = (client_plan(instruction(tmp_path, m)) for m in ("fedit", "commit"))
    assert commit.peak_bytes > fedit.peak_bytes
    budget = (fedit.peak_bytes + commit.peak_bytes) / 2 / GIB
    between = f"federation.profiles=[{{memory_gib={budget}}}]"
    assert client_plan(instruction(tmp_path, "fedit", between)).excluded is None
    excluded = client_plan(instruction(tmp_path, "commit", between)).excluded
    assert (
        excluded.startswith("excluded by the plan: no setting fits its budget (rank 4") and "> memory_gib" in excluded
    )
    # a run drops it with that reason and measures the client that fits against its prediction
    budgets = f"federation.profiles=[{{memory_gib=64}}, {{memory_gib={budget}}}]"
    summary = run_experiment(instruction(tmp_path, "commit", budgets, "rounds=1", "federation.clients_per_round=2"))
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[0])
    assert line["dropped"] == {"1": excluded}
    assert abs(commit.peak_bytes / line["client_peak_bytes"]["0"] - 1) < TOLERANCE
    # the trainer runs in evaluation mode, where the LM does not checkpoint: CoMMIT refuses the
    # option (it saved nothing: 22.3 against 21.5 MB), so the planner never offers it there
    ckpt = "train.gradient_checkpointing=true"
    with pytest.raises(ConfigError, match="^train.gradient_checkpointing: method 'commit' does not support it"):
        client_plan(instruction(tmp_path, "commit", ckpt))
    assert client_plan(instruction(tmp_path, "fedit", ckpt)).peak_bytes < fedit.peak_bytes


def test_a_commit_clients_measured_peak_is_within_the_tolerance_of_its_prediction(tmp_path):
    """One real client fit (CoMMIT's regularized trainer, 2 steps of batch 16) under the meter."""
    batch = "train.batch_size=16"
    ctx = context(instruction(tmp_path, "commit", batch))
    predicted = plan_budgets(ctx, always=True).clients[0].peak_bytes
    strategy = ctx.strategy()
    strategy.initialize()
    measured = metered_fit(ctx.client(0), strategy.configure_fit(1, [0])[0]).meta["peak_bytes"]
    assert abs(predicted / measured - 1) < TOLERANCE, (predicted, measured)
    fedit = client_plan(instruction(tmp_path, "fedit", batch)).peak_bytes
    assert abs(fedit / measured - 1) > TOLERANCE, (fedit, measured)


def test_fedmbo_plans_rabos_capacity_1_prediction_ignores_stated_capacities_and_excludes(tmp_path):
    profiles = "federation.profiles=[{capacity=0.25}, {memory_gib=64}, {memory_gib=1e-9}]"
    config = tiny(tmp_path, "fedmbo", "few-shot", profiles, "federation.clients_per_round=3", "rounds=1")
    plan = plan_budgets(context(config), always=True)
    rabo, upload = predict_capacity(context(tiny(tmp_path, "rabo", "few-shot")), 1.0)
    assert [c.setting for c in plan.clients] == ["full model"] * 3
    assert {c.peak_bytes for c in plan.clients} == {rabo.peak}
    assert {c.seconds for c in plan.clients} == {rabo.seconds}
    assert {c.upload_mb for c in plan.clients} == {upload * bytes_per_value(None, "float32") / MB}
    assert [p.capacity for p in plan.profiles] == [0.25, None, None]  # stated, and ignored as the method does
    assert plan.note == "fedmbo trains the full model: the capacities of clients 0 are ignored"
    assert list(plan.excluded) == [2] and plan.excluded[2].startswith(
        "excluded by the plan: no setting fits its budget (full model: predicted peak"
    )
    summary = run_experiment(config)
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[0])
    assert line["dropped"] == {"2": plan.excluded[2]}
    assert set(line["client_peak_bytes"]) == {"1"} and line["client_peak_bytes"]["1"] > 0


@pytest.mark.parametrize(
    "trainer, copies, tensors",
    [("commit", 2, 3), ("commit-clr", 1, 0), ("feature-cd", 1, 0)],
)
def test_commit_holds_its_trainers_copies_and_answer_logits_beyond_fedits_peak(tmp_path, trainer, copies, tensors):
    """Counted by hand from ``train_coordinated``: the regularized trainer holds the provisional
    values and the swapped-out component's (2 copies of the trainable values) and answer_distance's 3
    float32 answer-logit tensors; kappa's measurement and CD one copy; every path y_hat, the loss
    pass's logits over the A + 1 positions. A table entry that drops a copy or a tensor fails here."""
    fedit = client_plan(instruction(tmp_path, "fedit"))
    ctx = context(instruction(tmp_path, "commit", f"options.trainer={trainer}"))
    commit = plan_budgets(ctx, always=True).clients[0]
    batch, positions = 4, ctx.task.step_shape()[1]
    vocab = Shape.of(ctx.skeleton).vocab
    trainable = lora_knob(ctx, None).cost(4, False, None)[0].trainable
    y_hat = 4 * batch * positions * vocab  # float32: the tiny model computes in float32
    held = copies * 4 * trainable + tensors * 4 * batch * (positions - 1) * vocab + y_hat
    assert commit.peak_bytes - fedit.peak_bytes == held
