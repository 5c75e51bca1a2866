"""BoMM and its baselines driven through the real Strategy / Client code on the paired task: what
crosses between parties and cloud (never a raw sample; per method, the arrays Section 5.1 implies),
how the parties use the scenario's masks, that unlabeled rows' labels are never used, the scheduler
inside a party's training, alignment in a round, and the same run on Flower."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import load_config
from fedtune.engines.embedded import LocalTransport
from fedtune.engines.rounds import drive_rounds
from fedtune.methods.bomm.backbone import FEATURE_DIM
from fedtune.methods.bomm.party import COMPLETE
from fedtune.methods.bomm.pool import CloudRound, Pool, union_samples
from fedtune.protocol.messages import Message
from fedtune.protocol.validation import check_arrays
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.paired_multimodal import PairedMultimodal
from tests.test_flower import task_identity  # noqa: F401 - fixture

PAIRED = [
    "task.kind=paired-multimodal",
    *PairedMultimodal.test_overrides,
    "federation.num_clients=2",
    "rounds=2",
    "train.local_steps=3",
    "train.batch_size=8",
    "train.eval_batch_size=64",
    "options.cloud_epochs=1",
    "options.generator_epochs=1",
]
UPLOAD = {"rows", "sample_ids", "masks", "labels", "features"}


@dataclass(frozen=True)
class Does:
    """What a method does (Section 5.1), independently of its code: the rows its cloud holds (None:
    no cloud), who completes missing modalities (none, each party alone, the cloud), with the
    preference-driven loss, with alignment, with the parties' scheduler."""

    cloud_rows: str | None = None
    completion: str = "none"
    preference: bool = False
    alignment: bool = False
    scheduler: bool = False


DOES = {
    "bomm-local": Does(),
    "bomm-mm-local": Does(completion="local"),
    "bomm-vanilla": Does("aligned"),
    "bomm-mm-ac": Does("aligned", "cloud"),
    "bomm-mm-uc": Does("all", "cloud"),
    "bomm": Does("all", "cloud", preference=True, alignment=True, scheduler=True),
}


@pytest.fixture
def config(tmp_path):
    def make(method: str = "bomm", *extra: str):
        return load_config(None, [*PAIRED, f"method={method}", f"output_dir={tmp_path / 'runs'}", *extra])

    return make


class Recorder(LocalTransport):
    """The embedded engine's transport, keeping every message and reply that crossed, encoded."""

    def __init__(self, config) -> None:
        super().__init__(RunContext(resolve_run(config)).client, config.seed)
        self.client_context = self.make_client(0, {}).context
        self.log: list[tuple[str, int, str, Message]] = []  # (kind, client, "down" / "up", message)

    def __call__(self, kind, rnd, messages, attempt=0):
        out = super().__call__(kind, rnd, messages, attempt)
        for cid, message in messages.items():
            self.log.append((kind, cid, "down", Message.decode(message.encode())))
            if out[cid].reply is not None:
                self.log.append((kind, cid, "up", out[cid].reply))
        return out


def run(config, transport=None):
    """(strategy, transport, round records) of ``config`` on the embedded engine's transport."""
    server = RunContext(resolve_run(config))
    strategy = server.strategy()
    strategy.initialize()
    transport = transport or Recorder(config)
    fed = config.federation
    history = drive_rounds(strategy, transport, fed.num_clients, fed.sample_size(), config.rounds, config.seed)
    return strategy, transport, history


def raw_samples(context, cid: int) -> list[bytes]:
    """The bytes of party ``cid``'s raw samples as they exist on the party: the model-input images
    and log-mels of its present modalities, and the first 200 samples of each recording."""
    task = context.task
    train, tensors = task.train, task.tensors[0]
    rows = context.partitions[cid]
    out = []
    for r in rows:
        if train.masks[r, 0]:
            out.append(tensors["image"][train.image_index[r]].numpy().astype(np.float32).tobytes())
        if train.masks[r, 1]:
            out.append(tensors["audio"][train.audio_index[r]].numpy().astype(np.float32).tobytes())
            out.append(np.asarray(train.audio.waves[train.audio_index[r]][:200], np.float32).tobytes())
    return out


