"""``few-shot``: N-way K-shot episodes on Omniglot, alphabets split across clients, evaluation on
held-out alphabets.

Data (``data.name = "omniglot"``, :mod:`fedtune.data.omniglot`): the 8 background alphabets (242
characters x 20 drawings). ``task.test_alphabets`` (default Balinese and Tagalog, 41 characters,
one alphabet from each of the two archives) are held out for evaluation; the other 6 (201
characters) form the training pool, one class per character (with ``task.rotations`` also each
character turned by 90, 180 and 270 degrees as a new class, Snell et al. 2017, Sec. 3.1; training
pool only). RABO (Sec. V-A) splits all 50 alphabets 30/20; only the 8 background alphabets of
the small sets are here. ``data.max_train_samples`` / ``max_test_samples`` are refused: episodes
need whole characters.

Partition (:func:`split_characters`, replaces ``data.partition`` / ``data.alpha``, which are not
used, and takes no seed): with at most as many clients as training alphabets each client gets whole
alphabets (largest first, to the client with the fewest characters so far); with more clients
than alphabets every alphabet gets at least one client, the remaining clients go one at a time to
the alphabet with the most characters per client, and each alphabet's characters are cut into
that many contiguous groups. Rotated copies stay with their character. Every client needs at
least ``n_way`` classes.

Batches: ``train.batch_size`` is the meta-batch, the number of episodes per optimizer step;
``train.local_steps`` steps each draw that many episodes from the client's own classes. An
episode: ``n_way`` classes drawn without replacement, and ``k_shot + q_query`` distinct drawings
of each (the first ``k_shot`` the support set, the rest the query set), labels 0..N-1 in the
order the classes were drawn; all of it fixed by the rng. One forward pass embeds every image of the meta-batch (batch
norm statistics over the meta-batch).

Model (``model.name = "conv4"``, :mod:`fedtune.models.fewshot`): the 4-block conv backbone
(``task.filters`` channels, 64 by default) as the embedding x, and linear heads y on it.
Loss (``task.head``): the query cross-entropy of a head derived from the support set,

- ``prototype`` (default): the prototypical-network classifier in closed form, W_k = 2 c_k,
  b_k = -||c_k||^2 (Snell et al. 2017); the loss is ProtoNet's.
- ``fitted``: a linear head fitted on the support set from zero by ``task.head_steps`` gradient
  steps of size ``task.head_lr``, unrolled so the query loss trains the backbone through the fit
  (the hyper-representation problem, Franceschi et al. 2018; RABO Sec. V-A).

The model's own ``head`` (one linear layer shared by every episode) is not used by this loss; it
is y for methods that share a head (:meth:`FewShot.support_loss`, :meth:`FewShot.query_loss`:
the inner loss g and outer loss f of a bilevel method, RABO Sec. V-A).

Metrics: ``accuracy``, the mean query accuracy over ``task.eval_episodes`` episodes of the
held-out alphabets (fixed by ``task.eval_seed``, the same for every run; ``20 - k_shot`` queries
per class by default, as in RABO Sec. V-A), ``accuracy_ci95`` its 95 % interval half-width
(1.96 sd / sqrt(episodes)), ``loss`` the mean query cross-entropy, and with ``task.official_runs``
``oneshot20_accuracy``, the accuracy on the 20 official 20-way 1-shot runs of Lake et al. (400
queries, characters from the evaluation alphabets, none seen in training). The reference rate is
chance, 1/N. Evaluation runs the backbone in eval mode (batch-norm running statistics), embeds
each test image once and gathers the episodes from those embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, field_validator

from fedtune.config import ConfigError, RunConfig
from fedtune.data.omniglot import DRAWINGS, RUN_WAYS, as_tensor, load_background, load_runs
from fedtune.data.text import data_dir
from fedtune.models.fewshot import (
    FewShotNet,
    Head,
    episode_cross_entropy,
    fit_head,
    linear_logits,
    prototype_head,
)
from fedtune.models.precision import model_device
from fedtune.tasks.base import Task, TaskOptions, register_task
from fedtune.tasks.bilevel_problems import HyperRepresentation

HEAD = ["head"]
EVAL_CHUNK = 64  # episodes scored at once in evaluation


class FewShotOptions(TaskOptions):
    n_way: int = Field(5, ge=2, description="classes per episode (N)")
    k_shot: int = Field(1, ge=1, description="support drawings per class (K)")
    q_query: int = Field(5, ge=1, description="query drawings per class in training episodes")
    eval_q_query: int | None = Field(
        None, ge=1, description="query drawings per class in evaluation (default 20 - k_shot)"
    )
    eval_episodes: int = Field(600, ge=2, description="evaluation episodes on the held-out alphabets")
    eval_seed: int = Field(
        0, description="seed of the evaluation episodes (not the run's: every run tests on the same)"
    )
    test_alphabets: list[str] = Field(
        ["Balinese", "Tagalog"], min_length=1, description="alphabets held out for evaluation"
    )
    rotations: bool = Field(
        False, description="add each training character rotated by 90/180/270 degrees as new classes"
    )
    image_size: int = Field(28, ge=16, le=105, description="images are resized to image_size x image_size")
    filters: int = Field(64, gt=0, description="channels of each conv block")
    head: Literal["prototype", "fitted"] = Field("prototype", description="head of the training loss and evaluation")
    head_steps: int = Field(10, ge=0, description="gradient steps of the fitted head on the support set")
    head_lr: float = Field(0.1, gt=0, description="step size of the fitted head")
    official_runs: bool = Field(True, description="also score the 20 official 20-way 1-shot runs (all_runs.zip)")

    @field_validator("q_query", "eval_q_query")
    @classmethod
    def _fits_in_drawings(cls, value: int | None, info) -> int | None:
        k = info.data.get("k_shot", 1)
        if value is not None and k + value > DRAWINGS:
            raise ValueError(
                f"k_shot + {info.field_name} must be at most {DRAWINGS} (drawings per character), got {k} + {value}"
            )
        return value

    @field_validator("test_alphabets")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("expected distinct alphabet names")
        return value


@dataclass
class FewShotSet:
    """Images of characters, one class per character (or rotated character)."""

    images: np.ndarray  # (M, S, S) uint8 ink
    labels: np.ndarray  # (M,) int64 class id
    drawings: np.ndarray  # (M,) int64 drawer index 0..19
    class_names: list[str]  # class id -> "Alphabet/characterNN" (+ "@90" etc. for rotations)
    class_characters: list[str]  # class id -> its character "Alphabet/characterNN"

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, idx: np.ndarray) -> FewShotSet:
        return FewShotSet(
            self.images[idx], self.labels[idx], self.drawings[idx], self.class_names, self.class_characters
        )

    @property
    def alphabets(self) -> list[str]:
        return sorted({c.split("/")[0] for c in self.class_characters})


@dataclass
class Episodes:
    """B episodes of N classes: support (B, N*K, 1, S, S), query (B, N*Q, 1, S, S), labels 0..N-1;
    class j of episode b is ``classes[b, j]``; ``*_idx`` index the set the images came from."""

    support: torch.Tensor
    support_labels: torch.Tensor  # (B, N*K) int64
    query: torch.Tensor
    query_labels: torch.Tensor  # (B, N*Q) int64
    classes: np.ndarray  # (B, N)
    support_idx: np.ndarray  # (B, N*K)
    query_idx: np.ndarray  # (B, N*Q)

    @property
    def n_way(self) -> int:
        return self.classes.shape[1]

    def __len__(self) -> int:
        return len(self.classes)


def sample_episodes(
    labels: np.ndarray, pool: np.ndarray, n_way: int, k_shot: int, q_query: int, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` episodes from the examples ``pool``: (classes (count, N), support indices
    (count, N*K), query indices (count, N*Q)), class-major (class j's K support images, then the
    next class's). Classes with fewer than K + Q examples in ``pool`` are never drawn."""
    pool = np.asarray(pool)
    by_class = {c: pool[labels[pool] == c] for c in np.unique(labels[pool])}
    eligible = np.array([c for c, idx in by_class.items() if len(idx) >= k_shot + q_query], dtype=np.int64)
    if len(eligible) < n_way:
        raise ConfigError(
            f"task.n_way: {n_way}-way episodes with {k_shot}+{q_query} drawings need {n_way} classes, "
            f"this pool has {len(eligible)}"
        )
    classes = np.empty((count, n_way), dtype=np.int64)
    support = np.empty((count, n_way, k_shot), dtype=np.int64)
    query = np.empty((count, n_way, q_query), dtype=np.int64)
    for e in range(count):
        classes[e] = rng.choice(eligible, n_way, replace=False)
        for j, c in enumerate(classes[e]):
            drawn = rng.choice(by_class[c], k_shot + q_query, replace=False)
            support[e, j], query[e, j] = drawn[:k_shot], drawn[k_shot:]
    return classes, support.reshape(count, -1), query.reshape(count, -1)


