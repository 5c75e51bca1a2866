"""The strict layers document their public API: every public class, function and method of the
modules that pyproject.toml's strict mypy override names has a docstring, and a function's docstring
names each of its arguments. Adding a module to that override adds it here."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def strict_modules() -> list[str]:
    """The module patterns of the ``[[tool.mypy.overrides]]`` that disallows untyped definitions."""
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    (strict,) = [o for o in mypy["overrides"] if o.get("disallow_untyped_defs")]
    return strict["module"]


def module_files(pattern: str) -> list[Path]:
    """The source files a mypy module pattern (``a.b`` or ``a.b.*``) names."""
    path = ROOT / pattern.removesuffix(".*").replace(".", "/")
    if pattern.endswith(".*"):
        return sorted(path.rglob("*.py"))
    return [path.with_suffix(".py")] if path.with_suffix(".py").is_file() else [path / "__init__.py"]


def public_definitions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    """Top-level public functions and classes, and the public methods (``__init__`` included) of public classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                        item.name == "__init__" or not item.name.startswith("_")
                    ):
                        yield item


def arguments(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """The names a caller passes: every parameter except ``self`` and ``cls``."""
    args = node.args
    named = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return [a.arg for a in named if a is not None and a.arg not in ("self", "cls")]


def undocumented(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line name: what is missing`` for each public definition of ``path`` that lacks a
    docstring, or whose docstring (for ``__init__``: its class's too) leaves an argument unnamed; ``root``: what the
    lines' paths are relative to."""
    tree = ast.parse(path.read_text())
    classes = {id(item): node for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body}
    where = path.relative_to(root)
    out = []
    for node in public_definitions(tree):
        doc = ast.get_docstring(node) or ""
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "__init__":
            doc += "\n" + (ast.get_docstring(classes[id(node)]) or "")
        if not doc.strip():
            out.append(f"{where}:{node.lineno} {node.name}: no docstring")
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            missing = [a for a in arguments(node) if not re.search(rf"(?<!\w){re.escape(a)}(?!\w)", doc)]
            if missing:
                out.append(f"{where}:{node.lineno} {node.name}: docstring does not name {', '.join(missing)}")
    return out


def test_the_strict_layers_are_the_protocol_and_the_registry_at_least():
    assert {"fedtune.protocol.*", "fedtune.registry"} <= set(strict_modules())


@pytest.mark.parametrize("pattern", strict_modules())
def test_public_definitions_of_a_strict_layer_have_docstrings_naming_their_arguments(pattern):
    files = module_files(pattern)
    assert files and all(f.is_file() for f in files), f"{pattern}: no such module"
    problems = [p for f in files for p in undocumented(f)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_missing_docstring_and_an_unnamed_argument(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "class A:\n"
        '    """An A."""\n'
        "    def f(self, x, *, y=1):\n"
        '        """Uses ``x``."""\n'
        "    def _private(self, z):\n"
        "        pass\n"
        "def g():\n"
        "    pass\n"
    )
    assert undocumented(source, tmp_path) == ["m.py:3 f: docstring does not name y", "m.py:7 g: no docstring"]