@pytest.mark.parametrize("method", list(DOES))
def test_no_raw_sample_leaves_a_party_and_only_representations_cross(config, method):
    strategy, transport, history = run(config(method))
    assert all(not r.dropped for r in history)
    blobs = {cid: b"".join(m.encode() for _, c, _, m in transport.log if c == cid) for cid in (0, 1)}
    for cid in (0, 1):
        raws = raw_samples(transport.client_context, cid)
        assert raws and not any(raw in blobs[cid] for raw in raws)
    mode = DOES[method]
    names = {(kind, way): set() for kind in ("train", COMPLETE, "evaluate") for way in ("down", "up")}
    for kind, _, way, m in transport.log:
        names[kind, way] |= set(m.arrays)
    want_up = (UPLOAD | ({"prototypes", "proto_counts"} if mode.alignment else set())) if mode.cloud_rows else set()
    assert names["train", "up"] == want_up and names["train", "down"] == set()
    want_down = ({"gen_rows", "gen_modality", "gen"} if mode.completion == "cloud" else set()) | (
        {"label_rows", "label_values"} if mode.alignment else set()
    )
    assert names[COMPLETE, "down"] == want_down and names[COMPLETE, "up"] == set()
    assert names["evaluate", "up"] == set()
    assert names["evaluate", "down"] == ({"test_gen"} if mode.completion == "cloud" else set())
    # the representations cross once (round 1); round 2's fit replies carry none
    uploads = [m for kind, _, way, m in transport.log if kind == "train" and way == "up" and m.arrays]
    assert len(uploads) == (2 if mode.cloud_rows else 0)


def test_each_method_is_assembled_from_the_parts_of_what_it_does():
    """The registration assembles each method's cloud and parties from parts, chosen once (no
    dispatch on the method's name): they match what the method does, and the cloud and its parties
    share the rows in scope and the aligner (what the parties send is what the cloud checks)."""
    from fedtune.methods import get_method
    from fedtune.methods.bomm.aligner import PrototypeAlignment
    from fedtune.methods.bomm.cloud import BommCloud, BommServer
    from fedtune.methods.bomm.completer import PreferenceCompletion, RegressionCompletion
    from fedtune.methods.bomm.party import BommParty, CloudParty
    from fedtune.methods.bomm.party_parts import CloudFill, LocalFill, Scheduling

    for name, does in DOES.items():
        server, party = get_method(name).strategy, get_method(name).client
        assert issubclass(party, BommParty), name
        assert isinstance(party.fill, LocalFill) == (does.completion == "local"), name
        assert isinstance(party.fill, CloudFill) == (does.completion != "none"), name
        assert party.fill.adapters == (does.completion != "none"), name
        assert isinstance(party.scheduling, Scheduling) == does.scheduler, name
        if not does.cloud_rows:
            assert server is BommServer and not issubclass(party, CloudParty), name
            continue
        assert issubclass(server, BommCloud) and issubclass(party, CloudParty), name
        assert server.rows == party.scope == does.cloud_rows, name
        assert party.aligner is server.aligner, name
        assert isinstance(server.aligner, PrototypeAlignment) == does.alignment, name
        assert isinstance(server.completer, RegressionCompletion) == (does.completion == "cloud"), name
        assert isinstance(server.completer, PreferenceCompletion) == does.preference, name


def test_a_party_is_assembled_only_from_parts_it_has():
    from fedtune.methods.bomm.party import BommParty, CloudParty
    from fedtune.methods.bomm.party_parts import LocalFill

    with pytest.raises(TypeError, match="BommParty.assemble: no part named 'scope'"):
        BommParty.assemble(scope="all")
    assembled = CloudParty.assemble(scope="all", fill=LocalFill())
    assert (
        assembled.scope == "all"
        and isinstance(assembled.fill, LocalFill)
        and assembled.__name__ == ("CloudParty[all, local fill]")
    )


def test_parties_send_what_their_mode_scopes_and_zeros_for_absent_modalities(config):
    for method in ("bomm-vanilla", "bomm-mm-uc"):
        strategy, transport, _ = run(config(method, "rounds=1"))
        ctx = transport.client_context
        train = ctx.task.train
        for cid, upload in strategy.uploads.items():
            rows = ctx.partitions[cid][upload["rows"]]
            assert train.aligned[rows].all() if method == "bomm-vanilla" else len(rows) == len(ctx.partitions[cid])
            np.testing.assert_array_equal(upload["masks"], train.masks[rows])
            np.testing.assert_array_equal(upload["sample_ids"], train.sample_ids[rows])
            assert (upload["features"][~upload["masks"]] == 0).all()
            assert (np.abs(upload["features"][upload["masks"]]).sum(-1) > 0).all()
            np.testing.assert_array_equal(upload["labels"] >= 0, train.labeled[rows])
            np.testing.assert_array_equal(
                upload["labels"][train.labeled[rows]], train.labels[rows][train.labeled[rows]]
            )


