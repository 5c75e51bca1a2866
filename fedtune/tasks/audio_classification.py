"""``audio-classification``: a recording in, one of C classes out.

Data (``data.name``): ``fsdd``, the Free Spoken Digit Dataset (3,000 8 kHz recordings of the
digits 0-9 by 6 speakers) read from ``fsdd-recordings.tar.gz`` in the data directory
(``data.data_dir`` or ``$FEDTUNE_DATA_DIR``), split as the dataset prescribes: recordings 0-4
of every digit and speaker are the test set (300), the rest the training pool (2,700)
(:mod:`fedtune.data.audio`).

Models (``model.name``): ``audio-cnn`` (the default; :class:`~fedtune.models.audio.AudioConvNet`
trained from scratch on log-mels: ``task.n_mels`` x ``task.frames``, each clip standardized on
its own, computed once per process), or a Hugging Face audio-classification model by name or
path on raw waveforms resampled to its feature extractor's rate and cut or padded to
``task.clip_seconds``; ``tiny-wav2vec2`` (2 layers, hidden 32, built in code) for tests. LoRA
targets the small net's convolutions or the HF model's attention query/value; the head is
``classifier`` (plus wav2vec2's ``projector``).

Partition (``task.split_by``): ``label`` uses ``data.partition`` over the digits (iid or
Dirichlet); ``speaker`` gives every client whole speakers (sorted names dealt round-robin; at
most as many clients as speakers), a feature-skewed split in which every client has every
digit. Loss: cross-entropy. Metrics: accuracy and mean cross-entropy on the test set.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedtune.config import ConfigError
from fedtune.data.audio import AudioSet, load_fsdd, log_mel, standardize_clips
from fedtune.data.batches import index_batches
from fedtune.data.text import data_dir
from fedtune.models.audio import (
    SMALL_NET,
    audio_head_modules,
    audio_model_names,
    build_small_net,
    hf_audio_inputs,
    is_small_net,
    load_audio_classifier,
    load_audio_extractor,
)
from fedtune.models.training import evaluate_classifier, freeze_except
from fedtune.tasks.base import Task, TaskOptions, register_task

AUDIO_SETS = ("fsdd",)


class LogMelOptions(TaskOptions):
    """Log-mel feature options (also used by ``paired-multimodal``)."""

    n_mels: int = Field(40, gt=0, description="mel bands of the log-mel features")
    n_fft: int = Field(256, ge=16, description="STFT window and FFT size in samples")
    hop: int = Field(80, gt=0, description="STFT hop in samples (80 = 10 ms at 8 kHz)")
    frames: int = Field(64, gt=0, description="log-mel frames per clip (clips cut or zero-padded at the end)")

    def features(self, audio: AudioSet) -> torch.Tensor:
        """(N, n_mels, frames) standardized log-mels of ``audio`` (computed once per process)."""
        feats = log_mel(
            audio.waves, audio.sample_rate, n_mels=self.n_mels, n_fft=self.n_fft, hop=self.hop, frames=self.frames
        )
        return torch.from_numpy(standardize_clips(feats))


class AudioOptions(LogMelOptions):
    clip_seconds: float = Field(1.0, gt=0, description="HF models: waveform length after resampling")
    split_by: Literal["label", "speaker"] = Field(
        "label", description="clients by data.partition over labels, or by speaker (whole speakers per client)"
    )


def logits_of(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a model that returns them (the small net) or an output holding them (HF)."""
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


@register_task
class AudioClassification(Task):
    kind = "audio-classification"
    description = "audio -> class: FSDD spoken digits (official split); log-mel conv net or HF audio models"
    capabilities = frozenset({"lora", "transformer"})

    @classmethod
    def capabilities_for(cls, config) -> frozenset[str]:
        """LoRA on every model; transformer blocks only in the HF audio models."""
        name = config.model.name or cls.defaults["model.name"]
        return cls.capabilities - {"transformer"} if is_small_net(name) else cls.capabilities

    defaults = {"data.name": "fsdd", "model.name": SMALL_NET}
    Options = AudioOptions
    peft_task_type = None  # a plain PeftModel: the small net and HF audio models take keyword tensors
    # the HF path (LoRA on linear attention projections, which every LoRA method handles)
    test_overrides = (
        "model.name=tiny-wav2vec2",
        "data.name=fsdd",
        "data.max_train_samples=96",
        "data.max_test_samples=40",
        "task.clip_seconds=0.5",
    )
    test_variants = {"conv-lora": ("model.name=audio-cnn",)}
    options: AudioOptions

    def load(self) -> tuple[AudioSet, AudioSet]:
        name = self.config.data.name
        if name not in AUDIO_SETS:
            raise ConfigError(f"data.name: audio-classification reads {', '.join(AUDIO_SETS)}; got {name!r}")
        return load_fsdd(data_dir(self.config.data))

    @property
    def label_names(self) -> list[str]:
        return self.train.label_names

    @property
    def small_net(self) -> bool:
        return is_small_net(self.model_name)

    @cached_property
    def inputs(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(training pool, test set) model inputs, computed once: standardized log-mels
        (``input_features``) for the small net, the feature extractor's output for HF models."""
        o = self.options
        if self.small_net:
            train, test = ({"input_features": o.features(ds)} for ds in self.data)
            return train, test
        extractor = load_audio_extractor(self.model_name)
        train, test = (hf_audio_inputs(extractor, ds.waves, ds.sample_rate, o.clip_seconds) for ds in self.data)
        return train, test

    def partition(self, num_clients: int, seed: int) -> list[np.ndarray]:
        if self.options.split_by == "label":
            return super().partition(num_clients, seed)
        speakers = sorted(set(self.train.speakers))
        if num_clients > len(speakers):
            raise ConfigError(
                f"federation.num_clients: task.split_by='speaker' needs at most {len(speakers)} clients "
                f"(the data has {len(speakers)} speakers), got {num_clients}"
            )
        owner = {s: i % num_clients for i, s in enumerate(speakers)}
        clients = np.array([owner[s] for s in self.train.speakers])
        return [np.flatnonzero(clients == c) for c in range(num_clients)]

    # -- model -------------------------------------------------------------------------------
    def build_model(self, seed: int) -> torch.nn.Module:
        model = (
            build_small_net(self.num_labels, seed)
            if self.small_net
            else load_audio_classifier(self.model_name, self.num_labels, seed)
        )
        return freeze_except(model, audio_head_modules(model)) if self.config.model.finetune == "head" else model

    @cached_property
    def _model_names(self) -> tuple[list[str], list[str]]:
        """(LoRA targets, head modules) of the model."""
        return audio_model_names(self.model_name, self.num_labels)

    def lora_targets(self) -> list[str]:
        return list(self._model_names[0])

    def head_modules(self) -> list[str]:
        return list(self._model_names[1])

    # -- batches, loss, metrics --------------------------------------------------------------
    def _batch(self, which: int, idx: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        idx_t = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        inputs = {k: v[idx_t] for k, v in self.inputs[which].items()}
        return inputs, torch.from_numpy(self.data[which].labels[idx])

    def train_batches(self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator):
        for idx in index_batches(np.asarray(pool, dtype=np.int64), batch_size, steps, rng):
            yield self._batch(0, idx)

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(logits_of(model, inputs), labels)

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> dict[str, float]:
        n = len(self.test)
        batches = (self._batch(1, np.arange(i, min(i + batch_size, n))) for i in range(0, n, batch_size))

        def forward(m, batch):
            inputs, labels = batch
            logits = logits_of(m, inputs)
            return logits, labels, F.cross_entropy(logits, labels)

        return evaluate_classifier(model, batches, forward)
