"""Every registered method on every task kind it supports: one tiny run each, embedded engine.

The cases come from ``list_methods()`` x ``supported_tasks()`` at collection time and each task's
own ``test_overrides`` (a tiny model on a few real examples), so a method or a task added later is
tested here without editing this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError, flat_keys
from fedtune.methods import get_method, list_methods
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks import list_tasks
from tests.conftest import assert_moved_alike, tiny, variants

CASES = [
    (spec.name, kind, v)
    for spec in list_methods()
    for kind in spec.supported_tasks()
    for v in variants(kind)
    if spec.supports_config(tiny(Path("/tmp"), spec.name, kind, variant=v))  # the variant's model offers what it needs
]


def flatten(state: dict) -> dict:
    """Nested state dicts as one ``a/b/c -> value`` dict."""
    return flat_keys(state, "/")


def test_every_task_kind_has_test_overrides_and_every_method_a_task():
    assert {t.kind for t in list_tasks()} >= {"text-classification"}
    for task in list_tasks():
        assert task.test_overrides, f"task {task.kind} gives the contract test no tiny configuration"
    for spec in list_methods():
        assert spec.supported_tasks(), f"method {spec.name} runs on no registered task"


@pytest.mark.parametrize(
    ("method", "kind", "variant"), CASES, ids=[f"{m}-{k}{'-' + v if v else ''}" for m, k, v in CASES]
)
def test_method_runs_on_task(tmp_path, method, kind, variant):
    summary = run_experiment(tiny(tmp_path, method, kind, variant=variant))
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2]
    assert all(len(line["clients"]) == 2 for line in lines)
    assert all(set(line["client_bytes_down"]) == {str(c) for c in line["clients"]} for line in lines)
    assert all(v > 0 for line in lines for v in line["client_bytes_up"].values())
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and np.isfinite(summary["final_loss"])
    assert summary["task"] == kind and 0.0 < summary["majority_accuracy"] <= 1.0
    # the final state round-trips through the checkpoint into a fresh strategy
    state = load_state(run_dir / "checkpoint.npz")
    assert state.pop("_round") == 2
    state.pop("_engine")
    fresh = RunContext(resolve_run(tiny(tmp_path, method, kind, variant=variant))).strategy()
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    a, b = flatten(state), flatten(again)
    assert a.keys() == b.keys()
    assert all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_unsupported_pairing_names_both(tmp_path):
    unsupported = [(s.name, t.kind) for s in list_methods() for t in list_tasks() if not s.supports(t.kind)]
    if not unsupported:  # every method runs everywhere: check the message on a made-up requirement
        spec = get_method("fedit")
        with pytest.raises(ConfigError, match="does not support task"):
            type(spec)(spec.name, spec.strategy, spec.client, spec.options, "", frozenset({"nothing"})).check_task(
                "text-classification"
            )
        return
    method, kind = unsupported[0]
    with pytest.raises(ConfigError, match=rf"method '{method}' does not support task '{kind}'"):
        RunContext(resolve_run(tiny(tmp_path, method, kind)))


CROSS_OPTION_SETTINGS = {
    "server.optimizer": ["server.optimizer=adam", "server.lr=1e-3"],
    "federation.upload_topk": ["federation.upload_topk=0.1"],
    "robust.aggregation": ['robust.aggregation="median"'],
    "robust.clip_update_norm": ["robust.clip_update_norm=1e-6"],
    "robust.max_client_weight": ["robust.max_client_weight=0.01"],
    "federation.wire_dtype": ['federation.wire_dtype="bfloat16"'],
    "model.dtype": ['model.dtype="bfloat16"'],
    "model.quantization": ['model.quantization="4bit"'],
    "train.gradient_checkpointing": ["train.gradient_checkpointing=true"],
    "device": ["device=cuda"],  # taken as an accelerator here (the test patches the check)
    "privacy.mode": ['privacy.mode="central"', "privacy.clip=1.0", "privacy.noise_multiplier=1.0"],
    "secure_aggregation.enabled": ["secure_aggregation.enabled=true", 'engine="flower-sim"'],
}
ROBUST_OPTIONS = ("robust.aggregation", "robust.clip_update_norm", "robust.max_client_weight")
#: A method's own options an honoured cross-method option needs beside it (otherwise one line names them)
METHOD_NEEDS = {("fedpft", "secure_aggregation.enabled"): ["options.distill_during=false"]}


@pytest.mark.parametrize("option", sorted(CROSS_OPTION_SETTINGS))
@pytest.mark.parametrize("method", sorted({m for m, _, _ in CASES}))
def test_a_cross_method_option_is_honoured_or_refused_in_one_line(tmp_path, monkeypatch, method, option):
    """Every method declares the cross-method options it honours; any other one, set, stops the
    run with one line naming the method and the option (it used to be accepted and ignored)."""
    from fedtune import registry
    from fedtune.registry import CROSS_METHOD_OPTIONS
    from fedtune.runtime import resolve_run

    monkeypatch.setattr(registry, "_accelerated", lambda device: device != "cpu")  # no GPU needed

    assert set(CROSS_OPTION_SETTINGS) == set(CROSS_METHOD_OPTIONS)
    kind = next(k for m, k, _ in CASES if m == method)
    config = tiny(tmp_path, method, kind, *CROSS_OPTION_SETTINGS[option], *METHOD_NEEDS.get((method, option), []))
    if option in get_method(method).honours:
        assert resolve_run(config).method.name == method
    else:
        with pytest.raises(ConfigError, match=rf"^{option}: method '{method}' does not support it"):
            resolve_run(config)
    resolve_run(tiny(tmp_path, method, kind))  # at its default every method accepts it


def _one_round(tmp_path, method, kind, *extra):
    """(the global state after one round, the bytes clients uploaded) of a tiny run."""
    summary = run_experiment(tiny(tmp_path, method, kind, "rounds=1", *extra))
    state = load_state(Path(summary["run_dir"]) / "checkpoint.npz")
    state.pop("_round"), state.pop("_engine")
    return flatten(state), summary["total_bytes_up"]


def _initial_state(tmp_path, method, kind) -> dict:
    """The strategy's state before any round (as :func:`_one_round` flattens a checkpoint)."""
    strategy = RunContext(resolve_run(tiny(tmp_path, method, kind))).strategy()
    strategy.initialize()
    return flatten(strategy.state_dict())


