"""Client-level differential privacy for the weighted-sum methods: DP-FedAvg (McMahan, Ramage,
Talwar, Zhang, ICLR 2018), with adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS
2021) and the accountant of :mod:`fedtune.methods.base.accounting` (``[privacy]``,
:class:`fedtune.config.PrivacyConfig`).

The unit of privacy is a client (adjacency: :mod:`~fedtune.methods.base.accounting`). A
*mechanism* (one class per kind, :func:`mechanism_kind` picks it; its parameters checked and
calibrated once at resolve, :class:`PrivacyParams`; the server's instance built from them by
:class:`~fedtune.methods.base.aggregation.Aggregation`) owns everything private about a run: the
secret randomness, the sample, the clipping, the noise, the accountant and what the run may
release. A new mechanism is a subclass here, chosen in :func:`mechanism_kind`. Round t, with
q = m/N (m = ``federation.sample_size()``):

* sampling: each client joins the round independently with probability q (Poisson sampling, what
  the accountant models), drawn from the server's secret; the sample is never written or printed.
  A round aggregates whatever its sample returns (no retry: a resampled round would condition the
  sample), a missing reply counting as a zero update;
* :class:`CentralGaussian` (trusted server): the server clips each update to L2 norm C (the whole
  update, or each of its L arrays to C/sqrt(L) with ``privacy.per_layer``), sums, adds one draw
  xi ~ N(0, (zC)^2 I) and divides by the fixed m: Delta = (sum_i clip(Delta_i) + xi) / m
  (McMahan et al.'s fixed-denominator estimator; neither the replies' count nor their example
  counts, which would make the sensitivity depend on the data);
* :class:`AdaptiveClipGaussian` (``privacy.adaptive_clip``): as central, and C follows the
  ``target_quantile`` gamma of the update norms: b = (sum_i (1[||Delta_i|| <= C] - 1/2) + N(0,
  sigma_b^2)) / m + 1/2, C <- C exp(-eta (b - gamma)) (sigma_b default max(m/20, z)); the
  update's noise multiplier becomes z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2, so the pair of queries
  is one Gaussian of multiplier z (Andrew et al., Theorem 1) and the accountant is unchanged;
* :class:`SecureCentralGaussian` (``secure_aggregation.enabled`` with ``mode = "central"``):
  each client clips its own update before SecAgg+ masks it, the server adds xi to the secure sum.
  The server is trusted to add the noise, not with any individual update; the clients are trusted
  to clip (the masked sum cannot show a skipped clip). The clip is C minus SecAgg+'s rounding
  margin (:func:`quantization_margin`), so the quantized update stays within C;
* :class:`LocalGaussian` (untrusted server): each client clips its update and adds its own
  N(0, (zC)^2 I) before upload; the server sums the uploads over m. The server knows whom it
  asked, so each upload is accounted as a Gaussian of its own (q = 1) and the reported epsilon is
  the largest over clients. Its replies carry fixed metadata (``num_examples`` 1, no loss).

Secret randomness. Every draw comes from OS entropy (:func:`fresh_secret`; under SecAgg+ the mod's
stochastic rounding too, :func:`fedtune.engines.flower.clientapp.rounding_seed`), never from the config,
the run name or a message: the server's secret (sampling, central noise) lives in its checkpoint,
which is therefore private state to be kept like a key (resume stays bit-identical); a local-DP
client makes its own, kept in its persistent state (Flower: the node's memory; the embedded
engine's simulated clients: the checkpoint), and draws a fresh noise vector for every upload it
makes (a counter in that state), so a retry never reuses noise and a resumed round replays the
same one. ``privacy.insecure_reproducible_noise`` derives every secret from ``seed`` instead, for
tests only: it is not private, and a run with it reports epsilon = inf.

What a DP run releases (:attr:`Mechanism.releases`): the global arrays of every round, the server's
evaluation of them (post-processing), epsilon so far and, with adaptive clipping, C. Not the
sample, the replies' count, losses, bytes, timings or drop reasons of clients, nor the label
histograms (:mod:`fedtune.run`, :class:`fedtune.engines.rounds.RoundRecord`).

Dropouts: a dropped client's update is absent from the sum, the same as a zero update (norm 0 <= C)
with the denominator still m, so the guarantee holds as long as whether a client drops does not
depend on other clients' data.

Delta defaults to min(1/N^2, 1e-5) and must be below 1/N. ``privacy.epsilon`` calibrates z so that
epsilon after ``rounds`` releases is at most the target; ``privacy.epsilon_budget`` (and the target)
stop the run before a round whose epsilon would exceed it. Epsilon is the composition of the
:class:`~fedtune.methods.base.accounting.Ledger` (each release at its own z and q, in the
checkpoint), and a resume never changes z. Under local DP the server drops an upload beyond what a
clipped and noised one can be (:meth:`LocalGaussian.upload_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedtune.config import ConfigError, RunConfig
from fedtune.methods.base import accounting
from fedtune.methods.base.dp_primitives import (  # noqa: F401 - re-exported: clients and tests import them here
    clip,
    fresh_secret,
    gaussian_like,
    generator,
    l2_norm,
    poisson_sample,
    quantization_margin,
)

#: The cross-method option (fedtune.registry.CROSS_METHOD_OPTIONS) a method honours when its server
#: aggregates through BroadcastAverage (or, like FSLoRA and HeteroLoRA, puts each update in the
#: global shape with its norm kept and calls Aggregation.private_step) and its clients upload
#: through UpdateClient.upload.
PRIVACY_OPTIONS = ("privacy.mode",)
SAMPLE, NOISE, COUNT, UPLOAD = 1, 2, 3, 4  # the streams drawn from a secret
SECRET, UPLOADS = "dp_secret", "dp_uploads"  # a local-DP client's persistent state (uploads: [round, n])
NOT_PRIVATE = "privacy.insecure_reproducible_noise: noise and sample derive from the seed (tests only)"
#: local DP: the probability that the server drops an honest upload as beyond what a clipped and
#: noised one can be (:meth:`LocalGaussian.upload_bound`), and the relative rounding of the wire's
#: coarsest float (bfloat16's machine epsilon; float32's is 2^-23) the bound allows for
FALSE_DROP, WIRE_ROUNDING = 1e-9, 2.0**-7


class Mechanism:
    """One run's DP mechanism (see the module docstring): the noise multiplier, the secret sample,
    the aggregate, the accountant and the release count, the budget. Subclasses differ in where
    updates are clipped and noised."""

    mode = "central"
    clips_on_client = False  # the client clips before upload (and the server cannot check it)
    noises_on_client = False  # the client noises before upload (local DP)

    def __init__(self, params: PrivacyParams) -> None:
        self.C, self.per_layer = params.clip, params.per_layer
        self.N, self.m = params.num_clients, params.sample_size
        self.accountant, self.adjacency, self.delta = params.accountant, params.adjacency, params.delta
        self.budget, self.reproducible, self.seed, self.z = params.budget, params.reproducible, params.seed, params.z
        self.target, self.calibrated_for = params.target, params.calibrated_for
        self.secret = np.array([self.seed], dtype=np.uint32) if self.reproducible else fresh_secret()
        self.ledger = accounting.Ledger(self.N if self.noises_on_client else 1)  # what was released, at which z, q

    # -- accounting -------------------------------------------------------------------------------
    @property
    def rate(self) -> float:
        """The sampling rate the accountant amplifies by: q = m/N (local: 1)."""
        return 1.0 if self.noises_on_client else self.m / self.N

    @property
    def releases(self) -> np.ndarray:
        """(slots,) int64: the releases so far of the round's aggregate (central: one slot) or of
        each client's uploads (local), whatever z they were made at (read-only: :attr:`ledger`)."""
        return self.ledger.counts

    def epsilon(self, steps: int) -> float:
        """Epsilon after ``steps`` releases (rounds, or one client's uploads) at this run's z and q."""
        if self.reproducible and steps > 0:
            return math.inf
        return accounting.epsilon(self.accountant, self.adjacency, self.rate, self.z, int(steps), self.delta)

    def _composed(self, then: tuple[float, float] | None = None) -> float:
        """Epsilon of what the ledger holds (each release at its own z and q), plus ``then``."""
        if self.reproducible and (then is not None or self.releases.any()):
            return math.inf
        return self.ledger.epsilon(self.accountant, self.adjacency, self.delta, then)

    def spent(self) -> float:
        """Epsilon so far: the composition of what was released (:attr:`ledger`)."""
        return self._composed()

    def halt_before(self, rnd: int) -> str | None:
        """The one line that stops the run before round ``rnd``'s release would take epsilon past
        ``privacy.epsilon_budget`` or the target ``privacy.epsilon`` (the ledger's releases and one
        more at this z: also across resumes)."""
        ceilings = [(k, v) for k, v in (("epsilon_budget", self.budget), ("epsilon", self.target)) if v is not None]
        if not ceilings:
            return None
        after = self._composed((self.z, self.rate))
        key, ceiling = min(ceilings, key=lambda kv: kv[1])
        if after <= ceiling:
            return None
        return (
            f"privacy.{key}: stopped before round {rnd}, whose epsilon would be {after:.4g} > "
            f"{ceiling:g} (spent: {self.spent():.4g} at delta {self.delta:.3g})"
        )

    def asked(self, client_ids: list[int]) -> None:
        """Local DP: each client asked uploads once more (a fresh noise draw each time)."""
        if self.noises_on_client:
            self.ledger.record(self.z, self.rate, client_ids)

    def aggregated(self) -> None:
        """Central DP: the round's aggregate is one release."""
        if not self.noises_on_client:
            self.ledger.record(self.z, self.rate, [0])

    # -- the round ----------------------------------------------------------------------------------
    def sample(self, rnd: int, attempt: int = 0) -> list[int]:
        """Round ``rnd``'s clients: a Poisson sample of rate m/N from the server's secret."""
        return poisson_sample(self.N, self.m / self.N, generator(self.secret, SAMPLE, rnd, attempt))

    @staticmethod
    def client_release(
        params: PrivacyParams, update: Mapping[str, np.ndarray], state: dict, cid: int, rnd: int
    ) -> dict[str, np.ndarray]:
        """Client ``cid``'s upload in round ``rnd`` (``state``: its persistent state) under
        ``params``: its update as it is (the trusted server clips it). Static: a client holds no
        mechanism, only the run's parameters."""
        return dict(update)

    @staticmethod
    def upload_bound(params: PrivacyParams, d: int) -> float:
        """The largest L2 norm the server accepts in a training upload of ``d`` values under
        ``params``: any (a trusted server clips every update itself; under SecAgg+ it sees only the sum)."""
        return math.inf

    @staticmethod
    def secure_bound(params: PrivacyParams, size: int) -> float | None:
        """Under SecAgg+: the L2 bound a client clips its vector of ``size`` coordinates to before the
        mod quantizes it (None: none); ValueError where no bound can hold (one line)."""
        return None

    @classmethod
    def secure_release(cls, params: PrivacyParams, vector: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Under SecAgg+: the vector a client hands the mod to quantize and mask, from the one its
        method sums (:meth:`fedtune.protocol.client.Client.bound_secure_vector`): clipped to
        :meth:`secure_bound` (float64), or as it is."""
        bound = cls.secure_bound(params, sum(int(np.size(v)) for v in vector.values()))
        return dict(vector) if bound is None else clip(vector, bound, params.per_layer)

    def server_clip(self, update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """An update as the server sums it: clipped to C."""
        return clip(update, self.C, self.per_layer)

    def noise_std(self) -> float:
        """The std of the noise on the sum: zC."""
        return self.z * self.C

    def noised_mean(self, total: Mapping[str, np.ndarray], rnd: int) -> dict[str, np.ndarray]:
        """(sum + xi) / m, xi ~ N(0, noise_std^2) from the server's secret (float32)."""
        noise = gaussian_like(total, self.noise_std(), generator(self.secret, NOISE, rnd))
        return {k: ((np.asarray(v, np.float64) + noise[k]) / self.m).astype(np.float32) for k, v in total.items()}

    def aggregate(
        self, updates: Sequence[Mapping[str, np.ndarray]], rnd: int, like: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The round's update from the replies' updates (shaped like ``like``; none: noise alone)."""
        total = {k: np.zeros(np.shape(v), np.float64) for k, v in like.items()}
        for update in updates:
            for k, v in self.server_clip(update).items():
                total[k] += v
        return self.noised_mean(total, rnd)

    def metrics(self) -> dict[str, float]:
        """What a round's line may show of the mechanism: epsilon so far."""
        return {"epsilon": self.spent()}

    # -- state and report --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """The server's private state: its secret, the ledger of releases and (for readers) their counts."""
        return {
            "privacy_secret": self.secret.copy(),
            "privacy_ledger": self.ledger.rows.copy(),
            "privacy_releases": self.releases.copy(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (resume); ConfigError, one line, for a ledger that is damaged
        or whose releases used another z or q than this run's (``privacy.epsilon`` recalibrated
        for changed ``rounds``): a DP run never changes z on resume."""
        if "privacy_secret" in state:
            self.secret = np.asarray(state["privacy_secret"], dtype=np.uint32).copy()
        if "privacy_ledger" not in state:
            return
        try:
            self.ledger.load(state["privacy_ledger"])
        except ValueError as exc:
            raise ConfigError(f"--resume: the checkpoint's privacy_ledger is damaged ({exc})") from None
        if not np.array_equal(np.asarray(state.get("privacy_releases", self.releases)), self.releases):
            raise ConfigError("--resume: the checkpoint's privacy_releases disagree with its privacy_ledger")
        for z, q, n in self.ledger.released_at():
            if (z, q) != (self.z, self.rate):
                raise ConfigError(self._changed_z(z, q, n))

    def _changed_z(self, z: float, q: float, n: int) -> str:
        """The one line refusing a resume whose config gives another z (or q) than the releases'."""
        later = (self.calibrated_for or n) - n  # privacy.epsilon: the rounds today's z is calibrated for
        events = ((q, z, n), (self.rate, self.z, later))
        would = accounting.composed(self.accountant, self.adjacency, events, self.delta)
        return (
            f"--resume: this DP run released {n} times at noise multiplier z = {z:.4g} (rate {q:.4g}); the config "
            f"now gives z = {self.z:.4g} (rate {self.rate:.4g}; privacy.epsilon recalibrates z when rounds change) "
            f"and its releases would compose to epsilon {would:.4g}: a DP run keeps its z on resume, start a new run"
        )

    def report(self) -> dict[str, Any]:
        """``summary.json``'s ``privacy``."""
        return {
            "mode": self.mode,
            "epsilon": self.spent(),
            "delta": self.delta,
            "noise_multiplier": self.z,
            "clip": self.C,
            "per_layer": self.per_layer,
            "sampling": f"Poisson, rate {self.m / self.N:.6g} (secret)",
            "releases": int(self.releases.max()),
            "adjacency": self.adjacency,
            "accountant": accounting.describe(self.accountant, self.adjacency, self.mode),
            **({"not_private": NOT_PRIVATE} if self.reproducible else {}),
        }


class CentralGaussian(Mechanism):
    """Trusted server: it clips, sums and noises (module docstring)."""


class SecureCentralGaussian(Mechanism):
    """SecAgg+ with central noise: each client clips before masking, the server noises the sum."""

    mode = "central+secagg"
    clips_on_client = True

    @staticmethod
    def client_release(
        params: PrivacyParams, update: Mapping[str, np.ndarray], state: dict, cid: int, rnd: int
    ) -> dict[str, np.ndarray]:
        return {k: v.astype(np.float32) for k, v in clip(update, params.clip, params.per_layer).items()}

    @staticmethod
    def secure_bound(params: PrivacyParams, size: int) -> float | None:
        """C - mu, mu the rounding margin (:func:`quantization_margin`) of ``size`` coordinates at the
        worst step of any round (``params.quantization_step``): a vector clipped to it (in float64,
        so the mod rounds without float32 error) quantizes to norm at most C, and the secure sum
        moves by at most 2C when one client's data is replaced, as the accountant assumes. (A
        method's vector is its update placed in the global shape, norm kept: clipping it is
        clipping the update.) ValueError where the margin leaves no room (mu >= C)."""
        margin = quantization_margin(params.quantization_step, size, params.clip)
        if not margin < params.clip:
            raise ValueError(
                f"privacy.clip: C = {params.clip:g} is within SecAgg+'s rounding margin {margin:.3g} for "
                f"{size} coordinates (step {params.quantization_step:.3g}): raise "
                "secure_aggregation.quantization_range or lower secure_aggregation.clipping_range"
            )
        return params.clip - margin

    def server_clip(self, update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.float64) for k, v in update.items()}


class LocalGaussian(Mechanism):
    """Untrusted server: each client clips and noises its own upload from its own secret."""

    mode = "local"
    clips_on_client = noises_on_client = True

    @staticmethod
    def client_release(
        params: PrivacyParams, update: Mapping[str, np.ndarray], state: dict, cid: int, rnd: int
    ) -> dict[str, np.ndarray]:
        """clip(Delta) + N(0, (zC)^2), the noise drawn from the client's secret, the round and the
        uploads it already made in that round (a second upload in one round draws afresh; a round
        replayed from an earlier state replays its noise)."""
        if SECRET not in state:
            own = [params.seed, cid] if params.reproducible else fresh_secret()
            state[SECRET] = np.asarray(own, dtype=np.uint32)
        last, made = (int(x) for x in np.asarray(state.get(UPLOADS, [0, 0])))
        made = made + 1 if last == rnd else 0
        state[UPLOADS] = np.asarray([rnd, made], dtype=np.int64)
        clipped = clip(update, params.clip, params.per_layer)
        noise = gaussian_like(clipped, params.z * params.clip, generator(state[SECRET], UPLOAD, rnd, made))
        return {k: (clipped[k] + noise[k]).astype(np.float32) for k in update}

    @staticmethod
    def upload_bound(params: PrivacyParams, d: int) -> float:
        """(C + zC (sqrt(d) + t)) (1 + :data:`WIRE_ROUNDING`), t = sqrt(2 ln(1 / :data:`FALSE_DROP`)):
        an honest upload clip(Delta) + xi has norm at most C + ||xi||, and ||xi|| / (zC), a
        1-Lipschitz function of a standard Gaussian with mean at most sqrt(d), exceeds sqrt(d) + t
        with probability at most exp(-t^2 / 2) = FALSE_DROP (Gaussian concentration; Boucheron,
        Lugosi, Massart 2013, Theorem 5.6); the wire's rounding raises a norm by at most its
        relative error. Beyond it the upload is a hostile (or broken) client's: the server drops it
        (the server does not clip in local mode)."""
        t = math.sqrt(2 * math.log(1 / FALSE_DROP))
        return (params.clip + params.z * params.clip * (math.sqrt(d) + t)) * (1 + WIRE_ROUNDING)

    def server_clip(self, update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, np.float64) for k, v in update.items()}

    def noised_mean(self, total: Mapping[str, np.ndarray], rnd: int) -> dict[str, np.ndarray]:
        """sum / m: the uploads carry their noise."""
        return {k: (np.asarray(v, np.float64) / self.m).astype(np.float32) for k, v in total.items()}


class AdaptiveClipGaussian(Mechanism):
    """Central DP whose clip follows a quantile of the update norms (Andrew et al. 2021)."""

    mode = "central+adaptive-clip"

    def __init__(self, params: PrivacyParams) -> None:
        super().__init__(params)
        self.gamma, self.eta, self.sigma_b = params.target_quantile, params.clip_learning_rate, params.sigma_b
        self.z_update = (self.z**-2 - (2 * self.sigma_b) ** -2) ** -0.5

    def noise_std(self) -> float:
        return self.z_update * self.C

    def aggregate(
        self, updates: Sequence[Mapping[str, np.ndarray]], rnd: int, like: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """Clip at the current C, noise with z_Delta C, then move C toward the target quantile by
        the noised fraction of unclipped updates."""
        below = sum(l2_norm(u) <= self.C for u in updates) - len(updates) / 2
        combined = super().aggregate(updates, rnd, like)
        noised = (below + generator(self.secret, COUNT, rnd).normal(0.0, self.sigma_b)) / self.m + 0.5
        self.C *= math.exp(-self.eta * (noised - self.gamma))
        return combined

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "clip": self.C}

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**super().state_dict(), "privacy_clip": np.asarray(self.C, dtype=np.float64)}

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        if "privacy_clip" in state:
            self.C = float(np.asarray(state["privacy_clip"]))

    def report(self) -> dict[str, Any]:
        extra = {"target_quantile": self.gamma, "clip_learning_rate": self.eta, "clipped_count_stddev": self.sigma_b}
        return {**super().report(), "final_clip": self.C, "update_noise_multiplier": self.z_update, **extra}


