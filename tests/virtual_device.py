"""A CUDA device simulated on the CPU, to catch a tensor left on the host in a method's code
without a GPU (the real check is ``tests/test_gpu.py``, run where CUDA exists).

Inside :func:`virtual_cuda`, ``device = "cuda"`` resolves to ``torch.device("cuda")``, and a
:class:`~torch.overrides.TorchFunctionMode` keeps the tensors stay on the CPU while it records
which of them would be on the accelerator:

- ``.to("cuda")`` / ``.cuda()``, a factory given ``device="cuda"`` (or the ``.device`` of such a
  tensor) and the output of any operation with such an input are "on the accelerator"; their
  ``.device`` reads ``cuda:0``; ``.cpu()`` / ``.to("cpu")`` brings a host tensor back;
- an operation mixing an accelerator tensor with a host tensor of one or more dimensions (a
  0-dim host tensor is allowed, as CUDA allows it; so are copies, ``.to`` and indexing with host
  indices), ``.numpy()`` / ``np.asarray`` of an accelerator tensor, a gradient assigned across
  devices, and a factory on the accelerator drawing from a CPU ``torch.Generator`` are what CUDA
  refuses: each is recorded (:attr:`VirtualCuda.errors`, with the innermost ``fedtune`` frame)
  and raised as CUDA would raise it;
- a model's compute (:data:`COMPUTE`: matrix products, convolutions, embeddings) on host tensors
  only, outside ``fedtune/data`` (which prepares host batches) and a task's ``build_model`` (which
  may probe a model before it is placed), is counted (:attr:`VirtualCuda.compute`,
  :attr:`VirtualCuda.host_compute`): CUDA allows it, but a method that honours ``device`` runs its
  networks there.

Operations implemented in C++ beneath one Python call (autograd's accumulation, a kernel's
internals) are not seen; their results are tagged through the Python calls that read them
(``.grad``, ``torch.autograd.grad``). It is a model of CUDA's device rules, not CUDA: numbers,
kernels and autocast are the CPU's.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

CUDA = torch.device("cuda", 0)
HOST = torch.device("cpu")
#: the calls that hold a model's compute (matrix products, convolutions, embeddings, attention)
COMPUTE = {
    "linear", "bilinear", "conv1d", "conv2d", "conv3d", "embedding", "matmul", "__matmul__", "mm", "bmm",
    "addmm", "baddbmm", "einsum", "scaled_dot_product_attention",
}  # fmt: skip
#: calls that read only the shape of their tensor argument
SHAPE_OF = {"expand_as", "view_as", "reshape_as"}
#: calls CUDA allows across devices (copies, moves, indexing a device tensor with host indices)
CROSS_DEVICE = {"copy_", "to", "cpu", "cuda", "__getitem__", "__setitem__", "_has_compatible_shallow_copy_type"}
_CUDA_NAME = re.compile(r"cuda(:\d+)?")


def _name(func) -> str:
    name = getattr(func, "__name__", str(func))
    if name in ("__get__", "__set__"):
        return f"{name}:{getattr(getattr(func, '__self__', None), '__name__', '?')}"
    return name


def _building() -> bool:
    """Inside a task's ``build_model`` (a model probed on the host before it is placed)."""
    return any(f.name == "build_model" and "/fedtune/" in f.filename for f in traceback.extract_stack())


def _is_cuda(value) -> bool:
    return (isinstance(value, torch.device) and value.type == "cuda") or (
        isinstance(value, str) and bool(_CUDA_NAME.fullmatch(value))
    )


def _is_cpu(value) -> bool:
    return (isinstance(value, torch.device) and value.type == "cpu") or (isinstance(value, str) and value == "cpu")


#: tensor -> True: "on the accelerator", for every mode (a model cached by the process stays there)
ON_DEVICE = WeakIdKeyDictionary()


