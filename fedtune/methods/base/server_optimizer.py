"""The server's step on an aggregated update, shared by every LoRA method (``[server]``).

Each method aggregates its clients' replies into one update Delta^t per global array (FedIT and
FSLoRA: eq. (5)'s sum_i p_i Delta_i; HeteroLoRA: the zero-padded average; FlexLoRA: the new Delta W
minus the old one; FedStackLoRA: the stacked product B_stack A_stack). This module turns Delta^t
into the new global state x^{t+1}:

- ``server.optimizer = "sgd"`` (default): x^{t+1} = x^t + eta Delta^t, eta = ``server.lr``
  (default 1). With eta = 1 this is each method's own rule exactly (FSLoRA: eq. (5)), bit for
  bit. **Deviation** from the papers when eta != 1. With ``server.momentum`` mu > 0, heavy-ball
  momentum on the update (FedAvgM, Hsu et al. 2019, Alg. 1 with the pseudo-gradient -Delta^t):
  b^t = mu b^{t-1} + Delta^t (b^0 = 0), x^{t+1} = x^t + eta b^t; **deviation** too (each round's
  step carries the earlier rounds' updates). Under DP it is post-processing of the released
  aggregates: it spends no privacy (DP-FedAvgM).
- ``server.optimizer = "adam"``: FedAdam (Reddi et al. 2021, Alg. 2) with the pseudo-gradient
  -Delta^t: m^t = b1 m^{t-1} + (1 - b1) Delta^t, v^t = b2 v^{t-1} + (1 - b2) (Delta^t)^2,
  x^{t+1} = x^t (1 - eta wd) + eta m_hat^t / (sqrt(v_hat^t) + eps), with m_hat = m / (1 - b1^t) and
  v_hat = v / (1 - b2^t) when ``server.bias_correction`` (torch's Adam/AdamW, the default) and
  m_hat = m, v_hat = v without it (Reddi et al.'s form, where eps is their tau). This is what the
  published FSLoRA code runs (``torch.optim.AdamW(lr=server_lr)`` on the negated mean update:
  betas (0.9, 0.999), eps 1e-8, bias correction, weight decay 0.01). **Deviation** from every
  paper's aggregation rule (FSLoRA's eq. (5), FedAvg's mean). Its per-coordinate normalization
  also undoes eq. (5)'s k/r shrinking of rarely drawn ranks, and a coordinate no client touched
  this round (an FSLoRA rank nobody drew) still moves by its first moment.

Moments and the momentum buffer are kept in float64 per array name (missing names start at zero);
the new arrays keep their dtype. The state (step count, moments, buffer) is part of the strategy's
checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedtune.config import ServerConfig


@dataclass(frozen=True)
class ServerStep:
    """The server optimizer's settings (``[server]``), read once (:meth:`of`)."""

    kind: str
    lr: float
    momentum: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    bias_correction: bool

    @classmethod
    def of(cls, server: ServerConfig) -> ServerStep:
        b1, b2 = (float(b) for b in server.betas)
        return cls(
            server.optimizer,
            server.resolved_lr(),
            float(server.momentum),
            (b1, b2),
            float(server.eps),
            float(server.weight_decay),
            bool(server.bias_correction),
        )


class ServerOptimizer:
    """x^{t+1} from x^t and the aggregated update Delta^t (see the module docstring)."""

    def __init__(self, step: ServerStep) -> None:
        self.kind, self.lr, self.betas, self.eps = step.kind, step.lr, step.betas, step.eps
        self.momentum = step.momentum
        self.weight_decay, self.bias_correction = step.weight_decay, step.bias_correction
        self.t = 0
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self.buffer: dict[str, np.ndarray] = {}

    @property
    def is_identity(self) -> bool:
        """True when x^{t+1} = x^t + Delta^t exactly (plain SGD, server lr 1, no momentum): each
        paper's rule."""
        return self.kind == "sgd" and self.lr == 1.0 and self.momentum == 0

    def step(self, params: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """x^{t+1} for every array of ``params`` (an array absent from ``update`` is unchanged; one
        absent from ``params`` starts at zero)."""
        out = dict(params)
        if self.kind == "sgd" and self.momentum:
            return self._momentum_step(out, update)
        if self.kind == "sgd":
            for k, d in update.items():
                out[k] = self.lr * d if k not in params else params[k] + self.lr * d
            return out
        self.t += 1
        b1, b2 = self.betas
        c1 = 1.0 - b1**self.t if self.bias_correction else 1.0
        c2 = 1.0 - b2**self.t if self.bias_correction else 1.0
        for k, d in update.items():
            d64 = np.asarray(d, dtype=np.float64)
            m = b1 * self.m.get(k, 0.0) + (1.0 - b1) * d64
            v = b2 * self.v.get(k, 0.0) + (1.0 - b2) * d64**2
            self.m[k], self.v[k] = m, v
            x = np.asarray(params[k], dtype=np.float64) if k in params else np.zeros_like(d64)
            x = x * (1.0 - self.lr * self.weight_decay) + self.lr * (m / c1) / (np.sqrt(v / c2) + self.eps)
            out[k] = x.astype(params[k].dtype if k in params else np.asarray(d).dtype)
        return out

    def _momentum_step(self, out: dict[str, np.ndarray], update: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """b^t = mu b^{t-1} + Delta^t, x^{t+1} = x^t + eta b^t (module docstring), per array of
        ``update``; a buffer of an array absent from ``update`` is left as it is."""
        for k, d in update.items():
            d64 = np.asarray(d, dtype=np.float64)
            self.buffer[k] = self.momentum * self.buffer.get(k, 0.0) + d64
            x = np.asarray(out[k], dtype=np.float64) if k in out else np.zeros_like(d64)
            out[k] = (x + self.lr * self.buffer[k]).astype(out[k].dtype if k in out else np.asarray(d).dtype)
        return out

    def move_to(self, params: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """For methods whose aggregate is a new state rather than an update (FlexLoRA's Delta W,
        HeteroLoRA's module average): ``target`` itself when :attr:`is_identity` (bit for bit),
        else :meth:`step` with Delta^t = target - x^t."""
        if self.is_identity:
            return {**params, **target}
        update = {k: v - params[k] if k in params else v for k, v in target.items()}
        return self.step(params, update)

    def state_dict(self) -> dict:
        if self.kind == "sgd":
            return {"buffer": dict(self.buffer)} if self.momentum else {}
        return {"t": self.t, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state: Mapping | None) -> None:
        state = state or {}
        self.t = int(state.get("t", 0))
        self.m = {k: np.asarray(v, dtype=np.float64) for k, v in state.get("m", {}).items()}
        self.v = {k: np.asarray(v, dtype=np.float64) for k, v in state.get("v", {}).items()}
        self.buffer = {k: np.asarray(v, dtype=np.float64) for k, v in state.get("buffer", {}).items()}
