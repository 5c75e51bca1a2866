"""An empirical audit of client-level DP (:mod:`fedtune.methods.base.privacy`): a lower bound on
the epsilon a run actually gives, from a distinguishing test between neighbouring federations
(Jagielski, Ullman, Oprea, NeurIPS 2020; Nasr, Song, Thakurta, Papernot, Carlini, IEEE S&P 2021).

Each trial is a run through the real round loop (:func:`fedtune.engines.rounds.drive_rounds`, the
embedded transport, reply validation) and the real DP strategy (FedAvg's
:class:`~fedtune.methods.base.averaging.BroadcastAverage` with the run's mechanism: its secret
Poisson sample, clipping, noise), over a synthetic federation of ``num_clients`` clients on a
d-dimensional model: client 0 is the canary, which uploads +C u (federation D) or -C u (its
neighbour D', the canary's data replaced: the replace-one worst case, the sum moving by 2C), u a
fixed unit vector; every other client uploads a random update of norm C/2 (the other parties'
data). The auditor sees what the run releases, the global state after every round, and
scores s = <theta_T - theta_0, u> m / C, guessing D when s > 0.

Over ``trials`` runs of each federation the false-positive and false-negative rates' one-sided
Clopper-Pearson upper bounds at confidence 1 - alpha/2 each give, for any (epsilon, delta)-DP
mechanism, epsilon >= log((1 - delta - FPR) / FNR) (and with the rates swapped; Kairouz, Oh,
Viswanath 2015): that is the lower bound, to hold below the accountant's epsilon.

``attack``: ``"released"`` scores the released state as it is; ``"regenerate"`` plays the outsider
who regenerates the sample and the noise from the run's public seed (what issue 37 found
possible), subtracts the noise before scoring and, where the regenerated sample never holds the
canary, abstains (the trial is left out: a guess conditioned on a public event still obeys the DP
bound): against secret randomness it subtracts unrelated noise and leaves out unrelated trials,
gaining nothing; against ``privacy.insecure_reproducible_noise`` it removes the noise whole and
scores only the runs the canary was in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from scipy.stats import beta

from fedtune.engines.embedded import run_rounds
from fedtune.methods.base.aggregation import Aggregation, plan_aggregation
from fedtune.methods.base.averaging import BroadcastAverage, UpdateClient
from fedtune.methods.base.privacy import NOISE, SAMPLE, gaussian_like, generator, poisson_sample
from fedtune.protocol.messages import Message
from fedtune.protocol.profiles import ClientProfile

AUDIT_STREAM = 0xA0D1  # the synthetic federation's randomness (public: it is the auditor's)


class AuditStrategy(BroadcastAverage):
    """FedAvg over one vector ``w`` (d,), the run's DP mechanism aggregating."""

    def __init__(self, context: Any, dim: int) -> None:
        super().__init__(context)
        self.aggregation = Aggregation(context.run.aggregation)
        self.dim = dim

    def initialize(self) -> None:
        self.global_arrays = {"w": np.zeros(self.dim, np.float32)}

    def state_dict(self) -> dict:
        return {"global": dict(self.global_arrays), **self.aggregation.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.global_arrays = dict(state["global"])


@dataclass(frozen=True)
class Fit:
    """The fit metrics an audit client reports (it does not train)."""

    def meta(self) -> dict[str, float]:
        return {"num_examples": 1, "steps": 1, "train_loss": 0.0}


class AuditClient(UpdateClient):
    """Client 0 uploads ``sign`` C u; the others a random update of norm C/2 from (trial, round, id)."""

    def __init__(self, cid: int, context: Any, state: dict, canary: np.ndarray, sign: float, trial: int) -> None:
        super().__init__(cid, ClientProfile(), context, state)
        self.canary, self.sign, self.trial = canary, sign, trial

    def fit(self, message: Message) -> Message:
        rnd, clip = int(message.meta["round"]), self.config.privacy.clip
        if self.cid == 0:
            update = self.sign * clip * self.canary
        else:
            v = np.random.default_rng([AUDIT_STREAM, self.trial, rnd, self.cid]).normal(size=self.canary.shape)
            update = 0.5 * clip * v / np.linalg.norm(v)
        return self.upload({"w": update.astype(np.float32)}, Fit(), rnd=rnd)


def audit_scores(config: Any, trials: int, dim: int = 1000, attack: str = "released", start: int = 0):
    """Scores s of ``trials`` runs of D (canary +C u) and of D' (-C u) under ``config``'s
    ``[privacy]`` and ``[federation]``, trial t with the public seed ``config.seed + t`` (many runs,
    as an auditor repeats them): two arrays, without the trials the attack abstains on (see the
    module docstring)."""
    fed = config.federation
    canary = np.random.default_rng([AUDIT_STREAM]).normal(size=dim)
    canary /= np.linalg.norm(canary)
    scores: dict[float, list[float]] = {1.0: [], -1.0: []}
    for trial in range(start, start + trials):
        run = config.model_copy(update={"seed": (config.seed + trial) % 2**32})
        context = SimpleNamespace(
            config=run,
            run=SimpleNamespace(aggregation=plan_aggregation(run)),
            options=SimpleNamespace(weighting="uniform"),
            example_bound=lambda kind, cid: 1,
        )
        if attack == "regenerate" and not seed_sample_holds_canary(run):
            continue  # the outsider abstains: by the seed's sample, the canary never took part
        for sign in scores:
            strategy = AuditStrategy(context, dim)
            strategy.initialize()

            def make(cid: int, state: dict, context=context, trial=trial, sign=sign) -> AuditClient:
                return AuditClient(cid, context, state, canary, sign, trial)

            history = run_rounds(strategy, make, fed.num_clients, fed.sample_size(), run.rounds, run.seed)
            private = strategy.aggregation.privacy
            assert private is not None, "the audit runs under privacy.mode"
            moved = strategy.global_arrays["w"].astype(np.float64)
            if attack == "regenerate":  # the outsider's guess at the noise, from the public seed
                for record in history:
                    guess = gaussian_like({"w": moved}, private.noise_std(), generator([run.seed], NOISE, record.round))
                    moved = moved - guess["w"] / private.m
            scores[sign].append(float(moved @ canary) * private.m / config.privacy.clip)
    return np.asarray(scores[1.0]), np.asarray(scores[-1.0])


def seed_sample_holds_canary(run: Any) -> bool:
    """Whether client 0 is in some round's sample as the run's public seed would draw it (the
    reproducible rule; under secret sampling an unrelated draw)."""
    fed = run.federation
    rate = fed.sample_size() / fed.num_clients
    rounds = range(1, run.rounds + 1)
    return any(0 in poisson_sample(fed.num_clients, rate, generator([run.seed], SAMPLE, r, 0)) for r in rounds)


def upper(failures: int, n: int, alpha: float) -> float:
    """One-sided Clopper-Pearson upper bound at confidence 1 - alpha on a rate of failures / n."""
    return 1.0 if failures >= n else float(beta.ppf(1 - alpha, failures + 1, n - failures))


def epsilon_lower_bound(positive: np.ndarray, negative: np.ndarray, delta: float, alpha: float = 0.05) -> dict:
    """The lower bound on epsilon at ``delta`` (confidence 1 - alpha) from the test s > 0."""
    fn, fp = int(np.sum(positive <= 0)), int(np.sum(negative > 0))
    fnr, fpr = upper(fn, len(positive), alpha / 2), upper(fp, len(negative), alpha / 2)
    bounds = [math.log(max(1 - delta - a, 1e-300) / b) for a, b in ((fpr, fnr), (fnr, fpr))]
    return {
        "epsilon_lower_bound": max(0.0, *bounds),
        "false_negatives": fn,
        "false_positives": fp,
        "trials_each": len(positive),
        "fnr_upper": fnr,
        "fpr_upper": fpr,
        "confidence": 1 - alpha,
    }


def audit(config: Any, trials: int, dim: int = 1000, attack: str = "released", alpha: float = 0.05) -> dict:
    """Run the audit of ``config`` and return its lower bound beside the epsilon the run reports
    and the one the accountant gives its noise multiplier (they differ only under
    ``insecure_reproducible_noise``, reported as inf)."""
    from fedtune.methods.base import accounting
    from fedtune.methods.base.privacy import mechanism

    positive, negative = audit_scores(config, trials, dim, attack)
    private = mechanism(config)
    private.ledger.record(private.z, private.rate, range(len(private.releases)), times=config.rounds)
    claimed = accounting.epsilon(
        private.accountant, private.adjacency, private.rate, private.z, config.rounds, private.delta
    )
    bound = epsilon_lower_bound(positive, negative, private.delta, alpha)
    return {
        **bound,
        "reported_epsilon": private.spent(),
        "accountant_epsilon": claimed,
        "noise_multiplier": private.z,
        "delta": private.delta,
        "attack": attack,
    }
