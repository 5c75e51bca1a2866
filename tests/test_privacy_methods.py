"""What client-level DP means for each method (fedtune.methods.base.privacy; the DP forms in the
docstrings of fedtune.methods.fslora and fedtune.methods.heterolora): FSLoRA's sketched uploads and
HeteroLoRA's zero-padded ones enter (sum_i P_i clip_C(U_i) + xi) / m through the real
Strategy.aggregate_fit, replacing one client moves that sum by at most 2C (checked on an adversarial
update, tight), FSLoRA's local-DP upload through the real Client.fit is its clipped k-rank slice plus
the N(0, (zC)^2) draw from its own secret, options without a DP form and every method without one refuse
``privacy.mode`` in one line."""

from __future__ import annotations

import numpy as np
import pytest

from fedtune.config import ConfigError, load_config
from fedtune.engines.embedded import exchange
from fedtune.methods import list_methods
from fedtune.methods.base.privacy import NOISE, PRIVACY_OPTIONS, UPLOAD, generator
from fedtune.protocol.messages import Message
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY, one_line_config_error, tiny

C, Z, R = 0.5, 1.3, 8
CENTRAL = ['privacy.mode="central"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
#: 4 clients, 3 sampled per round (m = 3, the fixed denominator); r = 8; k_i (FSLoRA) or r_i
#: (HeteroLoRA) = 4, 2, 8, 4
PROFILES = {
    "fslora": "federation.profiles=[{sketch_ratio=0.5},{sketch_ratio=0.25},{sketch_ratio=1.0},{sketch_ratio=0.5}]",
    "heterolora": "federation.profiles=[{rank=4},{rank=2},{rank=8},{rank=4}]",
}
SAMPLED, REPLIED = [0, 1, 3], [0, 3]  # client 1 dropped: the denominator stays m = 3


def _config(tmp_path, method, *extra):
    return load_config(
        None,
        [
            *TINY,
            f"method={method}",
            f"model.lora_rank={R}",
            "federation.clients_per_round=3",
            PROFILES[method],
            f"output_dir={tmp_path / 'runs'}",
            *extra,
        ],
    )


def _norm(arrays) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(v, dtype=np.float64))) for v in arrays.values())))


def _reply(sent: Message, spec, norm: float, rng) -> dict[str, np.ndarray]:
    """A reply to ``sent``: a random update of the shapes ``spec`` names, of L2 norm ``norm``, with
    FSLoRA's index set copied from what was sent."""
    update = {k: rng.normal(size=s.shape).astype(np.float32) for k, s in spec.items() if s.dtype == "float32"}
    scale = norm / _norm(update)
    update = {k: (v * scale).astype(np.float32) for k, v in update.items()}
    return {**update, **{k: sent.arrays[k] for k in spec if k not in update}}


def _ranks(method: str, sent: Message) -> np.ndarray:
    """The rank indices a client's upload covers, read directly: FSLoRA's sent index set I_i, or
    HeteroLoRA's leading 0..r_i-1."""
    if method == "fslora":
        return np.asarray(sent.arrays["sketch/index"], dtype=np.int64)
    return np.arange(int(sent.meta["rank"]))


def _placed(method: str, sent: Message, upload: dict[str, np.ndarray], shapes) -> dict[str, np.ndarray]:
    """P_i U_i, independently of the library: rows I of a zero (r, n) lora_A, columns I of a zero
    (m, r) lora_B, the head as is (float64)."""
    index, out = _ranks(method, sent), {}
    for k, shape in shapes.items():
        x = np.asarray(upload[k], dtype=np.float64)
        if ".lora_A." in k:
            out[k] = np.zeros(shape)
            out[k][index, :] = x
        elif ".lora_B." in k:
            out[k] = np.zeros(shape)
            out[k][:, index] = x
        else:
            out[k] = x
    return out


def _round(tmp_path, method, uploads, *extra, seed=11):
    """One round through the real configure_fit / aggregate_fit: clients 0, 1, 3 sampled, the
    uploads of clients 0 and 3 ({cid: norm} or {cid: arrays}) replied. Returns the strategy, the
    global state before, what was sent and the arrays replied."""
    strategy = RunContext(resolve_run(_config(tmp_path, method, *CENTRAL, f"seed={seed}", *extra))).strategy()
    strategy.initialize()
    before = {k: v.copy() for k, v in strategy.global_arrays.items()}
    sent = strategy.configure_fit(1, SAMPLED)
    rng = np.random.default_rng(5)
    arrays = {
        cid: u if isinstance(u, dict) else _reply(sent[cid], strategy.reply_spec(1, cid, sent[cid]), u, rng)
        for cid, u in uploads.items()
    }
    metrics = strategy.aggregate_fit(1, {cid: Message(a, {"num_examples": 10 + cid}) for cid, a in arrays.items()})
    return strategy, before, sent, arrays, metrics


