"""``device`` on the methods' own tensor paths, without a GPU: each method runs with
``device = "cuda"`` on the simulated CUDA of :mod:`tests.virtual_device` (CUDA's device rules,
the CPU's numbers) and must (a) do nothing CUDA refuses (a host tensor met by a device tensor,
numpy of a device tensor, a CPU generator for a device draw) and (b) give the numbers of the same
run on the CPU, round by round, to rounding (moving tensors changes no value and no seeded draw).
The real accelerator runs are in ``tests/test_gpu.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError
from fedtune.run import run_experiment
from tests.conftest import tiny
from tests.virtual_device import virtual_cuda

#: (method, task, extra overrides): one tiny run each; the extras reach a method's other paths
DEVICE_CASES = [
    ("commit", "instruction", ()),
    # centralized, the AdamW state carried across rounds (restored onto the device)
    ("commit", "instruction", ("federation.num_clients=1", "federation.clients_per_round=1",
                               "options.carry_optimizer=true", 'options.trainer="commit-clr"')),
    # the model trained directly (RunContext.model on the device); episodes (a dataclass batch) and
    # their evaluation; image normalization; classifier evaluation (a LoRA method's too)
    ("fedavg", "few-shot", ()),
    ("fedavg", "image-classification", ()),
    ("fedavg", "paired-multimodal", ()),
    ("fedit", "audio-classification", ()),
    # bilevel: x, y, masks and episodes on the device; the implicit hypergradient (CG over
    # Hessian-vector products), RAFBO's finite differences, loss tuning's data and weights
    ("rabo", "few-shot", ()),
    ("rafbo", "few-shot", ()),
    ("fedmbo", "image-classification", ()),
    # sub-models: sliced / masked tensors on the device, gradient masks, FIARSE's threshold
    ("static", "image-classification", ()),
    ("fiarse", "few-shot", ()),
    # BoMM: the backbone's features, the parties' networks, the cloud's classifier, generator
    # (preference completion), alignment and the scheduler; MM-LOCAL: a party's own generator
    ("bomm", "paired-multimodal", ()),
    pytest.param("bomm-mm-local", "paired-multimodal", (), marks=pytest.mark.slow),  # 6 s: make test-all
    # FedPFT: the proxy cut from the model on the device, layer-level distillation before FL, APoZ
    # counting and neuron-level distillation in round 1, the neuron deltas clients load in round 2;
    # FedOT's emulator (tiny-llama has middle layers) and plug-back; FedPETuning
    ("fedpft", "text-classification", ("options.align_interval=1", "options.align_steps=2")),
    pytest.param("fedot", "instruction", (), marks=pytest.mark.slow),  # 13 s: make test-all
    ("fedpetuning", "text-classification", ()),
]  # fmt: skip
#: what a round line holds that is not measured by the clock
COMPARED = ("loss", "train_loss", "accuracy", "bytes_up", "bytes_down", "kappa", "lr_encoder", "lr_language_model")


def _rounds(summary: dict) -> list[dict]:
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k in COMPARED} for line in lines]


def _run(tmp_path: Path, method: str, kind: str, extra, device: str) -> list[dict]:
    config = tiny(tmp_path / device, method, kind, "train.local_steps=1", f"device={device}", *extra)
    return _rounds(run_experiment(config))


def test_the_virtual_cuda_refuses_what_cuda_refuses(monkeypatch):
    """The model of CUDA's rules the other tests rely on, on cases whose CUDA outcome is known."""
    with virtual_cuda(monkeypatch) as mode:
        lin = torch.nn.Linear(3, 2).to("cuda")
        assert lin.weight.device.type == "cuda" and lin.weight.is_cuda
        x = torch.ones(4, 3)
        with pytest.raises(RuntimeError, match="linear: expected all tensors to be on the same device"):
            lin(x)
        y = lin(x.to(lin.weight.device))  # moved: allowed, and on the device
        assert y.device.type == "cuda" and (y * torch.tensor(2.0)).device.type == "cuda"  # a 0-dim host scalar
        assert torch.zeros(2, device=y.device).device.type == "cuda"
        assert torch.zeros(2).device.type == "cpu" and x.device.type == "cpu"  # the host original stays
        with pytest.raises(RuntimeError, match="cat: expected all tensors"):
            torch.cat([y, torch.zeros(4, 2)])
        with pytest.raises(RuntimeError, match="numpy"):
            y.detach().numpy()
        assert y.detach().cpu().numpy().shape == (4, 2)
        y.sum().backward()
        with pytest.raises(RuntimeError, match="add: expected"):
            lin.weight.grad + torch.ones(2, 3)  # the gradient is on the parameter's device
        with pytest.raises(RuntimeError, match="CPU generator"):
            torch.randn(3, device="cuda", generator=torch.Generator().manual_seed(0))
        assert y[torch.tensor([0, 1])].device.type == "cuda"  # host indices into a device tensor
        assert len(mode.errors) == 5


@pytest.mark.parametrize(("method", "kind", "extra"), DEVICE_CASES)
def test_a_run_on_cuda_keeps_every_tensor_on_the_device_and_the_cpu_numbers(tmp_path, monkeypatch, method, kind, extra):
    cpu = _run(tmp_path, method, kind, extra, "cpu")
    with virtual_cuda(monkeypatch) as mode:
        cuda = _run(tmp_path, method, kind, extra, "cuda")
    assert mode.errors == []
    assert mode.compute["cuda"] > 0 and mode.host_compute == [], mode.host_compute  # the networks ran there
    assert len(cuda) == len(cpu) == 2 and all(np.isfinite(r["loss"]) for r in cuda)
    # the same numbers, up to rounding: on a device AdamW takes its foreach path (another order of
    # float operations; on the CPU the single-tensor one), so equal to 1e-5 relative, not bit for bit
    for a, b in zip(cpu, cuda):
        assert a.keys() == b.keys()
        for key in a:
            expected = pytest.approx(a[key], rel=1e-5) if isinstance(a[key], float) else a[key]
            if key == "bytes_up":  # the reply's JSON metadata prints numbers whose last digits may differ
                expected = pytest.approx(a[key], abs=64)
            assert b[key] == expected, key


@pytest.mark.parametrize(("method", "kind"), sorted({getattr(c, "values", c)[:2] for c in DEVICE_CASES}))
def test_cuda_on_a_machine_without_it_stops_in_one_line(tmp_path, method, kind):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(
        ConfigError, match=r"^device: 'cuda' is not available here \(0 CUDA devices\); use cpu or auto$"
    ):
        run_experiment(tiny(tmp_path, method, kind, "device=cuda"))