def test_a_party_never_reads_an_absent_modality(config):
    """Poison every recording whose row lacks audio (scenario 1) with NaN: nothing non-finite
    crosses (a reply with NaN would be dropped) and the run trains."""
    cfg = config("bomm")
    transport = Recorder(cfg)
    ctx = transport.client_context
    train = ctx.task.train
    absent = ~train.masks[:, 1]
    assert absent.any()
    ctx.task.tensors[0]["audio"][torch.from_numpy(train.audio_index[absent])] = float("nan")
    _, _, history = run(cfg, transport)
    assert all(not r.dropped for r in history)
    for _, _, _, m in transport.log:
        assert all(np.isfinite(a).all() for a in m.arrays.values() if a.dtype.kind == "f")
    assert np.isfinite(history[-1].metrics["accuracy"])


@pytest.mark.parametrize(("method", "scenario"), [("bomm", 1), ("bomm", 2), ("bomm", 3), ("bomm-mm-ac", 1)])
def test_completions_are_exactly_the_rows_missing_the_scenarios_modality(config, method, scenario):
    cfg = config(method, f"task.scenario={scenario}", "task.delta=0.6", "rounds=1")
    _, transport, _ = run(cfg)
    ctx = transport.client_context
    train = ctx.task.train
    missing = {1: 1, 2: 1, 3: 0}[scenario]
    sent = {cid: m for kind, cid, way, m in transport.log if kind == COMPLETE and way == "down"}
    for cid, m in sent.items():
        rows = ctx.partitions[cid]
        want = ~train.masks[rows, missing] & train.masks[rows, 1 - missing]
        if method == "bomm-mm-ac":
            want &= train.aligned[rows]
        if scenario == 2 and cid == 0:
            assert not want.any()  # party 0 is complete in scenario 2
        np.testing.assert_array_equal(np.sort(m.arrays["gen_rows"]), np.flatnonzero(want))
        assert (m.arrays["gen_modality"] == missing).all()
        assert m.arrays["gen"].shape == (int(want.sum()), FEATURE_DIM)


def states_after_one_round(cfg, relabel_unlabeled: bool):
    transport = Recorder(cfg)
    server = RunContext(resolve_run(cfg))
    if relabel_unlabeled:  # every unlabeled row's label changed, on the parties' side and the cloud's
        for ctx in (transport.client_context, server):
            train = ctx.task.train
            train.labels[~train.labeled] = (train.labels[~train.labeled] + 3) % ctx.task.num_labels
    strategy = server.strategy()
    strategy.initialize()
    drive_rounds(strategy, transport, 2, 2, 1, cfg.seed)
    return strategy.state_dict(), transport.states


def test_labels_of_unlabeled_rows_are_never_used(config):
    cfg = config("bomm", "rounds=1", "options.diagnostics=false")
    (s1, c1), (s2, c2) = states_after_one_round(cfg, False), states_after_one_round(cfg, True)
    for key in ("classifier", "generator"):
        for name in s1[key]:
            np.testing.assert_array_equal(s1[key][name], s2[key][name])
    np.testing.assert_array_equal(s1["grown"], s2["grown"])
    for cid in c1:
        for name in c1[cid]:
            np.testing.assert_array_equal(c1[cid][name], c2[cid][name], err_msg=f"{cid} {name}")


def test_the_party_loss_is_the_tasks_loss_when_nothing_is_completed(config):
    ctx = RunContext(resolve_run(config("bomm")))
    party = ctx.client(0, {})
    sm, adapters, _, _ = party.networks()
    sm.eval()
    local = np.arange(12)
    labels = torch.from_numpy(ctx.task.train.labels[party.rows[local]])
    logits, emb, _, real = party.forward(
        sm, adapters, local, np.zeros(12, bool), np.zeros((12, FEATURE_DIM), np.float32), np.zeros(12, np.int64)
    )
    mine = party.sm_loss(sm, logits, emb, real, labels)
    batch = ctx.task.batch(ctx.task.train, ctx.task.tensors[0], party.rows[local])
    torch.testing.assert_close(mine, ctx.task.loss(sm, batch))


