"""Model scale (fedtune.models.precision, the wire dtype, the shared base): bfloat16 and 4-bit bases,
gradient checkpointing, the upload dtype and one frozen base per process, on tiny-llama (the
instruction task's tiny configuration)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError, load_config
from fedtune.models.precision import prepare_base, resolve_device
from fedtune.protocol.compression import bfloat16_bits, from_bfloat16_bits, wire_decode, wire_encode
from fedtune.protocol.validation import ArraySpec, check_arrays
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.instruction import Instruction
from tests.conftest import assert_moved_alike

pytest.importorskip("bitsandbytes")

TINY = [
    "task.kind=instruction",
    *Instruction.test_overrides,
    "data.max_train_samples=16",
    "data.max_test_samples=4",
    "train.local_steps=2",
    "train.batch_size=4",
    "federation.num_clients=2",
    "model.lora_rank=4",
]
SCALES = {
    "bfloat16": ["model.dtype=bfloat16"],
    "4bit": ["model.quantization=4bit"],
    "checkpointing": ["train.gradient_checkpointing=true"],
}


def config(tmp_path, *overrides):
    return load_config(None, [*TINY, f"output_dir={tmp_path / 'runs'}", *overrides])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def batch_of(task, n: int = 4):
    pool = np.arange(n)
    return next(iter(task.train_batches(pool, n, 1, np.random.default_rng(0))))


@pytest.fixture(scope="module")
def float32_runs(tmp_path_factory):
    """The float32 runs the other scales are compared with: method -> metrics lines."""
    tmp = tmp_path_factory.mktemp("f32")
    return {m: metrics(Path(run_experiment(config(tmp, f"method={m}", "rounds=2"))["run_dir"])) for m in ("fedit",)}


@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize("method", ["fedit", "fslora"])
def test_two_rounds_at_scale_give_finite_losses_and_an_adapter_that_reloads(tmp_path, method, scale, float32_runs):
    """Two rounds give finite losses; the saved adapter loads with ``PeftModel.from_pretrained``
    onto a base built and prepared the same way (same dtype or quantization), holds the run's
    final global arrays, and gives the run's own loss on a batch."""
    from peft import PeftModel

    cfg = config(tmp_path, f"method={method}", "rounds=2", *SCALES[scale])
    summary = run_experiment(cfg)
    run_dir = Path(summary["run_dir"])
    lines = metrics(run_dir)
    assert [x["round"] for x in lines] == [1, 2]
    assert all(np.isfinite(x["loss"]) and np.isfinite(x["train_loss"]) for x in lines)
    if method == "fedit" and scale == "checkpointing":  # recomputing activations changes no number
        assert [x["train_loss"] for x in lines] == [x["train_loss"] for x in float32_runs["fedit"]]
        assert [x["loss"] for x in lines] == [x["loss"] for x in float32_runs["fedit"]]
    if method == "fedit" and scale in ("bfloat16", "4bit"):  # a different base computes other numbers
        assert lines[-1]["train_loss"] != float32_runs["fedit"][-1]["train_loss"]
        assert lines[-1]["train_loss"] == pytest.approx(float32_runs["fedit"][-1]["train_loss"], rel=0.05)

    context = RunContext(resolve_run(cfg))
    ws = context.workspace
    state = load_state(run_dir / "checkpoint.npz")
    global_arrays = state["global"]
    params = ws.load(global_arrays, int(state["rank"]))
    batch = batch_of(context.task)
    with torch.no_grad():
        ws.model.eval()
        run_loss = float(context.task.loss(ws.model, batch))
    fresh = prepare_base(context.task.build_model(cfg.seed), cfg, context.task.head_modules())
    loaded = PeftModel.from_pretrained(fresh, str(run_dir / "adapter")).eval()
    loaded_params = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert loaded_params and all(p.dtype == torch.float32 for p in loaded_params.values())
    lora_b = next(k for k in params if ".lora_B." in k)
    module = lora_b.replace(".lora_B.weight", "")
    saved_b = next(p for n, p in loaded_params.items() if module in n and "lora_B" in n)
    np.testing.assert_array_equal(saved_b.detach().numpy(), global_arrays[lora_b])
    with torch.no_grad():
        assert float(context.task.loss(loaded, batch)) == pytest.approx(run_loss, rel=1e-4)


