"""Issue 52: budgets where the devices are. A Flower node states its own resources in its node
config; the server plans each of its clients from that report (nothing in the server's config names
a node's resources), drops a malformed report with its reason, excludes a node no setting fits, and
sends each node-budgeted client its setting; the node refuses a setting its budget cannot hold
before it loads anything; under DP neither the report nor the measured peak is released.

Fast: the in-process loopback Grid of tests/test_flower.py (each node a Flower Context with its own
node config, the ClientApp and its worker in this process). Slow: a real loopback deployment."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from fedtune.config import load_config
from fedtune.engines.flower import budgets, serverapp, worker
from fedtune.engines.flower.clientapp import make_client_app
from fedtune.engines.flower.codec import META, RECORD
from fedtune.engines.flower.serverapp import serve
from fedtune.harness import toml_value
from fedtune.planning.node_report import check_report, node_report
from fedtune.planning.planner import MB, plan_budgets
from fedtune.runtime import RunContext, resolve_run
from tests.conftest import TINY
from tests.test_flower import LoopbackGrid, task_identity  # noqa: F401 - the fixture a loopback ServerApp needs

#: HeteroLoRA on the tiny BERT, four clients, one round; no budget anywhere in the config
NODES = 4


def config(tmp_path, *extra: str):
    base = [*TINY, "method=heterolora", "model.lora_rank=8", f"federation.num_clients={NODES}", "rounds=1"]
    return load_config(None, [*base, "train.local_steps=1", f"output_dir={tmp_path}", *extra])


def uploads(tmp_path) -> dict[int, float]:
    """The predicted MB a client uploads a round at each rank of the ladder (the budgets are set from them)."""
    ranks = [8, 4, 2, 1]
    profiles = "federation.profiles=[" + ", ".join(f"{{rank={r}}}" for r in ranks) + "]"
    plan = plan_budgets(RunContext(resolve_run(config(tmp_path, profiles))), always=True)
    return {r: c.upload_mb for r, c in zip(ranks, plan.clients)}


class RecordingGrid(LoopbackGrid):
    """The loopback Grid, keeping every reply the server pulled (``pulled``)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.pulled: list = []

    def pull_messages(self, message_ids):
        got = super().pull_messages(message_ids)
        self.pulled += got
        return got


def budgeted_grid(cfg, node_budgets: list[dict]) -> RecordingGrid:
    """A loopback Grid of one node per client, node ``i`` started with ``node_budgets[i]`` in its node config."""
    grid = RecordingGrid(make_client_app(cfg), NODES)
    for (nid, context), extra in zip(sorted(grid.contexts.items(), key=lambda kv: -kv[0]), node_budgets):
        grid.contexts[nid] = Context(
            run_id=1, node_id=nid, node_config={**context.node_config, **extra}, state=RecordDict(), run_config={}
        )
    return grid


def run_nodes(cfg, node_budgets: list[dict]) -> tuple[Path, RecordingGrid]:
    grid = budgeted_grid(cfg, node_budgets)
    try:
        summary = serve(grid, cfg, timeout=120)
    finally:
        worker._CONTEXTS.pop(cfg.model_dump_json(), None)
    return Path(summary["run_dir"]), grid


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "report, reason",
    [
        ({"memory_gib": -1}, "memory_gib = -1: expected a positive finite number"),
        ({"memory_gib": float("nan")}, "memory_gib = nan: expected a positive finite number"),
        ({"deadline_s": float("inf")}, "deadline_s = inf: expected a positive finite number"),
        ({"bandwidth_mb": "20"}, "bandwidth_mb = '20': expected a positive finite number"),
        ({"memory_gib": [8]}, "memory_gib = [8]: expected a positive finite number"),
        ({"speed": True}, "speed = True: expected a positive finite number"),
        ({"memory_gib": 0}, "memory_gib = 0: expected a positive finite number"),
        ({"rank": 64}, "names 'rank'; expected some of memory_gib"),
        ([8, 20], "budget report is a list, expected a mapping"),
        ("{not json", "budget report is not JSON"),
        ('{"memory_gib": NaN}', "memory_gib = nan: expected"),
    ],
)
def test_a_malformed_or_lying_budget_report_is_refused_with_its_reason(report, reason):
    budget, why = check_report(report)
    assert budget is None and reason in why and "\n" not in why
    # the control: a well-formed report passes, as floats
    assert check_report('{"memory_gib": 8, "speed": 0.5}') == ({"memory_gib": 8.0, "speed": 0.5}, None)


def test_a_node_states_its_budget_from_its_node_config_or_measures_it():
    assert node_report({"fedtune-clients": "0-3", "memory-gib": 8, "bandwidth-mb": 20.5}) == {
        "memory_gib": 8,
        "bandwidth_mb": 20.5,
    }
    assert node_report({"partition-id": 0}) == {}  # states none: the server keeps the config's (simulation)
    measured = node_report({"measure-memory": True, "measure-speed": True})
    assert set(measured) == {"memory_gib", "speed"} and all(v > 0 and math.isfinite(v) for v in measured.values())
    assert node_report({"measure-memory": True, "memory-gib": 2}) == {"memory_gib": 2}  # stated wins over measured


