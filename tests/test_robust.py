"""Robust aggregation (fedtune.methods.base.robust) and the hostile clients that test it: the
defining formulas on hand-computed cases, through the real FedIT / FedAvg aggregate_fit, and the
one-line refusals for the methods whose combination is not a weighted sum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedtune.config import ConfigError, load_config
from fedtune.engines.rounds import TRAIN, answer
from fedtune.methods.base.robust import bounded_weights, clip_update, combiner, trimmed_mean
from fedtune.protocol.messages import Message
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY


def fed(**options):
    return load_config(None, [*TINY, *(f"robust.{k}={v}" for k, v in options.items())]).robust


def test_clip_scales_the_whole_update_to_the_bound_and_leaves_a_smaller_one_alone():
    update = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}  # ||.|| = 5 over both
    clipped = clip_update(update, 1.0)
    np.testing.assert_allclose(clipped["a"], [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped["b"], [[0.8]], rtol=1e-6)  # per-array clipping would give 1.0 here
    assert clip_update(update, 5.0)["a"] is not None and np.array_equal(clip_update(update, 10.0)["a"], update["a"])


def test_weight_bound_moves_the_excess_to_the_others_in_proportion():
    np.testing.assert_allclose(bounded_weights([1e9, 1, 1, 1], 0.4), [0.4, 0.2, 0.2, 0.2])
    np.testing.assert_allclose(bounded_weights([5, 3, 1, 1], 0.4), [0.4, 0.36, 0.12, 0.12])
    np.testing.assert_allclose(bounded_weights([10, 9, 1], 0.4), [0.4, 0.4, 0.2])  # two over at once
    # capping the first pushes the second over: [.6, .35, .05] -> [.4, .525, .075] -> [.4, .4, .2]
    np.testing.assert_allclose(bounded_weights([6, 3.5, 0.5], 0.4), [0.4, 0.4, 0.2])
    np.testing.assert_allclose(bounded_weights([3, 1], 0.5), [0.5, 0.5])
    np.testing.assert_allclose(bounded_weights([1, 2, 3], 1.0), [1 / 6, 2 / 6, 3 / 6])  # no bound reached


def test_trimmed_mean_and_median_per_coordinate():
    values = [1.0, 2.0, 3.0, 100.0, -50.0]
    updates = [{"w": np.array([v, -v], np.float32)} for v in values]
    np.testing.assert_allclose(trimmed_mean(updates, 0.2)["w"], [2.0, -2.0])  # -50 and 100 cut, mean(1, 2, 3)
    np.testing.assert_allclose(trimmed_mean(updates, 0.0)["w"], [11.2, -11.2])  # no cut: the plain mean
    np.testing.assert_allclose(trimmed_mean(updates, 0.49)["w"], [2.0, -2.0])  # cut 2 a side: the median
    median = combiner(fed(aggregation='"median"'))(updates, [1e9, 1, 1, 1, 1])
    np.testing.assert_allclose(median["w"], [2.0, -2.0])  # unweighted: a claimed 1e9 examples changes nothing


def test_defaults_are_exactly_the_weighted_mean():
    rng = np.random.default_rng(0)
    updates = [{"w": rng.normal(size=(3, 4)).astype(np.float32)} for _ in range(3)]
    out = combiner(fed())(updates, [1, 2, 3])
    expected = (1 * updates[0]["w"] + 2 * updates[1]["w"] + 3 * updates[2]["w"]) / 6
    np.testing.assert_allclose(out["w"], expected, rtol=1e-6)


def _strategy(method: str, *extra: str):
    config = load_config(None, [*TINY, f"method={method}", "federation.num_clients=5", *extra])
    strategy = RunContext(resolve_run(config)).strategy()
    strategy.initialize()
    return strategy


@pytest.mark.parametrize("method", ["fedit", "fedavg"])
def test_aggregate_fit_applies_clip_bound_and_trim(method):
    """The real aggregate_fit: 5 replies (updates) with claimed sizes, one 100x too large and claiming
    1e6 examples; each option's global step equals the formula computed here."""
    rng = np.random.default_rng(1)
    options = {
        "none": ([], None),
        "clip": (["robust.clip_update_norm=0.5"], "clip"),
        "bound": (["robust.max_client_weight=0.3"], "bound"),
        "trim": (['robust.aggregation="trimmed-mean"', "robust.trim_fraction=0.2"], "trim"),
    }
    first = _strategy(method)
    sent = first.configure_fit(1, list(range(5)))[0]
    updates = [
        {k: rng.normal(scale=0.01, size=v.shape).astype(v.dtype) for k, v in sent.arrays.items()} for _ in range(5)
    ]
    updates[4] = {k: 100 * v for k, v in updates[4].items()}
    sizes = [10, 20, 30, 40, 1e6]
    replies = {c: Message(updates[c], {"num_examples": sizes[c], "train_loss": 0.5}) for c in range(5)}
    for name, (extra, kind) in options.items():
        strategy = _strategy(method, *extra)
        before = {k: v.copy() for k, v in strategy.global_arrays.items()}
        strategy.configure_fit(1, list(range(5)))
        strategy.aggregate_fit(1, replies)
        step = {k: strategy.global_arrays[k] - before[k] for k in before}
        if kind == "clip":
            us = [clip_update(u, 0.5) for u in updates]
            p = np.array(sizes) / sum(sizes)
        elif kind == "bound":
            us, p = updates, bounded_weights(sizes, 0.3)
        else:
            us, p = updates, np.array(sizes) / sum(sizes)
        for k in step:
            if kind == "trim":
                expected = np.sort(np.stack([u[k] for u in updates]), axis=0)[1:4].mean(axis=0)
            else:
                expected = sum(pi * u[k] for pi, u in zip(p, us))
            np.testing.assert_allclose(step[k], expected, rtol=1e-4, atol=1e-7, err_msg=f"{name} {k}")
        norm = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in step.values()))
        if kind == "clip":
            assert norm <= 0.5 + 1e-5  # every clipped update has norm <= C, so does their convex combination
        if kind is None:
            assert norm > 1.0  # the attacker's 100x update with its claimed weight dominates the plain mean


