"""Client-level DP (fedtune.methods.base.privacy) on the Flower engines: the same mechanism and
accountant as on the embedded engine, so a run with the test-only reproducible noise (the secret
noise of two runs differs by design) gives the same final state, the same lines and the same
``summary.json`` privacy record; resume restores the server's secret and release counts. Through
the in-process Grid of tests/test_flower.py (resume too), and one real Flower simulation (Ray) per
privacy mode (slow tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.serverapp import serve
from fedtune.methods.base.privacy import mechanism
from fedtune.run import run_experiment
from tests.conftest import tiny
from tests.test_contract import flatten
from tests.test_flower import LoopbackGrid, task_identity  # noqa: F401 - fixture
from tests.test_flower_contract import assert_same_state

KIND = "text-classification"
C = 0.05  # below the tiny updates' norms: clipping is active
SAME_NOISE = "privacy.insecure_reproducible_noise=true"  # tests only: the two engines' runs draw alike
DP = {
    "central": ['privacy.mode="central"', f"privacy.clip={C}", "privacy.noise_multiplier=0.8", SAME_NOISE],
    "local": ['privacy.mode="local"', f"privacy.clip={C}", "privacy.noise_multiplier=0.8", SAME_NOISE],
}


def _config(tmp_path: Path, mode: str, *extra: str):
    # 4 clients, 2 sampled per round: the local releases differ between clients
    return tiny(tmp_path, "fedit", KIND, *DP[mode], "federation.num_clients=4", "seed=9", *extra)


def _result(summary: dict) -> tuple[dict, list[dict]]:
    run_dir = Path(summary["run_dir"])
    state = load_state(run_dir / "checkpoint.npz")
    state.pop("_engine")
    return flatten(state), [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_privacy(flower: dict, embedded: dict, flower_run: tuple, embedded_run: tuple) -> None:
    assert_same_state(flower_run[0], embedded_run[0])
    f_lines, e_lines = flower_run[1], embedded_run[1]
    assert [x.keys() for x in f_lines] == [x.keys() for x in e_lines] and [x["round"] for x in f_lines] == [1, 2]
    assert all(x["private"] and "clients" not in x for x in f_lines)
    for f, e in zip(f_lines, e_lines):
        np.testing.assert_allclose(f["accuracy"], e["accuracy"], atol=1e-6)
    assert flower["privacy"] == embedded["privacy"] and flower["privacy"]["releases"] > 0


@pytest.mark.parametrize("mode", ["central", "local"])
def test_dp_over_flowers_apps_gives_the_embedded_run(task_identity, tmp_path, mode):  # noqa: F811
    """The same comparison through Flower's ServerApp and ClientApps on the in-process Grid of
    tests/test_flower.py (seconds; the Ray runs below are slow tests): the same noised global
    adapter, clients, bytes, epsilon on every line and summary privacy record as the embedded run."""
    embedded = run_experiment(_config(tmp_path / "embedded", mode))
    cfg = _config(tmp_path / "flower", mode)
    flower = serve(LoopbackGrid(make_client_app(cfg), 4), cfg, timeout=60)
    _assert_same_privacy(flower, embedded, _result(flower), _result(embedded))


@pytest.mark.slow  # a Ray start per mode; tests/test_secagg.py keeps one Ray run in the default suite
@pytest.mark.parametrize("mode", ["central", "local"])
def test_dp_on_the_flower_simulation_gives_the_embedded_run(tmp_path, mode):
    """Same seed, same tiny FedIT run under DP on the embedded engine and on Flower's simulation
    runtime (Ray): the same noised global adapter (to float tolerance), clients, bytes, epsilon on
    every line and summary privacy record. Fails if the ClientApps do not noise (local), if the
    server does not count a client's releases or rounds, or if the noise streams differ."""
    ray = pytest.importorskip("ray")
    from fedtune.engines.flower.simulation import run_flower_simulation

    embedded = run_experiment(_config(tmp_path / "embedded", mode))
    flower = run_flower_simulation(_config(tmp_path / "flower", mode, 'engine="flower-sim"'), timeout=600)
    assert not ray.is_initialized() and flower["engine"] == "flower"
    _assert_same_privacy(flower, embedded, _result(flower), _result(embedded))
    counts = load_state(Path(flower["run_dir"]) / "checkpoint.npz")["privacy_releases"]
    assert int(counts.max()) == flower["privacy"]["releases"] == (2 if mode == "central" else int(counts.max()))
    assert mechanism(_config(tmp_path, mode)).epsilon(2) == float("inf")  # reproducible noise is not private


