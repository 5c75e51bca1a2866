"""SecAgg+'s stochastic rounding under DP (issue 48): the quantized update stays within the clip C,
so the secure sum's sensitivity is the 2C the accountant assumes, and the rounding draws from secret
randomness. Through Flower's ClientApp with Flower's own ``secaggplus_mod`` (its ``quantize``
recorded, not replaced) and fedtune's ServerApp on the in-process Grid of tests/test_flower.py.

The adversary's update has every coordinate equal and just above a grid point of the quantizer,
and the rounding draws are forced to their largest value, so every coordinate rounds up by almost
a whole step s: the quantized norm reaches ||v|| + s sqrt(d), the worst case the clip's margin
(``fedtune.methods.base.privacy.quantization_margin``) is sized for."""

from __future__ import annotations

import hashlib
import importlib
import math
from pathlib import Path

import numpy as np
import pytest
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from fedtune.config import ConfigError
from fedtune.engines.flower.clientapp import check_setup, make_client_app
from fedtune.engines.flower.serverapp import serve
from fedtune.methods.base import privacy
from fedtune.methods.base.averaging import UpdateClient
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import tiny
from tests.test_flower import LoopbackGrid, task_identity  # noqa: F401 - fixture

MOD = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
KIND = "text-classification"
RANGE, T = 0.5, 2**12  # a coarse step s = 2c/T = 2.4e-4, so the rounding's lift s sqrt(d) is 0.008 at d = 1123
PRIVATE_SECURE = [
    "federation.clients_per_round=3",  # 3 of 3: every client sampled, so each run rounds the same 3 vectors
    "rounds=1",
    "seed=4",
    "secure_aggregation.enabled=true",
    f"secure_aggregation.clipping_range={RANGE}",
    f"secure_aggregation.quantization_range={T}",
    'engine="flower-sim"',
    'privacy.mode="central"',
    "privacy.noise_multiplier=1",
    "privacy.clip=1.0",  # the adversarial test sets its own
]


def _config(tmp_path: Path, *extra: str):
    return tiny(tmp_path, "fedit", KIND, *PRIVATE_SECURE, *extra)


@pytest.fixture
def quantized(monkeypatch):
    """Every vector Flower's mod quantizes: [(the float vector it got, its quantization dequantized)]."""
    out: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
    quantize = MOD.quantize

    def recording(parameters, clipping_range, target_range):
        ints = quantize(parameters, clipping_range, target_range)
        out.append((list(parameters), dequantize(ints, clipping_range, target_range)))
        return ints

    monkeypatch.setattr(MOD, "quantize", recording)
    return out


def _norm(arrays: list[np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays))


def _serve(config) -> None:
    serve(LoopbackGrid(make_client_app(config), 3), config, timeout=60)


def _adversarial_clip(tmp_path: Path) -> tuple[float, float, int]:
    """(C, s, d): a clip C at which an update of d equal coordinates, clipped to C - mu, sits
    0.001 of a step above a grid point of the quantizer (step s, range [-c, c])."""
    strategy = RunContext(resolve_run(_config(tmp_path))).strategy()
    strategy.initialize()
    d = sum(int(np.size(v)) for v in strategy.global_arrays.values())  # FedIT's secure vector: the update
    s = 2 * RANGE / T
    above = s * (round(1 / (math.sqrt(d) * s)) + 0.001)  # each coordinate: s (j + 0.001), about 1 / sqrt(d)
    # C - mu(C) = sqrt(d) * above, mu(C) = s sqrt(d) (1 + 1e-5) + 1e-6 C (quantization_margin)
    return (math.sqrt(d) * above + s * math.sqrt(d) * (1 + 1e-5)) / (1 - 1e-6), s, d


