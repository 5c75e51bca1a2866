"""The bilevel problems the tasks supply (:class:`~fedtune.models.bilevel.BilevelProblem`, RABO eq.
(1)-(2)) to RABO, RAFBO and the full-model bilevel baseline: outer variables x, inner variables y,
and per client i an inner loss g_i(x, y) and an outer loss f_i(x, y), over the task's data and
model.

A problem names its tensors (``outer`` x, ``inner`` y, and which of them are ``buffers``: batch-
norm statistics, carried and averaged but never differentiated), gives their initial values, the
:class:`~fedtune.methods.rabo.masks.Structure` that masks them, each client's data of a round, the
two losses on (sub-)tensors, and the evaluation of the global (x, y).

- :class:`HyperRepresentation`, the few-shot task (RABO Sec. V-A, Franceschi et al. 2018):
  x = the 4-block conv backbone, y = linear heads fitted **per episode** on its support set.
  g_i = sum over its episodes j of [support cross-entropy + (lambda / 2) ||y_j||^2], f_i = the mean
  query cross-entropy (the task's :meth:`~fedtune.tasks.few_shot.FewShot.support_loss` /
  ``query_loss`` with an explicit head (times B for g), plus the L2 term that makes g strongly
  convex in y, Assumption 1; with K support images in d dimensions the cross-entropy alone is
  flat in most directions of y_j, and the hypergradient grows like 1 / lambda there).
  *Shared or per-episode head.* The paper writes one y with y*(x) in argmin_y sum_{i,j} L_{S_j}(x, y)
  and aggregates y on the server (eq. (6)). In an N-way episode the labels 0..N-1 are a random
  assignment of the episode's classes, so a head shared by all episodes has no class to learn:
  its minimizer averages over label permutations and predicts about uniformly, and f(x, y*(x))
  would not depend on how well x separates an episode's classes. The hyper-representation
  problem the paper cites (and its few-shot baselines ProtoNet, MAML) fits a head per task; we
  read y as the collection of the episodes' heads. Client i's B episodes of round q own the
  slot ``[i]`` of y (shape (clients, B, N, d)), so every head is covered by its own client
  (C_y = 1) and eq. (6) returns each client its own fitted heads y_{q+1}; new episodes start from
  y_q = 0 every round (``reset_inner``). Their input columns follow the backbone's last channel
  mask ("both feature extractor x and classifier y are followed the same model capacities").
  The paper's ResNet-12 is replaced by the task's Conv4 (2 CPU cores). Evaluation is the task's:
  with ``task.head = "fitted"`` (and head_steps / head_lr = T / beta, as the recipes set) it fits
  the same heads as the inner problem (without lambda); with the default prototype head it scores
  the learned representation with ProtoNet's classifier instead.
- :class:`LossTuning`, the image task with a long-tailed pool (RABO Sec. V-B, VS loss of Kini et
  al. 2021): x = the VS loss's per-class (w, l, Delta), y = the model; each client splits
  its shard 80/20 into train and validation. g_i = mean_i w_{y_i} CE(Delta (.) z_i + l, y_i) on
  train batches (+ lambda / 2 ||y||^2), f_i = the class-balanced cross-entropy on validation
  batches (classes weighted by the inverse of their count in the client's validation split),
  which depends on x only through y*(x). The paper writes f as "L_VS^val(x, y*(x))"; with the
  weights w inside f the outer problem is minimized by moving weight to the easiest class, so we
  use the balanced loss that AutoBalance and FedNest's experiments tune for
  (``options.outer_loss = "vs"`` gives the literal form, w normalized as F.cross_entropy does).
  x holds (x_w, l, x_Delta) with w = C softmax(x_w) (mean 1) and Delta = exp(x_Delta - max x_Delta)
  (largest 1): positive, and of a fixed overall scale, without which the hypergradient steps
  inflated w or Delta and the inner SGD steps (fixed beta) diverged in our runs. x is never pruned ("each client must
  optimize the full hyper-parameters x, thus we can only prune inner parameters").

The methods require the task capability ``bilevel`` (declared by the few-shot and image-
classification tasks, the two problems above). A task can offer its own split instead:
:func:`bilevel_problem` uses ``task.bilevel_problem(context, options)`` when the task has one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedtune.models.bilevel import BilevelProblem, Tensors, gradient_steps
from fedtune.models.precision import to_device
from fedtune.models.structure import CLIENT_SLOT, Member, Structure, structure_of
from fedtune.models.tensors import load_tensors, to_numpy, trainable_tensors
from fedtune.models.training import seed_for


def _model_tensors(model: torch.nn.Module, names: list[str]) -> dict[str, np.ndarray]:
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    return {n: to_numpy(state[n]).astype(np.float32, copy=False) for n in names}


class HyperRepresentation(BilevelProblem):
    """Few-shot hyper-representation learning: x backbone, y per-episode heads (module docstring)."""

    reset_inner = True

    def __init__(self, context: Any, options: Any) -> None:
        super().__init__(context, options)
        task, model = context.task, context.model
        params = [n for n, p in model.named_parameters()]
        groups = task.parameter_groups(params + [n for n, b in model.named_buffers() if b.is_floating_point()])
        self.outer = list(groups["backbone"])
        self.buffers = {n for n, b in model.named_buffers() if n in self.outer}
        self.inner = ["episodes.weight", "episodes.bias"]
        self.episodes = self.config.train.batch_size  # B: the meta-batch
        self.n_way, self.dim = task.opts.n_way, model.backbone.out_dim
        self.clients = self.config.federation.num_clients

    def initial(self):
        x = _model_tensors(self.context.model, self.outer)
        y = {
            "episodes.weight": np.zeros((self.clients, self.episodes, self.n_way, self.dim), np.float32),
            "episodes.bias": np.zeros((self.clients, self.episodes, self.n_way), np.float32),
        }
        return x, y

    def structure(self) -> Structure:
        full = structure_of(self.context.model, self.context.task.head_modules())
        last = next(g for g in full.groups if any(m.tensor == "head.weight" and m.dim == 1 for m in g.members))
        repeat = next(m.repeat for m in last.members if m.tensor == "head.weight")
        shapes = {
            "episodes.weight": (self.clients, self.episodes, self.n_way, self.dim),
            "episodes.bias": (self.clients, self.episodes, self.n_way),
        }
        return full.restricted(self.outer).extended(
            shapes,
            {
                last.name: [Member("episodes.weight", 3, repeat)],
                CLIENT_SLOT: [Member("episodes.weight", 0), Member("episodes.bias", 0)],
            },
            {CLIENT_SLOT: self.clients},
        )

    def data(self, cid: int, rnd: int):
        rng = np.random.default_rng(seed_for(self.config.seed, rnd, cid, 0xB1))
        pool = self.context.partitions[cid]
        return to_device(next(iter(self.context.task.train_batches(pool, self.episodes, 1, rng))), self.device)

    # -- the losses -------------------------------------------------------------------------------
    def embed(self, x: Tensors, images: torch.Tensor) -> torch.Tensor:
        """The backbone (x, possibly a sliced sub-model) on images (B, M, 1, S, S) -> (B, M, d)."""
        backbone = {n.removeprefix("backbone."): t for n, t in x.items()}
        emb = functional_call(self.context.model.backbone, backbone, (images.flatten(0, 1),))
        return emb.view(*images.shape[:2], -1)

    @staticmethod
    def _heads(y: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
        w, b = y["episodes.weight"], y["episodes.bias"]  # (1, B, N, d), (1, B, N): the client's slot
        return w.reshape(w.shape[-3:]), b.reshape(b.shape[-2:])

    def _support_loss(self, emb: torch.Tensor, y: Tensors, batch) -> torch.Tensor:
        """sum_j [CE(support_j; y_j) + (lambda / 2) ||y_j||^2]: summed over the episodes, so each
        head takes its own full gradient step (as the task's ``fit_head`` does; the sum's scale
        does not change the hypergradient)."""
        from fedtune.models.fewshot import episode_cross_entropy, linear_logits

        head = self._heads(y)
        ce = episode_cross_entropy(linear_logits(emb, head), batch.support_labels).sum()
        return ce + 0.5 * self.options.inner_l2 * sum((t**2).sum() for t in head)

    def g(self, x, y, batch):
        return self._support_loss(self.embed(x, batch.support), y, batch)

    def f(self, x, y, batch):
        from fedtune.models.fewshot import episode_cross_entropy, linear_logits

        return episode_cross_entropy(
            linear_logits(self.embed(x, batch.query), self._heads(y)), batch.query_labels
        ).mean()

    def inner_batches(self, data, steps):
        return [data] * steps  # T full-batch steps on each episode's support set

    def hyper_batches(self, data):
        return data, data  # xi: the support sets, zeta: the query sets of the same episodes

    def inner_solve(self, x, y0, batches, lr, masks=None):
        """T steps on the heads with the support embeddings computed once (x is fixed; batch-norm
        statistics of that forward are not kept)."""
        x = {n: t.clone() if n in self.buffers else t for n, t in x.items()}
        with torch.no_grad():
            emb = self.embed(x, batches[0].support)
        names = list(self.inner)
        ys = gradient_steps(
            lambda xs, ys: self._support_loss(emb, dict(zip(names, ys)), batches[0]),
            [],
            [y0[n] for n in names],
            len(batches),
            lr,
            None if masks is None else [masks.get(n) for n in names],
        )
        return dict(zip(names, ys))

    def evaluate(self, x, y):
        model = self.context.model
        tensors = trainable_tensors(model)
        with torch.no_grad():
            for n, a in x.items():
                tensors[n].copy_(torch.as_tensor(a))
        return self.context.task.evaluate(model, self.config.train.eval_batch_size)


class LossTuning(BilevelProblem):
    """VS-loss tuning on a long-tailed image task: x = (x_w, l, x_Delta) (see vs_parameters), y = the model."""

    X = ("vs.w", "vs.l", "vs.delta")

    def __init__(self, context: Any, options: Any) -> None:
        super().__init__(context, options)
        self.outer = list(self.X)
        tensors = trainable_tensors(context.model)
        self.inner = list(tensors)
        self.buffers = {n for n, t in tensors.items() if not isinstance(t, torch.nn.Parameter)}
        self.classes = context.task.num_labels

    def initial(self):
        x = {n: np.zeros(self.classes, np.float32) for n in self.outer}
        return x, _model_tensors(self.context.model, self.inner)

    def structure(self) -> Structure:
        return (
            structure_of(self.context.model, self.context.task.head_modules())
            .restricted(self.inner)
            .extended({n: (self.classes,) for n in self.outer}, {})
        )

    def split(self, cid: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``cid``'s shard cut 80/20 into train and validation (seeded by the run and client)."""
        pool = np.asarray(self.context.partitions[cid])
        order = pool[np.random.default_rng([self.config.seed, cid, 0x5917]).permutation(len(pool))]
        cut = max(1, min(len(order) - 1, int(round(0.8 * len(order)))))
        return np.sort(order[:cut]), np.sort(order[cut:])

    def data(self, cid: int, rnd: int):
        train, val = self.split(cid)
        counts = np.bincount(self.context.task.train.labels[val], minlength=self.classes).astype(np.float32)
        inverse = np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0).astype(np.float32)
        weights = torch.from_numpy(inverse).to(self.device)
        return {"train": train, "val": val, "weights": weights, "cid": cid, "round": rnd}

    def _batches(self, data, pool: np.ndarray, steps: int, tag: int) -> list:
        rng = np.random.default_rng(seed_for(self.config.seed, data["round"], data["cid"], tag))
        return to_device(
            list(self.context.task.train_batches(pool, self.config.train.batch_size, steps, rng)), self.device
        )

    def inner_batches(self, data, steps):
        return self._batches(data, data["train"], steps, 0xA1)

    def hyper_batches(self, data):
        return self._batches(data, data["train"], 1, 0xA2)[0], (
            *self._batches(data, data["val"], 1, 0xA3)[0],
            data["weights"],
        )

    def logits(self, y: Tensors, inputs: torch.Tensor) -> torch.Tensor:
        return functional_call(self.context.model, y, (inputs,))

    @staticmethod
    def vs_parameters(x: Tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w, l, Delta) from x: w = C softmax(x_w) (mean 1, AutoBalance's normalization),
        Delta = exp(x_Delta - max x_Delta) (largest entry 1, as VS's (n_y / n_max)^gamma), l = x_l.
        The normalizations keep the loss's scale, and with it the inner step beta, stable."""
        w = torch.softmax(x["vs.w"], 0) * x["vs.w"].numel()
        delta = torch.exp(x["vs.delta"] - x["vs.delta"].max())
        return w, x["vs.l"], delta

    def _vs(self, x: Tensors, logits: torch.Tensor, labels: torch.Tensor, normalized: bool) -> torch.Tensor:
        """The VS loss -w_y log softmax(Delta (.) z + l)_y (Kini et al. 2021), mean over the batch
        (``normalized``: divided by the sum of the batch's weights, as F.cross_entropy's weight)."""
        w, l, delta = self.vs_parameters(x)
        ce = F.cross_entropy(logits * delta + l, labels, reduction="none")
        w = w[labels]
        return (w * ce).sum() / w.sum() if normalized else (w * ce).mean()

    def g(self, x, y, batch):
        inputs, labels = batch
        l2 = sum((t**2).sum() for n, t in y.items() if n not in self.buffers)
        return self._vs(x, self.logits(y, inputs), labels, normalized=False) + 0.5 * self.options.inner_l2 * l2

    def f(self, x, y, batch):
        inputs, labels, weights = batch
        logits = self.logits(y, inputs)
        if self.options.outer_loss == "vs":
            return self._vs(x, logits, labels, normalized=True)
        return F.cross_entropy(logits, labels, weight=weights)

    def evaluate(self, x, y):
        model = self.context.model
        load_tensors(model, y)
        metrics = self.context.task.evaluate(model, self.config.train.eval_batch_size)
        w, _, delta = (
            t.numpy() for t in self.vs_parameters({n: torch.from_numpy(np.asarray(a)) for n, a in x.items()})
        )
        metrics.update({"vs_delta_min": float(delta.min()), "vs_w_max": float(w.max()), "vs_w_min": float(w.min())})
        return metrics
