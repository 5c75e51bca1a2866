"""Every file of ``configs/`` is a promise to users, so every one is tested (globbed at collection:
a new recipe is covered without editing this file):

- a recipe (``configs/*.toml``) loads and resolves (:func:`fedtune.runtime.resolve_run`: the task
  kind and the task's default data and model names, the method, the method x task x model
  capability check, the task's and the method's options, the client profiles);
- a suite's base recipe (``configs/benchmarks/<suite>.toml``) and its named overlays
  (``<suite>-overlays.toml``) are partial: a suite adds each run's method and settings. Here the
  base loads (every key and value valid) and every overlay parses; the runs they make, the base
  with its overlays as the suite combines them, each resolve in the suite's own test
  (``test_every_planned_run_resolves`` in tests/test_*_suite.py and tests/test_fslora_sweep.py);
- a cheap recipe also runs one tiny round end to end (its own model and method, the data shrunk by
  :func:`shrink`). Cheap means: not a causal-LM recipe (``model.name = "smollm2"``: 135M
  parameters, 15-45 s for one round here, covered by the instruction and CoMMIT tests on tiny-llama).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedtune.config import load_config
from fedtune.harness import read_overlays
from fedtune.runtime import resolve_run

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(CONFIGS.glob("*.toml"))
SUITE_BASES = sorted(p for p in (CONFIGS / "benchmarks").glob("*.toml") if not p.stem.endswith("-overlays"))
OVERLAY_FILES = sorted((CONFIGS / "benchmarks").glob("*-overlays.toml"))
EXPENSIVE_MODELS = {"smollm2"}


def base_of(overlays: Path) -> Path:
    """``<suite>-overlays.toml`` -> ``<suite>.toml``."""
    return overlays.with_name(overlays.name.replace("-overlays.toml", ".toml"))


def shrink(config) -> list[str]:
    """Overrides that make ``config`` one tiny round: one local step on at most 4 sampled clients, few
    examples (in the task's own terms: few-shot draws episodes, the paired task sizes its pool with
    task.aligned/unaligned; short texts), and a short pre-FL distillation for FedPFT and FedOT."""
    out = ["rounds=1", "eval_every=1", "train.local_steps=1"]
    fed = config.federation
    if fed.fraction is None and fed.sample_size() > 4:  # fedstacklora.toml trained 20 clients a round
        out.append("federation.clients_per_round=4")
    kind = config.task.kind
    if kind == "few-shot":
        out += ["task.eval_episodes=10", "task.q_query=2"]
    elif kind == "paired-multimodal":
        out += ["task.aligned=8", "task.unaligned=24", "data.max_test_samples=40"]
    else:  # local.toml evaluates each of its 20 clients' models
        out += ["data.max_train_samples=200", "data.max_test_samples=20"]
    if kind == "text-classification":
        out.append("data.max_length=32")
    if config.method in ("fedpft", "fedot"):  # both distill a proxy before FL (fedot.toml: 100 steps)
        out += ["options.distill_steps=2", "options.distill_samples=64"]
    return out


def test_every_config_file_is_a_recipe_a_suite_base_or_an_overlay_file():
    """The globs above cover all of configs/ (a file elsewhere would go untested)."""
    assert set(CONFIGS.rglob("*.toml")) == {*RECIPES, *SUITE_BASES, *OVERLAY_FILES}
    assert RECIPES and SUITE_BASES and OVERLAY_FILES
    for overlays in OVERLAY_FILES:
        assert base_of(overlays).is_file(), f"{overlays.name} has no base recipe {base_of(overlays).name}"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_resolves(path):
    run = resolve_run(load_config(path))
    assert run.config.data.name and run.config.model.name  # the task's defaults filled in
    assert run.method.name == run.config.method and len(run.profiles) == run.config.federation.num_clients


@pytest.mark.parametrize("path", SUITE_BASES, ids=lambda p: p.name)
def test_suite_base_recipe_loads_and_its_overlays_parse(path):
    load_config(path)
    overlays = path.with_name(path.stem + "-overlays.toml")
    if overlays.is_file():
        assert all(read_overlays(overlays).values())  # every named overlay sets something


CHEAP = [p for p in RECIPES if load_config(p).model.name not in EXPENSIVE_MODELS]


@pytest.mark.parametrize("path", CHEAP, ids=lambda p: p.name)
def test_cheap_recipe_runs_one_tiny_round(path, tmp_path):
    from fedtune.run import run_experiment

    config = load_config(path)
    summary = run_experiment(load_config(path, [*shrink(config), f"output_dir={tmp_path}"]))
    assert summary["rounds"] == 1 and summary["method"] == config.method
    assert summary["final_accuracy"] is not None and 0.0 <= summary["final_accuracy"] <= 1.0
