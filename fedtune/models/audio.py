"""Audio classifiers: a small conv net over log-mels (trained from scratch) and Hugging Face
audio-classification models on raw waveforms.

- ``audio-cnn``: :class:`AudioConvNet`, three conv blocks (3x3 conv, group norm, ReLU, 2x2 max
  pool; 16, 32, 64 channels) over a (n_mels, frames) log-mel, average pooling to 4 frequency
  bands (time averaged out), dropout and a linear head ``classifier`` (26k parameters); LoRA
  targets its convolutions (``conv``).
- any other name: ``AutoModelForAudioClassification.from_pretrained`` (a hub name or a local
  folder) with its feature extractor, a fresh ``num_labels`` head; inputs are waveforms
  resampled to the extractor's rate (:func:`hf_audio_inputs`). ``tiny-wav2vec2`` is a 2-layer
  Wav2Vec2 (hidden 32) built in code, for tests. LoRA targets the attention's query and value
  projections (``q_proj`` / ``v_proj`` for wav2vec2-style models, ``query`` / ``value`` for
  AST-style ones); the head is ``projector`` + ``classifier`` (or ``classifier`` alone).

Every builder seeds its own initialization (the global torch RNG is left untouched), so every
process that builds a model from the same seed gets the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from fedtune.config import ConfigError
from fedtune.process import offline_hint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Built = TypeVar("Built")

SMALL_NET = "audio-cnn"
TINY_WAV2VEC2 = "tiny-wav2vec2"
HEAD = "classifier"


class ConvBlock(nn.Module):
    """3x3 convolution (padding 1), group norm (8 groups), ReLU, 2x2 max pooling (ceil mode, so
    inputs as small as 1x1 pass). Group norm rather than batch norm: no running statistics, so
    nothing depends on which clients' batches a model saw or on the evaluation batch."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)
        self.norm = nn.GroupNorm(min(8, c_out), c_out)
        self.pool = nn.MaxPool2d(2, ceil_mode=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.norm(self.conv(x))))


class ConvEncoder(nn.Module):
    """(B, C, H, W) -> (B, out_dim): conv blocks, adaptive average pooling to a ``grid`` of
    (rows, columns) cells, flattened, then a linear projection to ``embed_dim`` when given (else
    out_dim = channels[-1] x rows x columns). A (B, H, W) input (a log-mel) is read as one
    channel. For log-mels the grid is (4, 1): time is averaged out and four frequency bands
    are kept (which band holds the energy is what tells the digits apart; a fully global pool
    trains several times slower on FSDD)."""

    def __init__(
        self,
        in_channels: int,
        channels: tuple[int, ...] = (16, 32, 64),
        embed_dim: int | None = None,
        grid: tuple[int, int] = (1, 1),
    ) -> None:
        super().__init__()
        widths = (in_channels, *channels)
        self.blocks = nn.Sequential(*[ConvBlock(a, b) for a, b in zip(widths[:-1], widths[1:])])
        self.grid: tuple[int, int] = (grid[0], grid[1])
        flat = channels[-1] * self.grid[0] * self.grid[1]
        self.proj = nn.Linear(flat, embed_dim) if embed_dim else None
        self.out_dim = embed_dim or flat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x.unsqueeze(1) if x.dim() == 3 else x)
        h = nn.functional.adaptive_avg_pool2d(h, self.grid).flatten(1)
        return self.proj(h) if self.proj is not None else h


LOG_MEL_GRID = (4, 1)  # 4 frequency bands x time averaged


class AudioConvNet(nn.Module):
    """Log-mel (B, n_mels, frames) -> logits (B, num_labels)."""

    def __init__(self, num_labels: int, channels: tuple[int, ...] = (16, 32, 64), dropout: float = 0.1) -> None:
        super().__init__()
        self.encoder = ConvEncoder(1, channels, grid=LOG_MEL_GRID)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(self.encoder.out_dim, num_labels)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.encoder(input_features)))


