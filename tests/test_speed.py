"""Issue 41's time model: a step's FLOPs over the FLOP/s of the base's format (weights, compute
dtype) at its width, the CPU's bfloat16 units picking the entry, a format without one priced at
float32's and said so, and this machine's calibration in place of the table."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from fedtune.planning import speed
from fedtune.planning.memory import Shape, Workload, frozen_values, predict

DIMS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=100, tie_word_embeddings=True,
)  # fmt: skip
#: a table whose entries are told apart by their figures (GFLOP/s)
TABLE = {
    ("float32", "float32"): ((64, 1e9),),
    ("bfloat16", "bfloat16"): ((64, 4e9),),
    ("bfloat16", "float32"): ((64, 0.5e9),),
}


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(speed, "FLOPS", TABLE)


@pytest.fixture(params=[True, False], ids=["bf16-units", "avx2"])
def units(request, monkeypatch):
    """This CPU seen with or without bfloat16 units (torch.cpu's probes fedtune reads)."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: request.param, raising=False)
    return request.param


def hand_flops(batch: int, length: int, rank: int) -> float:
    """One step's FLOPs of DIMS with LoRA on q/v, counted by hand: 4 per frozen value and token
    (forward, input gradient), 6 per trainable one."""
    h, i, kv, n, v = 64, 128, 32, 2, 100  # kv: 2 heads of 64 / 4
    layer = h * h + h * kv + h * kv + h * h + 3 * h * i + 2 * h  # q, k, v, o, MLP, 2 norms
    frozen = v * h + n * layer + h  # tied embedding once, final norm
    trainable = n * rank * ((h + h) + (h + kv))  # q: h -> h, v: h -> kv
    return (4 * frozen + 6 * trainable) * batch * length


def test_bfloat16_seconds_are_the_flops_over_the_entry_the_cpus_units_pick(table, units):
    base = speed.lora_llama(DIMS, "bfloat16", rank=4).base_model.model
    prediction = predict(base, ["q_proj", "v_proj"], [], 4, Workload(2, 8, 2, False, states=2))
    fmt = ("bfloat16", "bfloat16") if units else ("bfloat16", "float32")
    assert speed.base_format(base) == fmt
    flops = 4e9 if units else 0.5e9  # the other CPU kind: fedtune upcasts each weight, float32 compute
    assert prediction.seconds == pytest.approx(hand_flops(2, 8, 4) / flops, rel=1e-9)


def test_a_format_without_an_entry_is_priced_at_float32s_and_the_note_says_so(table, monkeypatch):
    base = speed.lora_llama(DIMS, "float16", rank=4).base_model.model  # no AMX-FP16 here: float32 compute
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False, raising=False)
    ref = speed.reference(base, 64)
    assert ref.flops == 1e9
    assert (
        ref.note
        == "time model: width 64, float16 weights, float32 compute: speed not measured, float32's 1e+09 FLOP/s used"
    )


def test_a_base_on_another_device_is_priced_at_this_cpus_float32_and_the_note_says_so(table):
    base = speed.lora_llama(DIMS, "bfloat16", rank=4).base_model.model.to("meta")
    ref = speed.reference(base, 64)
    assert ref == speed.Reference(
        1e9, "time model: width 64, no speed measured on meta: this CPU's float32 1e+09 FLOP/s used"
    )


def test_widths_between_the_fitted_ones_are_interpolated_on_log_scales_and_clamped_outside():
    points = ((100, 1e9), (400, 4e9))
    assert speed.at_width(points, 200) == pytest.approx(2e9)  # halfway in log width: the geometric mean
    assert speed.at_width(points, 50) == 1e9 and speed.at_width(points, 4000) == 4e9
    assert speed.at_width(points, 400) == 4e9


def test_a_4bit_weight_counts_its_unpacked_values():
    pytest.importorskip("bitsandbytes")
    plain = speed.lora_llama(DIMS, "float32").base_model.model
    packed = speed.lora_llama(DIMS, "float32", "4bit").base_model.model
    assert speed.base_format(packed) == ("4bit", "float32")
    assert frozen_values(packed) == frozen_values(plain)


