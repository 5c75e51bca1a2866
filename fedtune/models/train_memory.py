"""The memory a client's local training needs, measured from what it holds (CPU runs share one
process, so its resident size says nothing about one client).

``peak = weights + trainable x (1 gradient + optimizer states) + peak autograd-saved activations``:

- weights: every parameter and buffer of the model the client holds (each storage once);
- optimizer states: AdamW keeps 2 per trainable value, SGD with momentum 1, plain SGD none;
- activations: the tensors autograd saves for the backward pass that are not weights, counted
  once per storage while alive (a pack hook registers them, their release unregisters them),
  the maximum over the whole local training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage once."""
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        ptr, n = _storage(t)
        seen[ptr] = n
    return sum(seen.values())


class _Saved:
    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: ActivationMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.ptr)


class ActivationMeter:
    """Context manager: the peak bytes of live autograd-saved activations (weights excluded)."""

    def __init__(self, model: nn.Module) -> None:
        self.weights = {_storage(t)[0] for t in list(model.parameters()) + list(model.buffers())}
        self.live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.current = self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided or t.device.type == "meta":
            return t
        ptr, n = _storage(t)
        if ptr in self.weights or n == 0:
            return t
        entry = self.live.setdefault(ptr, [0, n])
        if entry[0] == 0:
            self.current += n
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(t, ptr, self)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def optimizer_states(optimizer: str, momentum: float = 0.0) -> int:
    """Per-value states of ``train.optimizer``: AdamW 2, SGD with momentum 1, plain SGD 0."""
    return 2 if optimizer == "adamw" else int(momentum > 0)


def training_peak_bytes(model: nn.Module, trainable: list[nn.Parameter], states: int, activations: int) -> int:
    """weights + trainable x (1 + states) + activations (see the module docstring)."""
    return weight_bytes(model) + sum(p.numel() * p.element_size() for p in trainable) * (1 + states) + activations
