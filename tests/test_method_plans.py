"""Each method carries its own plan (issue 53 item 2): a method registers its knob and cost model
(:class:`~fedtune.planning.spec.PlanSpec`) and the planner, which names no method, plans any
registered method by it; a method that registers none gets one line from ``fedtune plan``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.methods import get_method
from fedtune.planning.memory import Prediction
from fedtune.planning.planner import GIB, plan_budgets, refusal
from fedtune.planning.spec import Knob, PlanSpec
from fedtune.registry import _METHODS, MethodSpec
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY, output_lines

MIB = 2**20


def mib_per_rank(context) -> tuple[Knob, str]:
    """A cost model of the test's own: rank v costs v MiB and v seconds, uploads v values."""

    def cost(rank, checkpointing, fmt):
        prediction = Prediction(weights=rank * MIB, trainable=0, states=0, activations=0, seconds=rank, features=())
        return prediction, rank

    return Knob([8, 4, 2, 1], lambda p: p.rank, cost, "rank {}".format), "priced by the method's own model"


def registered(monkeypatch, name: str, plan: PlanSpec | None) -> MethodSpec:
    """FedIT's classes registered again under ``name`` with ``plan`` (removed after the test)."""
    fedit = get_method("fedit")
    spec = MethodSpec(name, fedit.strategy, fedit.client, fedit.options, "a new method", fedit.requires,
                      __name__, fedit.honours, plan)  # fmt: skip
    monkeypatch.setitem(_METHODS, name, spec)
    return spec


def test_a_new_method_is_planned_by_the_cost_model_it_registers(monkeypatch, tiny_config):
    """The knob's ladder, prices, labels and note are the registered plan's: rank 4 under 5 MiB,
    rank 1 under 1.5 MiB, a client under 1 MiB excluded, a stated rank kept, and a node's refusal
    priced the same way (a planner that kept its own table of methods plans none of it)."""
    registered(monkeypatch, "planned-fedit", PlanSpec("rank", mib_per_rank))
    budgets = [5 * MIB / GIB, 1.5 * MIB / GIB, 0.5 * MIB / GIB]
    profiles = ", ".join(f"{{memory_gib={b!r}}}" for b in budgets) + ", {rank=2, memory_gib=1e-6}"
    config = tiny_config("method=planned-fedit", "federation.num_clients=4", f"federation.profiles=[{profiles}]")
    context = RunContext(resolve_run(config))
    plan = plan_budgets(context)
    assert [c.setting for c in plan.clients] == ["rank 4", "rank 1", "rank 1", "rank 2"]
    assert [p.rank for p in plan.profiles] == [4, 1, 1, 2] and plan.note == "priced by the method's own model"
    assert list(plan.excluded) == [2] and "predicted peak 0.000977 GiB > memory_gib" in plan.excluded[2]
    assert plan.clients[3].stated and plan.clients[3].over is not None and plan.clients[0].seconds == 4.0
    assert refusal(context, context.run.profiles[0]) == "predicted peak 0.00781 GiB > memory_gib 0.00488281"


@pytest.mark.parametrize("method", ["unplanned-fedit", "fedavg"])
def test_a_method_that_registers_no_plan_gets_one_line_from_fedtune_plan(monkeypatch, tmp_path, method):
    registered(monkeypatch, "unplanned-fedit", None)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'method = "{method}"\n')
    overrides = [x for o in (*TINY, "federation.profiles=[{memory_gib=4}]") for x in ("--set", o)]
    result = CliRunner().invoke(app, ["plan", str(recipe), *overrides])
    lines = output_lines(result.output)
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"method {method!r} has no planner" in lines[0] and lines[0].count(method) == 1
    assert "fedit, fedmbo, fedot" in lines[0]  # the methods that do, from the registry
