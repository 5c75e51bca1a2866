"""BoMM (multi-modality large-small model bidirectional collaboration) and the five baselines of its
Section 5.1, registered as ``bomm``, ``bomm-local``, ``bomm-mm-local``, ``bomm-vanilla``,
``bomm-mm-ac`` and ``bomm-mm-uc`` (the names carry the prefix because ``local`` is the LoRA
methods' reference). They run on the ``paired-multimodal`` task.

- :mod:`~fedtune.methods.bomm.options`: the options (shared by all six);
- :mod:`~fedtune.methods.bomm.party`: a party (Client): its small model, what it sends, local
  training with completions and the scheduler, assembled per method from parts
  (:mod:`~fedtune.methods.bomm.party_parts`: where its completions come from, whether it schedules
  them; with a cloud, the cloud's aligner for what it sends);
- :mod:`~fedtune.methods.bomm.cloud`: the cloud (Strategy): the classifier, the round's exchanges,
  assembled per method from parts: :mod:`~fedtune.methods.bomm.aligner` (none, or global
  prototype-guided alignment) and :mod:`~fedtune.methods.bomm.completer` (no generator, regression,
  or preference-driven completion);
- :mod:`~fedtune.methods.bomm.common`: what both sides share.

BoMM's networks and the pure pieces of its algorithm (Section 4), free of any protocol code:

- :mod:`~fedtune.methods.bomm.backbone`: the cloud model's frozen pretrained backbone phi, run
  where the data is (parties; the server on the public test set), with a per-process feature cache;
- :mod:`~fedtune.methods.bomm.networks`: the cloud classifier psi_1, the generator psi_2 and the
  parties' adapters from phi-space into their small model's embedding space;
- :mod:`~fedtune.methods.bomm.completion`: the preference-driven completion loss, eqs. (3)-(4);
- :mod:`~fedtune.methods.bomm.scheduler`: the dynamic sample scheduler, eqs. (5)-(8);
- :mod:`~fedtune.methods.bomm.alignment`: prototypes and global prototype-guided alignment, eq. (9);
- :mod:`~fedtune.methods.bomm.dual_encoder`: CLIP-style dual encoders (phi for image + caption data).

Baselines (Section 5.1), as implemented (:data:`METHODS`):

- ``bomm-local`` (LOCAL): each party trains its small model on its labeled rows; no cloud.
- ``bomm-mm-local`` (MM-LOCAL): each party trains its own generator (regression, on its complete
  rows) and completes its missing modalities before local training; no cloud.
- ``bomm-vanilla`` (Vanilla): parties send the aligned ids' representations; the cloud trains its
  classifier on them; parties train on their local data.
- ``bomm-mm-ac`` (MM-AC): Vanilla, and the cloud's generator (regression on the real targets of the
  aligned rows) completes the aligned rows' missing modalities, for the cloud and for the parties.
- ``bomm-mm-uc`` (MM-UC): as MM-AC over every row, aligned and unaligned.
- ``bomm``: MM-UC's data flow with global prototype-guided alignment, the preference-driven
  generator and the parties' scheduler.
"""

from __future__ import annotations

from fedtune.methods.bomm.aligner import NoAlignment, PrototypeAlignment
from fedtune.methods.bomm.cloud import BommCloud, BommServer
from fedtune.methods.bomm.common import PAIRED
from fedtune.methods.bomm.completer import NoCompletion, PreferenceCompletion, RegressionCompletion
from fedtune.methods.bomm.options import BommOptions, CloudRows
from fedtune.methods.bomm.party import BommParty, CloudParty
from fedtune.methods.bomm.party_parts import CloudFill, LocalFill, NoScheduling, Scheduling
from fedtune.registry import register


def with_cloud(
    rows: CloudRows,
    aligner: NoAlignment = NoAlignment(),
    completer: NoCompletion = NoCompletion(),
    scheduling: NoScheduling = NoScheduling(),
) -> tuple[type[BommCloud], type[CloudParty]]:
    """A method with a cloud over ``rows``: the cloud assembled from ``aligner`` and ``completer``,
    its parties from the same ``rows`` and ``aligner`` (what they send), the completer's fill (the
    cloud's completions, if it has a generator) and ``scheduling``."""
    fill = CloudFill() if isinstance(completer, RegressionCompletion) else BommParty.fill
    cloud = BommCloud.assemble(rows, aligner=aligner, completer=completer)
    party = CloudParty.assemble(scope=rows, aligner=aligner, fill=fill, scheduling=scheduling)
    return cloud, party


#: The six methods: (description, (the server, the parties)), both assembled from their parts.
METHODS = {
    "bomm": (
        "BoMM: parties' small models and a cloud multimodal model help each other (alignment, completion, scheduler)",
        with_cloud("all", PrototypeAlignment(), PreferenceCompletion(), Scheduling()),
    ),
    "bomm-local": ("BoMM's LOCAL baseline: each party trains its small model alone", (BommServer, BommParty)),
    "bomm-mm-local": (
        "BoMM's MM-LOCAL baseline: each party completes missing modalities with its own generator",
        (BommServer, BommParty.assemble(fill=LocalFill())),
    ),
    "bomm-vanilla": (
        "BoMM's Vanilla baseline: the cloud trains on the aligned ids' representations",
        with_cloud("aligned"),
    ),
    "bomm-mm-ac": (
        "BoMM's MM-AC baseline: Vanilla plus cloud completion of the aligned rows",
        with_cloud("aligned", completer=RegressionCompletion()),
    ),
    "bomm-mm-uc": (
        "BoMM's MM-UC baseline: cloud completion of aligned and unaligned rows",
        with_cloud("all", completer=RegressionCompletion()),
    ),
}
for _name, (_description, (_server, _party)) in METHODS.items():
    register(_name, _server, _party, BommOptions, _description, requires=(PAIRED,), supports=("device",))
