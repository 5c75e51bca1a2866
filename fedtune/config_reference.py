"""The config reference, generated from the config classes (so it cannot drift): every key of a
recipe with its type, default and description, for the docs site (``docs/hooks.py`` writes it into
``docs/config.md`` at build time; ``python -m fedtune.config_reference`` prints it).

:func:`entries` walks :class:`~fedtune.config.RunConfig` and the models under it (sections, a
client profile, a device class); :func:`option_entries` adds each task kind's ``[task]`` options and
each method's ``[options]``. A key without a description is a key the reference cannot explain:
``tests/test_config_reference.py`` fails on it.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Entry:
    """One key of the reference: its dotted name, type, default and description."""

    key: str
    type: str
    default: str
    description: str


def _type(annotation: Any) -> str:
    """``annotation`` as a reader wants it: a Literal's choices, ``X | None``, a model's name."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " / ".join(json.dumps(a) for a in args)
    if args:
        inner = [_type(a) for a in args if a is not type(None)]
        joined = ", ".join(inner)
        if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            return " | ".join(inner) + (" | None" if type(None) in args else "")
        return f"{getattr(origin, '__name__', str(origin))}[{joined}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(table)"
    return "–" if value is None else json.dumps(value, default=str)


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside ``annotation`` (a section, or a list of profiles)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models(a)]


def model_entries(model: type[BaseModel], prefix: str = "") -> list[Entry]:
    """The keys of ``model`` under ``prefix``, a model-valued field's keys below it (a list of
    models: ``key[].field``)."""
    out: list[Entry] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append(Entry(key, _type(field.annotation), _default(field), field.description or ""))
        for inner in _models(field.annotation):
            many = typing.get_origin(field.annotation) is not None and inner is not field.annotation
            out.extend(model_entries(inner, f"{key}[]." if many else f"{key}."))
    return out


def entries() -> list[Entry]:
    """Every key of :class:`~fedtune.config.RunConfig`, sections and nested tables included."""
    from fedtune.config import RunConfig

    return model_entries(RunConfig)


def option_entries() -> dict[str, list[Entry]]:
    """``[task]`` options per task kind (``task(kind)``) and ``[options]`` per method
    (``options(method)``), fedtune's own."""
    from fedtune.methods import list_methods
    from fedtune.tasks import list_tasks

    out = {f"task ({t.kind})": model_entries(t.Options, "task.") for t in list_tasks()}
    out.update({f"options ({s.name})": model_entries(s.options, "options.") for s in list_methods()})
    return out


def _table(rows: list[Entry]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{e.key}` | {cell(e.type)} | `{cell(e.default)}` | {cell(e.description)} |" for e in rows]
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The reference as Markdown: the run's keys by section, then each task kind's and method's options."""
    top = [e for e in entries() if "." not in e.key]
    parts = ["## The run\n", _table(top)]
    for section in dict.fromkeys(e.key.split(".")[0] for e in entries() if "." in e.key):
        parts += [f"\n## [{section}]\n", _table([e for e in entries() if e.key.startswith(section + ".")])]
    for title, rows in option_entries().items():
        if rows:
            parts += [f"\n## {title}\n", _table(rows)]
    return "".join(parts)


def undocumented() -> list[str]:
    """The keys whose reference entry has no description (a task's or method's: ``key (whose)``)."""
    named = [(e, "") for e in entries()]
    named += [(e, f" ({title})") for title, rows in option_entries().items() for e in rows]
    return sorted({f"{e.key}{whose}" for e, whose in named if not e.description.strip()})


if __name__ == "__main__":
    print(markdown())
