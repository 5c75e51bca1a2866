"""The package's layering: module-level imports only point down, there is no import circle, and
every module imports cleanly on its own and in any order.

Bottom to top (a module may import, at module level, only from its own layer or below; imports
inside functions are lazy and may point up, for example the registries discovering plugins)::

    errors              FedtuneError, the one exception base
    protocol            messages, Strategy/Client ABCs, profiles, top-k codec
    config, process, checkpoint
    data                sources, partitioners, batches (no model code)
    models              loading, LoRA workspace, training loop, networks
    tasks               Task ABC + one module per kind (data + model + loss + metrics)
    registry            method name -> Strategy, Client, options, required capabilities
    methods             one module per method, over protocol + the Task interface
    runtime             RunContext: one process's task, model and profiles
    engines.rounds, engines.embedded   the round loop and in-process delivery
    run, progress       one run end to end, the run folder
    engines.flower      the same Strategy/Client objects on Flower
    cli, report, harness
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import random
import subprocess
import sys
from pathlib import Path

import fedtune

LAYERS = [
    ["fedtune.errors"],
    ["fedtune.protocol"],
    ["fedtune.config", "fedtune.process", "fedtune.checkpoint"],
    ["fedtune.data"],
    ["fedtune.models"],
    ["fedtune.tasks"],
    ["fedtune.registry"],
    ["fedtune.methods"],
    ["fedtune.runtime"],
    ["fedtune.engines.rounds", "fedtune.engines.embedded", "fedtune.engines"],
    ["fedtune.run", "fedtune.progress"],
    ["fedtune.engines.flower"],
    ["fedtune.cli", "fedtune.report", "fedtune.harness"],
]


def all_modules() -> list[str]:
    names = ["fedtune"]
    for info in pkgutil.walk_packages(fedtune.__path__, "fedtune."):
        names.append(info.name)
    return sorted(names)


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to the docstring)"
    return best


def module_level_imports(module: str, known: set[str]) -> set[str]:
    """fedtune modules imported when ``module`` is imported (not inside functions, not under
    ``if TYPE_CHECKING``)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    package = module if spec.origin.endswith("__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("fedtune"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                if base.startswith("fedtune"):
                    for alias in node.names:
                        sub = f"{base}.{alias.name}"
                        found.add(sub if sub in known else base)
            for field in ("body", "orelse", "finalbody", "handlers"):
                child = getattr(node, field, None)
                if isinstance(child, list):
                    visit(child)

    visit(tree.body)
    found.discard(module)
    return found


def test_module_level_imports_point_down_and_have_no_cycle():
    modules = all_modules()
    known = set(modules)
    graph = {m: module_level_imports(m, known) for m in modules}
    upward = [(m, d) for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)]
    assert not upward, f"module-level imports pointing up the layers: {upward}"
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            assert state.get(dep) != 1, f"import circle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in modules:
        if module not in state:
            visit(module, [module])


def test_every_module_imports_in_any_order():
    modules = all_modules()
    orders = [list(reversed(modules)), random.Random(7).sample(modules, len(modules))]
    for order in orders:
        code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\n" % order
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
