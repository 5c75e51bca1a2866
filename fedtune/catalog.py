"""What ``fedtune methods`` and ``fedtune tasks`` list, read without importing the methods and
tasks (they import torch: seconds before the first line). ``catalog.json`` beside this module holds
each method's name and description and each task kind's description and defaults; it is written
from the registries by ``python -m fedtune.catalog``, and tests/test_catalog.py fails while it
departs from them."""

from __future__ import annotations

import json
from pathlib import Path

PATH = Path(__file__).with_name("catalog.json")


def read() -> dict:
    """``{"methods": [[name, description], ...], "tasks": [[kind, description, defaults], ...]}``."""
    return json.loads(PATH.read_text())


def build() -> dict:
    """What :func:`read` gives, from the registries (imports every method and task)."""
    from fedtune.methods import list_methods
    from fedtune.tasks import list_tasks

    return {  # fedtune's own: a user's package (fedtune.plugins) may have registered more in this process
        "methods": [[spec.name, spec.description] for spec in list_methods() if spec.module.startswith("fedtune.")],
        "tasks": [
            [task.kind, task.description, dict(task.defaults)]
            for task in list_tasks()
            if task.__module__.startswith("fedtune.")
        ],
    }


def text(catalog: dict) -> str:
    """``catalog`` as ``catalog.json`` holds it: an entry a line."""
    parts = [
        f'"{key}": [\n' + ",\n".join(f"  {json.dumps(entry)}" for entry in items) + "\n]"
        for key, items in catalog.items()
    ]
    return "{\n" + ",\n".join(parts) + "\n}\n"


if __name__ == "__main__":
    PATH.write_text(text(build()))
