"""Shared pieces of the heterogeneous-rank LoRA baselines (HeteroLoRA, FlexLoRA, FedStackLoRA)
beyond array algebra (which lives in :mod:`fedtune.methods.base.lora_arrays`): the reversible merge of
a dense Delta W into the shared base model, and the client that trains a server-named rank.

Client i trains a rank-r_i adapter, r_i = ``client_rank(profile, r)`` <= r (the global rank).
PEFT computes ``W0 + s B A`` with ``s = alpha / rank``; the methods take that scale explicitly
wherever a product ``s_i B_i A_i`` is formed, so aggregation is exact in W space.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch

from fedtune.methods.base.lora import LoraClient
from fedtune.protocol.messages import Message


# -- reversible merge of a dense Delta W into the shared base model (FedStackLoRA) -------------
def _base_weight(workspace, path: str) -> torch.Tensor:
    module = workspace.base.get_submodule(path)
    get_base = getattr(module, "get_base_layer", None)
    return (get_base() if get_base is not None else module).weight


@contextmanager
def merged_into_base(workspace, deltas: Mapping[str, np.ndarray]) -> Iterator[None]:
    """Run the body with ``W0 + Delta W`` in the workspace's frozen base layers; restore W0.

    ``deltas`` maps a module path to its (m, n) Delta W (a convolution's (c_out, c_in kh kw)).
    The base weights are copied before and copied back afterwards (also on error), so the restore
    is exact: the next client, or the server's evaluation in the same process, sees W0 untouched."""
    saved: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for path, delta in deltas.items():
                weight = _base_weight(workspace, path)
                d = torch.as_tensor(np.asarray(delta), dtype=weight.dtype, device=weight.device)
                if d.shape != weight.shape and d.T.shape == weight.shape:  # fan_in_fan_out layers
                    d = d.T
                elif d.shape != weight.shape and d.numel() == weight.numel():  # a convolution's (c_out, c_in kh kw)
                    d = d.reshape(weight.shape)
                saved[path] = weight.detach().clone()
                weight.add_(d)
        yield
    finally:
        with torch.no_grad():
            for path, original in saved.items():
                _base_weight(workspace, path).copy_(original)


# -- the client of HeteroLoRA and FlexLoRA ------------------------------------------------------
class RankedAdapterClient(LoraClient):
    """Trains the received adapter at the rank (and optional alpha) the server names in
    ``meta``; uploads its update (trained minus received, same shapes as received)."""

    def fit(self, message: Message) -> Message:
        return fit_at_sent_rank(self, message)


def fit_at_sent_rank(client: LoraClient, message: Message) -> Message:
    """``client`` trains the received adapter at the rank (and optional alpha) the server names in
    ``message.meta`` and uploads its update (trained minus received, same shapes as received)."""
    received = message.arrays
    rank = int(message.meta["rank"])
    trained, result = client.train_adapter(received, message.meta["round"], rank, message.meta.get("alpha"))
    return client.upload({k: trained[k] - received[k] for k in trained}, result, rnd=message.meta["round"])