def completion_message(party, rnd: int = 1, seed: int = 0) -> Message:
    """Random phi-space completions for every row of ``party`` that lacks audio."""
    rows = np.flatnonzero(~party.masks[:, 1] & party.masks[:, 0])
    gen = np.abs(np.random.default_rng(seed).normal(size=(len(rows), FEATURE_DIM))).astype(np.float32)
    return Message(
        {"gen_rows": rows, "gen_modality": np.ones(len(rows), np.int64), "gen": gen}, {"round": rnd, "phase": COMPLETE}
    )


def trained(cfg, message: Message, monkeypatch=None, record=None) -> dict[str, np.ndarray]:
    ctx = RunContext(resolve_run(cfg))
    party = ctx.client(0, {})
    if record is not None:
        original_select, original_forward = type(party.networks()[2]).select, type(party).forward

        def select(self, xbar, lam, mu):
            out = original_select(self, xbar, lam, mu)
            record["selected"].append(out.numpy().copy())
            return out

        def forward(self, sm, adapters, local, use, gen, gen_mod, ds=None, split=0):
            if sm.training:
                record["used"].append(use.copy())
                record["has"].append(np.isin(local, message.arrays["gen_rows"]))
            return original_forward(self, sm, adapters, local, use, gen, gen_mod, ds, split)

        monkeypatch.setattr(type(party.networks()[2]), "select", select)
        monkeypatch.setattr(type(party), "forward", forward)
    reply = party.phase(COMPLETE, message)
    return {**party.state, "_meta": reply.meta}


def test_the_scheduler_decides_which_completions_each_update_uses(config, monkeypatch):
    cfg = config("bomm", "options.mu=0.5", "train.local_steps=6", "train.batch_size=16")
    ctx = RunContext(resolve_run(cfg))
    message = completion_message(ctx.client(0, {}))
    record = {"selected": [], "used": [], "has": []}
    state = trained(cfg, message, monkeypatch, record)
    steps = [(u, h) for u, h in zip(record["used"], record["has"]) if h.any()]
    assert len(steps) == len(record["selected"]) > 0
    for (used, has), chosen in zip(steps, record["selected"]):
        np.testing.assert_array_equal(used[has], chosen)  # a completion is used iff r_hat > mu
        assert not used[~has].any()
    meta = state["_meta"]
    assert meta["selected"] == sum(int(c.sum()) for c in record["selected"])
    assert meta["completed"] == sum(len(c) for c in record["selected"])


def test_mu_at_the_extremes_is_no_completion_and_every_completion(config):
    base = config("bomm", "train.local_steps=4")
    ctx = RunContext(resolve_run(base))
    message = completion_message(ctx.client(0, {}))
    empty = Message({k: v[:0] for k, v in message.arrays.items()}, message.meta)

    def params(state):
        return {k: v for k, v in state.items() if k.startswith(("sm.", "ad."))}

    none_used = params(trained(config("bomm", "train.local_steps=4", "options.mu=1e9"), message))
    no_completions = params(trained(base, empty))
    all_used = params(trained(config("bomm", "train.local_steps=4", "options.mu=-1e9"), message))
    unscheduled = params(trained(config("bomm", "train.local_steps=4", "options.scheduler=false"), message))
    for key in none_used:
        np.testing.assert_array_equal(none_used[key], no_completions[key], err_msg=key)
        np.testing.assert_array_equal(all_used[key], unscheduled[key], err_msg=key)
    assert any(not np.array_equal(none_used[k], all_used[k]) for k in none_used)


def test_alignment_pairs_mostly_same_class_rows_grows_the_prototypes_and_labels_only_unlabeled_rows(config):
    cfg = config(
        "bomm",
        "task.aligned=0",
        "task.unaligned=80",
        "task.labeled_fraction=0.3",
        "options.n_global=16",
        "options.grow_per_round=4",
        "rounds=2",
    )
    strategy, transport, history = run(cfg)
    seeds = int(np.sum([(u["proto_counts"].sum(1) > 0) for u in strategy.uploads.values()], axis=0).__ge__(2).sum())
    assert seeds >= 8  # the classes labeled at both parties
    # grows by grow_per_round until n_global, then stops
    assert [r.metrics["prototypes"] for r in history] == [seeds + 4, min(16, seeds + 8)]
    assert len(strategy.grown) == min(16, seeds + 8) - seeds
    for r in history:
        assert r.metrics["aligned_pairs"] > 0
        assert r.metrics["diag_pair_accuracy"] > 0.3  # chance: 0.1
        assert r.metrics["cloud_multi_view"] > 0  # the enlarged aligned set reaches the cloud's training
    ctx = transport.client_context
    for kind, cid, way, m in transport.log:
        if kind == COMPLETE and way == "down" and len(m.arrays["label_rows"]):
            assert not ctx.task.train.labeled[ctx.partitions[cid][m.arrays["label_rows"]]].any()
    assert history[-1].metrics["transferred_labels"] > 0


