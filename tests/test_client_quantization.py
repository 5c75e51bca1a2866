"""Issue 41: a client's own base quantization (``federation.profiles[i].quantization``): the run
holds one base per quantization in use and each client trains on its own; the planner gives a
client over its memory budget a cheaper base before a smaller rank; bad values are one-line errors.
Every base here is float32 (4-bit compute in float32), and the CPU is seen without bfloat16 units
(as tests/test_cpu_paths.py forces it), so the same path runs on an AVX2-only CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fedtune.config import ConfigError, load_config
from fedtune.models import precision
from fedtune.models.lora import LoraWorkspace
from fedtune.planning import quantization, speed
from fedtune.planning.memory import base_weight_bytes
from fedtune.planning.planner import GIB, format_plan, plan_budgets
from fedtune.planning.quantization import weight_bytes
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.instruction import Instruction
from tests.test_flower import task_identity  # noqa: F401 - the fixture a loopback ServerApp needs

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(autouse=True)
def avx2_cpu(monkeypatch):
    """This machine seen as a CPU without bfloat16/float16 units, for fedtune and bitsandbytes."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda: False, raising=False)
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: False)


def config(tmp_path, *extra: str):
    """Two clients of HeteroLoRA on the instruction task's tiny Llama, one round of two steps."""
    overrides = [*Instruction.test_overrides, "data.max_train_samples=16", "data.max_test_samples=4"]
    overrides += ["train.local_steps=2", "train.batch_size=4", "federation.num_clients=2", "rounds=1"]
    overrides += ["method=heterolora", "model.lora_rank=4", f"output_dir={tmp_path}"]
    return load_config(None, ["task.kind=instruction", *overrides, *extra])


def quantized(base: nn.Module) -> set[str]:
    """The kinds of the base's attention projections: plain, 8-bit or 4-bit layers."""
    kinds = {"Linear": "none", "Linear8bitLt": "8bit", "Linear4bit": "4bit"}
    return {kinds[type(m).__name__] for n, m in base.named_modules() if n.endswith("q_proj")}


@pytest.fixture
def built(monkeypatch):
    """The quantization of every LoRA workspace the run builds (None: the run's ``model.quantization``)."""
    out: list[tuple[str | None, LoraWorkspace]] = []
    init = LoraWorkspace.__init__

    def record(self, task, seed, quantization=None, dtype=None):
        init(self, task, seed, quantization, dtype)
        out.append((quantization, self))

    monkeypatch.setattr(LoraWorkspace, "__init__", record)
    return out


def test_two_clients_train_on_their_own_bases_and_one_base_is_held_per_quantization_in_use(tmp_path, built):
    summary = run_experiment(config(tmp_path / "two", "federation.profiles=[{}, {quantization='4bit'}]"))
    assert [q for q, _ in built] == [None, "4bit"]  # the run's base, and the 4-bit client's
    (_, plain), (_, own) = built
    assert quantized(plain.base) == {"none"} and quantized(own.base) == {"4bit"}
    frozen = {n: p.dtype for n, p in own.base.named_parameters() if "q_proj" in n and "lora_" not in n}
    assert set(frozen.values()) == {torch.uint8}  # packed NF4
    assert {p.dtype for n, p in plain.base.named_parameters() if n in frozen} == {torch.float32}
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[-1])
    assert sorted(line["clients"]) == [0, 1] and not line.get("dropped")
    up = line["client_bytes_up"]  # the same float32 adapter from either base (the metadata's digits aside)
    assert abs(up["0"] - up["1"]) < 16 and up["0"] > 4 * sum(v.size for v in plain.state(4).values()), up
    built.clear()
    run_experiment(config(tmp_path / "one", "federation.profiles=[{}, {quantization='none'}]"))
    assert [q for q, _ in built] == [None]  # no client states another base: one base


@pytest.mark.usefixtures("task_identity")
def test_a_flower_run_trains_each_client_on_the_base_its_profile_states(tmp_path, built):
    """Flower's ClientApp serves each node's requests in the node's process (here: this one, through
    a loopback Grid), whose RunContext reads the client's profile from the run config."""
    from fedtune.engines.flower import worker
    from fedtune.engines.flower.clientapp import make_client_app
    from fedtune.engines.flower.serverapp import serve
    from tests.test_flower import LoopbackGrid

    cfg = config(tmp_path, "federation.profiles=[{}, {quantization='8bit'}]")
    try:
        summary = serve(LoopbackGrid(make_client_app(cfg), 2), cfg, timeout=120)
        node = worker._CONTEXTS[cfg.model_dump_json()]  # the nodes' context (one process here)
        assert list(node._bases) == [("8bit", "float32")]  # built by client 1's requests
        assert quantized(node._bases["8bit", "float32"].base) == {"8bit"} and quantized(node.workspace.base) == {"none"}
    finally:
        worker._CONTEXTS.pop(cfg.model_dump_json(), None)
    assert sorted(str(q) for q, _ in built) == ["8bit", "None", "None"]  # the server's base, the nodes' two
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[-1])
    assert sorted(line["clients"]) == [0, 1] and not line.get("dropped")


