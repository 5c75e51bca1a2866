"""The model-scale cases on CUDA (``pytest -m gpu tests/test_gpu.py`` on a machine with a GPU;
deselected elsewhere): each runs on the GPU and on the CPU and must agree.

Tolerances: float32 on the GPU may use TF32 matmuls and other kernels, so losses agree to 2 %
relative; bfloat16 bases and 4-bit NF4 bases (dequantized by different kernels) to 5 %."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import load_config
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from tests.test_scale import TINY as CPU_TINY
from tests.test_scale import batch_of

pytestmark = pytest.mark.gpu
#: the CPU cases' configuration with the image encoder trained from scratch (no weights package needed)
TINY = [*CPU_TINY, "task.image_encoder=small-cnn"]

CASES = {
    "float32": ([], 0.02),
    "bfloat16": (["model.dtype=bfloat16"], 0.05),
    "4bit": (["model.quantization=4bit"], 0.05),
    "checkpointing": (["train.gradient_checkpointing=true"], 0.02),
}


def _run(tmp_path, device: str, method: str, extra: list[str]) -> list[dict]:
    cfg = load_config(
        None, [*TINY, f"output_dir={tmp_path / device}", f"device={device}", f"method={method}", "rounds=2", *extra]
    )
    run_dir = Path(run_experiment(cfg)["run_dir"])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", ["fedit", "fslora"])
def test_a_run_on_cuda_agrees_with_the_cpu(tmp_path, method, case):
    extra, rtol = CASES[case]
    cpu, cuda = _run(tmp_path, "cpu", method, extra), _run(tmp_path, "cuda", method, extra)
    for a, b in zip(cpu, cuda):
        assert np.isfinite(b["loss"]) and np.isfinite(b["train_loss"])
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=rtol)
        assert b["loss"] == pytest.approx(a["loss"], rel=rtol)
    # the same arrays crossed (the header's JSON metadata prints losses, whose digits may differ)
    assert cuda[-1]["bytes_up"] == pytest.approx(cpu[-1]["bytes_up"], abs=64)


def test_the_shared_base_lives_on_the_gpu_and_batches_follow_it(tmp_path):
    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}", "device=cuda", "model.dtype=bfloat16"])
    context = RunContext(resolve_run(cfg))
    ws = context.workspace
    params = ws.activate(4)
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params.values())
    assert all(p.device.type == "cuda" for p in ws.base.parameters())
    loss = context.task.loss(ws.model, batch_of(context.task))  # a CPU batch
    assert loss.device.type == "cuda" and torch.isfinite(loss)


@pytest.mark.parametrize("case", ["float32", "bfloat16", "4bit"])
def test_a_causal_lm_run_on_cuda_agrees_with_the_cpu(tmp_path, case):
    """The causal-LM task (tiny-llama on two commonsense sets): training, response loss and the
    log-likelihood choice scoring on CUDA against the CPU."""
    from fedtune.tasks.causal_lm import CausalLM

    extra, rtol = CASES[case]
    runs = {}
    for device in ("cpu", "cuda"):
        cfg = load_config(
            None,
            ["task.kind=causal-lm", *CausalLM.test_overrides, f"output_dir={tmp_path / device}", f"device={device}",
             "rounds=2", "federation.num_clients=2", "model.lora_rank=4", *extra],
        )  # fmt: skip
        run_dir = Path(run_experiment(cfg)["run_dir"])
        runs[device] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=rtol)
        assert b["loss"] == pytest.approx(a["loss"], rel=rtol)
        assert abs(b["accuracy"] - a["accuracy"]) <= 0.25  # 8 questions: at most 2 flips near ties


#: (method, task, extra overrides) of the methods whose own tensor code follows ``device``
#: (tests/test_device.py checks the same cases on a simulated CUDA), and each one's tolerance.
#: float32 on both sides; the GPU may use TF32 matmuls and other reduction orders, so after two
#: rounds losses agree to 2 % relative. CoMMIT's kappa is a ratio of small distances between
#: rounded predictions: 25 %. Where a model has dropout, its masks come from the device's generator
#: (seeded by the same torch.manual_seed, drawn differently), so the runs agree less closely.
METHOD_CASES = [
    ("commit", "instruction", (), 0.02),
    ("fedavg", "few-shot", (), 0.02),
    ("fedavg", "image-classification", (), 0.02),
    # these two models have dropout, whose masks come from the device's generator (seeded alike,
    # drawn differently): 10 %
    ("fedavg", "paired-multimodal", (), 0.1),
    ("fedit", "audio-classification", (), 0.1),
    ("rabo", "few-shot", (), 0.02),
    ("rafbo", "few-shot", (), 0.05),  # finite differences (mu = fd_mu) of TF32 forwards
    ("fedmbo", "image-classification", (), 0.02),
    ("static", "image-classification", (), 0.02),
    ("fiarse", "few-shot", (), 0.02),
    # BoMM's networks have dropout (the cloud classifier, the small models): 10 %
    ("bomm", "paired-multimodal", (), 0.1),
    ("bomm-mm-local", "paired-multimodal", (), 0.1),
    # the proxy methods on the tiny BERT (dropout: 10 %) and tiny-llama (none)
    ("fedpft", "text-classification", ("options.align_interval=1", "options.align_steps=2"), 0.1),
    ("fedot", "instruction", (), 0.02),
    ("fedpetuning", "text-classification", (), 0.1),
]


@pytest.mark.parametrize(("method", "kind", "extra", "rtol"), METHOD_CASES)
def test_a_method_run_on_cuda_agrees_with_the_cpu(tmp_path, method, kind, extra, rtol):
    """A 2-round tiny run of the method (tests/conftest.py's ``tiny``) on CUDA and on the CPU."""
    from tests.conftest import tiny

    runs = {}
    for device in ("cpu", "cuda"):
        summary = run_experiment(tiny(tmp_path / device, method, kind, f"device={device}", *extra))
        lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        runs[device] = [json.loads(line) for line in lines]
    assert len(runs["cuda"]) == len(runs["cpu"]) == 2
    for a, b in zip(runs["cpu"], runs["cuda"]):
        assert np.isfinite(b["loss"]) and np.isfinite(b["train_loss"])
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=rtol)
        assert b["loss"] == pytest.approx(a["loss"], rel=rtol)
        if a.get("kappa") is not None:
            assert b["kappa"] == pytest.approx(a["kappa"], rel=0.25)
    # the same arrays crossed (the JSON metadata prints numbers whose digits may differ)
    assert runs["cuda"][-1]["bytes_up"] == pytest.approx(runs["cpu"][-1]["bytes_up"], rel=2e-3)


