"""``fedtune new method NAME`` / ``fedtune new task NAME``: a small package of the user's own, outside
fedtune, that registers a method (a Strategy, Client and Options skeleton: FedAvg of LoRA adapters
to edit) or a task kind (a Task subclass to edit), with a recipe and a test that runs fedtune's
contract checks (:mod:`fedtune.testing`) on the embedded engine and on ``flower-sim``.

The package declares its entry point (``fedtune.methods`` / ``fedtune.tasks``), so ``pip install -e
PACKAGE`` makes ``method = "NAME"`` work; without installing it, the recipe's ``"PACKAGE.module:NAME"``
works wherever the package is importable (``PYTHONPATH``).
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

import typer

from fedtune.cli.common import console, fail

new_app = typer.Typer(no_args_is_help=True, help="Write a package of your own: a method or a task kind.")
NAME = re.compile(r"[a-z][a-z0-9-]{0,40}")

METHOD = '''"""{name}: FedAvg of LoRA adapters, a skeleton to make your own method of.

Round t: the server sends the global adapter; each client trains it for H local steps and uploads
its update Delta_i; the server adds sum_i p_i Delta_i (p_i by data size, or 1/N). Edit
:class:`Client.fit` (what a client trains and sends) and :meth:`Strategy.aggregate_fit` (the
server's rule, from BroadcastAverage); declare new options on :class:`Options`.
"""

from __future__ import annotations

from pydantic import Field

from fedtune.methods.base.averaging import BroadcastAverage, Weighting
from fedtune.methods.base.lora import LORA, GlobalAdapterStrategy, LoraClient
from fedtune.protocol.messages import Message
from fedtune.registry import MethodOptions, register


class Options(MethodOptions):
    """``[options]`` of a recipe: this method's own settings, checked before the run starts."""

    weighting: Weighting = Field("examples", description="p_i: data size (FedAvg) or 1/N (uniform)")


class Strategy(BroadcastAverage, GlobalAdapterStrategy):
    """{name}: FedAvg of LoRA adapters (the server side)."""

    def initialize(self) -> None:
        self.rank = self.config.model.lora_rank
        self.global_arrays = self.context.workspace.state(self.rank)

    def fit_meta(self, rnd: int) -> dict:
        return {{"round": rnd, "rank": self.rank}}


class Client(LoraClient):
    """The client side: train the received adapter, upload the update."""

    def fit(self, message: Message) -> Message:
        received = message.arrays
        trained, result = self.train_adapter(received, message.meta["round"], message.meta["rank"])
        update = {{k: trained[k] - received[k] for k in trained}}
        return self.upload(update, result, rnd=message.meta["round"])


register("{name}", Strategy, Client, Options, requires=LORA)
'''

TASK = '''"""{name}: a task kind of your own (here text classification with its defaults, to edit).

A task is data + model + loss + metrics: override ``load`` (train pool and test set),
``build_model``, ``batches``, ``loss`` and ``evaluate`` of :class:`fedtune.tasks.base.Task` as
your data needs; ``test_overrides`` is the tiny configuration the contract checks run.
"""

from __future__ import annotations

from fedtune.tasks.base import register_task
from fedtune.tasks.text_classification import TextClassification


@register_task
class Task(TextClassification):
    kind = "{name}"
    description = "{name}: text -> label (edit me)"
'''

PYPROJECT = """[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "A fedtune {what}: {name}"
dependencies = ["fedtune"]

[project.entry-points."fedtune.{group}"]
{name} = "{package}.{module}"

[tool.setuptools]
packages = ["{package}"]
"""

RECIPE = """# fedtune run recipe.toml   (the package importable: pip install -e . , or PYTHONPATH=.)
{key} = "{package}.{module}:{name}"
{other}
rounds = 3

[data]
max_train_samples = 400
max_test_samples = 200
"""

TEST = '''"""fedtune's contract checks on {name}, as fedtune runs them on its own {what}s."""

import pytest

from fedtune.testing import {check}


@pytest.mark.parametrize("engine", ["embedded", "flower-sim"])
def test_{package}_meets_fedtune_contract(tmp_path, engine):
    {check}("{package}.{module}:{name}", tmp_path, engine=engine)
'''

README = """# {dist}

A fedtune {what} of your own: `{name}` ({package}/{module}.py).

```bash
pip install -e .                 # declares the entry point: {key} = "{name}" works anywhere
fedtune {listing} -v             # lists it with its source
fedtune run recipe.toml          # or, without installing: PYTHONPATH=. fedtune run recipe.toml
pytest tests                     # fedtune's contract checks, embedded and flower-sim
```
"""


def _scaffold(kind: str, name: str, folder: Path) -> Path:
    """Write the package of ``kind`` (``method`` or ``task``) ``name`` into ``folder``/<package>."""
    if not NAME.fullmatch(name):
        fail(f"NAME {name!r}: expected lowercase letters, digits and - (a letter first, at most 41)")
    package = name.replace("-", "_")
    if keyword.iskeyword(package):
        fail(f"NAME {name!r}: {package!r} is a Python keyword")
    root = folder / package
    if root.exists():
        fail(f"{str(root)!r} exists; choose another NAME or --dir (nothing was written)")
    method = kind == "method"
    module = "method" if method else "task"
    values = {
        "name": name,
        "package": package,
        "module": module,
        "dist": f"fedtune-{name}",
        "what": kind,
        "group": "methods" if method else "tasks",
        "check": "check_method" if method else "check_task",
        "key": "method" if method else "task",
        "other": "" if method else 'method = "fedit"',
        "listing": "methods" if method else "tasks",
    }
    files = {
        f"{package}/__init__.py": f'"""fedtune {kind} {name}: see {module}.py."""\n',
        f"{package}/{module}.py": (METHOD if method else TASK).format(**values),
        "pyproject.toml": PYPROJECT.format(**values),
        "recipe.toml": RECIPE.format(**values),
        f"tests/test_{package}.py": TEST.format(**values),
        "conftest.py": '"""pytest puts this folder on sys.path: the package imports uninstalled too."""\n',
        "README.md": README.format(**values),
    }
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@new_app.command("method")
def new_method(
    name: str = typer.Argument(..., help="the method's name (lowercase, digits, -)"),
    folder: Path = typer.Option(Path("."), "--dir", help="where the package's folder goes"),
) -> None:
    """A package registering method NAME: Strategy, Client and Options (FedAvg of LoRA to edit), a
    recipe and a test running fedtune's contract checks on embedded and flower-sim."""
    root = _scaffold("method", name, folder)
    console.print(f"wrote {root} (its README says how to run and test it)", markup=False, highlight=False)


@new_app.command("task")
def new_task(
    name: str = typer.Argument(..., help="the task kind (lowercase, digits, -)"),
    folder: Path = typer.Option(Path("."), "--dir", help="where the package's folder goes"),
) -> None:
    """A package registering task kind NAME (a Task subclass to edit), a recipe and a test running
    fedtune's contract checks on embedded and flower-sim."""
    root = _scaffold("task", name, folder)
    console.print(f"wrote {root} (its README says how to run and test it)", markup=False, highlight=False)
