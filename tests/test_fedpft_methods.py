"""FedPFT, FedOT and FedPETuning through their real Strategy / Client objects (fedtune.methods.fedpft):
the proxy reaching clients only through Messages, plug-back into the full model (exact, as the
merged weights predict), keep-ratio 1.0, neuron-level alignment driven by APoZ on activations the
test controls, the byte accounting of APoZ uploads and neuron downloads, a client that lost its
proxy, FedOT's layer renaming and budget, and the clients' training memory.

Unfaithful variants these tests catch (``test_alignment_selects_the_high_apoz_neurons``):
random neuron selection, the lowest-APoZ neurons, and alignment that updates every neuron.
Tiny model (2-layer BERT, hidden 32): seconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import fedtune.methods.fedpft.fedpft as fedpft_module
from fedtune.config import ConfigError, load_config
from fedtune.engines.embedded import exchange
from fedtune.methods.fedpft.fedpft import APOZ, DELTA, TOKENS
from fedtune.methods.fedpft.ffn_proxy import find_stack
from fedtune.methods.fedpft.proxy import PROXY
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HAS_SST2 = (Path(os.environ.get("FEDTUNE_DATA_DIR", "data")) / "sst2" / "train.tsv").is_file()
DATA = "sst2" if HAS_SST2 else "tweets"
# a public set of another domain for distillation when the data directory has it (loads 64 examples);
# else the task's own held-out examples
HAS_AGNEWS = (Path(os.environ.get("FEDTUNE_DATA_DIR", "data")) / "agnews" / "dev.tsv").is_file()
PUBLIC = ["options.distill_data=agnews"] if HAS_AGNEWS else []
ALIGN_EVERY_ROUND = (  # FedPFT aligning a quarter of the neurons after every round, 3 steps
    "options.align_interval=1",
    "options.align_fraction=0.25",
    "options.distill_before=false",
    "options.align_steps=3",
)
TOP_LAYER = ("options.adapter_bottom=0", "options.adapter_top=1")  # the adapter: layer 1, the top one
BASE = [
    *PUBLIC,
    "model.name=tiny-bert",
    f"data.name={DATA}",
    "data.max_train_samples=160",
    "data.max_test_samples=32",
    "data.max_length=16",
    "train.local_steps=2",
    "train.batch_size=8",
    "train.eval_batch_size=32",
    "train.lr=0.01",
    "federation.num_clients=3",
    "rounds=3",
    "options.distill_steps=10",
    "options.distill_batch_size=8",
    "options.distill_samples=64",
]


class Federation:
    """A server strategy and client contexts of their own, talking through encoded Messages."""

    def __init__(self, tmp_path: Path, method: str = "fedpft", *overrides: str) -> None:
        base = [o for o in BASE if method != "fedpetuning" or not o.startswith("options.")]  # no proxy options
        self.config = load_config(None, [*base, f"method={method}", f"output_dir={tmp_path}", *overrides])
        self.server, self.clients = RunContext(resolve_run(self.config)), RunContext(resolve_run(self.config))
        self.strategy = self.server.strategy()
        self.strategy.initialize()
        self.states: dict[int, dict] = {}
        self.sent: dict[int, object] = {}
        self.down: dict[int, int] = {}

    def round(self, rnd: int, cids: list[int], drop: tuple[int, ...] = ()) -> tuple[dict, dict]:
        """One training exchange; ``drop``: clients whose reply never arrives. Returns (replies, metrics)."""
        self.sent = self.strategy.configure_fit(rnd, cids)
        replies = {}
        for cid, message in self.sent.items():
            if cid in drop:
                continue
            client = self.clients.client(cid, dict(self.states.get(cid, {})))
            reply, self.down[cid], up, _ = exchange(message, client.fit)
            assert up == reply.nbytes
            self.states[cid] = client.state
            replies[cid] = reply
        return replies, self.strategy.aggregate_fit(rnd, replies)


def batch_of(task, n: int = 8):
    return next(task.train_batches(np.arange(n), n, 1, np.random.default_rng(0)))


def test_proxy_reaches_clients_only_through_messages(tmp_path):
    fed = Federation(tmp_path)
    fed.round(1, [0, 1])
    first = fed.sent[0]
    assert first.meta["proxy"] == "full" and set(k[len(PROXY) :] for k in first.arrays if k.startswith(PROXY)) == set(
        fed.strategy.builder.clean_tensors
    )
    # the client's model holds exactly the server's proxy, every tensor, none of its locally built weights
    store = vars(fed.clients)["_proxy_store"]
    for name, tensor in fed.strategy.builder.clean_tensors.items():
        assert torch.equal(store["tensors"][name], tensor), name
    assert int(fed.states[0]["proxy_version"]) == 0
    fed.round(2, [0, 2])
    assert "proxy" not in fed.sent[0].meta and not any(k.startswith(PROXY) for k in fed.sent[0].arrays)
    assert fed.sent[2].meta["proxy"] == "full"


def test_plug_back_is_exact(tmp_path):
    """The adapter trained on the proxy, applied to the full model, changes its outputs exactly as
    merging W + (alpha / r) B A into the full model's weights (and the trained head) predicts."""
    fed = Federation(tmp_path)
    fed.round(1, [0])
    arrays, task = fed.strategy.global_arrays, fed.server.task
    assert any(np.abs(v).max() > 0 for k, v in arrays.items() if "lora_B" in k)  # it trained
    ws = fed.server.workspace
    ws.load(arrays, fed.strategy.rank)
    batch = batch_of(task)
    ws.model.eval()
    with torch.no_grad():
        plugged = ws.model(**batch).logits
        merged = task.build_model(fed.config.seed).eval()
        scale = fed.config.model.lora_alpha / fed.strategy.rank
        params = dict(merged.named_parameters())
        for name, a in arrays.items():
            if ".lora_A." in name:
                module = name.split(".lora_A.")[0]
                b = arrays[name.replace("lora_A", "lora_B")]
                params[module + ".weight"] += scale * torch.from_numpy(b @ a)
            elif "lora_" not in name:
                params[name].copy_(torch.from_numpy(a))  # the head (modules_to_save)
        expected = merged(**batch).logits
        untouched = task.build_model(fed.config.seed).eval()(**batch).logits
    assert torch.allclose(plugged, expected, atol=1e-5)
    assert not torch.allclose(plugged, untouched, atol=1e-3)


