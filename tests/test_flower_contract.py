"""Every registered method gives the same run on Flower as on the embedded engine: the same
final global state (to float tolerance) and the same bytes, client by client and round by round.

The cases come from ``list_methods()`` at collection time (a method added later is tested here
without editing this file), on ``text-classification`` with its tiny test configuration. The
default run drives the real ServerApp/ClientApp code through an in-process Grid
(:class:`tests.test_flower.LoopbackGrid`), with one node per client and with nodes playing
groups of clients; the slow tests run a real loopback deployment (SuperLink, SuperNodes, workers,
``flwr run``) for ``fedit`` and ``fslora``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.serverapp import serve
from fedtune.methods import list_methods
from fedtune.run import run_experiment
from tests.test_contract import flatten, tiny
from tests.test_flower import LoopbackGrid, client_1_fails_in_round_2, task_identity  # noqa: F401 - fixtures

KIND = "text-classification"
METHODS = [spec.name for spec in list_methods() if spec.supports(KIND)]


def _run(tmp_path: Path, method: str, engine: str, groups=None):
    """(flattened final state, metrics lines) of a 2-round tiny run of ``method``."""
    config = tiny(tmp_path / engine, method, KIND, "seed=5")
    if engine == "embedded":
        summary = run_experiment(config)
    else:
        grid = LoopbackGrid(make_client_app(config), config.federation.num_clients, groups=groups)
        summary = serve(grid, config, timeout=120)
        assert summary["engine"] == "flower"
    run_dir = Path(summary["run_dir"])
    state = load_state(run_dir / "checkpoint.npz")
    state.pop("_engine")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return flatten(state), lines


def assert_same_run(flower: tuple, embedded: tuple) -> None:
    (f_state, f_lines), (e_state, e_lines) = flower, embedded
    assert_same_state(f_state, e_state)
    assert [x["round"] for x in f_lines] == [x["round"] for x in e_lines] == [1, 2]
    for key in ("clients", "client_bytes_up", "client_bytes_down", "eval_bytes", "client_steps"):
        assert [x[key] for x in f_lines] == [x[key] for x in e_lines], key
    assert all(v > 0 for x in f_lines for v in x["client_bytes_up"].values())
    for f, e in zip(f_lines, e_lines):
        np.testing.assert_allclose(f["accuracy"], e["accuracy"], atol=1e-6)
        np.testing.assert_allclose(f["loss"], e["loss"], rtol=1e-4)


def assert_same_state(f_state: dict, e_state: dict) -> None:
    """Two flattened checkpoints hold the same arrays (floats to 1e-5)."""
    assert f_state.keys() == e_state.keys()
    for key, value in e_state.items():
        got, want = np.asarray(f_state[key]), np.asarray(value)
        assert got.shape == want.shape and got.dtype == want.dtype, key
        if want.dtype.kind in "fc":
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=key)
        else:
            np.testing.assert_array_equal(got, want, err_msg=key)


@pytest.mark.parametrize("method", METHODS)
def test_method_on_flower_apps_matches_embedded_engine(task_identity, tmp_path, method):  # noqa: F811
    assert_same_run(_run(tmp_path, method, "flower"), _run(tmp_path, method, "embedded"))


def test_nodes_playing_groups_of_clients_match_embedded_engine(task_identity, tmp_path, monkeypatch):  # noqa: F811
    from fedtune.engines.flower import codec

    # 3 clients, all sampled, on 2 nodes: one node plays clients 0 and 1 (fedtune-clients="0-1"),
    # and gets both in one bundle per round
    sent = []
    monkeypatch.setattr(
        LoopbackGrid,
        "push_messages",
        lambda self, ms, push=LoopbackGrid.push_messages: sent.extend(ms) or push(self, ms),
    )
    extra = "federation.clients_per_round=3"
    config = tiny(tmp_path / "flower", "fslora", KIND, "seed=5", extra)
    summary = serve(LoopbackGrid(make_client_app(config), 3, groups=[[0, 1], [2]]), config, timeout=120)
    bundles = [m for m in sent if codec.BUNDLE in m.content]
    assert len(bundles) == 2 and all(list(m.content[codec.BUNDLE][codec.CLIENTS]) == [0, 1] for m in bundles)
    run_dir = Path(summary["run_dir"])
    state = load_state(run_dir / "checkpoint.npz")
    state.pop("_engine")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    embedded = run_experiment(tiny(tmp_path / "embedded", "fslora", KIND, "seed=5", extra))
    e_state = load_state(Path(embedded["run_dir"]) / "checkpoint.npz")
    e_state.pop("_engine")
    e_lines = [json.loads(x) for x in (Path(embedded["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert_same_run((flatten(state), lines), (flatten(e_state), e_lines))


def test_a_client_failing_in_a_bundle_is_dropped_alone(task_identity, tmp_path, client_1_fails_in_round_2):  # noqa: F811
    config = tiny(tmp_path, "fedit", KIND, "federation.clients_per_round=3")
    summary = serve(LoopbackGrid(make_client_app(config), 3, groups=[[0, 1, 2]]), config, timeout=120)
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert (
        lines[0]["dropped"] == {} and lines[0]["attempts"] == 1 and lines[0]["client_steps"] == {"0": 2, "1": 2, "2": 2}
    )
    assert list(lines[1]["dropped"]) == ["1"] and "RuntimeError: out of memory on purpose" in lines[1]["dropped"]["1"]
    assert lines[1]["client_steps"] == {"0": 2, "2": 2}


# -- a real deployment on 127.0.0.1 -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedit", "fslora"])
def test_loopback_deployment_matches_embedded_engine(tmp_path, method):
    import psutil

    from fedtune.engines.flower.deployment import run_flower_deployment

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    config = tiny(tmp_path / "flower", method, KIND, "seed=5", "engine=flower", "placement.nodes=2")
    seen = []
    summary = run_flower_deployment(config, on_round=seen.append, timeout=300, keep_logs=tmp_path / "logs")
    assert summary["engine"] == "flower" and [r.round for r in seen] == [1, 2]
    run_dir = Path(summary["run_dir"])
    state = load_state(run_dir / "checkpoint.npz")
    state.pop("_engine")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_same_run((flatten(state), lines), _run(tmp_path, method, "embedded"))
    timing = [json.loads(x) for x in (run_dir / "flower_timing.jsonl").read_text().splitlines()]
    assert [t["round"] for t in timing if t["kind"] == "train"] == [1, 2]
    # every process the deployment started is gone
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