def test_the_clouds_parts_return_what_the_cloud_applies_and_leave_its_state_alone(config):
    """The aligner and the completer read the round (a CloudRound), never the cloud: the aligner
    returns the grown pairs (the cloud's ``grown`` unchanged until the cloud applies them), the
    completer trains the generator it is given and says that it did."""
    cfg = config(
        "bomm",
        "task.aligned=0",
        "task.unaligned=80",
        "task.labeled_fraction=0.3",
        "options.n_global=64",
        "options.grow_per_round=4",
        "rounds=1",
    )
    strategy, _, _ = run(cfg)
    state = copy.deepcopy(strategy.state_dict())  # arrays, not views of the networks
    pool, st = Pool.of(strategy.uploads), strategy.standardizer()
    z = st.apply(pool.x, pool.mask)
    r = CloudRound(2, cfg.seed, strategy.uploads, pool, st, z, strategy.alignment_space(), None)
    aligned = strategy.aligner.align(r, strategy.grown, strategy.options, 2, None)
    assert len(aligned.grown) == len(state["grown"]) + 4
    np.testing.assert_array_equal(aligned.grown[: len(state["grown"])], state["grown"])
    assert aligned.metrics["aligned_pairs"] > 0 and "diag_pair_accuracy" not in aligned.metrics  # no truth given
    generator = copy.deepcopy(strategy.generator)
    samples = union_samples(pool.sid, aligned.pairs)
    metrics, trained = strategy.completer.train(generator, r, samples, aligned.protos, strategy.options)
    assert trained and metrics["generator_items"] > 0
    moved = [
        not torch.equal(a, b) for a, b in zip(generator.state_dict().values(), strategy.generator.state_dict().values())
    ]
    assert any(moved)
    after = strategy.state_dict()
    np.testing.assert_array_equal(after["grown"], state["grown"])
    assert after["generator_trained"] == state["generator_trained"]
    for key, value in state["generator"].items():
        np.testing.assert_array_equal(after["generator"][key], value)


def test_alignment_compares_the_cloud_models_embeddings_once_it_has_trained(config):
    x = np.random.default_rng(0).normal(size=(5, 2, FEATURE_DIM)).astype(np.float32)
    mask = np.array([[True, True], [True, False], [False, True], [True, True], [True, False]])
    for space in ("cloud", "phi"):
        strategy = RunContext(resolve_run(config("bomm", f"options.alignment_space={space}"))).strategy()
        strategy.initialize()
        assert strategy.alignment_space()(x, mask) is x  # before psi_1 has trained: phi
        strategy.classifier_trained = True
        emb = strategy.alignment_space()(x, mask)
        if space == "phi":
            assert emb is x
            continue
        assert emb.shape == (5, 2, strategy.options.cloud_embed)
        with torch.no_grad():
            want = strategy.classifier.encoders[1](torch.from_numpy(x[mask[:, 1], 1])).numpy()
        np.testing.assert_allclose(emb[mask[:, 1], 1], want, rtol=1e-5, atol=1e-6)
        assert (emb[~mask[:, 1], 1] == 0).all()


def test_only_bomm_gives_its_generator_prototype_targets_where_no_real_one_exists(config):
    for method in ("bomm", "bomm-mm-uc"):
        _, _, history = run(config(method, "rounds=1"))
        m = history[0].metrics
        if method == "bomm":  # rows lacking audio with no aligned partner holding it: g^p from o_i
            assert m["generator_items"] > m["generator_real_items"] > 0 and "generator_prefer" in m
        else:  # regression on real targets only
            assert m["generator_items"] == m["generator_real_items"] > 0 and "generator_prefer" not in m


def test_a_malformed_upload_is_rejected_by_the_reply_spec(config):
    ctx = RunContext(resolve_run(config("bomm")))
    strategy = ctx.strategy()
    strategy.initialize()
    sent = strategy.configure_fit(1, [0])[0]
    upload = ctx.client(0, {}).fit(sent)
    spec = strategy.reply_spec(1, 0, sent)
    assert check_arrays(upload.arrays, spec) is None
    short = dict(upload.arrays, features=upload.arrays["features"][:-1])
    assert "features" in check_arrays(short, spec)
    leaked = dict(upload.arrays, pixels=np.zeros((3, 8, 8), np.float32))
    assert "unexpected" in check_arrays(leaked, spec)


