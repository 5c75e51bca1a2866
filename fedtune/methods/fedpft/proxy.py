"""Federated fine-tuning on a proxy sub-model, the part FedPFT and FedOT share.

**Server**, three collaborating parts. The proxy's *construction*
(:class:`~fedtune.methods.fedpft.construction.ProxyBuilder`, the method's own) builds it from the
task's model before round 1, usually with a distillation on a public data set (progress on
stderr), caches it in the run folder (``<method>-proxy.npz``, keyed by every setting that shapes
it; ``options.proxy_cache_dir`` shares it between runs), so a rerun skips it, and then holds it.
Its *alignment* with the full model (:class:`~fedtune.methods.fedpft.alignment.ProxyAligner`: the
public data, the teacher, the distillation runs) serves the construction and, during FL, the
method's :class:`RoundAlignment` (FedPFT's neuron-level step). The FL strategy
(:class:`ProxyStrategy`) holds both and runs the rounds: the global state is one LoRA adapter
(``self.global_arrays``, names as in the full model) averaged with FedAvg (``options.weighting``)
through the server optimizer. Evaluation plugs the adapter into the **full** model (``accuracy``,
``loss``: the paper's point) and reports the proxy with the same adapter beside it
(``proxy_accuracy``, ``proxy_loss``).

**Proxy download, through Messages only.** A client knows nothing of the proxy but what it
receives. The server remembers, per client, the proxy version the client's last valid reply
said it holds (a reply carries ``meta["proxy_version"]``; a client that was sent a message and
gave no valid reply is forgotten). A client the server knows nothing of gets the whole proxy
(every tensor of its state dict, ``proxy/<name>``, and its shape in ``meta``); a client one or
more versions behind gets the method's delta (FedPFT: the neurons changed since); an up-to-date
client gets only the adapter. Every byte is in the Message, so the engines count it; the
strategy's round metrics split out ``proxy_download_bytes`` (whole proxies) and
``neuron_download_bytes`` (deltas), payload bytes. The client keeps the version number in its
persistent ``state``; the tensors of each version live in a store of its process (its
RunContext), filled only from received Messages and shared by the clients of that process
(deduplication of identical copies, nothing more). The server's record of who holds what is not
checkpointed: after ``--resume`` (a new process, an empty store) every client downloads the proxy
again, so a resumed run counts those extra bytes; its accuracies are unaffected.

**Client.** Builds the proxy's skeleton once per process (the task's model reshaped by the
received :class:`~fedtune.methods.fedpft.ffn_proxy.ProxyShape`), loads *every* tensor of the held version
into it (nothing of the locally built weights survives), trains the received adapter on it for
``train.local_steps`` and uploads the update (trained minus received, through the upload codec).
A client whose profile says ``trains_on = "full"`` (the budget planner's choice, or stated:
:mod:`fedtune.methods.fedpft.plan`) gets no proxy: it trains the same adapter on the full model it
holds, the adapter's arrays renamed from the proxy's layer positions to the full model's layers
(FedPFT keeps every layer: the names are the same; FedOT's position p is layer ``keep[p]``, sent
as ``meta["proxy_shape"]``) and its update renamed back, so the server averages every client's
update in the one adapter space. It counts no APoZ (FedPFT's alignment pools the proxy clients'),
and the server keeps no proxy version for it.
Its reply's ``meta["peak_mem_bytes"]`` is its training memory
(:mod:`fedtune.models.train_memory`): the strategy reports ``client_peak_mem_mb`` (max over the
round's clients).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import numpy as np
import torch

from fedtune.config import ConfigError
from fedtune.methods.base.aggregation import layout_of
from fedtune.methods.base.averaging import (
    UpdateClient,
    client_weights,
    decode_update,
    mean_train_loss,
)
from fedtune.methods.base.lora import GlobalAdapterStrategy
from fedtune.methods.fedpft.construction import ProxyBuilder
from fedtune.methods.fedpft.ffn_proxy import ProxyShape, SubmodelError, apply_shape, find_stack
from fedtune.methods.fedpft.options import ProxyOptions
from fedtune.methods.fedpft.support import (
    ModelTask,
    as_arrays,
    load_tensors,
    memory_metrics,
    size_metrics,
    state_tensors,
    task_model,
    train_lora,
)
from fedtune.models.lora import LoraWorkspace
from fedtune.protocol.compression import encoded_base_name
from fedtune.protocol.context import ServerContext
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SecureSum
from fedtune.protocol.validation import ArraySpec, MetaField, spec_like

PROXY = "proxy/"  # whole-proxy arrays of a fit message


class GlobalAdapter(NamedTuple):
    """The global adapter as the clients get it: arrays (full-model names), LoRA rank and alpha."""

    arrays: dict[str, np.ndarray]
    rank: int
    alpha: float | None


class RoundAlignment:
    """Alignment of the proxy during FL, asked by the strategy in every round: what the fit
    messages ask of the clients (:meth:`fit_meta`), what the replies carry besides the update
    (:meth:`reply_spec`), and the alignment after the round's aggregation (:meth:`after_aggregate`,
    its metrics). This base aligns nothing (FedOT: the emulator stays frozen); FedPFT's is the
    neuron-level alignment of eq. (14)."""

    def fit_meta(self, rnd: int) -> dict:
        return {}

    def reply_spec(self, sent: Message) -> dict[str, ArraySpec]:
        return {}

    def after_aggregate(self, rnd: int, replies: dict[int, Message], adapter: GlobalAdapter) -> dict[str, float]:
        return {}


class ProxyStrategy(GlobalAdapterStrategy):
    """Server side of FL on a proxy (module docstring): the rounds. The subclass chooses, by
    composition, how the proxy is built (``builder``: a :class:`ProxyBuilder`, which also holds the
    proxy) and aligned during FL (``alignment``: a :class:`RoundAlignment`, none by default), and
    which adapter the clients train (:meth:`adapter_budget`, :meth:`initial_adapter`)."""

    options: ProxyOptions  # the method's registered options class (resolve_run validated them)

    method_name: ClassVar[str]

    def __init__(self, context: ServerContext, builder: ProxyBuilder, alignment: RoundAlignment | None = None) -> None:
        super().__init__(context)
        self.builder = builder
        self.alignment = alignment or RoundAlignment()
        self.held: dict[int, int] = {}  # client -> proxy version its last valid reply holds
        self._sent: set[int] = set()
        self._round = -1
        self._bytes: dict[str, int] = {}

    def reply_meta_spec(self, kind: str, cid: int) -> dict[str, MetaField]:
        """The keys the server reads: the proxy version a reply holds (a full-model client's holds
        none) and the client's training memory (``peak_mem_bytes``), integers, not negative."""
        versions = {"proxy_version": MetaField(int, low=0), "peak_mem_bytes": MetaField(int, low=0)}
        return {**super().reply_meta_spec(kind, cid), **versions}

    def adapter_budget(self) -> tuple[int, float | None]:
        """(LoRA rank, alpha) of the clients' adapter, once the proxy exists (default: ``model.lora_rank``,
        the workspace's alpha)."""
        return self.config.model.lora_rank, None

    def initial_adapter(self) -> dict[str, np.ndarray]:
        """The global adapter before round 1 (default: LoRA initialized on the proxy)."""
        return self.builder.workspace.state(self.rank, self.alpha)

    @property
    def global_adapter(self) -> GlobalAdapter:
        return GlobalAdapter(self.global_arrays, self.rank, self.alpha)

    # -- Strategy -------------------------------------------------------------------------------------
    def initialize(self) -> None:
        try:
            self.builder.load_or_construct()
        except SubmodelError as exc:
            raise ConfigError(f"method {self.method_name!r}: {exc}") from None
        self.rank, self.alpha = self.adapter_budget()
        self.global_arrays = self.initial_adapter()

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        if rnd != self._round:
            self._round, self._sent, self._bytes = rnd, set(), {}
        builder, out = self.builder, {}
        bounds = (self.context.example_bound("train", cid) for cid in client_ids)
        secure = self.aggregation.secure_meta(layout_of(self.global_arrays), self.options.weighting, bounds)
        for cid in client_ids:
            if self.context.profiles[cid].trains_on == "full":
                meta = {"round": rnd, "rank": self.rank, "alpha": self.alpha, "trains_on": "full", **secure}
                out[cid] = Message(dict(self.global_arrays), {**meta, "proxy_shape": builder.shape.to_meta()})
                continue
            arrays, meta = (
                dict(self.global_arrays),
                {
                    "round": rnd,
                    "rank": self.rank,
                    "alpha": self.alpha,
                    "proxy_version": builder.version,
                    **self.alignment.fit_meta(rnd),
                    **secure,
                },
            )
            base = self.held.get(cid)
            if base is None:
                extra = as_arrays(builder.clean_tensors, PROXY)
                meta.update(proxy="full", proxy_shape=builder.shape.to_meta())
                key = "proxy_download_bytes"
            elif base != builder.version:
                extra = builder.delta(base)
                meta.update(proxy="delta", proxy_base=base)
                key = "neuron_download_bytes"
            else:
                extra, key = {}, None
            if key:
                self._bytes[key] = self._bytes.get(key, 0) + sum(a.nbytes for a in extra.values())
                count = key.replace("_bytes", "s")  # proxy_downloads, neuron_downloads: how many messages
                self._bytes[count] = self._bytes.get(count, 0) + 1
            out[cid] = Message({**arrays, **extra}, meta)
            self._sent.add(cid)
        return out

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        return {**spec_like(self.global_arrays), **self.alignment.reply_spec(sent)}

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        def combine() -> dict[str, np.ndarray]:
            updates = [
                decode_update({k: v for k, v in m.arrays.items() if encoded_base_name(k) in self.global_arrays})
                for m in replies.values()
            ]
            return self.aggregation.combine(updates, client_weights(replies, self.options.weighting))

        return self._round_step(rnd, replies, combine)

    def aggregate_secure_fit(self, rnd: int, replies: dict[int, Message], total: SecureSum) -> dict[str, float]:
        """The same round from the secure sum: theta + sum_i w_i Delta_i / sum_i w_i (the replies'
        metadata still say which proxy version each client holds, and its memory)."""
        like = self.global_arrays
        return self._round_step(rnd, replies, lambda: self.aggregation.secure_mean(rnd, total, layout_of(like), like))

    def _round_step(self, rnd: int, replies: dict[int, Message], combine) -> dict[str, float]:
        """The round's bookkeeping around the server step theta + ``combine()``: who holds which
        proxy version, the byte, memory and size metrics, then the method's alignment."""
        for cid in self._sent - set(replies):
            self.held.pop(cid, None)
        for cid, reply in replies.items():
            if "proxy_version" in reply.meta:  # a full-model client holds none
                self.held[cid] = int(reply.meta["proxy_version"])
        metrics: dict[str, float] = {k: float(v) for k, v in self._bytes.items()}
        if not replies:
            return metrics
        self.global_arrays = self.aggregation.server_opt.step(self.global_arrays, combine())
        metrics.update(mean_train_loss(replies))
        metrics.update(memory_metrics(replies))
        metrics.update(
            size_metrics(
                sum(t.numel() for t in self.builder.clean_tensors.values() if isinstance(t, torch.nn.Parameter)),
                self.global_arrays,
            )
        )
        metrics.update(self.alignment.after_aggregate(rnd, replies, self.global_adapter))
        return metrics

    def evaluate_full(self) -> dict[str, float]:
        """The adapter plugged into the full model (plug-back)."""
        return GlobalAdapterStrategy.evaluate(self, 0)

    def evaluate(self, rnd: int) -> dict[str, float]:
        metrics = self.evaluate_full()
        if self.options.eval_proxy:
            ws = self.builder.workspace
            ws.load(self.global_arrays, self.rank, self.alpha)
            proxy = self.context.task.evaluate(ws.peft_model, self.config.train.eval_batch_size)
            metrics.update({f"proxy_{k}": v for k, v in proxy.items()})
        return metrics

    def state_dict(self) -> dict:
        return {
            **super().state_dict(),
            "alpha": -1.0 if self.alpha is None else float(self.alpha),
            "proxy": self.builder.state(),
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        alpha = float(state["alpha"])
        self.alpha = None if alpha < 0 else alpha
        self.builder.load(state["proxy"])


class ProxyClient(UpdateClient):
    """Client side of FL on a proxy (module docstring): receive or update the proxy, train the
    adapter on it, upload the update."""

    @property
    def store(self) -> dict:
        """This process's proxy store (versions received through Messages, the skeleton)."""
        return vars(self.context).setdefault("_proxy_store", {"versions": {}})

    def apply_delta(self, base: dict[str, np.ndarray], message: Message) -> dict[str, np.ndarray]:
        raise RuntimeError(f"{type(self).__name__} cannot apply a proxy delta")

    def receive(self, message: Message) -> int:
        """Bring this client's proxy to the message's version; returns it."""
        meta, store = message.meta, self.store
        version, kind = int(meta["proxy_version"]), meta.get("proxy")
        held = int(self.state["proxy_version"]) if "proxy_version" in self.state else None
        if kind == "full":
            shape = ProxyShape.from_meta(meta["proxy_shape"])
            if store.get("shape") != shape:
                store.update(shape=shape, versions={}, skeleton=None, loaded=None)
            store["versions"][version] = {k[len(PROXY) :]: v for k, v in message.arrays.items() if k.startswith(PROXY)}
        elif kind == "delta":
            base = int(meta["proxy_base"])
            if held != base or base not in store["versions"]:
                raise RuntimeError(f"client {self.cid}: proxy delta from version {base}, but it holds {held}")
            store["versions"][version] = self.apply_delta(store["versions"][base], message)
        elif held != version or version not in store["versions"]:
            raise RuntimeError(f"client {self.cid}: holds proxy version {held}, the server assumed {version}")
        self.state["proxy_version"] = np.asarray(version, dtype=np.int64)
        return version

    def workspace(self, version: int) -> LoraWorkspace:
        """LoRA on the skeleton, holding proxy ``version``."""
        store = self.store
        if store.get("skeleton") is None:
            # on its device before its live tensors are taken (a move replaces buffer objects)
            model = apply_shape(task_model(self.context), store["shape"])
            store["tensors"], store["stack"] = state_tensors(model), find_stack(model)
            targets = self.proxy_targets(model)
            store["skeleton"] = LoraWorkspace(ModelTask(self.context.task, lambda: model, targets), self.config.seed)
            store["loaded"] = None
        if store["loaded"] != version:
            load_tensors(store["tensors"], store["versions"][version])
            store["loaded"] = version
        return store["skeleton"]

    def proxy_targets(self, model: torch.nn.Module) -> list[str] | None:
        return None

    def before_training(self, ws: LoraWorkspace, message: Message) -> dict[str, np.ndarray]:
        """Arrays to upload beside the update, computed before training (FedPFT: APoZ)."""
        return {}

    def train_adapter(self, ws: LoraWorkspace, received: dict[str, np.ndarray], meta: dict) -> tuple:
        """:func:`train_lora` of the ``received`` adapter (rank, alpha: ``meta``'s) on ``ws`` with this
        client's data and round seed."""
        rank, alpha = int(meta["rank"]), meta.get("alpha")
        round_seed = self.train_seed(int(meta["round"]))
        pool = self.context.partitions[self.cid]
        return train_lora(ws, received, rank, alpha, self.context.task, pool, self.config, round_seed)

    def fit_full(self, message: Message) -> Message:
        """Train the received adapter on the full model (module docstring: its arrays renamed to the
        full model's layers, the update renamed back to the proxy's positions)."""
        meta, store = message.meta, self.store
        layers = ProxyShape.from_meta(meta["proxy_shape"]).layers
        if store.get("full") is None:
            model = task_model(self.context)
            path = find_stack(model).path
            names = rename_layers(dict(message.arrays), path, layers)
            targets = sorted({k.split(".lora_A.")[0] for k in names if ".lora_A." in k})
            store["full"] = LoraWorkspace(ModelTask(self.context.task, lambda: model, targets), self.config.seed), path
        ws, path = store["full"]
        received = rename_layers(dict(message.arrays), path, layers)
        trained, result, peak = self.train_adapter(ws, received, meta)
        update = rename_layers({k: trained[k] - received[k] for k in trained}, path, layers, inverse=True)
        return self.upload(update, result, peak_mem_bytes=int(peak))

    def fit(self, message: Message) -> Message:
        meta = message.meta
        if meta.get("trains_on") == "full":
            return self.fit_full(message)
        version = self.receive(message)
        ws = self.workspace(version)
        rank, alpha = int(meta["rank"]), meta.get("alpha")
        received = {k: v for k, v in message.arrays.items() if not k.startswith(PROXY) and "/" not in k}
        ws.load(received, rank, alpha)
        extra = self.before_training(ws, message)
        trained, result, peak = self.train_adapter(ws, received, meta)
        reply = self.upload(
            {k: trained[k] - received[k] for k in trained}, result, proxy_version=version, peak_mem_bytes=int(peak)
        )
        reply.arrays.update(extra)
        return reply


def rename_layers(
    arrays: dict[str, np.ndarray], path: str, layers: tuple[int, ...] | list[int] | None, inverse: bool = False
) -> dict[str, np.ndarray]:
    """``arrays`` with the layer index after the stack's ``path`` renamed from the proxy's position
    p to the full model's layer ``layers[p]`` (``inverse``: back); None (every layer kept): unchanged."""
    if layers is None:
        return dict(arrays)
    to = {layer: p for p, layer in enumerate(layers)} if inverse else dict(enumerate(layers))
    prefix, out = path + ".", {}
    for name, a in arrays.items():
        if name.startswith(prefix):
            pos, rest = name[len(prefix) :].split(".", 1)
            name = f"{prefix}{to[int(pos)]}.{rest}"
        out[name] = a
    return out


def check_layers(stack_len: int, layers: list[int], what: str) -> None:
    bad = [i for i in layers if not 0 <= i < stack_len]
    if bad:
        raise ConfigError(f"{what}: layers {bad} do not exist (the model has {stack_len} layers)")


__all__ = [
    "PROXY",
    "GlobalAdapter",
    "ProxyClient",
    "ProxyOptions",
    "ProxyStrategy",
    "RoundAlignment",
    "check_layers",
    "rename_layers",
]
