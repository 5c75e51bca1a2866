"""A reply whose metadata is not a mapping of what the method declares (a list, a string, a
number, a mapping inside a list, numbers nested in mappings) is dropped with its reason on every
engine, never a crash: the round loop checks the metadata's shape before it reads a key of it
(``peak_bytes`` of a client with a memory budget among them). The hostile clients are the
profile's fault injection ``attack = "metadata"``, which every engine's client side applies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedtune.config import load_config
from tests.conftest import TINY

#: client -> (its reply's metadata, what its drop reason says)
HOSTILE = {
    0: ("[1, 2]", "metadata is a list, not a mapping"),
    1: ("'plenty'", "metadata is a str, not a mapping"),
    2: ("7", "metadata is a int, not a mapping"),
    3: ("[{num_examples = 3, peak_bytes = 1}]", "metadata is a list, not a mapping"),
    4: ("{num_examples = {n = 3}, peak_bytes = {bytes = 1}}", "metadata 'num_examples': dict"),
}


def _config(tmp_path: Path, engine: str):
    """Six clients with a memory budget each (their replies carry ``peak_bytes``), 0-4 hostile."""
    profiles = [f"{{memory_gib = 64, attack = 'metadata', attack_metadata = {meta}}}" for meta, _ in HOSTILE.values()]
    profiles.append("{memory_gib = 64}")
    return load_config(
        None,
        [
            *TINY,
            f"output_dir={tmp_path}",
            f"engine={'flower' if engine == 'loopback' else engine}",
            "federation.num_clients=6",
            f"federation.profiles=[{', '.join(profiles)}]",
            "rounds=1",
            "train.local_steps=1",
        ],
    )


def _run(tmp_path: Path, engine: str) -> dict:
    config = _config(tmp_path, engine)
    if engine == "loopback":  # Flower's ClientApp and ServerApp, through an in-process Grid
        from fedtune.engines.flower.clientapp import make_client_app
        from fedtune.engines.flower.serverapp import serve
        from tests.test_flower import LoopbackGrid

        return serve(LoopbackGrid(make_client_app(config), 6), config, timeout=120)
    from fedtune.launch import launch

    return launch(config)


ENGINES = [
    "embedded",
    "loopback",
    pytest.param("flower-sim", marks=pytest.mark.slow),
    pytest.param("flower", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("engine", ENGINES)
def test_hostile_metadata_is_dropped_with_its_reason_on_every_engine(tmp_path, engine, monkeypatch):
    if engine == "loopback":
        from flwr.supercore.task_identity import TaskIdentity

        for attr in ("_run_id", "_task_id", "_node_id"):
            monkeypatch.setattr(TaskIdentity, attr, 1)
    summary = _run(tmp_path, engine)
    (line,) = [json.loads(x) for x in Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()]
    for cid, (_, reason) in HOSTILE.items():
        assert reason in line["dropped"][str(cid)], (cid, line["dropped"])
    assert "5" not in line["dropped"] and line["client_steps"]["5"] == 1  # the honest client is aggregated
    assert line["accuracy"] is not None