def seeded(seed: int, build: Callable[[], Built]) -> Built:
    """``build()`` under ``torch.manual_seed(seed)``, the global RNG state restored afterwards."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build()


def is_small_net(name: str) -> bool:
    return name == SMALL_NET


def build_small_net(num_labels: int, seed: int) -> AudioConvNet:
    return seeded(seed, lambda: AudioConvNet(num_labels))


def conv_features(n_mels: int, channels: tuple[int, ...] = (16, 32, 64)) -> tuple[ConvEncoder, int]:
    """(the log-mel encoder of :class:`AudioConvNet`, its output width): (B, n_mels, frames) ->
    (B, 4 x channels[-1]). Adaptive pooling makes it independent of ``n_mels`` and ``frames``;
    initialized from the global torch RNG (seed it first)."""
    encoder = ConvEncoder(1, channels, grid=LOG_MEL_GRID)
    return encoder, encoder.out_dim


# -- Hugging Face audio-classification models ----------------------------------------------------
def _tiny_wav2vec2(num_labels: int) -> PreTrainedModel:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = Wav2Vec2Config(  # type: ignore[call-arg]  # num_labels: PretrainedConfig's, not in the stub
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16, 16),
        conv_kernel=(10, 8, 8),
        conv_stride=(5, 8, 8),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        classifier_proj_size=32,
        apply_spec_augment=False,
        layerdrop=0.0,
        num_labels=num_labels,
    )
    return Wav2Vec2ForSequenceClassification(cfg)


def _tiny_wav2vec2_extractor():
    from transformers import Wav2Vec2FeatureExtractor

    return Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=False
    )


def load_audio_extractor(name: str):
    """The feature extractor of HF audio model ``name`` (its ``sampling_rate`` is the rate the
    model expects)."""
    if name == TINY_WAV2VEC2:
        return _tiny_wav2vec2_extractor()
    from transformers import AutoFeatureExtractor

    try:
        return AutoFeatureExtractor.from_pretrained(_model_path(name))
    except OSError as exc:
        raise ConfigError(
            f"model.name: cannot load the feature extractor of {name!r}{offline_hint()} ({str(exc).splitlines()[0]})"
        ) from None


def _model_path(name: str) -> str:
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def load_audio_classifier(name: str, num_labels: int, seed: int) -> PreTrainedModel:
    """HF audio-classification model ``name`` with a fresh ``num_labels`` head initialized from
    ``seed``: the head modules (:func:`audio_head_modules`) are re-initialized with PyTorch's
    default ``reset_parameters`` even when the checkpoint has a head of that size. SpecAugment
    masking is switched off (``config.apply_spec_augment = False``): it draws from numpy's
    global RNG, which no run seed controls."""
    if name == TINY_WAV2VEC2:
        return seeded(seed, lambda: _tiny_wav2vec2(num_labels))
    from transformers import AutoModelForAudioClassification
    from transformers.utils import logging as hf_logging

    from fedtune.models.loading import from_pretrained

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights are newly initialized": the head, expected
    try:
        model = from_pretrained(
            AutoModelForAudioClassification, _model_path(name), num_labels=num_labels, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.name: cannot load audio classifier {name!r}{offline_hint()} ({str(exc).splitlines()[0]})"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if hasattr(model.config, "apply_spec_augment"):
        model.config.apply_spec_augment = False

    def fresh_head() -> PreTrainedModel:
        for head in audio_head_modules(model):
            for module in model.get_submodule(head).modules():
                reset = getattr(module, "reset_parameters", None)  # a torch layer's own (third-party)
                if reset is not None:
                    reset()
        return model

    return seeded(seed, fresh_head)


_INPUT_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def hf_audio_inputs(
    extractor: Any, waves: list[np.ndarray], sample_rate: int, seconds: float
) -> dict[str, torch.Tensor]:
    """The model inputs of ``waves``: resampled to the extractor's rate, cut or zero-padded to
    ``seconds``, then through the extractor (``input_values`` for wav2vec2-style models,
    ``input_features`` for spectrogram models such as AST). Cached per process (keyed by the
    extractor's configuration, a digest of the waveforms, the rate and the length)."""
    from fedtune.data.audio import fix_length, resample, waves_digest

    key = (extractor.to_json_string(), waves_digest(waves), sample_rate, seconds)
    if key not in _INPUT_CACHE:
        rate = int(extractor.sampling_rate)
        length = int(round(seconds * rate))
        fixed = [fix_length(w, length) for w in resample(waves, sample_rate, rate)]
        enc = extractor(fixed, sampling_rate=rate, return_tensors="np")
        _INPUT_CACHE[key] = {k: torch.from_numpy(np.asarray(v)) for k, v in enc.items()}
        while len(_INPUT_CACHE) > 4:  # a training pool and a test set, of two models at most
            _INPUT_CACHE.pop(next(iter(_INPUT_CACHE)))
    return _INPUT_CACHE[key]


_ATTENTION_TARGETS = (("q_proj", "v_proj"), ("query", "value"))


def audio_lora_targets(model: nn.Module) -> list[str]:
    """The model's attention query/value projections (first naming that matches), or its
    convolutions for :class:`AudioConvNet`."""
    if isinstance(model, AudioConvNet):
        return ["conv"]
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    for pair in _ATTENTION_TARGETS:
        if set(pair) <= leaves:
            return list(pair)
    return []


def audio_model_names(name: str, num_labels: int) -> tuple[list[str], list[str]]:
    """(LoRA targets, head modules) of model ``name``, read off its module tree built on the
    meta device (no weights loaded or initialized)."""
    model: nn.Module
    if is_small_net(name):
        model = AudioConvNet(num_labels)
    else:
        with torch.device("meta"):
            if name == TINY_WAV2VEC2:
                model = _tiny_wav2vec2(num_labels)
            else:
                from transformers import AutoConfig, AutoModelForAudioClassification

                try:
                    config = AutoConfig.from_pretrained(_model_path(name), num_labels=num_labels)
                    model = AutoModelForAudioClassification.from_config(config)
                except (OSError, ValueError) as exc:
                    raise ConfigError(
                        f"model.name: cannot load audio classifier {name!r}{offline_hint()} "
                        f"({str(exc).splitlines()[0]})"
                    ) from None
    return audio_lora_targets(model), audio_head_modules(model)


def audio_head_modules(model: nn.Module) -> list[str]:
    """The freshly initialized head: the top-level ``projector`` (wav2vec2-style pooling
    projection) and ``classifier`` that the model has."""
    children = dict(model.named_children())
    return [n for n in ("projector", HEAD) if n in children]