@pytest.mark.parametrize("distill", ["false", "true"])
def test_keep_ratio_one_proxy_evaluates_as_the_full_model(tmp_path, distill):
    fed = Federation(
        tmp_path,
        "fedpft",
        "options.keep_ratio=1.0",
        f"options.distill_before={distill}",
        "options.distill_weight_decay=0",
    )
    fed.round(1, [0, 1])
    metrics = fed.strategy.evaluate(1)
    assert metrics["proxy_accuracy"] == metrics["accuracy"] and metrics["proxy_loss"] == metrics["loss"]


def control_activations(fed, chosen: dict[int, list[int]]) -> None:
    """Make every compressed neuron's activation constant: gelu(-1) <= 0 (APoZ 1) for ``chosen``,
    gelu(+1) > 0 (APoZ 0) for the others (W1 = 0), in the server's proxy (the clients download it)."""
    stack = find_stack(fed.strategy.builder.proxy)
    with torch.no_grad():
        for i, neurons in chosen.items():
            ffn = stack.ffn(i)
            ffn.up.weight.zero_()
            ffn.up.bias.fill_(1.0)
            ffn.up.bias[neurons] = -1.0


def aligned_neurons(tmp_path, select=None, masks=None) -> tuple[dict, dict, dict]:
    """Round 1 of FedPFT with APoZ (t = 1, p = 0.25 of 16 neurons) on controlled activations;
    ``select`` / ``masks`` replace the strategy's neuron selection / training masks (variants).
    Returns (chosen, changes the strategy recorded, (before, after) FFN tensors of layer 0)."""
    fed = Federation(
        tmp_path,
        "fedpft",
        "options.align_interval=1",
        "options.align_fraction=0.25",
        "options.distill_before=false",
        "options.align_steps=5",
    )
    chosen = {0: [1, 4, 9, 14], 1: [0, 2, 3, 15]}
    control_activations(fed, chosen)
    ffn = find_stack(fed.strategy.builder.proxy).ffn(0)
    before = [t.detach().clone() for t in (ffn.up.weight, ffn.up.bias, ffn.down.weight)]
    saved = fedpft_module.select_neurons, fedpft_module.neuron_masks
    fedpft_module.select_neurons = select or saved[0]
    fedpft_module.neuron_masks = masks or saved[1]
    try:
        replies, metrics = fed.round(1, [0, 1])
    finally:
        fedpft_module.select_neurons, fedpft_module.neuron_masks = saved
    for reply in replies.values():  # the clients' counts: every real token for the chosen, none otherwise
        tokens = reply.arrays[TOKENS]
        for j, (i, neurons) in enumerate(chosen.items()):
            expect = np.where(np.isin(np.arange(16), neurons), tokens[j], 0)
            assert np.array_equal(reply.arrays[f"{APOZ}{i}"], expect)
    after = [t.detach().clone() for t in (ffn.up.weight, ffn.up.bias, ffn.down.weight)]
    return chosen, fed.strategy.builder.changes.get(1, {}), (before, after)