def _coordinate_median(stacked: np.ndarray) -> np.ndarray:
    """Python's statistics.median of each coordinate (an even count: the mean of the two middle values)."""
    import statistics

    return np.apply_along_axis(statistics.median, 0, stacked.astype(np.float64))


def _trim_mean_30(stacked: np.ndarray) -> np.ndarray:
    """scipy's trimmed mean at 0.3 (it cuts floor(0.3 n) a side: "slices off less if proportion
    results in a non-integer slice index")."""
    from scipy.stats import trim_mean

    return trim_mean(stacked.astype(np.float64), 0.3, axis=0)


@pytest.mark.parametrize(
    ("extra", "replies", "reference"),
    [
        (['robust.aggregation="trimmed-mean"', "robust.trim_fraction=0.3"], 5, _trim_mean_30),
        (['robust.aggregation="median"'], 4, _coordinate_median),
    ],
    ids=["trim-0.3-of-5", "median-of-4"],
)
def test_robust_combiners_where_rounding_and_parity_matter(extra, replies, reference):
    """The real aggregate_fit against independent references on the inputs where a plausible slip
    shows: 0.3 of 5 replies is 1.5 (floor cuts 1 a side and averages 3 values; ceil would cut 2,
    the median) and 4 replies have two middle values (their mean, not the upper one)."""
    rng = np.random.default_rng(3)
    strategy = _strategy("fedit", *extra)
    before = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    sent = strategy.configure_fit(1, list(range(replies)))[0]
    updates = [
        {k: rng.normal(scale=0.01, size=v.shape).astype(v.dtype) for k, v in sent.arrays.items()}
        for _ in range(replies)
    ]
    strategy.aggregate_fit(1, {c: Message(updates[c], {"num_examples": 10 + c}) for c in range(replies)})
    for k in before:
        expected = reference(np.stack([u[k] for u in updates]))
        np.testing.assert_allclose(strategy.global_arrays[k] - before[k], expected, rtol=1e-4, atol=1e-7, err_msg=k)


def test_a_hostile_profile_sign_flips_or_scales_its_update():
    config = load_config(
        None, [*TINY, "federation.num_clients=3", 'federation.profiles=[{}, {attack="sign-flip"}, {attack="scale"}]']
    )
    context = RunContext(resolve_run(config))
    strategy = context.strategy()
    strategy.initialize()
    clients = [context.client(c) for c in range(3)]
    messages = strategy.configure_fit(1, [0, 1, 2])
    honest = answer(clients[0], TRAIN, messages[0], config.seed, 1)
    again = {
        c: answer(
            RunContext(resolve_run(load_config(None, [*TINY, "federation.num_clients=3"]))).client(c),
            TRAIN,
            messages[c],
            config.seed,
            1,
        )
        for c in (1, 2)
    }
    flipped = answer(clients[1], TRAIN, messages[1], config.seed, 1)
    scaled = answer(clients[2], TRAIN, messages[2], config.seed, 1)
    assert honest.arrays
    for k in flipped.arrays:
        np.testing.assert_array_equal(flipped.arrays[k], -again[1].arrays[k])
        np.testing.assert_allclose(scaled.arrays[k], 100 * again[2].arrays[k], rtol=1e-6)
    assert flipped.meta == again[1].meta


