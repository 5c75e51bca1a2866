"""FSLoRA: federated sketching LoRA (Fang et al. 2025), Algorithm 1.

The server keeps, per adapted module, one global rank-r pair B (m, r), A (r, n) (r =
``model.lora_rank``) and the classifier head. Round t, for each sampled client i:

1. **Sketch** (Def. 3.1): the server draws S_i^t = (r/k_i) sum_{j in I} e_j e_j^T, i.e. an index
   set I of k_i = ``client_rank(profile, r)`` ranks (``profile.sketch_ratio``), uniform without
   replacement, sorted, from a generator seeded by (run seed, round, client id) alone: reproducible
   and independent of the sampling order, and E[S] = I_r. **One index set per client per round,
   shared by every LoRA pair** (the paper draws one sketch S_i^t per device per round);
   ``options.per_module_sketch = true`` draws an independent set per module instead.
2. **Download**: the dense global modules and I (``options.download = "dense"``, as in the paper),
   or only the active slices B[:, I], A[I, :], the head and I (``"active"``).
3. **Local training**, eq. (4): the client trains W0 + (alpha/r) B S A for H steps with the
   configured optimizer (``train.optimizer``; Algorithm 1 takes plain SGD steps, see below). Since B
   S A = (r/k) B[:, I] A[I, :], this is a PEFT LoRA adapter of rank k *with the same lora_alpha*:
   PEFT's scaling alpha/k equals (alpha/r) (r/k) exactly, so W0 + (alpha/r) B S A = W0 + (alpha/k)
   B[:, I] A[I, :]. Compute is proportional to k (no dense masked product), and the gradients w.r.t.
   B[:, I], A[I, :] are those of eq. (3) restricted to I. The ranks outside I are not parameters of
   the client at all, so they stay exactly unchanged, with any optimizer: Adam's per-coordinate
   update of the slice equals dense Adam on the sketched loss (whose gradient is zero outside I),
   and weight decay (AdamW) only reaches the k active ranks (eq. (4) leaves the others untouched).
   (The published code's "scale B's gradient by S^2" trick is exact only for plain SGD, and its name
   test never matched, so it never sketched.)
4. **Upload** (Alg. 1 line 7): only Delta B[:, I] (m, k), Delta A[I, :] (k, n), the head delta
   and I (int32). ``federation.upload_topk`` applies top-k to the deltas, never to I.
5. **Aggregate**, eq. (5): the server scatters each reply back to (m, r) / (r, n) (zeros outside
   I_i) and sets X^{t+1} = X^t + sum_i p_i Delta X_i, p_i = 1/|replies| (eq. (5) with the clients
   that replied). This is a plain mean over clients, not a per-rank mean over the clients that
   drew a rank: eq. (5) keeps the 1/N. The head is averaged with the same weights, as in FedIT.
   The sum goes through the server optimizer (``server.optimizer``; the default,
   plain SGD at server lr 1, is eq. (5) exactly).

**When the update is unbiased.** E[S] = I_r (Def. 3.1) makes the sketched *SGD* step unbiased:
with plain SGD (``train.optimizer = "sgd"``, eq. (4)), rank j is active with probability k/r
and its step carries the factor r/k from S (Lemma 3.2), so its expected update is that of an
unsketched step, and eq. (5)'s 1/N average keeps it so. Under an adaptive optimizer (AdamW, the
default here) the per-coordinate normalization removes the r/k factor from the step size, so
eq. (5) shrinks each rank's expected update to about k/r of an unsketched one: the sketched
update is then *not* unbiased, and small-k devices move the global adapter less per round.

Deviations from the paper (labelled in ``fedtune methods --verbose``): ``train.optimizer =
"adamw"`` (the default; Algorithm 1 uses SGD), ``train.momentum > 0`` (the published GLUE
clients' SGD momentum 0.9), ``server.optimizer = "adam"`` or ``server_lr != 1`` (the
published code's server AdamW on the averaged update; eq. (5) adds the plain mean),
``options.weighting = "examples"`` (eq. (5) weights 1/N) and ``options.per_module_sketch``
(the paper draws one S_i^t per device per round). ``options.download = "active"`` changes only
the bytes sent, not the algorithm.

**Client-level DP** (``privacy.mode``; DP-FedAvg, McMahan et al. 2018, as in
:mod:`fedtune.methods.base.privacy`). What client i uploads is U_i = (Delta B[:, I_i], Delta A[I_i, :]
of every pair, Delta head): exactly the non-zero columns / rows of its round's update, which by
eq. (4) already carry the sketch's r/k_i (the client trains W0 + (alpha/k_i) B[:, I] A[I, :] =
W0 + (alpha/r) B S A, so its steps are the sketched gradients of eq. (3)); the server applies no
further r/k. Let P_i put U_i back at I_i with zeros elsewhere (the reconstruction before eq. (5)).
P_i only places coordinates, so ||P_i U_i||_2 = ||U_i||_2. The DP form of eq. (5) is

    X^{t+1} = X^t + (sum_i P_i clip_C(U_i) + xi) / m,     xi ~ N(0, (zC)^2 I) on every coordinate
    of X (central: the server clips what it receives and adds xi once), or each client uploads
    clip_C(U_i) + N(0, (zC)^2 I) on its own k_i-rank coordinates (local),

with m = ``federation.sample_size()`` fixed and public (eq. (5)'s 1/N over the sampled clients; not
the replies). Clipping U_i is clipping P_i U_i (same norm), so the clipped quantity is the update
after the r/k of training and exactly what enters the sum. I_i is drawn from (seed, round, client)
alone, not from the client's data, so replacing client i's data changes only its term, by at most
||P_i clip(U_i) - P_i clip(U_i')|| <= 2C: the sum's replace-one sensitivity is 2C, the accountant's
assumption (multiplier z/2). The per-rank mean (rank j divided by the number n_j of clients that drew
it) would have sensitivity 2C / n_j, with n_j as small as 1 and changing every round, which no fixed
noise scale matches; eq. (5) does not divide that way and neither does this form. ``options.weighting
= "examples"`` is refused (a weight would depend on the data).

**Secure aggregation** (``secure_aggregation.enabled``, SecAgg+ on Flower): eq. (5) is a
weighted sum of the placed uploads P_i U_i over the clients, so each client places its own upload
(:meth:`FSLoRAClient.secure_vector`; it knows I_i) and masks P_i U_i; the server divides the sum by
sum_i w_i (local DP: by m). The server then cannot check a client's I_i against its draw.

With k_i = r (sketch_ratio 1) every I is 0..r-1 and FSLoRA is FedIT step for step. Evaluation and
saving use the rank-r global adapter (scaling alpha/r).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedtune.methods.base.aggregation import layout_of
from fedtune.methods.base.averaging import (
    SECURE_AGGREGATION,
    SERVER_STEP_AND_UPLOAD_CODEC,
    BroadcastAverage,
    Weighting,
    client_weights,
    decode_update,
)
from fedtune.methods.base.lora import (
    LORA,
    SCALE_OPTIONS,
    SERVER_DEVIATIONS,
    GlobalAdapterStrategy,
    LoraClient,
    client_rank,
)
from fedtune.methods.base.lora_arrays import add_ranks, lora_pairs, module_path, take_ranks
from fedtune.methods.base.privacy import PRIVACY_OPTIONS
from fedtune.planning.lora_plan import lora_plan
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import secure_layout_of
from fedtune.protocol.validation import ArraySpec, spec_like
from fedtune.registry import MethodOptions, register

SKETCH_PREFIX = "sketch/"
SHARED_SKETCH = SKETCH_PREFIX + "index"  # one index set I for every LoRA pair (int32, sorted)
_SKETCH_STREAM = 0xF5104A


class FSLoRAOptions(MethodOptions):
    weighting: Weighting = Field("uniform", description="eq. (5) mean (uniform) or FedAvg data-size weights (examples)")
    download: Literal["dense", "active"] = Field(
        "dense", description="send the dense global modules (paper) or only the active slices B[:, I], A[I, :]"
    )
    per_module_sketch: bool = Field(False, description="draw an index set per LoRA module instead of one per client")

    deviations: ClassVar[dict[str, str]] = {
        "train.optimizer": "'adamw' (the default) departs from Algorithm 1, whose eq. (4) takes plain SGD steps; "
        "E[S] = I makes SGD steps unbiased, but under AdamW eq. (5) shrinks each rank's expected update to k/r "
        "of an unsketched one",
        "train.momentum": "a value above 0 (heavy-ball SGD; the published GLUE clients use 0.9) departs from eq. (4)",
        **SERVER_DEVIATIONS,
        "options.weighting": "'examples' (data-size weights) departs from eq. (5)'s 1/N",
        "options.per_module_sketch": "true departs from the paper's one sketch S_i^t per device per round",
    }


# -- sketches -------------------------------------------------------------------------------


def sketch_indices(seed: int, rnd: int, cid: int, rank: int, k: int, stream: int = 0) -> np.ndarray:
    """Index set I of a random-k sketch S in S(r, k) (Def. 3.1): k of the r ranks, uniform
    without replacement, from (seed, round, client, stream) alone; sorted, int32, shape (k,)."""
    if not 1 <= k <= rank:
        raise ValueError(f"sketch size k={k} must be in 1..{rank}")
    rng = np.random.default_rng([int(seed), int(rnd), int(cid), int(stream), _SKETCH_STREAM])
    return np.sort(rng.choice(rank, size=k, replace=False)).astype(np.int32)


def sketch_matrix(index: np.ndarray, rank: int) -> np.ndarray:
    """The (r, r) diagonal sketch S = (r/k) sum_{j in I} e_j e_j^T (Def. 3.1), for reference."""
    diag = np.zeros(rank, dtype=np.float64)
    diag[np.asarray(index)] = rank / len(index)
    return np.diag(diag)


def sketch_key(a_name: str) -> str:
    """Message key of a per-module index set (``sketch/<module path>``)."""
    return SKETCH_PREFIX + module_path(a_name)


def is_sketch_key(name: str) -> bool:
    return name.startswith(SKETCH_PREFIX)


def sketch_arrays(indices: Mapping[str, np.ndarray], shared: bool) -> dict[str, np.ndarray]:
    """The Message arrays carrying the index sets: one shared array, or one per module."""
    if shared:
        return {SHARED_SKETCH: next(iter(indices.values()))}
    return {sketch_key(a): idx for a, idx in indices.items()}


def read_indices(
    arrays: Mapping[str, np.ndarray], pairs: list[tuple[str, str]], rank: int | None = None
) -> dict[str, np.ndarray]:
    """A name -> index set I from a Message's arrays (shared or per module), validated: int,
    1-D, unique, in 0..rank-1 when ``rank`` is given, and the same k for every pair."""
    out: dict[str, np.ndarray] = {}
    for a_name, _ in pairs:
        key = SHARED_SKETCH if SHARED_SKETCH in arrays else sketch_key(a_name)
        if key not in arrays:
            raise ValueError(f"fslora: message lacks the sketch index {key!r}")
        idx = np.asarray(arrays[key])
        if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"fslora: sketch index {key!r} must be a non-empty 1-D integer array")
        if len(np.unique(idx)) != idx.size or idx.min() < 0 or (rank is not None and idx.max() >= rank):
            raise ValueError(f"fslora: sketch index {key!r} must hold distinct ranks in 0..{rank}")
        out[a_name] = idx.astype(np.int64)
    if len({len(i) for i in out.values()}) > 1:
        raise ValueError("fslora: every module's sketch must have the same size k")
    return out


def param_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The adapter arrays of a Message, without the sketch indices."""
    return {k: v for k, v in arrays.items() if not is_sketch_key(k)}