def faithful_alignment(chosen, changes, tensors) -> bool:
    """The test's criterion: exactly the high-APoZ neurons were selected and changed, every other
    entry of the FFN is bit-identical."""
    if not changes or any(sorted(changes[i].tolist()) != chosen[i] for i in chosen):
        return False
    (w1, b1, w2), (w1n, b1n, w2n) = tensors
    other = np.setdiff1d(np.arange(16), chosen[0])
    same = (
        torch.equal(w1[other], w1n[other])
        and torch.equal(b1[other], b1n[other])
        and torch.equal(w2[:, other], w2n[:, other])
    )
    changed = not torch.equal(w1[chosen[0]], w1n[chosen[0]])
    return same and changed


def test_alignment_selects_the_high_apoz_neurons(tmp_path):
    assert faithful_alignment(*aligned_neurons(tmp_path / "faithful"))

    def random_selection(apoz, fraction, rng):
        return np.sort(np.random.default_rng(1).choice(len(apoz), max(1, round(fraction * len(apoz))), replace=False))

    def lowest_apoz(apoz, fraction, rng):
        return np.sort(np.argsort(apoz, kind="stable")[: max(1, round(fraction * len(apoz)))])

    saved_masks = fedpft_module.neuron_masks

    def every_neuron(stack, i, selected):
        return saved_masks(stack, i, np.arange(stack.ffn(i).width))

    assert not faithful_alignment(*aligned_neurons(tmp_path / "random", select=random_selection))
    assert not faithful_alignment(*aligned_neurons(tmp_path / "lowest", select=lowest_apoz))
    assert not faithful_alignment(*aligned_neurons(tmp_path / "unmasked", masks=every_neuron))


