"""A BoMM party: its small multimodal model f_theta_k, what it sends the cloud, and its local
training with completed modalities and the sample scheduler.

**What a party holds** (``context.partitions[cid]``, rows of the paired task's pool): per row a
modality mask, a sample id, and a label only where the row is labeled (the labels of other rows
are never read). Its small model is the task's :class:`~fedtune.models.multimodal.FusionClassifier`,
initialized from (seed, party) (heterogeneous parties), plus, when it receives completions, an
:class:`~fedtune.methods.bomm.networks.Adapters` map from phi-space into the model's embedding space,
and with BoMM's scheduler a :class:`~fedtune.methods.bomm.scheduler.SampleScheduler`. All of it lives
in the party's persistent ``state``.

**Parts**, chosen once by a method's registration (:meth:`BommParty.assemble`), like the cloud's:
without a cloud a :class:`BommParty` trains in ``fit``; with one a :class:`CloudParty` sends the
rows of its ``scope`` and what the cloud's ``aligner`` needs, and trains in the ``complete`` phase.
Its ``fill`` says where completions come from and its ``scheduling`` whether it filters them
(:mod:`~fedtune.methods.bomm.party_parts`).

**What it sends** (the ``fit`` reply, once, when the cloud asks: its representations never
change, phi being frozen): for the rows in the method's scope (aligned ids, or all rows) their
party-local positions, sample ids, masks, labels (-1 where unlabeled) and phi-representations
(n, 2, 1280), zeros for absent modalities (phi never reads those); with alignment also its class
prototypes (C, 2, 1280) and their counts (:func:`~fedtune.methods.bomm.alignment.class_prototypes`).
Never a pixel or a spectrogram.

**Local training** (:meth:`BommParty.train_sm`, ``train.local_steps`` steps of the task's optimizer
on batches of its labeled rows plus the rows the cloud gave labels to). A row the cloud completed
has its missing modality's embedding replaced by the adapter's image of the generated
representation, and counts as holding that modality in the fusion mean. The loss is the paired
task's (cross-entropy of the fused logits plus ``task.unimodal_weight`` times that of each *real*
present modality classified alone) plus ``adapter_weight`` times the adapters' distillation loss:
the squared error between adapter(phi(x^m)) and the encoder's (detached) embedding of x^m, on the
batch's real modalities, which teaches the adapters the encoders' language.

**Scheduler** (BoMM, eqs. (5)-(8)). Before each update, a no-grad pass (evaluation mode) with
*every* available completion gives x_bar = [e_image, e_audio, fused embedding, softmax] per
completed row, the sample-level rewards and the losses L(a; theta^{b-1}); r_hat > mu decides which
completions the update uses (a row whose completion is not selected trains on its real modalities
only). The next batch's pass gives Q, so batch b's rewards are complete one batch later, when
R^p and R^q take their steps; one extra batch is drawn after the last update to measure its Q.

**Evaluation**: the task's metrics (complete test pairs, image only, audio only) and, where a
generator exists, ``accuracy_completed``: the scenario's missing modality removed from every test
row and replaced by the generator's completion (the cloud's, sent in the evaluation message; or
MM-LOCAL's own), and ``gen_cosine``, the completions' mean cosine to the real representations
(standardized with the party's statistics: the counterpart of the paper's CLIPScore).
"""

from __future__ import annotations

from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedtune.config import ConfigError
from fedtune.data.batches import index_batches
from fedtune.data.paired import missing_modality
from fedtune.methods.bomm.aligner import NoAlignment
from fedtune.methods.bomm.backbone import FEATURE_DIM, source_features
from fedtune.methods.bomm.common import (
    GENERATOR_INIT,
    Standardizer,
    generate,
    load_module,
    module_arrays,
    on,
    party_seed,
    placed,
    run_device,
)
from fedtune.methods.bomm.networks import Adapters
from fedtune.methods.bomm.options import BommOptions, CloudRows
from fedtune.methods.bomm.party_parts import NoFill, NoScheduling
from fedtune.methods.bomm.scheduler import batch_level_reward, sample_level_reward
from fedtune.models.audio import seeded
from fedtune.models.multimodal import MODALITY_NAMES
from fedtune.models.precision import model_device, to_device
from fedtune.models.tensors import to_numpy
from fedtune.models.training import evaluate_classifier, make_optimizer, seed_for, train_mode
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message

COMPLETE = "complete"  # the round's phase: the cloud's completions and labels out, local training


