"""Static sub-models, HeteroFL (Diao et al., ICLR 2021), the "Static" baseline of RABO's Table II.

A client of capacity beta (``profile.capacity``, HeteroFL's model rate) trains the nested slice of
the global model made of the *first* ceil(beta n) units of every hidden layer (``split_model``:
``torch.arange(output_size)[:local_output_size]``, and the matching input columns of the next
layer); the slices are the same every round, so a smaller model is always the top-left corner of
a larger one. The server averages every entry over the clients whose slice holds it and keeps the
others (``combine``: ``tmp_v[count > 0] / count[count > 0]``), which for updates reads
theta^k <- theta^k + (1 / C^k) sum_{i covering k} Delta_i^k (:mod:`fedtune.methods.rabo.submodel`).
"""

from __future__ import annotations

from fedtune.methods.rabo.plan import CAPACITY_PLAN
from fedtune.methods.rabo.submodel import SubmodelClient, SubmodelOptions, SubmodelStrategy
from fedtune.registry import register


class StaticStrategy(SubmodelStrategy):
    """Static (HeteroFL): nested width slices, the first ceil(beta n) units of every layer."""

    policy = "static"


register("static", StaticStrategy, SubmodelClient, SubmodelOptions, supports=("device",), plan=CAPACITY_PLAN)
