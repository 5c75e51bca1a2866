"""What the BoMM cloud's generator trains on (eqs. (3)-(4)): items (row, target modality) with the
other modality present, each with its preferred output g^p (the row's real target; else an
aligned partner's, the mean over the sample's other views that hold it; else, with ``preference``
(BoMM), the target modality of the row's closest global prototype) and sim(x, o_i)."""

from __future__ import annotations

import numpy as np

from fedtune.methods.bomm.alignment import PrototypeSet, nearest_prototype, pair_similarity
from fedtune.methods.bomm.backbone import FEATURE_DIM
from fedtune.methods.bomm.common import generate
from fedtune.methods.bomm.pool import M, Pool


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
