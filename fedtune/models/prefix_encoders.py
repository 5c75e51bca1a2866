"""The media side of :class:`~fedtune.models.prefix_lm.PrefixLM`: feature encoders and the projector.

Image encoders (:func:`build_image_encoder`): the feature part of any image model of
:mod:`fedtune.models.vision`, head dropped and outputs averaged: ``mobilenet-v2`` (pretrained
ImageNet weights, 1280 features; the default), ``efficientnet-lite0``, ``small-cnn`` and
``tiny-vit`` (random), or a Hugging Face vision model by name or path (its base model's last
hidden states). Audio encoders (:func:`build_audio_encoder`): ``audio-cnn`` (the log-mel conv net
of :mod:`fedtune.models.audio`, trained from scratch), ``log-mel`` (the log-mel itself, flattened:
fixed features, no parameters), ``tiny-wav2vec2`` or a Hugging Face audio model by name or path.
Pretrained encoders keep their batch-norm statistics fixed; nets trained from scratch normalize
with batch statistics (:func:`fix_norm_statistics`). A :class:`Projector` maps an encoder's
features to the prefix embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from fedtune.config import ConfigError


class Encoder(nn.Module):
    """A feature encoder: ``backbone`` then the mean over every axis after the feature axis
    ((B, ...) -> (B, D)). A ``pretrained`` encoder keeps its batch norms in eval mode (see
    :func:`fix_norm_statistics`)."""

    def __init__(self, backbone: nn.Module, pretrained: bool, tokens_last: bool = False) -> None:
        super().__init__()
        self.backbone = backbone
        self.pretrained = pretrained
        self.tokens_last = tokens_last  # (B, T, D) outputs (transformers): average over T
        fix_norm_statistics(self.backbone, pretrained)

    def train(self, mode: bool = True) -> Encoder:
        super().train(mode)
        if self.pretrained:
            for m in self.backbone.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.backbone(x)
        if self.tokens_last:
            return y.mean(1)
        return y.flatten(2).mean(-1) if y.dim() > 2 else y


def fix_norm_statistics(module: nn.Module, pretrained: bool) -> None:
    """Batch norms of an encoder inside federated LoRA runs: only trainable *parameters* travel
    between parties, so running statistics updated by one party's batches would differ from
    every other party's. Pretrained statistics (``pretrained``) stay fixed (:class:`Encoder`
    keeps those norms in eval mode); a net trained from scratch normalizes with each batch's own
    statistics, in training and in evaluation alike (its norms keep no running statistics)."""
    if pretrained:
        return
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None


class HFBackbone(nn.Module):
    """A Hugging Face base model: its input (``input_name``: ``pixel_values``, ``input_values``,
    ...) -> its last hidden states."""

    def __init__(self, model: nn.Module, input_name: str, **kwargs) -> None:
        super().__init__()
        self.model = model
        self.input_name = input_name
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.input_name: x}, **self.kwargs).last_hidden_state


class Projector(nn.Module):
    """(B, D) features -> (B, K, hidden) prefix embeddings: Linear(D, width), GELU,
    Linear(width, K x hidden) (``width = 0``: one Linear(D, K x hidden))."""

    def __init__(self, in_dim: int, hidden: int, num_tokens: int, width: int) -> None:
        super().__init__()
        self.num_tokens, self.hidden = num_tokens, hidden
        out = num_tokens * hidden
        self.net = (
            nn.Linear(in_dim, out)
            if width == 0
            else nn.Sequential(nn.Linear(in_dim, width), nn.GELU(), nn.Linear(width, out))
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).view(features.shape[0], self.num_tokens, self.hidden)


@dataclass(frozen=True)
class ImagePreprocessing:
    """How uint8 images become an image encoder's input (:func:`fedtune.data.images.image_tensor`)."""

    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


PRETRAINED_IMAGE = ("mobilenet-v2", "efficientnet-lite0", "hf")  # vision families with pretrained weights


