"""Shared test setup: offline hub, the shared data directory, a tiny-model config factory."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # the tests use tiny models: threads cost more than they give

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
os.environ.setdefault("FEDTUNE_DATA_DIR", str(Path(__file__).resolve().parents[1].parent / "shared" / "data"))
warnings.filterwarnings("ignore", category=FutureWarning)

TINY = [
    "model.name=tiny-bert",
    "data.name=tweets",
    "data.max_train_samples=200",
    "data.max_test_samples=100",
    "data.max_length=32",
    "federation.num_clients=4",
    "train.local_steps=3",
    "train.batch_size=8",
    "rounds=2",
]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One torch thread in every test (tiny tensors, a shared 2-core machine), even after a test
    whose run set ``train.threads``."""
    torch.set_num_threads(1)


@pytest.fixture
def tiny_config(tmp_path):
    """``tiny_config(*overrides)``: a fast RunConfig (2-layer BERT, hidden 32) writing under tmp_path."""
    from fedtune.config import load_config

    def make(*overrides: str):
        return load_config(None, [*TINY, f"output_dir={tmp_path / 'runs'}", *overrides])

    return make


def variants(kind: str) -> list[str]:
    """The task's tiny configurations: the default one and its named variants."""
    from fedtune.tasks import get_task_class

    return ["", *get_task_class(kind).test_variants]


#: A method's own tiny settings in :func:`tiny`. The proxy methods distill before FL (FedOT only when
#: the model has middle layers to emulate): 2 steps of 8 public examples run that code path (the
#: default, 200 steps of 32, took 20 of the 23 s of FedPFT's contract run on the instruction task);
#: the distillation itself is tested in tests/test_fedpft.py and tests/test_fedpft_methods.py.
#: RAFBO's finite-difference hypergradient perturbs 8 coordinates, not 64 (an inner solve each: 10
#: of the 13 s of its contract run on the image task); tests/test_rabo_hypergrad.py tests the estimate.
METHOD_TINY = {
    **{
        method: ("options.distill_steps=2", "options.distill_batch_size=8", "options.distill_samples=64")
        for method in ("fedpft", "fedot")
    },
    "rafbo": ("options.fd_coordinates=8",),
}


def tiny(tmp_path, method: str, kind: str, *extra: str, variant: str = ""):
    """A seconds-long config of ``method`` on task ``kind`` (:func:`fedtune.testing.tiny_config`: its
    ``test_overrides`` and the named variant, 3 clients, 2 per round, 2 rounds, heterogeneous ranks)
    with the method's ``METHOD_TINY``, writing under ``tmp_path``."""
    from fedtune.testing import tiny_config

    return tiny_config(method, kind, tmp_path, *METHOD_TINY.get(method, ()), *extra, variant=variant)


def random_global(strategy, seed: int) -> dict:
    """Give the initialized ``strategy`` random global arrays (N(0, 0.3^2) each coordinate, float32)
    and return them in float64: a start far from the zero-initialized LoRA B."""
    import numpy as np

    rng = np.random.default_rng(seed)
    strategy.global_arrays = {
        k: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in strategy.global_arrays.items()
    }
    return {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}


def one_line_config_error(call) -> str:
    """The message of the :class:`~fedtune.config.ConfigError` that ``call()`` raises, checked to be
    one line."""
    from fedtune.config import ConfigError

    with pytest.raises(ConfigError) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


STEP_LINE = re.compile(r"^.+: done(, [\d,.]+ \S+)? in \d+\.\d s$")


def output_lines(output: str) -> list[str]:
    """A command's output less the closing lines of :mod:`fedtune.steps` shown off a terminal ("loading
    X: done in 0.1 s"): what a one-line error test counts. Nothing else is removed."""
    return [line for line in output.strip().splitlines() if not STEP_LINE.match(line)]


def load_script(path: Path, name: str):
    """A benchmark script (not a package module) imported from its file as module ``name``. Its
    folder goes on ``sys.path``, as when the script runs, so that it finds its sibling modules
    (a suite's experiments and reports, named after the suite)."""
    import importlib.util
    import sys

    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_suite(path: Path, name: str, prefix: str):
    """A benchmark suite as one namespace: its script ``path`` (imported as ``name``) and the sibling
    modules it is split into (``<prefix>_*.py`` beside it: its experiments, tables and figures); a
    name the script defines wins."""
    import importlib
    from types import SimpleNamespace

    script = load_script(path, name)
    merged = {}
    for sibling in sorted(path.parent.glob(f"{prefix}_*.py")):
        merged.update(vars(importlib.import_module(sibling.stem)))
    return SimpleNamespace(**{**merged, **vars(script)})


