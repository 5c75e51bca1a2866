"""The BoMM cloud's completer, the part that owns the generator psi_2 (chosen by a method's
registration, :meth:`~fedtune.methods.bomm.cloud.BommCloud.assemble`):

- :class:`NoCompletion` (Vanilla): no generator; rows keep their missing modalities;
- :class:`RegressionCompletion` (MM-AC, MM-UC): a generator trained by regression on real targets;
- :class:`PreferenceCompletion` (BoMM): a generator trained with L_G of eqs. (3)-(4).

What the generator trains on (eqs. (3)-(4)): items (row, target modality) with the other modality
present, each with its preferred output g^p (the row's real target; else an aligned partner's, the
mean over the sample's other views that hold it; else, with ``preference`` (BoMM), the target
modality of the row's closest global prototype) and sim(x, o_i)."""

from __future__ import annotations

import numpy as np

from fedtune.methods.bomm.alignment import PrototypeSet, nearest_prototype, pair_similarity
from fedtune.methods.bomm.backbone import FEATURE_DIM
from fedtune.methods.bomm.common import GENERATOR_INIT, GENERATOR_TRAIN, generate, train_generator
from fedtune.methods.bomm.networks import Generator
from fedtune.methods.bomm.pool import CloudRound, M, Pool
from fedtune.models.audio import seeded
from fedtune.models.training import seed_for