def test_apoz_uploads_and_neuron_downloads_are_byte_accounted(tmp_path):
    fed = Federation(
        tmp_path,
        "fedpft",
        *ALIGN_EVERY_ROUND,
        "rounds=2",
    )  # aligns after round 1 only
    replies, metrics = fed.round(1, [0, 1])
    layers, width, hidden = [0, 1], 16, 32
    per_client = 4 * width * len(layers) + 8 * len(layers)  # int32 counts per neuron, int64 positions per layer
    for reply in replies.values():
        assert sum(a.nbytes for k, a in reply.arrays.items() if k.startswith(APOZ)) == per_client
        assert reply.arrays[TOKENS].dtype == np.int64 and reply.arrays[f"{APOZ}0"].dtype == np.int32
    assert metrics["apoz_upload_bytes"] == 2 * per_client
    changed = fed.strategy.builder.changes[1]
    assert fed.strategy.builder.version == 1 and all(len(changed[i]) == 4 for i in layers)
    # round 2: client 0 is one version behind: it gets exactly the changed neurons (+ b2), client 2 everything
    replies, metrics = fed.round(2, [0, 2])
    delta = {k: a for k, a in fed.sent[0].arrays.items() if k.startswith(DELTA)}
    assert fed.sent[0].meta["proxy"] == "delta" and fed.sent[0].meta["proxy_base"] == 0
    for i in layers:
        assert np.array_equal(delta[f"{DELTA}{i}/idx"], changed[i])
    k = 4
    expected = len(layers) * (
        4 * k + 4 * k * hidden + 4 * k + 4 * hidden * k + 4 * hidden
    )  # idx, W1 rows, b1, W2 cols, b2
    assert sum(a.nbytes for a in delta.values()) == expected == metrics["neuron_download_bytes"]
    assert fed.down[0] == fed.sent[0].nbytes and fed.sent[2].meta["proxy"] == "full"
    assert metrics["proxy_download_bytes"] == sum(
        a.nbytes for k, a in fed.sent[2].arrays.items() if k.startswith(PROXY)
    )
    # after the delta, client 0 holds exactly the server's proxy
    store = vars(fed.clients)["_proxy_store"]
    held = store["versions"][int(fed.states[0]["proxy_version"])]
    assert int(fed.states[0]["proxy_version"]) == 1
    for name, tensor in fed.strategy.builder.clean_tensors.items():
        assert np.array_equal(held[name], tensor.detach().numpy()), name


def test_a_client_that_lost_its_proxy_is_dropped_then_sent_it_whole(tmp_path):
    fed = Federation(tmp_path)
    fed.round(1, [0])
    fed.clients = RunContext(resolve_run(fed.config))  # a new process: empty store, the persistent state kept
    with pytest.raises(RuntimeError, match="holds proxy version"):
        fed.clients.client(0, dict(fed.states[0])).fit(fed.strategy.configure_fit(2, [0])[0])
    fed.strategy.aggregate_fit(2, {})  # the engine drops the failed client
    assert fed.strategy.configure_fit(3, [0])[0].meta["proxy"] == "full"


def test_run_metrics_and_proxy_cache(tmp_path, capsys):
    config = load_config(
        None,
        [
            *BASE,
            "method=fedpft",
            f"output_dir={tmp_path}",
            "options.align_interval=1",
            "federation.clients_per_round=2",
        ],
    )
    summary = run_experiment(config)
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert all("proxy_accuracy" in x and x["client_peak_mem_mb"] > 0 for x in lines)
    assert [x.get("apoz_upload_bytes", 0) > 0 for x in lines] == [True, True, False]  # not in the last round
    assert lines[0]["proxy_download_bytes"] > 0 and lines[0]["bytes_down"] > lines[0]["proxy_download_bytes"]
    assert "layer-level distillation (eq. 13): step 10/10" in capsys.readouterr().err
    cache = Path(summary["run_dir"]) / "fedpft-proxy.npz"
    assert cache.is_file()
    again = RunContext(resolve_run(config)).strategy()
    again.initialize()  # a rerun loads the cached proxy instead of distilling
    assert again.builder.record["cache"] == str(cache) and "layer-level" not in capsys.readouterr().err
    fresh = RunContext(resolve_run(config)).strategy()
    fresh.builder._proxy, _ = fresh.builder.construct()  # distilling again gives the very same proxy (seeded)
    for name, array in fresh.builder.state()["ffn"].items():
        assert np.array_equal(again.builder.state()["ffn"][name], array), name


def test_fedpft_refuses_models_without_a_known_ffn(tmp_path):
    config = load_config(
        None,
        [
            "method=fedpft",
            "task.kind=image-classification",
            "model.name=small-cnn",
            "data.name=digits",
            "data.max_train_samples=64",
            "data.max_test_samples=16",
            f"output_dir={tmp_path}",
        ],
    )
    with pytest.raises(ConfigError, match=r"method 'fedpft' does not support model 'small-cnn' .*needs: transformer"):
        RunContext(resolve_run(config)).strategy().initialize()


