"""A BoMM party's parts, chosen once by a method's registration
(:meth:`~fedtune.methods.bomm.party.BommParty.assemble`), like the cloud's aligner and completer:

- its fill, where the completions of its rows' missing modalities come from: :class:`NoFill`
  (LOCAL, Vanilla: none), :class:`CloudFill` (MM-AC, MM-UC, BoMM: the cloud's generator) or
  :class:`LocalFill` (MM-LOCAL: its own generator, trained by regression on its complete rows);
- its scheduling of those completions: :class:`NoScheduling` (use each) or :class:`Scheduling`
  (BoMM's dynamic sample scheduler, eqs. (5)-(8), with ``options.scheduler``).

Each part gets the arrays, networks and options it needs and returns its result; the party keeps
its state."""

from __future__ import annotations

import numpy as np

from fedtune.methods.bomm.backbone import FEATURE_DIM
from fedtune.methods.bomm.common import GENERATOR_INIT, SCHEDULER_INIT, Standardizer, generate, train_generator
from fedtune.methods.bomm.networks import Generator
from fedtune.methods.bomm.scheduler import SampleScheduler
from fedtune.models.audio import seeded
from fedtune.models.training import seed_for

Completions = tuple[np.ndarray, np.ndarray, np.ndarray]  # (party-local rows, generated modality, phi-space)


class NoFill:
    """No completions: no adapters, no generator; rows keep their missing modalities."""

    name = "no fill"
    adapters = False  # the party maps completions into its small model's embedding space

    def generator(self, options, seed: int, cid: int) -> Generator | None:
        """The party's own generator, freshly initialized from the run's ``seed`` (none here)."""
        return None

    def local_completions(
        self, generator, st: Standardizer, z: np.ndarray, masks: np.ndarray, options, seed: int
    ) -> Completions | None:
        """Before local training without a cloud: train ``generator`` (in place) on the party's
        standardized rows ``z`` with ``masks`` and complete its rows that miss one modality (None
        here). ``seed``: the round's generator seed."""
        return None


class CloudFill(NoFill):
    """The cloud's generator completes the rows the party sent; the completions arrive in the
    ``complete`` phase."""

    name = "cloud fill"
    adapters = True


class LocalFill(CloudFill):
    """MM-LOCAL: the party's own generator, trained by regression on its complete rows (each
    modality from the other), completes its rows that miss one modality."""

    name = "local fill"

    def generator(self, options, seed: int, cid: int) -> Generator:
        return seeded(seed_for(seed, GENERATOR_INIT, cid), lambda: Generator(FEATURE_DIM, options.generator_hidden))

    def local_completions(
        self, generator, st: Standardizer, z: np.ndarray, masks: np.ndarray, options, seed: int
    ) -> Completions:
        both = np.flatnonzero(masks.all(axis=1))
        source = np.concatenate([z[both, 1], z[both, 0]])
        target = np.concatenate([np.zeros(len(both), np.int64), np.ones(len(both), np.int64)])
        g_p = np.concatenate([z[both, 0], z[both, 1]])
        train_generator(generator, source, target, g_p, np.zeros(len(target)), options, preference=False, seed=seed)
        one = np.flatnonzero(masks.sum(axis=1) == 1)
        missing = np.where(masks[one, 0], 1, 0).astype(np.int64)  # the modality each row lacks
        feats = np.zeros((len(one), FEATURE_DIM), np.float32)
        for t in (0, 1):
            sel = missing == t
            if sel.any():
                feats[sel] = st.invert_one(generate(generator, z[one[sel], 1 - t], t), t)
        return one, missing, feats


class NoScheduling:
    """Every completion a party holds is used."""

    name = "no scheduling"

    def build(self, in_dim: int, options, seed: int, cid: int) -> SampleScheduler | None:
        """The party's scheduler over ``in_dim``-wide x_bar, freshly initialized (none here)."""
        return None


class Scheduling(NoScheduling):
    """BoMM's dynamic sample scheduler (eqs. (5)-(8)) selects the completions each update uses,
    with ``options.scheduler`` (false: the ablation that uses every completion)."""

    name = "scheduling"

    def build(self, in_dim: int, options, seed: int, cid: int) -> SampleScheduler | None:
        if not options.scheduler:
            return None
        return seeded(seed_for(seed, SCHEDULER_INIT, cid), lambda: SampleScheduler(in_dim, options.scheduler_hidden))
