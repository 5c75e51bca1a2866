"""BoMM (multi-modality large-small model bidirectional collaboration) and the five baselines of its
Section 5.1, registered as ``bomm``, ``bomm-local``, ``bomm-mm-local``, ``bomm-vanilla``,
``bomm-mm-ac`` and ``bomm-mm-uc`` (the names carry the prefix because ``local`` is the LoRA
methods' reference). They run on the ``paired-multimodal`` task.

- :mod:`~fedtune.methods.bomm.options`: the options (shared by all six) and the mode of each;
- :mod:`~fedtune.methods.bomm.party`: a party (Client): its small model, what it sends, local
  training with completions and the scheduler;
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

Baselines (Section 5.1), as implemented (:data:`~fedtune.methods.bomm.options.MODES`):

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

from fedtune.methods.bomm.aligner import PrototypeAlignment
from fedtune.methods.bomm.cloud import BommCloud, BommServer
from fedtune.methods.bomm.common import PAIRED
from fedtune.methods.bomm.completer import PreferenceCompletion, RegressionCompletion
from fedtune.methods.bomm.options import MODES, BommOptions
from fedtune.methods.bomm.party import BommParty
from fedtune.registry import register

#: The six methods: (description, the server: no cloud, or the cloud assembled from its parts). The
#: parties (one Client class) read what they do from the method's entry of
#: :data:`~fedtune.methods.bomm.options.MODES` (``config.method``), which these parts match.
METHODS = {
    "bomm": (
        "BoMM: parties' small models and a cloud multimodal model help each other (alignment, completion, scheduler)",
        BommCloud.assemble("all", aligner=PrototypeAlignment(), completer=PreferenceCompletion()),
    ),
    "bomm-local": ("BoMM's LOCAL baseline: each party trains its small model alone", BommServer),
    "bomm-mm-local": (
        "BoMM's MM-LOCAL baseline: each party completes missing modalities with its own generator",
        BommServer,
    ),
    "bomm-vanilla": (
        "BoMM's Vanilla baseline: the cloud trains on the aligned ids' representations",
        BommCloud.assemble("aligned"),
    ),
    "bomm-mm-ac": (
        "BoMM's MM-AC baseline: Vanilla plus cloud completion of the aligned rows",
        BommCloud.assemble("aligned", completer=RegressionCompletion()),
    ),
    "bomm-mm-uc": (
        "BoMM's MM-UC baseline: cloud completion of aligned and unaligned rows",
        BommCloud.assemble("all", completer=RegressionCompletion()),
    ),
}
assert set(METHODS) == set(MODES)
for _name, (_description, _server) in METHODS.items():
    register(_name, _server, BommParty, BommOptions, _description, requires=(PAIRED,), supports=("device",))