def test_fedot_plugs_the_adapter_into_the_full_models_layers(tmp_path):
    """Proxy = the top layer alone (layer 1 at position 0): the LoRA trained there lands on the full
    model's layer 1, as the merged weights predict; the rank keeps FedPETuning's budget."""
    fed = Federation(tmp_path, "fedot", *TOP_LAYER, "options.emulator_layers=1", "options.distill_steps=5")
    s = fed.strategy
    assert s.builder.keep == [0, 1] and s.rank == 16 and s.alpha == fed.config.model.lora_alpha * 2
    fed = Federation(tmp_path / "b", "fedot", *TOP_LAYER, "options.emulator_layers=0")
    s = fed.strategy
    assert s.builder.keep == [1] and s.rank == 16
    fed.round(1, [0])
    proxy_names = [k for k in s.global_arrays if "lora_A" in k]
    assert proxy_names and all(".layer.0." in k for k in proxy_names)
    full = s.to_full(s.global_arrays)
    assert all(".layer.1." in k for k in full if "lora_A" in k)
    trainable = sum(v.size for k, v in s.global_arrays.items() if "lora_" in k)
    petuning = Federation(tmp_path / "c", "fedpetuning").strategy
    assert trainable == sum(v.size for k, v in petuning.global_arrays.items() if "lora_" in k)  # same budget
    task, batch = fed.server.task, batch_of(fed.server.task)
    with torch.no_grad():
        ws = s.full_ws
        ws.load(full, s.rank, s.alpha)
        ws.model.eval()
        plugged = ws.model(**batch).logits
        merged = task.build_model(fed.config.seed).eval()
        params = dict(merged.named_parameters())
        for name, a in full.items():
            if ".lora_A." in name:
                params[name.split(".lora_A.")[0] + ".weight"] += (
                    s.alpha / s.rank * torch.from_numpy(full[name.replace("lora_A", "lora_B")] @ a)
                )
            elif "lora_" not in name:
                params[name].copy_(torch.from_numpy(a))
        assert torch.allclose(plugged, merged(**batch).logits, atol=1e-5)
    assert s.evaluate(1)["accuracy"] == s.evaluate_full()["accuracy"]


def test_proxy_clients_train_in_less_memory_than_fedpetuning(tmp_path):
    peaks = {}
    for method, extra in [
        ("fedpetuning", []),
        ("fedpft", ["options.distill_before=false"]),
        ("fedot", ["options.adapter_bottom=1", "options.adapter_top=0", "options.emulator_layers=0"]),
    ]:
        fed = Federation(tmp_path / method, method, *extra)
        replies, metrics = fed.round(1, [0])
        peaks[method] = metrics["client_peak_mem_mb"]
    assert peaks["fedpft"] < peaks["fedpetuning"] and peaks["fedot"] < peaks["fedpetuning"]


# -- review additions (paste into tests/test_fedpft_methods.py) ---------------------------------------------


def test_apoz_is_pooled_over_the_round_clients_positions(tmp_path, monkeypatch):
    """Eq. (14) averages over the data: the server divides the summed zero counts by the summed
    positions, so a client with more tokens weighs more (not the mean of per-client APoZ)."""
    from fedtune.protocol.messages import Message

    fed = Federation(tmp_path, "fedpft", "options.align_interval=1", "options.distill_before=false")
    s = fed.strategy
    seen = []

    def capture(apoz, fraction, rng):
        seen.append(apoz.copy())
        return np.arange(1)

    monkeypatch.setattr(fedpft_module, "select_neurons", capture)
    monkeypatch.setattr(
        s.alignment,
        "align",
        lambda selected, rnd, adapter: {"heldout_output_error_before": 0.0, "heldout_output_error_after": 0.0},
    )
    width = len(s.builder.kept[s.builder.layers[0]])
    replies = {}
    for cid, (zeros, positions) in enumerate([(10, 10), (0, 90)]):  # APoZ of neuron 0: 1.0 and 0.0
        counts = np.zeros(width, np.int32)
        counts[0], counts[1] = zeros, positions // 2
        arrays = {f"{APOZ}{i}": counts.copy() for i in s.builder.layers}
        arrays[TOKENS] = np.full(len(s.builder.layers), positions, np.int64)
        replies[cid] = Message(arrays, {})
    metrics = s.alignment.after_aggregate(1, replies, s.global_adapter)
    assert len(seen) == len(s.builder.layers) and s.builder.version == 1
    for apoz in seen:
        assert apoz[0] == pytest.approx(10 / 100)  # pooled; the per-client mean would be 0.5
        assert apoz[1] == pytest.approx(50 / 100) and apoz[2] == 0.0
    assert metrics["apoz_upload_bytes"] == 2 * (4 * width + 8) * len(s.builder.layers)


