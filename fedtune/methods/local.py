"""Local: every client trains its own adapter alone, no aggregation (reference lower bound).

The server sends the common initial adapter once, in a client's first message; the client keeps
its adapter in its persistent state and never uploads weights. Evaluation is federated: every
client evaluates its own adapter on the test set, and each reported metric is the plain mean of
the clients' (the accuracy's, the loss's and every other metric all clients report, e.g. ROUGE-L;
``accuracy_std`` the accuracies' spread).
"""

from __future__ import annotations

import numpy as np

from fedtune.methods.base.averaging import mean_train_loss
from fedtune.methods.base.lora import LORA, SCALE_OPTIONS, LoraClient
from fedtune.methods.fedit import FedITStrategy
from fedtune.planning.lora_plan import lora_plan
from fedtune.protocol.messages import Message
from fedtune.registry import register


class LocalStrategy(FedITStrategy):
    """Local: each client trains alone; reports the mean of client accuracies."""

    def initialize(self) -> None:  # it aggregates nothing: it supports no cross-method option
        super().initialize()
        self.sent_init: set[int] = set()

    def _message(self, cid: int, rnd: int) -> Message:
        """The initial adapter until the client has answered once (a client that failed gets it
        again), then nothing but the round."""
        first = cid not in self.sent_init
        return Message(self.global_arrays if first else {}, {"round": rnd, "rank": self.rank})

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict:
        """Local clients upload metrics only, never arrays."""
        return {}

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        return {cid: self._message(cid, rnd) for cid in client_ids}

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        self.sent_init.update(replies)
        return mean_train_loss(replies)

    def evaluate(self, rnd: int) -> dict[str, float]:
        return {}

    def configure_evaluate(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        return {cid: self._message(cid, rnd) for cid in client_ids}

    def aggregate_evaluate(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """The mean over the clients of every metric all of them report as a finite number (the
        task's own: ROUGE-L, per-set accuracies, ...), ``accuracy_std`` the accuracies' spread."""
        self.sent_init.update(replies)
        metas = [m.meta for m in replies.values()]
        acc = np.array([m["accuracy"] for m in metas])
        shared = set.intersection(*[{k for k, v in m.items() if _finite_number(v)} for m in metas])
        out = {k: float(np.mean([m[k] for m in metas])) for k in sorted(shared)}
        loss = np.array([m["loss"] for m in metas])
        out.update(accuracy=float(acc.mean()), accuracy_std=float(acc.std()), loss=float(loss.mean()))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "sent_init": sorted(self.sent_init)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sent_init = set(state["sent_init"])

    def save(self, run_dir) -> None:
        """Local has no global adapter: nothing to save (client adapters stay with clients)."""


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))


class LocalClient(LoraClient):
    def _adapter(self, message: Message) -> dict[str, np.ndarray]:
        if message.arrays:
            self.state.update(message.arrays)
        return self.state

    def fit(self, message: Message) -> Message:
        trained, result = self.train_adapter(self._adapter(message), message.meta["round"], message.meta["rank"])
        self.state.update(trained)
        return Message({}, result.meta())

    def evaluate(self, message: Message) -> Message:
        ws = self.context.workspace
        ws.load(self._adapter(message), message.meta["rank"])
        return Message({}, self.context.task.evaluate(ws.peft_model, self.config.train.eval_batch_size))


register("local", LocalStrategy, LocalClient, requires=LORA, supports=SCALE_OPTIONS, plan=lora_plan(None))