def episode_labels(count: int, n_way: int, per_class: int) -> torch.Tensor:
    """(count, N * per_class): 0 repeated per_class times, then 1, ..."""
    return torch.arange(n_way).repeat_interleave(per_class).expand(count, -1).contiguous()


def split_characters(alphabets: list[str], num_clients: int) -> list[np.ndarray]:
    """Client id -> character ids, from each character's alphabet (characters of one alphabet
    contiguous): whole alphabets while clients <= alphabets, contiguous groups within alphabets
    otherwise (see the module docstring). Deterministic."""
    names = list(dict.fromkeys(alphabets))
    members = {a: np.flatnonzero(np.asarray(alphabets) == a) for a in names}
    if num_clients <= len(names):
        shards: list[list[int]] = [[] for _ in range(num_clients)]
        for a in sorted(names, key=lambda a: (-len(members[a]), a)):
            target = min(range(num_clients), key=lambda i: (len(shards[i]), i))
            shards[target].extend(members[a].tolist())
        return [np.sort(np.asarray(s, dtype=np.int64)) for s in shards]
    clients = {a: 1 for a in names}
    for _ in range(num_clients - len(names)):
        a = max(names, key=lambda a: len(members[a]) / clients[a])
        clients[a] += 1
    return [part for a in names for part in np.array_split(members[a], clients[a])]


