"""FedStackLoRA / FLoRA: stack the clients' LoRA modules and merge them into the base model
(Wang et al. 2024), FSLoRA's baseline of Section 2.2 / 5.2.

Round t: every client starts from a *freshly initialized* rank-r_i LoRA (A_i ~ PEFT's
kaiming-uniform, B_i = 0) on top of the current merged base W0 + Delta W^t, trains it with
PEFT's scale s_i = alpha / r_i for H steps, and uploads its update (B_i itself, since its init
is 0, and A_i - A_i^init: the init is drawn from (seed, round, client, module) alone, so the
server regenerates it and rebuilds A_i exactly; updates keep any top-k codec meaningful). The
server stacks along the rank axis, folding each client's weight and PEFT scale into A:

    B_stack = [B_1 ... B_N]  (m, sum r_i),  A_stack = [p_1 s_1 A_1; ...; p_N s_N A_N]  (sum r_i, n)
    B_stack A_stack = sum_i p_i s_i B_i A_i,     Delta W^{t+1} = Delta W^t + B_stack A_stack

(p_i proportional to data size; ``weighting = "uniform"``: 1/N). The head is averaged FedAvg-style.
Both go through the server optimizer (``server.optimizer``; default: exactly this sum).

Differential privacy: refused (``privacy.mode`` stops the run in one line naming the method). What
a client adds is the product s_i B_i A_i, not its uploaded factors; clipping the factors bounds the
product only through ||B_i|| ||A_i||, and noise on the factors is not a Gaussian mechanism on the sum
the server adds (the accountant's assumption). A central form would clip each s_i B_i A_i in W space
and add dense (m, n) noise to their sum, which leaves FLoRA's stacking (the noisy sum is full-rank,
so ``transport = "stacks"`` no longer applies); it is not implemented.

Transport of the merged base. Clients are stateless and share nothing with the server but
Messages, so each round the server must ship the whole merged Delta W^t (FLoRA's clients keep
their merged model; ours cannot). ``transport = "dense"`` (default): the dense (m, n) Delta W
of every adapted module, a constant m*n floats per module per client; ``"stacks"``: the stacked
factors of all past rounds concatenated ([B_stack^1 ... B_stack^t], [A_stack^1; ...]), which
grow by (m + n) sum_i r_i floats per module every round (FLoRA's wire form, cheaper only in
the first rounds). Either way the bytes accounted are the bytes sent: this download is FLoRA's
cost. Clients add Delta W to the frozen base layers of the shared model before training and
restore an exact copy afterwards (:func:`merged_into_base`), so nothing leaks to the next
client or to the server's evaluation.

The saved ``adapter/`` is W0 + Delta W exactly, as a PEFT adapter of full rank
R = max min(m, n) with lora_alpha = R (scale 1): B = U S, A = V^T.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fedtune.config import RunConfig
from fedtune.methods.base.aggregation import Aggregation, planned
from fedtune.methods.base.averaging import (
    SERVER_STEP_AND_UPLOAD_CODEC,
    Weighting,
    client_weights,
    decode_update,
    mean_train_loss,
)
from fedtune.methods.base.lora import LORA, MERGING_SCALE_OPTIONS, SERVER_DEVIATIONS, LoraClient, client_rank
from fedtune.methods.base.lora_arrays import (
    a_name,
    array_rank,
    b_name,
    fresh_lora_a,
    head_arrays,
    is_lora_a,
    lora_paths,
    lora_scale,
    shaped_like,
    stack_factors,
    svd_factors,
)
from fedtune.methods.base.ranked import merged_into_base
from fedtune.methods.base.robust import weighted_average
from fedtune.methods.base.server_optimizer import ServerOptimizer, ServerStep
from fedtune.planning.lora_plan import lora_plan
from fedtune.protocol.context import ServerContext
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import ArraySpec, spec_like
from fedtune.registry import MethodOptions, register

DENSE, STACK_B, STACK_A = ".merged_delta", ".stack_B", ".stack_A"
_DOWNLINK = (DENSE, STACK_B, STACK_A)


class FedStackLoRAOptions(MethodOptions):
    weighting: Weighting = Field("examples", description="p_i: data size (FLoRA) or 1/N")
    transport: Literal["dense", "stacks"] = Field(
        "dense", description="ship the merged Delta W dense or as all past stacks (needs the plain server step)"
    )

    deviations: ClassVar[dict[str, str]] = {
        **SERVER_DEVIATIONS,
        "options.weighting": "'uniform' departs from FLoRA's data-size weights",
    }

    def config_refusal(self, config: RunConfig) -> str | None:
        """``transport = "stacks"`` with a server step other than x + Delta (which it cannot keep)."""
        if self.transport == "stacks" and not ServerOptimizer(ServerStep.of(config.server)).is_identity:
            return (
                "options.transport: 'stacks' ships B_stack A_stack exactly, which a server optimizer other than "
                "sgd at server_lr 1 does not keep; use transport='dense'"
            )
        return None


def split_downlink(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A server message's arrays -> (head arrays, module path -> merged Delta W (m, n))."""
    head, deltas = {}, {}
    for k, v in arrays.items():
        if k.endswith(DENSE):
            deltas[k[: -len(DENSE)]] = v
        elif k.endswith(STACK_B):
            path = k[: -len(STACK_B)]
            deltas[path] = v.astype(np.float64) @ arrays[path + STACK_A].astype(np.float64)
        elif not k.endswith(STACK_A):
            head[k] = v
    return head, deltas


