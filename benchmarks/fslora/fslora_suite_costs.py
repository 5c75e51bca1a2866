"""The FSLoRA suite's cost model: per-step, evaluation and setup seconds, measured here by ``--calibrate``."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from fslora_suite_experiments import METHODS, OVERLAYS, REPO, TEST_SET_SIZES, Scale, lora

from fedtune.config import RunConfig
from fedtune.harness import (
    Costs,
    calibrate,
    probe,
)
from fedtune.process import setup_process

# -- cost model and calibration ---------------------------------------------------------------

# What --calibrate measured on the 2-core VM (one torch thread; load average ~3 from other jobs),
# used when <out>/calibration.json is absent.
DEFAULT_CALIBRATION = {
    "minilm": {
        "sst2": {"step_s": 0.189, "eval_s_per_example": 0.0091, "run_setup_s": 1.7},
        "agnews": {"step_s": 0.534, "eval_s_per_example": 0.0150, "run_setup_s": 5.1},
        "method_client_overhead_s": {
            "fedit": 0.17,
            "fslora": 0.16,
            "heterolora": 0.35,
            "flexlora": 0.26,
            "fedstacklora": 0.35,
        },
    },
}


def load_calibration(out: Path) -> tuple[dict, str]:
    path = out / "calibration.json"
    if path.is_file():
        return json.loads(path.read_text()), os.path.relpath(path, REPO)
    return DEFAULT_CALIBRATION, "built-in defaults (measured for minilm; run --calibrate)"


def test_size(config: RunConfig) -> int:
    full = TEST_SET_SIZES.get(config.data.name, 2000)
    return min(full, config.data.max_test_samples or full)


def run_costs(config: RunConfig, calibration: dict) -> Costs:
    """The calibrated costs of ``config``'s model (else minilm's), data set (else sst2's) and method."""
    model = calibration.get(config.model.name) or calibration.get("minilm") or DEFAULT_CALIBRATION["minilm"]
    data = model.get(config.data.name) or model["sst2"]
    return Costs(
        data["step_s"],
        data["eval_s_per_example"],
        data["run_setup_s"],
        model["method_client_overhead_s"].get(config.method, 0.1),
    )


def calibrate_here(scale: Scale, out: Path) -> dict:
    """Measure, with one torch thread, each data set's step, evaluation and setup costs (FSLoRA's
    Table 5.1 config) and each method's per-client overhead beyond its steps (first data set), with
    short runs; merge them into ``<out>/calibration.json`` under the model's name."""
    setup_process(1)
    data_sets = sorted(set(scale.table_data) | set(scale.fig_data))
    model: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for data in data_sets:
            costs = calibrate(scale.config(data, "fslora", *lora(scale.rank), *OVERLAYS["hetero"]), Path(tmp))
            model[data] = {
                "step_s": costs.step_s,
                "eval_s_per_example": costs.eval_s_per_example,
                "run_setup_s": costs.run_setup_s,
            }
            print(
                f"calibration {data}: step {costs.step_s:.3f} s, evaluation {costs.eval_s_per_example:.4f} s "
                f"per example, run setup {costs.run_setup_s:.1f} s",
                flush=True,
            )
        overhead = model["method_client_overhead_s"] = {}
        for method in METHODS:
            extra = lora(8) if method == "fedit" else [*lora(scale.rank), *OVERLAYS["hetero"]]
            client_s = probe(scale.config(data_sets[0], method, *extra), Path(tmp), 2).client_s
            overhead[method] = max(0.0, client_s - 2 * model[data_sets[0]]["step_s"])
            print(f"calibration {method}: {overhead[method]:.3f} s per client and round beyond its steps", flush=True)
    path = out / "calibration.json"
    calibration = json.loads(path.read_text()) if path.is_file() else {}
    calibration.update(
        {
            scale.base.model.name: model,
            "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
            "threads": 1,
            "loadavg_1min": os.getloadavg()[0],
            "cpu_count": os.cpu_count(),
        }
    )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=2) + "\n")
    return calibration
