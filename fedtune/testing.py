"""fedtune's contract checks, public: a method or task kind in the user's own package is tested the
way fedtune's own are (``tests/test_contract.py``), on any engine.

.. code-block:: python

    from fedtune.testing import check_method

    def test_my_method(tmp_path):
        check_method("my_pkg.method:mine", tmp_path, engine="flower-sim")

:func:`tiny_config` is the seconds-long configuration those checks run: the task kind's own tiny
model and data (its ``test_overrides``), 3 clients, 2 per round, 2 rounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedtune.config import RunConfig, flat_keys, load_config

#: what every contract run sets beside the task's own tiny overrides
TINY_RUN = (
    "federation.num_clients=3",
    "federation.clients_per_round=2",
    "rounds=2",
    "train.local_steps=2",
    "train.batch_size=4",
    "model.lora_rank=4",
    "federation.profile_choices={rank=[2,4], sketch_ratio=[0.5,1.0]}",  # heterogeneous ranks
    "train.eval_batch_size=16",
)


def tiny_config(method: str, kind: str, output_dir: str | Path, *extra: str, variant: str = "") -> RunConfig:
    """A seconds-long config of ``method`` on task kind ``kind`` (its ``test_overrides`` and the
    named ``variant`` of its ``test_variants``), :data:`TINY_RUN`, writing under ``output_dir``;
    ``extra``: further ``key=value`` overrides."""
    from fedtune.tasks import get_task_class

    task = get_task_class(kind)
    return load_config(
        None,
        [
            f"method={method}",
            f"task.kind={kind}",
            *task.test_overrides,
            *task.test_variants.get(variant, ()),
            *TINY_RUN,
            f"output_dir={output_dir}",
            *extra,
        ],
    )


def check_run(config: RunConfig) -> dict[str, Any]:
    """Run ``config`` on its engine (:func:`fedtune.launch.launch`) and check what every method
    guarantees: each round recorded once, in order, each sampled client's bytes down and up
    counted (and above zero), a finite final loss and an accuracy in [0, 1], and the final state
    round-tripping through the checkpoint into a freshly built strategy. Returns the summary."""
    import json

    from fedtune.checkpoint import load_state
    from fedtune.launch import launch
    from fedtune.runtime import RunContext, resolve_run

    summary = launch(config)
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == list(range(1, config.rounds + 1)), "a round missing or twice"
    for line in lines:
        sampled = {str(c) for c in line["clients"]} - set(line["dropped"])
        assert sampled, f"round {line['round']}: no client answered ({line['dropped']})"
        assert sampled <= set(line["client_bytes_down"]), f"round {line['round']}: bytes down not counted"
        assert all(line["client_bytes_up"][c] > 0 for c in sampled), f"round {line['round']}: an empty upload"
    assert 0.0 <= summary["final_accuracy"] <= 1.0, f"final accuracy {summary['final_accuracy']}"
    assert np.isfinite(summary["final_loss"]), f"final loss {summary['final_loss']}"
    state = load_state(run_dir / "checkpoint.npz")
    assert state.pop("_round") == config.rounds
    state.pop("_engine", None)
    fresh = RunContext(resolve_run(config)).strategy()
    fresh.load_state_dict(state)
    a, b = flat_keys(state, "/"), flat_keys(fresh.state_dict(), "/")
    assert a.keys() == b.keys(), "the state a strategy loads is not the state it gives back"
    assert all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a), "the state changed on load"
    return summary


def check_method(
    method: str, output_dir: str | Path, engine: str = "embedded", kinds: list[str] | None = None, *extra: str
) -> list[dict[str, Any]]:
    """:func:`check_run` of ``method`` (a name or ``"my_pkg.module:NAME"``) on each task kind it
    runs on (or ``kinds``), tiny (:func:`tiny_config`), on ``engine``; the summaries."""
    from fedtune.methods import get_method

    spec = get_method(method)
    out = []
    for kind in kinds or spec.supported_tasks():
        folder = Path(output_dir) / f"{kind}-{engine}"
        out.append(check_run(tiny_config(method, kind, folder, f"engine={engine}", *extra)))
    return out


def check_task(kind: str, output_dir: str | Path, engine: str = "embedded", method: str = "fedavg") -> dict[str, Any]:
    """:func:`check_run` of the task kind ``kind`` (a name or ``"my_pkg.module:KIND"``) with
    ``method`` (FedAvg runs on every task), tiny, on ``engine``; the summary."""
    return check_run(tiny_config(method, kind, Path(output_dir) / f"{method}-{engine}", f"engine={engine}"))
