"""The privacy-utility benchmark's ``secagg`` experiment read back: each way's MB per client of its two
one-round runs on the Flower simulation (plain and SecAgg+), ``secagg.json`` and the report's section."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from privacy_experiments import noised_coordinates

from fedtune.checkpoint import load_state
from fedtune.harness import RunSpec, load_rounds, load_summary, produced_by, table_lines


def client_bytes(spec: RunSpec) -> dict | None:
    """The finished one-round run's bytes per client: the mean over its clients of
    ``client_bytes_up`` / ``client_bytes_down`` (in MB), and how many clients that is."""
    rounds = load_rounds(spec)
    if not rounds:
        return None
    up, down = (list(rounds[0][f"client_bytes_{way}"].values()) for way in ("up", "down"))
    return {
        "clients": len(up),
        "mb_up_per_client": sum(up) / len(up) / 1e6,
        "mb_down_per_client": sum(down) / len(down) / 1e6,
        "wall_s": (load_summary(spec) or {}).get("wall_s"),
    }


def secagg_result(specs: list[RunSpec], command: str) -> dict | None:
    """``secagg.json``: both runs' bytes per client, SecAgg+'s ratios over plain, its options, and the
    largest difference between the two global adapters after the round against SecAgg+'s bound on
    the uniform mean, 2c/T (each coordinate of the sum within k (2c/T) W, W = 1, divided by k:
    ``fedtune/engines/flower/secagg.py``); None until both runs are finished."""
    plain, secure = specs
    a, b = client_bytes(plain), client_bytes(secure)
    if a is None or b is None:
        return None
    fed, c, sa = secure.config.federation, secure.config, secure.config.secure_aggregation
    paths = [s.run_dir / "checkpoint.npz" for s in specs]
    diff = None
    if all(p.is_file() for p in paths):
        x, y = (load_state(p)["global"] for p in paths)
        diff = max(float(np.max(np.abs(np.asarray(x[k], np.float64) - np.asarray(y[k], np.float64)))) for k in x)
    return {
        "what": (
            f"one round of the suite's FedIT recipe without DP (model {c.model.name}, rank {c.model.lora_rank}, "
            f"{c.train.local_steps} local steps) on engine {c.engine}, {fed.num_clients} clients all sampled, "
            "with secure_aggregation.enabled = true (SecAgg+) and without"
        ),
        "command": command,
        "adapter_coordinates": noised_coordinates(plain),
        "secagg_options": {
            "clipping_range": sa.clipping_range,
            "quantization_range": sa.quantization_range,
            "modulus_range": sa.modulus_range,
            "num_shares": sa.shares(fed.sample_size()),
            "threshold": sa.reconstruction_threshold(sa.shares(fed.sample_size())),
        },
        "plain": a,
        "secagg": b,
        "ratio_up": b["mb_up_per_client"] / a["mb_up_per_client"],
        "ratio_down": b["mb_down_per_client"] / a["mb_down_per_client"],
        "max_abs_difference": diff,
        "quantization_bound": 2 * sa.clipping_range / sa.quantization_range,
    }


def write_secagg(specs: list[RunSpec], out: Path, command: str) -> list[Path]:
    """``out/secagg.json`` once both runs are finished (:func:`secagg_result`; the report quotes it),
    with its line printed; the files written (none while a run is unfinished)."""
    result = secagg_result(specs, command)
    if result is None:
        print("secagg: unfinished, no secagg.json")
        return []
    out.mkdir(parents=True, exist_ok=True)
    (out / "secagg.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"secagg: MB up per client {result['plain']['mb_up_per_client']:.4f} plain, "
        f"{result['secagg']['mb_up_per_client']:.4f} SecAgg+ ({result['ratio_up']:.2f}x)"
    )
    return [out / "secagg.json"]


def secagg_lines(out: Path) -> list[str]:
    """The report's SecAgg+ section, from ``out/secagg.json`` (none without it)."""
    path = out / "secagg.json"
    if not path.is_file():
        return []
    r = json.loads(path.read_text())
    o = r["secagg_options"]
    diff = "not measured" if r["max_abs_difference"] is None else f"{r['max_abs_difference']:.2g}"
    return [
        "## SecAgg+ byte overhead",
        "",
        f"{r['what'][0].upper()}{r['what'][1:]}; SecAgg+ options c = {o['clipping_range']:g}, "
        f"T = {o['quantization_range']}, M = {o['modulus_range']}, {o['num_shares']} shares, threshold "
        f"{o['threshold']}. Bytes per client in the round (its fedtune messages, plus every SecAgg+ payload: "
        "keys, encrypted shares, the masked int64 vector).",
        "",
        *produced_by(r["command"]),
        *table_lines(
            ["aggregation", "MB up / client", "MB down / client"],
            [
                [name, f"{r[key]['mb_up_per_client']:.4f}", f"{r[key]['mb_down_per_client']:.4f}"]
                for name, key in (("plain", "plain"), ("SecAgg+", "secagg"))
            ],
        ),
        "",
        f"SecAgg+ over plain: {r['ratio_up']:.2f}x up, {r['ratio_down']:.2f}x down (adapter: "
        f"{r['adapter_coordinates']:,} coordinates). The two runs' global adapters after the round differ by at "
        f"most {diff} (SecAgg+'s quantization bound on the mean: 2c/T = {r['quantization_bound']:.2g}). Central "
        "DP cannot run with SecAgg+; local DP can and adds no bytes, so under SecAgg+ the table's MB up / client "
        "would grow by about this factor (the key and share payloads are a small fixed part per client and round).",
        "",
    ]
