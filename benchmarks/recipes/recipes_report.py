"""The recipes benchmark's report: one row per recipe and data set against its reference rate (markdown and JSON)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from recipes_runs import LAST, QUICK_DATA, SIMILAR, Options, similar_sets

from fedtune import harness


def row_values(spec: harness.RunSpec) -> dict[str, Any]:
    """The finished run's figures (fractions), or Nones."""
    summary = harness.load_summary(spec)
    if summary is None:
        return {
            "done": False,
            "rounds": None,
            "first": None,
            "final": None,
            "mean_last": None,
            "evaluations": 0,
            "reference": None,
            "reference_name": None,
            "test_examples": None,
            "clearly_above": None,
            "margin": None,
            "wall_s": None,
        }
    rounds = harness.load_rounds(spec)
    evaluated = [r for r in rounds if r.get("accuracy") is not None]
    mean_last = harness.mean_of_last(rounds, LAST)
    ok, margin = harness.clearly_above(
        mean_last, summary.get("final_accuracy"), summary.get("majority_accuracy"), summary.get("test_examples")
    )
    return {
        "done": True,
        "rounds": len(rounds),
        "first": evaluated[0]["accuracy"] if evaluated else None,
        "final": summary.get("final_accuracy"),
        "mean_last": mean_last,
        "evaluations": min(LAST, len(evaluated)),
        "reference": summary.get("majority_accuracy"),
        "reference_name": summary.get("reference_name", "majority-class rate"),
        "test_examples": summary.get("test_examples"),
        "clearly_above": ok,
        "margin": margin,
        "wall_s": summary.get("wall_s"),
    }


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.2f}"


def verdict_text(v: dict[str, Any]) -> str:
    if not v["done"]:
        return "pending"
    return ("**yes**" if v["clearly_above"] else "**no**") + f" (needs +{100 * v['margin']:.1f})"


def table_rows(plan) -> list[dict[str, Any]]:
    """One entry per recipe (own run, with its similar-data runs), in recipe order."""
    rows = []
    for spec in plan["own"]:
        similar = [
            s
            for s in plan["similar"]
            if s.labels["recipe"] == spec.labels["recipe"] and s.labels["seed"] == spec.labels["seed"]
        ]
        rows.append({"spec": spec, "own": row_values(spec), "similar": [(s, row_values(s)) for s in similar]})
    return rows


