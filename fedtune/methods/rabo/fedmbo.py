"""Full-model federated bilevel optimization, FedMBO / FedNest style: RABO's two exchanges per
round with every client on the whole x and y (no masks, capacities ignored).

Each round: T local inner steps on y from y_q, the server's mean of the clients' accumulated
inner gradients (y_{q+1} = y_q - beta mean_i G_q^i), then each client's local hypergradient at
(x_q, y_{q+1}) by implicit differentiation with conjugate gradient or a Neumann series of
Hessian-vector products (FedNest's ``neumann_hyperstep_preconditioner``), and x_{q+1} =
x_q - alpha mean_i H_q^i. This is RABO with C_{q,x}^s = C_{q,y}^k = n for every entry, the case
RABO's Remark 2 identifies with FedMBO's linear-speedup rate. Simplifications against the
published algorithms: FedMBO (Huang et al. 2023) and FedNest (Tarzanagh et al. 2022) take several
local outer steps with variance-reduced or server-aggregated inverse-Hessian estimates; here one
outer step per round with the local estimate, exactly RABO's Algorithm 1 without masks, so that
the comparison of Fig. 4 isolates the pruning.
"""

from __future__ import annotations

from fedtune.methods.rabo.options import ImplicitOptions
from fedtune.methods.rabo.plan import FULL_MODEL_PLAN
from fedtune.methods.rabo.rabo import BILEVEL, BilevelClient, BilevelStrategy
from fedtune.registry import register


class FedMBOStrategy(BilevelStrategy):
    """FedMBO-style full-model federated bilevel optimization (RABO's rounds without masks)."""

    masked = False


register(
    "fedmbo", FedMBOStrategy, BilevelClient, ImplicitOptions, requires=BILEVEL, supports=("device",),
    plan=FULL_MODEL_PLAN,
)  # fmt: skip
