"""A run is resolved once (fedtune.runtime.resolve_run) and the ResolvedRun travels: launch hands it
to the engine, the engine to its RunContexts and to Flower's server side; a process that gets only a
config (a Flower node, the ServerApp of a deployment) resolves it once, however many requests it
serves. The cross-section rules are one table (fedtune.config.RULES), and module sizes stay bounded."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

import fedtune
import fedtune.runtime
from fedtune.config import RULES, ConfigError, RunConfig, load_config
from fedtune.runtime import ResolvedRun, RunContext, resolve_run
from tests.conftest import TINY
from tests.test_flower import LoopbackGrid, task_identity  # noqa: F401 - fixture

PACKAGE = Path(fedtune.__file__).parent
MODULE_LINES, CONFIG_LINES = 500, 400


@pytest.fixture
def resolutions(monkeypatch) -> Counter:
    """Counts this process's calls of resolve_run, under every name a fedtune module imported it."""
    calls: Counter = Counter()
    original = fedtune.runtime.resolve_run

    def counted(config: RunConfig) -> ResolvedRun:
        calls["resolve_run"] += 1
        return original(config)

    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "") or "").startswith("fedtune") and getattr(
            module, "resolve_run", None
        ) is original:
            monkeypatch.setattr(module, "resolve_run", counted)
    return calls


def _config(tmp_path: Path, *extra: str) -> RunConfig:
    return load_config(None, [*TINY, "rounds=2", f"output_dir={tmp_path}", *extra])


def test_an_embedded_run_resolves_its_config_once(tmp_path, resolutions):
    from fedtune.launch import launch

    summary = launch(_config(tmp_path))
    assert summary["rounds"] == 2 and Path(summary["run_dir"], "summary.json").is_file()
    assert resolutions["resolve_run"] == 1


def test_flowers_server_side_takes_the_resolved_run_and_a_node_resolves_once(
    task_identity,  # noqa: F811
    tmp_path,
    resolutions,
):
    """The ServerApp handed the resolved run (a simulation) resolves nothing; the node's ClientApp,
    which gets a config, resolves it once for all its clients' requests of both rounds."""
    from fedtune.engines.flower.clientapp import make_client_app
    from fedtune.engines.flower.serverapp import serve

    run = resolve_run(_config(tmp_path))  # the launching process's (not counted: this module's own name)
    summary = serve(LoopbackGrid(make_client_app(run.config), 4), run, timeout=120)
    assert summary["rounds"] == 2
    assert resolutions["resolve_run"] == 1  # the in-process "node": one resolution for 4 clients x 2 rounds


def test_a_deployments_serverapp_resolves_its_run_config_once(task_identity, tmp_path, resolutions):  # noqa: F811
    """A ServerApp that gets only Flower's run config (the resolved config, serialized once by the
    launching process) resolves it once: the run folder's path and the run come from that one."""
    from fedtune.engines.flower.clientapp import make_client_app
    from fedtune.engines.flower.serverapp import STATUS_FILE, make_server_app

    run = resolve_run(_config(tmp_path, "rounds=1"))
    node = make_client_app(run.config)
    app = make_server_app(timeout=120)
    app._main(LoopbackGrid(node, 4), Context(0, 0, {}, RecordDict(), {"config": run.config.model_dump_json()}))
    assert json.loads((run.run_dir / STATUS_FILE).read_text())["status"] == "ok"
    assert resolutions["resolve_run"] == 2  # the ServerApp's one, and the node's one


def test_a_run_context_takes_a_resolved_run_not_a_config(tmp_path):
    config = _config(tmp_path)
    with pytest.raises(TypeError, match="RunContext takes a ResolvedRun"):
        RunContext(config)  # type: ignore[arg-type]
    run = resolve_run(config)
    assert RunContext(run).run is run


def test_a_relocated_run_keeps_everything_resolved_but_its_folder(tmp_path):
    run = resolve_run(_config(tmp_path))
    moved = run.relocated(str(tmp_path / "elsewhere"))
    assert moved.run_dir == tmp_path / "elsewhere" / run.config.run_name
    assert (moved.method, moved.options, moved.profiles) == (run.method, run.options, run.profiles)
    assert run.run_dir == tmp_path / run.config.run_name  # the original is unchanged