@pytest.mark.usefixtures("task_identity")
def test_the_server_plans_each_node_from_its_own_report_and_drops_a_bad_one(tmp_path):
    up = uploads(tmp_path)
    cfg = config(tmp_path, "name=nodes")
    fed = cfg.federation
    assert fed.profiles is None and fed.profile_choices is None and fed.device_classes is None  # no resources
    node_budgets = [
        {"bandwidth-mb": up[8] * 1.5},  # rank 8 fits
        {"bandwidth-mb": (up[2] + up[4]) / 2, "memory-gib": 64},  # rank 2
        {"bandwidth-mb": up[1] / 50},  # nothing fits (top-k 0.05 in bfloat16 sends 7.5 %): excluded
        {"memory-gib": float("nan")},  # a malformed report: dropped, with its reason
    ]
    run_dir, grid = run_nodes(cfg, node_budgets)
    plan = json.loads((run_dir / "plan.json").read_text())["clients"]
    # one planning path: the plan from the nodes' reports is the plan of the same budgets in the config
    same = [{k.replace("-", "_"): v for k, v in b.items()} for b in node_budgets[:3]] + [{}]
    simulated = plan_budgets(RunContext(resolve_run(config(tmp_path, f"federation.profiles={toml_value(same)}"))))
    assert [c["setting"] for c in plan[:3]] == [c.setting for c in simulated.clients[:3]]
    assert plan[0]["setting"] == "rank 8" and plan[1]["setting"] != "rank 8"  # the small node's is lighter
    assert [c["excluded"] is None for c in plan] == [True, True, False, False]
    assert plan[2]["excluded"].startswith("excluded by the plan: no setting fits its budget (rank 1")
    nid = sorted(grid.contexts, reverse=True)[3]  # client 3's node
    assert plan[3]["excluded"] == (
        f"excluded: Flower node {nid}'s budget report memory_gib = nan: expected a positive finite number; "
        "reply dropped"
    )
    assert plan[0]["device_class"].startswith("Flower node ")  # each client's class: its node
    (line,) = lines(run_dir)
    assert line["dropped"] == {"2": plan[2]["excluded"], "3": plan[3]["excluded"]}
    assert sorted(line["clients"]) == [0, 1]  # the excluded are never asked
    # each node's client trained and uploaded as the server planned from its report
    sent_up = line["client_bytes_up"]
    for cid in (0, 1):  # the plan's values, plus the message's framing (names, shapes, metadata)
        assert 0 < sent_up[str(cid)] - plan[cid]["upload_mb"] * MB < 3000
    assert plan[1]["upload_mb"] * MB + 3000 < sent_up["0"]  # so client 1 did not upload client 0's setting
    # the node with a memory budget measured its fit; its budget is its node's, not the config's
    assert line["client_memory_budget_bytes"] == {"1": 64 * 2**30}
    # the settings travelled to the nodes with the requests (client 0's node: rank 8; client 1's: rank 2)
    settings = [m.content[RECORD].get("setting") for m in grid.sent if m.metadata.message_type == "train"]
    assert len(settings) == 2 and {json.loads(s).get("upload_topk") for s in settings} == {
        None,
        simulated.profiles[1].upload_topk,
    }


@pytest.mark.usefixtures("task_identity")
def test_a_node_refuses_a_setting_its_budget_cannot_hold_even_when_the_server_asks(tmp_path, monkeypatch):
    """The server lies (asks every node-budgeted client for rank 8): the node whose budget holds rank 2
    refuses, with the plan's reason, and the round drops it; the control node (room for rank 8) trains."""
    up = uploads(tmp_path)
    real = serverapp.adopt_reports

    def greedy(context, reported):
        return {cid: '{"rank": 8}' for cid in real(context, reported)}

    monkeypatch.setattr(serverapp, "adopt_reports", greedy)
    node_budgets = [{"bandwidth-mb": up[8] * 1.5}, {"bandwidth-mb": (up[2] + up[4]) / 2}, {}, {}]
    run_dir, _ = run_nodes(config(tmp_path, "name=lying"), node_budgets)
    (line,) = lines(run_dir)
    assert set(line["dropped"]) == {"1"}
    assert "refused by its node before loading anything: predicted upload" in line["dropped"]["1"]
    assert f"> bandwidth_mb {(up[2] + up[4]) / 2:g}" in line["dropped"]["1"]
    assert {"0", "2", "3"} <= set(line["client_bytes_up"]) and line["client_bytes_up"]["0"] > 0


