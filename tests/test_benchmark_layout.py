"""The benchmarks' layout: every script in a suite folder ``benchmarks/<suite>/`` (none at the top),
each file at most 400 lines, every folder with an entry script (``python benchmarks/<suite>/<x>.py``),
siblings imported by their module name (the script's folder is on ``sys.path``; nothing imports a
``benchmarks`` package, so no ``PYTHONPATH`` is needed) and module names that do not clash across
folders; every entry answers ``--help`` and every other module imports."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MAX_LINES = 400
#: folders under benchmarks/ that are no suite: the committed results
NOT_SUITES = {"results", "__pycache__"}


def suites() -> list[Path]:
    return sorted(p for p in BENCHMARKS.iterdir() if p.is_dir() and p.name not in NOT_SUITES)


def scripts(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.py"))


def is_entry(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


def test_no_script_sits_at_the_top_of_benchmarks():
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == []


def test_every_benchmark_file_is_at_most_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for folder in suites()
        for p in scripts(folder)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_suite_folder_has_an_entry_script_and_module_names_are_unique():
    assert len(suites()) >= 10
    for folder in suites():
        assert any(is_entry(p) for p in scripts(folder)), f"{folder.name}: no script with a __main__ entry"
    # entries run as __main__; the modules they import by name share one sys.path in the tests
    names = Counter(p.stem for folder in suites() for p in scripts(folder) if not is_entry(p))
    assert [n for n, k in names.items() if k > 1] == []


def test_no_benchmark_imports_a_benchmarks_package():
    found = []
    for path in (p for folder in suites() for p in scripts(folder)):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {m}" for m in modules if m.split(".")[0] in ("benchmarks", "tests")]
    assert found == []


#: run in a fresh interpreter: every entry with --help (exit 0), every other module imported, each
#: folder alone on sys.path while its files load, as when its script runs
SMOKE = """
import importlib, json, runpy, sys
from pathlib import Path
failures = {}
for folder in map(Path, sys.argv[1:]):
    sys.path.insert(0, str(folder))
    for path in sorted(folder.glob("*.py")):
        try:
            if 'if __name__ == "__main__":' in path.read_text():
                sys.argv = [str(path), "--help"]
                try:
                    runpy.run_path(str(path), run_name="__main__")
                    failures[str(path)] = "--help did not exit"
                except SystemExit as exit:
                    if exit.code not in (0, None):
                        failures[str(path)] = f"--help exited {exit.code}"
            else:
                importlib.import_module(path.stem)
        except Exception as exc:
            failures[str(path)] = f"{type(exc).__name__}: {exc}"
    sys.path.remove(str(folder))
print(json.dumps(failures))
"""


def test_every_entry_answers_help_and_every_module_imports_without_pythonpath():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    folders = [str(f) for f in suites()]
    done = subprocess.run(
        [sys.executable, "-c", SMOKE, *folders], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_every_registered_set_has_an_lm_eval_format_and_every_recipe_names_registered_sets():
    """One registry of evaluation sets (``fedtune.data.llm_text``): ``fedtune eval``, the lm-eval
    formats and the suites' recipes (``task.sets``) all name its sets."""
    import tomllib

    from fedtune.data.llm_text import ALL_SETS, check_sets
    from fedtune.data.lm_eval_formats import FORMATS, requests
    from fedtune.trained.evaluate import SETS

    assert set(ALL_SETS) <= set(SETS) and set(ALL_SETS) <= set(FORMATS)
    for name in ALL_SETS:
        assert len(requests(name, "Who _ it?", ["a", "b"])) == 2, name
    named = []
    for path in sorted((ROOT / "configs").rglob("*.toml")):
        sets = tomllib.loads(path.read_text()).get("task", {}).get("sets")
        if sets is not None:
            assert check_sets(sets, str(path)) == sets
            named.append(path.name)
    assert "commonsense-suite.toml" in named  # the LLM tables' recipe