@pytest.mark.parametrize("method", ["fslora", "heterolora"])
def test_central_aggregate_is_the_placed_clipped_sum_plus_one_noise_draw_over_m(tmp_path, method):
    """theta + (P_0 clip_C(U_0) + P_3 U_3 + xi) / 3 with xi ~ N(0, (zC)^2) on every coordinate of the
    rank-r state (the seeded draw): client 0's upload of norm 10C enters with norm C, client 3's
    (C/2) as is. Fails when the server skips the clip, divides by the 2 replies, weighs by examples,
    multiplies the placed slices by r/k, places them at the wrong ranks, or noises only the active
    coordinates."""
    strategy, before, sent, arrays, metrics = _round(tmp_path, method, {0: 10 * C, 3: C / 2})
    shapes = {k: v.shape for k, v in before.items()}
    assert len(_ranks(method, sent[0])) == 4 and len(_ranks(method, sent[1])) == 2  # k_i < r
    p0, p3 = (_placed(method, sent[c], arrays[c], shapes) for c in REPLIED)
    rng = generator(strategy.aggregation.privacy.secret, NOISE, 1)  # the server's secret: an insider's view
    noise = {k: rng.normal(0.0, Z * C, size=shapes[k]) for k in sorted(shapes)}
    for k in before:
        expected = before[k] + (p0[k] * (C / _norm(p0)) + p3[k] + noise[k]) / 3
        np.testing.assert_allclose(strategy.global_arrays[k], expected, rtol=1e-5, atol=1e-6)
    assert metrics["epsilon"] == pytest.approx(strategy.aggregation.privacy.epsilon(1)) and metrics["epsilon"] > 0
    assert strategy.summary()["privacy"]["releases"] == 1


@pytest.mark.parametrize("method", ["fslora", "heterolora"])
def test_replacing_one_client_moves_the_noiseless_aggregate_by_at_most_2C_over_m(tmp_path, method):
    """Replace-one sensitivity, on the real aggregate_fit: two runs with the same seed and the
    test-only reproducible noise (the same noise draw, which cancels in the difference) differ only
    in client 0's upload, U_0 of norm 50C and the adversarial U_0' = -3 U_0 (norm 150C, the
    opposite direction): their states differ by
    exactly 2C / m (clip(U_0') = -clip(U_0)), the sum's sensitivity 2C that the accountant assumes
    (multiplier z/2). Fails when the server skips the clip (100C), applies a factor r/k_0 = 2 after
    the clip (clipping the upload before an r/k scale: 4C), or divides by the 2 replies instead of
    m = 3."""
    same = "privacy.insecure_reproducible_noise=true"
    _, before, sent, arrays, _ = _round(tmp_path, method, {0: 50 * C, 3: C}, same)
    adversarial = {k: (-3 * v if v.dtype.kind == "f" else v) for k, v in arrays[0].items()}
    first, *_ = _round(tmp_path, method, arrays, same)
    second, *_ = _round(tmp_path, method, {0: adversarial, 3: arrays[3]}, same)
    moved = _norm({k: first.global_arrays[k].astype(np.float64) - second.global_arrays[k] for k in before})
    assert moved <= 2 * C / 3 * (1 + 1e-4)
    assert moved >= 2 * C / 3 * (1 - 1e-4)  # the bound is attained: it is the sensitivity, not a loose one