def image_preprocessing(name: str, size: int | None) -> ImagePreprocessing:
    """Input side (``size``, else the model's own for ViTs and Hugging Face models, 64 for the
    conv nets) and RGB normalization of image model ``name``."""
    from fedtune.models import vision

    spec = vision.image_model_spec(name)
    side = size or (spec.image_size if spec.family in ("tiny-vit", "hf") else 64)

    def rgb(v) -> tuple[float, ...]:
        return tuple(v) * 3 if len(v) == 1 else tuple(v)

    if side is None:
        raise ConfigError(f"task.image_size: model {name!r} states no input size; set one")
    return ImagePreprocessing(int(side), rgb(spec.mean), rgb(spec.std))


def image_encoder_pretrained(name: str) -> bool:
    """Whether image model ``name`` comes with pretrained weights (then it stays frozen unless
    ``task.train_encoder`` says otherwise)."""
    from fedtune.models import vision

    return vision.image_model_spec(name).family in PRETRAINED_IMAGE


def build_image_encoder(name: str, size: int | None, seed: int) -> tuple[Encoder, ImagePreprocessing]:
    """The feature part of image model ``name`` of :mod:`fedtune.models.vision` (its head
    dropped), built from ``seed``: ``mobilenet-v2`` / ``efficientnet-lite0`` (pretrained),
    ``small-cnn``, ``tiny-vit`` (random), or a Hugging Face vision model by name or path
    (pretrained; its base model's last hidden states, averaged)."""
    from fedtune.models import vision

    spec = vision.image_model_spec(name)
    pre = image_preprocessing(name, size)
    model = vision.build_image_model(spec, 1, seed, (pre.size, pre.size), 3)
    if spec.family in ("mobilenet-v2", "small-cnn"):
        backbone, tokens_last = model.get_submodule("features"), False
    elif spec.family == "efficientnet-lite0":
        backbone, tokens_last = _EfficientNetFeatures(model), False
    elif isinstance(model, vision.HFImageClassifier):  # around a Hugging Face classifier: its base model
        extra = {"interpolate_pos_encoding": True} if model.interpolate else {}
        backbone, tokens_last = HFBackbone(model.model.base_model, "pixel_values", **extra), True
    else:
        raise TypeError(f"image model {name!r}: no encoder form for a {type(model).__name__}")
    return Encoder(backbone, spec.family in PRETRAINED_IMAGE, tokens_last), pre


class _EfficientNetFeatures(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(Any, self.model).extract_features(x)  # EfficientNet's method: the package is untyped


AUDIO_CNN = "audio-cnn"
LOG_MEL = "log-mel"


def audio_encoder_pretrained(name: str) -> bool:
    """Whether audio encoder ``name`` arrives ready (pretrained weights, or ``log-mel``'s fixed
    features): such encoders stay frozen unless ``task.train_encoder`` says otherwise."""
    from fedtune.models import audio

    return name not in (AUDIO_CNN, audio.TINY_WAV2VEC2)  # log-mel: fixed features, nothing to train


def build_audio_encoder(name: str, n_mels: int, seed: int) -> Encoder:
    """Audio encoder ``name`` built from ``seed``: ``audio-cnn`` (the log-mel conv net of
    :mod:`fedtune.models.audio`, head dropped, trained from scratch; input (B, n_mels, frames)),
    ``log-mel`` (that input flattened, (B, n_mels x frames): fixed features),
    ``tiny-wav2vec2`` (random) or a Hugging Face audio model by name or path (pretrained; its
    base model's last hidden states, averaged; input: what its feature extractor gives, for
    example ``input_values`` (B, samples))."""
    from fedtune.models import audio

    if name == LOG_MEL:
        return Encoder(nn.Flatten(1), pretrained=True)
    if name == AUDIO_CNN:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            net, _ = audio.conv_features(n_mels)
        return Encoder(net, pretrained=False)
    model = audio.load_audio_classifier(name, 1, seed)
    input_name = audio.load_audio_extractor(name).model_input_names[0]
    return Encoder(HFBackbone(model.base_model, input_name), audio_encoder_pretrained(name), tokens_last=True)


def feature_dim(encoder: nn.Module, example: torch.Tensor) -> int:
    """D of ``encoder``'s (1, D) output on one example input (a dry run, no gradient)."""
    was = encoder.training
    encoder.eval()
    with torch.no_grad():
        d = encoder(example).shape[-1]
    encoder.train(was)
    return int(d)
