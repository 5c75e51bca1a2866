"""The package's layering: module-level imports only point down, there is no import circle, and
every module imports cleanly on its own and in any order.

Bottom to top (a module may import, at module level, only from its own layer or below; imports
inside functions are lazy and may point up, for example the registries discovering plugins)::

    errors              FedtuneError, the one exception base
    protocol            messages, Strategy/Client ABCs, profiles, top-k codec
    config, process, certificates, checkpoint, run_folder, output_files
    data                sources, partitioners, batches (no model code)
    models              loading, LoRA workspace, training loop, networks
    tasks               Task ABC + one module per kind (data + model + loss + metrics)
    registry            method name -> Strategy, Client, options, required capabilities
    methods             one module per method, over protocol + the Task interface
    catalog             the methods' and task kinds' names and descriptions, read without them
    runtime             RunContext: one process's task, model and profiles
    engines.rounds, engines.local, engines.embedded, engines.device_pool
                        the round loop, in-process delivery, the engine, its device workers
    run, progress       one run end to end, the run folder
    trained             a finished run's model: reloaded, exported, evaluated
    privacy_audit       the empirical DP audit: many runs of two neighbouring federations
    engines.flower      the same Strategy/Client objects on Flower (codec, runconfig, worker,
                        clientapp, transport, serverapp, simulation, commands, deployment)
    launch              config.engine -> its launcher (the one entry point)
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
    [
        "fedtune.config",
        "fedtune.process",
        "fedtune.certificates",
        "fedtune.checkpoint",
        "fedtune.run_folder",
        "fedtune.output_files",
    ],
    ["fedtune.data"],
    ["fedtune.models"],
    ["fedtune.tasks"],
    ["fedtune.registry"],
    ["fedtune.methods"],
    ["fedtune.catalog"],
    ["fedtune.runtime"],
    ["fedtune.engines", "fedtune.engines.rounds", "fedtune.engines.embedded"],
    ["fedtune.run", "fedtune.progress", "fedtune.trained", "fedtune.privacy_audit"],
    ["fedtune.engines.flower"],
    ["fedtune.launch"],
    ["fedtune.cli", "fedtune.report", "fedtune.harness"],
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


def imports_of(module: str, known: set[str]) -> dict[str, bool]:
    """fedtune modules that ``module`` imports -> whether that import runs when ``module`` is
    imported (True: at module level) or only when a function runs (False: lazy). Imports under
    ``if TYPE_CHECKING`` never run and are left out."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    package = module if spec.origin.endswith("__init__.py") else module.rpartition(".")[0]
    found: dict[str, bool] = {}

    def add(name: str, eager: bool) -> None:
        found[name] = found.get(name, False) or eager

    def visit(nodes, eager: bool):
        for node in nodes:
            inner = eager and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, eager)
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("fedtune"):
                        add(a.name, eager)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if base.startswith("fedtune"):
                    for alias in node.names:
                        sub = f"{base}.{alias.name}"
                        add(sub if sub in known else base, eager)
            visit(ast.iter_child_nodes(node), inner)

    visit(tree.body, True)
    found.pop(module, None)
    return found


def module_level_imports(module: str, known: set[str]) -> set[str]:
    """fedtune modules imported when ``module`` is imported (not inside functions)."""
    return {dep for dep, eager in imports_of(module, known).items() if eager}


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


def test_function_level_imports_point_down_too_and_no_cycle_with_them_counted():
    """Lazy imports (inside functions) count: they point down except the few in ALLOWED_UPWARD,
    and the graph of all imports, lazy ones included, has no circle."""
    assert len(ALLOWED_UPWARD) <= 3
    modules = all_modules()
    known = set(modules)
    graph = {m: set(imports_of(m, known)) for m in modules}
    upward = {(m, d) for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)}
    assert upward <= set(ALLOWED_UPWARD), f"imports pointing up the layers: {sorted(upward - set(ALLOWED_UPWARD))}"
    assert set(ALLOWED_UPWARD) <= upward, f"stale ALLOWED_UPWARD entries: {sorted(set(ALLOWED_UPWARD) - upward)}"
    assert_no_cycle(graph)


def test_the_import_scan_sees_lazy_and_eager_imports(tmp_path, monkeypatch):
    """The scan itself: a lazy import inside a method is found and marked lazy; a module-level one eager."""
    pkg = tmp_path / "fedtune_scan_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text(
        "from fedtune.config import ConfigError\n"
        "class A:\n    def f(self):\n        from fedtune.run import run_experiment\n"
        "        return lambda: __import__('x')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = imports_of("fedtune_scan_probe.m", {"fedtune.config", "fedtune.run"})
    assert found == {"fedtune.config": True, "fedtune.run": False}


def test_every_module_imports_in_any_order():
    modules = all_modules()
    orders = [list(reversed(modules)), random.Random(7).sample(modules, len(modules))]
    for order in orders:
        code = f"import importlib\nfor m in {order!r}:\n    importlib.import_module(m)\n"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]


def inheritance_depth(cls: type, root: type) -> int:
    """How many classes lie between ``cls`` and the protocol ABC ``root`` on its longest path of
    ``root`` subclasses (a direct subclass of Strategy: 1; mixins that are not Strategies or Clients,
    such as ServerOptimized, do not count)."""
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