def test_alignment_runs_every_t_rounds_and_not_in_the_last(tmp_path):
    fed = Federation(tmp_path, "fedpft", "options.align_interval=3", "options.distill_before=false", "rounds=10")
    s = fed.strategy
    assert [r for r in range(1, 11) if s.alignment.align_round(r)] == [3, 6, 9]
    sent = s.configure_fit(3, [0])[0]
    assert sent.meta.get("apoz") is True and "apoz" not in s.configure_fit(4, [0])[0].meta


def test_a_client_several_versions_behind_gets_the_union_of_changed_neurons(tmp_path, monkeypatch):
    """Client 0 trains in round 1, misses round 2 (two alignments happen meanwhile), returns in
    round 3: its delta holds every neuron changed in versions 1 and 2, and afterwards it holds
    exactly the server's proxy."""
    fed = Federation(
        tmp_path,
        "fedpft",
        *ALIGN_EVERY_ROUND,
        "rounds=3",
    )
    # round 3, the last, does not align
    calls = []

    def disjoint(apoz, fraction, rng):  # version 1: neurons 0-3, version 2: neurons 12-15
        n = max(1, round(fraction * len(apoz)))
        calls.append(n)
        return np.arange(n) if len(calls) <= 2 else np.arange(len(apoz) - n, len(apoz))

    monkeypatch.setattr(fedpft_module, "select_neurons", disjoint)
    fed.round(1, [0, 1])
    fed.round(2, [1])
    assert fed.strategy.builder.version == 2
    replies, metrics = fed.round(3, [0])
    sent = fed.sent[0]
    assert sent.meta["proxy"] == "delta" and sent.meta["proxy_base"] == 0
    hidden, layers = 32, fed.strategy.builder.layers
    for i in layers:
        assert sent.arrays[f"{DELTA}{i}/idx"].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    k = 8
    per_layer = 4 * k + 4 * k * hidden + 4 * k + 4 * hidden * k + 4 * hidden  # idx, W1 rows, b1, W2 columns, b2
    assert metrics["neuron_download_bytes"] == len(layers) * per_layer
    assert int(fed.states[0]["proxy_version"]) == 2 == fed.strategy.builder.version
    held = vars(fed.clients)["_proxy_store"]["versions"][2]  # what client 0 built from its delta
    for name, tensor in fed.strategy.builder.clean_tensors.items():
        assert np.array_equal(held[name], tensor.detach().numpy()), name


