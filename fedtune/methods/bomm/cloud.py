"""BoMM's cloud (the Strategy): the cloud model f_psi = frozen backbone phi + classifier psi_1 +
generator psi_2, global prototype-guided alignment, and the round's exchanges with the parties.

**Parts.** A method's registration assembles its cloud (:meth:`BommCloud.assemble`) from the rows
it holds (``rows``: the aligned ids' or all), an aligner (:mod:`~fedtune.methods.bomm.aligner`: none,
or global prototype-guided alignment with label transfer) and a completer
(:mod:`~fedtune.methods.bomm.completer`: no generator, regression on real targets, or the
preference-driven L_G of eqs. (3)-(4)). LOCAL and MM-LOCAL have no cloud: :class:`BommServer`.

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
from functools import partial
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from fedtune.data.paired import missing_modality
from fedtune.methods.bomm.aligner import NoAlignment
from fedtune.methods.bomm.backbone import FEATURE_DIM, source_features
from fedtune.methods.bomm.classifier import train_classifier
from fedtune.methods.bomm.common import (
    CLOUD_INIT,
    CLOUD_TRAIN,
    Standardizer,
    generate,
    load_module,
    module_arrays,
    on,
    party_metrics,
    placed,
    run_device,
)
from fedtune.methods.bomm.completer import NoCompletion, complete_rows
from fedtune.methods.bomm.networks import CloudClassifier
from fedtune.methods.bomm.options import BommOptions, CloudRows
from fedtune.methods.bomm.party import COMPLETE, scope_rows
from fedtune.methods.bomm.pool import CloudRound, M, Pool, union_samples
from fedtune.models.audio import seeded
from fedtune.models.multimodal import MODALITY_NAMES
from fedtune.models.precision import model_device
from fedtune.models.tensors import to_numpy
from fedtune.models.training import evaluate_classifier, seed_for
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.protocol.validation import ArraySpec


class BommServer(Strategy):
    """BoMM without a cloud (LOCAL, MM-LOCAL): the parties train in ``fit``; the server relays the
    rounds and gathers the parties' metrics. The base of :class:`BommCloud`, whose state it holds
    and checkpoints (the same keys for every BoMM method; empty here)."""

    options: BommOptions  # the method's registered options class (resolve_run validated them)

    # -- setup and state -----------------------------------------------------------------------
    def initialize(self) -> None:
        self.uploads: dict[int, dict[str, np.ndarray]] = {}
        self.grown = np.zeros((0, 4), dtype=np.int64)  # (party k, row of k, party w, row of w) per grown prototype
        self.generator_trained = self.classifier_trained = False
        self._build()

    def _build(self) -> None:
        """The cloud's networks, freshly initialized from the run's seed (none here)."""
        self.classifier = self.generator = None

    def networks(self) -> dict[str, torch.nn.Module]:
        """The cloud's trainable networks by name (``classifier``: psi_1, ``generator``: psi_2)."""
        named = (("classifier", self.classifier), ("generator", self.generator))
        return {name: module for name, module in named if module is not None}

    def state_dict(self) -> dict:
        state = {
            "uploads": {str(k): dict(v) for k, v in self.uploads.items()},
            "grown": self.grown.copy(),
            "generator_trained": self.generator_trained,
            "classifier_trained": self.classifier_trained,
        }
        return state | {name: module_arrays(module, "") for name, module in self.networks().items()}

    def load_state_dict(self, state: dict) -> None:
        self._build()
        self.uploads = {int(k): {n: np.asarray(a) for n, a in v.items()} for k, v in state.get("uploads", {}).items()}
        self.grown = np.asarray(state["grown"], dtype=np.int64).reshape(-1, 4)
        self.generator_trained = bool(state["generator_trained"])
        self.classifier_trained = bool(state["classifier_trained"])
        for name, module in self.networks().items():
            load_module(module, state[name], "")

    def save(self, run_dir) -> None:
        """The cloud model's trainable parts, ``cloud.safetensors`` (``classifier.*``, ``generator.*``),
        if any; the parties' small models stay with the parties (their state)."""
        networks = self.networks()
        if not networks:
            return
        from safetensors.torch import save_file

        tensors = {f"{name}.{k}": v.contiguous() for name, m in networks.items() for k, v in m.state_dict().items()}
        save_file(tensors, str(run_dir / "cloud.safetensors"))

    # -- the exchanges -------------------------------------------------------------------------
    def wants_upload(self, cid: int) -> bool:
        """Whether party ``cid`` is asked for its representations this round (never without a cloud)."""
        return False

    def configure_fit(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        return {cid: Message({}, {"round": rnd, "send": self.wants_upload(cid)}) for cid in client_ids}

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        """No arrays."""
        return {}

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        return party_metrics(replies)

    def evaluation_arrays(self) -> dict[str, np.ndarray]:
        """What the parties' evaluation message carries (nothing without a cloud)."""
        return {}

    def configure_evaluate(self, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        """Every party evaluates its small model (the message: :meth:`evaluation_arrays`)."""
        message = Message(self.evaluation_arrays(), {"round": rnd})
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


class BommCloud(BommServer):
    """BoMM's cloud and the baselines' (Vanilla, MM-AC, MM-UC): the cloud model holds ``rows`` of the
    parties' representations and is assembled from an ``aligner`` and a ``completer``
    (:meth:`assemble`; the defaults: Vanilla's)."""

    rows: ClassVar[CloudRows] = "aligned"
    aligner: ClassVar[NoAlignment] = NoAlignment()
    completer: ClassVar[NoCompletion] = NoCompletion()

    @classmethod
    def assemble(
        cls, rows: CloudRows, aligner: NoAlignment = aligner, completer: NoCompletion = completer
    ) -> type[BommCloud]:
        """The cloud of a method that holds ``rows`` ("aligned": the aligned ids' rows; "all") and
        uses these parts (what the method registers)."""
        name = f"{cls.__name__}[{rows} rows, {aligner.name}, {completer.name}]"
        doc = f"BoMM's cloud over {rows} rows with {aligner.name} and {completer.name}."
        attrs = {"rows": rows, "aligner": aligner, "completer": completer, "__doc__": doc, "__module__": cls.__module__}
        return type(name, (cls,), attrs)

    # -- setup ---------------------------------------------------------------------------------
    def _build(self) -> None:
        o, seed, task = self.options, self.config.seed, self.context.task
        self.classifier = placed(
            seeded(
                seed_for(seed, CLOUD_INIT),
                lambda: CloudClassifier(task.num_labels, FEATURE_DIM, M, o.cloud_hidden, o.cloud_embed),
            ),
            self.config,
        )
        generator = self.completer.build(o, seed)
        self.generator = None if generator is None else placed(generator, self.config)
        self.outgoing: dict[int, Message] = {}
        self._stats: tuple[tuple, Standardizer] | None = None

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
    def wants_upload(self, cid: int) -> bool:
        return cid not in self.uploads

    def reply_spec(self, rnd: int, cid: int, sent: Message) -> dict[str, ArraySpec]:
        """No arrays, except the representations (and the aligner's prototypes) a party was asked to
        send: their count follows from the public structure of the parties (their sizes, the aligned ids)."""
        if sent.meta.get("phase") == COMPLETE or not sent.meta.get("send"):
            return {}
        train = self.context.task.train
        n = len(scope_rows(train.aligned[self.context.partitions[cid]], self.rows))
        spec = {
            "rows": ArraySpec((n,), "int64", False),
            "sample_ids": ArraySpec((n,), "int64", False),
            "masks": ArraySpec((n, M), "bool", False),
            "labels": ArraySpec((n,), "int64", False),
            "features": ArraySpec((n, M, FEATURE_DIM), "float32", False),
        }
        return spec | self.aligner.upload_spec(self.context.task.num_labels)

    def aggregate_fit(self, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        for cid, reply in replies.items():
            if reply.arrays:
                self.uploads[cid] = {k: np.asarray(v) for k, v in reply.arrays.items()}
        start = time.perf_counter()
        metrics = self.cloud_update(rnd, sorted(replies))
        metrics["cloud_compute_s"] = time.perf_counter() - start
        return metrics

    def phases(self, rnd: int) -> tuple[str, ...]:
        return (COMPLETE,)

    def configure_phase(self, phase: str, rnd: int, client_ids: list[int]) -> dict[int, Message]:
        if phase != COMPLETE:
            return super().configure_phase(phase, rnd, client_ids)
        meta = {"round": rnd, "phase": COMPLETE}
        return {cid: Message(self.outgoing.get(cid, {}), meta) for cid in client_ids}

    def aggregate_phase(self, phase: str, rnd: int, replies: dict[int, Message]) -> dict[str, float]:
        return party_metrics(replies)

    def evaluation_arrays(self) -> dict[str, np.ndarray]:
        """The trained generator's completion of the test pairs' missing modality (``test_gen``,
        phi-space); nothing in scenario 0 or before the generator has trained."""
        t = self.missing
        if t is None or not self.generator_trained:
            return {}
        z = self.test_z()
        return {"test_gen": self.standardizer().invert_one(generate(self.generator, z[:, 1 - t], t), t)}

    # -- the cloud's update --------------------------------------------------------------------
    def cloud_update(self, rnd: int, active: list[int]) -> dict[str, float]:
        """Alignment (the aligner), generator (the completer), classifier, and the completions /
        labels for the parties (``self.outgoing``); returns the round's cloud metrics. The parts read
        the round (:class:`~fedtune.methods.bomm.pool.CloudRound`) and return what the cloud applies."""
        pool = Pool.of(self.uploads)
        self.outgoing = {}
        if len(pool) == 0:
            return {}
        o, st = self.options, self.standardizer()
        truth = self.true_labels(pool) if o.diagnostics else None
        r = CloudRound(
            rnd, self.config.seed, self.uploads, pool, st, st.apply(pool.x, pool.mask), self.alignment_space(), truth
        )
        complete = partial(complete_rows, self.generator) if self.generator_trained else None
        aligned = self.aligner.align(r, self.grown, o, self.config.federation.num_clients, complete)
        self.grown = aligned.grown
        samples = union_samples(pool.sid, aligned.pairs)
        generator_metrics, trained = self.completer.train(self.generator, r, samples, aligned.protos, o)
        self.generator_trained = self.generator_trained or trained
        metrics = aligned.metrics | generator_metrics
        zc, mc, gen_mod = self.complete(r.z, pool.mask)
        metrics |= self.train_classifier(rnd, pool, zc, mc, samples)
        completions = self.completer.completions(r, zc, gen_mod)
        labels, label_metrics = self.aligner.transfer_labels(r, samples, o)
        self.outgoing = {k: completions.get(k, {}) | labels.get(k, {}) for k in r.parties}
        return metrics | label_metrics

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
                    inputs = on(np.asarray(x[rows, mod], np.float32), model_device(classifier))
                    out[rows, mod] = to_numpy(encoder(inputs))
            return out

        return embed

    def complete(self, z: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(completed z, completed mask, generated modality per row or -1): every row holding one
        modality gets the generator's representation of the other (none without a generator)."""
        return complete_rows(self.generator, z, mask)

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
                    run_device(self.config),
                )
                for name in MODALITY_NAMES
            ],
            axis=1,
        )
        return self.standardizer().apply(feats)

    def evaluate(self, rnd: int) -> dict[str, float]:
        """The cloud model on the test pairs: complete, each modality alone, and (with a generator)
        the scenario's missing modality completed by it (``cloud_accuracy_completed``, and the
        completer's ``cloud_gen_cosine``)."""
        z = self.test_z()
        y = torch.from_numpy(self.context.task.test.labels.astype(np.int64))
        variants = {"": (True, True), "_image_only": (True, False), "_audio_only": (False, True)}
        metrics: dict[str, float] = {}
        for suffix, present in variants.items():
            mask = np.tile(np.asarray(present), (len(z), 1))
            metrics |= self.accuracy(z, mask, y, suffix)
        completed = self.completer.completed_test(self.generator, z, self.missing)
        if completed is not None:
            zc, mc, generator_metrics = completed
            metrics |= self.accuracy(zc, mc, y, "_completed") | generator_metrics
        return metrics

    def accuracy(self, z: np.ndarray, mask: np.ndarray, y: torch.Tensor, suffix: str) -> dict[str, float]:
        """``cloud_accuracy<suffix>`` (and ``cloud_loss`` without a suffix) of the cloud model on
        standardized test representations ``z`` with modalities ``mask``."""
        x, m = torch.from_numpy(z[:, None].astype(np.float32)), torch.from_numpy(mask[:, None])
        bs = self.config.train.eval_batch_size

        def forward(model, idx):
            fused, _ = model(x[idx], m[idx])  # host rows: the classifier's pre-hook moves them
            labels = y[idx].to(fused.device)
            return fused, labels, F.cross_entropy(fused, labels)

        result = evaluate_classifier(
            self.classifier, (np.arange(i, min(i + bs, len(y))) for i in range(0, len(y), bs)), forward
        )
        out = {f"cloud_accuracy{suffix}": result["accuracy"]}
        if not suffix:
            out["cloud_loss"] = result["loss"]
        return out

    # -- diagnostics (never used for training) -------------------------------------------------
    def true_labels(self, pool: Pool) -> np.ndarray:
        """The pool rows' true labels, read from the task's pool for diagnostics only."""
        train, parts = self.context.task.train, self.context.partitions
        return np.array([train.labels[parts[k][i]] for k, i in zip(pool.party, pool.local)], dtype=np.int64)