def test_fslora_noise_is_zC_over_m_on_every_coordinate_of_the_rank_r_state(tmp_path):
    """Central: with zero uploads the state moves by xi / m; its empirical std over 8 rounds of the
    tiny adapter (about 17000 draws, relative standard error 0.55 %) is z C / m within 3 %, on the
    sketched ranks and on those no replying client drew alike. Noise per client (sqrt(2) z C / m),
    over the replies (z C / 2) or only on the active ranks would fail."""
    strategy = RunContext(resolve_run(_config(tmp_path, "fslora", *CENTRAL))).strategy()
    strategy.initialize()
    drawn, idle = [], []
    for rnd in range(1, 9):
        before = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
        sent = strategy.configure_fit(rnd, SAMPLED)
        replies = {}
        for cid in REPLIED:
            spec = strategy.reply_spec(rnd, cid, sent[cid])
            zeros = {k: np.zeros(s.shape, np.float32) for k, s in spec.items() if s.dtype == "float32"}
            replies[cid] = Message({**zeros, "sketch/index": sent[cid].arrays["sketch/index"]}, {"num_examples": 1})
        strategy.aggregate_fit(rnd, replies)
        moved = {k: strategy.global_arrays[k] - v for k, v in before.items()}
        drawn.append(np.concatenate([v.ravel() for v in moved.values()]))
        active = np.union1d(sent[0].arrays["sketch/index"], sent[3].arrays["sketch/index"])
        rest = np.setdiff1d(np.arange(R), active)
        idle += [moved[k][rest, :].ravel() for k in moved if ".lora_A." in k]
    drawn = np.concatenate(drawn)
    assert drawn.size > 15000
    assert np.std(drawn) == pytest.approx(Z * C / 3, rel=0.03)
    assert abs(np.mean(drawn)) < 4 * Z * C / 3 / np.sqrt(drawn.size)
    idle = np.concatenate(idle)
    assert idle.size > 1000 and np.std(idle) == pytest.approx(Z * C / 3, rel=0.1)


def test_fslora_local_upload_through_client_fit_is_its_clipped_slice_plus_its_own_noise(tmp_path):
    """Local DP on the real FSLoRAClient.fit: the upload holds only the k = 4 active ranks
    ((m, k) / (k, n)), and minus the draw N(0, (zC)^2) from the client's own secret (kept in its
    persistent state; round 1, its first upload) it is the
    trained update clipped to norm C exactly (training moves the adapter by far more than C =
    1e-3); its empirical std (about 1000 coordinates) is z C within 10 %. Fails when the client
    skips the clip, noises before clipping, scales the noise by r/k or 1/m, or uploads dense."""
    c, z = 1e-3, 2.0
    local = ['privacy.mode="local"', f"privacy.clip={c}", f"privacy.noise_multiplier={z}", "seed=3"]
    config = _config(tmp_path, "fslora", *local, "train.lr=0.01")
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    strategy = server.strategy()
    strategy.initialize()
    sent = strategy.configure_fit(1, [0])[0]
    client = clients.client(0, {})
    reply = exchange(sent, client.fit)[0]
    upload = {k: np.asarray(v, dtype=np.float64) for k, v in reply.arrays.items() if not k.startswith("sketch/")}
    for k, v in upload.items():
        full = strategy.global_arrays[k].shape
        assert v.shape == ((4, full[1]) if ".lora_A." in k else (full[0], 4) if ".lora_B." in k else full)
    rng = generator(client.state["dp_secret"], UPLOAD, 1, 0)
    noise = {k: rng.normal(0.0, z * c, size=upload[k].shape) for k in sorted(upload)}
    assert _norm({k: upload[k] - noise[k] for k in upload}) == pytest.approx(c, rel=1e-3)
    values = np.concatenate([v.ravel() for v in upload.values()])
    assert values.size > 900 and np.std(values) == pytest.approx(z * c, rel=0.1)
    # the server adds the uploads as they are, over m (no second clip, no second noise)
    before = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    strategy.aggregate_fit(1, {0: reply})
    placed = _placed("fslora", sent, upload, {k: v.shape for k, v in before.items()})
    for k in before:
        np.testing.assert_allclose(strategy.global_arrays[k], before[k] + placed[k] / 3, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ('options.padding="coverage"', "options.padding: not with privacy.mode"),
        ('options.weighting="sparsity"', "options.weighting: not with privacy.mode"),
        ('options.weighting="examples"', 'options.weighting: "examples" is not DP'),
        ('options.aggregate="modules"', "options.aggregate: not with privacy.mode"),
        ("options.self_pruning=true", "options.self_pruning: not with privacy.mode"),
    ],
)
def test_heterolora_options_without_a_dp_form_refuse_privacy_in_one_line(tmp_path, option, message):
    assert one_line_config_error(lambda: resolve_run(_config(tmp_path, "heterolora", *CENTRAL, option))).startswith(
        message
    )


