"""The method boundary is typed (issue 53): a Strategy and a Client are built on the context
protocols of :mod:`fedtune.protocol.context`, not on ``Any``, and mypy's ``ignore_errors`` list
names no module of the layers every method stands on (``methods/base``, ``planning``, ``run.py``)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import tomllib

import fedtune
from fedtune.protocol.client import Client
from fedtune.protocol.context import ClientContext, ServerContext
from fedtune.protocol.strategy import Strategy

ROOT = Path(fedtune.__file__).parent.parent
#: module prefixes mypy must check whole (none of their modules may be under ignore_errors)
CHECKED = ("fedtune.methods.base", "fedtune.planning", "fedtune.run")


def ignored_modules(pyproject: str) -> list[str]:
    """The module patterns of ``pyproject``'s ``[[tool.mypy.overrides]]`` that set ``ignore_errors``."""
    overrides = tomllib.loads(pyproject)["tool"]["mypy"].get("overrides", [])
    return [m for o in overrides if o.get("ignore_errors") for m in o["module"]]


def unchecked(modules: list[str]) -> list[str]:
    """Those of ``modules`` under a :data:`CHECKED` prefix (the module itself or one below it)."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in CHECKED)]


def test_the_ignore_list_names_no_module_of_methods_base_planning_or_run():
    assert unchecked(ignored_modules((ROOT / "pyproject.toml").read_text())) == []


def test_the_ignore_list_check_sees_a_listed_base_or_planning_module():
    """The control: the list as it was before issue 53 (methods.base.privacy, planning.memory) fails."""
    before = '[tool.mypy]\n[[tool.mypy.overrides]]\nmodule = ["fedtune.cli", "fedtune.methods.base.privacy",'
    before += ' "fedtune.planning.memory", "fedtune.runtime", "fedtune.run", "fedtune.runner"]\nignore_errors = true\n'
    assert unchecked(ignored_modules(before)) == [
        "fedtune.methods.base.privacy",
        "fedtune.planning.memory",
        "fedtune.run",
    ]


@pytest.mark.parametrize(("cls", "protocol"), [(Strategy, ServerContext), (Client, ClientContext)])
def test_strategy_and_client_are_built_on_the_context_protocols_not_any(cls, protocol):
    hints = typing.get_type_hints(cls.__init__)
    assert hints["context"] is protocol, f"{cls.__name__}(context: {hints['context']})"


def members(protocol: type) -> dict[str, object]:
    """The public members (properties and methods) ``protocol`` declares itself."""
    return {
        n: v for n, v in vars(protocol).items() if not n.startswith("_") and (isinstance(v, property) or callable(v))
    }


def test_the_context_protocols_name_each_member_with_a_type_not_any():
    declared = {**members(ClientContext), **members(ServerContext)}
    assert {"config", "options", "task", "workspace", "profiles", "example_bound"} <= set(declared)
    for name, member in declared.items():
        function = member.fget if isinstance(member, property) else member
        returned = function.__annotations__.get("return")  # the source's spelling (postponed annotations)
        assert returned not in (None, "Any", typing.Any), f"{name} -> {returned}"


def test_options_as_gives_the_methods_options_and_refuses_another_class():
    """A helper object reads the method's options checked: its own class passes, another class's
    options (a context of another method) raise, naming both."""
    from types import SimpleNamespace

    from fedtune.methods.fedpft.fedpft import FedPFTOptions
    from fedtune.methods.fedpft.options import ProxyOptions
    from fedtune.methods.rabo.options import RaboOptions
    from fedtune.protocol.context import options_as

    own = FedPFTOptions()
    assert options_as(SimpleNamespace(options=own), ProxyOptions) is own  # a subclass is one
    with pytest.raises(TypeError, match="RaboOptions, not ProxyOptions"):
        options_as(SimpleNamespace(options=RaboOptions()), ProxyOptions)


def test_planned_reads_the_runs_aggregation_plan_typed_and_refuses_anything_else():
    from types import SimpleNamespace

    from fedtune.config import load_config
    from fedtune.methods.base.aggregation import AggregationPlan, plan_aggregation, planned

    plan = plan_aggregation(load_config(None, []))
    assert isinstance(plan, AggregationPlan)
    assert planned(SimpleNamespace(run=SimpleNamespace(aggregation=plan))) is plan
    with pytest.raises(TypeError, match="dict, not an AggregationPlan"):
        planned(SimpleNamespace(run=SimpleNamespace(aggregation={"combiner": "mean"})))
