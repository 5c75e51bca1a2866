"""BoMM's trainable networks over phi-representations (:mod:`~fedtune.methods.bomm.backbone`).

- :class:`CloudClassifier`, psi_1: the cloud's classifier. A sample is a set of *views* (one per
  party holding it: an aligned id has K views, a newly aligned pair two, an unaligned row one), each
  with up to M modalities. Each present (view, modality) representation goes through its
  modality's MLP (LayerNorm, Linear D -> hidden, ReLU, dropout, Linear hidden -> embed); the
  embeddings are averaged (the same mean-of-present fusion as the parties'
  :class:`~fedtune.models.multimodal.FusionClassifier`) and a linear head classifies. With D = 1280,
  hidden 256 and embed 128 it has 0.73M trainable parameters (the parties' fusion CNN: 0.05M).
- :class:`Generator`, psi_2: one head per target modality, reading the other modality's
  representation (Linear D -> hidden, ReLU, Linear hidden -> hidden, ReLU, Linear hidden -> D).
- :class:`Adapters`: a party's map from phi-space into its small model's embedding space, one per
  modality (LayerNorm, Linear D -> embed_dim), so that a generated representation can stand in for
  an absent modality's embedding.

Every builder seeds its own initialization (:func:`fedtune.models.audio.seeded` does that for the
callers).
"""

from __future__ import annotations

import torch
from torch import nn


def _mlp_encoder(in_dim: int, hidden: int, out_dim: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        nn.LayerNorm(in_dim), nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out_dim)
    )


class CloudClassifier(nn.Module):
    """psi_1: (B, V, M, D) view representations with a (B, V, M) mask -> logits."""

    def __init__(
        self,
        num_labels: int,
        in_dim: int,
        modalities: int = 2,
        hidden: int = 256,
        embed: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.encoders = nn.ModuleList([_mlp_encoder(in_dim, hidden, embed, dropout) for _ in range(modalities)])
        self.embed_dim = embed
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(embed, num_labels)

    def embed(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, V, M, E) embeddings, zeros where a (view, modality) is absent (never encoded)."""
        b, v, _, _ = x.shape
        columns = []
        for mod, encoder in enumerate(self.encoders):
            where = torch.nonzero(mask[:, :, mod], as_tuple=True)
            col = torch.zeros(b, v, self.embed_dim, dtype=torch.float32, device=x.device)
            if len(where[0]):
                col = col.index_put(where, encoder(x[:, :, mod][where]))
            columns.append(col)
        return torch.stack(columns, dim=2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fused logits (B, C), each (view, modality)'s own logits (B, V, M, C); mask them)."""
        emb = self.embed(x, mask)
        w = mask.float().unsqueeze(-1)
        fused = (emb * w).sum((1, 2)) / w.sum((1, 2)).clamp_min(1.0)
        return self.classifier(self.dropout(fused)), self.classifier(self.dropout(emb))


class Generator(nn.Module):
    """psi_2: ``forward(source, target)`` maps (B, D) representations of modality 1 - target to
    (B, D) representations of ``target`` (two modalities)."""

    def __init__(self, dim: int, hidden: int = 512, modalities: int = 2) -> None:
        super().__init__()
        if modalities != 2:
            raise ValueError("the generator completes one of two modalities from the other")
        self.heads = nn.ModuleList(
            [
                nn.Sequential(
                    nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, dim)
                )
                for _ in range(modalities)
            ]
        )

    def forward(self, source: torch.Tensor, target: int) -> torch.Tensor:
        return self.heads[target](source)


class Adapters(nn.Module):
    """A party's phi-space -> small-model embedding maps, one per modality."""

    def __init__(self, in_dim: int, embed_dim: int, modalities: int = 2) -> None:
        super().__init__()
        self.maps = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, embed_dim)) for _ in range(modalities)]
        )

    def forward(self, x: torch.Tensor, modality: int) -> torch.Tensor:
        return self.maps[modality](x)
