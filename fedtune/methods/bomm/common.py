"""Pieces both sides of BoMM use: the standardization of phi-representations, generator training
(plain regression for the baselines, L_G of eqs. (3)-(4) for BoMM), seeds, and the task capability
BoMM runs on."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedtune.methods.bomm.completion import generator_loss
from fedtune.models import precision
from fedtune.models.precision import model_device
from fedtune.models.tensors import to_numpy
from fedtune.models.training import seed_for
from fedtune.protocol.messages import Message

PAIRED = "paired-modalities"  # the task capability BoMM needs: parties' rows with ids, masks and labels
# streams of seed_for(config.seed, STREAM, ...): one per random thing BoMM draws
PARTY_INIT, CLOUD_INIT, GENERATOR_INIT, SCHEDULER_INIT, CLOUD_TRAIN, GENERATOR_TRAIN = (
    0xB0,
    0xC1,
    0xC2,
    0xB5,
    0xC3,
    0xC4,
)


@dataclass
class Standardizer:
    """Per-modality, per-feature standardization z = (x - mean) / std of phi-representations,
    fitted on the rows that hold each modality (std floored at 1e-3)."""

    mean: np.ndarray  # (M, D)
    std: np.ndarray  # (M, D)

    @classmethod
    def fit(cls, x: np.ndarray, mask: np.ndarray) -> Standardizer:
        m, d = x.shape[1], x.shape[2]
        mean, std = np.zeros((m, d), np.float32), np.ones((m, d), np.float32)
        for mod in range(m):
            rows = x[mask[:, mod], mod]
            if len(rows):
                mean[mod] = rows.mean(0)
                std[mod] = np.maximum(rows.std(0), 1e-3)
        return cls(mean, std)

    def apply(self, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """(n, M, D) standardized; entries of absent modalities (``mask`` False) are zero."""
        z = ((x - self.mean) / self.std).astype(np.float32)
        return z if mask is None else z * mask[..., None]

    def apply_one(self, x: np.ndarray, modality: int) -> np.ndarray:
        return ((x - self.mean[modality]) / self.std[modality]).astype(np.float32)

    def invert_one(self, z: np.ndarray, modality: int) -> np.ndarray:
        return (z * self.std[modality] + self.mean[modality]).astype(np.float32)


def fit_generator(
    gen: torch.nn.Module,
    source: np.ndarray,
    target: np.ndarray,
    g_p: np.ndarray,
    sim: np.ndarray,
    *,
    preference: bool,
    beta: float,
    gamma: float,
    prefer: bool,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    reference: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Train ``gen`` for ``epochs`` epochs (Adam, fresh each call) on items (source representation
    (n, D), target modality (n,), preferred output g^p (n, D), sim(x, o_i) (n,)).

    ``preference``: L_G = L_prefer + gamma L_special
    (:func:`~fedtune.methods.bomm.completion.generator_loss`), the non-preferred output g^q being
    the generation of ``gen`` as it is on entry (what the cloud sent the parties) and the reference
    G_ref ``reference`` (frozen; default: ``gen`` on entry); else the mean squared error to g^p (the
    baselines' generator, trained on real targets only). A batch's loss is the item-weighted mean of
    its per-target-modality losses. Returns the last epoch's mean loss (and L_G's parts)."""
    n = len(source)
    if n == 0 or epochs == 0:
        return {}
    before = copy.deepcopy(gen).eval() if preference else None
    ref = (reference or before).eval() if preference else None
    dev = model_device(gen)
    src, tgt = on(np.asarray(source, np.float32), dev), on(np.asarray(target, np.int64), dev)
    gp, sm = on(np.asarray(g_p, np.float32), dev), on(np.asarray(sim, np.float32), dev)
    opt = torch.optim.Adam(gen.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    gen.train()
    for _ in range(epochs):
        totals: dict[str, float] = {}
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            idx = on(order[start : start + batch_size], dev)
            loss = torch.zeros((), device=dev)
            for t in (0, 1):
                sel = idx[tgt[idx] == t]
                if len(sel) == 0:
                    continue
                pred = gen(src[sel], t)
                if preference:
                    with torch.no_grad():
                        ref_pred, g_q = ref(src[sel], t), before(src[sel], t)
                    part, parts = generator_loss(pred, ref_pred, gp[sel], g_q, sm[sel], beta, gamma, prefer)
                else:
                    part, parts = F.mse_loss(pred, gp[sel]), {}
                share = len(sel) / len(idx)
                loss = loss + share * part
                for key, value in parts.items():
                    totals[key] = totals.get(key, 0.0) + share * value * len(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            totals["loss"] = totals.get("loss", 0.0) + loss.item() * len(idx)
    gen.eval()
    return {f"generator_{k}": v / n for k, v in totals.items()}


def train_generator(
    gen: torch.nn.Module,
    source: np.ndarray,
    target: np.ndarray,
    g_p: np.ndarray,
    sim: np.ndarray,
    options,
    *,
    preference: bool,
    seed: int,
    reference: torch.nn.Module | None = None,
) -> dict[str, float]:
    """:func:`fit_generator` with the run's generator ``options`` (``beta``, ``gamma``, ``prefer``,
    ``generator_epochs``, ``generator_lr``, ``cloud_batch_size``)."""
    o = options
    return fit_generator(
        gen,
        source,
        target,
        g_p,
        sim,
        preference=preference,
        beta=o.beta,
        gamma=o.gamma,
        prefer=o.prefer,
        epochs=o.generator_epochs,
        lr=o.generator_lr,
        batch_size=o.cloud_batch_size,
        seed=seed,
        reference=reference,
    )


@torch.no_grad()
def generate(gen: torch.nn.Module, source: np.ndarray, target: int) -> np.ndarray:
    """(n, D) generations of modality ``target`` from (n, D) representations of the other one."""
    gen.eval()
    if len(source) == 0:
        return np.zeros((0, source.shape[-1]), np.float32)
    return to_numpy(gen(on(np.asarray(source, np.float32), model_device(gen)), target))


def on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` (the network's that reads it)."""
    return torch.from_numpy(array).to(device)


def run_device(config) -> torch.device:
    """The run's ``device`` (:func:`fedtune.models.precision.resolve_device`)."""
    return precision.resolve_device(config.device)


def placed(module: torch.nn.Module, config) -> torch.nn.Module:
    """A network BoMM builds, on the run's ``device`` (:func:`fedtune.models.precision.place`)."""
    return precision.place(module, run_device(config))


def party_seed(seed: int, cid: int) -> int:
    """Initialization seed of party ``cid``'s small model (each party its own: heterogeneous SMs)."""
    return seed_for(seed, PARTY_INIT, cid)


def module_arrays(module: torch.nn.Module, prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}{k}": v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_module(module: torch.nn.Module, arrays: dict[str, np.ndarray], prefix: str) -> bool:
    """Load ``prefix``-ed arrays into ``module``; False (module untouched) when there are none."""
    own = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
    if not own:
        return False
    module.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in own.items()}, strict=True)
    return True


def party_metrics(replies: dict[int, Message]) -> dict[str, float]:
    """The parties' training metrics: mean train loss, per-party train loss, scheduler selection."""
    metas = {cid: m.meta for cid, m in replies.items()}
    out: dict[str, float] = {}
    losses = [m["train_loss"] for m in metas.values() if "train_loss" in m]
    if losses:
        out["train_loss"] = float(np.mean(losses))
    for cid, m in sorted(metas.items()):
        if "train_loss" in m:
            out[f"party{cid}_train_loss"] = float(m["train_loss"])
    completed = sum(int(m.get("completed", 0)) for m in metas.values())
    if completed:
        out["completed_samples"] = float(completed)
        out["selected_fraction"] = sum(int(m.get("selected", 0)) for m in metas.values()) / completed
    rewards = [m["reward_mean"] for m in metas.values() if "reward_mean" in m]
    if rewards:
        out["reward_mean"] = float(np.mean(rewards))
    transferred = [m["transferred_labels"] for m in metas.values() if "transferred_labels" in m]
    if transferred:
        out["party_transferred_labels"] = float(sum(transferred))
    return out
