"""The package's layering: module-level imports only point down, there is no import circle (lazy
imports and imports under ``if TYPE_CHECKING`` counted), every module imports cleanly on its own
and in any order, and no new class is assembled from mixins.

Bottom to top (a module may import, at module level, only from its own layer or below; imports
inside functions are lazy and may point up, for example the registries discovering plugins)::

    errors              FedtuneError, the one exception base
    protocol            messages, Strategy/Client ABCs, profiles, top-k codec
    config, process, certificates, checkpoint, run_folder, output_files, steps, plugins
    data                sources, partitioners, batches (no model code)
    models              loading, LoRA workspace, training loop, networks
    tasks               Task ABC + one module per kind (data + model + loss + metrics)
    registry            method name -> Strategy, Client, options, required capabilities
    methods             one module per method, over protocol + the Task interface
    catalog, config_reference
                        the methods' and task kinds' names and descriptions, read without them;
                        the config reference generated from the config classes (the docs)
    planning            client budgets: the memory and time model, the planner, the peak meter
    runtime             RunContext: one process's task, model and profiles
    engines.rounds, engines.delivery, engines.policy, engines.record, engines.local,
    engines.embedded, engines.device_pool
                        the round loop (its transport protocol, reply checks and round record),
                        in-process delivery, the engine, its device workers
    run, progress, privacy_audit, tracking, fingerprint
                        one run end to end, the run folder; the empirical DP audit; experiment trackers; a DP
                        run's input fingerprints (resume)
    trained             a finished run's model: reloaded, exported, evaluated
    engines.flower      the same Strategy/Client objects on Flower (codec, runconfig, worker,
                        clientapp, transport, serverapp, simulation, commands, deployment)
    launch              config.engine -> its launcher (the one entry point)
    cli, report, harness, testing
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import random
import subprocess
import sys
from pathlib import Path

import fedtune

LAYERS = [
    ["fedtune.errors"],
    ["fedtune.protocol"],
    [
        "fedtune.config",
        "fedtune.process",
        "fedtune.certificates",
        "fedtune.checkpoint",
        "fedtune.run_folder",
        "fedtune.output_files",
        "fedtune.steps",
        "fedtune.plugins",
    ],
    ["fedtune.data"],
    ["fedtune.models"],
    ["fedtune.tasks"],
    ["fedtune.registry"],
    ["fedtune.methods"],
    ["fedtune.catalog", "fedtune.config_reference"],
    ["fedtune.planning"],
    ["fedtune.runtime"],
    ["fedtune.engines", "fedtune.engines.rounds", "fedtune.engines.embedded"],
    [
        "fedtune.run",
        "fedtune.progress",
        "fedtune.trained",
        "fedtune.privacy_audit",
        "fedtune.tracking",
        "fedtune.fingerprint",
    ],
    ["fedtune.engines.flower"],
    ["fedtune.launch"],
    ["fedtune.cli", "fedtune.report", "fedtune.harness", "fedtune.testing"],
]


def all_modules() -> list[str]:
    names = ["fedtune"]
    for info in pkgutil.walk_packages(fedtune.__path__, "fedtune."):
        names.append(info.name)
    return sorted(names)


def layer_of(module: str) -> int:
    if module == "fedtune":  # the root package: only __version__, imports nothing
        return 0
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to the docstring)"
    return best


EAGER, LAZY, TYPING = 3, 2, 1  # how an import runs, strongest first: at module level, in a function, never


def imports_of(module: str, known: set[str]) -> dict[str, int]:
    """fedtune modules that ``module`` imports -> how the strongest of those imports runs: EAGER
    (at module level, when ``module`` is imported), LAZY (only when a function runs) or TYPING
    (under ``if TYPE_CHECKING``: never, but a circle through it is a circle of the code all the same)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    package = module if spec.origin.endswith("__init__.py") else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, how: int) -> None:
        found[name] = max(found.get(name, 0), how)

    def visit(nodes, how: int):
        for node in nodes:
            inner = min(how, LAZY) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else how
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.body, TYPING)
                visit(node.orelse, how)
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("fedtune"):
                        add(a.name, how)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if base.startswith("fedtune"):
                    for alias in node.names:
                        sub = f"{base}.{alias.name}"
                        add(sub if sub in known else base, how)
            visit(ast.iter_child_nodes(node), inner)

    visit(tree.body, EAGER)
    found.pop(module, None)
    return found


def module_level_imports(module: str, known: set[str]) -> set[str]:
    """fedtune modules imported when ``module`` is imported (not inside functions)."""
    return {dep for dep, how in imports_of(module, known).items() if how == EAGER}


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            assert state.get(dep) != 1, f"import circle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_every_module_is_in_a_layer_and_every_layer_entry_names_modules():
    modules = all_modules()
    for module in modules:
        layer_of(module)  # asserts it is in one
    for prefixes in LAYERS:
        for prefix in prefixes:
            assert any(m == prefix or m.startswith(prefix + ".") for m in modules), f"LAYERS names no module: {prefix}"


def test_module_level_imports_point_down_and_have_no_cycle():
    modules = all_modules()
    known = set(modules)
    graph = {m: module_level_imports(m, known) for m in modules}
    upward = [(m, d) for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)]
    assert not upward, f"module-level imports pointing up the layers: {upward}"
    assert_no_cycle(graph)