def slice_adapter(arrays: Mapping[str, np.ndarray], indices: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rank-k adapter of the active ranks: B[:, I] (m, k), A[I, :] (k, n); the head as is."""
    return take_ranks(arrays, indices)


# -- server -------------------------------------------------------------------------------


class FSLoRAStrategy(BroadcastAverage, GlobalAdapterStrategy):
    """FSLoRA: sketched rank-k updates of a rank-r global LoRA pair (Fang et al. 2025)."""

    options: FSLoRAOptions  # the method's registered options class (resolve_run validated them)

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        self.global_arrays = self.context.workspace.state(self.rank)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return lora_pairs(self.global_arrays)

    def sketch(self, rnd: int, cid: int) -> dict[str, np.ndarray]:
        """Client ``cid``'s index sets of round ``rnd``: A name -> I (shared by all pairs unless
        ``per_module_sketch``); k_i = client_rank(profile, r)."""
        k = client_rank(self.context.profiles[cid], self.rank)
        seed = self.config.seed
        if not self.options.per_module_sketch:
            idx = sketch_indices(seed, rnd, cid, self.rank, k)
            return {a: idx for a, _ in self.pairs}
        return {a: sketch_indices(seed, rnd, cid, self.rank, k, stream=j + 1) for j, (a, _) in enumerate(self.pairs)}

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        messages = {}
        self.aggregation.asked(client_ids)
        bounds = (self.context.example_bound("train", cid) for cid in client_ids)
        secure = self.aggregation.secure_meta(layout_of(self.global_arrays), self.options.weighting, bounds)
        for cid in client_ids:
            indices = self.sketch(rnd, cid)
            arrays = (
                self.global_arrays if self.options.download == "dense" else slice_adapter(self.global_arrays, indices)
            )
            sketch = sketch_arrays(indices, shared=not self.options.per_module_sketch)
            meta = {"round": rnd, "rank": self.rank, "download": self.options.download, **secure}
            messages[cid] = Message({**arrays, **sketch}, meta)
        return messages

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        """Delta B[:, I] (m, k), Delta A[I, :] (k, n) of every pair, the head's update, and I."""
        indices = self.sketch(rnd, cid)
        update = spec_like(slice_adapter(self.global_arrays, indices))
        sketch = sketch_arrays(
            {a: idx.astype(np.int32) for a, idx in indices.items()}, not self.options.per_module_sketch
        )
        return {**update, **spec_like(sketch)}

    def _reply_indices(self, rnd: int, cid: int, reply: Message) -> dict[str, np.ndarray]:
        """The reply's index sets, checked against the server's own draw."""
        indices = read_indices(reply.arrays, self.pairs, self.rank)
        expected = self.sketch(rnd, cid)
        if any(not np.array_equal(indices[a], expected[a]) for a in expected):
            raise ValueError(f"fslora: client {cid} replied with a sketch other than the one it was sent")
        return indices

    def private_updates(self, rnd: int, replies: dict[int, Message]) -> list[dict[str, np.ndarray]]:
        """Under ``privacy.mode``: each P_i U_i (zeros outside I_i), for the DP form of the module
        docstring, (sum_i P_i clip(U_i) + xi) / m."""
        return [self.scatter(rnd, c, r, self.zeros(np.float64)) for c, r in replies.items()]

    def averaged(self, rnd: int, replies: dict[int, Message]) -> dict[str, np.ndarray]:
        """eq. (5): theta + sum_i p_i P_i U_i, each sparse update rebuilt (zeros outside I_i),
        through the server optimizer."""
        w = np.asarray(client_weights(replies, self.options.weighting), dtype=np.float64)
        total = self.zeros()
        for p_i, (cid, reply) in zip(w / w.sum(), replies.items()):
            self.scatter(rnd, cid, reply, total, float(p_i))
        return self.aggregation.server_opt.step(self.global_arrays, total)

    def zeros(self, dtype=None) -> dict[str, np.ndarray]:
        return {k: np.zeros(v.shape, dtype=dtype or v.dtype) for k, v in self.global_arrays.items()}

    def scatter(
        self, rnd: int, cid: int, reply: Message, total: dict[str, np.ndarray], weight: float = 1.0
    ) -> dict[str, np.ndarray]:
        """``total += weight P_i U_i``: client ``cid``'s upload U_i with its (m, k) / (k, n) slices put
        back into columns / rows I_i of (m, r) / (r, n) zeros (the head dense). P_i keeps the L2 norm:
        ||P_i U_i|| = ||U_i||. Returns ``total``."""
        indices = self._reply_indices(rnd, cid, reply)
        update = decode_update(param_arrays(reply.arrays))
        if update.keys() != total.keys():
            raise ValueError(
                f"fslora: client {cid} update has arrays {sorted(update.keys() ^ total.keys())[:3]} mismatched"
            )
        for name, x in update.items():  # (k, n) into rows I, (m, k) into columns I; head dense
            add_ranks(total[name], name, x, indices, weight)
        return total


