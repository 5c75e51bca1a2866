"""The cloud model's frozen backbone phi: pretrained features of each modality, computed where the
data is.

BoMM's cloud model f_psi is a multimodal "large" model; here it is a frozen pretrained backbone phi
plus the cloud's trainable classifier psi_1 and generator psi_2 (:mod:`~fedtune.methods.bomm.networks`),
which read phi's representations. phi is public (like a CLIP or LLaVA vision tower), so a party runs
it on its own rows and sends representations, never raw samples; the server runs it on the public
test set to evaluate the cloud model.

``mobilenet-v2`` (the only backbone offline): torchvision's ImageNet MobileNetV2
(:func:`fedtune.models.vision.pretrained_mobilenet_v2`), its ``features`` trunk globally average-pooled
to D = 1280. Images (the paired task's [-1, 1] tensors) are mapped back to [0, 1], repeated to three
channels, normalized with the ImageNet statistics and resized bilinearly to ``size`` x ``size``; a
log-mel spectrogram (standardized by the task) is read as a one-channel image, repeated to three
channels and resized the same way (ImageNet CNNs on spectrograms are a common audio baseline).
Measured (logistic regression on the features, digits images / FSDD test clips): 83% / 75% at
32 x 32 inputs, 97% / 79% at 64 x 64 (8x slower).

Features are cached per process, task and split (:func:`source_features`), computed only for the
indices asked for: a party computes them for the modalities its rows hold, never for an absent one.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedtune.config import ConfigError
from fedtune.models.audio import seeded
from fedtune.models.precision import place
from fedtune.models.tensors import to_numpy

FEATURE_DIM = 1280
BACKBONES = ("mobilenet-v2",)
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


class FrozenBackbone(nn.Module):
    """phi: (B, C, H, W) images in [-1, 1] or (B, n_mels, frames) log-mels -> (B, 1280) features."""

    def __init__(self, size: int) -> None:
        from fedtune.models.vision import pretrained_mobilenet_v2

        super().__init__()
        self.trunk = pretrained_mobilenet_v2().features.eval()
        self.trunk.requires_grad_(False)
        self.size = size
        self.register_buffer("mean", torch.tensor(_IMAGENET_MEAN).reshape(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(_IMAGENET_STD).reshape(1, 3, 1, 1))

    @torch.inference_mode()
    def encode(self, x: torch.Tensor, modality: str, batch_size: int = 64) -> torch.Tensor:
        """(len(x), 1280) features, computed in batches of exactly ``batch_size`` (the last one
        zero-padded): an item's features then do not depend on which items it was encoded with
        (CPU kernels pick their arithmetic by batch shape), so a resumed run computes what an
        uninterrupted one did."""
        out = []
        for i in range(0, len(x), batch_size):
            b = x[i : i + batch_size].float().to(self.mean.device)  # host source tensors
            n = len(b)
            if n < batch_size:
                b = torch.cat([b, b.new_zeros((batch_size - n, *b.shape[1:]))])
            if b.dim() == 3:  # log-mel (B, n_mels, frames)
                b = b.unsqueeze(1)
            if modality == "image":
                b = b * 0.5 + 0.5  # the paired task's [-1, 1] back to [0, 1]
            b = b.expand(-1, 3, -1, -1) if b.shape[1] == 1 else b
            if modality == "image":
                b = (b - self.mean) / self.std
            b = F.interpolate(b, size=(self.size, self.size), mode="bilinear", align_corners=False)
            out.append(F.adaptive_avg_pool2d(self.trunk(b), 1).flatten(1)[:n])
        return torch.cat(out) if out else torch.zeros(0, FEATURE_DIM, device=self.mean.device)


_MODELS: dict[tuple[str, int], FrozenBackbone] = {}
_CACHE: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()


def get_backbone(name: str, size: int, device: torch.device = torch.device("cpu")) -> FrozenBackbone:
    """The process's copy of backbone ``name`` at input side ``size`` on ``device`` (loaded once)."""
    if name not in BACKBONES:
        raise ConfigError(f"options.backbone: expected one of {', '.join(BACKBONES)}, got {name!r}")
    key = (name, size, str(device))
    if key not in _MODELS:
        # built under a fixed seed with the caller's RNG state restored: torchvision initializes the
        # layers randomly before the pretrained weights replace them, and that draw must not shift
        # the caller's random stream (a resumed run builds it in a later round than an uninterrupted one)
        _MODELS[key] = place(seeded(0, lambda: FrozenBackbone(size)), device)
    return _MODELS[key]


def source_features(
    task: Any, split: int, modality: str, indices: np.ndarray, name: str, size: int, device: torch.device
) -> np.ndarray:
    """(len(indices), 1280) float32 phi-features of the task's ``split`` (0 train, 1 test) source
    tensors ``task.tensors[split][modality]`` at ``indices``, encoded on ``device``; each source
    item is encoded once per process (cached on the task object, on the host)."""
    indices = np.asarray(indices, dtype=np.int64)
    source = task.tensors[split][modality]
    per_task = _CACHE.setdefault(task, {})
    key = (split, modality, name, size)
    if key not in per_task:
        per_task[key] = (np.zeros((len(source), FEATURE_DIM), dtype=np.float32), np.zeros(len(source), dtype=bool))
    feats, done = per_task[key]
    todo = np.unique(indices[~done[indices]])
    if len(todo):
        feats[todo] = to_numpy(get_backbone(name, size, device).encode(source[torch.from_numpy(todo)], modality))
        done[todo] = True
    return feats[indices].copy()
