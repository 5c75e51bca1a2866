"""A DP run across resumes (fedtune.fingerprint, fedtune.methods.base.accounting.Ledger): a resume
never replays the run's secret noise on other inputs (a difference attack), and epsilon is the
composition of what was released, each release at its own noise multiplier, never re-derived from
today's config. Each test has a control that shows it can fail."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedtune.checkpoint import load_state
from fedtune.config import ConfigError
from fedtune.fingerprint import PARTS, changed_inputs, digest, keyed
from fedtune.methods.base.privacy import mechanism
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import one_line_config_error, tiny

KIND = "text-classification"
CENTRAL = ['privacy.mode="central"', "privacy.clip=0.05", "privacy.noise_multiplier=0.8"]
WORDS = ("good", "bad", "fine", "poor", "great", "awful", "nice", "dull")


def write_rows(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return path


def text_data(folder: Path, last_row: str = "a plain short row") -> list[str]:
    """A train file of 40 short rows (its last one ``last_row``) and a test file of 20: the overrides naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    train = [(f"{WORDS[i % 8]} {WORDS[(3 * i) % 8]} movie {i}", "ab"[i % 2]) for i in range(39)]
    test = [(f"{WORDS[(5 * i) % 8]} film {i}", "ab"[i % 2]) for i in range(20)]
    write_rows(folder / "train.jsonl", [*train, (last_row, "b")])
    write_rows(folder / "test.jsonl", test)
    return [f"data.name={folder / 'train.jsonl'}", f"data.test_path={folder / 'test.jsonl'}"]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run folder, byte for byte (a refusal must change none)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_dp_resume_on_changed_client_data_is_refused_in_one_line_and_writes_nothing(tmp_path):
    """One round of a central-DP run, then one training row's text changes under the same path
    (label kept: the partition is the same): --resume stops in one line naming exactly the client
    holding that row, and the folder is byte-identical. Control: the original file restored, the
    same resume runs (the refusal is the data's doing)."""
    data = text_data(tmp_path / "data")
    config = tiny(tmp_path, "fedit", KIND, *CENTRAL, *data, "rounds=1", "name=dp")
    run_dir = Path(run_experiment(config)["run_dir"])
    before = snapshot(run_dir)
    holder = [c for c, idx in enumerate(RunContext(resolve_run(config)).partitions) if 39 in idx]
    resumed = tiny(tmp_path, "fedit", KIND, *CENTRAL, *data, "rounds=2", "name=dp")

    text_data(tmp_path / "data", last_row="an entirely different row of text")
    message = one_line_config_error(lambda: run_experiment(resumed, resume=True))
    assert message.startswith("--resume: this DP run's inputs changed since its checkpoint: ")
    assert f"the data of client {holder[0]}. Resuming" in message and "the config" not in message
    assert snapshot(run_dir) == before

    text_data(tmp_path / "data")  # control: the inputs the checkpoint saw
    assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    run_experiment(resumed, resume=True)
    assert [json.loads(x)["round"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_fingerprints_are_keyed_private_and_name_every_part_that_changed(tmp_path):
    """The checkpoint holds HMACs under a fresh per-run key, not plain digests (a plain hash of a
    low-entropy file would confirm a guess at it); the digests of one config are the same in two
    processes' contexts (a resume on the same inputs is never refused: also the control that the
    comparison can match); and each part that differs is named."""
    from fedtune.fingerprint import input_digests
    from fedtune.run import _resumable_keys

    config = tiny(tmp_path, "fedit", KIND, *CENTRAL, "rounds=1")
    run_dir = Path(run_experiment(config)["run_dir"])
    recorded = load_state(run_dir / "checkpoint.npz")["_inputs"]
    assert set(recorded) == {"key", *PARTS} and recorded["clients"].shape == (3, 32)

    def digests():
        context = RunContext(resolve_run(config))
        strategy = context.strategy()
        strategy.initialize()
        return input_digests(context, strategy, _resumable_keys(config))

    now = digests()
    assert now == digests()
    assert changed_inputs(recorded, now) == []
    plain = np.frombuffer(now["clients"][0], np.uint8)
    assert not np.array_equal(recorded["clients"][0], plain)  # keyed: not the data's plain SHA-256
    assert not np.array_equal(keyed(now, recorded["key"] ^ 1)["clients"], recorded["clients"])

    other = {**now, "clients": [now["clients"][0], digest("x", {}), now["clients"][2]], "base": [digest("y", {})]}
    other["config"] = [digest({"seed": 1}, {})]
    assert changed_inputs(recorded, other) == ["the config", "the data of client 1", "the base model"]


def test_a_dp_resume_that_would_recalibrate_z_is_refused_with_the_true_epsilon(tmp_path):
    """Issue 48's probe: 2 rounds at privacy.epsilon = 8 (q = 1, delta 1e-5: z = 1.699), then a
    resume to 4 rounds, whose config recalibrates z to 2.403. Before, the resume ran and reported
    6.72 then 7.99 while what was released composes to 10.24; with epsilon_budget = 9 resumed to 6
    rounds it ran every round (true: 10.93). Now a DP run keeps its z: the resume is refused in one
    line stating both z and the true composition, nothing written. Control: the unchanged config
    resumes (its z is the releases')."""
    every = ["federation.num_clients=4", "federation.clients_per_round=4", 'privacy.mode="central"', "privacy.clip=1"]
    dp = [*every, "privacy.epsilon=8", "privacy.epsilon_budget=9", "name=probe"]
    run_dir = Path(run_experiment(tiny(tmp_path, "fedit", KIND, *dp, "rounds=2"))["run_dir"])
    before = snapshot(run_dir)
    for rounds, true_epsilon in ((4, "10.24"), (6, "10.93")):
        resumed = tiny(tmp_path, "fedit", KIND, *dp, f"rounds={rounds}")
        message = one_line_config_error(lambda: run_experiment(resumed, resume=True))  # noqa: B023
        assert message.startswith("--resume: this DP run released 2 times at noise multiplier z = 1.699")
        assert f"now gives z = {mechanism(resumed).z:.4g}" in message and f"epsilon {true_epsilon}" in message
        assert snapshot(run_dir) == before
    summary = run_experiment(tiny(tmp_path, "fedit", KIND, *dp, "rounds=2"), resume=True)  # control
    assert summary["privacy"]["epsilon"] == pytest.approx(7.992, abs=1e-3)


def _pld(*events: tuple[float, int], delta: float = 1e-5) -> float:
    """dp-accounting's PLD epsilon (replace-one, q = 1) of n releases at z for each (z, n), composed here."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    tracker = PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-3)
    for z, n in events:
        tracker.compose(dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(z)), n)
    return tracker.get_epsilon(delta)


def test_epsilon_composes_each_release_at_its_own_z_and_the_budget_prices_the_next(tmp_path):
    """A ledger of 2 releases at z = 1.699 and 2 at 2.403 (the probe's four rounds) reports their
    composition, 10.24, not 4 rounds at today's z (7.99, the former rule); a budget of 10.5 stops
    before a fifth release (10.24 + one at 2.403 > 10.5) and a target (privacy.epsilon) does the
    same. Control: with 10.24 < budget < the fifth's epsilon it would not stop before a fourth."""
    every = ["federation.num_clients=4", "federation.clients_per_round=4", 'privacy.mode="central"', "privacy.clip=1"]
    private = mechanism(tiny(tmp_path, "fedit", KIND, *every, "privacy.noise_multiplier=2.403"))
    private.ledger.record(1.699, 1.0, [0], times=2)
    private.ledger.record(2.403, 1.0, [0], times=2)
    true = _pld((1.699, 2), (2.403, 2))
    assert true == pytest.approx(10.24, abs=0.01) and private.spent() == pytest.approx(true, rel=1e-3)
    assert private.releases.tolist() == [4] and private.epsilon(4) == pytest.approx(7.99, abs=0.01)
    fifth = _pld((1.699, 2), (2.403, 3))
    private.budget = (true + fifth) / 2
    assert private.halt_before(5).startswith("privacy.epsilon_budget: stopped before round 5")
    private.budget, private.target = None, (true + fifth) / 2
    assert private.halt_before(5).startswith("privacy.epsilon: stopped before round 5")
    private.target = fifth + 0.01  # control
    assert private.halt_before(5) is None

    state = private.state_dict()  # the ledger round-trips through a checkpoint, and is checked
    fresh = mechanism(tiny(tmp_path, "fedit", KIND, *every, "privacy.noise_multiplier=2.403"))
    with pytest.raises(ConfigError, match="released 2 times at noise multiplier z = 1.699"):
        fresh.load_state_dict(state)
    with pytest.raises(ConfigError, match="privacy_ledger is damaged"):
        fresh.load_state_dict({**state, "privacy_ledger": -state["privacy_ledger"]})


def test_a_dp_resume_stops_before_the_release_that_would_cross_its_budget(tmp_path):
    """A fixed z = 1.699 (q = 1) and epsilon_budget = 9: two rounds (epsilon 7.99), then a resume to
    four stops before round 3 (its release would take epsilon to about 10.2), in one line, the
    restored ledger composed with one more release. Control: with budget 11 the same resume runs
    round 3 (and stops before round 4)."""
    every = ["federation.num_clients=4", "federation.clients_per_round=4", 'privacy.mode="central"', "privacy.clip=1"]

    def config(budget: float, rounds: int, name: str):
        dp = ["privacy.noise_multiplier=1.699", f"privacy.epsilon_budget={budget}", f"name={name}"]
        return tiny(tmp_path, "fedit", KIND, *every, *dp, f"rounds={rounds}")

    for budget, name, done in ((9, "tight", [1, 2]), (11, "loose", [1, 2, 3])):
        run_dir = Path(run_experiment(config(budget, 2, name))["run_dir"])
        summary = run_experiment(config(budget, 4, name), resume=True)
        assert summary["stopped"].startswith(f"privacy.epsilon_budget: stopped before round {done[-1] + 1}, whose ")
        assert "\n" not in summary["stopped"]
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [x["round"] for x in lines] == done and lines[-1]["epsilon"] <= budget
        assert summary["privacy"]["epsilon"] == pytest.approx(_pld((1.699, len(done))), rel=1e-3)
