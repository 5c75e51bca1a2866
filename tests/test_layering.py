"""The package's layering: module-level imports only point down, there is no import circle (lazy
imports and imports under ``if TYPE_CHECKING`` counted), every module imports cleanly on its own
and in any order, and no new class is assembled from mixins. The round loop asks the strategy's
round rules and knows no mechanism (no privacy or secure-aggregation branch), SecAgg+'s stages pass
their state, and FedIT, FSLoRA and HeteroLoRA fill in one averaging skeleton.

Bottom to top (a module may import, at module level, only from its own layer or below; imports
inside functions are lazy and may point up, for example the registries discovering plugins)::

    errors              FedtuneError, the one exception base
    protocol            messages, profiles, reply validation, top-k codec
    config, process, certificates, checkpoint, run_folder, output_files, steps, plugins
    data                sources, partitioners, batches (no model code)
    models              loading, LoRA workspace, training loop, networks
    tasks               Task ABC + one module per kind (data + model + loss + metrics)
    protocol.context, protocol.strategy, protocol.client
                        the Strategy/Client ABCs and the typed context they are built on (its
                        config, task and LoRA workspace)
    registry, planning.spec
                        method name -> Strategy, Client, options, required capabilities, its plan
                        (the knob client budgets set and the method's cost model)
    methods.base        what several methods share
    planning.memory, speed, quantization, knob, workload, measured, lora_plan
                        the generic pricing a method's plan is built from: the memory and time
                        models, the LoRA methods' rank knob
    methods             one module per method family, over protocol + the Task interface, each
                        registering its plan next to its code
    catalog, config_reference
                        the methods' and task kinds' names and descriptions, read without them;
                        the config reference generated from the config classes (the docs)
    planning            client budgets: the planner (the search over any method's knob), node
                        reports, the peak meter; names no method
    runtime             RunContext: one process's task, model and profiles
    engines.rounds, engines.delivery, engines.policy, engines.record, engines.local,
    engines.embedded, engines.device_pool
                        the round loop (its transport protocol, reply checks and round record),
                        in-process delivery, the engine, its device workers
    run, resume, progress, privacy_audit, tracking, fingerprint
                        one run end to end, the run folder; a resume's checks; the empirical DP audit;
                        experiment trackers; a DP run's input fingerprints (resume)
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
import random
import re
import subprocess
import sys
from pathlib import Path

import fedtune

PACKAGE = Path(fedtune.__file__).parent
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
    ["fedtune.protocol.context", "fedtune.protocol.strategy", "fedtune.protocol.client"],
    ["fedtune.registry", "fedtune.planning.spec"],
    ["fedtune.methods.base"],
    [
        "fedtune.planning.memory",
        "fedtune.planning.speed",
        "fedtune.planning.quantization",
        "fedtune.planning.knob",
        "fedtune.planning.workload",
        "fedtune.planning.measured",
        "fedtune.planning.lora_plan",
    ],
    ["fedtune.methods"],
    ["fedtune.catalog", "fedtune.config_reference"],
    ["fedtune.planning"],
    ["fedtune.runtime"],
    ["fedtune.engines", "fedtune.engines.rounds", "fedtune.engines.embedded"],
    [
        "fedtune.run",
        "fedtune.resume",
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
    """fedtune's modules: the packages' and those of a folder without ``__init__.py`` (``methods/base``)."""
    root = Path(fedtune.__file__).parent
    names = ["fedtune"]
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(set(names))


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


# -- function lengths (issue 53: the run driver reads as its steps; few long functions) ----------
#: the run driver's budget, from ``def`` to its last line, docstring included
RUN_DRIVER_MAX = 40
#: every function in fedtune/ over 80 lines (issue 53's aim: at most 3) -> its length when listed; none
#: may grow, and no other may pass 80 (an entry whose function shrank under 81 may go)
LONG_FUNCTIONS = {
    "fedtune/cli/__init__.py:eval_": 86,
    "fedtune/trained/evaluate.py:evaluate": 85,
}


def function_lengths(source: str, prefix: str = "") -> dict[str, int]:
    """Every function and method of ``source``, by qualified name (``Class.method``, ``f.inner``)
    after ``prefix``, -> its lines from ``def`` (decorators left out) to its last line."""
    found: dict[str, int] = {}

    def visit(nodes, scope: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}{node.name}"
                if not isinstance(node, ast.ClassDef):
                    found[f"{prefix}{name}"] = node.end_lineno - node.lineno + 1
                visit(node.body, f"{name}.")
            else:
                visit(ast.iter_child_nodes(node), scope)

    visit(ast.parse(source).body, "")
    return found


def package_function_lengths() -> dict[str, int]:
    root = Path(fedtune.__file__).parent
    return {
        name: n
        for path in sorted(root.rglob("*.py"))
        for name, n in function_lengths(path.read_text(), f"fedtune/{path.relative_to(root)}:").items()
    }


def test_run_experiment_reads_as_the_runs_steps():
    """``run_experiment`` is the run's steps (the run folder object does the writing): at most
    :data:`RUN_DRIVER_MAX` lines, docstring included."""
    lengths = function_lengths((Path(fedtune.__file__).parent / "run.py").read_text())
    assert lengths["run_experiment"] <= RUN_DRIVER_MAX, f"run_experiment is {lengths['run_experiment']} lines"


def test_no_function_passes_80_lines_but_the_listed_ones_and_none_of_them_grows():
    long = {name: n for name, n in package_function_lengths().items() if n > 80}
    assert set(long) <= set(LONG_FUNCTIONS), (
        f"new functions over 80 lines (split them): {set(long) - set(LONG_FUNCTIONS)}"
    )
    grown = {name: (LONG_FUNCTIONS[name], n) for name, n in long.items() if n > LONG_FUNCTIONS[name]}
    assert grown == {}, f"listed long functions grew (listed, now): {grown}"
    assert len(LONG_FUNCTIONS) <= 2  # issue 53: at most 3


def test_function_lengths_sees_methods_nested_functions_and_the_whole_span():
    body = "\n".join(f"    x{i} = {i}" for i in range(RUN_DRIVER_MAX))  # def + 40 lines: one over the budget
    nested = "class A:\n    @staticmethod\n    def m():\n        def inner():\n            pass\n\n\n"
    source = f"{nested}def run_experiment():\n{body}\n"
    assert function_lengths(source, "f.py:") == {"f.py:A.m": 3, "f.py:A.m.inner": 2, "f.py:run_experiment": 41}
    assert function_lengths(source)["run_experiment"] > RUN_DRIVER_MAX


#: registered method names that are also English words: in prose ("local steps") they name no method
ENGLISH = {"local", "static"}


def method_names_in(folder: Path) -> list[str]:
    """Each registered method's name that a module under ``folder`` spells, as ``grep -wi`` finds
    it (``file:line: name``): anywhere in the text, docstrings and comments included, and for the
    names that are also English words (:data:`ENGLISH`) in the code only: a word of a string
    literal or an f-string's text (not a docstring), or a whole identifier."""
    from fedtune.methods import list_methods

    names = {m.name for m in list_methods()}
    hits = []
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        for lineno, line in enumerate(text.splitlines(), 1):
            words = {w.lower() for w in re.findall(r"[\w-]+", line)} | {w.lower() for w in re.findall(r"\w+", line)}
            hits += [f"{path.name}:{lineno}: {w}" for w in sorted(words & (names - ENGLISH))]
        tree = ast.parse(text)
        prose = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                words = set(re.findall(r"[\w-]+", node.value))
            elif isinstance(node, (ast.Name, ast.Attribute, ast.alias, ast.arg, ast.FunctionDef, ast.ClassDef)):
                spelled = [getattr(node, k, None) for k in ("id", "attr", "name", "arg", "asname")]
                words = {str(w).lower() for w in spelled if w}
            else:
                continue
            hits += [f"{path.name}:{node.lineno}: {w}" for w in sorted(words & ENGLISH)]
    return hits


