"""Paired image + audio samples across parties (AV-MNIST style), the data BoMM starts from.

A *sample* (one id) is a handwritten digit image paired with a spoken recording of the same digit
(FSDD). K parties hold samples; what one party holds of a sample is a *row* of a
:class:`PairedSet`. Every row carries:

- ``sample_ids``: the sample's id. An *aligned* id is held by every party (K rows, one per party;
  the paper's D_k^a, "same sample ID across K parties"); an *unaligned* id by one party only
  (D_k^ua). ``aligned`` flags the rows of aligned ids.
- ``party``: the party holding the row (-1 in a test set).
- ``image_index`` / ``audio_index``: the image and the recording, indices into the set's
  ``images`` (:class:`~fedtune.data.images.ImageSet`) and ``audio``
  (:class:`~fedtune.data.audio.AudioSet`). The parties' rows of an aligned id share its image
  and each hold a *different* recording of the same digit: the analogue of the paper's MS COCO
  set, where aligned samples share the image and each party holds its own caption. Audio plays
  the paper's text modality.
- ``masks``: (N, 2) bool, which modalities the row has, columns in :data:`MODALITIES` order
  (image, audio). The absent modality's data is never to be read.
- ``labeled``: whether the party knows the row's label (D_k^l vs D_k^ul). ``labels`` holds
  every row's true digit so that runs can measure, e.g., matching accuracy; training code
  must read only the labels of labeled rows.

Construction (:func:`build_paired_train`, seeded; independent random streams for the draws
below, so that changing Delta changes only the masks):

1. Ids: ``aligned + K * unaligned`` training images drawn class-balanced (class c gets floor or
   ceil of the total / C; which classes get the extra ones is seeded), then put in a seeded
   random order: ids ``0 .. aligned-1`` are the aligned ones, then party 0's unaligned ids,
   party 1's, ...
2. Pairing: within each digit, a seeded permutation of that digit's recordings is consumed in
   order: id by id, and for an aligned id party by party, each row takes the next recording.
   No recording is used twice; a request beyond what a digit has is a ConfigError.
3. Labeled rows: in each party, exactly ``round(labeled_fraction * N_k)`` rows, a seeded draw.
4. Masks (:func:`draw_masks`): the scenario's modality is missing from a row with probability
   Delta, independently per row (so the parties' rows of an aligned id go missing
   independently). Scenarios follow BoMM (Section 5.1 / Appendix A), with audio as "text":

   - 0: nothing missing;
   - 1: audio missing with probability Delta at every party;
   - 2: party 0 complete; audio missing with probability Delta at parties 1..K-1, for aligned
     and unaligned rows alike;
   - 3: image missing with probability Delta at every party.

   Each row draws one uniform u and loses the modality when u < Delta, so the missing rows at
   a smaller Delta are a subset of those at a larger one (same seed).

The test set (:func:`build_paired_test`) pairs, within each digit, the test images with the
test recordings (seeded permutations; min of the two counts per digit), every row complete,
labeled, unaligned, party -1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fedtune.config import ConfigError

MODALITIES = ("image", "audio")
IMAGE, AUDIO = 0, 1
SCENARIOS = {
    0: "nothing missing",
    1: "audio missing with probability delta at every party",
    2: "party 0 complete; audio missing with probability delta at parties 1..K-1",
    3: "image missing with probability delta at every party",
}
_STREAM = {"ids": 11, "audio": 12, "labeled": 13, "masks": 14, "test": 15}


def missing_modality(scenario: int) -> int | None:
    """The column of :data:`MODALITIES` that ``scenario`` removes (None for scenario 0)."""
    _check_scenario(scenario)
    return {0: None, 1: AUDIO, 2: AUDIO, 3: IMAGE}[scenario]


def affected_parties(scenario: int, num_parties: int) -> list[int]:
    """The parties whose rows may lose a modality under ``scenario``."""
    _check_scenario(scenario)
    if scenario == 0:
        return []
    return list(range(1, num_parties)) if scenario == 2 else list(range(num_parties))


def _check_scenario(scenario: int) -> None:
    if scenario not in SCENARIOS:
        known = "; ".join(f"{k}: {v}" for k, v in SCENARIOS.items())
        raise ConfigError(f"task.scenario: expected one of {sorted(SCENARIOS)} ({known}), got {scenario!r}")


@dataclass(frozen=True)
class PartyData:
    """What one party holds: its rows (indices into the pool) and their per-row fields."""

    party: int
    rows: np.ndarray
    sample_ids: np.ndarray
    masks: np.ndarray
    aligned: np.ndarray
    labeled: np.ndarray


@dataclass
class PairedSet:
    """Rows of paired image + audio samples (see the module docstring for every field)."""

    sample_ids: np.ndarray  # (N,) int64
    party: np.ndarray  # (N,) int64, -1 in a test set
    labels: np.ndarray  # (N,) int64, the true digit of every row
    masks: np.ndarray  # (N, 2) bool, columns MODALITIES = (image, audio)
    aligned: np.ndarray  # (N,) bool
    labeled: np.ndarray  # (N,) bool
    image_index: np.ndarray  # (N,) int64 into images
    audio_index: np.ndarray  # (N,) int64 into audio
    images: Any  # ImageSet: the image source
    audio: Any  # AudioSet: the recording source
    label_names: list[str]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def subset(self, idx) -> PairedSet:
        idx = np.asarray(idx, dtype=np.int64)
        return replace(self, **{f: getattr(self, f)[idx] for f in _ROW_FIELDS})

    def with_modalities(self, present: tuple[bool, bool]) -> PairedSet:
        """The same rows with the masks of every row set to ``present`` (test variants)."""
        return replace(self, masks=np.tile(np.asarray(present, dtype=bool), (len(self), 1)))

    @property
    def num_parties(self) -> int:
        return int(self.party.max()) + 1 if len(self) and self.party.max() >= 0 else 0

    def party_data(self, k: int) -> PartyData:
        rows = np.flatnonzero(self.party == k)
        return PartyData(k, rows, self.sample_ids[rows], self.masks[rows], self.aligned[rows], self.labeled[rows])

    def parties(self) -> list[PartyData]:
        return [self.party_data(k) for k in range(self.num_parties)]


_ROW_FIELDS = ("sample_ids", "party", "labels", "masks", "aligned", "labeled", "image_index", "audio_index")


def draw_masks(
    party: np.ndarray, scenario: int, delta: float, num_parties: int, rng: np.random.Generator
) -> np.ndarray:
    """(N, 2) modality masks for rows held by ``party``: one uniform u per row; the scenario's
    modality is absent where u < ``delta`` and the row's party is affected."""
    if not 0.0 <= delta <= 1.0:
        raise ConfigError(f"task.delta: expected a probability in [0, 1], got {delta}")
    masks = np.ones((len(party), len(MODALITIES)), dtype=bool)
    u = rng.random(len(party))
    column = missing_modality(scenario)
    if column is not None:
        masks[:, column] = ~((u < delta) & np.isin(party, affected_parties(scenario, num_parties)))
    return masks


