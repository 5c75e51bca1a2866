"""LoRA through PEFT: one base model per process, one adapter per rank, named flat arrays.

Adapter state is a dict ``name -> array`` over the trainable parameters of the active adapter,
with names free of PEFT's adapter and wrapper parts, for example
``bert.encoder.layer.0.attention.self.query.lora_A.weight`` (shape (r, n)) and
``...lora_B.weight`` (shape (m, r)), plus the task's head (``classifier.weight``, ...).
PEFT computes ``W0 x + (alpha / r) B A x`` for an adapter of rank r (a convolution's A is
(r, c_in, k, k) and its B (c_out, r, 1, 1)).

The base model, its LoRA targets and its head come from the task
(:meth:`~fedtune.tasks.base.Task.build_model`, ``lora_targets``, ``head_modules``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedtune.config import ConfigError

if TYPE_CHECKING:
    from peft import PeftModel


def lora_config(task, rank: int, alpha: float | None = None):
    """PEFT's LoraConfig for ``task``'s model: ``model.target_modules`` (default: the task's),
    the task's head as ``modules_to_save``, ``model.lora_alpha`` unless ``alpha`` is given."""
    from peft import LoraConfig

    cfg = task.config.model
    targets = list(cfg.target_modules) if cfg.target_modules is not None else task.lora_targets()
    if not targets:
        raise ConfigError(
            f"model.target_modules: the {task.kind} model {cfg.name!r} has no default LoRA targets; name them"
        )
    return LoraConfig(
        task_type=task.peft_task_type,
        r=rank,
        lora_alpha=cfg.lora_alpha if alpha is None else alpha,  # type: ignore[arg-type]  # PEFT annotates int, scales by any float
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        modules_to_save=task.head_modules() or None,
    )


def rank_bound(model: torch.nn.Module, targets: list[str]) -> tuple[int, str] | None:
    """(the largest LoRA rank every adapted layer can take, the layer that bounds it): min(in, out)
    of each module whose name is a target or ends with ``.<target>``, as PEFT matches a list of
    targets (a convolution as its (c_out, c_in x kernel) matrix, as its Delta W is). None when no
    module matches (PEFT then names the missing target itself)."""
    bound = None
    for name, module in model.named_modules():
        if not any(name == t or name.endswith("." + t) for t in targets):
            continue
        module = getattr(module, "base_layer", module)  # a layer PEFT adapted already: its own
        if isinstance(module, torch.nn.Linear):
            dims = (module.in_features, module.out_features)
        elif isinstance(module, torch.nn.modules.conv._ConvNd):  # as a matrix: (c_out, c_in / groups x kernel)
            dims = (module.weight.shape[0], module.weight[0].numel())
        elif getattr(module, "weight", None) is not None and module.weight.dim() >= 2:
            dims = tuple(module.weight.shape[:2])
        else:
            continue
        if bound is None or min(dims) < bound[0]:
            bound = (min(dims), name)
    return bound


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target names a layer (a module whose name is it or ends with ``.<target>``, as PEFT
    matches a list), else one line naming it and the model's adaptable layer names."""
    names = [name for name, _ in model.named_modules()]
    for target in targets:
        if not any(name == target or name.endswith("." + target) for name in names):
            layers = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, ADAPTABLE) and n})
            shown = ", ".join(layers[:12]) + (", ..." if len(layers) > 12 else "")
            raise ConfigError(f"model.target_modules: {target!r} names no layer of the model (its layers: {shown})")


#: layers LoRA can adapt (PEFT's LoRA layer types)
ADAPTABLE = (torch.nn.Linear, torch.nn.Embedding, torch.nn.modules.conv._ConvNd)


def _short_name(name: str, adapter: str) -> str:
    return name.replace(f".{adapter}.", ".").replace("base_model.model.", "").replace(".modules_to_save", "")