def test_planning_names_no_method():
    """Each method carries its own plan (registered with it, issue 53 item 2): fedtune/planning/ is
    the generic machinery and spells no registered method's name (the control: main's planner,
    with its KNOBS table and CoMMIT / FedOT branches, is caught)."""
    assert method_names_in(Path(fedtune.__file__).parent / "planning") == []


def test_the_method_name_check_catches_a_name_put_back(tmp_path):
    """The control of :func:`test_planning_names_no_method`: a method's name put back into a copy of
    the planner, as a literal, in an f-string, as a name or in prose, is found; "local" as a word of
    prose and a longer word holding a name are not; "local" as a literal or a name is."""
    planner = (Path(fedtune.__file__).parent / "planning" / "planner.py").read_text()
    (tmp_path / "planner.py").write_text(planner)
    assert method_names_in(tmp_path) == []
    put_back = '\nKNOBS = {"heterolora": "rank", "local": None}\nWHY = f"{1} needs FedPFT"\n\n\ndef f(commit):\n'
    body = '    """FSLoRA\'s knob over local steps."""\n    return commit.local_steps + fedotherwise  # FedIT\n'
    (tmp_path / "planner.py").write_text(planner + put_back + body)
    found = sorted(hit.rsplit(": ", 1)[1] for hit in method_names_in(tmp_path))
    assert found == ["commit", "commit", "fedit", "fedpft", "fslora", "heterolora", "local"]