def fresh_adapter(shapes: Mapping[str, tuple[int, ...]], seed: int, rnd: int, cid: int) -> dict[str, np.ndarray]:
    """The LoRA pairs client ``cid`` starts round ``rnd`` from: A fresh (seeded), B = 0."""
    return {
        k: fresh_lora_a(k, s, seed, rnd, cid) if is_lora_a(k) else np.zeros(s, dtype=np.float32)
        for k, s in shapes.items()
    }


class FedStackLoRAStrategy(Strategy):
    """FedStackLoRA (FLoRA): stack B_i and p_i A_i, merge into the base (Wang et al. 2024)."""

    options: FedStackLoRAOptions  # the method's registered options class (resolve_run validated them)

    def __init__(self, context: ServerContext) -> None:
        super().__init__(context)
        self.aggregation: Aggregation = Aggregation(planned(context))

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        init = self.context.workspace.state(self.rank)
        self.head = head_arrays(init)
        self.paths = lora_paths(init)
        self.merged: dict[str, np.ndarray] = {}  # module path -> Delta W (m, n), float64
        self.stacks: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # "stacks" transport only

    def downlink(self) -> dict[str, np.ndarray]:
        """The merged-base arrays every client needs this round (nothing before the first merge)."""
        if self.options.transport == "stacks":
            out = {}
            for path, (b, a) in self.stacks.items():
                out[path + STACK_B], out[path + STACK_A] = b.astype(np.float32), a.astype(np.float32)
            return out
        return {path + DENSE: d.astype(np.float32) for path, d in self.merged.items()}

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        arrays = {**self.head, **self.downlink()}
        return {
            cid: Message(arrays, {"round": rnd, "rank": client_rank(self.context.profiles[cid], self.rank)})
            for cid in client_ids
        }

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        """The update of a fresh rank-r_i adapter and of the head (what the client trained)."""
        return spec_like(self.context.workspace.state(int(sent.meta["rank"])))

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        if not replies:
            return {}
        adapters, head_updates = [], []
        for cid, message in replies.items():
            update = decode_update(message.arrays)
            adapter = {}
            for path in self.paths:
                da = update[a_name(path)]
                adapter[a_name(path)] = fresh_lora_a(a_name(path), da.shape, self.config.seed, rnd, cid) + da
                adapter[b_name(path)] = update[b_name(path)]  # B_i^init = 0
            adapters.append(adapter)
            head_updates.append(head_arrays(update))
        weights = client_weights(replies, self.options.weighting)
        alpha = self.config.model.lora_alpha
        scales = [lora_scale(alpha, array_rank(ad)) for ad in adapters]
        products = {}
        for path, (b, a) in stack_factors(adapters, weights, scales).items():
            products[path] = b @ a  # Delta W^{t+1} - Delta W^t = B_stack A_stack
            if self.options.transport == "stacks":
                if path in self.stacks:
                    b0, a0 = self.stacks[path]
                    b, a = np.concatenate([b0, b], axis=1), np.concatenate([a0, a], axis=0)
                self.stacks[path] = (b, a)
        mean = weighted_average(head_updates, weights)
        new = self.aggregation.server_opt.step({**self.merged, **self.head}, {**products, **mean})
        self.merged = {path: v for path, v in new.items() if path in products or path in self.merged}
        self.head = {k: new[k] for k in self.head}
        stacked = sum(array_rank(ad) for ad in adapters)
        return {**mean_train_loss(replies), "stacked_rank": float(stacked)}

    def evaluate(self, rnd: int) -> dict[str, float]:
        """W0 + Delta W with the global head (the LoRA pairs are zero)."""
        ws = self.context.workspace
        params = ws.activate(self.rank)
        arrays = {k: np.zeros(tuple(p.shape), dtype=np.float32) for k, p in params.items()}
        ws.load({**arrays, **self.head}, self.rank)
        with merged_into_base(ws, self.merged):
            return self.context.task.evaluate(ws.peft_model, self.config.train.eval_batch_size)

    def state_dict(self) -> dict:
        return {
            "rank": self.rank,
            "head": dict(self.head),
            "merged": dict(self.merged),
            "stacks": {p: {"B": b, "A": a} for p, (b, a) in self.stacks.items()},
            **self.aggregation.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.rank = int(state["rank"])
        self.head = {k: np.asarray(v, dtype=np.float32) for k, v in state["head"].items()}
        self.merged = {k: np.asarray(v, dtype=np.float64) for k, v in state.get("merged", {}).items()}
        self.stacks = {p: (np.asarray(s["B"]), np.asarray(s["A"])) for p, s in state.get("stacks", {}).items()}
        self.paths = lora_paths(self.context.workspace.state(self.rank))
        self.aggregation.load_state_dict(state)

    def save(self, run_dir: Path) -> None:
        """W0 + Delta W as an exact full-rank PEFT adapter (scale 1) plus the head."""
        ws = self.context.workspace
        shapes = {k: v.shape for k, v in ws.state(self.rank).items()}
        mn = {p: (shapes[b_name(p)][0], int(np.prod(shapes[a_name(p)][1:]))) for p in self.paths}  # Delta W (m, n)
        full = max(min(m, n) for m, n in mn.values())
        arrays = dict(self.head)
        for path in self.paths:
            b, a = svd_factors(self.merged.get(path, np.zeros(mn[path])), full, 1.0)
            arrays[b_name(path)], arrays[a_name(path)] = shaped_like(b, a, shapes[b_name(path)], shapes[a_name(path)])
        ws.save_pretrained(run_dir / "adapter", arrays, full, float(full))


class FedStackLoRAClient(LoraClient):
    """Merges the received Delta W into the base (reversibly), trains a fresh rank-r_i LoRA,
    uploads B_i and A_i - A_i^init (and the head's update)."""

    def fit(self, message: Message) -> Message:
        rnd, rank = message.meta["round"], int(message.meta["rank"])
        head, deltas = split_downlink(message.arrays)
        params = self.context.workspace.activate(rank)
        shapes = {k: tuple(p.shape) for k, p in params.items() if k not in head}
        start = {**fresh_adapter(shapes, self.config.seed, rnd, self.cid), **head}
        with merged_into_base(self.context.workspace, deltas):
            trained, result = self.train_adapter(start, rnd, rank)
        return self.upload({k: trained[k] - start[k] for k in trained}, result)


register(
    "fedstacklora",
    FedStackLoRAStrategy,
    FedStackLoRAClient,
    FedStackLoRAOptions,
    requires=LORA,
    supports=(*SERVER_STEP_AND_UPLOAD_CODEC, *MERGING_SCALE_OPTIONS),
    plan=lora_plan("rank"),
)
