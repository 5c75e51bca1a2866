"""The options of the bilevel methods (RABO, RAFBO, FedMBO: :mod:`fedtune.methods.rabo.rabo`), apart
so that their cost model (:mod:`fedtune.methods.rabo.plan`) reads them typed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fedtune.config import RunConfig
from fedtune.methods.rabo.masks import Policy
from fedtune.registry import MethodOptions


class BilevelOptions(MethodOptions):
    outer_lr: float = Field(0.01, gt=0, description="alpha: the outer step on x (eq. (8))")
    inner_lr: float = Field(0.1, gt=0, description="beta: the inner step on y (eqs. (5)-(6))")
    inner_steps: int = Field(10, ge=1, description="T: inner steps per round (Alg. 1 line 6)")
    inner_l2: float = Field(1e-3, ge=0, description="lambda: (lambda / 2) ||y||^2 added to g (strong convexity)")
    outer_loss: Literal["balanced", "vs"] = Field(
        "balanced", description="loss tuning: f on validation (fedtune.tasks.bilevel_problems)"
    )
    count_flops: bool = Field(False, description="count each client's FLOPs (torch's counter; about 2x slower)")


class ImplicitOptions(BilevelOptions):
    solver: Literal["cg", "neumann"] = Field("cg", description="inverse-Hessian-vector product of eq. (7)")
    solver_iters: int = Field(10, ge=1, description="CG iterations / Neumann terms (Hessian-vector products)")
    neumann_lr: float = Field(0.1, gt=0, description="Neumann series step (below 2 / the largest curvature)")


class MaskOptions(MethodOptions):
    masks: Policy = Field("importance", description="mask policy M(., R_i): importance, segment, static, rolling, full")
    segments: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="masks = 'segment': the segment of each client, one per client (default its id)"
    )

    def config_refusal(self, config: RunConfig) -> str | None:
        """``segments`` of a length other than ``federation.num_clients``."""
        clients = config.federation.num_clients
        if self.segments is not None and len(self.segments) != clients:
            return f"options.segments: one segment per client expected ({clients} clients), got {len(self.segments)}"
        return None


class RaboOptions(ImplicitOptions, MaskOptions):
    pass


class RafboOptions(BilevelOptions, MaskOptions):
    fd_coordinates: int = Field(64, ge=1, description="|P|: coordinates of the x sub-model perturbed (Alg. 2 line 3)")
    fd_mu: float = Field(1e-3, gt=0, description="mu: the smoothing (perturbation size) of eq. (10)")
    fd_steps: int | None = Field(None, ge=1, description="inner steps of y_hat(x + mu e_p) (default T)")