@dataclass(frozen=True)
class PrivacyParams:
    """A run's ``[privacy]`` resolved once (:func:`privacy_params`): the mechanism's kind and every
    number it needs, the noise multiplier calibrated. No secret and no state: the server's
    :class:`Mechanism` is built from it (``params.kind(params)``), a client releases through
    ``params.kind.client_release``."""

    kind: type[Mechanism]
    clip: float
    per_layer: bool
    num_clients: int
    sample_size: int
    accountant: str
    adjacency: str
    delta: float
    budget: float | None
    reproducible: bool
    seed: int
    z: float
    target: float | None = None  # privacy.epsilon: z calibrated so that `calibrated_for` rounds reach it
    calibrated_for: int | None = None
    target_quantile: float = 0.5  # adaptive clipping (AdaptiveClipGaussian) only, these three
    clip_learning_rate: float = 0.2
    sigma_b: float = 0.0
    quantization_step: float = 0.0  # SecAgg+ with central DP (SecureCentralGaussian): the worst rounding step 2c/T


def mechanism_kind(config: RunConfig) -> type[Mechanism]:
    """The class of the run's mechanism (``privacy.mode`` not "none"): where a new one is chosen."""
    if config.privacy.mode == "local":
        return LocalGaussian
    if config.secure_aggregation.enabled:
        return SecureCentralGaussian
    return AdaptiveClipGaussian if config.privacy.adaptive_clip else CentralGaussian


