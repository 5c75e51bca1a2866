"""The embedded engine's clients spread over devices (``placement.client_devices``): one worker
process per device, with the one-process engine's numbers, states, failures and checkpoints.

Runs on the CPU as ``["cpu", "cpu"]`` (two worker processes); ``tests/test_gpu.py`` has the CUDA
case. Direct pool tests use the probe client of ``tests/device_pool_probe.py`` (its workers import
no model). A worker is a spawned interpreter: each pool start costs a few seconds of imports.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError, flat_keys
from fedtune.engines.device_pool import DevicePool, assignment, client_devices
from fedtune.engines.embedded import EmbeddedEngine
from fedtune.engines.rounds import RoundFailed
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from fedtune.runtime import resolve_run
from tests.device_pool_probe import probe_context

TWO_CPUS = 'placement.client_devices=["cpu", "cpu"]'
#: what differs between two runs of the same config: timings
TIMINGS = {"wall_s", "compute_s", "client_compute_s"}


def children() -> set[int]:
    """This process's descendants; multiprocessing's resource tracker (started with the first
    spawned process, alive until this process ends) is started first, so it is not counted as new."""
    resource_tracker.ensure_running()
    return {p.pid for p in psutil.Process().children(recursive=True)}


def outcome(summary: dict) -> tuple[list[dict], dict]:
    """A run's metrics lines without timings, and its last checkpoint (strategy and client states), flat."""
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    state = {k: np.asarray(v) for k, v in flat_keys(load_state(run_dir / "checkpoint.npz"), "/").items()}
    return [{k: v for k, v in line.items() if k not in TIMINGS} for line in lines], state


