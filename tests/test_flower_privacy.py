"""Client-level DP (fedtune.methods.base.privacy) on the Flower engines: the same mechanism and
accountant as on the embedded engine, so a run with the test-only reproducible noise (the secret
noise of two runs differs by design) gives the same final state, the same lines and the same
``summary.json`` privacy record; resume restores the server's secret and release counts. Through
the in-process Grid of tests/test_flower.py (resume too), and one real Flower simulation (Ray) per
privacy mode (slow tests)."""

from __future__ import annotations

import json
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