def test_a_bfloat16_base_keeps_adapters_heads_and_norms_in_float32(tmp_path):
    ws = RunContext(resolve_run(config(tmp_path, *SCALES["bfloat16"]))).workspace
    params = ws.activate(4)
    assert params and all(p.dtype == torch.float32 for p in params.values())  # what trains and travels
    q_proj = ws.base.language_model.model.layers[0].self_attn.q_proj
    assert q_proj.base_layer.weight.dtype == torch.bfloat16 and not q_proj.base_layer.weight.requires_grad
    assert ws.base.language_model.model.norm.weight.dtype == torch.float32
    projector = ws.base.image_projector.modules_to_save[ws.adapter_name(4)]
    assert all(p.dtype == torch.float32 and p.requires_grad for p in projector.parameters())
    frozen_bytes = sum(p.numel() * p.element_size() for p in ws.base.parameters() if not p.requires_grad)
    f32 = RunContext(resolve_run(config(tmp_path / "f32"))).workspace
    f32.activate(4)
    assert frozen_bytes < 0.6 * sum(p.numel() * p.element_size() for p in f32.base.parameters() if not p.requires_grad)


def test_a_4bit_base_is_nf4_with_double_quantization_and_lora_on_top(tmp_path):
    import bitsandbytes as bnb

    ws = RunContext(resolve_run(config(tmp_path, *SCALES["4bit"]))).workspace
    ws.activate(4)
    q_proj = ws.base.language_model.model.layers[0].self_attn.q_proj
    layer = q_proj.base_layer
    assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.quant_type == "nf4"
    assert layer.weight.compress_statistics and layer.weight.dtype == torch.uint8
    assert not isinstance(ws.base.language_model.lm_head, bnb.nn.Linear4bit)  # tied to the embedding
    # the quantized layer computes what its dequantized weights do (within NF4's error)
    x = torch.randn(3, layer.in_features)
    dense = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    torch.testing.assert_close(layer(x), x @ dense.float().T, rtol=1e-4, atol=1e-5)


def test_a_method_that_writes_into_base_weights_refuses_a_quantized_base(tmp_path):
    for method in ("fedstacklora", "flexlora"):
        with pytest.raises(ConfigError, match=rf"^model.quantization: method '{method}' does not support it"):
            RunContext(resolve_run(config(tmp_path, f"method={method}", *SCALES["4bit"])))


def test_gradient_checkpointing_is_on_and_refused_by_models_without_it(tmp_path):
    ws = RunContext(resolve_run(config(tmp_path, *SCALES["checkpointing"]))).workspace
    assert ws.base.language_model.is_gradient_checkpointing
    tiny_cnn = load_config(
        None,
        [
            "task.kind=image-classification",
            "model.name=small-cnn",
            "method=fedavg",
            f"output_dir={tmp_path}",
        ],
    )
    from fedtune.models.precision import enable_gradient_checkpointing

    with pytest.raises(ConfigError, match="^train.gradient_checkpointing: model 'small-cnn' does not support it"):
        enable_gradient_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)), tiny_cnn.model.name)