def test_fedtune_plan_states_its_time_model_and_calibrates_this_machines_speed(table, monkeypatch):
    from fedtune.cli import app
    from tests.conftest import TINY

    args = [a for item in TINY for a in ("--set", item)] + ["--set", "model.dtype=bfloat16"]
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: True, raising=False)
    plan = CliRunner().invoke(app, ["plan", "configs/heterolora.toml", *args])
    assert plan.exit_code == 0, plan.output
    tiny_width = next(line for line in plan.output.splitlines() if line.startswith("time model: width"))
    assert tiny_width.endswith(
        "bfloat16 at 4e+09 FLOP/s, fitted at widths 64-64 (benchmarks/results/budgets/speed-fit.json)"
    )
    calls = []

    def calibrate(shape, dtype, quantization):
        calls.append((dtype, quantization))
        return {("bfloat16", "bfloat16"): 3.0}

    monkeypatch.setattr(speed, "calibrate", calibrate)
    measured = CliRunner().invoke(app, ["plan", "configs/heterolora.toml", *args, "--calibrate-speed"])
    assert measured.exit_code == 0, measured.output
    assert calls == [("bfloat16", "none")]
    assert "bfloat16 measured on this machine at 3 x float32's 1e+09 FLOP/s" in measured.output
    assert speed._measured == {}  # the table again after the plan


def test_calibrate_times_the_runs_format_against_float32():
    shape = Shape.of(speed.lora_llama(DIMS, "float32").base_model.model)
    assert speed.calibrate(shape, "float32", "none") == {}  # float32 is the reference itself
    ratios = speed.calibrate(shape, "bfloat16", "none", repeats=1)
    assert list(ratios) == [speed.base_format(speed.lora_llama(DIMS, "bfloat16").base_model.model)]
    assert 0 < next(iter(ratios.values())) < 100


@pytest.mark.parametrize(
    ("quantization", "fmt"),
    [("4bit", ("4bit", "float32")), ("8bit", ("8bit", "int8")), ("none", ("float32", "float32"))],
)
def test_a_planned_quantization_is_timed_at_its_own_formats_entry(table, monkeypatch, quantization, fmt):
    """A client the planner gives another base than the loaded one (float32 here) is priced at that
    base's format (4-bit: its entry; 8-bit: none measured, float32's), not the loaded base's."""
    monkeypatch.setitem(speed.FLOPS, ("4bit", "float32"), ((64, 0.25e9),))
    base = speed.lora_llama(DIMS, "float32", rank=4).base_model.model
    assert speed.planned_format(quantization, torch.float32, torch.device("cpu")) == fmt
    work = Workload(2, 8, 4, False, states=2)
    planned = predict(
        base,
        ["q_proj", "v_proj"],
        [],
        4,
        work,
        fmt=speed.planned_format(quantization, torch.float32, torch.device("cpu")),
    )
    flops = {"4bit": 0.25e9, "8bit": 1e9, "none": 1e9}[quantization]
    assert planned.seconds == pytest.approx(hand_flops(2, 8, 4) / flops, rel=1e-9)


def test_a_4bit_base_wrapped_by_peft_counts_its_adapted_layers_unpacked():
    """PEFT's wrapper of a 4-bit layer shows the packed bytes as its ``weight``; the adapted layers'
    (in, out) are the float base's, so the trainable values (and the FLOPs, the peak) are too."""
    from fedtune.planning.memory import adapted_layers

    plain = speed.llama_base(DIMS, "float32")
    wrapped = speed.lora_llama(DIMS, "float32", "4bit", rank=4).base_model.model
    assert adapted_layers(wrapped, ["q_proj", "v_proj"]) == adapted_layers(plain, ["q_proj", "v_proj"])
    assert adapted_layers(plain, ["q_proj", "v_proj"]) == [(64, 64), (64, 32)] * 2
