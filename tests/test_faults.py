"""Runs survive failing, slow and malformed clients, and restarts.

- Clients that fail or miss the deadline are dropped, every drop recorded, every round completed.
- A fuzzer sends over 1,000 malformed replies: each is rejected with a reason, the server never
  crashes, and the aggregate equals the one over the valid replies alone.
- A run killed with SIGKILL and resumed ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.config import flat_keys
from fedtune.engines.rounds import Delivery, RoundFailed, RoundPolicy, drive_rounds, first_nonfinite
from fedtune.methods import get_method, list_methods
from fedtune.protocol.compression import topk_encode
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY, tiny


def metrics(summary: dict) -> list[dict]:
    return [json.loads(line) for line in Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()]


def test_thirty_percent_failing_or_slow_clients_every_round_are_dropped_and_recorded(tiny_config):
    # 10 clients, all sampled: 2 always fail, 1 always misses the 1.5 s deadline (30 %); the others
    # take well under a second (tiny model, one step), their first call building the model included
    profiles = ["{}"] * 10
    profiles[2] = profiles[7] = "{failure_prob=1.0}"
    profiles[5] = "{delay_s=2.0}"
    summary = run_experiment(
        tiny_config(
            "federation.num_clients=10",
            f"federation.profiles=[{', '.join(profiles)}]",
            "federation.round_timeout_s=1.5",
            "rounds=3",
            "train.local_steps=1",
        )
    )
    lines = metrics(summary)
    assert [line["round"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert set(line["dropped"]) == {"2", "5", "7"}
        assert "injected failure" in line["dropped"]["2"] and "injected failure" in line["dropped"]["7"]
        assert "missed the 1.5 s deadline" in line["dropped"]["5"]
        assert line["accuracy"] is not None
    assert summary["dropped"] == 9


def test_random_failures_follow_the_seeded_draw_and_too_few_replies_stop_the_run(tiny_config):
    summary = run_experiment(
        tiny_config(
            "federation.num_clients=6",
            "federation.profiles=[{failure_prob=0.3}]",
            "rounds=4",
            "train.local_steps=1",
        )
    )
    for line in metrics(summary):
        rnd = line["round"]
        failed = {str(c) for c in range(6) if np.random.default_rng([0, rnd, c, 0, 0xFA11]).random() < 0.3}
        assert set(line.get("dropped", {})) == failed
    with pytest.raises(
        RoundFailed, match=r"round 1: fewer than federation.min_replies = 2 valid replies after 2 attempts"
    ):
        run_experiment(
            tiny_config(
                "federation.num_clients=4",
                'name="too-few-replies"',
                "federation.profiles=[{failure_prob=1.0}, {}, {failure_prob=1.0}, {failure_prob=1.0}]",
                "federation.min_replies=2",
                "federation.max_retries=1",
            )
        )


# -- fuzzing the server with malformed replies ---------------------------------------------------
DELETE = object()
#: Damage to a reply's metadata: the FedAvg weight (num_examples) and the losses a client reports.
META_DAMAGE = {
    "examples-nan": ("num_examples", float("nan")),
    "examples-inf": ("num_examples", float("inf")),
    "examples-negative": ("num_examples", -7),
    "examples-zero": ("num_examples", 0),
    "examples-huge": ("num_examples", 10**9),
    "examples-string": ("num_examples", "12"),
    "examples-float": ("num_examples", 12.5),
    "examples-missing": ("num_examples", DELETE),
    "loss-nan": ("train_loss", float("nan")),
    "loss-inf": ("train_loss", float("-inf")),
    "loss-string": ("train_loss", "low"),
    "steps-bool": ("steps", True),
    "other-nan": ("surprise", [1.0, float("nan")]),
}


def mutate(reply: Message, rng: np.random.Generator, cid: int, rnd: int, cap: int) -> tuple[Delivery, str]:
    """A malformed delivery derived from a valid ``reply``, and the kind of damage."""
    arrays = {k: v.copy() for k, v in reply.arrays.items()}
    names = list(arrays)
    name = names[rng.integers(len(names))]
    kind = [
        "nan",
        "inf",
        "missing",
        "extra",
        "renamed",
        "shape",
        "dtype",
        "oversize",
        "client",
        "round",
        "topk",
        "error",
        "empty",
        *META_DAMAGE,
    ][rng.integers(13 + len(META_DAMAGE))]
    sender, claimed_round, error = cid, rnd, None
    meta = dict(reply.meta)
    if kind in ("nan", "inf"):
        flat = arrays[name].reshape(-1)
        flat[rng.integers(flat.size)] = np.nan if kind == "nan" else -np.inf
    elif kind == "missing":
        del arrays[name]
    elif kind == "extra":
        arrays["extra." + name] = arrays[name]
    elif kind == "renamed":
        arrays[name + ".x"] = arrays.pop(name)
    elif kind == "shape":
        a = arrays[name]
        arrays[name] = a.reshape(-1) if a.ndim > 1 else a[: max(0, a.size - 1)]
    elif kind == "dtype":
        arrays[name] = arrays[name].astype([np.float64, np.float16, np.int32][rng.integers(3)])
    elif kind == "oversize":
        arrays["padding"] = np.zeros(cap // 4 + 1, dtype=np.float32)
    elif kind == "client":
        sender = int(rng.choice([cid + 1, -1, 10**6]))
    elif kind == "round":
        claimed_round = int(rng.choice([rnd - 1, rnd + 1, 0]))
    elif kind == "topk":
        triple = topk_encode({name: arrays.pop(name)}, 0.5)
        damage = rng.integers(3)
        if damage == 0:
            triple[name + ".topk_idx"][0] = 10**7  # index out of range
        elif damage == 1:
            triple[name + ".topk_val"][0] = np.nan
        else:
            triple[name + ".topk_shape"] = triple[name + ".topk_shape"][::-1].copy() + 1
        arrays.update(triple)
    elif kind == "error":
        return Delivery(None, 100, error="ConnectionResetError: peer went away"), kind
    elif kind == "empty":
        arrays = {}
    elif kind in META_DAMAGE:
        key, value = META_DAMAGE[kind]
        if value is DELETE:
            del meta[key]
        else:
            meta[key] = value
    message = Message(arrays, meta)
    return Delivery(message, 100, message.nbytes, 0.1, sender, claimed_round, error), kind


@pytest.mark.parametrize("method", ["fedit", "fedavg"])
def test_fuzzed_replies_are_all_rejected_and_the_aggregate_is_the_valid_ones(tiny_config, method):
    config = tiny_config(f"method={method}", "federation.num_clients=22", "train.local_steps=1", "model.lora_rank=2")
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    strategy, reference = server.strategy(), RunContext(resolve_run(config)).strategy()
    strategy.initialize()
    reference.initialize()
    first = strategy.configure_fit(1, [0, 1])
    genuine = {cid: clients.client(cid, {}).fit(first[cid]) for cid in (0, 1)}  # two valid replies, reused
    cap = max(m.nbytes for m in genuine.values()) * 3
    rng = np.random.default_rng(0)
    rejected: dict[str, int] = {}
    base = Message(genuine[0].arrays, {**genuine[0].meta, "num_examples": 1})  # valid for any client's partition

    def transport(kind, rnd, messages, attempt=0):
        out = {}
        for cid in messages:
            if cid in genuine:
                out[cid] = Delivery(genuine[cid], 100, genuine[cid].nbytes, 0.1, cid, rnd)
            else:
                out[cid], damage = mutate(base, rng, cid, rnd, cap)
                rejected[damage] = rejected.get(damage, 0) + 1
        return out

    rounds = 50  # 20 malformed replies a round: 1,000 in all
    history = drive_rounds(
        strategy, transport, 22, 22, rounds, seed=0, eval_every=rounds, policy=RoundPolicy(max_reply_bytes=cap)
    )
    assert sum(rejected.values()) == 1000 and len(rejected) == 13 + len(META_DAMAGE)
    for record in history:
        assert set(record.dropped) == set(range(2, 22)) and all(record.dropped.values())
    assert first_nonfinite(strategy.state_dict()) is None
    metadata_reasons = [r for rec in history for r in rec.dropped.values() if r.startswith("metadata")]
    assert len(metadata_reasons) == sum(n for k, n in rejected.items() if k in META_DAMAGE)  # each for its metadata
    for rnd in range(1, rounds + 1):  # the reference sees the two valid replies alone
        reference.aggregate_fit(rnd, {cid: Message.decode(m.encode()) for cid, m in genuine.items()})
    for key, value in reference.global_arrays.items():
        assert np.array_equal(strategy.global_arrays[key], value), key


@pytest.mark.parametrize("method", sorted(s.name for s in list_methods()))
def test_resume_from_a_checkpoint_equals_running_straight_through(tmp_path, method):
    """Round 1 alone, then resumed to round 3 = rounds 1-3 in one go, for every method (on the
    first task kind it supports, its tiny contract configuration)."""
    kind = get_method(method).supported_tasks()[0]
    straight = run_experiment(tiny(tmp_path / "a", method, kind, "rounds=3"))
    run_experiment(tiny(tmp_path / "b", method, kind, "rounds=1"))
    resumed = run_experiment(tiny(tmp_path / "b", method, kind, "rounds=3"), resume=True)
    a, b = (
        load_state(Path(straight["run_dir"], "checkpoint.npz")),
        load_state(Path(resumed["run_dir"], "checkpoint.npz")),
    )
    assert [m["accuracy"] for m in metrics(straight)] == [m["accuracy"] for m in metrics(resumed)]
    flat_a, flat_b = flat_keys(a, "/"), flat_keys(b, "/")
    assert {k for k in flat_a if not k.startswith("_engine")} == {k for k in flat_b if not k.startswith("_engine")}
    for key in flat_a:
        assert np.array_equal(np.asarray(flat_a[key]), np.asarray(flat_b[key])), key


def test_sigkill_at_a_random_round_then_resume_is_bit_identical(tmp_path):
    """A real process killed with SIGKILL after a random round, resumed from the command line:
    the final adapter is bit-identical to an uninterrupted run's. The uninterrupted run is this
    process's, made while the resumed one runs (a CLI run spends most of its time importing);
    every run has one torch thread."""
    from safetensors.numpy import load_file

    from fedtune.config import load_config

    args = [*TINY, "rounds=6", "train.local_steps=2", "train.threads=1"]
    sets = [a for t in args for a in ("--set", t)]
    cli = [str(Path(sys.executable).parent / "fedtune")]
    env = dict(os.environ)
    kill_after = int(np.random.default_rng().integers(1, 5))  # a random round in 1..4
    run_dir = tmp_path / "b" / "fedit-tweets-s0"
    proc = subprocess.Popen(
        [*cli, "run", *sets, "--set", f"output_dir={tmp_path / 'b'}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        # kill once round ``kill_after``'s line is out and some checkpoint exists: at round 1 the
        # line precedes the first checkpoint, and a kill between them leaves nothing to resume
        path = run_dir / "metrics.jsonl"
        if (run_dir / "checkpoint.npz").exists() and path.exists() and len(path.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists(), "the run finished before it was killed"
    with open(tmp_path / "resume.log", "w+") as log:
        resumed = subprocess.Popen([*cli, "run", "--resume", str(run_dir)], env=env, stdout=log, stderr=log)
        try:
            run_experiment(load_config(None, [*args, f"output_dir={tmp_path / 'a'}"]))  # straight through
        finally:
            resumed.wait(timeout=600)
        log.seek(0)
        assert resumed.returncode == 0, log.read()[-2000:]
    a = load_file(tmp_path / "a" / "fedit-tweets-s0" / "adapter" / "adapter_model.safetensors")
    b = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_sigkill_then_resume_is_bit_identical_on_every_engine(engine, engine_runs):
    """Every engine (tests/engines.py): ``fedtune run`` of a DP run killed with SIGKILL with every
    process it started (a deployment's SuperLink, nodes and ServerApp too, as when the machine
    dies) once round 1 is checkpointed, then ``fedtune run --resume``: the checkpoint (the server's
    state and secret), the adapter and every metrics line equal the uninterrupted embedded run's,
    bit for bit (one torch thread: every engine computes the same bits), and the run folder holds
    the same files. Control: the neighbouring run (client 0 failing) ends elsewhere, so equality is
    not a state that never moved."""
    from safetensors.numpy import load_file

    killed, straight = engine_runs.killed(engine), engine_runs.cli("embedded", "honest")
    other = engine_runs.cli(engine, "failing")
    a, b = load_state(killed.run_dir / "checkpoint.npz"), load_state(straight.run_dir / "checkpoint.npz")
    flat_a, flat_b = flat_keys(a, "/"), flat_keys(b, "/")
    assert {k for k in flat_a if not k.startswith("_engine")} == {k for k in flat_b if not k.startswith("_engine")}
    assert any(k.startswith("_inputs/") for k in flat_a)  # a DP checkpoint: its inputs' fingerprints
    for key in flat_a:
        # not compared: _engine (the embedded engine's client states; Flower's are on the nodes) and
        # _inputs (keyed fingerprints of the config, which here holds the slow client's profile)
        if not key.startswith(("_engine", "_inputs")):
            assert np.array_equal(np.asarray(flat_a[key]), np.asarray(flat_b[key])), key
    adapters = [load_file(r.run_dir / "adapter" / "adapter_model.safetensors") for r in (killed, straight, other)]
    assert adapters[0].keys() == adapters[1].keys()
    assert all(np.array_equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    assert not all(np.array_equal(adapters[0][k], adapters[2][k]) for k in adapters[0])
    lines = [(r.run_dir / "metrics.jsonl").read_text().splitlines() for r in (killed, straight)]
    assert lines[0] == lines[1] and len(lines[0]) == 2
    assert sorted(p.name for p in killed.run_dir.iterdir()) == sorted(p.name for p in straight.run_dir.iterdir())
    assert sorted(p.name for p in killed.run_dir.parent.iterdir()) == [killed.run_dir.name]


# -- aggregation that fails or leaves a non-finite state rejects the round -------------------------
def _sabotaged_run(tiny_config, tmp_path, break_aggregation):
    """A fedit run of 3 rounds whose aggregation ``break_aggregation(strategy, rnd)`` may sabotage;
    returns (the exception, the metrics lines written, the checkpoint's state)."""
    from fedtune.methods.fedit import FedITStrategy
    from fedtune.run import run_experiment

    config = tiny_config("method=fedit", "rounds=3", f"output_dir={tmp_path}", "name=guarded")

    real = FedITStrategy.aggregate_fit

    def sabotaged(self, rnd, replies):
        metrics = real(self, rnd, replies)
        break_aggregation(self, rnd)
        return metrics

    FedITStrategy.aggregate_fit = sabotaged
    try:
        with pytest.raises(RoundFailed) as caught:
            run_experiment(config)
    finally:
        FedITStrategy.aggregate_fit = real
    run_dir = tmp_path / "guarded"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return caught.value, lines, load_state(run_dir / "checkpoint.npz")


def test_a_non_finite_global_state_after_aggregation_stops_the_run_and_is_never_checkpointed(tiny_config, tmp_path):
    def poison(strategy, rnd):
        if rnd == 2:
            name = sorted(strategy.global_arrays)[0]
            strategy.global_arrays[name] = strategy.global_arrays[name] * np.float32("nan")

    exc, lines, state = _sabotaged_run(tiny_config, tmp_path, poison)
    assert str(exc).startswith("round 2: the aggregated global state is not finite (state/global/") and "\n" not in str(
        exc
    )
    assert [line["round"] for line in lines] == [1] and int(state["_round"]) == 1
    assert first_nonfinite({k: v for k, v in state.items() if k != "_engine"}) is None


def test_an_exception_inside_aggregation_stops_the_run_with_one_line(tiny_config, tmp_path):
    def explode(strategy, rnd):
        if rnd == 3:
            raise TypeError("unsupported operand type(s) for +: 'float' and 'str'")

    exc, lines, state = _sabotaged_run(tiny_config, tmp_path, explode)
    assert str(exc) == (
        "round 3: aggregation failed (TypeError: unsupported operand type(s) for +: 'float' and 'str'); "
        "nothing of this round is kept"
    )
    assert [line["round"] for line in lines] == [1, 2] and int(state["_round"]) == 2


def test_first_nonfinite_finds_the_path_of_a_nan_anywhere_in_a_nested_state():
    assert first_nonfinite({"a": np.ones(3), "b": [1.0, {"c": np.float32(2)}]}) is None
    assert first_nonfinite({"a": np.ones(3), "b": [1.0, {"c": np.array([0.0, np.inf])}]}) == "state/b/1/c"
    assert first_nonfinite({"x": float("nan")}) == "state/x"
    assert first_nonfinite({"i": np.arange(3), "s": "text"}) is None


@pytest.mark.parametrize(
    ("method", "kind", "key", "value"),
    [
        ("rabo", "hypergradient", "outer_loss", "low"),
        ("rabo", "train", "train_loss", float("nan")),
        ("rabo", "train", "flops", -1.0),
        ("static", "train", "train_loss", None),
        ("commit", "train", "curves", [1.0]),
        ("commit", "train", "schedule", "fast"),
    ],
)
def test_a_methods_own_reply_metadata_is_validated_before_aggregation_reads_it(method, kind, key, value):
    """The keys a method's aggregation reads are declared: a bad or missing one drops the reply."""
    from types import SimpleNamespace

    from fedtune.config import load_config
    from fedtune.methods import get_method
    from fedtune.methods.base.aggregation import plan_aggregation
    from fedtune.protocol.validation import check_meta

    class Context:  # what reply_meta_spec reads of the run context (and the strategy's aggregation plan)
        config = options = None
        run = SimpleNamespace(aggregation=plan_aggregation(load_config(None, TINY)))

        @staticmethod
        def example_bound(kind, cid):
            return 100

    strategy = get_method(method).strategy(Context())
    spec = strategy.reply_meta_spec(kind, 0)
    meta = {"num_examples": 10, "steps": 1, "train_loss": 0.5, "outer_loss": 0.5, "schedule": {}, "curves": {}}
    assert check_meta(meta if kind == "train" else {k: v for k, v in meta.items() if k != "num_examples"}, spec) is None
    bad = {**meta, key: value} if value is not None else {k: v for k, v in meta.items() if k != key}
    assert check_meta(bad, spec) is not None