@pytest.mark.usefixtures("task_identity")
def test_a_quantized_update_stays_within_the_clip_when_every_coordinate_rounds_up(tmp_path, quantized, monkeypatch):
    """Every client uploads an update of norm far above C with all coordinates equal; the rounding
    draws are forced to their largest value (each coordinate rounds up). What the mod quantizes is
    float64, and its quantized form has norm at most C, within 1e-5 s sqrt(d) + 1e-6 C of it (the
    margin is tight); with the margin removed (the clip at C, as before issue 48) the same upload
    quantizes to C + 0.999 s sqrt(d)."""
    upload = UpdateClient.upload

    def constant(self, update, result, rnd=None, **meta):
        return upload(self, {k: np.ones_like(v) for k, v in update.items()}, result, rnd=rnd, **meta)

    monkeypatch.setattr(UpdateClient, "upload", constant)
    monkeypatch.setattr(np.random, "rand", lambda *shape: np.full(shape, np.nextafter(1.0, 0.0)))
    clip, s, d = _adversarial_clip(tmp_path / "initial")
    lift = s * math.sqrt(d)
    assert 0.005 < lift < 0.01 and 0.5 < clip < 2

    _serve(_config(tmp_path / "margin", f"privacy.clip={clip!r}"))
    assert len(quantized) == 3
    for vector, rounded in quantized:
        assert all(v.dtype == np.float64 for v in vector)  # the mod's arithmetic adds no float32 error
        assert clip - 2e-3 * lift < _norm(rounded) <= clip  # reached the worst case, and within C

    quantized.clear()  # control: the clip at C, no margin
    monkeypatch.setattr(privacy, "quantization_margin", lambda step, size, bound: 0.0)
    _serve(_config(tmp_path / "no-margin", f"privacy.clip={clip!r}"))
    assert len(quantized) == 3
    assert all(_norm(rounded) > clip + 0.99 * lift for _, rounded in quantized)


def _rounded(config, quantized) -> dict[str, list[np.ndarray]]:
    """One run of ``config``: the quantization of each vector the mod got, by the vector's digest."""
    quantized.clear()
    _serve(config)
    out = {}
    for vector, rounded in quantized:
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(v, np.float64).tobytes() for v in vector)).hexdigest()
        out[digest] = rounded
    return out


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(("extra", "secret"), [((), True), (("privacy.insecure_reproducible_noise=true",), False)])
def test_the_rounding_under_dp_draws_from_secret_randomness(tmp_path, quantized, extra, secret):
    """Two runs of one DP config round the same three vectors (round 1's updates, clipped: they
    depend on the seed alone) differently: the draws come from OS entropy, not from the seed, the
    round or the client. Control: the former public rule, seeded from (seed, round, client,
    attempt), which ``privacy.insecure_reproducible_noise`` (tests only) keeps, rounds them alike."""
    first = _rounded(_config(tmp_path / "first", *extra), quantized)
    second = _rounded(_config(tmp_path / "second", *extra), quantized)
    assert len(first) == 3 and first.keys() == second.keys()
    same = [all(np.array_equal(a, b) for a, b in zip(first[k], second[k], strict=True)) for k in first]
    assert same == [not secret] * 3


def test_a_setup_coarser_than_the_configs_worst_step_is_refused(tmp_path):
    """The client sized its margin for the run's worst step 2c/T (T lowered to (M - 1) // N for a
    sample of every client): a server's setup with a smaller T (a coarser step) is refused in one
    line; the run's own T and the lowered one pass."""
    config = _config(tmp_path)
    setup = {Key.STAGE: Stage.SETUP, Key.CLIPPING_RANGE: RANGE}
    check_setup(config, {**setup, Key.TARGET_RANGE: T})
    check_setup(config, {**setup, Key.TARGET_RANGE: config.secure_aggregation.target(3)})
    check_setup(config, {Key.STAGE: Stage.SHARE_KEYS})  # other stages carry no quantization
    with pytest.raises(ValueError, match=r"SecAgg\+ setup: quantization step .* coarser than this run's worst"):
        check_setup(config, {**setup, Key.TARGET_RANGE: T // 2})


@pytest.mark.usefixtures("task_identity")
def test_a_clip_within_the_rounding_margin_stops_in_one_line(tmp_path):
    """T = 16: the step 2c/T = 1/16 lifts 1,123 coordinates by up to 2.1 > C = 1, so no clip keeps the
    quantized update within C: the server stops at its first request, naming the field and the way
    out (every client would refuse the same with its reply)."""
    config = _config(tmp_path, "secure_aggregation.quantization_range=16")
    with pytest.raises(ConfigError) as stopped:
        _serve(config)
    assert str(stopped.value).startswith(
        "privacy.clip: C = 1 is within SecAgg+'s rounding margin 2.09 for 1123 coordinates (step 0.0625)"
    )
    assert str(stopped.value).endswith(
        "raise secure_aggregation.quantization_range or lower secure_aggregation.clipping_range"
    )
    assert "\n" not in str(stopped.value)