SECURE = "secure_aggregation.enabled=true;engine=flower-sim"
#: One config per rule of RULES, in table order, with the first line it stops with.
RULE_CASES = [
    (f"{SECURE};federation.clients_per_round=1", "secure_aggregation.enabled: needs at least 2 clients per round"),
    (f"{SECURE};secure_aggregation.quantization_range=2147483648", "secure_aggregation.quantization_range: 4 "),
    (f"{SECURE};secure_aggregation.num_shares=5", "secure_aggregation.num_shares: expected at most the 4"),
    (f"{SECURE};secure_aggregation.threshold=5", "secure_aggregation.threshold: expected 2..num_shares = 4"),
    (f"{SECURE};federation.wire_dtype=bfloat16", "federation.wire_dtype: not with secure_aggregation.enabled"),
    ("placement.gpus_per_client=0.5", "placement.gpus_per_client: applies to engine = 'flower-sim'"),
    ("placement.client_devices=['cpu','cpu'];engine=flower", "placement.client_devices: applies to engine"),
    ("placement.gpus_per_client=0.5;engine=flower-sim", "placement.gpus_per_client: needs device = 'cuda'"),
    ("secure_aggregation.enabled=true", "secure_aggregation.enabled: runs on engine"),
    ("secure_aggregation.enabled=true;engine=flower;placement.nodes=2", "placement.nodes: secure aggregation"),
    (
        "secure_aggregation.enabled=true;engine=flower-sim;privacy.mode=central;privacy.clip=1;"
        "privacy.noise_multiplier=1;privacy.adaptive_clip=true",
        "privacy.adaptive_clip: not with secure_aggregation.enabled",
    ),
    ("DP;robust.aggregation=median", "robust.aggregation: not with privacy.mode"),
    ("DP;robust.clip_update_norm=1", "robust.clip_update_norm: not with privacy.mode"),
    ("DP;robust.max_client_weight=0.5", "robust.max_client_weight: not with privacy.mode"),
    ("DP;robust.max_update_ratio=10", "robust.max_update_ratio: not with privacy.mode"),
    ("DP;federation.min_replies=2", "federation.min_replies: not with privacy.mode"),
    ("DP;federation.max_retries=0", "federation.max_retries: not with privacy.mode"),
    ("DP;method=heterolora;options.weighting=sparsity", "options.weighting: not with privacy.mode ('sparsity'"),
    ("DP;options.weighting=examples", 'options.weighting: "examples" is not DP'),
    (
        "secure_aggregation.enabled=true;engine=flower-sim;method=heterolora;options.weighting=sparsity",
        "options.weighting: 'sparsity' is not with secure_aggregation.enabled",
    ),
    (
        "method=fedstacklora;options.transport=stacks;server.lr=0.5",
        "options.transport: 'stacks' ships B_stack A_stack exactly",
    ),
]
DP = "privacy.mode=central;privacy.clip=1;privacy.noise_multiplier=1"


def test_the_rules_table_holds_every_cross_section_rule_once_with_its_line(tmp_path):
    """Each rule of RULES stops its config with its one line (the message tests/test_config.py and
    the others check), in table order; a config breaking none resolves."""
    assert len(RULES) == len(RULE_CASES)
    for rule, (overrides, line) in zip(RULES, RULE_CASES):
        sets = overrides.replace("DP", DP).split(";")
        with pytest.raises(ConfigError) as err:
            resolve_run(_config(tmp_path, *sets))
        message = str(err.value)
        assert message.startswith(line) and "\n" not in message, (rule.fields, message)
        assert any(message.startswith(field) for field in rule.fields), (rule.fields, message)
    resolve_run(_config(tmp_path, *DP.split(";")))


def test_modules_stay_small():
    """No module of fedtune/ over 500 lines, and no module of the config package over 400."""
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}"
    config = {name: n for name, n in sizes.items() if name.startswith("config/") and n > CONFIG_LINES}
    assert not config and "config.py" not in sizes, config
