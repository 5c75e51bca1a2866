"""CLIP-style dual encoders by name: BoMM's representation backbone phi for image + text data (the
paper's parties run CLIP-base / CLIP-large), for users with a network.

:class:`DualEncoder` wraps any Hugging Face model with ``get_image_features`` and
``get_text_features`` (CLIP, SigLIP, ...; ``AutoModel.from_pretrained(name)`` and its
``AutoProcessor``), and returns each modality's projected embedding as float32 numpy rows, the
form BoMM's parties send. ``tiny-clip`` is a random 1-layer CLIP (hidden 16, projection 12,
16 x 16 images, a hashing word tokenizer) built in code, for tests: nothing is downloaded.

Nothing offline has CLIP weights (see the data README), so the paired task here uses the frozen
MobileNetV2 of :mod:`~fedtune.methods.bomm.backbone`; an image + caption task (MS COCO, CUB-200 with
Reed et al.'s captions: :mod:`~fedtune.data.captions`) would use a DualEncoder as phi.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

TINY_CLIP = "tiny-clip"
_TINY_VOCAB, _TINY_LEN, _TINY_SIDE = 99, 16, 16


def _tiny_clip() -> torch.nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = dict(
        vocab_size=_TINY_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=_TINY_LEN,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=_TINY_SIDE,
        patch_size=8,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=12)).eval()


def _hash_tokens(texts: Sequence[str]) -> dict[str, torch.Tensor]:
    """tiny-clip's tokenizer: bos, one id per lower-cased word (a stable hash), eos, padded."""
    import zlib

    rows = []
    for text in texts:
        ids = [2 + zlib.crc32(w.encode()) % (_TINY_VOCAB - 2) for w in text.lower().split()][: _TINY_LEN - 2]
        rows.append([0, *ids, 1])
    width = max(len(r) for r in rows)
    ids = torch.ones(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _tensor(out: Any) -> torch.Tensor:
    """transformers 4 returns the projected features; 5 a model output holding them in ``pooler_output``."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class DualEncoder:
    """A frozen image / text dual encoder by name (``tiny-clip``, or a hub name or local path)."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == TINY_CLIP:
            self.model, self.processor = _tiny_clip(), None
        else:
            from transformers import AutoModel, AutoProcessor

            self.model = AutoModel.from_pretrained(name).eval()
            self.processor = AutoProcessor.from_pretrained(name)
        self.model.requires_grad_(False)

    @property
    def dim(self) -> int:
        return int(self.model.config.projection_dim)

    @torch.inference_mode()
    def encode_images(self, images: Sequence[Any] | np.ndarray, batch_size: int = 64) -> np.ndarray:
        """(N, dim) embeddings of images (PIL images or uint8 (H, W, C) arrays)."""
        out = []
        for i in range(0, len(images), batch_size):
            chunk = images[i : i + batch_size]
            if self.processor is None:
                x = torch.as_tensor(np.stack([np.asarray(im, dtype=np.float32) for im in chunk])) / 255.0
                x = x.permute(0, 3, 1, 2) if x.dim() == 4 else x[:, None].expand(-1, 3, -1, -1)
                if x.shape[1] == 1:
                    x = x.expand(-1, 3, -1, -1)
                pixels = torch.nn.functional.interpolate(x, size=(_TINY_SIDE, _TINY_SIDE), mode="bilinear")
            else:
                pixels = self.processor(images=list(chunk), return_tensors="pt")["pixel_values"]
            out.append(_tensor(self.model.get_image_features(pixel_values=pixels)).float())
        return torch.cat(out).numpy() if out else np.zeros((0, self.dim), np.float32)

    @torch.inference_mode()
    def encode_texts(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """(N, dim) embeddings of captions."""
        out = []
        for i in range(0, len(texts), batch_size):
            chunk = list(texts[i : i + batch_size])
            if self.processor is None:
                inputs = _hash_tokens(chunk)
            else:
                inputs = self.processor(text=chunk, return_tensors="pt", padding=True, truncation=True)
                inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
            out.append(_tensor(self.model.get_text_features(**inputs)).float())
        return torch.cat(out).numpy() if out else np.zeros((0, self.dim), np.float32)
