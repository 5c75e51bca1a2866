"""Single-level federated training of sub-models (partial training), the base of the Static
(HeteroFL), FedRolex and FIARSE baselines of RABO: the server extracts a sub-model for each client
from the global model, the client trains it on the task's own loss and uploads its update at its
mask, and the server averages every entry over the clients that covered it, leaving the others
(HeteroFL's and FedRolex's ``combine``; FIARSE's ``tot_grad / tot_mask``;
:func:`~fedtune.methods.rabo.masks.covered_update`).

What travels: the model's trainable tensors (:func:`~fedtune.methods.base.full_model.trainable_tensors`,
batch-norm statistics included: averaged over their coverers like the weights, as the reference
code does for tracked statistics). The server sends each client only its sub-model (the values
at its mask and the kept unit indices) and the client uploads only its update there, so both
directions shrink with the capacity. On the package's sequential conv nets the client trains the
sliced sub-network (fewer channels, less compute); on other models it trains the full-size model
with the pruned entries zero and their gradients masked (:mod:`fedtune.methods.rabo.masks`).

Round metrics: ``train_loss``, ``C_x_round`` (the least coverage of a trained entry this round),
``C_x_star`` (its minimum over the rounds so far, RABO Definition 3), ``covered_x`` (fraction of
entries trained this round). Not implemented from the reference code: HeteroFL's static batch
norm and ``Scaler`` (on Conv4 every conv is followed by batch norm, which divides the scale out in
training) and its label-split masking of the output layer.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from fedtune.methods.base.averaging import UpdateClient
from fedtune.methods.base.full_model import ModelStateStrategy, trainable_tensors
from fedtune.methods.rabo.masks import (
    Policy,
    SubModel,
    choose_units,
    coverage_stats,
    covered_update,
    expand,
    flatten_at,
    materialize,
    submodel_of,
    take,
)
from fedtune.models.precision import model_device
from fedtune.models.structure import Structure, structure_of
from fedtune.models.training import FitResult, train_local
from fedtune.protocol.context import ClientContext
from fedtune.protocol.messages import Message
from fedtune.protocol.validation import ArraySpec, MetaField
from fedtune.registry import MethodOptions


class SubmodelOptions(MethodOptions):
    server_lr: float = Field(1.0, gt=0, description="step on the coverer-averaged update (1: the average itself)")


def model_structure(context: ClientContext) -> Structure:
    """The unit groups of the task's model over its trainable tensors."""
    names = trainable_tensors(context.model)
    return structure_of(context.model, context.task.head_modules()).restricted(names)


class SubmodelStrategy(ModelStateStrategy):
    """Partial training: per-client sub-models, parameter-wise aggregation over coverers."""

    options: SubmodelOptions  # the method's registered options class (resolve_run validated them)

    policy: Policy = "static"

    def reply_meta_spec(self, kind: str, cid: int) -> dict[str, MetaField]:
        """Aggregation reads each training reply's ``train_loss``: required and finite."""
        return self.meta_with(kind, cid, "train", train_loss=MetaField(float, required=True))

    def initialize(self) -> None:
        super().initialize()
        self.structure = model_structure(self.context)
        self.subs: dict[int, SubModel] = {}
        self.star: int | None = None

    def aggregate(self, old, contributions, scale):
        """Parameter-wise aggregation over the coverers of each entry."""
        return covered_update(old, contributions, scale)

    def capacity(self, cid: int) -> float:
        cap = self.context.profiles[cid].capacity
        return 1.0 if cap is None else float(cap)

    def submodel(self, rnd: int, cid: int) -> SubModel:
        units = {g.name: choose_units(self.policy, g, self.capacity(cid), rnd, cid) for g in self.structure.groups}
        return submodel_of(self.structure, units)

    def fit_arrays(self, sub: SubModel) -> dict[str, np.ndarray]:
        """What client ``sub`` downloads: its sub-model's values and kept units."""
        return {
            **{f"x/{n}": v for n, v in take(self.global_arrays, sub).items()},
            **{f"units/{g}": u.astype(np.int32) for g, u in sub.units.items()},
        }

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        self.subs = {cid: self.submodel(rnd, cid) for cid in client_ids}
        return {cid: Message(self.fit_arrays(sub), {"round": rnd}) for cid, sub in self.subs.items()}

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec] | None:
        sub = self.subs.get(cid)
        return None if sub is None else {f"d/{n}": ArraySpec((sub.kept(n),)) for n in self.global_arrays}

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """theta^k <- theta^k + eta (1 / C^k) sum_{i covering k} Delta_i^k; uncovered entries unchanged."""
        contributions = [
            (self.subs[cid], {n: m.arrays[f"d/{n}"] for n in self.global_arrays}) for cid, m in replies.items()
        ]
        self.global_arrays, counts = self.aggregate(self.global_arrays, contributions, self.options.server_lr)
        least, covered = coverage_stats(counts)
        metrics = {"covered_x": covered, "train_loss": float(np.mean([m.meta["train_loss"] for m in replies.values()]))}
        if least is not None:
            self.star = least if self.star is None else min(self.star, least)
            metrics.update({"C_x_round": least, "C_x_star": self.star})
        return metrics

    def state_dict(self) -> dict:
        return {**super().state_dict(), "coverage_star": self.star}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        star = state.get("coverage_star")
        self.star = None if star is None else int(star)


class SubmodelClient(UpdateClient):
    """Trains the received sub-model on the task's loss; uploads its update at its mask."""

    def receive(self, message: Message) -> tuple[SubModel, dict[str, torch.Tensor], bool]:
        """(its sub-model, the tensors it trains, whether they are sliced) from the message."""
        structure = model_structure(self.context)
        units = {k[len("units/") :]: v for k, v in message.arrays.items() if k.startswith("units/")}
        sub = submodel_of(structure, units)
        values = {k[len("x/") :]: v for k, v in message.arrays.items() if k.startswith("x/")}
        return sub, expand(values, sub, structure.physical, model_device(self.context.model)), structure.physical

    def prepare(self, model: torch.nn.Module, sub: SubModel, physical: bool, message: Message) -> None:
        """Before training: zero-masked full-size tensors keep their pruned entries at zero."""
        if physical:
            return
        for name, param in model.named_parameters():
            if name in sub.masks and param.requires_grad and not sub.masks[name].all():
                mask = torch.from_numpy(sub.masks[name]).to(param.device, param.dtype)
                param.register_hook(lambda g, m=mask: g * m)

    def finish(self, model: torch.nn.Module) -> None:
        """After training (FIARSE removes its re-parametrization here)."""

    def fit(self, message: Message) -> Message:
        rnd = int(message.meta["round"])
        sub, tensors, physical = self.receive(message)
        model = materialize(self.context.model, tensors)
        self.prepare(model, sub, physical, message)
        params = [p for p in model.parameters() if p.requires_grad]
        result: FitResult = train_local(
            model, params, self.context.task, self.context.partitions[self.cid], self.config.train, self.train_seed(rnd)
        )
        self.finish(model)
        trained = trainable_tensors(model)
        delta = {n: trained[n].detach() - tensors[n] for n in tensors}
        return Message({f"d/{n}": v for n, v in flatten_at(delta, sub, physical).items()}, result.meta())


__all__ = ["SubmodelClient", "SubmodelOptions", "SubmodelStrategy", "model_structure"]