class VirtualCuda(TorchFunctionMode):
    """The mode (see the module docstring); ``errors``: one line per refused call."""

    def __init__(self) -> None:
        super().__init__()
        self.on = ON_DEVICE
        self.errors: list[str] = []
        self.compute = {"cuda": 0, "cpu": 0}  # calls of COMPUTE on each side
        self.host_compute: list[str] = []  # where compute ran on the host (first few)

    def tagged(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.on

    def tag(self, value) -> None:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self.on[leaf] = True

    @staticmethod
    def _where() -> str:
        frames = [f for f in traceback.extract_stack() if "/fedtune/" in f.filename]
        return f" at {frames[-1].filename.split('/fedtune/')[-1]}:{frames[-1].lineno}" if frames else ""

    def refuse(self, message: str) -> None:
        where = self._where()
        self.errors.append(message + where)
        raise RuntimeError(f"virtual cuda: {message}{where}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if func is torch.device or name == "_parse_to":  # device names, not tensors
            return func(*args, **kwargs)
        if name == "__get__:device" and self.tagged(args[0]):
            return CUDA
        if name == "__get__:is_cuda":
            return self.tagged(args[0])
        leaves = pytree.tree_leaves((args, kwargs))
        to_cuda = any(_is_cuda(v) for v in leaves)
        to_cpu = any(_is_cpu(v) for v in leaves)
        args, kwargs = pytree.tree_map(lambda v: HOST if _is_cuda(v) else v, (args, kwargs))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        if name in SHAPE_OF:  # reads only the other tensor's shape: the output is where self is
            tensors = tensors[:1]
        on = [t for t in tensors if self.tagged(t)]
        host = [t for t in tensors if not self.tagged(t) and t.dim() > 0]
        if name in COMPUTE and tensors:
            side, where = ("cuda" if on else "cpu"), self._where()
            if not where.startswith(" at data/") and not _building():  # host batches, model construction
                self.compute[side] += 1
                if side == "cpu" and len(self.host_compute) < 5:
                    self.host_compute.append(name + where)
        if on and host and name not in CROSS_DEVICE:
            if name == "__set__:grad":
                self.refuse("assigned grad is on a different device than its parameter")
            elif name != "__set__:data":
                self.refuse(f"{name}: expected all tensors to be on the same device (cuda:0 and cpu)")
        if on and name in ("numpy", "__array__"):
            self.refuse(f"{name}: can't convert a cuda tensor to numpy; use .cpu() first")
        generator = kwargs.get("generator")
        if to_cuda and not tensors and isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            self.refuse(f"{name}: a CPU generator for a factory on cuda")
        out = func(*args, **kwargs)
        if name == "__set__:data":
            if self.tagged(args[1]):
                self.on[args[0]] = True
            else:
                self.on.pop(args[0], None)
            return out
        if name == "cuda" or to_cuda:
            if name in ("to", "cuda") and any(out is t for t in tensors) and not isinstance(out, torch.nn.Parameter):
                out = out.view_as(out)  # a host tensor someone else holds stays on the host
            self.tag(out)
        elif name == "cpu" or to_cpu or (name == "to" and any(isinstance(v, torch.Tensor) for v in leaves[1:])):
            target_on = name == "to" and any(self.tagged(v) for v in leaves[1:] if isinstance(v, torch.Tensor))
            if target_on:
                self.tag(out)
            elif self.tagged(out):
                out = out.view_as(out)  # a fresh host alias
        elif on:
            self.tag(out)
        return out


@contextmanager
def virtual_cuda(monkeypatch) -> Iterator[VirtualCuda]:
    """``device = "cuda"`` resolves to CUDA and the :class:`VirtualCuda` mode records what
    CUDA would refuse; new ``nn.Parameter``s of accelerator tensors stay on it."""
    from fedtune.models import precision

    real = precision.resolve_device
    monkeypatch.setattr(precision, "resolve_device", lambda name: CUDA if _is_cuda(name) else real(name))
    mode = VirtualCuda()
    new = torch.nn.Parameter.__new__

    def parameter(cls, data=None, requires_grad=True):
        param = new(cls, data, requires_grad)
        if data is not None and mode.tagged(data):
            mode.on[param] = True
        return param

    monkeypatch.setattr(torch.nn.Parameter, "__new__", parameter)
    with mode:
        yield mode
