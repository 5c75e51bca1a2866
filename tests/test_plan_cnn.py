"""Issue 41's planner on a LoRA run whose model has no transformer config (a CNN): each rank priced
by measuring the adapted model (fedtune.planning.measured.measured_lora_knob)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fedtune.config import load_config
from fedtune.planning.measured import measured_lora_knob
from fedtune.planning.planner import GIB, format_plan, plan_budgets
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run

CNN = [
    "task.kind=image-classification",
    "model.name=small-cnn",
    "data.name=digits",
    "data.max_train_samples=240",
    "data.max_test_samples=32",
    "federation.num_clients=3",
    "federation.clients_per_round=2",
    "rounds=1",
    "train.local_steps=2",
    "train.batch_size=16",
    "model.lora_rank=4",
]


def cnn(tmp_path, method: str, *extra: str):
    return load_config(None, [*CNN, f"method={method}", f"output_dir={tmp_path}", *extra])


def predictions(config) -> dict:
    knob = measured_lora_knob(RunContext(resolve_run(config)), "rank")
    return {r: knob.cost(r, False, None)[0] for r in knob.ladder}


def test_heterolora_on_a_cnn_plans_a_rank_per_client_and_excludes_the_one_no_rank_fits(tmp_path):
    peaks = {r: p.peak for r, p in predictions(cnn(tmp_path, "heterolora")).items()}
    assert list(peaks) == [4, 2, 1] and peaks[4] > peaks[2] > peaks[1]
    budgets = [(peaks[4] + peaks[2]) / 2, 8 * GIB, peaks[1] * 0.9]
    profiles = ", ".join(f"{{memory_gib={b / GIB}}}" for b in budgets)
    plan = plan_budgets(RunContext(resolve_run(cnn(tmp_path, "heterolora", f"federation.profiles=[{profiles}]"))))
    assert [p.rank for p in plan.profiles] == [2, 4, 1]
    assert list(plan.excluded) == [2]
    assert plan.excluded[2].startswith("excluded by the plan: no setting fits its budget (rank 1: predicted peak")
    table = format_plan(plan)
    assert "float32's" in table.splitlines()[0] and "1 excluded" in table  # the speed note says its reference
    assert [line.split()[4:6] for line in table.splitlines()[2:5]] == [["rank", "2"], ["rank", "4"], ["rank", "1"]]


def test_the_predicted_peak_grows_with_the_rank_by_the_adapters_bytes(tmp_path):
    """Weights (the adapter's), its gradients and AdamW's two states: 4 x 4 bytes per adapter value."""
    config = cnn(tmp_path, "fedit")
    pred = predictions(config)
    lora = {r: sum(p.numel() for k, p in RunContext(resolve_run(config)).workspace.activate(r).items() if "lora_" in k)
            for r in (4, 2)}  # fmt: skip
    assert lora[4] == 2 * lora[2] > 0
    without_activations = {r: pred[r].peak - pred[r].activations for r in (4, 2)}
    assert without_activations[4] - without_activations[2] == (lora[4] - lora[2]) * 4 * 4
    assert pred[4].trainable - pred[2].trainable == lora[4] - lora[2]


def test_a_cnn_client_fit_measures_near_its_predicted_peak(tmp_path):
    """The measured tensor bytes of a FedIT fit on the small CNN: predicted -5 % (rank 4, batch 16)
    with the factor measured on MobileNetV2 (the tiny net's fit holds ~90 KB the forward does not save)."""
    summary = run_experiment(cnn(tmp_path, "fedit", "federation.profiles=[{memory_gib=8}]"))
    plan = json.loads(Path(summary["run_dir"], "plan.json").read_text())["clients"]
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[0])
    assert line["client_peak_bytes"]
    for cid, measured in line["client_peak_bytes"].items():
        assert abs(plan[int(cid)]["peak_bytes"] / measured - 1) < 0.1


def test_pricing_a_rank_leaves_the_runs_base_and_random_state_as_they_were(tmp_path):
    """MobileNetV2 (batch norm, dropout in its head): the measuring forward runs in training mode."""
    context = RunContext(resolve_run(cnn(tmp_path, "fedit", "model.name=mobilenet-v2", "task.image_size=32")))
    ws = context.workspace
    ws.activate(4)
    ws.model.eval()
    before = {n: b.clone() for n, b in ws.model.named_buffers()}
    assert any("running_mean" in n for n in before)
    rng = torch.random.get_rng_state()
    measured_lora_knob(context, "rank").cost(4, False, None)
    assert all(torch.equal(before[n], b) for n, b in ws.model.named_buffers())
    assert not ws.model.training and torch.equal(torch.random.get_rng_state(), rng)
