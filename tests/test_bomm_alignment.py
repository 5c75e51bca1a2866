"""BoMM's global prototype-guided alignment (Section 4.2, eq. (9)): prototypes, cost vectors, the
OT plan variant, mutual matching, and recovery of planted cross-party pairs.

The planted case: latent samples u_i; party A sees each through *its own* random isometric map of the
*image* modality, party B through another one of the *audio* modality (incompatible spaces,
different modalities, as in the paper's motivation). A global prototype is an aligned item with one
component per party (each party's map of a latent anchor, both modalities). Eq. (9) on cost vectors
recovers the planted pairs; matching the raw features (the unfaithful variant) or features that carry
no information (the random control) does not, and the recovery threshold tells them apart.
"""

from __future__ import annotations

import numpy as np
import pytest

from fedtune.methods.bomm.alignment import (
    PrototypeSet,
    align_parties,
    class_prototypes,
    cost_matrix,
    match,
    nearest_prototype,
    relationship_vectors,
)

LATENT, WIDTH, ANCHORS, N = 12, 48, 40, 120


def planted(seed: int = 0, noise: float = 0.05):
    """(x_a, mask_a, x_b, mask_b, prototypes, truth): party A holds image-only rows, party B
    audio-only rows; row i of A and row truth[i] of B are the same latent sample."""
    rng = np.random.default_rng(seed)
    # [party, modality]: isometric embeddings of the latent space (orthonormal columns), each its own
    maps = np.stack([np.stack([np.linalg.qr(rng.normal(size=(WIDTH, LATENT)))[0] for _ in range(2)]) for _ in range(2)])
    u = rng.normal(size=(N, LATENT))
    anchors = rng.normal(size=(ANCHORS, LATENT))
    truth = rng.permutation(N)

    def view(party, modality, latent):
        return latent @ maps[party, modality].T + noise * rng.normal(size=(len(latent), WIDTH))

    x_a = np.zeros((N, 2, WIDTH))
    x_a[:, 0] = view(0, 0, u)
    x_b = np.zeros((N, 2, WIDTH))
    x_b[truth, 1] = view(1, 1, u)
    mask_a = np.tile([True, False], (N, 1))
    mask_b = np.tile([False, True], (N, 1))
    comp = np.zeros((ANCHORS, 2, 2, WIDTH))
    for k in range(2):
        for m in range(2):
            comp[:, k, m] = anchors @ maps[k, m].T
    protos = PrototypeSet(comp.astype(np.float32), np.ones((ANCHORS, 2, 2), bool), np.full(ANCHORS, -1))
    return x_a, mask_a, x_b, mask_b, protos, truth


def recovery(pairs, truth) -> float:
    return sum(truth[i] == j for i, j, _ in pairs) / len(truth)


# -- the faithful method and the variants the recovery test must tell apart ---------------------
def faithful(x_a, mask_a, x_b, mask_b, protos):
    return align_parties(x_a, mask_a, x_b, mask_b, protos, 0, 1)


def faithful_plan(x_a, mask_a, x_b, mask_b, protos):
    return align_parties(x_a, mask_a, x_b, mask_b, protos, 0, 1, vector="plan", reg=0.05)


def raw_features(x_a, mask_a, x_b, mask_b, protos):
    """Unfaithful: eq. (9)'s cosine on the raw representations instead of the cost vectors."""
    return match(x_a.reshape(len(x_a), -1), x_b.reshape(len(x_b), -1))


def random_features(x_a, mask_a, x_b, mask_b, protos):
    """Control: the faithful method on features that carry no information."""
    rng = np.random.default_rng(99)
    return faithful(rng.normal(size=x_a.shape), mask_a, rng.normal(size=x_b.shape), mask_b, protos)


@pytest.mark.parametrize(
    ("variant", "faithful_one"),
    [
        (faithful, True),
        (faithful_plan, True),
        (raw_features, False),
        (random_features, False),
    ],
    ids=["cost-vectors", "ot-plan-vectors", "raw-features", "random-control"],
)
def test_cost_vector_matching_recovers_planted_cross_party_pairs_and_the_variants_do_not(variant, faithful_one):
    rates = [recovery(variant(*planted(seed)[:5]), planted(seed)[5]) for seed in range(3)]
    if faithful_one:
        assert min(rates) >= 0.9, rates
    else:  # chance is 1/N; the recovery threshold above fails these
        assert max(rates) < 0.2, rates


def test_recovery_degrades_with_noise_so_the_test_is_not_trivial():
    x_a, mask_a, x_b, mask_b, protos, truth = planted(0, noise=3.0)
    assert recovery(faithful(x_a, mask_a, x_b, mask_b, protos), truth) < 0.5


# -- the pieces, by hand ----------------------------------------------------------------------
def test_class_prototypes_average_only_labeled_rows_holding_the_modality():
    x = np.array(
        [
            [[1.0, 0.0], [9.0, 9.0]],  # class 0, audio absent: its audio entries are ignored
            [[3.0, 2.0], [4.0, 0.0]],  # class 0
            [[7.0, 7.0], [7.0, 7.0]],  # unlabeled
            [[0.0, 5.0], [1.0, 1.0]],
        ]
    )  # class 1
    mask = np.array([[True, False], [True, True], [True, True], [False, True]])
    labels = np.array([0, 0, -1, 1])
    protos, counts = class_prototypes(x, mask, labels, 3)
    np.testing.assert_allclose(protos[0, 0], [2.0, 1.0])
    np.testing.assert_allclose(protos[0, 1], [4.0, 0.0])
    np.testing.assert_allclose(protos[1, 1], [1.0, 1.0])
    np.testing.assert_allclose(protos[1, 0], 0.0)
    np.testing.assert_array_equal(counts, [[2, 1], [0, 1], [0, 0]])
    weighted, _ = class_prototypes(x, mask, labels, 3, weights=np.array([1.0, 3.0, 1.0, 1.0]))
    np.testing.assert_allclose(weighted[0, 0], [(1 + 9) / 4, 6 / 4])