#: Who honours the cross-method options: the methods whose server steps through its Aggregation and
#: whose clients upload through UpdateClient.upload (pinned: a declaration added or dropped fails here).
HONOURING = [
    "commit",
    "fedavg",
    "fedit",
    "fedot",
    "fedpetuning",
    "fedpft",
    "fedstacklora",
    "flexlora",
    "fslora",
    "heterolora",
]


#: ... and the robust-aggregation options: the methods whose server combines updates as a weighted sum.
ROBUST_HONOURING = ["fedavg", "fedit", "fedot", "fedpetuning", "fedpft"]
#: ... and the model-scale options: the LoRA methods that touch the base only through the prepared
#: workspace (fedtune.models.precision); quantization not by those that write merges into base weights;
#: CoMMIT not a bfloat16 base (its kappa compares small changes of rounded predictions).
SCALE_HONOURING = ["fedit", "fedstacklora", "flexlora", "fslora", "heterolora", "local"]
BOMM = ["bomm", "bomm-local", "bomm-mm-ac", "bomm-mm-local", "bomm-mm-uc", "bomm-vanilla"]
#: ... and the device: those, and the methods whose own tensor code follows it (tests/test_device.py)
DEVICE_HONOURING = sorted(
    [
        *SCALE_HONOURING,
        "commit",
        "fedavg",
        "fedmbo",
        "fedrolex",
        "fiarse",
        "rabo",
        "rafbo",
        "static",
        *BOMM,
        "fedot",
        "fedpetuning",
        "fedpft",
    ]
)
#: ... and client-level DP (fedtune.methods.base.privacy): the sums of clipped updates with uniform
#: weights, replace-one sensitivity 2C (heterolora's zero-padded sum, FSLoRA's placed sketched uploads).
PRIVACY_HONOURING = ["fedavg", "fedit", "fslora", "heterolora"]
PINNED = {
    **dict.fromkeys(ROBUST_OPTIONS, ROBUST_HONOURING),
    "model.dtype": SCALE_HONOURING,
    "device": DEVICE_HONOURING,
    "train.gradient_checkpointing": sorted(SCALE_HONOURING),
    "model.quantization": ["commit", "fedit", "fslora", "heterolora", "local"],
    "privacy.mode": PRIVACY_HONOURING,
    # the weighted sums SecAgg+ computes (fedtune.methods.base.aggregation.Aggregation.secure_sum)
    "secure_aggregation.enabled": ["fedavg", "fedit", "fedot", "fedpetuning", "fedpft", "fslora", "heterolora"],
}


def test_the_methods_that_honour_cross_method_options_are_the_pinned_ones():
    from fedtune.methods import list_methods

    for option in CROSS_OPTION_SETTINGS:
        pinned = PINNED.get(option, HONOURING)
        assert sorted(s.name for s in list_methods() if option in s.honours) == pinned, option


@pytest.mark.parametrize("method", ["fedavg", "fedit"])
def test_a_method_that_honours_update_clipping_changes_with_it(tmp_path, method):
    """A bound of 1e-6 on every update leaves the global state all but where it started."""
    kind = next(k for m, k, _ in CASES if m == method)
    plain, _ = _one_round(tmp_path / "plain", method, kind)
    clipped, _ = _one_round(tmp_path / "clip", method, kind, *CROSS_OPTION_SETTINGS["robust.clip_update_norm"])
    floats = [k for k in plain if np.asarray(plain[k]).dtype.kind == "f" and k in clipped]
    assert any(not np.array_equal(plain[k], clipped[k]) for k in floats)


@pytest.mark.parametrize("method", HONOURING)
def test_a_method_that_honours_a_cross_method_option_changes_with_it(tmp_path, method):
    """What it declares it does: FedAdam moves the global state elsewhere than the plain step, top-k
    (10 %) uploads fewer bytes, and a bfloat16 wire dtype uploads about half (the state stays float32)."""
    kind = next(k for m, k, _ in CASES if m == method)
    plain, plain_up = _one_round(tmp_path / "plain", method, kind)
    adam, _ = _one_round(tmp_path / "adam", method, kind, *CROSS_OPTION_SETTINGS["server.optimizer"])
    floats = [k for k in plain if np.asarray(plain[k]).dtype.kind == "f" and k in adam]
    assert any(not np.array_equal(plain[k], adam[k]) for k in floats)  # the server step changed the state
    _, topk_up = _one_round(tmp_path / "topk", method, kind, *CROSS_OPTION_SETTINGS["federation.upload_topk"])
    assert topk_up < plain_up  # the clients uploaded through the top-k codec
    wire, wire_up = _one_round(tmp_path / "wire", method, kind, *CROSS_OPTION_SETTINGS["federation.wire_dtype"])
    assert wire_up < 0.75 * plain_up  # float arrays crossed in 2 bytes per entry
    assert_moved_alike(wire, plain, _initial_state(tmp_path / "init", method, kind))  # and were decoded