def scope_rows(aligned: np.ndarray, cloud_rows: CloudRows) -> np.ndarray:
    """Party-local positions of the rows whose representations the party sends (given its rows'
    aligned flags): the aligned ids' rows, or all rows."""
    return np.flatnonzero(aligned) if cloud_rows == "aligned" else np.arange(len(aligned))


class BommParty(Client):
    """A party without a cloud (LOCAL, MM-LOCAL): it trains in ``fit``. The base of
    :class:`CloudParty`; assembled from its parts (:meth:`assemble`; the defaults: LOCAL's)."""

    options: BommOptions  # the method's registered options class (resolve_run validated them)

    fill: ClassVar[NoFill] = NoFill()
    scheduling: ClassVar[NoScheduling] = NoScheduling()

    @classmethod
    def assemble(cls, **parts) -> type[BommParty]:
        """The party of a method that uses these ``parts`` (class attributes of ``cls``: ``fill``,
        ``scheduling``, and for a :class:`CloudParty` ``scope`` and ``aligner``)."""
        unknown = sorted(set(parts) - set(dir(cls)))
        if unknown:
            raise TypeError(f"{cls.__name__}.assemble: no part named {unknown[0]!r}")
        names = ", ".join(str(getattr(part, "name", part)) for part in parts.values())
        doc = f"A BoMM party with {names}."
        return type(f"{cls.__name__}[{names}]", (cls,), {**parts, "__doc__": doc, "__module__": cls.__module__})

    # -- what the party holds ----------------------------------------------------------------
    @property
    def task(self):
        return self.context.task

    @cached_property
    def rows(self) -> np.ndarray:
        return np.asarray(self.context.partitions[self.cid], dtype=np.int64)

    @cached_property
    def masks(self) -> np.ndarray:
        return self.task.train.masks[self.rows]

    @cached_property
    def labels(self) -> np.ndarray:
        """(n,) the labels of the labeled rows, -1 elsewhere (no other label is ever read)."""
        train = self.task.train
        out = np.full(len(self.rows), -1, dtype=np.int64)
        lab = train.labeled[self.rows]
        out[lab] = train.labels[self.rows[lab]]
        return out

    def features(self, local: np.ndarray) -> np.ndarray:
        """(len(local), 2, D) phi-representations of the party's rows at positions ``local``;
        zeros where a modality is absent (never encoded)."""
        train, o = self.task.train, self.options
        local = np.asarray(local, dtype=np.int64)
        out = np.zeros((len(local), len(MODALITY_NAMES), FEATURE_DIM), dtype=np.float32)
        for m, name in enumerate(MODALITY_NAMES):
            present = self.masks[local, m]
            if present.any():
                source = train.image_index if name == "image" else train.audio_index
                out[present, m] = source_features(
                    self.task, 0, name, source[self.rows[local[present]]], o.backbone, o.backbone_size, self.device
                )
        return out

    def test_features(self, modality: int) -> np.ndarray:
        test, o = self.task.test, self.options
        source = test.image_index if MODALITY_NAMES[modality] == "image" else test.audio_index
        return source_features(self.task, 1, MODALITY_NAMES[modality], source, o.backbone, o.backbone_size, self.device)

    @property
    def device(self) -> torch.device:
        return run_device(self.config)

    # -- networks ------------------------------------------------------------------------------
    def networks(self):
        """(small model, adapters or None, scheduler or None, local generator or None), from the
        party's state (fresh, seeded per party, on first use)."""
        o, seed = self.options, party_seed(self.config.seed, self.cid)
        sm = placed(self.task.build_model(seed), self.config)
        load_module(sm, self.state, "sm.")
        adapters = None
        if self.fill.adapters:
            adapters = placed(seeded(seed + 1, lambda: Adapters(FEATURE_DIM, sm.embed_dim)), self.config)
            load_module(adapters, self.state, "ad.")
        sched = self.scheduling.build(3 * sm.embed_dim + self.task.num_labels, o, self.config.seed, self.cid)
        if sched is not None:
            sched = placed(sched, self.config)
            load_module(sched, self.state, "sc.")
        return sm, adapters, sched, self.generator()

    def generator(self):
        """The fill's own generator (MM-LOCAL), from the party's state; None for the others."""
        gen = self.fill.generator(self.options, self.config.seed, self.cid)
        if gen is not None:
            gen = placed(gen, self.config)
            load_module(gen, self.state, "gen.")
        return gen

    def save(self, sm, adapters, sched, gen) -> None:
        for module, prefix in ((sm, "sm."), (adapters, "ad."), (sched, "sc."), (gen, "gen.")):
            if module is not None:
                self.state.update(module_arrays(module, prefix))

    # -- the exchanges -------------------------------------------------------------------------
    def fit(self, message: Message) -> Message:
        """Train locally (with the fill's own completions, if any) and report."""
        rnd = int(message.meta["round"])
        return Message({}, self.train_sm(rnd, self.labels, self.local_completions(rnd)))

    def evaluate(self, message: Message) -> Message:
        sm, adapters, _, gen = self.networks()
        bs = self.config.train.eval_batch_size
        metrics = self.task.evaluate(sm, bs)
        t = missing_modality(self.task.options.scenario)
        test_gen = message.arrays.get("test_gen")
        if test_gen is None and gen is not None and t is not None:
            st = self.local_standardizer()
            z = st.apply_one(self.test_features(1 - t), 1 - t)
            test_gen = st.invert_one(generate(gen, z, t), t)
        if test_gen is not None and adapters is not None and t is not None:
            test_gen = np.asarray(test_gen, np.float32)
            metrics["accuracy_completed"] = self.evaluate_completed(sm, adapters, test_gen, t)
            metrics["gen_cosine"] = self.generation_cosine(test_gen, t)
        return Message({}, {**metrics, "num_examples": len(self.task.test)})

    def generation_cosine(self, test_gen: np.ndarray, t: int) -> float:
        """Quality of the completions (the paper's CLIPScore, here in representation space): the
        mean cosine between each test pair's generated and real modality ``t``, both standardized
        with the party's own statistics."""
        st = self.local_standardizer()
        a, b = st.apply_one(test_gen, t), st.apply_one(self.test_features(t), t)
        cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
        return float(cos.mean())

    # -- local training ------------------------------------------------------------------------
    def forward(
        self,
        sm,
        adapters,
        local: np.ndarray,
        use: np.ndarray,
        gen: np.ndarray,
        gen_mod: np.ndarray,
        ds=None,
        split: int = 0,
    ):
        """Logits (B, C), embeddings (B, 2, d), fused embedding (B, d) and the real-modality mask
        (B, 2) of rows ``local`` (of the party, or of ``ds``), where rows with ``use`` take the
        adapted ``gen`` as their ``gen_mod`` modality."""
        ds = self.task.train if ds is None else ds
        rows = self.rows[local] if split == 0 and ds is self.task.train else local
        inputs, _ = self.task.batch(ds, self.task.tensors[split], rows)  # the task's labels are not used
        dev = model_device(sm)
        inputs = to_device(inputs, dev)
        emb = sm.embed(inputs["image"], inputs["audio"], inputs["mask"])
        real = inputs["mask"]
        mask = real
        if use.any():
            idx = np.flatnonzero(use)
            mods = gen_mod[idx]
            adapted = torch.zeros(len(idx), emb.shape[-1], device=dev)
            for m in np.unique(mods):
                sel = mods == m
                adapted = adapted.index_put(
                    (on(np.flatnonzero(sel), dev),), adapters(on(np.asarray(gen[idx[sel]]), dev), int(m))
                )
            where = (on(idx, dev), on(mods, dev))
            emb = emb.index_put(where, adapted)
            mask = mask.index_put(where, torch.ones(len(idx), dtype=torch.bool, device=dev))
        fused = sm.fuse(emb, mask)
        return sm.classifier(sm.dropout(fused)), emb, fused, real

    def sm_loss(self, sm, logits: torch.Tensor, emb: torch.Tensor, real: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The paired task's loss (:meth:`~fedtune.tasks.paired_multimodal.PairedMultimodal.loss`)
        on (possibly completed) fused logits: CE(fused) + unimodal_weight x CE of each real present
        modality classified alone."""
        loss = F.cross_entropy(logits, y)
        w = self.task.options.unimodal_weight
        if w:
            single = sm.classifier(sm.dropout(emb))
            loss = loss + w * F.cross_entropy(single[real], y.unsqueeze(1).expand_as(real)[real])
        return loss

    def adapter_loss(self, adapters, local: np.ndarray, emb: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Mean over modalities of the squared error between adapter(phi(x^m)) and the encoder's
        detached embedding of x^m, on the batch's real modalities."""
        phi = on(self.features(local), emb.device)
        parts = []
        for m in range(real.shape[1]):
            rows = real[:, m]
            if rows.any():
                parts.append(F.mse_loss(adapters(phi[rows, m], m), emb[rows, m].detach()))
        return torch.stack(parts).mean() if parts else torch.zeros((), device=emb.device)

    def train_sm(self, rnd: int, labels: np.ndarray, completions) -> dict:
        """``train.local_steps`` updates of the small model (and adapters) on the rows with a label
        in ``labels`` (-1: none), using ``completions`` = (party-local rows, generated modality,
        generated phi-representation) where the scheduler (if any) selects them. Saves the networks
        to the state; returns the reply's metrics."""
        cfg, o = self.config.train, self.options
        sm, adapters, sched, gen = self.networks()
        pool = np.flatnonzero(labels >= 0)
        if len(pool) == 0:
            raise ConfigError("task.labeled_fraction: a party has no labeled rows to train on")
        gen_index, gen_mod, gen_feat = self.completion_lookup(completions)
        seed = seed_for(self.config.seed, rnd, self.cid)
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        params = [p for p in sm.parameters() if p.requires_grad]
        if adapters is not None:
            params += list(adapters.parameters())
        optimizer = make_optimizer(params, cfg)
        scheduling = sched is not None and len(gen_mod) > 0
        if scheduling:
            opt_p = torch.optim.Adam(sched.exploit.parameters(), lr=o.scheduler_lr)
            opt_q = torch.optim.Adam(sched.explore.parameters(), lr=o.scheduler_lr)
        stats = {"completed": 0, "selected": 0, "reward_sum": 0.0, "rewards": 0}
        pending = None  # previous batch: (x_bar, sample-level rewards, losses before its update)
        total = 0.0
        steps = cfg.local_steps
        for b, local in enumerate(index_batches(pool, cfg.batch_size, steps + 1 if scheduling else steps, rng)):
            gi = gen_index[local]
            has = gi >= 0
            feat_b = gen_feat[np.maximum(gi, 0)] if len(gen_feat) else np.zeros((len(local), FEATURE_DIM), np.float32)
            mod_b = gen_mod[np.maximum(gi, 0)] if len(gen_mod) else np.zeros(len(local), np.int64)
            y = on(labels[local], model_device(sm))
            use = has.copy()
            if scheduling:
                if has.any() or pending is not None:
                    sm.eval()
                    with torch.no_grad():
                        logits_all, emb_all, fused_all, _ = self.forward(sm, adapters, local, has, feat_b, mod_b)
                        ce_all = F.cross_entropy(logits_all, y, reduction="none")
                        xbar = torch.cat([emb_all.flatten(1), fused_all, logits_all.softmax(-1)], dim=1)
                    h = on(has, y.device)
                    if pending is not None:
                        rewards = pending[1] + batch_level_reward(pending[2], ce_all[h])
                        sched.update(pending[0], rewards, opt_p, opt_q)
                        stats["reward_sum"] += float(rewards.sum())
                        stats["rewards"] += len(rewards)
                        pending = None
                    if b == steps:  # the extra batch only measures Q for the last update
                        break
                    if has.any():
                        chosen = to_numpy(sched.select(xbar[h], o.lam, o.mu))
                        use[has] = chosen
                        stats["completed"] += int(has.sum())
                        stats["selected"] += int(chosen.sum())
                        pending = (xbar[h], sample_level_reward(logits_all[h], y[h], o.reward_entropy), ce_all[h])
            else:
                stats["completed"] += int(has.sum())
                stats["selected"] += int(has.sum())
            total += self.sm_step(sm, adapters, optimizer, local, use, feat_b, mod_b, y)
        self.save(sm, adapters, sched, gen)
        meta = {
            "train_loss": total / steps,
            "steps": steps,
            "num_examples": int(len(pool)),
            "completed": stats["completed"],
            "selected": stats["selected"],
        }
        if stats["rewards"]:
            meta["reward_mean"] = stats["reward_sum"] / stats["rewards"]
        return meta

    def completion_lookup(self, completions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``completions`` (party-local rows, generated modality, generated phi-representation; or
        None) as each of the party's rows' index into them (-1: none), their modalities and features."""
        gen_index = np.full(len(self.rows), -1, dtype=np.int64)
        gen_mod = np.zeros(0, dtype=np.int64)
        gen_feat = np.zeros((0, FEATURE_DIM), dtype=np.float32)
        if completions is not None and len(completions[0]):
            gen_rows, gen_mod, gen_feat = completions
            gen_index[gen_rows] = np.arange(len(gen_rows))
        return gen_index, gen_mod, gen_feat

    def sm_step(self, sm, adapters, optimizer, local, use, feat_b, mod_b, y) -> float:
        """One update of the small model ``sm`` (and ``adapters``, weighted by ``options.adapter_weight``)
        by ``optimizer`` on the rows ``local`` with labels ``y``, those in ``use`` completed with the
        generated modality ``mod_b`` and features ``feat_b``; the batch's loss."""
        train_mode(sm)
        if adapters is not None:
            adapters.train()
        logits, emb, _, real = self.forward(sm, adapters, local, use, feat_b, mod_b)
        loss = self.sm_loss(sm, logits, emb, real, y)
        if adapters is not None and self.options.adapter_weight:
            loss = loss + self.options.adapter_weight * self.adapter_loss(adapters, local, emb, real)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.item()

    # -- MM-LOCAL: the party's own generator ---------------------------------------------------
    def local_standardizer(self) -> Standardizer:
        every = np.arange(len(self.rows))
        return Standardizer.fit(self.features(every), self.masks)

    def local_completions(self, rnd: int):
        """The fill's completions of the party's rows before local training without a cloud
        (MM-LOCAL: its own generator, trained this round and saved to the state; else None)."""
        gen = self.generator()
        if gen is None:
            return None
        every = np.arange(len(self.rows))
        st = self.local_standardizer()
        z = st.apply(self.features(every), self.masks)
        seed = seed_for(self.config.seed, rnd, self.cid, GENERATOR_INIT)
        completions = self.fill.local_completions(gen, st, z, self.masks, self.options, seed)
        self.save(None, None, None, gen)
        return completions

    # -- evaluation ----------------------------------------------------------------------------
    def evaluate_completed(self, sm, adapters, test_gen: np.ndarray, t: int) -> float:
        """Accuracy on the test set with modality ``t`` removed from every row and replaced by the
        adapted completion ``test_gen`` (N_test, D)."""
        present = tuple(m != t for m in range(len(MODALITY_NAMES)))
        ds = self.task.test.with_modalities(present)
        n, bs = len(ds), self.config.train.eval_batch_size

        def forward(model, idx):
            logits, _, _, _ = self.forward(
                model,
                adapters,
                idx,
                np.ones(len(idx), bool),
                test_gen[idx],
                np.full(len(idx), t, np.int64),
                ds=ds,
                split=1,
            )
            labels = on(ds.labels[idx], logits.device)
            return logits, labels, F.cross_entropy(logits, labels)

        adapters.eval()
        batches = (np.arange(i, min(i + bs, n)) for i in range(0, n, bs))
        return evaluate_classifier(sm, batches, forward)["accuracy"]


class CloudParty(BommParty):
    """A party with a cloud (Vanilla, MM-AC, MM-UC, BoMM): it sends the representations of the
    rows in its ``scope`` (and what the cloud's ``aligner`` needs) once, when asked, and trains in the
    ``complete`` phase with the cloud's completions and labels."""

    scope: ClassVar[CloudRows] = "aligned"  # the rows it sends: the cloud's ``rows``
    aligner: ClassVar[NoAlignment] = NoAlignment()

    def fit(self, message: Message) -> Message:
        """Send the representations (and the aligner's arrays) when asked; training happens in the
        ``complete`` phase."""
        arrays = self.upload() if message.meta.get("send") else {}
        return Message(arrays, {"num_examples": int((self.labels >= 0).sum()), "steps": 0})

    def upload(self) -> dict[str, np.ndarray]:
        local = scope_rows(self.task.train.aligned[self.rows], self.scope)
        feats = self.features(local)
        arrays = {
            "rows": local.astype(np.int64),
            "sample_ids": self.task.train.sample_ids[self.rows[local]].astype(np.int64),
            "masks": self.masks[local].copy(),
            "labels": self.labels[local].copy(),
            "features": feats,
        }
        every = np.arange(len(self.rows))
        return arrays | self.aligner.upload(lambda: self.features(every), self.masks, self.labels, self.task.num_labels)

    def phase(self, name: str, message: Message) -> Message:
        """``complete``: the cloud's completions (``gen_rows``, ``gen_modality``, ``gen``) and
        transferred labels (``label_rows``, ``label_values``) in, local training, metrics out."""
        if name != COMPLETE:
            return super().phase(name, message)
        a = message.arrays
        labels = self.labels.copy()
        transferred = 0
        if "label_rows" in a and len(a["label_rows"]):
            fresh = labels[a["label_rows"]] < 0
            labels[a["label_rows"][fresh]] = a["label_values"][fresh]
            transferred = int(fresh.sum())
        completions = None
        if "gen_rows" in a:
            completions = (
                np.asarray(a["gen_rows"], np.int64),
                np.asarray(a["gen_modality"], np.int64),
                np.asarray(a["gen"], np.float32),
            )
        meta = self.train_sm(int(message.meta["round"]), labels, completions)
        return Message({}, {**meta, "transferred_labels": transferred})