def test_layer_level_distillation_uses_mu_and_trains_only_the_compressed_ffns(tmp_path):
    """Eq. (13) before FL: the held-out loss minus its output term is mu times the normalized
    ||W1 W2 - W1' W2'||^2 of the freshly compressed proxy (averaged over the compressed layers), and
    every tensor outside the compressed FFNs is still the full model's."""
    from fedtune.methods.fedpft.distill import normalized_mse

    fed = Federation(tmp_path, "fedpft", "options.distill_mu=0.5", "options.distill_steps=10")
    s = fed.strategy
    full = s.context.task.build_model(fed.config.seed)
    t, p = find_stack(full), find_stack(s.builder.proxy)
    with torch.no_grad():
        terms = []
        for i in s.builder.layers:
            kept = torch.as_tensor(s.builder.kept[i], dtype=torch.long)
            f = t.ffn(i)
            terms.append(float(normalized_mse(f.down.weight @ f.up.weight, f.down.weight[:, kept] @ f.up.weight[kept])))
    record = s.builder.record["distill"]
    assert record["heldout_loss_before"] - record["heldout_output_error_before"] == pytest.approx(
        0.5 * sum(terms) / len(terms), rel=1e-3
    )
    ffn_names = {n for i in s.builder.layers for n in p.param_names(i).values()}
    state = full.state_dict()
    for name, tensor in s.builder.clean_tensors.items():
        if name not in ffn_names:
            assert torch.equal(tensor, state[name]), name
    for i in s.builder.layers:  # the compressed FFNs did train
        kept = torch.as_tensor(s.builder.kept[i], dtype=torch.long)
        assert not torch.equal(p.ffn(i).up.weight, t.ffn(i).up.weight[kept])


def test_fedot_emulator_distillation_reads_the_middle_block_and_trains_only_the_emulator(tmp_path):
    """With every middle layer kept, the emulator is the full middle block: the distillation's
    held-out output error starts at exactly 0 (the teacher is read at the last middle layer);
    the adapter layers, embeddings and head stay the full model's."""
    fed = Federation(tmp_path, "fedot", *TOP_LAYER, "options.emulator_layers=1", "options.distill_steps=5")
    s = fed.strategy
    assert s.builder.keep == [0, 1] and s.builder.emulator_positions == [0]
    assert s.builder.record["distill"]["heldout_output_error_before"] == 0.0
    state = s.context.task.build_model(fed.config.seed).state_dict()
    emulator = f"{find_stack(s.builder.proxy).path}.0."
    outside = [n for n in s.builder.clean_tensors if not n.startswith(emulator)]
    assert outside and all(torch.equal(s.builder.clean_tensors[n], state[n]) for n in outside)


@pytest.mark.parametrize("method", ["fedpft", "fedot", "fedpetuning"])
def test_global_adapter_is_the_data_weighted_mean_of_the_trained_adapters(tmp_path, monkeypatch, method):
    """FedAvg of the adapter: after a round, global = received + sum_i (n_i / n) (trained_i - received)
    with n_i the clients' data sizes (a sign-flipped or unweighted update fails)."""
    import fedtune.methods.fedpft.fedpetuning as petuning_module
    import fedtune.methods.fedpft.proxy as proxy_module

    module = petuning_module if method == "fedpetuning" else proxy_module
    extra = ["options.distill_before=false"] if method != "fedpetuning" else []
    fed = Federation(tmp_path, method, *extra)
    trained = []
    real = module.train_lora

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        trained.append(out[0])
        return out

    monkeypatch.setattr(module, "train_lora", recording)
    received = {k: v.copy() for k, v in fed.strategy.global_arrays.items()}
    sizes = [len(fed.server.partitions[c]) for c in (0, 1)]
    assert sizes[0] != sizes[1]
    fed.round(1, [0, 1])
    w = np.asarray(sizes, dtype=np.float64) / sum(sizes)
    for name, value in fed.strategy.global_arrays.items():
        expected = received[name] + sum(p * (t[name] - received[name]) for p, t in zip(w, trained))
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7, err_msg=name)
    assert any(not np.array_equal(fed.strategy.global_arrays[k], received[k]) for k in received)


def test_fedpft_accuracy_is_the_full_model_with_the_adapter(tmp_path):
    """``accuracy`` / ``loss`` are the full model's with the global adapter plugged in (the paper's
    point); the proxy's are reported beside them."""
    fed = Federation(tmp_path, "fedpft", "options.distill_before=false")
    fed.round(1, [0])
    s = fed.strategy
    metrics = s.evaluate(1)
    ws = fed.server.workspace
    ws.load(s.global_arrays, s.rank)
    full = fed.server.task.evaluate(ws.model, fed.config.train.eval_batch_size)
    assert metrics["loss"] == full["loss"] and metrics["accuracy"] == full["accuracy"]
    assert metrics["proxy_loss"] != metrics["loss"]