@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_weights_predicted_at_a_quantization_not_loaded_are_the_bytes_of_that_base(quantization):
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(q: str) -> nn.Module:
        shape = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
        torch.manual_seed(0)
        return precision.prepare_base(LlamaForCausalLM(shape), load_config(None, [f"model.quantization={q}"]))

    plain, packed = build("none"), build(quantization)
    assert weight_bytes(plain, quantization, ()) == base_weight_bytes(packed) < base_weight_bytes(plain)
    assert weight_bytes(packed, "none", ()) == base_weight_bytes(plain)


@pytest.fixture
def wide_llama(monkeypatch):
    """The task's tiny Llama at width 256 (at width 32 a 4-bit layer's block scales and maps
    outweigh what packing saves over 8 bits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedtune.models import prefix_lm

    def wider(vocab_size: int, bos: int, eos: int, pad: int, seed: int) -> nn.Module:
        shape = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)  # fmt: skip
        torch.manual_seed(seed)
        return LlamaForCausalLM(shape).eval()

    monkeypatch.setattr(prefix_lm, "tiny_llama", wider)


def test_the_planner_gives_a_4bit_base_before_a_smaller_rank_and_excludes_the_client_nothing_fits(
    tmp_path, monkeypatch, wide_llama
):
    """On a tiny Llama of width 256 (the planner tries both 8 and 4 bits)."""

    def plan(profiles: str):
        cfg = config(tmp_path, f"federation.profiles={profiles}", "train.gradient_checkpointing=true")
        return plan_budgets(RunContext(resolve_run(cfg)), always=True)

    # a 4-bit step 4x slower than float32's (8-bit: no entry, float32's): each client timed at its own base's
    monkeypatch.setattr(speed, "FLOPS", {("float32", "float32"): ((256, 1e9),), ("4bit", "float32"): ((256, 0.25e9),)})
    # the quantized rungs only: on this tiny model the bfloat16 rung (tests/test_node_budgets.py) is
    # lighter than 4-bit (k-bit preparation keeps the embedding float32), so it would fit first
    ladder = quantization.base_formats
    monkeypatch.setattr(quantization, "base_formats", lambda *a: [f for f in ladder(*a) if f[1] == "float32"])
    stated = plan("[{rank=4, quantization='8bit'}, {rank=4, quantization='4bit'}]")
    eight, packed = (c.peak_bytes for c in stated.clients)
    assert packed < eight
    assert stated.clients[1].seconds == pytest.approx(4 * stated.clients[0].seconds, rel=1e-9)
    smallest = plan("[{rank=1, quantization='4bit'}, {}]").clients[0].peak_bytes
    budgets = f"[{{memory_gib={(eight + packed) / 2 / GIB}}}, {{memory_gib={smallest * 0.99 / GIB}}}]"
    planned = plan(budgets)
    assert (planned.profiles[0].rank, planned.profiles[0].quantization) == (4, "4bit")
    assert planned.clients[0].setting == "rank 4, 4bit base" and planned.clients[0].peak_bytes == packed
    assert list(planned.excluded) == [1] and planned.profiles[1].quantization is None  # no base built for it
    assert planned.excluded[1].startswith("excluded by the plan: no setting fits its budget (rank 1, 4bit base:")
    assert "rank 4, 4bit base" in format_plan(planned)  # what `fedtune plan` prints


def test_checkpointing_the_unquantized_base_comes_before_a_quantized_one(tmp_path, wide_llama, monkeypatch):
    """A budget that checkpointing alone meets, and an 8-bit base without checkpointing would too:
    the plan keeps the run's float32 base and checkpoints it (exact, only slower), and quantizes only
    where checkpointing does not fit (a budget just under the checkpointed float32 peak: the 8-bit
    base, checkpointed). Peaks here: float32 26.2 MB, checkpointed 20.7 MB, 8-bit 22.7 MB."""

    def plan(*extra: str):
        return plan_budgets(RunContext(resolve_run(config(tmp_path, *extra))), always=True)

    # the quantized rungs only (the bfloat16 rung comes before 8-bit: the test below)
    ladder = quantization.base_formats
    monkeypatch.setattr(quantization, "base_formats", lambda *a: [f for f in ladder(*a) if f[1] == "float32"])
    plain, ckpt = (plan(f"train.gradient_checkpointing={on}").clients[0].peak_bytes for on in ("false", "true"))
    eight = plan("federation.profiles=[{rank=4, quantization='8bit'}, {}]").clients[0].peak_bytes
    assert ckpt < plain and eight < plain  # either way fits a budget between them and the plain peak
    budget = max(ckpt, eight) * 1.001
    assert budget < plain
    chosen = plan(f"federation.profiles=[{{memory_gib={budget / GIB}}}, {{}}]")
    assert chosen.clients[0].setting == "rank 4, checkpointing" and chosen.clients[0].peak_bytes == ckpt
    assert chosen.profiles[0].gradient_checkpointing and chosen.profiles[0].quantization is None
    tight = plan(f"federation.profiles=[{{memory_gib={ckpt * 0.99 / GIB}}}, {{}}]").clients[0]
    assert (tight.setting, tight.peak_bytes < ckpt) == ("rank 4, checkpointing, 8bit base", True)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ("federation.profiles=[{quantization='3bit'}]",),
            "federation.profiles[0].quantization: Input should be 'none', '8bit' or '4bit'",
        ),
        (
            ("method=flexlora", "federation.profiles=[{}, {quantization='4bit'}]"),
            "federation.profiles[1].quantization: method 'flexlora' keeps its base unquantized (expected none)",
        ),
    ],
)
def test_a_bad_client_quantization_is_a_one_line_error_naming_the_field(tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        resolve_run(config(tmp_path, *extra))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_client_quantization_without_bitsandbytes_is_refused(tmp_path, monkeypatch):
    from fedtune.planning import quantization

    monkeypatch.setattr(quantization, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^federation.profiles\[0\].quantization: '8bit' needs the bitsandbytes"):
        resolve_run(config(tmp_path, "federation.profiles=[{quantization='8bit'}]"))


def test_a_simulation_with_4bit_and_bfloat16_clients_holds_two_bases_one_per_format(tmp_path, monkeypatch):
    """Issue 52, item 3: clients 0 and 2 at 4-bit, 1 and 3 at bfloat16 (the run's base: float32) in one
    simulated process. The server's context holds the run's base (it evaluates) and one base per
    other format, built once and shared by that format's clients (object identity); each measured in
    bytes is the format's (4-bit packs the projections, bfloat16 halves the float32 weights but the kept
    heads')."""
    contexts: list[RunContext] = []
    init = RunContext.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        contexts.append(self)

    monkeypatch.setattr(RunContext, "__init__", keep)
    seen: dict[int, int] = {}  # client id -> id() of the base it trained on
    client = RunContext.client

    def record(self, cid, state=None, profile=None):
        made = client(self, cid, state, profile)
        seen.setdefault(cid, id(made.context.workspace.base))
        return made

    monkeypatch.setattr(RunContext, "client", record)
    profiles = "[{quantization='4bit'}, {dtype='bfloat16'}, {quantization='4bit'}, {dtype='bfloat16'}]"
    cfg = config(tmp_path, f"federation.profiles={profiles}", "federation.num_clients=4")
    summary = run_experiment(cfg)
    (server,) = [c for c in contexts if c._bases]
    assert sorted(server._bases) == [("4bit", "float32"), ("none", "bfloat16")]  # two bases beside the run's
    packed, half = server._bases["4bit", "float32"].base, server._bases["none", "bfloat16"].base
    assert seen[0] == seen[2] == id(packed) and seen[1] == seen[3] == id(half)  # shared by the format's clients
    assert quantized(packed) == {"4bit"} and quantized(half) == {"none"}
    assert {p.dtype for n, p in half.named_parameters() if "q_proj" in n and "lora_" not in n} == {torch.bfloat16}
    plain = base_weight_bytes(server.workspace.base)
    # measured: float32 9.31 MB, 4-bit 9.26 MB (at width 32 packing saves little), bfloat16 4.88 MB (the
    # image encoder, a kept head, stays float32)
    assert base_weight_bytes(packed) < plain and plain / 2 < base_weight_bytes(half) < 0.55 * plain
    line = json.loads(Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()[-1])
    assert sorted(line["clients"]) == [0, 1, 2, 3] and not line.get("dropped")


def test_the_planner_gives_a_float32_runs_client_a_bfloat16_base_before_a_4bit_one(tmp_path, wide_llama):
    """The format ladder (quantization.base_formats): float32, its bfloat16 copy, 8-bit, 4-bit. A memory
    budget under the float32 peak (checkpointed too) and over the bfloat16 one gets the bfloat16 base; a method that
    keeps one base (FlexLoRA merges into it) is never given one."""

    def plan(*extra: str):
        return plan_budgets(RunContext(resolve_run(config(tmp_path, *extra))), always=True)

    plain = plan().clients[0].peak_bytes
    half = plan("federation.profiles=[{rank=4, dtype='bfloat16'}, {}]").clients[0]
    assert half.peak_bytes < plain and half.setting == "rank 4, bfloat16 base"
    ckpt = plan("train.gradient_checkpointing=true").clients[0].peak_bytes  # exact, so tried before a format
    assert half.peak_bytes * 1.001 < ckpt
    budget = f"memory_gib={half.peak_bytes * 1.001 / GIB}"
    chosen = plan(f"federation.profiles=[{{{budget}}}, {{}}]")
    assert chosen.clients[0].setting == "rank 4, bfloat16 base" and chosen.profiles[0].dtype == "bfloat16"
    assert chosen.profiles[0].quantization in (None, "none") and chosen.profiles[1].dtype is None
    assert quantization.base_formats(resolve_run(config(tmp_path, "method=flexlora")).method, "none", "float32") == [
        ("none", "float32")
    ]
