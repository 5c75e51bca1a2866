"""Combiners from the user's own package (``robust.aggregation``): by ``"pkg.module:NAME"`` in a
real CLI run (the run's state is the user's combination, not the mean's), by an installed package's
entry point (group ``fedtune.combiners``, listed by ``fedtune combiners`` with its source), refused
where the robust combiners are, and one line naming ``robust.aggregation`` for each way a
reference can be wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.config import ConfigError, load_config
from fedtune.methods.base import robust
from fedtune.methods.base.robust import WeightedMean, weighted_average
from fedtune.runtime import resolve_run
from tests.conftest import TINY, output_lines

runner = CliRunner()

#: A user's combiner: half the weighted mean, recording what it was given (when RECORD is set).
HALF = '''
import numpy as np
from fedtune.methods.base.robust import WeightedMean, register_combiner

RECORD = {record!r}


class Half:
    """Half the weighted mean of the updates."""

    def __call__(self, updates, weights):
        if RECORD:
            arrays = {{f"{{i}}/{{k}}": v for i, u in enumerate(updates) for k, v in u.items()}}
            np.savez(RECORD, weights=np.asarray(weights), **arrays)
        return {{k: v * 0.5 for k, v in WeightedMean()(updates, weights).items()}}


register_combiner("half", lambda robust: Half(), "half the weighted mean")
'''


@pytest.fixture(autouse=True)
def _registry():
    """Each test's package registers into a registry restored afterwards (and its module forgotten)."""
    before, modules = dict(robust.COMBINERS), set(sys.modules)
    yield
    robust.COMBINERS.clear()
    robust.COMBINERS.update(before)
    for name in set(sys.modules) - modules:
        if name.startswith("usercomb"):
            del sys.modules[name]


def _package(root: Path, name: str, source: str, monkeypatch) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "combine.py").write_text(source)
    monkeypatch.syspath_prepend(str(root))
    return root / name


def _cli(*sets: str):
    return runner.invoke(app, ["run", *(f"--set={s}" for s in sets)])


def test_a_reference_to_a_users_combiner_makes_the_runs_state(tmp_path, monkeypatch):
    """One round of FedIT through the CLI: the global B (zero at start) is half the weighted mean of
    the updates the user's combiner received; the mean (a lookup that fell back to it) is twice that."""
    record = tmp_path / "record.npz"
    _package(tmp_path / "src", "usercomb_ref", HALF.format(record=str(record)), monkeypatch)
    out = tmp_path / "runs"
    sets = [*TINY, "rounds=1", "train.local_steps=1", "federation.clients_per_round=2", f"output_dir={out}"]
    result = _cli(*sets, 'robust.aggregation="usercomb_ref.combine:half"')
    assert result.exit_code == 0, result.output
    (folder,) = out.iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rounds"] == 1 and summary["final_accuracy"] is not None

    seen = np.load(record)
    weights = seen["weights"]
    updates = [{k.split("/", 1)[1]: seen[k] for k in seen.files if k.startswith(f"{i}/")} for i in range(len(weights))]
    assert len(updates) == 2 and updates[0]
    mean = weighted_average(updates, weights)
    state = np.load(folder / "checkpoint.npz")
    b_keys = [k for k in mean if "lora_B" in k]
    assert b_keys
    for key in b_keys:
        assert np.abs(mean[key]).max() > 0
        np.testing.assert_allclose(state[f"global/{key}"], 0.5 * mean[key], rtol=1e-5, atol=1e-7)
        assert not np.allclose(state[f"global/{key}"], mean[key])  # the mean's state is not this one


