"""Proxy construction, the part of the server that makes and keeps the proxy sub-model.

A :class:`ProxyBuilder` builds the proxy before FL from the task's model (its method's
construction: FedPFT's sub-FFN compression by saliency, Sec. 3.4, and layer-level distillation,
eq. 13; FedOT's uniform layer drop and emulator distillation), usually aligning it on public data
through a :class:`~fedtune.methods.fedpft.alignment.ProxyAligner`, with progress on stderr. It
caches the result in the run folder (``<method>-proxy.npz``, keyed by every setting that shapes
it; ``options.proxy_cache_dir`` shares it between runs as ``<method>-proxy-<key>.npz``), so a
rerun loads it instead. It then holds the proxy module, its tensors as a client downloads them,
and the LoRA workspace on it, and describes the proxy as named arrays and JSON values (what
differs from the task's model: the cache's and the checkpoint's ``proxy`` entry), from which
:meth:`ProxyBuilder.rebuild` makes it again. The proxy's ``version`` counts the changes made to
it during FL (FedPFT's neuron-level alignment); :meth:`ProxyBuilder.delta` brings a client's older
version up to date.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from fedtune.checkpoint import load_state, save_state
from fedtune.methods.fedpft.alignment import ProxyAligner
from fedtune.methods.fedpft.ffn_proxy import ProxyShape
from fedtune.methods.fedpft.options import ProxyOptions
from fedtune.methods.fedpft.support import ModelTask, state_tensors
from fedtune.models.lora import LoraWorkspace
from fedtune.protocol.context import ServerContext, options_as


class ProxyBuilder(ABC):
    """Builds or loads the proxy, holds it and describes it (module docstring). A subclass is one
    construction: :meth:`construct`, :meth:`rebuild`, :meth:`describe`, :meth:`restore`,
    :attr:`shape` and, when the clients' LoRA targets differ from the task's, :meth:`lora_targets`.
    ``context``: the server's RunContext; ``method_name`` names the cache files."""

    def __init__(self, context: ServerContext, aligner: ProxyAligner, method_name: str) -> None:
        self.context = context
        self.config, self.options = context.config, options_as(context, ProxyOptions)
        self.aligner = aligner
        self.method_name = method_name
        self.version = 0  # the proxy's version (FedPFT bumps it at each neuron-level alignment)
        self.record: dict = {}  # how the proxy was made (JSON-able; "cache": the file it came from)
        self._proxy: torch.nn.Module | None = None
        self._loaded_state: dict | None = None  # the state of a checkpoint, until the proxy is rebuilt from it

    # -- what a construction provides ---------------------------------------------------------------
    @abstractmethod
    def construct(self) -> tuple[torch.nn.Module, dict]:
        """The proxy before FL (built, distilled) and a JSON-able record of how it was made."""

    @abstractmethod
    def rebuild(self, state: dict) -> torch.nn.Module:
        """The proxy from :meth:`describe`'s ``state`` (and the task's model), after :meth:`restore`."""

    @abstractmethod
    def describe(self) -> dict:
        """The proxy as named arrays and JSON values (what differs from the task's model)."""

    @abstractmethod
    def restore(self, state: dict) -> None:
        """Read what the builder keeps beside the module from :meth:`describe`'s ``state``."""

    @property
    @abstractmethod
    def shape(self) -> ProxyShape:
        """The proxy's shape (which FFN neurons each compressed layer keeps, which layers it keeps)."""

    def lora_targets(self) -> list[str] | None:
        """LoRA targets on the proxy (None: the task's)."""
        return None

    def delta(self, base: int) -> dict[str, np.ndarray]:
        """Arrays that bring a client from proxy version ``base`` to :attr:`version`."""
        raise RuntimeError(f"{type(self).__name__}: the proxy never changes, yet a client holds version {base}")

    # -- the proxy ------------------------------------------------------------------------------------
    @property
    def proxy(self) -> torch.nn.Module:
        """The proxy module (wrapped in place by :attr:`workspace` once that exists)."""
        if self._proxy is None:
            if self._loaded_state is None:
                raise RuntimeError("the proxy is neither built (initialize) nor loaded (load_state_dict)")
            self._proxy = self.rebuild(self._loaded_state)
        return self._proxy

    @cached_property
    def clean_tensors(self) -> dict[str, torch.Tensor]:
        """The proxy's state dict as the client downloads it (names before LoRA wrapping), live."""
        return state_tensors(self.proxy)

    @cached_property
    def workspace(self) -> LoraWorkspace:
        """LoRA on the proxy (the clients' model), for evaluation and alignment."""
        _ = self.clean_tensors  # before PEFT wraps the proxy in place
        return LoraWorkspace(ModelTask(self.context.task, lambda: self.proxy, self.lora_targets()), self.config.seed)

    def state(self) -> dict:
        """:meth:`describe`, or the loaded checkpoint's state as it is while the proxy is not rebuilt."""
        if self._proxy is None and self._loaded_state is not None:
            return self._loaded_state
        return self.describe()

    def load(self, state: dict) -> None:
        """Take the proxy from a checkpoint's ``state``; the module is rebuilt when first used."""
        self._loaded_state, self._proxy = state, None
        self.restore(state)
        self.__dict__.pop("clean_tensors", None)
        self.__dict__.pop("workspace", None)

    # -- cache ----------------------------------------------------------------------------------------
    def cache_key(self) -> str:
        c, o = self.config, self.options
        # the run's seed shapes the proxy through the distillation's draw (distill_seed overrides it) and,
        # without a public set, through the clients' pool that the held-out examples complement
        seeds = [o.distill_seed_of(c.seed), c.seed if o.distill_data is None else None]
        what = {
            "method": self.method_name,
            "seeds": seeds,
            "task": c.task.model_dump(mode="json"),
            "model": c.model.model_dump(mode="json", include={"name", "finetune"}),
            "data": c.data.model_dump(mode="json", include={"name", "data_dir", "max_train_samples", "max_length"}),
            "options": {k: getattr(o, k) for k in type(o).proxy_fields},
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def cache_paths(self) -> list[Path]:
        paths = [self.context.run.run_dir / f"{self.method_name}-proxy.npz"]
        if self.options.proxy_cache_dir:
            paths.append(Path(self.options.proxy_cache_dir) / f"{self.method_name}-proxy-{self.cache_key()}.npz")
        return paths

    def load_or_construct(self) -> None:
        """The proxy from the first cache file of the same key, else :meth:`construct`; then
        written to every cache path that has no file yet."""
        key = self.cache_key()
        for path in self.cache_paths():
            if path.is_file():
                cached = load_state(path)
                if cached.get("key") == key:
                    self._loaded_state, self.record = cached["proxy"], {**cached.get("record", {}), "cache": str(path)}
                    self.restore(self._loaded_state)
                    self._proxy = self.rebuild(self._loaded_state)
                    break
        else:
            self._proxy, self.record = self.construct()
        state = {
            "key": key,
            "proxy": self.state(),
            "record": {k: v for k, v in self.record.items() if k != "cache"},
        }
        for path in self.cache_paths():
            if not path.is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                save_state(path, state)


__all__ = ["ProxyBuilder"]