def _class_quotas(total: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    quotas = np.full(num_classes, total // num_classes, dtype=np.int64)
    quotas[rng.permutation(num_classes)[: total % num_classes]] += 1
    return quotas


def build_paired_train(
    images: Any,
    audio: Any,
    num_parties: int,
    aligned: int,
    unaligned: int,
    labeled_fraction: float,
    delta: float,
    scenario: int,
    seed: int,
) -> PairedSet:
    """The parties' training rows (module docstring, steps 1-4)."""
    if num_parties < 1:
        raise ConfigError(f"federation.num_clients: expected at least 1 party, got {num_parties}")
    if not 0.0 <= labeled_fraction <= 1.0:
        raise ConfigError(f"task.labeled_fraction: expected a fraction in [0, 1], got {labeled_fraction}")
    names = list(images.label_names)
    num_classes = len(names)
    # 1. ids: class-balanced images, seeded order
    rng = np.random.default_rng([seed, _STREAM["ids"]])
    n_ids = aligned + num_parties * unaligned
    quotas = _class_quotas(n_ids, num_classes, rng)
    chosen = []
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(images.labels == c))
        if quotas[c] > len(members):
            raise ConfigError(
                f"task.unaligned: {aligned} aligned + {num_parties} x {unaligned} unaligned samples need {quotas[c]} "
                f"images of class {names[c]!r}; the image set has {len(members)}"
            )
        chosen.append(members[: quotas[c]])
    id_image = np.concatenate(chosen)[rng.permutation(n_ids)]
    id_label = images.labels[id_image].astype(np.int64)
    # rows: party-major; within a party its aligned ids then its unaligned ids
    row_id = np.concatenate(
        [
            np.concatenate([np.arange(aligned), aligned + k * unaligned + np.arange(unaligned)])
            for k in range(num_parties)
        ]
    ).astype(np.int64)
    row_party = np.repeat(np.arange(num_parties), aligned + unaligned)
    # 2. pairing: per digit, a seeded permutation of its recordings consumed id by id, party by party
    rng = np.random.default_rng([seed, _STREAM["audio"]])
    queues = {c: list(rng.permutation(np.flatnonzero(audio.labels == c))) for c in range(num_classes)}
    row_audio = np.empty(len(row_id), dtype=np.int64)
    order = np.lexsort((row_party, row_id))  # rows by id, then party
    for r in order:
        c = int(id_label[row_id[r]])
        if not queues[c]:
            need = int(np.sum(id_label[row_id] == c))
            raise ConfigError(
                f"task.unaligned: {aligned} aligned + {num_parties} x {unaligned} unaligned samples need {need} "
                f"recordings of {names[c]!r}; the audio set has {int(np.sum(audio.labels == c))}"
            )
        row_audio[r] = queues[c].pop(0)
    # 3. labeled rows: an exact count per party
    rng = np.random.default_rng([seed, _STREAM["labeled"]])
    labeled = np.zeros(len(row_id), dtype=bool)
    for k in range(num_parties):
        rows = np.flatnonzero(row_party == k)
        labeled[rows[rng.permutation(len(rows))[: int(round(labeled_fraction * len(rows)))]]] = True
    # 4. masks
    masks = draw_masks(row_party, scenario, delta, num_parties, np.random.default_rng([seed, _STREAM["masks"]]))
    return PairedSet(
        sample_ids=row_id,
        party=row_party.astype(np.int64),
        labels=id_label[row_id],
        masks=masks,
        aligned=row_id < aligned,
        labeled=labeled,
        image_index=id_image[row_id],
        audio_index=row_audio,
        images=images,
        audio=audio,
        label_names=names,
    )


def build_paired_test(images: Any, audio: Any, seed: int = 0) -> PairedSet:
    """Complete test rows: within each digit, the first min(#images, #recordings) of seeded
    permutations of both paired in order; rows sorted by (digit, pair)."""
    rng = np.random.default_rng([seed, _STREAM["test"]])
    image_rows, audio_rows = [], []
    for c in range(len(images.label_names)):
        imgs = rng.permutation(np.flatnonzero(images.labels == c))
        auds = rng.permutation(np.flatnonzero(audio.labels == c))
        n = min(len(imgs), len(auds))
        image_rows.append(imgs[:n])
        audio_rows.append(auds[:n])
    image_index = np.concatenate(image_rows).astype(np.int64)
    n = len(image_index)
    return PairedSet(
        sample_ids=np.arange(n, dtype=np.int64),
        party=np.full(n, -1, dtype=np.int64),
        labels=images.labels[image_index].astype(np.int64),
        masks=np.ones((n, len(MODALITIES)), dtype=bool),
        aligned=np.zeros(n, dtype=bool),
        labeled=np.ones(n, dtype=bool),
        image_index=image_index,
        audio_index=np.concatenate(audio_rows).astype(np.int64),
        images=images,
        audio=audio,
        label_names=list(images.label_names),
    )