def test_an_installed_packages_combiner_is_listed_with_its_source_and_resolves_by_name(tmp_path, monkeypatch):
    """The entry point as pip installs it: a ``.dist-info`` with ``entry_points.txt`` on sys.path."""
    _package(tmp_path, "usercomb_ep", HALF.format(record=""), monkeypatch)
    info = tmp_path / "usercomb_ep-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: usercomb-ep\nVersion: 0.2.0\n")
    (info / "entry_points.txt").write_text("[fedtune.combiners]\nhalf = usercomb_ep.combine\n")

    listed = runner.invoke(app, ["combiners"])
    assert listed.exit_code == 0, listed.output
    assert "half           half the weighted mean (source: usercomb_ep.combine)" in listed.output
    assert "median         per coordinate, the median (source: fedtune)" in listed.output

    run = resolve_run(load_config(None, [*TINY, 'robust.aggregation="half"', "robust.clip_update_norm=1"]))
    combine = run.aggregation.combiner
    assert type(combine).__name__ == "NormClipped" and type(combine.combiner).__module__ == "usercomb_ep.combine"
    update = {"w": np.array([2.0, -4.0], dtype=np.float32)}
    np.testing.assert_allclose(combine.combiner([update, update], [1, 3])["w"], [1.0, -2.0])  # the mean: [2, -4]
    assert WeightedMean()([update, update], [1, 3])["w"].tolist() == [2.0, -4.0]


IMPORT = "from fedtune.methods.base.robust import register_combiner\n"
NOT_A_FACTORY = IMPORT + "register_combiner('bad', lambda updates, weights: updates[0])\n"  # a combiner itself
MAKES_NO_COMBINER = IMPORT + "register_combiner('bad', lambda robust: 3)\n"
FACTORY_FAILS = IMPORT + "register_combiner('bad', lambda robust: 1 / 0)\n"
BAD = '"usercomb_err.combine:bad"'


@pytest.mark.parametrize(
    ("value", "source", "expected"),
    [
        ('"meen"', None, "robust.aggregation: unknown combiner 'meen'; expected one of"),
        ('"usercomb_err.combine:nope"', "", "robust.aggregation: unknown combiner 'usercomb_err.combine:nope'"),
        ('"no_such_pkg.mod:x"', None, "robust.aggregation: cannot import 'no_such_pkg.mod' (ModuleNotFound"),
        (BAD, NOT_A_FACTORY, "robust.aggregation: cannot import 'usercomb_err.combine' "),
        (BAD, MAKES_NO_COMBINER, "robust.aggregation: 'usercomb_err.combine:bad' made int"),
        (BAD, FACTORY_FAILS, "robust.aggregation: 'usercomb_err.combine:bad' failed (ZeroDivisionError"),
        ('"a b"', None, "robust.aggregation: expected mean, trimmed-mean, median"),
    ],
)
def test_a_wrong_combiner_is_one_line_naming_the_field_and_nothing_is_written(
    tmp_path, monkeypatch, value, source, expected
):
    if source is not None:
        _package(tmp_path / "src", "usercomb_err", source, monkeypatch)
    out = tmp_path / "runs"
    result = _cli(*TINY, f"robust.aggregation={value}", f"output_dir={out}")
    assert result.exit_code == 2, result.output
    lines = output_lines(result.output)
    assert len(lines) == 1 and lines[0].startswith("error: " + expected), result.output
    if source is NOT_A_FACTORY:
        assert "register_combiner('bad'): expected a factory taking the [robust] section" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["privacy.mode=central", "privacy.clip=1", "privacy.noise_multiplier=1"], "not with privacy.mode"),
        (["secure_aggregation.enabled=true", 'engine="flower-sim"'], "not with secure_aggregation.enabled"),
        (["method=fslora"], "method 'fslora' does not support it"),
    ],
)
def test_a_users_combiner_is_refused_where_the_robust_ones_are(tmp_path, monkeypatch, extra, expected):
    _package(tmp_path, "usercomb_refused", HALF.format(record=""), monkeypatch)
    config = [*TINY, "federation.clients_per_round=2", 'robust.aggregation="usercomb_refused.combine:half"', *extra]
    with pytest.raises(ConfigError, match=rf"^robust.aggregation: {expected}"):
        resolve_run(load_config(None, config))
    control = [c for c in config if "aggregation=" not in c]  # the same config with the mean resolves
    resolve_run(load_config(None, control))