# -- the round loop asks, it does not know (issue 53) ----------------------------------------------
#: Words naming a mechanism the round loop must not branch on: it asks the strategy's round rules.
MECHANISM_WORDS = ("private", "privacy", "secure", "unmask", "secagg")
LOOP_LINES = 60


def function_node(source: str, name: str) -> ast.FunctionDef:
    """The top-level function ``name`` of ``source``."""
    found = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"no function {name}"
    return found[0]


def mechanism_branches(function: ast.FunctionDef) -> list[str]:
    """The branches of ``function`` (if, conditional expression, while, boolean test, match) whose
    test names a mechanism (:data:`MECHANISM_WORDS`), as source text."""
    out = []
    for node in ast.walk(function):
        test = getattr(node, "test", None) if isinstance(node, (ast.If, ast.IfExp, ast.While)) else None
        tests = [test] if test is not None else []
        if isinstance(node, ast.Match):
            tests = [node.subject]
        for t in tests:
            text = ast.unparse(t)
            if any(word in text.lower() for word in MECHANISM_WORDS):
                out.append(text)
    return out


def loop_problems(source: str) -> list[str]:
    """What keeps ``drive_rounds`` of ``source`` from asking instead of knowing: its length at
    :data:`LOOP_LINES` or more, a branch on a mechanism, or any mention of one in its body."""
    loop = function_node(source, "drive_rounds")
    problems = []
    lines = loop.end_lineno - loop.lineno + 1
    if lines >= LOOP_LINES:
        problems.append(f"drive_rounds is {lines} lines (at most {LOOP_LINES - 1})")
    problems += [f"drive_rounds branches on {t!r}" for t in mechanism_branches(loop)]
    body = loop.body[1:] if isinstance(loop.body[0], ast.Expr) else loop.body  # its docstring may explain
    named = {w for stmt in body for w in MECHANISM_WORDS if w in ast.unparse(stmt).lower()}
    problems += [f"drive_rounds names {w!r}" for w in sorted(named)]
    return problems


def test_drive_rounds_has_no_privacy_or_secure_branch_and_is_under_60_lines():
    source = (PACKAGE / "engines" / "rounds.py").read_text()
    assert loop_problems(source) == []


def test_the_loop_check_sees_a_privacy_branch_a_secure_stage_and_length():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(LOOP_LINES))
    assert loop_problems(f"def drive_rounds():\n    'doc'\n{long_body}\n") == [
        f"drive_rounds is {LOOP_LINES + 2} lines (at most {LOOP_LINES - 1})"
    ]
    branch = "def drive_rounds(record):\n    need = 0 if record.private else 1\n"
    assert loop_problems(branch) == ["drive_rounds branches on 'record.private'", "drive_rounds names 'private'"]
    stage = "def drive_rounds(transport):\n    if isinstance(transport, SecureTransport):\n        pass\n"
    assert loop_problems(stage)[0] == "drive_rounds branches on 'isinstance(transport, SecureTransport)'"
    assert (
        loop_problems("def drive_rounds(strategy):\n    '''no privacy here'''\n    strategy.round_rules(1, 0)\n") == []
    )


def test_secure_aggregations_stages_pass_their_state_and_hold_no_closure():
    """SecAgg+'s transport: each stage a method of at most 50 lines without nested functions, and
    no stage reads a round left on the transport by another (``self._round``)."""
    tree = ast.parse((PACKAGE / "engines" / "flower" / "secagg.py").read_text())
    (transport,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SecAggPlusTransport"]
    methods = [n for n in transport.body if isinstance(n, ast.FunctionDef)]
    long = {m.name: m.end_lineno - m.lineno + 1 for m in methods if m.end_lineno - m.lineno + 1 > 50}
    assert not long, f"SecAgg+ stages over 50 lines: {long}"
    nested = [(m.name, n.name) for m in methods for n in ast.walk(m) if n is not m and isinstance(n, ast.FunctionDef)]
    assert not nested, f"closures inside SecAgg+ stages: {nested}"
    assert "self._round" not in ast.unparse(transport)


def test_fedit_fslora_and_heterolora_fill_in_one_averaging_skeleton():
    from fedtune.methods.base.averaging import BroadcastAverage
    from fedtune.methods.fedit import FedITStrategy
    from fedtune.methods.fslora import FSLoRAStrategy
    from fedtune.methods.heterolora import HeteroLoRAStrategy

    for cls in (FedITStrategy, FSLoRAStrategy, HeteroLoRAStrategy):
        assert issubclass(cls, BroadcastAverage)
        assert cls.aggregate_fit is BroadcastAverage.aggregate_fit, f"{cls.__name__} writes its own aggregate_fit"
