"""FedRolex: rolling sub-model extraction (Alam et al., NeurIPS 2022), a baseline of RABO.

In round j every client of capacity beta trains, in each hidden layer of n units, the window of
ceil(beta n) consecutive units starting at j mod n and wrapping around (the paper's eq. (4), with
j counted from 0: round 1 starts at unit 0), with the matching input columns of the next layer;
the window advances by one unit per round, so over n rounds every unit is trained equally often.
All clients of a round share the window start (a smaller window is a prefix of a larger one).
The server averages every entry over the clients that covered it and keeps the others (the
reference ``combine``). The paper sizes the window floor(beta n); its code, and this module, use
ceil(beta n) (equal for the capacities 1/2^k of RABO's experiments on 2^m-channel layers). The
reference code builds the window with ``torch.roll(arange(n), j)``, which starts it at -j mod n
(it moves the other way round the layer); the paper's direction is used here.
"""

from __future__ import annotations

from fedtune.methods.rabo.plan import CAPACITY_PLAN
from fedtune.methods.rabo.submodel import SubmodelClient, SubmodelOptions, SubmodelStrategy
from fedtune.registry import register


class FedRolexStrategy(SubmodelStrategy):
    """FedRolex: a rolling window of ceil(beta n) units per layer, advancing one unit per round."""

    policy = "rolling"


register("fedrolex", FedRolexStrategy, SubmodelClient, SubmodelOptions, supports=("device",), plan=CAPACITY_PLAN)