class LoraWorkspace:
    """The base model shared by all clients of a process, with PEFT LoRA adapters by rank.

    ``activate(rank)`` switches to the adapter of that rank (created on first use) and returns
    its trainable parameters by short name; loading arrays into them is a copy, so a client
    sees nothing of the previous one. ``quantization``, ``dtype``: the base's, where a client's
    profile states another than ``model.quantization`` / ``model.dtype`` (the process then holds one
    workspace per base format)."""

    def __init__(self, task, seed: int, quantization: str | None = None, dtype: str | None = None) -> None:
        from fedtune.models.precision import prepare_base

        self.task = task
        self.seed = seed
        config = task.config
        own = {k: v for k, v in (("quantization", quantization), ("dtype", dtype)) if v is not None}
        if own:
            config = config.model_copy(update={"model": config.model.model_copy(update=own)})
        self.base = prepare_base(task.build_model(seed), config, task.head_modules())
        self.model: PeftModel | None = None  # once an adapter exists
        self._params: dict[str, dict[str, torch.nn.Parameter]] = {}
        self._target_names: set[str] | None = None

    def _check_rank(self, rank: int) -> None:
        """Refuse a rank larger than the smallest adapted layer allows (no adapter of 100,000 ranks
        on a 32-wide model: it would train nothing more and send hundreds of MB per round)."""
        cfg = self.task.config.model
        targets = list(cfg.target_modules) if cfg.target_modules is not None else self.task.lora_targets()
        check_targets(self.base, targets)
        bound = rank_bound(self.base, targets)
        if bound is not None and rank > bound[0]:
            raise ConfigError(
                f"model.lora_rank: {rank} exceeds what the adapted layers allow; expected at most {bound[0]} "
                f"(min(in, out) of {bound[1]})"
            )

    @property
    def peft_model(self) -> PeftModel:
        """The PEFT wrapper of the base, which :meth:`activate` makes with the first adapter."""
        if self.model is None:
            raise RuntimeError("LoRA workspace: no adapter yet (activate one first)")
        return self.model

    @staticmethod
    def adapter_name(rank: int, alpha: float | None = None) -> str:
        return f"r{rank}" if alpha is None else f"r{rank}a{alpha:g}"

    def activate(self, rank: int, alpha: float | None = None, bounded: bool = True) -> dict[str, torch.nn.Parameter]:
        """Make the rank-``rank`` adapter (scaling ``alpha / rank``) the only active, trainable one;
        ``bounded``: refuse a rank the adapted layers cannot use (see :meth:`_check_rank`)."""
        from peft import get_peft_model

        name = self.adapter_name(rank, alpha)
        if self.model is None or name not in self.model.peft_config:
            if bounded:
                self._check_rank(rank)
            with torch.random.fork_rng():  # seeded init that leaves the global RNG untouched
                torch.manual_seed(self.seed + 1)
                if self.model is None:
                    self.model = get_peft_model(self.base, lora_config(self.task, rank, alpha), adapter_name=name)
                else:
                    self.model.add_adapter(name, lora_config(self.task, rank, alpha))
        model = self.peft_model
        model.set_adapter(name)
        if name not in self._params:
            self._params[name] = {_short_name(n, name): p for n, p in model.named_parameters() if p.requires_grad}
        return self._params[name]

    def state(self, rank: int, alpha: float | None = None) -> dict[str, np.ndarray]:
        """A copy of the adapter's arrays (float32 numpy)."""
        return {k: p.detach().cpu().numpy().copy() for k, p in self.activate(rank, alpha).items()}

    def load(
        self, arrays: Mapping[str, np.ndarray], rank: int, alpha: float | None = None, bounded: bool = True
    ) -> dict[str, torch.nn.Parameter]:
        """Activate the adapter and copy ``arrays`` into it; every trainable array must be given."""
        params = self.activate(rank, alpha, bounded)
        missing = params.keys() - arrays.keys()
        if missing:
            raise KeyError(f"adapter state lacks {sorted(missing)[:3]}")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(torch.as_tensor(arrays[k]))
        return params

    def save_pretrained(
        self, out_dir: Path, arrays: Mapping[str, np.ndarray], rank: int, alpha: float | None = None
    ) -> None:
        """Write ``arrays`` as a standard PEFT adapter (``PeftModel.from_pretrained`` loads it
        onto the task's base model, ``task.build_model(seed)`` prepared as this one, see
        :func:`~fedtune.models.precision.prepare_base`). Written from the shared model (no second
        base is built): PEFT saves a named adapter into a subfolder, which becomes ``out_dir``. The
        rank is not bounded: FedStackLoRA saves its stacked adapter, of the clients' summed ranks.
        The base is recorded by the name another machine resolves (``adapter_config.json``'s
        ``base_model_name_or_path`` and the model card's ``base_model``:
        :func:`~fedtune.models.hub_ids.hub_id`), not by where this machine keeps it."""
        import shutil
        import tempfile

        from fedtune.models.hub_ids import hub_id

        name = self.adapter_name(rank, alpha)
        self.load(arrays, rank, alpha, bounded=False)
        base = hub_id(str(self.task.config.model.name))
        self.peft_model.peft_config[name].base_model_name_or_path = base
        out_dir = Path(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".adapter-") as tmp:
            self.peft_model.save_pretrained(tmp, selected_adapters=[name])
            record_base(Path(tmp) / name, base)
            if out_dir.exists():
                shutil.rmtree(out_dir)
            shutil.move(str(Path(tmp) / name), str(out_dir))


def record_base(adapter_dir: Path, base: str) -> None:
    """Name the base ``base`` in the model card PEFT wrote into ``adapter_dir`` (``base_model``:
    PEFT copies the base's ``_name_or_path``, a path on this machine)."""
    from huggingface_hub import ModelCard

    card_path = Path(adapter_dir) / "README.md"
    if not card_path.is_file():
        return
    card = ModelCard.load(card_path)
    card.data.base_model = base
    card.save(card_path)