def test_device_names_an_unavailable_accelerator_in_one_line():
    with pytest.raises(ValueError, match="device"):
        load_config(None, ["device=gpu"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^device: 'cuda:1' is not available here \(0 CUDA devices\)"):
            resolve_device("cuda:1")
        assert resolve_device("auto").type in ("cpu", "mps")
    assert resolve_device("cpu") == torch.device("cpu")


# -- the wire dtype -------------------------------------------------------------------------------
def test_bfloat16_on_the_wire_rounds_as_torch_does_and_decodes_to_float32():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1e3
    x[:6] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0 + 2**-8]  # the last is a tie: rounds to even (1.0)
    decoded = from_bfloat16_bits(bfloat16_bits(x))
    reference = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(decoded, reference)
    assert decoded[5] == 1.0
    enc = wire_encode({"w": x[6:], "idx": np.arange(3)}, "bfloat16")
    assert set(enc) == {"w.bf16", "idx"} and enc["w.bf16"].dtype == np.uint16
    dec = wire_decode(enc)
    assert dec["w"].dtype == np.float32 and np.array_equal(dec["idx"], np.arange(3))
    half = wire_decode(wire_encode({"w": x[6:]}, "float16"))["w"]
    np.testing.assert_array_equal(half, x[6:].astype(np.float16).astype(np.float32))


def test_a_reply_in_the_wire_dtype_is_checked_as_the_float32_it_decodes_to():
    spec = {"w": ArraySpec((2, 3))}
    good = wire_encode({"w": np.ones((2, 3), np.float32)}, "bfloat16")
    assert check_arrays(good, spec) is None
    assert "shape" in check_arrays(wire_encode({"w": np.ones((3, 2), np.float32)}, "float16"), spec)
    assert "non-finite" in check_arrays(wire_encode({"w": np.full((2, 3), np.nan, np.float32)}, "bfloat16"), spec)
    wrong_storage = {"w.bf16": np.ones((2, 3), np.float32)}  # not the uint16 bits: stays an unknown array
    assert check_arrays(wrong_storage, spec) is not None
    both = {"w": np.ones((2, 3), np.float32), "w.f16": np.ones((2, 3), np.float16)}  # no silent pick
    assert "unexpected" in check_arrays(both, spec)


@pytest.mark.parametrize("method", ["fedit", "fslora"])
def test_a_bfloat16_upload_halves_the_bytes_and_the_server_aggregates_in_float32(tmp_path, method):
    runs = {}
    for wire in ("float32", "bfloat16"):
        cfg = config(tmp_path / wire, f"method={method}", "rounds=1", f"federation.wire_dtype={wire}")
        summary = run_experiment(cfg)
        state = load_state(Path(summary["run_dir"]) / "checkpoint.npz")
        runs[wire] = (summary["total_bytes_up"], state)
    (up32, s32), (up16, s16) = runs["float32"], runs["bfloat16"]
    assert 0.45 * up32 < up16 < 0.6 * up32  # 2 bytes per entry instead of 4, plus headers
    globals16 = s16["global"]
    assert globals16 and all(v.dtype == np.float32 for v in globals16.values())
    assert any(not np.array_equal(v, s32["global"][k]) for k, v in globals16.items())  # the rounding reached the mean
    strategy = RunContext(resolve_run(config(tmp_path / "init", f"method={method}"))).strategy()
    strategy.initialize()
    assert_moved_alike(globals16, s32["global"], strategy.global_arrays)  # decoded, under the same names


# -- one frozen base per process ------------------------------------------------------------------
def _parameter_bytes() -> int:
    """Bytes of every distinct parameter storage alive in the process (by data_ptr)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Parameter) and obj.device.type != "meta":
            seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(seen.values())


def test_the_parameter_storage_does_not_grow_with_the_number_of_clients(tmp_path):
    """The embedded engine's clients and the server's evaluation share one base: a run of 8
    clients holds as many parameter bytes as a run of 2 (measured while the run is alive, over
    what the process held before it: other tests' models may still be alive)."""
    one_base = sum(
        p.numel() * p.element_size() for p in RunContext(resolve_run(config(tmp_path))).task.build_model(0).parameters()
    )
    held = {}
    for n in (2, 8):
        before, peak = _parameter_bytes(), []
        cfg = config(tmp_path / str(n), "rounds=1", f"federation.num_clients={n}", "data.max_train_samples=32")
        run_experiment(cfg, on_round=lambda record, peak=peak: peak.append(_parameter_bytes()))
        held[n] = max(peak) - before
    assert abs(held[8] - held[2]) < 0.1 * one_base  # a base per client would add 6 bases
    assert 0.5 * one_base < held[2] < 2 * one_base  # one base (plus adapters), not one per side


def test_gpu_fractions_go_to_rays_client_resources_and_only_on_the_flower_simulation(monkeypatch):
    from fedtune.engines.flower import simulation

    with pytest.raises(ValueError, match="placement.gpus_per_client: applies to engine = 'flower-sim'"):
        load_config(None, ["placement.gpus_per_client=0.25", "device=cuda"])
    with pytest.raises(ValueError, match="placement.gpus_per_client: needs device = 'cuda' or 'auto'"):
        load_config(None, ["placement.gpus_per_client=0.25", "engine=flower-sim"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    backend = simulation.ray_backend_config(4, gpus_per_client=0.25)
    assert backend["client_resources"]["num_gpus"] == 0.25 and backend["init_args"]["num_gpus"] == 2
    assert simulation.ray_backend_config(4)["client_resources"]["num_gpus"] == 0.0  # the default: none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="^placement.gpus_per_client: this machine has no CUDA device"):
        simulation.ray_backend_config(4, gpus_per_client=0.25)


def test_commit_trains_on_a_4bit_base_and_refuses_bfloat16_and_checkpointing(tmp_path):
    """CoMMIT honours quantization (its kappa measured on float32 predictions) and refuses a
    bfloat16 base in one line, and checkpointing: its trainer runs the model in evaluation mode,
    where Hugging Face layers do not checkpoint (accepted, it saved no memory)."""
    runs = {}
    for name, extra in {"plain": [], "4bit": SCALES["4bit"]}.items():
        summary = run_experiment(config(tmp_path / name, "method=commit", "rounds=1", *extra))
        runs[name] = metrics(Path(summary["run_dir"]))[-1]
    assert np.isfinite(runs["4bit"]["train_loss"]) and np.isfinite(runs["4bit"]["kappa"])
    assert runs["4bit"]["train_loss"] != runs["plain"]["train_loss"]
    for field, scale in (("model.dtype", "bfloat16"), ("train.gradient_checkpointing", "checkpointing")):
        with pytest.raises(ConfigError, match=f"^{field}: method 'commit' does not support it"):
            RunContext(resolve_run(config(tmp_path, "method=commit", *SCALES[scale])))


@pytest.mark.skipif(not __import__("fedtune.process").process._malloc_trim(), reason="glibc only")
def test_freed_heap_pages_go_back_between_clients(tmp_path, monkeypatch):
    """What grew the resident size by ~12 MB per simulated client (benchmarks/llm/llm_scale.py): megabyte
    buffers freed on the heap behind a buffer that lives on (a reply awaiting aggregation) stay
    resident until ``release_free_memory`` trims, which it does once the resident size has grown by
    ``min_growth`` over its level one call after the last trim (not before every client: the next
    client would fault its working set in again); and the embedded engine asks before every client."""
    import psutil

    from fedtune import process
    from fedtune.engines import local

    rss = psutil.Process().memory_info

    def freed_behind_a_live_buffer():
        buffers = [np.ones(2**17) for _ in range(64)]  # 64 MB of 1 MB buffers, resident
        pinned = np.ones(2**17)  # allocated after them: the heap cannot shrink from its top
        del buffers
        return pinned, rss().rss

    np.empty(2**20).fill(0)  # a first freed 8 MB mmap raises glibc's threshold: later buffers go on the heap
    pinned, before = freed_behind_a_live_buffer()
    monkeypatch.setattr(process, "_level", [before - 2**20])  # grown by 1 MiB over the level
    process.release_free_memory(min_growth=2**21)  # below min_growth: nothing is trimmed
    assert before - rss().rss < 8 * 2**20 and process._level == [before - 2**20]
    process.release_free_memory(min_growth=2**20)  # at min_growth: trimmed, the level measured anew
    assert before - rss().rss > 32 * 2**20, "freed heap pages still resident"
    assert process._level == [None]
    process.release_free_memory(min_growth=0)  # the call after a trim measures the level, trims nothing
    assert process._level[0] is not None
    del pinned

    calls = []
    monkeypatch.setattr(local, "release_free_memory", lambda: calls.append(1))
    run_experiment(config(tmp_path, "rounds=1", "federation.num_clients=3"))
    assert len(calls) >= 3  # once before each client's fit (and evaluation)


@pytest.mark.skipif(not __import__("fedtune.process").process._glibc(), reason="glibc only")
@pytest.mark.parametrize("limited", [True, False])
def test_the_threads_of_a_fedtune_process_share_two_malloc_arenas(limited):
    """A buffer freed by one thread is reused only by allocations in its own arena: a node trained in a
    thread of the server's process beside the server's evaluation kept two working sets (60-110 MB on
    MiniLM). After ``limit_malloc_arenas`` 6 threads allocating at once share 2 arenas (glibc's
    ``malloc_stats``); the control, without it, has one per thread (glibc's default: 8 per core)."""
    code = f"""
import ctypes, sys, threading
from fedtune.process import _glibc, limit_malloc_arenas
if {limited}:
    limit_malloc_arenas()
together = threading.Barrier(6)
def allocate():
    together.wait()
    kept = [ctypes.create_string_buffer(4096) for _ in range(16)]
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
_glibc().malloc_stats()
"""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    arenas = done.stderr.count("Arena ")
    assert arenas == 2 if limited else arenas >= 6, done.stderr


def test_a_quantized_base_is_read_in_its_checkpoints_dtype_and_ends_as_if_read_in_float32(tmp_path, monkeypatch):
    """A 4-bit base is read in the checkpoint's own dtype (a 3B bfloat16 checkpoint is never widened
    to float32 in full) and, once quantized and prepared, holds exactly what reading it in float32
    first gives: the same NF4 codes and scales, every other parameter float32 with the same values."""
    import transformers

    from fedtune.models import prefix_lm as plm
    from fedtune.tasks import build_task

    tok = plm.byte_tokenizer()
    lm = plm.tiny_llama(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, seed=0)
    folder = tmp_path / "bf16-checkpoint"
    lm.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = load_config(None, ["task.kind=causal-lm", f"model.name={folder}", "model.quantization=4bit"])

    read = []
    original = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **kw: read.append(kw.get("dtype")) or original(*a, **kw),
    )
    new = prepare_base(build_task(cfg).build_model(0), cfg)
    assert read == ["auto"]
    old = prepare_base(plm.build_language_model(str(folder), 0, torch.float32).requires_grad_(True), cfg)
    new_state, old_state = new.state_dict(), old.state_dict()
    assert new_state.keys() == old_state.keys()
    for name, value in old_state.items():
        assert new_state[name].dtype == value.dtype and torch.equal(new_state[name], value), name
    assert {p.dtype for n, p in new.named_parameters() if "proj" not in n} == {torch.float32}


def test_an_8bit_base_holds_int8_weights_that_compute_what_the_float_ones_do(tmp_path):
    """LLM.int8: every linear outside the heads is a bitsandbytes Linear8bitLt with int8 weights
    (quantized as the layer is replaced), and computes what the float32 layer does within int8's
    error (row-wise absmax: 1/127 of a row's largest weight)."""
    import bitsandbytes as bnb

    base = RunContext(resolve_run(config(tmp_path, "model.quantization=8bit"))).workspace.base
    dense = RunContext(resolve_run(config(tmp_path / "f32"))).workspace.base
    layer = base.language_model.model.layers[0].self_attn.q_proj
    reference = dense.language_model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear8bitLt) and layer.weight.dtype == torch.int8
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        got, want = layer(x).float(), reference(x)
    assert not torch.equal(got, want)  # quantized, not the float weights
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * float(want.abs().max()))


def tiny_causal_lm(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_without_bfloat16_units_stores_bfloat16_and_computes_float32(monkeypatch, native):
    """Where the CPU has no bfloat16 units (``computes_natively`` False: AVX512-BF16 / AMX absent),
    a bfloat16 base keeps its linear and embedding weights in bfloat16 and computes in float32: its
    logits equal, bit for bit, a float32 model whose weights are those bfloat16 values, and so do
    the input gradients; with the units present, the base computes under bfloat16 autocast (other
    numbers)."""
    from fedtune.models import precision

    monkeypatch.setattr(precision, "computes_natively", lambda device, dtype: native)
    base = precision.prepare_base(tiny_causal_lm(), load_config(None, ["model.dtype=bfloat16", "device=cpu"]))
    rounded = tiny_causal_lm()
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    q_proj = base.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.bfloat16 and base.model.embed_tokens.weight.dtype == torch.bfloat16
    assert base.model.norm.weight.dtype == torch.float32
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    hidden = [m.model.embed_tokens(ids).float().detach().requires_grad_() for m in (base, rounded)]
    logits = [m(inputs_embeds=h).logits for m, h in zip((base, rounded), hidden)]
    for out in logits:
        out.float().square().sum().backward()
    if native:
        assert isinstance(q_proj, torch.nn.Linear) and type(q_proj) is torch.nn.Linear
        assert not torch.equal(logits[0].float(), logits[1])
        return
    assert isinstance(q_proj, precision.UpcastLinear) and logits[0].dtype == torch.float32
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(hidden[0].grad, hidden[1].grad)
    with torch.no_grad():  # through the embedding too
        assert torch.equal(base(ids).logits, rounded(ids).logits)


def test_bfloat16_compute_is_native_on_accelerators_and_on_cpus_with_bfloat16_units(monkeypatch):
    from fedtune.models.precision import computes_natively

    cpu = torch.device("cpu")
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False, raising=False)
    assert not computes_natively(cpu, torch.bfloat16) and not computes_natively(cpu, torch.float16)
    assert computes_natively(cpu, torch.float32) and computes_natively(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert computes_natively(cpu, torch.bfloat16) and not computes_natively(cpu, torch.float16)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True, raising=False)
    assert computes_natively(cpu, torch.float16)


def test_an_upcast_linear_keeps_only_its_stored_weight_for_the_backward_pass():
    """The backward pass of a frozen :class:`UpcastLinear` holds the bfloat16 weight, never a
    float32 copy (a model's float32 copy would otherwise live through its whole forward pass), and
    gives dL/dx = dL/dy W and no weight gradient; a trainable weight gets its gradient through the
    cast."""
    from fedtune.models.precision import UpcastLinear

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 24).to(torch.bfloat16).requires_grad_(False)
    layer.__class__ = UpcastLinear
    x = torch.randn(5, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert saved and not any(t.dtype == torch.float32 and t.numel() == layer.weight.numel() for t in saved)
    grad = torch.randn(5, 24)
    y.backward(grad)
    w = layer.weight.float()
    assert torch.equal(y, torch.nn.functional.linear(x, w, layer.bias.float()))
    assert torch.allclose(x.grad, grad @ w, rtol=0, atol=1e-6) and layer.weight.grad is None
    layer.weight.requires_grad_(True)
    layer(x.detach()).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.bfloat16


def test_upcasts_reuse_one_buffer_per_shape_and_thread_and_chained_layers_keep_their_gradients(monkeypatch):
    """:func:`precision.upcast` writes a heap-sized weight into its thread's buffer for the shape
    (no fresh block per call: those fragmented glibc's heap), a larger one is a fresh copy; two
    frozen layers of one shape in a chain, each overwriting the buffer between the other's forward
    and backward, still give the float32 chain's output and input gradient exactly."""
    import threading

    from fedtune.models import precision

    torch.manual_seed(0)
    first, second = (torch.nn.Linear(16, 16).to(torch.bfloat16).requires_grad_(False) for _ in range(2))
    for layer in (first, second):
        layer.__class__ = precision.UpcastLinear
    a, b = precision.upcast(first.weight, torch.float32), precision.upcast(second.weight, torch.float32)
    assert a.data_ptr() == b.data_ptr() and torch.equal(b, second.weight.float())
    other = []
    thread = threading.Thread(target=lambda: other.append(precision.upcast(first.weight, torch.float32)))
    thread.start()
    thread.join()
    assert other[0].data_ptr() != a.data_ptr() and torch.equal(other[0], first.weight.float())
    monkeypatch.setattr(precision, "UPCAST_BUFFER_MAX_BYTES", 16 * 16 * 4 - 1)
    assert precision.upcast(first.weight, torch.float32).data_ptr() != a.data_ptr()
    monkeypatch.undo()

    x = torch.randn(3, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = second(torch.tanh(first(x)))
    w1, w2 = first.weight.float(), second.weight.float()
    linear = torch.nn.functional.linear
    y_ref = linear(torch.tanh(linear(x_ref, w1, first.bias.float())), w2, second.bias.float())
    grad = torch.randn(3, 16)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(y, y_ref) and torch.allclose(x.grad, x_ref.grad, rtol=0, atol=1e-6)