def suite_fixture(script: str, prefix: str | None = None, name: str = "suite"):
    """A module-scoped fixture ``name``: the benchmark script ``benchmarks/<script>`` imported (as its
    stem where that starts with its folder's name, else ``<folder>_<stem>``) with its sibling modules
    ``<prefix>_*.py`` (:func:`load_suite`; without ``prefix``, the script alone: :func:`load_script`)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    folder = path.parent.name
    module = path.stem if path.stem.startswith(folder) else f"{folder}_{path.stem}"

    @pytest.fixture(scope="module", name=name)
    def loaded():
        return load_script(path, module) if prefix is None else load_suite(path, module, prefix)

    return loaded


def planned_configs(plan) -> list:
    """The distinct RunConfigs of a benchmark suite's plan (its nested dicts / lists / tuples of
    RunSpecs), in plan order."""
    found, seen = [], set()

    def walk(node):
        config = getattr(node, "config", None)
        if config is not None and hasattr(config, "model_dump_json"):
            key = config.model_dump_json()
            if key not in seen:
                seen.add(key)
                found.append(config)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(plan)
    return found


def assert_every_planned_run_resolves(plan) -> int:
    """Every run of a suite's plan resolves (fedtune.runtime.resolve_run: task, method, the method x
    task x model capability check, options, profiles): the suite's base recipe with the overlays each
    run adds (configs/benchmarks/) as the suite combines them. Returns how many distinct configs."""
    from fedtune.runtime import resolve_run

    configs = planned_configs(plan)
    assert configs, "the plan holds no run"
    for config in configs:
        resolve_run(config)
    return len(configs)


#: Test modules that start Flower (a Ray instance, SuperLinks, SuperNodes): under ``pytest -n``
#: (``make test``) they share one xdist group, so one worker runs them one after another and two
#: Flower runs never compete for ports, Ray's session folder or the two cores.
FLOWER_MODULES = frozenset(
    {
        "test_flower",
        "test_flower_contract",
        "test_flower_deploy",
        "test_flower_privacy",
        "test_scale",
        "test_secagg",
        "test_tracking_engines",
        "test_plugins",
    }
)


#: The engines every guarantee test runs on (``config.engine``; tests/engines.py): a new engine goes here.
ENGINES = ("embedded", "flower-sim", "flower")
#: The engines whose cases carry the ``deployment`` marker (they start SuperLinks and SuperNodes).
DEPLOYMENTS = ("flower",)


@pytest.fixture(
    params=[pytest.param(e, marks=[pytest.mark.deployment] if e in DEPLOYMENTS else [], id=e) for e in ENGINES]
)
def engine(request) -> str:
    """Each engine of tests/engines.py's ``ENGINES`` in turn: a guarantee test that takes it runs on
    every engine (the loopback deployment's cases marked ``deployment``)."""
    return request.param


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory):
    """The session's runs of tests/engines.py's cases, each made once on its engine
    (:class:`tests.engines.EngineRuns`; in ``$FEDTUNE_TEST_ENGINE_RUNS`` when set, reusing the runs
    an earlier session finished there)."""
    from tests.engines import KEEP_ENV, EngineRuns

    kept = os.environ.get(KEEP_ENV)
    return EngineRuns(Path(kept) if kept else tmp_path_factory.mktemp("engine-runs"))


def pytest_collection_modifyitems(config, items):
    """Flower's modules and every test that runs on each engine (the ``engine`` fixture) join one
    xdist group (:data:`FLOWER_MODULES`; ``--dist loadgroup``): one worker makes the session's
    engine runs once. Tests marked ``gpu`` are deselected (not skipped) where CUDA is absent: a CPU
    run reports them as deselected, never as passed or skipped."""
    import torch

    for item in items:
        module = getattr(item, "module", None)
        if (module is not None and module.__name__.rpartition(".")[2] in FLOWER_MODULES) or "engine" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.xdist_group("flower"))
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def acting_adapter_model(workspace, rank: int = 4):
    """A tiny LM's PEFT model with LoRA B moved away from zero (so the adapter acts) and the
    random LM's query and key weights scaled up 10x: attention at initialization is nearly
    uniform, and a model whose attention barely depends on positions would not show a wrong
    position id or a prompt token that leaks into the loss."""
    import torch

    params = workspace.activate(rank)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for name, p in workspace.model.named_parameters():
            if name.endswith(
                ("q_proj.base_layer.weight", "q_proj.weight", "k_proj.base_layer.weight", "k_proj.weight")
            ):
                p.mul_(10.0)
    return workspace.model.eval()


def assert_moved_alike(state: dict, reference: dict, initial: dict, rtol: float = 0.05) -> None:
    """``state`` holds the same entries as ``reference`` and its float arrays moved from
    ``initial`` as the reference's did, to within ``rtol`` of that movement (bfloat16 rounds each
    update by about 0.4 %): an update that was dropped, or landed under another name, fails.
    Entries whose shape changes over a round (a schedule's history) are left out."""
    import numpy as np

    assert state.keys() == reference.keys()
    floats = [
        k
        for k in reference
        if np.asarray(reference[k]).dtype.kind == "f"
        and k in initial
        and np.shape(initial[k]) == np.shape(reference[k])
    ]
    moved = sum(float(np.sum((np.asarray(reference[k], np.float64) - initial[k]) ** 2)) for k in floats)
    apart = sum(float(np.sum((np.asarray(state[k], np.float64) - reference[k]) ** 2)) for k in floats)
    assert moved > 0 and apart <= rtol**2 * moved, (apart, moved)