def test_fslora_examples_weighting_refuses_privacy_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r'^options.weighting: "examples" is not DP'):
        resolve_run(_config(tmp_path, "fslora", *CENTRAL, 'options.weighting="examples"'))


WITHOUT_DP = sorted(m.name for m in list_methods() if not set(PRIVACY_OPTIONS) <= m.honours)


def test_the_methods_with_a_dp_form_are_the_weighted_sums_and_fslora():
    """FlexLoRA's SVD and FedStackLoRA's merge are among those without: their server step is not a
    sum of clipped updates."""
    assert {"flexlora", "fedstacklora"} <= set(WITHOUT_DP)
    with_dp = {m.name for m in list_methods() if set(PRIVACY_OPTIONS) <= m.honours}  # now: other tests register toys
    assert with_dp == {"fedavg", "fedit", "fslora", "heterolora"}


@pytest.mark.parametrize("method", WITHOUT_DP)
@pytest.mark.parametrize("mode", ["central", "local"])
def test_every_method_without_a_dp_form_refuses_privacy_in_one_line_naming_it(tmp_path, method, mode):
    from fedtune.methods import get_method

    kind = get_method(method).supported_tasks()[0]
    dp = [f'privacy.mode="{mode}"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
    with pytest.raises(ConfigError) as err:
        resolve_run(tiny(tmp_path, method, kind, *dp))
    assert str(err.value).startswith(f"privacy.mode: method {method!r} does not support it")
    assert "\n" not in str(err.value)


def test_every_rounds_printed_line_carries_epsilon_so_far(tmp_path):
    """The round line of ``fedtune run`` (fedtune.progress.RoundPrinter) shows the epsilon spent,
    as metrics.jsonl does; a run without DP shows none."""
    from rich.console import Console

    from fedtune.engines.rounds import RoundRecord
    from fedtune.progress import RoundPrinter

    console = Console(record=True, width=300)
    printer = RoundPrinter(console, _config(tmp_path, "fslora", *CENTRAL))
    printer(RoundRecord(1, [0, 3], {"train_loss": 0.5, "epsilon": 1.23456}))
    printer(RoundRecord(2, [0, 3], {"train_loss": 0.5}))
    secret = RoundRecord(3, [0, 3], {"train_loss": 0.5, "epsilon": 2.5, "accuracy": 0.5}, {0: 999}, private=True)
    secret.dropped = {3: "timeout"}
    printer(secret)
    first, second, third = console.export_text().splitlines()
    assert first.rstrip().endswith("epsilon 1.235") and "epsilon" not in second
    # a DP round's line shows what the mechanism releases, nothing per client (loss, sample, MB, drops)
    assert third.split() == ["round", "3/2", "acc", "50.00%", "epsilon", "2.5"]


@pytest.mark.parametrize("method", ["fslora", "heterolora"])
@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_dp_run_end_to_end_reports_the_accountants_epsilon(tmp_path, method, mode):
    """run_experiment on the tiny config (heterogeneous ranks or sketch ratios, 2 of 3 clients a
    round, 2 rounds): central counts the 2 aggregated rounds, local the most rounds any client was
    sampled in (the server's private release counts, in its checkpoint); every metrics line carries
    epsilon so far."""
    import json
    from pathlib import Path

    from fedtune.checkpoint import load_state
    from fedtune.methods.base.privacy import mechanism
    from fedtune.run import run_experiment

    dp = [f'privacy.mode="{mode}"', f"privacy.clip={C}", f"privacy.noise_multiplier={Z}"]
    config = tiny(tmp_path, method, "text-classification", *dp)
    summary = run_experiment(config)
    lines = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    counts = load_state(Path(summary["run_dir"]) / "checkpoint.npz")["privacy_releases"]
    steps = len(lines) if mode == "central" else int(counts.max())
    assert counts.shape == ((1,) if mode == "central" else (3,))
    assert summary["privacy"]["releases"] == steps and summary["privacy"]["mode"] == mode
    assert summary["privacy"]["epsilon"] == pytest.approx(mechanism(config).epsilon(steps))
    assert lines[-1]["epsilon"] == pytest.approx(summary["privacy"]["epsilon"])
    # central: round 1 is a release; local: the secret Poisson sample may hold nobody in round 1
    # (probability (1/3)^3), so its epsilon may still be 0 then, and it never decreases
    assert lines[0]["epsilon"] > 0 if mode == "central" else 0 <= lines[0]["epsilon"] <= lines[-1]["epsilon"]