def completion_items(
    pool: Pool,
    z: np.ndarray,
    samples: list[np.ndarray],
    protos: PrototypeSet | None,
    space,
    preference: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(source representations, target modality, g^p, sim(x, o_i), whether g^p is real) of every
    item; without ``preference`` (the regression baselines) only items with a real target. o_i is
    chosen in the alignment ``space``; sim is the cosine in the generator's own (standardized phi)
    space."""
    sample_of = np.empty(len(pool), dtype=np.int64)
    for s, rows in enumerate(samples):
        sample_of[rows] = s
    source, target, g_p, sim, real = [], [], [], [], []
    for t in range(M):
        rows = np.flatnonzero(pool.mask[:, 1 - t])
        gp = np.zeros((len(rows), FEATURE_DIM), np.float32)
        has = np.zeros(len(rows), bool)
        for n, r in enumerate(rows):
            views = samples[sample_of[r]]
            holders = views[pool.mask[views, t]]  # the row itself first if it holds t
            if pool.mask[r, t]:
                gp[n], has[n] = z[r, t], True
            elif len(holders):
                gp[n], has[n] = z[holders, t].mean(0), True
        is_real = has.copy()
        s = np.zeros(len(rows))
        if preference and protos is not None and len(protos):
            sub = protos.subset(np.flatnonzero(protos.mask[:, :, t].any(axis=1)))
            sub_a = sub.mapped(space)  # o_i: the closest prototype in the alignment space
            for k in np.unique(pool.party[rows]):
                mine = np.flatnonzero(pool.party[rows] == k)
                present = pool.mask[rows[mine]]
                idx, _ = nearest_prototype(space(z[rows[mine]], present), present, sub_a, int(k))
                s[mine] = pair_similarity(z[rows[mine]], present, sub, idx, int(k))  # in the generator's space
                fill = mine[(~has[mine]) & (idx >= 0)]
                if len(fill):
                    values, ok = sub.target(idx[np.isin(mine, fill)], t)
                    gp[fill[ok]] = values[ok]
                    has[fill[ok]] = True
        keep = has if preference else is_real
        source.append(z[rows[keep], 1 - t])
        target.append(np.full(int(keep.sum()), t, np.int64))
        g_p.append(gp[keep])
        sim.append(s[keep])
        real.append(is_real[keep])
    source, target, g_p, sim = (np.concatenate(a) for a in (source, target, g_p, sim))
    return source, target, g_p, sim, np.concatenate(real)


def complete_rows(generator, z: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(completed z, completed mask, generated modality per row or -1): every row holding one
    modality gets ``generator``'s representation of the other (none without a generator)."""
    zc, mc = z.copy(), mask.copy()
    gen_mod = np.full(len(z), -1, dtype=np.int64)
    if generator is None:
        return zc, mc, gen_mod
    for t in range(M):
        rows = np.flatnonzero(~mask[:, t] & mask[:, 1 - t])
        if len(rows):
            zc[rows, t] = generate(generator, z[rows, 1 - t], t)
            mc[rows, t] = True
            gen_mod[rows] = t
    return zc, mc, gen_mod


class NoCompletion:
    """No cloud generator (Vanilla): the cloud and the parties keep the rows' missing modalities."""

    name = "no completion"

    def build(self, options, seed: int) -> Generator | None:
        """The generator psi_2, freshly initialized from the run's ``seed`` (none here)."""
        return None

    def train(
        self, generator, r: CloudRound, samples: list[np.ndarray], protos: PrototypeSet | None, options
    ) -> tuple[dict[str, float], bool]:
        """One round's training of ``generator`` (in place): (its metrics, whether it trained)."""
        return {}, False

    def completions(self, r: CloudRound, zc: np.ndarray, gen_mod: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
        """Per uploading party, the arrays of its completions (``gen_rows``, ``gen_modality``, ``gen``)."""
        return {}

    def completed_test(
        self, generator, z: np.ndarray, missing: int | None
    ) -> tuple[np.ndarray, np.ndarray, dict[str, float]] | None:
        """The standardized test pairs ``z`` with the scenario's ``missing`` modality removed and
        completed by ``generator``: (completed z, mask, the completions' metrics); None without."""
        return None


class RegressionCompletion(NoCompletion):
    """MM-AC / MM-UC: the cloud generator psi_2 learns by regression (mean squared error) on the
    real targets of the rows the cloud holds (:func:`completion_items` without ``preference``) and
    completes every row that lacks one modality, for the cloud and for the parties."""

    name = "regression completion"
    preference = False  # eqs. (3)-(4) and the prototypes' targets (PreferenceCompletion)

    def build(self, options, seed: int) -> Generator:
        return seeded(seed_for(seed, GENERATOR_INIT), lambda: Generator(FEATURE_DIM, options.generator_hidden))

    def reference(self, options, seed: int) -> Generator | None:
        """G_ref of eq. (3), when fixed (None: the generator as it starts the round)."""
        return None

    def train(
        self, generator, r: CloudRound, samples: list[np.ndarray], protos: PrototypeSet | None, options
    ) -> tuple[dict[str, float], bool]:
        """Items (row, target modality) with the other modality present, their g^p and sim(x, o_i)
        (:func:`completion_items`); then :func:`~fedtune.methods.bomm.common.train_generator`."""
        source, target, g_p, sim, real = completion_items(r.pool, r.z, samples, protos, r.space, self.preference)
        seed = seed_for(r.seed, r.rnd, GENERATOR_TRAIN)
        reference = self.reference(options, r.seed)
        metrics = train_generator(
            generator, source, target, g_p, sim, options, preference=self.preference, seed=seed, reference=reference
        )
        metrics["generator_items"] = float(len(source))
        metrics["generator_real_items"] = float(real.sum())
        return metrics, True

    def completions(self, r: CloudRound, zc: np.ndarray, gen_mod: np.ndarray) -> dict[int, dict[str, np.ndarray]]:
        """Each party's rows that lack one modality (``gen_modality``, -1 in ``gen_mod`` elsewhere)
        with the generated representation ``zc`` de-standardized into phi-space (``gen``)."""
        pool, out = r.pool, {}
        for k in r.parties:
            rows = np.flatnonzero((pool.party == k) & (gen_mod >= 0))
            gen = np.zeros((len(rows), FEATURE_DIM), np.float32)
            for t in range(M):
                sel = gen_mod[rows] == t
                gen[sel] = r.st.invert_one(zc[rows[sel], t], t)
            out[k] = {"gen_rows": pool.local[rows], "gen_modality": gen_mod[rows], "gen": gen}
        return out

    def completed_test(
        self, generator, z: np.ndarray, missing: int | None
    ) -> tuple[np.ndarray, np.ndarray, dict[str, float]] | None:
        """``cloud_gen_cosine``: the completions' mean cosine to the real modality (standardized);
        None in scenario 0."""
        t = missing
        if t is None:
            return None
        mask = np.ones((len(z), M), bool)
        mask[:, t] = False
        zc, mc, _ = complete_rows(generator, z * mask[..., None], mask)
        a, b = zc[:, t], z[:, t]
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
        return zc, mc, {"cloud_gen_cosine": float(cos.mean())}


class PreferenceCompletion(RegressionCompletion):
    """BoMM: the generator learns from L_G = L_prefer + gamma L_special (eqs. (3)-(4),
    :mod:`fedtune.methods.bomm.completion`) on every item with a preferred output g^p, the closest
    global prototype's target where no real one exists; the DPO reference G_ref is the generator as
    it starts the round, or (``reference = "initial"``) as initialized."""

    name = "preference completion"
    preference = True

    def reference(self, options, seed: int) -> Generator | None:
        return self.build(options, seed) if options.reference == "initial" else None