# -- client -------------------------------------------------------------------------------


class FSLoRAClient(LoraClient):
    def secure_vector(self, message: Message, reply: Message) -> dict[str, np.ndarray]:
        """P_i U_i: the upload's (m, k) / (k, n) slices put at the columns / rows I_i of (m, r) /
        (r, n) zeros of the request's ``secure_layout`` (the head dense), as the server's eq. (5)
        would place them."""
        layout = secure_layout_of(message.meta)
        update = param_arrays(reply.arrays)
        indices = read_indices(reply.arrays, lora_pairs(update), int(message.meta["rank"]))
        out = {k: np.zeros(shape) for k, shape in layout.items()}
        for name, x in update.items():
            add_ranks(out[name], name, x, indices, 1.0)
        return out

    def fit(self, message: Message) -> Message:
        received = param_arrays(message.arrays)
        pairs = lora_pairs(received)
        rank = int(message.meta["rank"])
        indices = read_indices(message.arrays, pairs, rank)
        local = slice_adapter(received, indices) if message.meta["download"] == "dense" else received
        k = len(next(iter(indices.values())))
        # rank-k PEFT adapter, same lora_alpha: alpha/k = (alpha/r)(r/k), i.e. W0 + (alpha/r) B S A
        trained, result = self.train_adapter(local, message.meta["round"], k)
        update = {name: trained[name] - local[name] for name in trained}
        reply = self.upload(update, result, rnd=message.meta["round"], k=k)  # local DP: clip + noise U_i
        reply.arrays.update(
            sketch_arrays(
                {a: idx.astype(np.int32) for a, idx in indices.items()}, shared=SHARED_SKETCH in message.arrays
            )
        )
        return reply


register(
    "fslora",
    FSLoRAStrategy,
    FSLoRAClient,
    FSLoRAOptions,
    requires=LORA,
    supports=(*SERVER_STEP_AND_UPLOAD_CODEC, *SCALE_OPTIONS, *PRIVACY_OPTIONS, *SECURE_AGGREGATION),
    plan=lora_plan("sketch_ratio"),
)