def test_pool_concatenates_uploads_in_party_order():
    def up(n, k):
        return {
            "rows": np.arange(n),
            "sample_ids": np.arange(n) + 100 * k,
            "masks": np.ones((n, 2), bool),
            "labels": np.full(n, -1),
            "features": np.zeros((n, 2, FEATURE_DIM), np.float32),
        }

    pool = Pool.of({1: up(2, 1), 0: up(3, 0)})
    np.testing.assert_array_equal(pool.party, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(pool.sid, [0, 1, 2, 100, 101])


def test_bomm_runs_the_same_on_flower_as_embedded(config, tmp_path, task_identity):  # noqa: F811 - fixture
    from fedtune.checkpoint import load_state
    from fedtune.engines.flower.clientapp import make_client_app
    from fedtune.engines.flower.serverapp import serve
    from fedtune.run import run_experiment
    from tests.test_contract import flatten
    from tests.test_flower import LoopbackGrid
    from tests.test_flower_contract import assert_same_run

    def result(summary):
        run_dir = Path(summary["run_dir"])
        state = load_state(run_dir / "checkpoint.npz")
        state.pop("_engine")
        return flatten(state), [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    embedded = result(run_experiment(config("bomm", f"output_dir={tmp_path / 'e'}")))
    cfg = config("bomm", f"output_dir={tmp_path / 'f'}")
    grid = LoopbackGrid(make_client_app(cfg), cfg.federation.num_clients)
    assert_same_run(result(serve(grid, cfg, timeout=300)), embedded)


def test_a_resumed_run_ends_as_an_uninterrupted_one_though_it_loads_phi_later(config, monkeypatch, method="bomm"):
    """A resumed process loads the frozen backbone phi in a later round than an uninterrupted one
    (here in party 0's training of round 3): loading it must not draw from the caller's torch RNG
    (torchvision's random init before the pretrained weights), or that party's round 3 differs.
    Each run starts with no backbone loaded, as a fresh process does."""
    from fedtune.methods.bomm import backbone
    from fedtune.run import run_experiment

    def lines(summary):
        rows = Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if "wall" not in k and "compute" not in k} for x in rows]

    fresh = {}
    monkeypatch.setattr(backbone, "_MODELS", fresh)
    whole = lines(run_experiment(config(method, "rounds=3", "name=whole")))
    fresh.clear()
    run_experiment(config(method, "rounds=2", "name=cut"))
    fresh.clear()
    resumed = lines(run_experiment(config(method, "rounds=3", "name=cut"), resume=True))
    assert resumed == whole


def test_bomm_party_prototypes_are_standardized_before_they_seed_the_prototype_set(tmp_path, monkeypatch):
    """Mistake: the parties' class prototypes seeding the global prototype set raw, while every row
    they are compared with is standardized (per modality and feature over all representations
    received, std floored at 1e-3)."""
    from fedtune.methods.bomm import alignment

    seen = []
    real = alignment.PrototypeSet.seed.__func__

    def capture(cls, prototypes, num_parties):
        seen.append({k: (p.copy(), c.copy()) for k, (p, c) in prototypes.items()})
        return real(cls, prototypes, num_parties)

    monkeypatch.setattr(alignment.PrototypeSet, "seed", classmethod(capture))
    config = load_config(None, [*PAIRED, "method=bomm", "rounds=1", f"output_dir={tmp_path}"])
    _, transport, _ = run(config)
    uploads = {cid: m.arrays for kind, cid, way, m in transport.log if way == "up" and "prototypes" in m.arrays}
    assert seen and uploads
    x = np.concatenate([u["features"] for u in uploads.values()]).astype(np.float64)
    mask = np.concatenate([u["masks"] for u in uploads.values()])
    for k, (protos, _) in seen[0].items():
        raw, counts = uploads[k]["prototypes"], uploads[k]["proto_counts"]
        expected = np.zeros_like(raw)
        for mod in range(raw.shape[1]):
            rows = x[mask[:, mod], mod]
            mean, std = rows.mean(0), np.maximum(rows.std(0), 1e-3)
            expected[:, mod] = ((raw[:, mod] - mean) / std) * (counts[:, mod] > 0)[:, None]
        np.testing.assert_allclose(protos, expected, rtol=1e-4, atol=1e-4)
        assert not np.allclose(protos, raw * (counts > 0)[..., None], atol=1e-2)  # the raw ones differ