def test_seeds_pair_same_class_prototypes_held_by_at_least_two_parties():
    d = 3
    p0 = (
        np.arange(4 * 2 * d, dtype=np.float32).reshape(4, 2, d),
        np.array([[1, 1], [1, 0], [0, 0], [2, 2]], np.float32),
    )
    p1 = (-p0[0], np.array([[1, 0], [0, 0], [3, 3], [1, 1]], np.float32))
    seeds = PrototypeSet.seed({0: p0, 1: p1}, 3)
    np.testing.assert_array_equal(seeds.labels, [0, 3])  # class 1: party 0 only; class 2: party 1 only
    np.testing.assert_array_equal(seeds.comp[0, 0], p0[0][0])
    np.testing.assert_array_equal(seeds.comp[1, 1], p1[0][3])
    np.testing.assert_array_equal(seeds.mask[0], [[True, True], [True, False], [False, False]])
    grown = seeds.with_pairs(
        [(0, np.ones((2, d)), np.array([True, False]), 2, np.zeros((2, d)), np.array([True, True]), 5)]
    )
    assert len(grown) == 3 and grown.labels[-1] == 5 and grown.mask[-1, 1].sum() == 0
    np.testing.assert_array_equal(grown.shared(0, 2), [2])
    np.testing.assert_array_equal(grown.shared(0, 1), [0, 1])


def test_cost_is_one_minus_cosine_averaged_over_the_shared_modalities():
    x = np.array([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [0.0, 0.0]]])
    xmask = np.array([[True, True], [True, False]])
    comp = np.array([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 0.0], [0.0, 2.0]]])
    cmask = np.array([[True, True], [False, True]])
    cost = cost_matrix(x, xmask, comp, cmask)
    assert cost[0, 0] == pytest.approx(((1 - 1) + (1 - 0)) / 2)  # image cos 1, audio cos 0
    assert cost[0, 1] == pytest.approx(1 - 1)  # audio only, cos 1
    assert cost[1, 0] == pytest.approx(1 - 1 / np.sqrt(2))  # image only
    assert np.isnan(cost[1, 1])  # nothing shared


def test_plan_vectors_are_rows_of_a_sinkhorn_plan_with_uniform_marginals():
    cost = np.random.default_rng(0).uniform(0, 2, size=(7, 5))
    vec = relationship_vectors(cost, "plan", reg=0.1)
    np.testing.assert_allclose(vec.sum(axis=1), 1.0, atol=1e-6)  # each row: 1/n of the mass, scaled by n
    np.testing.assert_allclose(vec.sum(axis=0) / 7, 1 / 5, atol=1e-6)
    np.testing.assert_array_equal(relationship_vectors(cost, "cost"), cost)
    with pytest.raises(ValueError, match="cost"):
        relationship_vectors(cost, "features")


def test_matching_keeps_mutual_argmax_pairs_most_similar_first():
    a = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    b = np.array([[1.0, 0.05], [0.1, 1.0]])
    pairs = match(a, b)
    # row 1 prefers b[0], which prefers row 0: no pair for row 1; cos 0.9988 before cos 0.9950
    assert [(i, j) for i, j, _ in pairs] == [(0, 0), (2, 1)]
    assert pairs[0][2] == pytest.approx(1 / np.sqrt(1.0025)) and pairs[1][2] == pytest.approx(1 / np.sqrt(1.01))


def test_nearest_prototype_uses_only_the_party_component_and_shared_modalities():
    comp = np.zeros((2, 2, 2, 2), np.float32)
    comp[0, 0, 0] = [1, 0]
    comp[1, 0, 0] = [0, 1]
    comp[1, 1, 0] = [1, 0]  # party 1's component of prototype 1 is irrelevant for party 0
    mask = np.zeros((2, 2, 2), bool)
    mask[0, 0, 0] = mask[1, 0, 0] = mask[1, 1, 0] = True
    protos = PrototypeSet(comp, mask, np.array([0, 1]))
    idx, sim = nearest_prototype(np.array([[[0.1, 1.0], [5.0, 5.0]]]), np.array([[True, False]]), protos, 0)
    assert idx[0] == 1 and sim[0] == pytest.approx(1 / np.sqrt(1.01))
    idx, _ = nearest_prototype(np.array([[[0.1, 1.0], [5.0, 5.0]]]), np.array([[False, True]]), protos, 0)
    assert idx[0] == -1  # the row's audio meets no prototype's audio


def test_pair_similarity_is_one_minus_the_cost_to_the_chosen_prototype():
    from fedtune.methods.bomm.alignment import pair_similarity

    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 2, 5))
    xmask = np.array([[True, True], [True, False], [False, True], [True, True]])
    comp = rng.normal(size=(3, 2, 2, 5)).astype(np.float32)
    cmask = np.ones((3, 2, 2), bool)
    cmask[2, 1, 1] = False
    protos = PrototypeSet(comp, cmask, np.arange(3))
    idx = np.array([0, 2, 2, -1])
    got = pair_similarity(x, xmask, protos, idx, 1)
    cost = cost_matrix(x, xmask, comp[:, 1], cmask[:, 1])
    np.testing.assert_allclose(got[:2], 1 - cost[[0, 1], [0, 2]], rtol=1e-5)
    assert got[2] == 0.0 and got[3] == 0.0  # row 2's audio meets no audio in prototype 2; no prototype
