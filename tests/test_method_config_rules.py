"""A method's rules that need only the config (``MethodOptions.config_refusal``, a rule of
fedtune.config.RULES) are refused at resolve (``resolve_run``, on every engine; not in
``Strategy.initialize``, where a Flower engine has already started): ``fedtune run`` exits 2 with
one line, before the task loads its data or builds a model and before the run folder exists. The
controls: the same run without the refused setting resolves, and reaches the data (the spy raises
there), so the spy can tell."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.config import ConfigError
from fedtune.runtime import resolve_run
from fedtune.tasks import get_task_class
from fedtune.testing import TINY_RUN, tiny_config

runner = CliRunner()


class ModelBuilt(Exception):
    """Raised by the spy: the task loaded its data or built a model."""


#: (method, task kind, the refused settings, their one line's start, the same run without them)
RULES = [
    ("commit", "instruction", ["model.lora_dropout=0.1"], "model.lora_dropout: method 'commit'", []),
    (
        "commit",
        "instruction",
        ["options.carry_optimizer=true"],
        "options.carry_optimizer: centralized mode only (federation.num_clients = 1), got 3 clients",
        [],
    ),
    (
        "fedstacklora",
        "text-classification",
        ['options.transport="stacks"', "server.lr=0.5"],
        "options.transport: 'stacks' ships B_stack A_stack exactly",
        ["server.lr=0.5"],
    ),
    (
        "rabo",
        "few-shot",
        ['options.masks="segment"', "options.segments=[0, 1]"],
        "options.segments: one segment per client expected (3 clients), got 2",
        ['options.masks="segment"', "options.segments=[0, 1, 2]"],
    ),
]


def _run(tmp_path, monkeypatch, method: str, kind: str, settings: list[str]):
    """``fedtune run`` of a tiny ``method`` on ``kind`` with ``settings``, every model build raising."""
    task = get_task_class(kind)

    def spy(self, *args):
        raise ModelBuilt(f"{kind}: its data or a model was loaded")

    monkeypatch.setattr(task, "build_model", spy)
    monkeypatch.setattr(task, "load", spy)
    sets = [
        f"method={method}",
        f"task.kind={kind}",
        *task.test_overrides,
        *TINY_RUN,
        f"output_dir={tmp_path / 'out'}",
        *settings,
    ]
    return runner.invoke(app, ["run", *sum((["--set", s] for s in sets), [])])


@pytest.mark.parametrize(("method", "kind", "refused", "line", "control"), RULES, ids=[r[3][:24] for r in RULES])
def test_a_config_rule_is_refused_before_any_model_and_folder(
    tmp_path, monkeypatch, method, kind, refused, line, control
):
    with pytest.raises(ConfigError, match=f"^{re.escape(line)}"):  # at resolve, on every engine
        resolve_run(tiny_config(method, kind, tmp_path / "out", *refused))
    resolve_run(tiny_config(method, kind, tmp_path / "out", *control))  # control: resolves
    result = _run(tmp_path, monkeypatch, method, kind, refused)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and line in lines[0] and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

    # control: without the refused setting the run gets as far as loading data, where the spy stops it
    reached = _run(tmp_path / "control", monkeypatch, method, kind, control)
    assert isinstance(reached.exception, ModelBuilt), (reached.output, reached.exception)
