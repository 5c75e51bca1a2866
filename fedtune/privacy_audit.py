"""An empirical audit of client-level DP (:mod:`fedtune.methods.base.privacy`): a lower bound on
the epsilon a run actually gives, from a distinguishing test between neighbouring federations
(Jagielski, Ullman, Oprea, NeurIPS 2020; Nasr, Song, Thakurta, Papernot, Carlini, IEEE S&P 2021),
and the one-run audit of Steinke, Nasr, Jagielski (NeurIPS 2023).

Each run goes through the real round loop (:func:`fedtune.engines.rounds.drive_rounds`, the
embedded transport, reply validation) and the real DP strategy (FedAvg's
:class:`~fedtune.methods.base.averaging.BroadcastAverage` with the run's mechanism: its secret
Poisson sample, clipping, noise) of the run's resolved context, over a synthetic federation on a
d-dimensional model. A canary client uploads +C u (federation D) or -C u (its neighbour D', the
canary's data replaced: the replace-one worst case, the sum moving by 2C), u a fixed unit vector.
The auditor sees what the run releases, the global state after every round, and scores a canary
by the log-likelihood ratio of D against D' of the released steps, under the mechanism the
accountant assumes (:func:`likelihood_ratio`).

Many runs (:func:`audit`): client 0 is the canary, every other client uploads a random update of
norm C/2 (the other parties' data); ``trials`` runs of each federation. The test "guess D when
s > t" has false-negative and false-positive rates whose one-sided Clopper-Pearson upper bounds at
confidence 1 - alpha/2 each give, for any (epsilon, delta)-DP mechanism, epsilon >=
log((1 - delta - FNR) / FPR) and epsilon >= log((1 - delta - FPR) / FNR) (the same test on the
complementary event; Kairouz, Oh, Viswanath 2015). The threshold t is chosen on the first half of
the trials (the one that maximizes that bound there) and the bound is computed on the other half
(:func:`heldout_lower_bound`): a tail threshold sees far more than t = 0, whose bound tops out near
epsilon 0.75 whatever the trial count, and holding it out keeps the confidence exact.

One run (:func:`one_run_audit`): every client is a canary k with its own direction u_k (orthonormal)
and a random public sign S_k; the auditor guesses S_k for the ``guesses`` canaries whose scores are
largest and smallest and abstains on the rest; v correct guesses of r reject (epsilon, delta)-DP
when P[Binomial(r, e^eps / (1 + e^eps)) >= v] plus Steinke et al.'s delta term (Corollary 5.4)
falls below alpha (:func:`one_run_p_value`).

``attack`` (many runs): ``"released"`` scores the released state as it is; ``"regenerate"`` plays
the outsider who regenerates the sample and the noise from the run's public seed (what issue 37
found possible), subtracts the noise before scoring and, where the regenerated sample never holds
the canary, abstains (the trial is left out: a guess conditioned on a public event still obeys the
DP bound): against secret randomness it subtracts unrelated noise and leaves out unrelated trials,
gaining nothing; against ``privacy.insecure_reproducible_noise`` it removes the noise whole and
scores only the runs the canary was in.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from scipy.stats import beta, binom

from fedtune.engines.embedded import run_rounds
from fedtune.methods.base.aggregation import Aggregation, planned
from fedtune.methods.base.averaging import BroadcastAverage, UpdateClient
from fedtune.methods.base.privacy import NOISE, SAMPLE, gaussian_like, generator, poisson_sample
from fedtune.models.training import FitResult
from fedtune.protocol.context import ClientContext, ServerContext
from fedtune.protocol.messages import Message
from fedtune.protocol.profiles import ClientProfile
from fedtune.runtime import RunContext, resolve_run

if TYPE_CHECKING:
    from fedtune.config import RunConfig

AUDIT_STREAM = 0xA0D1  # the synthetic federation's randomness (public: it is the auditor's)


class AuditContext(RunContext):
    """The run's own resolved context; each audit client holds one example (no task data is read)."""

    def example_bound(self, kind: str, cid: int) -> int:
        return 1


