"""Client-level differential privacy for the weighted-sum methods: DP-FedAvg (McMahan, Ramage,
Talwar, Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018) with an
RDP accountant from Google's ``dp-accounting`` (``[privacy]``, :class:`fedtune.config.PrivacyConfig`).

The unit of privacy is a client: two federations are neighbours when one client's whole data set is
replaced by any other (replace-one; ``num_clients`` N is public).

Mechanism, round t, with the m = ``federation.sample_size()`` clients sampled uniformly without
replacement from the N (q = m/N, the seeded draw of :func:`fedtune.engines.rounds.sample_clients`):

* clipping: each update Delta_i -> Delta_i min(1, C / ||Delta_i||_2), the norm over all its arrays
  (``privacy.per_layer``: each of its L arrays clipped to C/sqrt(L), so the whole stays within C);
* central (trusted server): the server clips, sums, adds xi ~ N(0, (zC)^2 I) once to the sum and
  divides by the fixed denominator m = qN (McMahan et al.'s f_f estimator, Algorithm 1 with
  uniform weights w_k = 1 and W = m):
  Delta = (sum_i clip(Delta_i) + xi) / m. Not the number of replies (a dropout would then raise
  everybody's share, and the sensitivity with it), not the clients' example counts (a client's
  weight would depend on its data: ``options.weighting = "examples"`` is refused). The server
  clips (not the client) because the server is trusted in central DP and then a client that skips
  its clipping (faulty or hostile) cannot break the bound;
* local (untrusted server): each client clips and adds N(0, (zC)^2 I) to its own update before
  upload; the server averages the uploads the same way (sum / m).

Noise is drawn in float64 from ``numpy.random.default_rng([seed, round, NOISE_STREAM])`` (central)
or ``[seed, round, client, NOISE_STREAM]`` (local), array by array in sorted name order, so runs
and resumes are reproducible.

Accounting (``dp_accounting.rdp.RdpAccountant``, neighbouring relation REPLACE_ONE):

* central: replacing one client moves the sum of clipped updates by at most 2C, so each round is a
  Gaussian mechanism of noise multiplier z/2 relative to its sensitivity, on a sample of m of N
  drawn without replacement: ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z/2))``
  (Wang, Balle, Kasiviswanathan, "Subsampled Renyi DP and analytical moments accountant",
  AISTATS 2019, Theorem 27), composed once per aggregated round. This is the sampling fedtune
  actually does; McMahan et al.'s accounting assumes Poisson sampling with add/remove neighbours
  (multiplier z, not z/2), which would give a smaller epsilon but does not match a fixed-size
  sample, so it is not used.
* local: against the server, a client's upload is a Gaussian mechanism with multiplier z/2 (no
  amplification: the server knows whom it sampled), composed over the rounds that client was
  sampled in; the reported epsilon is the largest over clients. A retry of a round sends the same
  client the same round again, and its upload is the same (training and noise are seeded by
  (seed, round, client)), so a round counts once per client.

Dropouts: the accountant assumes every sampled client contributes. A dropped client's update is
simply absent from the sum, which is the same as that client contributing the zero vector (norm
0 <= C) while the denominator stays m; the sensitivity bound 2C and the sampling rate q are
unchanged, so the guarantee holds as long as whether a client drops does not depend on other
clients' data (crashes, deadlines, failures of its own). A retried round (fewer than
``federation.min_replies`` replies) releases no aggregate; its fresh sample is another uniform
draw. A reply rejected by validation because of its values (non-finite numbers) depends on that
client's own data only and is likewise its zero contribution.

Engines: the mechanism lives in the strategy and the clients, so it runs unchanged on every engine
(tests/test_flower_privacy.py). With ``federation.secure_aggregation`` (SecAgg+ on Flower) only
``local`` runs: each client clips and noises before masking (FSLoRA and HeteroLoRA then place or
pad the noised upload) and the server divides the masked sum by m; the accounting stays local
DP's, an upper bound, since the server sees only the noised sum (distributed DP's tighter
accounting is not claimed). ``central`` is refused there: its server
clips each update, which secure aggregation hides.

Delta defaults to 1/N^1.1 (N = ``num_clients``), below 1/N as it must be for a client-level
guarantee to mean anything. ``privacy.epsilon`` calibrates z by bisection so that epsilon after
``rounds`` rounds is at most the target; ``privacy.epsilon_budget`` stops the run before a round
whose epsilon would exceed it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np

from fedtune.config import ConfigError

NOISE_STREAM = 0xD9  # the last word of the noise generator's seed
ACCOUNTANT = "dp_accounting.rdp.RdpAccountant (REPLACE_ONE; central: SampledWithoutReplacement Gaussian)"
#: The cross-method option (fedtune.registry.CROSS_METHOD_OPTIONS) a method honours when its server
#: aggregates through BroadcastAverage (or, like FSLoRA and HeteroLoRA, puts each update in the
#: global shape with its norm kept and calls PrivateAverage.private_aggregate) and its clients upload
#: through UpdateClient.upload with the round.
PRIVACY_OPTIONS = ("privacy.mode",)


def default_delta(num_clients: int) -> float:
    """1 / N^1.1."""
    return float(num_clients) ** -1.1


@lru_cache(maxsize=4096)
def rdp_epsilon(mode: str, num_clients: int, sample_size: int, z: float, steps: int, delta: float) -> float:
    """Epsilon after ``steps`` releases (see the module docstring): central, a subsample of
    ``sample_size`` of ``num_clients`` without replacement with Gaussian multiplier z/2 per step;
    local, a plain Gaussian with multiplier z/2 per upload. 0 for no step."""
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    if steps <= 0:
        return 0.0
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    gaussian = dp_accounting.GaussianDpEvent(z / 2.0)  # the sum's replace-one sensitivity is 2C
    if mode == "central" and sample_size < num_clients:
        event = dp_accounting.SampledWithoutReplacementDpEvent(num_clients, sample_size, gaussian)
    else:
        event = gaussian
    accountant.compose(event, int(steps))
    return float(accountant.get_epsilon(delta))


def calibrate(mode: str, num_clients: int, sample_size: int, steps: int, delta: float, target: float) -> float:
    """The smallest noise multiplier z (to 0.1 %, by bisection) whose epsilon after ``steps`` is at
    most ``target``."""
    lo, hi = 1e-2, 1e4
    if rdp_epsilon(mode, num_clients, sample_size, hi, steps, delta) > target:
        raise ConfigError(f"privacy.epsilon: {target:g} is not reachable in {steps} rounds with any noise multiplier")
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if rdp_epsilon(mode, num_clients, sample_size, mid, steps, delta) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def clip(update: Mapping[str, np.ndarray], bound: float, per_layer: bool = False) -> dict[str, np.ndarray]:
    """``update`` (float64) scaled to L2 norm at most ``bound`` over all its arrays, or, with
    ``per_layer``, each of its L arrays to ``bound``/sqrt(L)."""
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in update.items()}
    if per_layer:
        each = bound / math.sqrt(len(arrays))
        return {k: v * min(1.0, each / max(float(np.linalg.norm(v)), 1e-300)) for k, v in arrays.items()}
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in arrays.values()))
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {k: v * scale for k, v in arrays.items()}


def gaussian_like(arrays: Mapping[str, np.ndarray], std: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """N(0, std^2) noise (float64) shaped like ``arrays``, drawn in sorted name order."""
    return {k: rng.normal(0.0, std, size=np.shape(arrays[k])) for k in sorted(arrays)}


class Privacy:
    """One run's DP-FedAvg: the mechanism and the accountant (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        p, fed = config.privacy, config.federation
        self.mode, self.C, self.per_layer, self.seed = p.mode, float(p.clip), p.per_layer, config.seed
        self.N, self.m = fed.num_clients, fed.sample_size()
        self.delta = p.delta if p.delta is not None else default_delta(self.N)
        self.budget = p.epsilon_budget
        if p.noise_multiplier is not None:
            self.z = float(p.noise_multiplier)
        else:
            self.z = calibrate(self.mode, self.N, self.m, config.rounds, self.delta, p.epsilon)
        if self.budget is not None and self.epsilon(1) > self.budget:
            raise ConfigError(
                f"privacy.epsilon_budget: {self.budget:g} is below the epsilon of one round ({self.epsilon(1):.4g})"
            )

    @property
    def sampling_rate(self) -> float:
        return self.m / self.N

    def epsilon(self, steps: int) -> float:
        """Epsilon after ``steps`` rounds (central) or uploads of one client (local)."""
        return rdp_epsilon(self.mode, self.N, self.m, self.z, int(steps), self.delta)

    def release(self, update: Mapping[str, np.ndarray], rnd: int, cid: int) -> dict[str, np.ndarray]:
        """A client's upload: its update as it is (central), or clipped plus N(0, (zC)^2) (local)."""
        if self.mode != "local":
            return dict(update)
        clipped = clip(update, self.C, self.per_layer)
        noise = gaussian_like(clipped, self.z * self.C, np.random.default_rng([self.seed, rnd, cid, NOISE_STREAM]))
        return {k: (clipped[k] + noise[k]).astype(np.float32) for k in update}

    def aggregate(self, updates: list[Mapping[str, np.ndarray]], rnd: int) -> dict[str, np.ndarray]:
        """The round's update: (sum_i clip(Delta_i) + xi) / m with xi ~ N(0, (zC)^2) (central), or
        sum_i Delta_i / m of the clients' noised uploads (local); uniform weights, fixed m."""
        if self.mode == "central":
            updates = [clip(u, self.C, self.per_layer) for u in updates]
        total = {k: sum(np.asarray(u[k], dtype=np.float64) for u in updates) for k in updates[0]}
        if self.mode == "central":
            noise = gaussian_like(total, self.z * self.C, np.random.default_rng([self.seed, rnd, NOISE_STREAM]))
            total = {k: total[k] + noise[k] for k in total}
        return {k: (v / self.m).astype(np.float32) for k, v in total.items()}

    def report(self, steps: int) -> dict[str, Any]:
        """``summary.json``'s ``privacy``."""
        return {
            "mode": self.mode,
            "epsilon": self.epsilon(steps),
            "delta": self.delta,
            "noise_multiplier": self.z,
            "clip": self.C,
            "per_layer": self.per_layer,
            "sampling_rate": self.sampling_rate,
            "steps": int(steps),
            "accountant": ACCOUNTANT,
        }


def check_privacy(config: Any, options: Any = None) -> None:
    """Stop with one line on a ``[privacy]`` that cannot run: a target epsilon no multiplier
    reaches, a budget below one round's epsilon, an explicit ``options.weighting = "examples"``
    (DP-FedAvg weighs clients uniformly), or a method option without a DP form (``options``: the
    method's validated options, :meth:`fedtune.registry.MethodOptions.privacy_refusal`)."""
    if config.privacy.mode == "none":
        return
    Privacy(config)
    refusal = options.privacy_refusal() if options is not None else None
    if refusal:
        raise ConfigError(refusal)
    if config.options.get("weighting") == "examples":
        raise ConfigError(
            'options.weighting: "examples" is not DP (a weight depends on the client\'s data); '
            "privacy.mode weighs every client 1/m"
        )
