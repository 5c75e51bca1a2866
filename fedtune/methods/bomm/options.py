"""BoMM's options (one class for BoMM and its five baselines, so a benchmark gives every method
the same settings); the parts that tell the methods apart are chosen at registration
(:mod:`fedtune.methods.bomm`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedtune.registry import MethodOptions


class BommOptions(MethodOptions):
    """The ``[options]`` of ``bomm`` and its baselines (each reads the fields it uses)."""

    deviations: ClassVar[dict[str, str]] = {
        "cloud model": "LLaVA-1.5-7B in the paper; here a frozen ImageNet MobileNetV2 (phi, run where the data is) "
        "with a trainable MLP classifier psi_1 (0.73M) and generator psi_2 in phi's representation space",
        "party models": "CLIP-base / CLIP-large in the paper; here the paired task's fusion CNN, initialized per party",
        "data": "MS COCO / CUB-200 image + caption in the paper; "
        "here digit images + spoken digits (audio plays 'text')",
        "schedule": "3 rounds x 20 epochs (Adam, lr 5e-4 parties / 5e-5 cloud) in the paper; here train.local_steps "
        "party steps and cloud_epochs / generator_epochs cloud epochs per round",
    }

    backbone: str = Field("mobilenet-v2", description="the cloud's frozen pretrained backbone phi")
    backbone_size: int = Field(32, ge=16, le=224, description="side of the square input phi reads (both modalities)")
    # cloud classifier psi_1 and generator psi_2
    cloud_hidden: int = Field(256, gt=0, description="psi_1: hidden width of each modality's MLP")
    cloud_embed: int = Field(128, gt=0, description="psi_1: embedding width")
    cloud_epochs: int = Field(3, ge=0, description="tau': cloud epochs over its labeled samples per round")
    cloud_lr: float = Field(1e-3, gt=0, description="cloud Adam learning rate (psi_1)")
    cloud_batch_size: int = Field(64, gt=0, description="cloud batch size (psi_1 and psi_2)")
    generator_hidden: int = Field(256, gt=0, description="psi_2: hidden width")
    generator_epochs: int = Field(3, ge=0, description="cloud epochs of the generator per round")
    generator_lr: float = Field(1e-3, gt=0, description="generator Adam learning rate (psi_2)")
    # preference-driven completion, eqs. (3)-(4)
    beta: float = Field(
        1.0, gt=0, description="eq. (3): scale of the reward margin (see fedtune.methods.bomm.completion)"
    )
    gamma: float = Field(1.0, ge=0, description="L_G = L_prefer + gamma L_special (0: ablation w/o special loss)")
    prefer: bool = Field(True, description="keep L_prefer in L_G (false: ablation w/o preference loss)")
    reference: Literal["round", "initial"] = Field(
        "round", description="DPO reference G_ref: the generator as it starts each round, or as initialized (fixed)"
    )
    # dynamic sample scheduler, eqs. (5)-(8)
    scheduler: bool = Field(True, description="schedule generated samples (false: use every generation)")
    mu: float = Field(0.4, description="eq. (8): a generated sample is used when r_hat > mu")
    lam: float = Field(0.1, description="eq. (8): lambda, weight of the explore network R^q")
    reward_entropy: float = Field(0.1, ge=0, description="eq. (5): delta, weight of the prediction entropy")
    scheduler_hidden: int = Field(64, gt=0, description="R^p and R^q hidden width")
    scheduler_lr: float = Field(1e-3, gt=0, description="R^p and R^q Adam learning rate")
    # global prototype-guided alignment, eq. (9)
    n_global: int = Field(100, gt=0, description="N_global: size the global prototype set grows to")
    grow_per_round: int = Field(20, ge=0, description="new aligned pairs that join the prototype set per round")
    alignment_vector: Literal["cost", "plan"] = Field(
        "cost", description="relationship vector: the OT cost row M_i (eq. (9)) or the Sinkhorn plan row"
    )
    sinkhorn_reg: float = Field(0.05, gt=0, description="entropic weight of alignment_vector = 'plan'")
    alignment_space: Literal["cloud", "phi"] = Field(
        "cloud", description="compare the cloud classifier's modality embeddings (from round 2) or the phi features"
    )
    complete_before_align: bool = Field(True, description="align on representations completed by the generator")
    label_transfer: bool = Field(True, description="parties train on the labels of their enlarged aligned partners")
    # parties
    adapter_weight: float = Field(1.0, ge=0, description="party: weight of the adapter's distillation loss")
    diagnostics: bool = Field(True, description="server metrics from the pool's true labels (matching accuracy)")


CloudRows = Literal["aligned", "all"]  # the rows a cloud holds: the aligned ids' rows, or every row