def test_fedpft_compresses_the_intermediate_layers_by_default():
    from fedtune.methods.fedpft.fedpft import compressed_layers

    assert compressed_layers(12, None) == list(range(1, 11))  # paper Sec. 4.1.3: the intermediate 10 of 12
    assert compressed_layers(6, None) == [1, 2, 3, 4] and compressed_layers(2, None) == [0, 1]
    assert compressed_layers(4, [0]) == [1, 2, 3]


def test_neuron_level_alignment_trains_b2_and_nothing_outside_the_compressed_ffns(tmp_path):
    """The neuron-level step trains the selected neurons' W1 rows / b1 / W2 columns and b2 (the
    published split layer's bias); attention, norms, embeddings and the head stay bit-identical."""
    fed = Federation(
        tmp_path, "fedpft", "options.align_interval=1", "options.distill_before=false", "options.align_steps=5"
    )
    s = fed.strategy
    before = {k: t.detach().clone() for k, t in s.builder.clean_tensors.items()}
    stack = find_stack(s.builder.proxy)
    ffn_names = {n for i in s.builder.layers for n in stack.param_names(i).values()}
    fed.round(1, [0, 1])
    assert s.builder.version == 1
    for i in s.builder.layers:
        b2 = stack.param_names(i)["down.bias"]
        assert not torch.equal(s.builder.clean_tensors[b2], before[b2]), b2
    for name, tensor in s.builder.clean_tensors.items():
        if name not in ffn_names:
            assert torch.equal(tensor, before[name]), name


def test_neuron_level_alignment_compares_full_and_proxy_with_the_same_adapter(tmp_path):
    """keep_ratio 1.0: the proxy is the full model, so with the current global adapter on both
    (teacher and student) the alignment's held-out error starts at exactly 0."""
    fed = Federation(
        tmp_path,
        "fedpft",
        "options.keep_ratio=1.0",
        "options.distill_before=false",
        "options.align_interval=1",
        "options.align_steps=2",
    )
    _, metrics = fed.round(1, [0, 1])
    assert any(np.abs(v).max() > 0 for k, v in fed.strategy.global_arrays.items() if "lora_B" in k)
    assert fed.strategy.builder.version == 1 and metrics["align_heldout_error_before"] == 0.0


def test_client_apoz_counts_its_data_with_the_received_adapter_before_training(tmp_path):
    """Eq. (14) on the client: every real token of (at most ``apoz_max_examples``) examples of its
    own data, on the proxy it holds with the adapter it received, before local training."""
    import math

    from fedtune.methods.fedpft.distill import count_zero_activations
    from fedtune.models.training import seed_for

    fed = Federation(
        tmp_path,
        "fedpft",
        "options.align_interval=1",
        "options.distill_before=false",
        "options.apoz_max_examples=16",
        "train.local_steps=4",
    )
    s, task, cfg = fed.strategy, fed.server.task, fed.config.train
    # round 1 first (its client gets adapter B = 0), so that round 2's received adapter is a trained one
    fed.round(1, [1])
    received = {k: v.copy() for k, v in s.global_arrays.items()}
    ws = s.builder.workspace
    ws.load(received, s.rank, s.alpha)
    stack, pool = find_stack(s.builder.proxy), fed.server.partitions[0]
    rng = np.random.default_rng(seed_for(fed.config.seed, 2, 0, 0xA907))
    batches = task.train_batches(pool, cfg.batch_size, math.ceil(min(len(pool), 16) / cfg.batch_size), rng)
    zeros, tokens = count_zero_activations(
        ws.model, [stack.ffn(i) for i in s.builder.layers], stack.layers[max(s.builder.layers)], batches, task.loss, 0.0
    )
    replies, _ = fed.round(2, [0])
    assert len(pool) > 16 > cfg.batch_size and replies[0].arrays[TOKENS].tolist() == tokens
    for i, z in zip(s.builder.layers, zeros):
        assert np.array_equal(replies[0].arrays[f"{APOZ}{i}"], z.numpy().astype(np.int32)), i