class AuditStrategy(BroadcastAverage):
    """FedAvg over one vector ``w`` (d,), the run's DP mechanism aggregating; ``moves`` keeps each
    round's released step theta_t - theta_{t-1} (float64)."""

    def __init__(self, context: ServerContext, dim: int) -> None:
        super().__init__(context)
        self.aggregation = Aggregation(planned(context))
        self.dim = dim
        self.moves: list[np.ndarray] = []

    def initialize(self) -> None:
        self.global_arrays = {"w": np.zeros(self.dim, np.float32)}

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        before = self.global_arrays["w"].astype(np.float64)
        metrics = super().aggregate_fit(rnd, replies)
        self.moves.append(self.global_arrays["w"].astype(np.float64) - before)
        return metrics

    def state_dict(self) -> dict:
        return {"global": dict(self.global_arrays), **self.aggregation.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.global_arrays = dict(state["global"])


#: the fit an audit client reports (it does not train): one example, one step, loss 0
NO_FIT = FitResult(loss=0.0, steps=1, num_examples=1, compute_s=0.0)


class AuditClient(UpdateClient):
    """Uploads ``update(rnd)`` (d,) in round ``rnd`` through the real upload path; it does not train."""

    def __init__(self, cid: int, context: ClientContext, state: dict, update: Callable[[int], np.ndarray]) -> None:
        super().__init__(cid, ClientProfile(), context, state)
        self.update = update

    def fit(self, message: Message) -> Message:
        rnd = int(message.meta["round"])
        return self.upload({"w": self.update(rnd).astype(np.float32)}, NO_FIT, rnd=rnd)


def _run(run: RunConfig, dim: int, update_of: Callable[[int], Callable[[int], np.ndarray]]) -> AuditStrategy:
    """One run of ``run`` (a config) through the round loop, client ``cid`` uploading ``update_of(cid)``."""
    if run.privacy.mode != "central" or run.privacy.adjacency != "replace-one":
        raise ValueError(
            "the audit's canary pairs (+C u, -C u) are replace-one neighbours under central DP: "
            'needs privacy.mode = "central" and privacy.adjacency = "replace-one"'
        )
    context = AuditContext(resolve_run(run))
    strategy = AuditStrategy(context, dim)
    strategy.initialize()

    def make(cid: int, state: dict) -> AuditClient:
        return AuditClient(cid, context, state, update_of(cid))

    fed = run.federation
    run_rounds(strategy, make, fed.num_clients, fed.sample_size(), run.rounds, run.seed)
    return strategy


def likelihood_ratio(projections: np.ndarray, rate: float, sigma: float) -> np.ndarray:
    """The log-likelihood ratio of D (+1) against D' (-1) of a canary's per-round projections
    r_t = <theta_t - theta_{t-1}, u> m / C (``projections``: (..., T)) under the accountant's model:
    r_t ~ (1 - q) N(0, sigma^2) + q N(+-1, sigma^2) (Poisson rate q, noise multiplier sigma = z),
    summed over rounds: (...). With q = 1 it is 2 sum_t r_t / sigma^2."""
    r = np.asarray(projections, dtype=np.float64)
    absent = -math.inf if rate >= 1 else math.log1p(-rate)

    def log_density(shift: float) -> np.ndarray:
        return np.logaddexp(absent - r**2 / (2 * sigma**2), math.log(rate) - (r - shift) ** 2 / (2 * sigma**2))

    return np.sum(log_density(1.0) - log_density(-1.0), axis=-1)


def audit_scores(config: RunConfig, trials: int, dim: int = 1000, attack: str = "released", start: int = 0):
    """Scores (:func:`likelihood_ratio`) of ``trials`` runs of D (canary +C u) and of D' (-C u)
    under ``config``'s ``[privacy]`` and ``[federation]``, trial t with the public seed
    ``config.seed + t`` (many runs, as an auditor repeats them): two arrays, without the trials the
    attack abstains on (see the module docstring)."""
    clip = config.privacy.clip
    if clip is None:
        raise ValueError("the audit's canaries upload +-C u: needs privacy.clip")
    canary = np.random.default_rng([AUDIT_STREAM]).normal(size=dim)
    canary /= np.linalg.norm(canary)
    scores: dict[float, list[float]] = {1.0: [], -1.0: []}
    for trial in range(start, start + trials):
        run = config.model_copy(update={"seed": (config.seed + trial) % 2**32})
        if attack == "regenerate" and not seed_sample_holds_canary(run):
            continue  # the outsider abstains: by the seed's sample, the canary never took part
        for sign in scores:

            def update_of(cid: int, trial: int = trial, sign: float = sign) -> Callable[[int], np.ndarray]:
                if cid == 0:
                    return lambda rnd: sign * clip * canary
                return lambda rnd: other_update(trial, rnd, cid, dim, clip)

            strategy = _run(run, dim, update_of)
            private = strategy.aggregation.privacy
            assert private is not None, "the audit runs under privacy.mode"
            moves = strategy.moves
            if attack == "regenerate":  # the outsider's guess at each round's noise, from the public seed
                std = private.noise_std()
                guess = [
                    gaussian_like({"w": m}, std, generator([run.seed], NOISE, t + 1))["w"] for t, m in enumerate(moves)
                ]
                moves = [m - g / private.m for m, g in zip(moves, guess, strict=True)]
            projections = np.array([float(m @ canary) for m in moves]) * private.m / clip
            scores[sign].append(float(likelihood_ratio(projections, private.rate, private.z)))
    return np.asarray(scores[1.0]), np.asarray(scores[-1.0])


def other_update(trial: int, rnd: int, cid: int, dim: int, clip: float) -> np.ndarray:
    """A non-canary client's update in round ``rnd`` of trial ``trial``: a random direction, norm C/2."""
    v = np.random.default_rng([AUDIT_STREAM, trial, rnd, cid]).normal(size=dim)
    return 0.5 * clip * v / np.linalg.norm(v)


def seed_sample_holds_canary(run: RunConfig) -> bool:
    """Whether client 0 is in some round's sample as the run's public seed would draw it (the
    reproducible rule; under secret sampling an unrelated draw)."""
    fed = run.federation
    rate = fed.sample_size() / fed.num_clients
    rounds = range(1, run.rounds + 1)
    return any(0 in poisson_sample(fed.num_clients, rate, generator([run.seed], SAMPLE, r, 0)) for r in rounds)


def upper(failures: np.ndarray | int, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound at confidence 1 - alpha on a rate of failures / n
    (elementwise)."""
    k = np.asarray(failures)
    return np.where(k >= n, 1.0, beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)))


def _bounds(
    positive: np.ndarray, negative: np.ndarray, thresholds: np.ndarray | list[float], delta: float, alpha: float
):
    """For each threshold t of the test "D when s > t": (bound, FN, FP, FNR upper, FPR upper), the
    bound max(0, log((1 - delta - FNR) / FPR), log((1 - delta - FPR) / FNR)) of the rates' upper
    bounds at confidence 1 - alpha/2 each."""
    t = np.asarray(thresholds, dtype=np.float64)
    fn = np.searchsorted(np.sort(positive), t, side="right")  # positives at or below t
    fp = len(negative) - np.searchsorted(np.sort(negative), t, side="right")  # negatives above t
    fnr, fpr = upper(fn, len(positive), alpha / 2), upper(fp, len(negative), alpha / 2)
    with np.errstate(divide="ignore"):
        tail = np.log(np.maximum(1 - delta - fnr, 1e-300) / fpr)  # P_D(s > t) <= e^eps P_D'(s > t) + delta
        head = np.log(np.maximum(1 - delta - fpr, 1e-300) / fnr)  # P_D'(s <= t) <= e^eps P_D(s <= t) + delta
    return np.maximum(0.0, np.maximum(tail, head)), fn, fp, fnr, fpr


def epsilon_lower_bound(
    positive: np.ndarray, negative: np.ndarray, delta: float, alpha: float = 0.05, threshold: float = 0.0
) -> dict:
    """The lower bound on epsilon at ``delta`` (confidence 1 - alpha) from the test s > ``threshold``
    on scores of D (``positive``) and D' (``negative``)."""
    bound, fn, fp, fnr, fpr = (float(x[0]) for x in _bounds(positive, negative, [threshold], delta, alpha))
    return {
        "epsilon_lower_bound": bound,
        "false_negatives": int(fn),
        "false_positives": int(fp),
        "trials_each": len(positive),
        "fnr_upper": fnr,
        "fpr_upper": fpr,
        "confidence": 1 - alpha,
        "threshold": float(threshold),
    }


def heldout_lower_bound(positive: np.ndarray, negative: np.ndarray, delta: float, alpha: float = 0.05) -> dict:
    """:func:`epsilon_lower_bound` on the second half of each federation's trials, at the threshold
    that maximizes it on the first half (candidates: the midpoints between the first half's scores
    and one past each end; of tied ones the middle): the threshold depends on the first half
    alone, so the second half's bound keeps its confidence 1 - alpha."""
    half_p, half_n = len(positive) // 2, len(negative) // 2
    chosen_p, chosen_n = positive[:half_p], negative[:half_n]
    seen = np.unique(np.concatenate([chosen_p, chosen_n]))  # every split of them: midpoints and both ends
    candidates = np.concatenate([[seen[0] - 1.0], (seen[:-1] + seen[1:]) / 2, [seen[-1] + 1.0]]) if len(seen) else [0.0]
    bounds = _bounds(chosen_p, chosen_n, candidates, delta, alpha)[0]
    best = np.flatnonzero(bounds == bounds.max())
    threshold = float(candidates[best[len(best) // 2]])  # the middle of a tie: a gap's centre, not its edge
    result = epsilon_lower_bound(positive[half_p:], negative[half_n:], delta, alpha, threshold)
    return {**result, "selection_trials": half_p}


def claimed(config: RunConfig) -> dict:
    """What the run of ``config`` reports after its rounds (``reported_epsilon``; inf under
    ``insecure_reproducible_noise``), what the accountant gives its noise multiplier
    (``accountant_epsilon``), z and delta."""
    from fedtune.methods.base import accounting
    from fedtune.methods.base.privacy import mechanism

    private = mechanism(config)
    assert private is not None, "the audit runs under privacy.mode"
    private.ledger.record(private.z, private.rate, range(len(private.releases)), times=config.rounds)
    return {
        "reported_epsilon": private.spent(),
        "accountant_epsilon": accounting.epsilon(
            private.accountant, private.adjacency, private.rate, private.z, config.rounds, private.delta
        ),
        "noise_multiplier": private.z,
        "delta": private.delta,
    }


def audit(config: RunConfig, trials: int, dim: int = 1000, attack: str = "released", alpha: float = 0.05) -> dict:
    """Run the many-run audit of ``config``: its held-out lower bound (:func:`heldout_lower_bound`)
    beside :func:`claimed`, and the threshold-0 bound on all the trials (``threshold_zero_bound``)."""
    positive, negative = audit_scores(config, trials, dim, attack)
    claim = claimed(config)
    zero = epsilon_lower_bound(positive, negative, claim["delta"], alpha)
    result = heldout_lower_bound(positive, negative, claim["delta"], alpha)
    return {**result, "threshold_zero_bound": zero["epsilon_lower_bound"], **claim, "attack": attack}


# -- one run (Steinke, Nasr, Jagielski 2023) ----------------------------------------------------------
def one_run_scores(config: RunConfig, canaries: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """One run of a federation of ``canaries`` clients at ``config``'s sampling rate q (m = qK) and
    ``[privacy]`` (its delta kept), on a K-dimensional model, client k uploading S_k C e_k every
    round (S_k = +-1 at random, the auditor's public draw; e_k the k-th unit vector: the canaries'
    directions orthonormal): (S, scores), each (K,)."""
    fed, clip = config.federation, config.privacy.clip
    m = fed.sample_size() * canaries / fed.num_clients
    if m != round(m):
        raise ValueError(f"one-run audit: q K = {m:g} must be a whole number of clients")
    signs = np.random.default_rng([AUDIT_STREAM, canaries]).choice([-1.0, 1.0], size=canaries)
    federation = fed.model_copy(update={"num_clients": canaries, "clients_per_round": int(m), "fraction": None})
    privacy = config.privacy.model_copy(update={"delta": claimed(config)["delta"]})
    run = config.model_copy(update={"federation": federation, "privacy": privacy})

    def update_of(cid: int) -> Callable[[int], np.ndarray]:
        canary = np.zeros(canaries)
        canary[cid] = signs[cid] * clip
        return lambda rnd: canary

    strategy = _run(run, canaries, update_of)
    private = strategy.aggregation.privacy
    assert private is not None, "the audit runs under privacy.mode"
    projections = np.stack(strategy.moves, axis=1) * private.m / clip  # (K, T): canary k's step on e_k
    return signs, likelihood_ratio(projections, private.rate, private.z)


def one_run_p_value(canaries: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """Steinke et al.'s Corollary 5.4: the probability of ``correct`` or more right guesses of
    ``guesses`` about ``canaries`` random signs under (eps, delta)-DP: P[B >= v] + 2 m delta
    max_{1<=i<=v} P[v > B >= v - i] / i, B ~ Binomial(r, e^eps / (1 + e^eps))."""
    q = 1 / (1 + math.exp(-eps))
    tail = float(binom.sf(correct - 1, guesses, q))
    i = np.arange(1, correct + 1)
    spread = float(np.max((binom.sf(correct - i - 1, guesses, q) - tail) / i, initial=0.0))
    return min(1.0, tail + 2 * canaries * delta * spread)


def one_run_lower_bound(signs: np.ndarray, scores: np.ndarray, guesses: int, delta: float, alpha: float = 0.05):
    """The largest epsilon that :func:`one_run_p_value` rejects at level ``alpha`` (bisection), with
    the guess +1 for the ``guesses`` / 2 largest scores and -1 for as many smallest, abstaining on
    the rest (``guesses`` fixed before the run)."""
    order = np.argsort(scores)
    half = guesses // 2
    guessed = np.concatenate([-signs[order[:half]], signs[order[-half:]]])  # +1 where the guess is right
    r, v, k = 2 * half, int(np.sum(guessed > 0)), len(signs)

    def rejected(eps: float) -> bool:
        return one_run_p_value(k, r, v, eps, delta) < alpha

    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, high + 1.0
    for _ in range(30 if rejected(low) else 0):
        mid = (low + high) / 2
        low, high = (mid, high) if rejected(mid) else (low, mid)
    return {"epsilon_lower_bound": low, "guesses": r, "correct": v, "canaries": k, "confidence": 1 - alpha}


def one_run_audit(config: RunConfig, canaries: int = 1000, guesses: int = 200, alpha: float = 0.05) -> dict:
    """The one-run audit of ``config`` (:func:`one_run_scores`, :func:`one_run_lower_bound`) beside
    :func:`claimed` (the claim of ``config`` itself: the same q, z, rounds and delta)."""
    signs, scores = one_run_scores(config, canaries)
    claim = claimed(config)
    return {**one_run_lower_bound(signs, scores, guesses, claim["delta"], alpha), **claim}