def test_the_node_refuses_before_it_loads_any_base(tmp_path):
    up = uploads(tmp_path)
    context = RunContext(resolve_run(config(tmp_path)))
    budget = json.dumps({"budget": json.dumps({"bandwidth_mb": (up[2] + up[4]) / 2}), "setting": '{"rank": 8}'})
    with pytest.raises(budgets.NodeRefusal, match="refused by its node before loading anything: predicted upload"):
        budgets.node_client(context, 1, {}, budget)
    assert "workspace" not in vars(context) and not context._bases  # nothing was loaded
    fits = json.dumps({"budget": json.dumps({"bandwidth_mb": (up[2] + up[4]) / 2}), "setting": '{"rank": 2}'})
    client = budgets.node_client(context, 1, {}, fits)  # the control: the setting the budget holds
    assert client.profile.rank == 2 and client.profile.bandwidth_mb == pytest.approx((up[2] + up[4]) / 2)
    for bad, why in [('{"rank": -2}', "the request's setting rank"), ('{"memory_gib": 99}', "expected a mapping of")]:
        with pytest.raises(budgets.NodeRefusal, match=why):
            budgets.node_client(context, 1, {}, json.dumps({"budget": None, "setting": bad}))
    with pytest.raises(budgets.NodeRefusal, match="this node's own budget report memory_gib = -1"):
        budgets.node_client(context, 1, {}, json.dumps({"budget": '{"memory_gib": -1}', "setting": None}))


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("private", [True, False])
def test_under_dp_no_node_report_nor_measured_peak_leaves_for_the_public_files(tmp_path, private):
    """Under DP the plan made from the nodes' reports is not written and no reply carries a measured
    peak (a node over its memory fails itself); without DP (the control) both are there."""
    dp = ['privacy.mode="central"', "privacy.clip=0.5", "privacy.noise_multiplier=0.8"]
    dp += ["privacy.insecure_reproducible_noise=true", "options.weighting='uniform'", "federation.clients_per_round=4"]
    cfg = config(tmp_path, "method=fedit", *(dp if private else []), f"name=dp-{private}")
    run_dir, grid = run_nodes(cfg, [{"memory-gib": 64, "bandwidth-mb": 1000}] * NODES)
    replies = [json.loads(r.content[RECORD][META]) for r in grid.pulled if META in r.content.get(RECORD, {})]
    assert len(replies) >= NODES  # the train and evaluate replies (the query's carry no metadata)
    assert (run_dir / "plan.json").exists() is not private
    assert any("peak_bytes" in m for m in replies) is not private
    (line,) = lines(run_dir)
    assert ("client_peak_bytes" in line) is not private
    if private:
        assert set(line) <= {"round", "accuracy", "loss", "epsilon", "private"}


def test_deploy_supernode_refuses_a_bad_budget_flag_and_states_a_good_one(tmp_path):
    from typer.testing import CliRunner

    from fedtune.cli import app
    from fedtune.engines.flower.commands import supernode_args

    for flag in ("--memory-gib=-1", "--deadline-s=nan"):
        result = CliRunner().invoke(
            app, ["deploy", "supernode", "--superlink", "x:1", "--clients", "0", "--insecure", flag]
        )
        assert result.exit_code == 2 and "expected a positive finite number" in result.output, result.output
    args = supernode_args("127.0.0.1:1", 2, [0, 1], budget={"memory-gib": 8.0, "measure-speed": True})
    node_config = args[args.index("--node-config") + 1]
    assert node_config == 'fedtune-clients="0-1" memory-gib=8.0 measure-speed=true'


@pytest.mark.slow
def test_a_real_loopback_deployment_plans_each_node_from_its_own_node_config(tmp_path):
    """Issue 52's acceptance on real processes (SuperLink, one SuperNode per client started with its own
    ``--node-config`` budget, ``flwr run``): the plan follows each node's report, the node no setting fits
    is excluded with its reason, the NaN report's reply is dropped, and the server's config names no
    node's resources. The fast tests above drive the same code in one process."""
    from fedtune.engines.flower.deployment import LoopbackDeployment

    up = uploads(tmp_path)
    cfg = config(tmp_path / "runs", "name=deployed")
    fed = cfg.federation
    assert fed.profiles is None and fed.profile_choices is None and fed.device_classes is None
    node_budgets = [
        {"bandwidth-mb": round(up[8] * 1.5, 6)},
        {"bandwidth-mb": round((up[2] + up[4]) / 2, 6), "memory-gib": 64},
        {"bandwidth-mb": round(up[1] / 50, 6)},
        {"memory-gib": "nan"},  # TOML's nan in the node config: a float NaN on the node
    ]
    with LoopbackDeployment([[i] for i in range(NODES)], budgets=node_budgets) as d:
        summary = d.run(cfg, timeout=600)
    run_dir = Path(summary["run_dir"])
    plan = json.loads((run_dir / "plan.json").read_text())["clients"]
    assert plan[0]["setting"] == "rank 8" and plan[1]["setting"] not in ("rank 8", "-")
    assert plan[2]["excluded"].startswith("excluded by the plan: no setting fits its budget")
    assert "memory_gib = nan: expected a positive finite number; reply dropped" in plan[3]["excluded"]
    (line,) = lines(run_dir)
    assert sorted(line["clients"]) == [0, 1] and set(line["dropped"]) == {"2", "3"}
    server_config = (run_dir / "config.toml").read_text()  # the server's config: no node's resources
    assert not any(field in server_config for field in ("memory_gib", "bandwidth_mb", "deadline_s", "profiles"))