@register_task
class FewShot(Task):
    kind = "few-shot"
    description = (
        "N-way K-shot episodes: Omniglot, alphabets split across clients; 4-block conv net, ProtoNet or "
        "fitted linear head"
    )
    defaults = {"data.name": "omniglot", "model.name": "conv4"}
    #: "bilevel": an (outer x, inner y) split of the model (backbone, per-episode heads) for the
    #: bilevel methods (RABO's hyper-representation problem, :mod:`fedtune.tasks.bilevel_problems`)
    capabilities = frozenset({"bilevel"})

    Options = FewShotOptions
    test_overrides = (
        "task.filters=8",
        "task.q_query=2",
        "task.eval_episodes=20",
        "train.batch_size=2",
        "train.local_steps=2",
    )

    def bilevel_problem(self, context: Any, options: Any) -> HyperRepresentation:
        """The bilevel methods' problem on this task
        (:class:`~fedtune.tasks.bilevel_problems.HyperRepresentation`)."""
        return HyperRepresentation(context, options)

    def __init__(self, config: RunConfig, options: FewShotOptions) -> None:
        super().__init__(config, options)
        if config.data.name not in (None, "omniglot"):
            raise ConfigError(f"data.name: the few-shot task reads 'omniglot', got {config.data.name!r}")
        if config.model.name not in (None, "conv4"):
            raise ConfigError(f"model.name: the few-shot task builds 'conv4', got {config.model.name!r}")
        for field, value in (
            ("max_train_samples", config.data.max_train_samples),
            ("max_test_samples", config.data.max_test_samples),
        ):
            if value is not None:
                raise ConfigError(
                    f"data.{field}: not used by the few-shot task (episodes need whole characters); leave it unset"
                )
        if config.model.finetune == "head":
            raise ConfigError(
                "model.finetune: 'head' would train only the shared head, which the few-shot loss does not use "
                f"(task.head = {options.head!r} derives the head from the support set); use 'full'"
            )

    @property
    def opts(self) -> FewShotOptions:
        return self.options  # type: ignore[return-value]

    # -- data --------------------------------------------------------------------------------
    def load(self) -> tuple[FewShotSet, FewShotSet]:
        o = self.opts
        bg = load_background(data_dir(self.config.data), o.image_size)
        unknown = sorted(set(o.test_alphabets) - set(bg.alphabet_names))
        if unknown:
            raise ConfigError(
                f"task.test_alphabets: unknown alphabet(s) {unknown}; expected some of {bg.alphabet_names}"
            )
        if set(o.test_alphabets) == set(bg.alphabet_names):
            raise ConfigError("task.test_alphabets: every alphabet is held out, none is left for training")
        held_out = np.isin(np.asarray(bg.alphabets), o.test_alphabets)  # per character
        test_chars, train_chars = np.flatnonzero(held_out), np.flatnonzero(~held_out)
        if len(test_chars) < o.n_way:
            raise ConfigError(
                f"task.test_alphabets: {len(test_chars)} held-out characters, {o.n_way}-way episodes need {o.n_way}"
            )
        return self._classes(bg, train_chars, o.rotations), self._classes(bg, test_chars, False)

    @staticmethod
    def _classes(bg, chars: np.ndarray, rotations: bool) -> FewShotSet:
        """Characters ``chars`` of ``bg`` as classes 0..C-1 (times 4 rotations when asked)."""
        idx = np.flatnonzero(np.isin(bg.labels, chars))
        relabel = np.searchsorted(chars, bg.labels[idx])
        names = [bg.characters[c] for c in chars]
        if not rotations:
            return FewShotSet(bg.images[idx], relabel, bg.drawings[idx], names, names)
        turns = range(4)  # class c * 4 + r: character c turned r quarter turns counterclockwise
        return FewShotSet(
            images=np.concatenate([np.rot90(bg.images[idx], r, axes=(1, 2)) for r in turns]),
            labels=np.concatenate([relabel * 4 + r for r in turns]),
            drawings=np.tile(bg.drawings[idx], 4),
            class_names=[f"{n}@{90 * r}" if r else n for n in names for r in turns],
            class_characters=[n for n in names for _ in turns],
        )

    @property
    def label_names(self) -> list[str]:
        return self.train.class_names

    def partition(self, num_clients: int, seed: int) -> list[np.ndarray]:
        """Client id -> indices of the training pool: the characters of :func:`split_characters`
        (whole alphabets, or contiguous groups within alphabets), all their drawings and
        rotations. ``data.partition``, ``data.alpha`` and ``seed`` are not used."""
        train = self.train
        characters = list(dict.fromkeys(train.class_characters))
        shards = split_characters([c.split("/")[0] for c in characters], num_clients)
        position = {c: i for i, c in enumerate(characters)}
        class_character = np.asarray([position[c] for c in train.class_characters])
        parts = []
        for cid, shard in enumerate(shards):
            classes = np.flatnonzero(np.isin(class_character, shard))
            if len(classes) < self.opts.n_way:
                raise ConfigError(
                    f"federation.num_clients: {num_clients} clients over {len(characters)} training characters in "
                    f"{len(set(train.alphabets))} alphabets leave client {cid} {len(classes)} classes; "
                    f"{self.opts.n_way}-way episodes need {self.opts.n_way} (fewer clients, a smaller task.n_way, "
                    "or task.rotations)"
                )
            parts.append(np.flatnonzero(np.isin(train.labels, classes)))
        return parts

    reference_name = "chance rate (1/N)"

    def majority_rate(self) -> float:
        """Chance in an N-way episode, 1/N (the bar a few-shot model must clear)."""
        return 1.0 / self.opts.n_way

    # -- model -------------------------------------------------------------------------------
    def build_model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return FewShotNet(self.opts.n_way, self.opts.filters, self.opts.image_size)

    def head_modules(self) -> list[str]:
        return list(HEAD)

    def parameter_groups(self, names: list[str]) -> dict[str, list[str]]:
        """``backbone`` (x, the embedding) and ``head`` (y, the shared linear head)."""
        head = [n for n in names if "head" in n.split(".")]
        return {"backbone": [n for n in names if n not in head], "head": head}

    # -- batches, loss, metrics --------------------------------------------------------------
    def episodes(self, ds: FewShotSet, classes: np.ndarray, support: np.ndarray, query: np.ndarray) -> Episodes:
        """Episodes over ``ds`` from the index arrays of :func:`sample_episodes`."""
        count, n_way = classes.shape
        return Episodes(
            support=as_tensor(ds.images[support]),
            support_labels=episode_labels(count, n_way, support.shape[1] // n_way),
            query=as_tensor(ds.images[query]),
            query_labels=episode_labels(count, n_way, query.shape[1] // n_way),
            classes=classes,
            support_idx=support,
            query_idx=query,
        )

    def train_batches(
        self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator
    ) -> Iterator[Episodes]:
        """``steps`` meta-batches of ``batch_size`` episodes each from the classes of ``pool``."""
        o = self.opts
        for _ in range(steps):
            yield self.episodes(
                self.train, *sample_episodes(self.train.labels, pool, o.n_way, o.k_shot, o.q_query, batch_size, rng)
            )

    @staticmethod
    def embed_episodes(model: FewShotNet, batch: Episodes) -> tuple[torch.Tensor, torch.Tensor]:
        """Support (B, N*K, d) and query (B, N*Q, d) embeddings, from one forward pass."""
        s, q = batch.support, batch.query
        emb = model.embed(torch.cat([s.flatten(0, 1), q.flatten(0, 1)]))
        return emb[: s.shape[0] * s.shape[1]].view(*s.shape[:2], -1), emb[s.shape[0] * s.shape[1] :].view(
            *q.shape[:2], -1
        )

    def support_head(self, emb: torch.Tensor, labels: torch.Tensor, n_way: int, create_graph: bool) -> Head:
        """The head of ``task.head`` from support embeddings (B, N*K, d): closed-form prototypes,
        or fitted from zero (differentiable with ``create_graph``)."""
        if self.opts.head == "prototype":
            return prototype_head(emb, labels, n_way)
        return fit_head(emb, labels, n_way, self.opts.head_steps, self.opts.head_lr, create_graph=create_graph)

    def loss(self, model: FewShotNet, batch: Episodes) -> torch.Tensor:  # type: ignore[override]  # its own net only
        """Mean query cross-entropy, the head derived from each episode's support set."""
        emb_s, emb_q = self.embed_episodes(model, batch)
        head = self.support_head(emb_s, batch.support_labels, batch.n_way, create_graph=True)
        return episode_cross_entropy(linear_logits(emb_q, head), batch.query_labels).mean()

    def support_loss(self, model: FewShotNet, batch: Episodes, head: Head | None = None) -> torch.Tensor:
        """g(x, y): mean support cross-entropy of ``head`` (default the model's shared head y)."""
        emb = model.embed(batch.support.flatten(0, 1)).view(*batch.support.shape[:2], -1)
        head = head if head is not None else model.shared_head(len(batch))
        return episode_cross_entropy(linear_logits(emb, head), batch.support_labels).mean()

    def query_loss(self, model: FewShotNet, batch: Episodes, head: Head | None = None) -> torch.Tensor:
        """f(x, y): mean query cross-entropy of ``head`` (default the model's shared head y)."""
        emb = model.embed(batch.query.flatten(0, 1)).view(*batch.query.shape[:2], -1)
        head = head if head is not None else model.shared_head(len(batch))
        return episode_cross_entropy(linear_logits(emb, head), batch.query_labels).mean()

    @cached_property
    def eval_episodes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The fixed evaluation episodes over the test set (classes, support, query indices)."""
        o = self.opts
        q = o.eval_q_query or DRAWINGS - o.k_shot
        rng = np.random.default_rng([o.eval_seed, 7])
        return sample_episodes(self.test.labels, np.arange(len(self.test)), o.n_way, o.k_shot, q, o.eval_episodes, rng)

    @torch.no_grad()
    def _embed_all(self, model: FewShotNet, images: np.ndarray, batch_size: int) -> torch.Tensor:
        device = model_device(model)
        return torch.cat(
            [model.embed(as_tensor(images[i : i + batch_size]).to(device)) for i in range(0, len(images), batch_size)]
        )

    def _score(self, emb_s, labels_s, emb_q, labels_q, n_way) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-episode query accuracy and cross-entropy, (B,) each (host labels follow the embeddings)."""
        labels_s, labels_q = labels_s.to(emb_s.device), labels_q.to(emb_q.device)
        logits = linear_logits(emb_q, self.support_head(emb_s, labels_s, n_way, create_graph=False)).detach()
        acc = (logits.argmax(-1) == labels_q).float().mean(1)
        return acc, episode_cross_entropy(logits, labels_q)

    def evaluate(self, model: FewShotNet, batch_size: int) -> dict[str, float]:  # type: ignore[override]  # its own net
        """Held-out episodes (every test image embedded once, in eval mode, then episodes gathered
        from the embeddings) and the official one-shot runs."""
        model.eval()
        o = self.opts
        emb = self._embed_all(model, self.test.images, batch_size)  # (M, d)
        classes, support, query = self.eval_episodes
        acc, loss = [], []
        for i in range(0, len(classes), EVAL_CHUNK):
            s, q = support[i : i + EVAL_CHUNK], query[i : i + EVAL_CHUNK]
            a, l = self._score(
                emb[s],
                episode_labels(len(s), o.n_way, s.shape[1] // o.n_way),
                emb[q],
                episode_labels(len(q), o.n_way, q.shape[1] // o.n_way),
                o.n_way,
            )
            acc.append(a)
            loss.append(l)
        acc_t, loss_t = torch.cat(acc).double(), torch.cat(loss).double()
        ci = 1.96 * acc_t.std().item() / float(np.sqrt(len(acc_t)))
        metrics = {"accuracy": acc_t.mean().item(), "accuracy_ci95": ci, "loss": loss_t.mean().item()}
        if o.official_runs:
            runs = load_runs(data_dir(self.config.data), o.image_size)
            size = runs[0].support.shape[1]
            support_img = np.stack([r.support for r in runs]).reshape(-1, size, size)
            query_img = np.stack([r.query for r in runs]).reshape(-1, size, size)
            emb_s = self._embed_all(model, support_img, batch_size).view(len(runs), RUN_WAYS, -1)
            emb_q = self._embed_all(model, query_img, batch_size).view(len(runs), RUN_WAYS, -1)
            labels_q = torch.from_numpy(np.stack([r.labels for r in runs]))
            a, _ = self._score(emb_s, episode_labels(len(runs), RUN_WAYS, 1), emb_q, labels_q, RUN_WAYS)
            metrics["oneshot20_accuracy"] = a.mean().item()
        return metrics