@pytest.mark.parametrize(
    "method, task",
    [
        ("fslora", None),
        ("heterolora", None),
        ("flexlora", None),
        ("fedstacklora", None),
        ("commit", "instruction"),
        ("rabo", "few-shot"),
        ("bomm", "paired-multimodal"),
    ],
)
def test_methods_whose_combination_is_not_a_weighted_sum_refuse_the_options(method, task):
    """FSLoRA's sketched mean, HeteroLoRA's padding, FlexLoRA's SVD, the stacking, CoMMIT's schedule
    merge (weights it would keep using), RABO's bilevel step and BoMM's cloud are not a weighted sum
    of updates: one line naming the method and the option."""
    for option in ('aggregation="median"', "clip_update_norm=1.0", "max_client_weight=0.5"):
        config = load_config(None, [f"method={method}", *([f"task={task}"] if task else []), f"robust.{option}"])
        with pytest.raises(
            ConfigError, match=rf"^robust.{option.split('=')[0]}: method '{method}' does not support it"
        ):
            resolve_run(config)


def test_option_combinations_that_would_be_ignored_are_refused():
    with pytest.raises(ConfigError, match="robust.trim_fraction: applies to"):
        load_config(None, ["robust.trim_fraction=0.2"])
    with pytest.raises(ConfigError, match="robust.max_client_weight: bounds the weighted mean"):
        load_config(None, ['robust.aggregation="median"', "robust.max_client_weight=0.5"])
    with pytest.raises(ConfigError, match="robust.trim_fraction"):
        load_config(None, ['robust.aggregation="trimmed-mean"', "robust.trim_fraction=0.5"])


# -- the default screen against an outsized update ---------------------------------------------------
def test_outsized_updates_are_those_above_the_ratio_times_the_others_lower_median_or_the_sent_norm():
    """The reference is the larger of the other replies' lower median norm and the sent state's
    norm: one huge reply of two is caught (its own norm, or a mean, would raise the reference), so
    is a lone one (against what it was sent), a reply at the bound passes and one just above it does
    not, and a zero reference rejects nothing."""
    from fedtune.protocol.validation import outsized_updates

    def msg(*values):
        return Message({"a": np.array(values, dtype=np.float32)}, {})

    zeros = {c: msg(0.0) for c in range(3)}
    assert list(outsized_updates({0: msg(1.0), 1: msg(1e30)}, zeros, 1000)) == [1]
    lone = outsized_updates({1: msg(1e30)}, {1: msg(1.0)}, 1000)
    assert lone == {1: "update norm 1e+30 exceeds robust.max_update_ratio = 1000 times its reference 1"}
    assert outsized_updates({0: msg(3.0, 4.0)}, {0: msg(0.004, 0.003)}, 1000) == {}  # norm 5 = 1000 x 0.005
    assert list(outsized_updates({0: msg(3.0, 4.0)}, {0: msg(0.00399, 0.003)}, 1000)) == [0]
    assert outsized_updates({0: msg(0.0), 1: msg(0.0), 2: msg(5.0)}, zeros, 10) == {}
    three = {0: msg(1.0), 1: msg(2.0), 2: msg(2500.0)}  # the others' lower median 1 -> bound 1000
    assert list(outsized_updates(three, zeros, 1000)) == [2]
    assert outsized_updates(three, {c: msg(3.0) for c in range(3)}, 1000) == {}  # sent norm 3 -> bound 3000
    two_hostile = {0: msg(1.0), 1: msg(1.5), 2: msg(2.0), 3: msg(1e30), 4: msg(-1e30)}
    assert sorted(outsized_updates(two_hostile, {c: msg(0.0) for c in range(5)}, 1000)) == [3, 4]