@pytest.mark.parametrize("method", ["fedit", "local"])
def test_clients_spread_over_two_gpus_agree_with_one_gpu_process(tmp_path, method):
    """``device = "cuda"`` with two or more GPUs spreads the clients over all of them (one worker
    process each, its base on its GPU) and agrees with one process on ``cuda:0``. The same kernels
    on the same GPU model, but atomics in some backward kernels may add in another order: 1e-4
    relative. The worker on ``cuda:1`` shows as memory taken there while the run is on."""
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 or more GPUs ({count} visible)")
    free_before = torch.cuda.mem_get_info(1)[0]
    taken = []

    def on_round(record) -> None:
        taken.append(free_before - torch.cuda.mem_get_info(1)[0])

    runs = {}
    for device in ("cuda:0", "cuda"):
        cfg = load_config(
            None,
            [*TINY, f"output_dir={tmp_path / device.replace(':', '')}", f"device={device}", f"method={method}",
             "rounds=2", "train.threads=1"],
        )  # fmt: skip
        summary = run_experiment(cfg, on_round=on_round if device == "cuda" else None)
        lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        runs[device] = [json.loads(line) for line in lines]
    assert min(taken) > 100 * 2**20  # a CUDA context and a base on cuda:1, held by its worker
    for a, b in zip(runs["cuda:0"], runs["cuda"]):
        assert b["dropped"] == {} and b["clients"] == a["clients"]
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["bytes_down"] == a["bytes_down"]
