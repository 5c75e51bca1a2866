"""The server's aggregation as parts (fedtune.methods.base.aggregation): planned once at resolve
(combiner, DP parameters, server optimizer), built once by the strategy, and secure aggregation
asked of the transport through its typed protocol."""

from __future__ import annotations

import pytest

from fedtune.config import load_config
from fedtune.config.aggregation import BUILTIN_AGGREGATIONS
from fedtune.engines.local import LocalTransport
from fedtune.engines.rounds import SecureTransport
from fedtune.methods.base import accounting
from fedtune.methods.base.privacy import AdaptiveClipGaussian, LocalGaussian, SecureCentralGaussian
from fedtune.methods.base.robust import COMBINERS, CoordinateMedian, NormClipped, TrimmedMean, WeightedMean, combiner
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY


def _config(tmp_path, *extra: str):
    return load_config(None, [*TINY, f"output_dir={tmp_path}", "federation.clients_per_round=3", *extra])


@pytest.mark.parametrize("mode", ["central", "local"])
def test_the_privacy_parameters_are_calibrated_once_at_resolve_and_the_strategy_builds_from_them(
    tmp_path, monkeypatch, mode
):
    """One calibration of z per resolution: the strategy's mechanism and a client's upload use the
    plan (before, the mechanism was built at resolve, again on the server and at every upload)."""
    calls = []
    calibrate = accounting.calibrate
    monkeypatch.setattr(accounting, "calibrate", lambda *a: calls.append(a) or calibrate(*a))
    context = RunContext(
        resolve_run(_config(tmp_path, f'privacy.mode="{mode}"', "privacy.clip=0.5", "privacy.epsilon=8"))
    )
    assert len(calls) == 1
    strategy = context.strategy()
    strategy.initialize()
    plan = context.run.aggregation
    assert strategy.aggregation.plan is plan and strategy.aggregation.privacy.z == plan.privacy.z
    sent = strategy.configure_fit(1, [0])
    reply = context.client(0).fit(sent[0])
    # released through the plan's mechanism: local DP hides the client's numbers, central does not
    assert (reply.meta["num_examples"] == 1 and "train_loss" not in reply.meta) == (mode == "local")
    strategy.aggregate_fit(1, {0: reply})
    assert len(calls) == 1


def test_the_plan_picks_the_mechanism_combiner_and_server_step_from_the_options(tmp_path):
    dp = ["privacy.clip=0.5", "privacy.noise_multiplier=1"]
    secure = ["secure_aggregation.enabled=true", 'engine="flower-sim"']
    kinds = {
        LocalGaussian: ['privacy.mode="local"', *dp],
        SecureCentralGaussian: ['privacy.mode="central"', *dp, *secure],
        AdaptiveClipGaussian: ['privacy.mode="central"', *dp, "privacy.adaptive_clip=true"],
    }
    for kind, extra in kinds.items():
        plan = resolve_run(_config(tmp_path, *extra)).aggregation
        assert plan.privacy.kind is kind and plan.secure == ("secure_aggregation.enabled=true" in extra)
    plan = resolve_run(
        _config(
            tmp_path,
            'robust.aggregation="median"',
            'server.optimizer="adam"',
            "server.lr=0.1",
        )
    ).aggregation
    assert plan.privacy is None and plan.combiner == CoordinateMedian()
    assert (plan.server.kind, plan.server.lr) == ("adam", 0.1)


def test_every_configurable_combiner_is_registered_and_clipping_wraps_it(tmp_path):
    own = {name for name, spec in COMBINERS.items() if spec.module.startswith("fedtune.")}
    assert own == set(BUILTIN_AGGREGATIONS)
    fed = _config(tmp_path, "robust.clip_update_norm=2", "robust.max_client_weight=0.5").robust
    assert combiner(fed) == NormClipped(2.0, WeightedMean(0.5))
    trimmed = _config(tmp_path, 'robust.aggregation="trimmed-mean"', "robust.trim_fraction=0.2").robust
    assert combiner(trimmed) == TrimmedMean(0.2)


def test_secure_aggregation_is_a_transport_capability_the_protocol_declares():
    from fedtune.engines.flower.secagg import SecAggPlusTransport

    assert issubclass(SecAggPlusTransport, SecureTransport)
    assert not isinstance(LocalTransport(lambda cid, state: None, 0), SecureTransport)
