"""What the planner prints and writes, for every method with a planner: issue 53's check that moving
each method's plan next to its code changes no plan.

``python benchmarks/budgets/plan_outputs.py --out FILE`` plans seconds-long configs
(:func:`fedtune.testing.tiny_config`, 6 clients) of every planned method on its task kinds (a LoRA
method on text classification and the instruction task, float32 and bfloat16; a CNN's measured
knob; the sub-model methods on few-shot and image classification; FedPFT and FedOT on text), first
without budgets, then with six budgets cut from the first plan's largest setting (room to spare,
70 % and 40 % of its memory with a deadline, 30 % of its upload, nothing, and half speed), and
writes, per case, ``fedtune plan``'s table (:func:`~fedtune.planning.planner.format_plan`), the
run folder's ``plan.json`` (:func:`~fedtune.planning.planner.plan_json`), the planned profiles and
each profile's refusal (:func:`~fedtune.planning.planner.refusal`). ``--compare A B`` names the
cases that differ and exits 1 on any.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

SHORT = ("options.distill_steps=2", "options.distill_batch_size=8", "options.distill_samples=64")
CASES = [(m, "text-classification", ()) for m in ("heterolora", "flexlora", "fedstacklora", "fslora", "fedit")]
CASES += [(m, "text-classification", ()) for m in ("fedpetuning", "local")]
CASES += [(m, "instruction", ()) for m in ("commit", "fedit", "heterolora")]
CASES += [("fedit", "text-classification", ("model.dtype=bfloat16",))]
CASES += [("heterolora", "instruction", ("model.dtype=bfloat16",)), ("fslora", "causal-lm", ())]
CASES += [(m, "few-shot", ()) for m in ("rabo", "rafbo", "static", "fedrolex", "fiarse", "fedmbo")]
CASES += [(m, "image-classification", ()) for m in ("static", "fedmbo")]
CASES += [(m, "image-classification:conv-lora", ()) for m in ("fedit", "heterolora")]
CASES += [("fedpft", "text-classification", (*SHORT, "options.retained_layers=[]"))]
CASES += [("fedot", "text-classification", (*SHORT, "options.adapter_bottom=0", "options.adapter_top=1"))]


def plan_case(method: str, kind: str, extra: tuple[str, ...]) -> dict:
    """One case's tables, plan.json, planned profiles and refusals (or its one-line error)."""
    from fedtune.errors import FedtuneError
    from fedtune.planning.planner import GIB, format_plan, plan_budgets, plan_json, refusal
    from fedtune.runtime import RunContext, resolve_run
    from fedtune.testing import tiny_config

    kind, _, variant = kind.partition(":")
    with tempfile.TemporaryDirectory() as tmp:

        def context(*more: str):
            config = tiny_config(method, kind, tmp, *extra, "federation.num_clients=6", *more, variant=variant)
            return RunContext(resolve_run(config))

        try:
            free = plan_budgets(context(), always=True)
            first = free.clients[0]
            peak, seconds, upload = first.peak_bytes / GIB, first.seconds, first.upload_mb
            budgets = [
                {"memory_gib": peak * 1.1}, {"memory_gib": peak * 0.7},
                {"memory_gib": peak * 0.4, "deadline_s": seconds * 0.6}, {"bandwidth_mb": max(upload * 0.3, 1e-9)},
                {"memory_gib": peak * 1e-4}, {"memory_gib": peak * 2, "speed": 0.5, "deadline_s": seconds * 1.5},
            ]  # fmt: skip
            rows = ", ".join("{" + ", ".join(f"{k}={v!r}" for k, v in b.items()) + "}" for b in budgets)
            budgeted = context(f"federation.profiles=[{rows}]")
            plan = plan_budgets(budgeted)
        except FedtuneError as exc:
            return {"error": str(exc)}
    return {
        "free": format_plan(free), "free_json": plan_json(free), "plan": format_plan(plan), "json": plan_json(plan),
        "profiles": [p.model_dump() for p in plan.profiles],
        "refusals": [refusal(budgeted, p) for p in budgeted.run.profiles],
    }  # fmt: skip


def compare(a: Path, b: Path) -> int:
    """Print the cases compared, identical and differing (named); 1 on any difference."""
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    keys = left.keys() | right.keys()
    differ = sorted(k for k in keys if left.get(k) != right.get(k))
    print(f"{len(keys)} cases compared, {len(keys) - len(differ)} identical, {len(differ)} differing")
    for key in differ:
        print(f"differs: {key}")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON file to write")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="two files --out wrote")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("--out or --compare")
    out = {}
    for method, kind, extra in CASES:
        key = f"{method}/{kind}/{','.join(extra)}"
        out[key] = plan_case(method, kind, extra)
        print(f"{key}: {out[key].get('error', 'planned')}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
