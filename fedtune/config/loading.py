"""Reading a config: a TOML recipe, ``key=value`` overrides, validation with one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import tomllib
from pydantic import BaseModel, ValidationError

from fedtune.config.base import ConfigError
from fedtune.config.legacy import moved_key, note_moved, split_federation
from fedtune.config.run_config import RunConfig


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"]).lstrip(".") or "config"
    msg = first["msg"].removeprefix("Value error, ")
    given = first.get("input")
    shown = "" if first["type"] == "missing" or isinstance(given, dict) else f" (got {given!r})"
    more = f" [+{len(err.errors()) - 1} more]" if len(err.errors()) > 1 else ""
    if first["type"] == "value_error" and (msg.startswith(where) or not first["loc"]):  # a check naming its field
        return f"{msg}{more}"
    return f"{where}: {msg}{shown}{more}"


Options = TypeVar("Options", bound=BaseModel)

SHORTHAND = {"task": "kind"}  # what a section given as a plain string names (default: "name")


def parse_value(text: str) -> Any:
    """A ``--set`` value ``text``: TOML syntax if it parses (numbers, booleans, lists), else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:  # tomllib recurses per nesting level
        raise ConfigError(f"--set value {text[:40]!r}...: nested too deeply") from None


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``assignment`` ``dotted.key=value`` to the nested dict ``tree``, in place (an old
    ``federation`` key at its new place: :mod:`~fedtune.config.legacy`)."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value")
    key, text = assignment.split("=", 1)
    new = moved_key(key.strip())  # an old [federation] key: its new place (so that it overrides it)
    if new != key.strip():
        note_moved(key.strip(), new, "--set")
    parts = new.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str):  # `data = "sst2"` then `--set data.alpha=0.1`
            child = {SHORTHAND.get(part, "name"): child}
        node[part] = child if isinstance(child, dict) else {}
        node = node[part]
    node[parts[-1]] = parse_value(text.strip())


def flat_keys(tree: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """The nested dict ``tree`` as one ``{"a.b.c": value}`` dict (the inverse of :func:`apply_override`'s
    nesting); ``sep`` joins the keys."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update({f"{key}{sep}{sub}": leaf for sub, leaf in flat_keys(value, sep).items()})
        else:
            out[key] = value
    return out


def load_config(
    recipe: str | Path | None = None, overrides: list[str] | None = None, run_folder: bool = False
) -> RunConfig:
    """Read a TOML recipe (optional), apply ``key=value`` overrides, validate. The recipe's keys from
    before ``[federation]``'s split are moved with a note (:mod:`~fedtune.config.legacy`), silently
    where it is a ``run_folder``'s own ``config.toml`` (``--resume``: fedtune wrote them, not the user)."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError(f"recipe {str(path)!r}: file not found")
        try:
            tree = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"recipe {str(path)!r}: invalid TOML ({exc})") from None
        except RecursionError:
            raise ConfigError(f"recipe {str(path)!r}: invalid TOML (nested too deeply)") from None
        except UnicodeDecodeError:
            raise ConfigError(f"recipe {str(path)!r}: invalid TOML (not UTF-8 text)") from None
        except OSError as exc:
            raise ConfigError(f"recipe {str(path)!r}: cannot be read ({exc.strerror})") from None
        tree = split_federation(tree, f"recipe {str(path)!r}", warn=not run_folder)
    for assignment in overrides or []:
        apply_override(tree, assignment)
    return validated(RunConfig, tree)


def validated(cls: type[Options], values: Any, prefix: str = "") -> Options:
    """``values`` (a config tree as read) validated as ``cls``, strictly: a bool or a string where a
    number is expected is refused (``true`` is not 1 GiB, ``"1"`` is not 1), an int where a float
    is expected accepted; the one place every config value is validated (the run's config, a
    method's ``[options]``, a task's). ConfigError: one line, prefixed with ``prefix``."""
    try:
        return cls.model_validate(values, strict=True)
    except ValidationError as exc:
        raise ConfigError(prefix + _format_error(exc)) from None


def validate_options(values: dict[str, Any], options_cls: type[Options], prefix: str = "options") -> Options:
    """``values`` validated as ``options_cls`` (:func:`validated`): typed options (a method's
    ``[options]``, a task's ``[task]``); errors prefixed with ``prefix.``."""
    return validated(options_cls, values, f"{prefix}.")
