"""A small multimodal classifier for paired image + audio rows with missing modalities.

:class:`FusionClassifier`: one :class:`~fedtune.models.audio.ConvEncoder` per modality (image:
(B, C, H, W) pixels, globally pooled; audio: (B, n_mels, frames) log-mels, pooled to four
frequency bands like :class:`~fedtune.models.audio.AudioConvNet`), each projecting to a shared
``embed_dim``; fusion is the *mean of the present modalities' embeddings* (per row, by the mask);
then dropout and a linear head ``classifier``. An encoder runs only on the rows where its
modality is present, so an absent modality's input is never read and never enters its batch-norm
statistics; a row with no modality at all would fuse to zeros (the head's bias).

Since a row with one modality is classified from that modality's embedding alone, the same head
also reads single embeddings: :meth:`FusionClassifier.all_logits` gives the fused logits and each
modality's own, for a training loss that asks every present modality to classify on its own too
(the task's ``unimodal_weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from fedtune.models.audio import LOG_MEL_GRID, ConvEncoder

FUSION_CNN = "fusion-cnn"
MODALITY_NAMES = ("image", "audio")  # the mask's columns (fedtune.data.paired.MODALITIES)


class FusionClassifier(nn.Module):
    def __init__(
        self,
        num_labels: int,
        image_channels: int,
        embed_dim: int = 64,
        channels: tuple[int, ...] = (16, 32, 64),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.encoders = nn.ModuleDict(
            {
                "image": ConvEncoder(image_channels, channels, embed_dim),
                "audio": ConvEncoder(1, channels, embed_dim, grid=LOG_MEL_GRID),
            }
        )
        self.embed_dim = embed_dim
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(embed_dim, num_labels)

    def embed(self, image: torch.Tensor, audio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, 2, embed_dim) per-modality embeddings, zeros where the modality is absent."""
        inputs = {"image": image, "audio": audio}
        mask = mask.bool()
        columns = []
        for m, name in enumerate(MODALITY_NAMES):
            rows = torch.nonzero(mask[:, m], as_tuple=True)[0]
            out = torch.zeros(len(mask), self.embed_dim, dtype=torch.float32, device=mask.device)
            if len(rows):
                out = out.index_put((rows,), self.encoders[name](inputs[name][rows]))
            columns.append(out)
        return torch.stack(columns, dim=1)

    @staticmethod
    def fuse(embeddings: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean over the present modalities: sum_m mask_m e_m / max(1, sum_m mask_m)."""
        weights = mask.float().unsqueeze(-1)
        return (embeddings * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def forward(self, image: torch.Tensor, audio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, num_labels) logits of the fused embedding."""
        return self.classifier(self.dropout(self.fuse(self.embed(image, audio, mask), mask)))

    def all_logits(
        self, image: torch.Tensor, audio: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fused logits (B, C), each modality's own logits (B, 2, C)): the head applied to the
        fused embedding and to every modality's embedding alone (rows where a modality is
        absent hold the head's output for zeros; mask them out)."""
        emb = self.embed(image, audio, mask)
        return self.classifier(self.dropout(self.fuse(emb, mask))), self.classifier(self.dropout(emb))
