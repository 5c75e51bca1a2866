"""Pins for what an independent mutation review could change unseen: each test here fails on one
plausible mistake that every other test let pass (named in its docstring), and passes on the code.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedtune.config import load_config
from fedtune.engines.embedded import run_rounds
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from fedtune.runtime import RunContext


# -- the round loop ---------------------------------------------------------------------------------
def test_bytes_up_of_a_multi_exchange_round_are_summed_over_its_exchanges(tiny_config):
    """Mistake: ``client_bytes_up`` overwritten, not summed, across the exchanges of a round (RABO's
    two phases): a client's upload is its fit reply plus its phase reply, byte for byte."""
    from tests.test_engine import TwoPhase, TwoPhaseClient, register_toy

    register_toy("toy-two-phase", TwoPhase, TwoPhaseClient)
    ctx = RunContext(tiny_config("method=toy-two-phase"))
    strategy = ctx.strategy()
    strategy.initialize()
    record = run_rounds(strategy, ctx.client, 4, 4, 1, seed=0)[0]
    x = np.zeros(2)  # the round-1 global both exchanges start from is x = 0, then 1.5
    for cid in (0, 1, 2):
        fit_up = Message({"x": x + cid}, {"steps": 1, "num_examples": 1}).nbytes
        phase_up = Message({"y": cid * (x + 1.5)}, {}).nbytes
        assert record.client_bytes_up[cid] == fit_up + phase_up


def test_the_last_round_is_evaluated_when_rounds_is_not_a_multiple_of_eval_every(tiny_config):
    """Mistake: evaluating only every ``eval_every`` rounds, so a run of 5 rounds at eval_every 2
    ends without a final accuracy."""
    summary = run_experiment(tiny_config("rounds=5", "eval_every=2"))
    lines = [json.loads(x) for x in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert [line["round"] for line in lines if line["accuracy"] is not None] == [2, 4, 5]
    assert summary["final_accuracy"] == lines[-1]["accuracy"] is not None


# -- FSLoRA ------------------------------------------------------------------------------------------
def fslora_strategy(*overrides: str):
    from tests.test_fslora import make_config

    strategy = RunContext(make_config(*overrides)).strategy()
    strategy.initialize()
    return strategy


def test_fslora_k_i_is_the_sketch_ratio_times_r_rounded_half_up():
    """Mistake: k_i = floor(sketch_ratio r): at r = 6 and ratio 0.25 that is 1 rank, where the stated
    rounding (half up) gives 2; the index set a client receives has k_i entries."""
    from fedtune.methods.fslora import SHARED_SKETCH

    strategy = fslora_strategy(
        "model.lora_rank=6", "federation.profiles=[{sketch_ratio=0.25}]", "federation.num_clients=1"
    )
    message = strategy.configure_fit(1, [0])[0]
    assert message.arrays[SHARED_SKETCH].shape == (2,)


def test_fslora_sketch_is_redrawn_every_round_from_seed_round_and_client():
    """The sketch a client receives changes from round to round (a new random I each round, Alg. 1),
    and the same (seed, round, client) gives the same I in a fresh strategy."""
    from fedtune.methods.fslora import SHARED_SKETCH, sketch_indices

    ratios = "federation.profiles=[{sketch_ratio=0.5},{sketch_ratio=0.5},{sketch_ratio=0.5}]"
    first, again = fslora_strategy(ratios), fslora_strategy(ratios)
    sets = [tuple(first.configure_fit(rnd, [1])[1].arrays[SHARED_SKETCH]) for rnd in range(1, 7)]
    assert len(set(sets)) > 1
    assert sets == [tuple(again.configure_fit(rnd, [1])[1].arrays[SHARED_SKETCH]) for rnd in range(1, 7)]
    seed, rank = first.config.seed, first.rank
    assert sets == [tuple(sketch_indices(seed, rnd, 1, rank, rank // 2)) for rnd in range(1, 7)]


# -- FedPFT ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("d", "p", "count"), [(13, 0.5, 7), (15, 0.5, 8), (14, 0.5, 7), (10, 0.25, 3), (4, 0.1, 1)])
def test_fedpft_apoz_alignment_count_is_the_published_one(d, p, count):
    """Mistake: the number of re-aligned neurons floored (floor(p d)): the published align_model
    freezes int((1 - p) d) and trains the rest, so p = 0.5 of 13 neurons trains 7 (floor: 6; Python's
    round, half to even: 6)."""
    from fedtune.methods.fedpft.fedpft import select_neurons

    apoz = np.random.default_rng(0).random(d)
    chosen = select_neurons(apoz, p, np.random.default_rng(1))
    assert len(chosen) == count
    assert set(chosen) == set(np.argsort(-apoz)[:count])  # the highest APoZ (no ties here)


# -- BoMM --------------------------------------------------------------------------------------------
def test_bomm_party_prototypes_are_standardized_before_they_seed_the_prototype_set(tmp_path, monkeypatch):
    """Mistake: the parties' class prototypes seeding the global prototype set raw, while every row
    they are compared with is standardized (per modality and feature over all representations
    received, std floored at 1e-3)."""
    from fedtune.methods.bomm import alignment
    from tests.test_bomm_method import PAIRED, run

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