#: The upward imports allowed inside functions (at most three), each with its reason.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def test_function_level_and_type_checking_imports_point_down_too_and_no_cycle_with_them_counted():
    """Lazy imports (inside functions) and imports under ``if TYPE_CHECKING`` count: they point
    down except the few in ALLOWED_UPWARD, and the graph of all imports, those included, has no
    circle (a type-only import back up a circle is still a circle of the code)."""
    assert len(ALLOWED_UPWARD) <= 3
    modules = all_modules()
    known = set(modules)
    graph = {m: set(imports_of(m, known)) for m in modules}
    upward = {(m, d) for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)}
    assert upward <= set(ALLOWED_UPWARD), f"imports pointing up the layers: {sorted(upward - set(ALLOWED_UPWARD))}"
    assert set(ALLOWED_UPWARD) <= upward, f"stale ALLOWED_UPWARD entries: {sorted(set(ALLOWED_UPWARD) - upward)}"
    assert_no_cycle(graph)


def test_the_import_scan_sees_lazy_eager_and_type_checking_imports(tmp_path, monkeypatch):
    """The scan itself: a lazy import inside a method is found and marked lazy; a module-level one
    eager; one under ``if TYPE_CHECKING`` typing (its ``else`` runs: eager)."""
    pkg = tmp_path / "fedtune_scan_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(
        "from fedtune.config import ConfigError\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fedtune.launch import launch\nelse:\n    import fedtune.errors\n"
        "class A:\n    def f(self):\n        from fedtune.run import run_experiment\n"
        "        return lambda: __import__('x')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = imports_of("fedtune_scan_probe.m", {"fedtune.config", "fedtune.run", "fedtune.launch", "fedtune.errors"})
    assert found == {"fedtune.config": EAGER, "fedtune.run": LAZY, "fedtune.launch": TYPING, "fedtune.errors": EAGER}


def test_every_module_imports_in_any_order():
    modules = all_modules()
    orders = [list(reversed(modules)), random.Random(7).sample(modules, len(modules))]
    for order in orders:
        code = f"import importlib\nfor m in {order!r}:\n    importlib.import_module(m)\n"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]


def inheritance_depth(cls: type, root: type) -> int:
    """How many classes lie between ``cls`` and the protocol ABC ``root`` on its longest path of
    ``root`` subclasses (a direct subclass of Strategy: 1; bases that are not Strategies or Clients
    do not count)."""
    if cls is root:
        return 0
    return 1 + max(inheritance_depth(b, root) for b in cls.__bases__ if isinstance(b, type) and issubclass(b, root))


def test_every_methods_strategy_and_client_are_at_most_three_deep():
    from fedtune.methods import list_methods
    from fedtune.protocol.client import Client
    from fedtune.protocol.strategy import Strategy

    deep = [
        (spec.name, cls.__name__, inheritance_depth(cls, root))
        for spec in list_methods()
        for cls, root in ((spec.strategy, Strategy), (spec.client, Client))
        if inheritance_depth(cls, root) > 3
    ]
    assert not deep, f"classes more than three deep below Strategy / Client: {deep}"


#: The fedtune classes assembled from mixins, each with its reason: none since the server's
#: aggregation is composed (fedtune.methods.base.aggregation, issue 40), and at most four. A
#: mixin is a concrete base (no abstract method left) beside another fedtune base: its methods call
#: ``self`` for what the other bases provide and they call it back, a circle of objects that no
#: import shows. Bases that are interfaces (abstract, such as Strategy or GlobalAdapterStrategy)
#: combine without one; pydantic models (options) merge fields, not behaviour, and are left out.
ALLOWED_MIXINS: dict[str, str] = {}


def mixin_bases(cls: type) -> list[type]:
    """The mixins among ``cls``'s direct bases: its concrete fedtune bases, where it has two or more
    fedtune bases (none for a pydantic model)."""
    from pydantic import BaseModel

    ours = [b for b in cls.__bases__ if b.__module__.split(".")[0] == "fedtune"]
    if len(ours) < 2 or issubclass(cls, BaseModel):
        return []
    return [b for b in ours if not inspect.isabstract(b)]


def classes_with_mixins(modules: list[str]) -> set[str]:
    found = set()
    for module in modules:
        for cls in vars(importlib.import_module(module)).values():
            if inspect.isclass(cls) and cls.__module__ == module and mixin_bases(cls):
                found.add(f"{module}.{cls.__qualname__}")
    return found


def test_no_new_class_is_assembled_from_mixins():
    assert len(ALLOWED_MIXINS) <= 4
    found = classes_with_mixins(all_modules())
    assert found <= set(ALLOWED_MIXINS), (
        f"classes with mixin bases (compose parts instead): {sorted(found - set(ALLOWED_MIXINS))}"
    )
    assert set(ALLOWED_MIXINS) <= found, f"stale ALLOWED_MIXINS entries: {sorted(set(ALLOWED_MIXINS) - found)}"


def test_the_mixin_rule_counts_concrete_bases_beside_another_and_not_interfaces():
    from abc import ABC, abstractmethod

    class Interface(ABC):
        @abstractmethod
        def f(self): ...

    class Other(ABC):
        @abstractmethod
        def g(self): ...

    class Mixin:
        def h(self):
            return self.f()

    for c in (Interface, Other, Mixin):
        c.__module__ = "fedtune.probe"
    assert mixin_bases(type("Both", (Interface, Other), {})) == []
    assert mixin_bases(type("Single", (Mixin,), {})) == []
    assert mixin_bases(type("Mixed", (Mixin, Interface), {})) == [Mixin]
    assert mixin_bases(type("Foreign", (Mixin, ABC), {})) == []  # ABC is not fedtune's