def markdown(plan, command: str, options: Options, selected: list[str], out: Path) -> str:
    rows = table_rows(plan)
    changed = options.overrides() + (QUICK_DATA if options.quick else [])
    lines = [
        "# Do the recipes learn?",
        "",
        "Every recipe in `configs/*.toml` run as written on its own data (and on similar data), against "
        "the reference rate its task names: the test set's majority class (text, image, audio, paired), "
        "chance 1/N (few-shot), the majority answer (instruction).",
        "",
        *harness.produced_by(command),
        (
            "**Changed from the recipes:** "
            + ", ".join(f"`{c}`" for c in changed)
            + " on every run"
            + (" (rounds: a cap; a recipe written shorter keeps its own)" if options.rounds is not None else "")
            + "."
            if changed
            else "**Every recipe ran exactly as written** (rounds, seed, data, model, method)."
        ),
        "",
        f"**Clearly above** = the mean of the last {LAST} evaluations beats the reference by at least "
        f"max({100 * harness.MIN_MARGIN:g} points, {harness.Z:g} binomial standard errors of an accuracy at the "
        "reference rate on that test set, sqrt(p (1 - p) / n)), *and* the final evaluation alone is above the "
        "reference. The needed margin is printed with each verdict. *First eval* is the run's first "
        "evaluation (after round 1 or its first evaluated round): where it is already far above the reference "
        "(few-shot: nearest-prototype classification on barely trained features), beating the reference says "
        "little about learning, and the gain over the first evaluation is the better reading.",
        "",
        "## Results",
        "",
    ]
    cols = [
        "recipe",
        "task",
        "method",
        "rounds run / written",
        "data",
        "first eval (%)",
        "final (%)",
        f"mean of last {LAST} (%)",
        "reference (%)",
        "clearly above?",
        "similar data",
        "final (%)",
        f"mean of last {LAST} (%)",
        "reference (%)",
        "clearly above?",
    ]
    body = []
    for r in rows:
        s, v = r["spec"], r["own"]
        ref = "–" if v["reference"] is None else f"{pct(v['reference'])} ({v['reference_name']})"
        sim = r["similar"]
        why = "no similar set" if not similar_sets(Path(s.labels["path"])) else "skipped: not cheap"
        sim_cells = (
            [why, "–", "–", "–", "–"]
            if not sim
            else [
                "<br>".join(f"{x.labels['data']}" for x, _ in sim),
                "<br>".join(pct(w["final"]) for _, w in sim),
                "<br>".join(pct(w["mean_last"]) for _, w in sim),
                "<br>".join(pct(w["reference"]) for _, w in sim),
                "<br>".join(verdict_text(w) if "similar" in selected else "not run" for _, w in sim),
            ]
        )
        body.append(
            [
                s.labels["recipe"],
                s.labels["task"],
                s.labels["method"],
                f"{v['rounds'] if v['rounds'] is not None else '–'} / {s.labels['written_rounds']}",
                s.labels["data"],
                pct(v["first"]),
                pct(v["final"]),
                pct(v["mean_last"]),
                ref,
                verdict_text(v),
                *sim_cells,
            ]
        )
    lines += harness.table_lines(cols, body)
    own = [r["own"] for r in rows if r["own"]["done"]]
    sims = [w for r in rows for _, w in r["similar"] if w["done"]]
    lines += [
        "",
        f"Own data: {sum(bool(v['clearly_above']) for v in own)} of {len(own)} finished recipes clearly "
        f"above their reference ({len(rows) - len(own)} pending). Similar data: "
        f"{sum(bool(w['clearly_above']) for w in sims)} of {len(sims)} finished runs clearly above.",
        "",
    ]
    below = [r["spec"].labels["recipe"] for r in rows if r["own"]["done"] and not r["own"]["clearly_above"]]
    if below:
        lines += ["**Not clearly above on their own data:** " + ", ".join(f"`{b}`" for b in below) + ".", ""]
    lines += [
        f"Similar-data runs only for recipes whose own run is estimated at most {options.similar_max_minutes:g} "
        'min on one core ("where cheap"); the others say "skipped: not cheap". '
        "They change only `data.name` (and subsample a large test set: "
        + "; ".join(
            f"{t}/{d} -> " + ", ".join(f"{n} ({' '.join(x) or 'as written'})" for n, x in v)
            for (t, d), v in SIMILAR.items()
        )
        + ").",
        "",
    ]
    lines += [
        "## Runs",
        "",
        *harness.table_lines(
            ["run", "folder", "rounds", "evaluations in the mean", "test examples", "wall s"],
            [
                [
                    s.name,
                    f"`{os.path.relpath(s.run_dir, out)}`",
                    str(v["rounds"] or "–"),
                    str(v["evaluations"]),
                    str(v["test_examples"] or "–"),
                    "–" if v["wall_s"] is None else f"{v['wall_s']:.0f}",
                ]
                for s, v in [(r["spec"], r["own"]) for r in rows] + [x for r in rows for x in r["similar"]]
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def json_report(plan, command: str, options: Options, out: Path) -> dict:
    def entry(spec: harness.RunSpec, v: dict[str, Any]) -> dict:
        return {
            "run": spec.name,
            "recipe": spec.labels["recipe"],
            "task": spec.labels["task"],
            "method": spec.labels["method"],
            "data": spec.labels["data"],
            "own_data": spec.labels["own"],
            "written_rounds": spec.labels["written_rounds"],
            **{k: v[k] for k in v if k != "done"},
            "finished": v["done"],
            "run_dir": os.path.relpath(spec.run_dir, out),
        }

    rows = table_rows(plan)
    return {
        "command": command,
        "changed": options.overrides() + (QUICK_DATA if options.quick else []),
        "last": LAST,
        "min_margin": harness.MIN_MARGIN,
        "z": harness.Z,
        "runs": [entry(r["spec"], r["own"]) for r in rows] + [entry(s, w) for r in rows for s, w in r["similar"]],
    }


def write_reports(plan, out: Path, command: str, options: Options, selected: list[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipes.md").write_text(markdown(plan, command, options, selected, out), encoding="utf-8")
    (out / "recipes.json").write_text(
        json.dumps(json_report(plan, command, options, out), indent=2) + "\n", encoding="utf-8"
    )
    return [out / "recipes.md", out / "recipes.json"]
