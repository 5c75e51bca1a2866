"""The README's architecture map matches the tree: every module and package of ``fedtune/`` is on
it and everything on it exists.

The map is the code block of the README's "Architecture" section. An entry is a line indented by
two spaces: its names (paths relative to ``fedtune/``, a package ending in ``/``, several separated
by commas), two or more spaces, then its description, which may go on in lines indented further.
A package whose entry (alone on it) names files of its own (``name.py`` in the description) is
enumerated: every module of it is named there, or has an entry of its own; any other package entry
describes the package as a whole. A module is on the map when an entry names it, or when the nearest
package above it that has an entry describes it as a whole or names it (or its subpackage, ``sub/``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILE_NAME = re.compile(r"(?<![\w./])(\w+\.py|\w+/)(?![\w/])")


@dataclass
class Entry:
    names: list[str]
    description: str


def architecture_map(readme: str) -> list[Entry]:
    """The entries of the code block after the ``readme``'s ``## Architecture`` heading."""
    section = readme.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    lines = section.split("```\n", 2)[1].splitlines()
    assert lines[0] == "fedtune/", "the architecture map starts with fedtune/"
    entries: list[Entry] = []
    for line in lines[1:]:
        if re.match(r"  \S", line):
            names, description = (re.split(r"\s{2,}", line.strip(), maxsplit=1) + [""])[:2]
            entries.append(Entry([n.strip() for n in names.split(",")], description))
        elif line.strip():
            assert entries and line.startswith("   "), f"map line {line!r} belongs to no entry"
            entries[-1].description += " " + line.strip()
    return entries


def packages(entries: list[Entry]) -> dict[str, set[str] | None]:
    """Each package on the map -> what its entry names of it (``x.py``, ``sub/``) when it is
    enumerated, None when it is described as a whole."""
    out: dict[str, set[str] | None] = {}
    for entry in entries:
        for name in entry.names:
            if name.endswith("/"):
                named = set(FILE_NAME.findall(entry.description)) if len(entry.names) == 1 else set()
                out[name] = named if any(n.endswith(".py") for n in named) else None
    return out


def unmapped(entries: list[Entry], package: Path) -> list[str]:
    """What is wrong with the map of ``package``: names on it that do not exist there, then the
    modules under it (paths relative to it) that it leaves out."""
    named = {n for e in entries for n in e.names}
    listed = packages(entries)
    wrong = [f"{n} (no such module or package)" for n in sorted(named) if not (package / n).exists()]
    for name, files in listed.items():
        wrong += [
            f"{name}{f} (no such module or package)" for f in sorted(files or ()) if not (package / name / f).exists()
        ]
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if path.name == "__init__.py" or relative in named:
            continue
        above = [p.as_posix() + "/" for p in path.relative_to(package).parents if p.as_posix() != "."]
        nearest = next((p for p in above if p in listed), None)
        if nearest is None:
            missing.append(relative)
            continue
        files = listed[nearest]
        head, sep, _ = relative[len(nearest) :].partition("/")
        if files is not None and head + sep not in files:
            missing.append(f"{relative} (its package's entry {nearest} names its other files)")
    return wrong + missing


def test_the_readme_map_names_every_module_and_nothing_else():
    entries = architecture_map((ROOT / "README.md").read_text())
    problems = unmapped(entries, ROOT / "fedtune")
    assert not problems, "README architecture map: " + "; ".join(problems)


@pytest.mark.parametrize(
    ("map_lines", "expected"),
    [
        (
            [
                "  a.py, whole/   a, and a whole package",
                "  listed/          one.py and two.py",
                "                   go on",
            ],
            [],
        ),
        (["  a.py           a", "  whole/         a whole package"], ["listed/one.py", "listed/two.py"]),
        (
            ["  a.py, whole/   both", "  listed/        one.py only"],
            ["listed/two.py (its package's entry listed/ names its other files)"],
        ),
        (
            ["  a.py, whole/, gone.py   names", "  listed/   one.py, two.py, three.py"],
            ["gone.py (no such module or package)", "listed/three.py (no such module or package)"],
        ),
    ],
)
def test_the_check_finds_what_is_missing_or_gone(tmp_path, map_lines, expected):
    for name in ["a.py", "whole/x.py", "whole/deep/y.py", "listed/one.py", "listed/two.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    readme = "\n## Architecture\n\ntext\n\n```\nfedtune/\n" + "\n".join(map_lines) + "\n```\n"
    assert unmapped(architecture_map(readme), tmp_path) == expected