def test_a_resumed_flower_run_keeps_its_release_counts(task_identity, tmp_path):  # noqa: F811
    """Local DP over Flower's apps (in-process Grid): one round, then a resume to three, ends
    with the state and release counts of an uninterrupted three-round embedded run. Fails if the
    server's per-client release counts were not checkpointed and restored (they would count only
    rounds 2-3), or its secret (the sample of rounds 2-3 would differ)."""
    embedded = run_experiment(_config(tmp_path / "embedded", "local", "rounds=3"))
    first = _config(tmp_path / "flower", "local", "rounds=1")
    serve(LoopbackGrid(make_client_app(first), 4), first, timeout=60)
    again = _config(tmp_path / "flower", "local", "rounds=3")
    flower = serve(LoopbackGrid(make_client_app(again), 4), again, timeout=60, resume=True)
    f_state, f_lines = _result(flower)
    e_state, e_lines = _result(embedded)
    assert [x["round"] for x in f_lines] == [1, 2, 3]
    assert_same_state(f_state, e_state)
    assert flower["privacy"] == embedded["privacy"]


def _recorded(tmp_path: Path, name: str, *extra: str, on_round=None) -> list[dict]:
    """Every reply the server pulled from its grid in a 2-round tiny run of tests/engines.py's
    BASE with ``extra`` over Flower's apps (the in-process Grid)."""
    from fedtune.config import load_config
    from tests.engines import BASE, RecordingGrid

    config = load_config(None, [*BASE, *extra, f"output_dir={tmp_path}", f"name={name}"])
    sink = tmp_path / f"{name}.replies.jsonl"
    grid = LoopbackGrid(make_client_app(config), config.federation.num_clients)
    serve(RecordingGrid(grid, sink), config, timeout=60, on_round=on_round)
    return [json.loads(x) for x in sink.read_text().splitlines()]


def _envelopes(replies: list[dict]) -> list[dict]:
    return [r["config"]["fedtune"] for r in replies if r["type"] == "train" and "fedtune" in r.get("config", {})]


@pytest.mark.parametrize("mode", ["local", "secure"])
def test_under_local_dp_or_secagg_a_reply_carries_nothing_of_a_client_but_its_upload(task_identity, tmp_path, mode):  # noqa: F811
    """Over Flower's apps (seconds; the real runtimes: tests/test_privacy_adversary.py on every
    engine): every training reply the server receives carries the fixed metadata and who answered
    for which round, no seconds or timestamps (tests/test_privacy_adversary.py's check)."""
    from tests.engines import CENTRAL, LOCAL, SECURE
    from tests.test_privacy_adversary import assert_nothing_of_a_client_but_its_upload

    extra = LOCAL if mode == "local" else [*CENTRAL, *SECURE, 'engine="flower-sim"']
    replies = _recorded(tmp_path, mode, *extra)
    assert assert_nothing_of_a_client_but_its_upload(replies) == (8 if mode == "local" else 4)


def test_a_reply_without_dp_carries_a_clients_numbers(task_identity, tmp_path):  # noqa: F811
    """Control of the check above: without DP a reply carries the client's loss, steps, seconds and
    timestamps (the timing file's), which the check refuses; under central DP without SecAgg+ (the
    server trusted with each update) the seconds still cross, for the deadlines, but no timestamp:
    the timing file is not written under DP."""
    from tests.engines import CENTRAL
    from tests.test_privacy_adversary import assert_nothing_of_a_client_but_its_upload

    plain = _recorded(tmp_path, "plain")
    assert all({"compute_s", "t-process", "t-enter", "t-exit"} <= set(e) for e in _envelopes(plain))
    assert all({"train_loss", "steps"} <= set(e["meta"]) for e in _envelopes(plain))
    with pytest.raises(AssertionError):
        assert_nothing_of_a_client_but_its_upload(plain)
    central = _envelopes(_recorded(tmp_path, "central", *CENTRAL))
    assert central and all(set(e) - {"layout"} == {"meta", "cid", "round", "compute_s"} for e in central)


@pytest.mark.parametrize("mode", ["local", "central"])
def test_the_deadline_holds_without_the_seconds_crossing(task_identity, tmp_path, mode):  # noqa: F811
    """A client slower than ``federation.round_timeout_s`` (its profile's ``delay_s``) is dropped,
    the others aggregated. Under local DP its reply carries no seconds, so its node finds it late
    and fails the request with a reason that holds no time; under central DP (control: the seconds
    cross) the server drops it, naming them."""
    from tests.engines import CENTRAL, LOCAL

    records = []
    extra = [
        *(LOCAL if mode == "local" else CENTRAL),
        "rounds=1",
        "federation.round_timeout_s=4",
        "federation.profiles=[{delay_s=5},{},{},{}]",
    ]
    replies = _recorded(tmp_path, mode, *extra, on_round=records.append)
    (record,) = records
    assert list(record.dropped) == [0]
    if mode == "local":
        assert "missed its 4 s deadline" in record.dropped[0] and not re.search(r"\d\.\d+ s", record.dropped[0])
        assert all("compute_s" not in e for e in _envelopes(replies))
    else:
        assert re.fullmatch(r"missed the 4 s deadline \(\d+\.\d+ s\)", record.dropped[0]), record.dropped
