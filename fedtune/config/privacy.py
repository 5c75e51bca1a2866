"""``[privacy]``: client-level differential privacy."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedtune.config.base import Section

#: the smallest noise multiplier a run takes: dp-accounting's PLD epsilon of z = 0.01 takes seconds
#: (10 rounds, q = 1: 4 s on the shared CPU; z = 0.001: 6 minutes; z = 1e-12 fails inside it), and
#: :func:`fedtune.methods.base.accounting.calibrate` searches z from here up
MIN_NOISE_MULTIPLIER = 0.01


class PrivacyConfig(Section):
    """Client-level differential privacy (DP-FedAvg, McMahan et al. 2018): see
    :mod:`fedtune.methods.base.privacy` for the mechanism, the accountant and what is guaranteed."""

    mode: Literal["none", "central", "local"] = Field(
        "none", description="Gaussian noise on the server's sum (central, trusted server) or on each upload (local)"
    )
    clip: float | None = Field(None, gt=0, description="C: each client's update clipped to this L2 norm")
    per_layer: bool = Field(False, description="clip each of the L arrays to C/sqrt(L) instead of the whole update")
    noise_multiplier: float | None = Field(
        None,
        ge=MIN_NOISE_MULTIPLIER,
        le=1e6,
        description="z: noise std z*C (or calibrate it: epsilon); at least 0.01, whose epsilon the accountant "
        "computes in seconds (0.001: minutes; far below: it fails)",
    )
    epsilon: float | None = Field(None, gt=0, description="target epsilon after `rounds`: z calibrated to it")
    delta: float | None = Field(None, gt=0, lt=1, description="delta (default min(1/num_clients^2, 1e-5))")
    epsilon_budget: float | None = Field(None, gt=0, description="stop before a round whose epsilon would exceed this")
    accountant: Literal["pld", "rdp"] = Field("pld", description="pld (tight) or rdp (Renyi, an upper bound)")
    adjacency: Literal["replace-one", "add-remove"] = Field(
        "replace-one", description="neighbouring federations: one client's data replaced, or one client added/removed"
    )
    adaptive_clip: bool = Field(False, description="central: C follows a quantile of the update norms (Andrew 2021)")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="adaptive_clip: the norm quantile C tracks")
    clip_learning_rate: float = Field(0.2, gt=0, le=10, description="adaptive_clip: eta of C <- C exp(-eta (b - q))")
    clipped_count_stddev: float | None = Field(
        None, gt=0, description="adaptive_clip: sigma_b, noise std of the unclipped count (default max(m/20, z))"
    )
    insecure_reproducible_noise: bool = Field(
        False, description="TESTS ONLY, NOT PRIVATE: noise and sample derived from `seed`; epsilon reported as inf"
    )

    @model_validator(mode="after")
    def _check(self) -> PrivacyConfig:
        defaults = {k: f.default for k, f in type(self).model_fields.items()}
        if self.mode == "none":
            given = [k for k in type(self).model_fields if k != "mode" and getattr(self, k) != defaults[k]]
            if given:
                raise ValueError(f'privacy.{given[0]}: applies to privacy.mode = "central" or "local"')
            return self
        if self.clip is None:
            raise ValueError(f'privacy.clip: required with privacy.mode = "{self.mode}" (the L2 bound C)')
        if self.noise_multiplier is not None and self.epsilon is not None:
            raise ValueError("privacy: give privacy.noise_multiplier or privacy.epsilon (to calibrate it), not both")
        if self.noise_multiplier is None and self.epsilon is None:
            raise ValueError(
                f'privacy.noise_multiplier: required with privacy.mode = "{self.mode}" '
                "(or privacy.epsilon to calibrate it)"
            )
        if self.insecure_reproducible_noise and (self.epsilon is not None or self.epsilon_budget is not None):
            stated = "epsilon" if self.epsilon is not None else "epsilon_budget"
            raise ValueError(
                f"privacy.{stated}: not with privacy.insecure_reproducible_noise (its noise can be regenerated from "
                "the seed: it gives no privacy)"
            )
        adaptive = [k for k in ADAPTIVE_CLIP_KEYS if getattr(self, k) != defaults[k]]
        if adaptive and not self.adaptive_clip:
            raise ValueError(f"privacy.{adaptive[0]}: applies to privacy.adaptive_clip = true")
        if self.mode == "local":
            if self.adaptive_clip:
                raise ValueError("privacy.adaptive_clip: central only (its count is noised by the server)")
            if self.adjacency == "add-remove":
                raise ValueError(
                    'privacy.adjacency: local DP protects each upload against its replacement ("replace-one")'
                )
        elif self.accountant == "rdp" and self.adjacency == "replace-one":
            raise ValueError(
                'privacy.accountant: "rdp" has no Poisson-subsampled Gaussian under replace-one adjacency; '
                'use "pld" or privacy.adjacency = "add-remove"'
            )
        return self


ADAPTIVE_CLIP_KEYS = ("target_quantile", "clip_learning_rate", "clipped_count_stddev")
