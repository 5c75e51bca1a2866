"""BoMM's cloud (the Strategy): the cloud model f_psi = frozen backbone phi + classifier psi_1 +
generator psi_2, global prototype-guided alignment, and the round's exchanges with the parties.

**A round** (Algorithm 1 of the paper: the cloud updates Psi with the parties' data, then the
parties update Theta with the cloud's help):

1. ``fit``: the cloud asks each party that has not yet sent them for its representations (and, with
   alignment, its class prototypes); a party's representations never change (phi is frozen), so
   they cross once and the cloud keeps them.
2. ``aggregate_fit``, the cloud's update (:meth:`BommCloud.cloud_update`): representations are
   standardized per modality and feature over everything received; with alignment (BoMM), global
   prototype-guided alignment (eq. (9), :mod:`fedtune.methods.bomm.alignment`) on the unaligned rows,
   completed by the generator first (``complete_before_align``), gives newly aligned cross-party
   pairs, and up to ``grow_per_round`` of them join the prototype set until it holds ``n_global``.
   The cosines of eq. (9) are taken in the cloud model's representation space (``alignment_space =
   "cloud"``: psi_1's per-modality embeddings, once psi_1 has trained; round 1 uses the standardized
   phi features). Measured on MNIST pairs (scenario 1, 0 aligned, after 6 rounds): 57% of the accepted
   pairs are same-class in phi space, 70% (90% of the 100 most similar) in the cloud's space;
   the generator trains ``generator_epochs`` epochs (L_G of eqs. (3)-(4) for BoMM; regression on real
   targets for MM-AC / MM-UC); the classifier trains ``cloud_epochs`` epochs on the labeled samples
   with their missing modalities completed.
3. phase ``complete``: each party receives the generator's completions of its rows' missing modality
   (the rows it sent) and, with BoMM, the labels its enlarged aligned set gives its unlabeled rows;
   it trains its small model (:class:`~fedtune.methods.bomm.party.BommParty`).
4. evaluation: the cloud model on the test set (``cloud_*`` metrics, centrally: phi runs on the
   public test set here) and every party's small model (``party<k>_*``; ``accuracy`` is their mean).

**Samples at the cloud.** The rows it holds are grouped by sample id (an aligned id: one view per
party holding it; an unaligned row: one view); BoMM merges the two rows of every newly aligned pair
into one sample. A sample's label is that of any labeled view; a pair of two labeled rows with
different labels is never accepted (the cloud sees those labels). Vanilla and MM-AC hold the
aligned ids' rows only; MM-UC and BoMM every row.

**Completion targets** (preferred outputs g^p, per (row, target modality), the other modality
present): the row's own real target; else an aligned partner's (the mean over the sample's other
views that hold it); else (BoMM only) the target modality of the row's closest global prototype
among those holding it, by the cost on the row's real modalities. The regression baselines train
on real targets only. o_i is chosen in the alignment space; sim(x, o_i) of eq. (4) is the cosine of
the row's real modalities to o_i's (party component), in the generator's own (standardized phi)
space.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from fedtune.data.paired import missing_modality
from fedtune.methods.bomm.aligner import align_rows, prototype_set
from fedtune.methods.bomm.alignment import PrototypeSet
from fedtune.methods.bomm.backbone import FEATURE_DIM, source_features
from fedtune.methods.bomm.classifier import train_classifier
from fedtune.methods.bomm.common import (
    CLOUD_INIT,
    CLOUD_TRAIN,
    GENERATOR_INIT,
    GENERATOR_TRAIN,
    Standardizer,
    fit_generator,
    generate,
    load_module,
    module_arrays,
    party_metrics,
)
from fedtune.methods.bomm.completer import complete_rows, completion_items
from fedtune.methods.bomm.networks import CloudClassifier, Generator
from fedtune.methods.bomm.options import MODES, Mode
from fedtune.methods.bomm.party import COMPLETE, scope_rows
from fedtune.methods.bomm.pool import M, Pool, union_samples
from fedtune.models.audio import seeded
from fedtune.models.multimodal import MODALITY_NAMES
from fedtune.models.training import evaluate_classifier, seed_for
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import ArraySpec


class BommCloud(Strategy):
    """BoMM: parties' small models and a cloud multimodal model help each other (alignment, completion, scheduler)."""

    @property
    def mode(self) -> Mode:
        """What this method does: its registered name's entry of MODES."""
        return MODES[self.config.method]

    # -- setup and state -----------------------------------------------------------------------
    def initialize(self) -> None:
        self.uploads: dict[int, dict[str, np.ndarray]] = {}
        self.grown = np.zeros((0, 4), dtype=np.int64)  # (party k, row of k, party w, row of w) per grown prototype
        self.generator_trained = self.classifier_trained = False
        self._build()

    def _build(self) -> None:
        """The cloud's networks, freshly initialized from the run's seed."""
        o, seed, task = self.options, self.config.seed, self.context.task
        self.classifier = self.generator = None
        if self.mode.cloud:
            self.classifier = seeded(
                seed_for(seed, CLOUD_INIT),
                lambda: CloudClassifier(task.num_labels, FEATURE_DIM, M, o.cloud_hidden, o.cloud_embed),
            )
        if self.mode.completion == "cloud":
            self.generator = seeded(seed_for(seed, GENERATOR_INIT), lambda: Generator(FEATURE_DIM, o.generator_hidden))
        self.outgoing: dict[int, Message] = {}
        self._stats: tuple[tuple, Standardizer] | None = None

    def state_dict(self) -> dict:
        state = {
            "uploads": {str(k): dict(v) for k, v in self.uploads.items()},
            "grown": self.grown.copy(),
            "generator_trained": self.generator_trained,
            "classifier_trained": self.classifier_trained,
        }
        if self.classifier is not None:
            state["classifier"] = module_arrays(self.classifier, "")
        if self.generator is not None:
            state["generator"] = module_arrays(self.generator, "")
        return state

    def load_state_dict(self, state: dict) -> None:
        self._build()
        self.uploads = {int(k): {n: np.asarray(a) for n, a in v.items()} for k, v in state.get("uploads", {}).items()}
        self.grown = np.asarray(state["grown"], dtype=np.int64).reshape(-1, 4)
        self.generator_trained = bool(state["generator_trained"])
        self.classifier_trained = bool(state["classifier_trained"])
        if self.classifier is not None:
            load_module(self.classifier, state["classifier"], "")
        if self.generator is not None:
            load_module(self.generator, state["generator"], "")

    def save(self, run_dir) -> None:
        """The cloud model's trainable parts, ``cloud.safetensors`` (``classifier.*``, ``generator.*``);
        the parties' small models stay with the parties (their state)."""
        if self.classifier is None:
            return
        from safetensors.torch import save_file

        tensors = {f"classifier.{k}": v.contiguous() for k, v in self.classifier.state_dict().items()}
        if self.generator is not None:
            tensors |= {f"generator.{k}": v.contiguous() for k, v in self.generator.state_dict().items()}
        save_file(tensors, str(run_dir / "cloud.safetensors"))

    @property
    def missing(self) -> int | None:
        """The modality the task's scenario removes (None: scenario 0)."""
        return missing_modality(self.context.task.options.scenario)

    def standardizer(self) -> Standardizer:
        """Per-modality standardization fitted on every representation received (identity before any)."""
        key = tuple(sorted(self.uploads))
        if self._stats is None or self._stats[0] != key:
            pool = Pool.of(self.uploads)
            st = (
                Standardizer.fit(pool.x, pool.mask)
                if len(pool)
                else Standardizer(np.zeros((M, FEATURE_DIM), np.float32), np.ones((M, FEATURE_DIM), np.float32))
            )
            self._stats = (key, st)
        return self._stats[1]

    # -- the exchanges -------------------------------------------------------------------------
    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        return {
            cid: Message({}, {"round": rnd, "send": bool(self.mode.cloud and cid not in self.uploads)})
            for cid in client_ids
        }

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        """No arrays, except the representations (and prototypes) a party was asked to send: their
        count follows from the public structure of the parties (their sizes, the aligned ids)."""
        if sent.meta.get("phase") == COMPLETE or not sent.meta.get("send"):
            return {}
        train = self.context.task.train
        n = len(scope_rows(train.aligned[self.context.partitions[cid]], self.mode.cloud_rows))
        spec = {
            "rows": ArraySpec((n,), "int64", False),
            "sample_ids": ArraySpec((n,), "int64", False),
            "masks": ArraySpec((n, M), "bool", False),
            "labels": ArraySpec((n,), "int64", False),
            "features": ArraySpec((n, M, FEATURE_DIM), "float32", False),
        }
        if self.mode.alignment:
            c = self.context.task.num_labels
            spec |= {
                "prototypes": ArraySpec((c, M, FEATURE_DIM), "float32", False),
                "proto_counts": ArraySpec((c, M), "float32", False),
            }
        return spec

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        if not self.mode.cloud:
            return party_metrics(replies)
        for cid, reply in replies.items():
            if reply.arrays:
                self.uploads[cid] = {k: np.asarray(v) for k, v in reply.arrays.items()}
        start = time.perf_counter()
        metrics = self.cloud_update(rnd, sorted(replies))
        metrics["cloud_compute_s"] = time.perf_counter() - start
        return metrics

    def phases(self, rnd: int) -> tuple[str, ...]:
        return (COMPLETE,) if self.mode.cloud else ()

    def configure_phase(self, phase: str, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        if phase != COMPLETE:
            return super().configure_phase(phase, rnd, client_ids)
        meta = {"round": rnd, "phase": COMPLETE}
        return {cid: Message(self.outgoing.get(cid, {}), meta) for cid in client_ids}

    def aggregate_phase(self, phase: str, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        return party_metrics(replies)

    # -- the cloud's update --------------------------------------------------------------------
    def cloud_update(self, rnd: int, active: list[int]) -> dict[str, float]:
        """Alignment, generator, classifier, and the completions / labels for the parties
        (``self.outgoing``); returns the round's cloud metrics."""
        o = self.options
        pool = Pool.of(self.uploads)
        self.outgoing = {}
        if len(pool) == 0:
            return {}
        st = self.standardizer()
        z = st.apply(pool.x, pool.mask)
        metrics: dict[str, float] = {}
        pairs: list[tuple[int, int]] = []
        protos = None
        space = self.alignment_space()
        if self.mode.alignment:
            zc, mc = (
                self.complete(z, pool.mask)[:2]
                if o.complete_before_align and self.generator_trained
                else (z, pool.mask)
            )
            protos = self.prototype_set(pool, st, zc, mc)
            pairs, align_metrics = self.align(pool, space(zc, mc), mc, protos.mapped(space))
            metrics |= align_metrics
        samples = union_samples(pool.sid, pairs)
        if self.generator is not None:
            metrics |= self.train_generator(rnd, pool, z, samples, protos, space)
            self.generator_trained = True
        zc, mc, gen_mod = self.complete(z, pool.mask)
        metrics |= self.train_classifier(rnd, pool, zc, mc, samples)
        self.outgoing, given = self.messages(pool, st, zc, gen_mod, samples)
        if self.mode.alignment and o.label_transfer:
            rows = np.flatnonzero(given >= 0)
            metrics["transferred_labels"] = float(len(rows))
            if o.diagnostics and len(rows):
                metrics["diag_transferred_accuracy"] = float(np.mean(self.true_labels(pool)[rows] == given[rows]))
        return metrics

    def alignment_space(self):
        """``f(z (n, M, D), mask (n, M)) -> (n, M, E)``: the representations eq. (9) compares. With
        ``alignment_space = "cloud"`` and a cloud classifier trained at least once, psi_1's
        per-modality embeddings of the standardized representations (the cloud model's view of a
        sample); otherwise the standardized phi-representations themselves."""
        if self.options.alignment_space != "cloud" or not self.classifier_trained:
            return lambda x, mask: x
        classifier = self.classifier

        @torch.no_grad()
        def embed(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
            classifier.eval()
            out = np.zeros((*x.shape[:2], classifier.embed_dim), np.float32)
            for mod, encoder in enumerate(classifier.encoders):
                rows = np.flatnonzero(mask[:, mod])
                if len(rows):
                    out[rows, mod] = encoder(torch.from_numpy(np.asarray(x[rows, mod], np.float32))).numpy()
            return out

        return embed

    def complete(self, z: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(completed z, completed mask, generated modality per row or -1): every row holding one
        modality gets the generator's representation of the other (none without a generator)."""
        return complete_rows(self.generator, z, mask)

    # -- alignment (eq. (9)): fedtune.methods.bomm.aligner ------------------------------------
    def prototype_set(self, pool: Pool, st: Standardizer, zc: np.ndarray, mc: np.ndarray) -> PrototypeSet:
        """Seeds (the parties' same-class prototypes, standardized, paired) plus the grown pairs' rows."""
        return prototype_set(self.uploads, self.grown, self.config.federation.num_clients, pool, st, zc, mc)

    def align(self, pool: Pool, zc: np.ndarray, mc: np.ndarray, protos: PrototypeSet):
        """Accepted cross-party pairs of unaligned rows (pool indices) and the prototype set's growth."""
        truth = self.true_labels if self.options.diagnostics else None
        pairs, self.grown, metrics = align_rows(
            pool, zc, mc, protos, sorted(self.uploads), self.grown, self.options, truth
        )
        return pairs, metrics

    # -- generator (eqs. (3)-(4)) --------------------------------------------------------------
    def train_generator(
        self,
        rnd: int,
        pool: Pool,
        z: np.ndarray,
        samples: list[np.ndarray],
        protos: PrototypeSet | None,
        space=lambda x, mask: x,
    ) -> dict[str, float]:
        """Items (row, target modality) with the other modality present, their g^p (real, an aligned
        partner's, or with ``preference`` the closest prototype's) and sim(x, o_i); then
        :func:`~fedtune.methods.bomm.common.fit_generator`."""
        o = self.options
        source, target, g_p, sim, real = completion_items(pool, z, samples, protos, space, self.mode.preference)
        reference = None
        if self.mode.preference and o.reference == "initial":  # G_ref: the generator as initialized, rebuilt
            reference = seeded(
                seed_for(self.config.seed, GENERATOR_INIT), lambda: Generator(FEATURE_DIM, o.generator_hidden)
            )
        metrics = fit_generator(
            self.generator,
            source,
            target,
            g_p,
            sim,
            preference=self.mode.preference,
            beta=o.beta,
            gamma=o.gamma,
            prefer=o.prefer,
            epochs=o.generator_epochs,
            lr=o.generator_lr,
            batch_size=o.cloud_batch_size,
            seed=seed_for(self.config.seed, rnd, GENERATOR_TRAIN),
            reference=reference,
        )
        metrics["generator_items"] = float(len(source))
        metrics["generator_real_items"] = float(real.sum())
        return metrics

    # -- classifier (L_task) -------------------------------------------------------------------
    def train_classifier(
        self, rnd: int, pool: Pool, zc: np.ndarray, mc: np.ndarray, samples: list[np.ndarray]
    ) -> dict[str, float]:
        """``cloud_epochs`` epochs (Adam) on the labeled samples, completed modalities included
        (:func:`fedtune.methods.bomm.classifier.train_classifier`)."""
        metrics = train_classifier(
            self.classifier,
            pool,
            zc,
            mc,
            samples,
            self.options,
            seed_for(self.config.seed, rnd, CLOUD_TRAIN),
            self.context.task.options.unimodal_weight,
        )
        self.classifier_trained = self.classifier_trained or "cloud_train_loss" in metrics
        return metrics

    # -- what the parties receive --------------------------------------------------------------
    def messages(
        self, pool: Pool, st: Standardizer, zc: np.ndarray, gen_mod: np.ndarray, samples: list[np.ndarray]
    ) -> tuple[dict[int, dict[str, np.ndarray]], np.ndarray]:
        """Per party: completions of its rows' missing modality (phi-space, de-standardized) and,
        with BoMM's label transfer, its unlabeled rows' labels from their sample's labeled views;
        also the label given to each pool row (-1: none)."""
        out: dict[int, dict[str, np.ndarray]] = {}
        transfer = self.mode.alignment and self.options.label_transfer
        given = np.full(len(pool), -1, dtype=np.int64)
        if transfer:
            for rows in samples:
                known = pool.label[rows][pool.label[rows] >= 0]
                if len(known):
                    unl = rows[pool.label[rows] < 0]
                    given[unl] = known[0]
        for k in sorted(self.uploads):
            mine = pool.party == k
            arrays: dict[str, np.ndarray] = {}
            if self.generator is not None:
                rows = np.flatnonzero(mine & (gen_mod >= 0))
                gen = np.zeros((len(rows), FEATURE_DIM), np.float32)
                for t in range(M):
                    sel = gen_mod[rows] == t
                    gen[sel] = st.invert_one(zc[rows[sel], t], t)
                arrays |= {"gen_rows": pool.local[rows], "gen_modality": gen_mod[rows], "gen": gen}
            if transfer:
                rows = np.flatnonzero(mine & (given >= 0))
                arrays |= {"label_rows": pool.local[rows], "label_values": given[rows]}
            out[k] = arrays
        return out, given

    # -- evaluation ----------------------------------------------------------------------------
    def test_z(self) -> np.ndarray:
        """(N_test, M, D) standardized phi-representations of the test pairs."""
        task, o = self.context.task, self.options
        test = task.test
        feats = np.stack(
            [
                source_features(
                    task,
                    1,
                    name,
                    test.image_index if name == "image" else test.audio_index,
                    o.backbone,
                    o.backbone_size,
                )
                for name in MODALITY_NAMES
            ],
            axis=1,
        )
        return self.standardizer().apply(feats)

    def evaluate(self, rnd: int) -> dict[str, float]:
        """The cloud model on the test pairs: complete, each modality alone, and (with a generator)
        the scenario's missing modality completed by the generator."""
        if not self.mode.cloud:
            return {}
        z = self.test_z()
        y = torch.from_numpy(self.context.task.test.labels.astype(np.int64))
        variants = {"": (True, True), "_image_only": (True, False), "_audio_only": (False, True)}
        metrics: dict[str, float] = {}
        for suffix, present in variants.items():
            mask = np.tile(np.asarray(present), (len(z), 1))
            metrics |= self._cloud_accuracy(z, mask, y, suffix)
        t = self.missing
        if self.generator is not None and t is not None:
            mask = np.ones((len(z), M), bool)
            mask[:, t] = False
            zc, mc, _ = self.complete(z * mask[..., None], mask)
            metrics |= self._cloud_accuracy(zc, mc, y, "_completed")
            a, b = zc[:, t], z[:, t]
            cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
            metrics["cloud_gen_cosine"] = float(cos.mean())  # completions vs the real modality (standardized)
        return metrics

    def _cloud_accuracy(self, z: np.ndarray, mask: np.ndarray, y: torch.Tensor, suffix: str) -> dict[str, float]:
        x, m = torch.from_numpy(z[:, None].astype(np.float32)), torch.from_numpy(mask[:, None])
        bs = self.config.train.eval_batch_size

        def forward(model, idx):
            fused, _ = model(x[idx], m[idx])
            return fused, y[idx], F.cross_entropy(fused, y[idx])

        result = evaluate_classifier(
            self.classifier, (np.arange(i, min(i + bs, len(y))) for i in range(0, len(y), bs)), forward
        )
        out = {f"cloud_accuracy{suffix}": result["accuracy"]}
        if not suffix:
            out["cloud_loss"] = result["loss"]
        return out

    def configure_evaluate(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        """Every party evaluates its small model; with a cloud generator the message carries the
        completion of the test pairs' missing modality (``test_gen``, phi-space)."""
        arrays = {}
        t = self.missing
        if self.generator is not None and t is not None and self.generator_trained:
            z = self.test_z()
            arrays["test_gen"] = self.standardizer().invert_one(generate(self.generator, z[:, 1 - t], t), t)
        message = Message(arrays, {"round": rnd})
        return {cid: message for cid in client_ids}

    def aggregate_evaluate(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        """``party<k>_<metric>`` per party and their plain mean under ``<metric>`` (``accuracy``:
        the parties' mean), plus ``accuracy_std`` over parties."""
        out: dict[str, float] = {}
        keys = sorted(
            {
                k
                for m in replies.values()
                for k, v in m.meta.items()
                if isinstance(v, (int, float)) and k != "num_examples"
            }
        )
        for cid, reply in sorted(replies.items()):
            for key in keys:
                if key in reply.meta:
                    out[f"party{cid}_{key}"] = float(reply.meta[key])
        for key in keys:
            values = [float(m.meta[key]) for m in replies.values() if key in m.meta]
            out[key] = float(np.mean(values))
            if key == "accuracy":
                out["accuracy_std"] = float(np.std(values))
        return out

    # -- diagnostics (never used for training) -------------------------------------------------
    def true_labels(self, pool: Pool) -> np.ndarray:
        """The pool rows' true labels, read from the task's pool for diagnostics only."""
        train, parts = self.context.task.train, self.context.partitions
        return np.array([train.labels[parts[k][i]] for k, i in zip(pool.party, pool.local)], dtype=np.int64)