def test_an_even_count_of_other_replies_takes_the_lower_of_the_two_middle_norms():
    """Five replies, two colluding at norm 3000 beside honest norms 1, 1 and 4 (ratio 1000): each
    colluder's other four norms are 1, 1, 4, 3000, whose lower middle value 1 bounds it at 1000
    (dropped); the upper one, 4, would let both through at 4000. The honest replies' references
    (lower middles of 1, 4, 3000, 3000 and of 1, 1, 3000, 3000) stay 4 and 1."""
    from fedtune.protocol.validation import outsized_updates

    def msg(norm):
        return Message({"a": np.array([0.6 * norm, 0.8 * norm], dtype=np.float32)}, {})

    replies = {0: msg(1.0), 1: msg(1.0), 2: msg(4.0), 3: msg(3000.0), 4: msg(3000.0)}
    out = outsized_updates(replies, {c: msg(0.0) for c in replies}, 1000)
    assert sorted(out) == [3, 4], out
    assert out[3] == "update norm 3e+03 exceeds robust.max_update_ratio = 1000 times its reference 1"


def test_a_huge_finite_update_is_dropped_by_default_and_the_run_goes_on(tiny_config):
    """One client times 1e30 (finite): under the default config it is dropped in every round with its
    reason, and the model stays usable (before, round 2's losses were all NaN and the run stopped).
    0 turns the screen off; under DP there is no screen (its clipping bounds updates)."""
    import json

    from fedtune.engines.rounds import RoundPolicy
    from fedtune.run import run_experiment

    hostile = 'federation.profiles=[{attack="scale", attack_scale=1e30}, {}, {}, {}]'
    summary = run_experiment(tiny_config(hostile, "rounds=3"))
    lines = [json.loads(x) for x in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert [line["round"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert list(line["dropped"]) == ["0"] and "exceeds robust.max_update_ratio" in line["dropped"]["0"]
        assert np.isfinite(line["loss"])
    assert RoundPolicy.of(tiny_config()).max_update_ratio == 1000
    assert RoundPolicy.of(tiny_config("robust.max_update_ratio=0")).max_update_ratio is None
    assert RoundPolicy.of(tiny_config(), private=True).max_update_ratio is None
    with pytest.raises(ConfigError, match="max_update_ratio"):
        tiny_config("robust.max_update_ratio=0.5")


def test_under_dp_the_round_loop_screens_nothing_and_clipping_bounds_the_huge_update(tiny_config):
    """The same client times 1e30 in a central-DP run (every client sampled: q = 1): the real round
    loop drops nobody, since whether a reply is outsized depends on the other clients' updates (a
    drop decided by others' data is not accounted), and the mechanism's clip (C = 0.5) bounds it:
    the state moves by a finite amount. A policy built as non-private drops client 0 each round."""
    from fedtune.run import run_experiment

    hostile = 'federation.profiles=[{attack="scale", attack_scale=1e30}, {}, {}, {}]'
    dp = ['privacy.mode="central"', "privacy.clip=0.5", "privacy.noise_multiplier=0.1"]
    records = []
    summary = run_experiment(
        tiny_config(hostile, *dp, "federation.clients_per_round=4"), on_round=lambda rec: records.append(rec)
    )
    assert [r.round for r in records] == [1, 2] and all(0 in r.clients for r in records)
    assert [dict(r.dropped) for r in records] == [{}, {}]
    assert np.isfinite(summary["final_loss"])


def test_the_screen_costs_an_honest_run_nothing(tiny_config):
    """An honest run with the default screen ends bit-identical to one without it."""
    from fedtune.checkpoint import load_state
    from fedtune.run import run_experiment

    runs = [run_experiment(tiny_config(f"name=r{r}", f"robust.max_update_ratio={r}")) for r in (1000, 0)]
    states = [load_state(Path(run["run_dir"], "checkpoint.npz")) for run in runs]
    assert all(not line for run in runs for line in [run["dropped"]])
    for key, value in states[0]["global"].items():
        assert np.array_equal(value, states[1]["global"][key]), key


def test_a_state_that_evaluates_to_a_non_finite_loss_is_never_checkpointed(tiny_config):
    """With the screen off, the 1e30 update is averaged in: the round is rejected on the server's
    evaluation (non-finite loss) before it is recorded, so no checkpoint holds the poisoned state
    (before, round 1 was checkpointed and every client failed on it in round 2)."""
    from fedtune.engines.rounds import RoundFailed
    from fedtune.run import run_experiment

    hostile = 'federation.profiles=[{attack="scale", attack_scale=1e30}, {}, {}, {}]'
    config = tiny_config(hostile, "robust.max_update_ratio=0", "name=poisoned")
    with pytest.raises(RoundFailed, match="round 1: the aggregated global state evaluates to a non-finite loss"):
        run_experiment(config)
    run_dir = Path(config.output_dir) / "poisoned"
    assert not (run_dir / "checkpoint.npz").exists() and (run_dir / "metrics.jsonl").read_text() == ""