def assert_same(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> None:
    assert a[0] == b[0]  # every metric, byte count, drop, bit for bit (JSON floats round-trip exactly)
    assert a[1].keys() == b[1].keys()
    for key in a[1]:
        assert np.array_equal(a[1][key], b[1][key]), key


def config(tiny_config, method: str, *extra: str):
    # one torch thread in the server's process and in each worker: the same kernels on both sides
    return tiny_config(f"method={method}", "train.threads=1", "federation.clients_per_round=3", *extra)


# -- (a) the numbers of the one-process engine ------------------------------------------------------
#: FedIT's run has two clients failing half their requests (drawn from the seed, round, client and
#: attempt on the client's side): the same drops either way
FLAKY = "federation.profiles=[{}, {failure_prob=0.5}, {}, {failure_prob=0.5}]"


def test_two_worker_processes_give_the_one_process_numbers_bit_for_bit(tiny_config):
    # (FSLoRA, RABO, FedPFT, CoMMIT, FlexLoRA and BoMM were checked so once too; each pool start
    # imports transformers and PEFT in two fresh interpreters, about 10 s of CPU, so one method here)
    before = children()
    one = outcome(run_experiment(config(tiny_config, "fedit", "name=one", FLAKY)))
    two = outcome(run_experiment(config(tiny_config, "fedit", "name=two", TWO_CPUS, FLAKY)))
    assert_same(one, two)
    assert len(one[0]) == 2
    assert any(line["dropped"] for line in two[0])  # the injected failures, as drops
    assert children() <= before  # every worker stopped with the run


# -- (e) a stateful method resumed from its checkpoint ----------------------------------------------
def test_local_on_two_workers_resumed_from_round_one_equals_a_straight_one_process_run(tiny_config):
    # Local keeps each client's adapter in its client state (sent with each request, returned on
    # each answer, in the checkpoint's engine part): round 2 trains on from round 1's adapters
    straight = outcome(run_experiment(config(tiny_config, "local", "name=straight")))
    run_experiment(config(tiny_config, "local", "name=resumed", TWO_CPUS, "rounds=1"))
    resumed = outcome(run_experiment(config(tiny_config, "local", "name=resumed", TWO_CPUS), resume=True))
    assert_same(straight, resumed)
    assert any(key.startswith("_engine/") for key in resumed[1])  # the client states are compared too


def test_a_run_whose_clients_all_fail_in_the_workers_stops_with_their_reasons_and_no_worker_left(tiny_config):
    # the engine's workers are probes (no model to load), whose fit raises on FedIT's messages (no array "x")
    cfg = config(tiny_config, "fedit", TWO_CPUS)
    engine = EmbeddedEngine(resolve_run(cfg))
    engine.local = DevicePool(cfg, ["cpu", "cpu"], make_context=probe_context)
    before = children()
    with pytest.raises(RoundFailed, match=r"after 3 attempts; drops: \{.*\"attempt 3: KeyError: 'x'\"") as failed:
        run_experiment(cfg, engine=engine)
    assert "died" not in str(failed.value)  # the clients raised; the workers lived
    assert children() <= before and engine.local.workers == [None, None]


# -- (b) which worker serves which client ------------------------------------------------------------
def test_assignment_deals_the_sorted_clients_round_robin_each_once():
    assert assignment([7, 2, 9, 0, 5], 2) == [[0, 5, 9], [2, 7]]
    assert assignment([3], 3) == [[3], [], []]
    shares = assignment(list(range(100, 0, -3)), 4)
    assert sorted(c for share in shares for c in share) == sorted(range(100, 0, -3))


def probe_messages(cids: list[int], **meta) -> dict[int, Message]:
    return {cid: Message({"x": np.full(3, float(cid), np.float32)}, meta) for cid in cids}


@pytest.fixture
def pool(tiny_config):
    """A pool of probe workers on ``cpu`` and ``cuda:1`` (the probe only reports its device)."""
    made = DevicePool(tiny_config(), ["cpu", "cuda:1"], threads=None, make_context=probe_context)
    yield made
    made.close()


def test_each_sampled_client_is_served_once_by_its_worker_on_its_device_and_its_state_kept(pool):
    cids = [7, 2, 9, 0, 5]
    out = pool("train", 1, probe_messages(cids))
    assert list(out) == cids  # in the order of the messages, as one process answers
    devices = {}
    for cid, got in out.items():
        assert got.error is None and got.sender == cid and got.round == 1
        assert got.reply.meta["cid"] == cid and got.reply.meta["count"] == 1
        np.testing.assert_array_equal(got.reply.arrays["x"], np.full(3, 2.0 * cid, np.float32))
        assert got.down == probe_messages([cid])[cid].nbytes and got.up == got.reply.nbytes  # bytes as they crossed
        devices[cid] = (got.reply.meta["device"], got.reply.meta["pid"])
    assert {devices[c][0] for c in (0, 5, 9)} == {"cpu"} and {devices[c][0] for c in (2, 7)} == {"cuda:1"}
    assert len({devices[c][1] for c in (0, 5, 9)}) == 1 and len({devices[c][1] for c in (2, 7)}) == 1
    assert devices[0][1] != devices[2][1] and os.getpid() not in {pid for _, pid in devices.values()}
    # each worker served its share once: the last reply of each counts every request it served
    served = {}
    for got in out.values():
        pid = got.reply.meta["pid"]
        served[pid] = max(served.get(pid, 0), got.reply.meta["served"])
    assert sorted(served.values()) == [2, 3]
    # the states came back: a client sampled again counts on, one sampled for the first time starts at 1
    again = pool("train", 2, probe_messages([0, 2, 4]))
    assert {cid: got.reply.meta["count"] for cid, got in again.items()} == {0: 2, 2: 2, 4: 1}
    assert {cid: int(s["count"]) for cid, s in pool.states.items()} == {0: 2, 2: 2, 4: 1, 5: 1, 7: 1, 9: 1}


def test_a_client_that_raises_in_a_worker_is_a_failed_delivery_with_its_reason_and_keeps_its_state(pool):
    pool("train", 1, probe_messages([0, 1, 2, 3]))
    out = pool("train", 2, probe_messages([0, 1, 2, 3], **{"raise": [1, 2]}))
    assert out[1].reply is None and out[1].error == "ValueError: client 1 broke"
    assert out[2].error == "ValueError: client 2 broke"
    assert out[1].down == probe_messages([1], **{"raise": [1, 2]})[1].nbytes and out[1].up == 0
    assert [out[c].reply.meta["count"] for c in (0, 3)] == [2, 2]
    assert {cid: int(s["count"]) for cid, s in pool.states.items()} == {0: 2, 1: 1, 2: 1, 3: 2}


def test_a_worker_killed_between_or_during_calls_fails_its_clients_naming_its_device_then_restarts(pool):
    first = pool("train", 1, probe_messages([0, 1, 2, 3]))
    pid = first[1].reply.meta["pid"]  # worker 1 ("cuda:1") serves clients 1 and 3
    os.kill(pid, signal.SIGKILL)
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # dead, not reaped: the pool reads its exit code
        time.sleep(0.05)
    between = pool("train", 2, probe_messages([0, 1, 2, 3]))
    reason = f"worker process on device 'cuda:1' (pid {pid}) died (exit code -9)"
    assert between[1].error == reason and between[3].error == reason
    assert [between[c].reply.meta["count"] for c in (0, 2)] == [2, 2]
    after = pool("train", 3, probe_messages([0, 1, 2, 3]))  # a fresh worker for device "cuda:1"
    restarted = after[1].reply.meta["pid"]
    assert restarted != pid and after[3].reply.meta["pid"] == restarted
    assert {c: after[c].reply.meta["count"] for c in range(4)} == {0: 3, 1: 2, 2: 3, 3: 2}  # 1, 3 kept round 1's
    # during a call: worker 1 is killed while its first client sleeps
    timer = threading.Timer(0.5, os.kill, (restarted, signal.SIGKILL))
    timer.start()
    during = pool("train", 4, probe_messages([0, 1, 2, 3], sleepers=[1, 3], sleep=2))
    timer.join()
    assert (
        during[1].error == during[3].error == f"worker process on device 'cuda:1' (pid {restarted}) died (exit code -9)"
    )
    assert during[0].error is None and during[2].error is None
    recovered = pool("train", 5, probe_messages([1]))
    assert recovered[1].error is None and recovered[1].reply.meta["count"] == 3
    pids = [w.process.pid for w in pool.workers if w is not None]
    pool.close()
    assert pool.workers == [None, None] and not any(psutil.pid_exists(p) for p in pids)


# -- torch threads -----------------------------------------------------------------------------------
def test_each_worker_runs_the_process_threads_divided_among_the_workers_unless_configured(tiny_config):
    torch.set_num_threads(4)  # the autouse fixture sets 1 again for the next test
    split = DevicePool(tiny_config(), ["cpu", "cpu"], make_context=probe_context)
    given = EmbeddedEngine(resolve_run(tiny_config(TWO_CPUS, "train.threads=3"))).local
    try:
        assert split.threads == 2 and given.threads == 3
        out = split("train", 1, probe_messages([0, 1]))
        assert [got.reply.meta["threads"] for got in out.values()] == [2, 2]
    finally:
        split.close()
        given.close()


# -- (d) the option ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('["cpu"]', r"^placement\.client_devices: expected two or more devices, one worker each \(got \['cpu'\]"),
        ('["cpu", "gpu"]', r"^placement\.client_devices: expected cpu, cuda, cuda:N or mps per entry \(got 'gpu'\)$"),
        ('["cpu", "auto"]', r"per entry \(got 'auto'\)$"),
        ("[]", r"expected two or more devices"),
    ],
)
def test_a_bad_device_list_is_one_line_naming_the_option(tiny_config, value, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(f"placement.client_devices={value}")


@pytest.mark.parametrize("engine", ["flower-sim", "flower"])
def test_other_engines_refuse_client_devices(tiny_config, engine):
    with pytest.raises(ConfigError, match=r"^placement\.client_devices: applies to engine = 'embedded' \(flower-sim"):
        tiny_config(TWO_CPUS, f"engine={engine}")


def test_a_cuda_index_this_machine_lacks_stops_before_the_run_folder(tiny_config):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg = tiny_config(f'placement.client_devices=["cpu", "cuda:{count}"]')
    with pytest.raises(
        ConfigError,
        match=rf"^placement\.client_devices: 'cuda:{count}' is not available here \({count} CUDA devices\); "
        r"list devices this machine has$",
    ):
        run_experiment(cfg)
    assert not Path(cfg.output_dir).exists()


def test_by_default_clients_spread_over_every_gpu_only_when_device_is_cuda_or_auto(tiny_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    every = ["cuda:0", "cuda:1", "cuda:2"]
    assert client_devices(tiny_config("device=cuda")) == every
    assert client_devices(tiny_config("device=auto")) == every
    assert client_devices(tiny_config("device=cuda:1")) == []  # one named device: one process
    assert client_devices(tiny_config("device=cpu")) == []
    assert client_devices(tiny_config("device=cuda", TWO_CPUS)) == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert client_devices(tiny_config("device=cuda")) == []