def privacy_params(config: RunConfig) -> PrivacyParams | None:
    """The run's :class:`PrivacyParams` (None without ``privacy.mode``), or one line on a
    ``[privacy]`` that cannot run: a target epsilon no multiplier reaches, a budget below one
    round's epsilon, an adaptive clip whose count noise is too small. (The method's options
    without a DP form, and ``options.weighting = "examples"``, are rules of
    :data:`fedtune.config.RULES`.)"""
    p, fed = config.privacy, config.federation
    if p.mode == "none":
        return None
    kind = mechanism_kind(config)
    n, m = fed.num_clients, fed.sample_size()
    rate = 1.0 if kind.noises_on_client else m / n
    delta = p.delta if p.delta is not None else accounting.default_delta(n)
    if not delta < 1 / n:
        raise ConfigError(
            f"privacy.delta: {delta:g} is not below 1/num_clients = {1 / n:.3g} (publishing one random client's "
            "data whole is (0, 1/N)-DP: such a delta guarantees nothing)"
        )
    if p.clip is None or (p.noise_multiplier is None and p.epsilon is None):  # refused by PrivacyConfig._check
        raise ConfigError("privacy: a mode needs privacy.clip and privacy.noise_multiplier or privacy.epsilon")
    if p.noise_multiplier is not None:
        z = float(p.noise_multiplier)
    else:
        assert p.epsilon is not None  # narrowed: one of the two is set (checked above)
        try:
            z = accounting.calibrate(p.accountant, p.adjacency, rate, config.rounds, delta, p.epsilon)
        except ValueError as exc:
            raise ConfigError(f"privacy.epsilon: {exc}") from None
    if p.epsilon_budget is not None:
        one = accounting.epsilon(p.accountant, p.adjacency, rate, z, 1, delta)
        if one > p.epsilon_budget:
            raise ConfigError(
                f"privacy.epsilon_budget: {p.epsilon_budget:g} is below the epsilon of one round ({one:.4g})"
            )
    extra: dict[str, Any] = {}  # the kind's own numbers (PrivacyParams' fields of one kind of mechanism)
    if kind is AdaptiveClipGaussian:
        # Andrew et al.'s m/20, at least z (the update's noise then grows by at most 1/sqrt(3/4) = 1.15x)
        sigma_b = p.clipped_count_stddev if p.clipped_count_stddev is not None else max(m / 20, z)
        if not z < 2 * sigma_b:
            raise ConfigError(
                f"privacy.clipped_count_stddev: sigma_b = {sigma_b:g} must exceed z / 2 = {z / 2:g} "
                "(the count query takes that share of the noise; Andrew et al. 2021, Theorem 1)"
            )
        extra = {"target_quantile": p.target_quantile, "clip_learning_rate": p.clip_learning_rate, "sigma_b": sigma_b}
    if kind is SecureCentralGaussian:
        extra = {"quantization_step": config.secure_aggregation.step(n)}
    common = (float(p.clip), p.per_layer, n, m, p.accountant, p.adjacency, delta, p.epsilon_budget)
    calibrated_for = None if p.epsilon is None else config.rounds
    return PrivacyParams(
        kind, *common, p.insecure_reproducible_noise, config.seed, z, p.epsilon, calibrated_for, **extra
    )


def mechanism(config: RunConfig) -> Mechanism | None:
    """A fresh server mechanism of ``config`` (None without ``privacy.mode``)."""
    params = privacy_params(config)
    return None if params is None else params.kind(params)
