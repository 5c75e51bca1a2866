"""The budgets benchmarks' per-class table (three_classes.py, causal_lm.py): each run's measured
client-rounds and plan.json prediction by device class, averaged over seeds per method and arm."""

from __future__ import annotations

from fedtune.harness import RunSpec, final_accuracy, load_rounds, load_summary
from fedtune.harness.report import run_accuracy
from fedtune.harness.stats import mean, mean_of_last, mean_std
from fedtune.planning.planner import GIB
from fedtune.report import client_rows

#: class -> (memory, upload) as multiples of the largest setting's predicted peak and MB per round; speed
CLASSES = {"phone": (1.15, 0.08, 0.5), "laptop": (2.3, 0.3, 1.0), "workstation": (6.9, 2.0, 2.0)}
LAST = 2
#: per class, averaged over seeds (``*_pred``: the run's plan.json, predicted)
MEANS = ("peak_gib", "compute_s", "mb_up", "trained", "dropped", "peak_gib_pred", "s_pred", "mb_pred")


def class_of(cid: int) -> str:
    return list(CLASSES)[cid % len(CLASSES)]


def class_costs(spec: RunSpec) -> dict[str, dict]:
    """Per class, over the run's client-rounds: how many trained (their fit measured, kept or then
    dropped as over its memory) and how many were dropped (any reason), and the means over the
    trained ones of the measured peak (GiB), compute seconds and MB up."""
    acc = {k: {"trained": 0, "dropped": 0, "peak": [], "s": [], "mb": []} for k in CLASSES}
    for line in load_rounds(spec):
        for c in line.get("clients", []):
            a = acc[class_of(c)]
            a["dropped"] += str(c) in line.get("dropped", {})
            peak = line.get("client_peak_bytes", {}).get(str(c))
            if peak is None:  # never trained (it did not answer)
                continue
            a["trained"] += 1
            a["peak"].append(peak / GIB)
            a["s"].append(line["client_compute_s"].get(str(c), 0.0))
            a["mb"].append(line["client_bytes_up"].get(str(c), 0) / 1e6)
    out = {}
    for k, a in acc.items():
        means = {"peak_gib": mean(a["peak"]), "compute_s": mean(a["s"]), "mb_up": mean(a["mb"])}
        out[k] = {
            "trained": a["trained"],
            "dropped": a["dropped"],
            **means,
            "peak_gib_max": max(a["peak"], default=None),
        }
    return out


def class_predictions(spec: RunSpec) -> dict[str, dict]:
    """Per class, the run's plan.json prediction (the mean over the class's clients) of the peak
    (GiB), seconds and MB up per round."""
    planned = client_rows(spec.run_dir, []) or []
    keys = ("peak_gib_pred", "s_pred", "mb_pred")
    return {
        k: {key: mean([r.predicted[i] for r in planned if r.device_class == k]) for i, key in enumerate(keys)}
        for k in CLASSES
    }


def rows(runs: list[RunSpec], settings: dict) -> list[dict]:
    """One row per method and arm of ``settings``: accuracy and held-out loss over seeds, and per
    class the setting and the means of :data:`MEANS`."""
    out = []
    for method, by_arm in settings.items():
        for arm, setting in by_arm.items():
            mine = [s for s in runs if s.labels["method"] == method and s.labels["arm"] == arm]
            done = [s for s in mine if load_summary(s)]
            m, sd, n = final_accuracy(mine, LAST)
            loss = mean_std([x for s in mine if (x := mean_of_last(load_rounds(s), LAST, "loss")) is not None])
            preds = [class_predictions(s) for s in done]
            costs = [{k: {**c[k], **p[k]} for k in CLASSES} for c, p in zip(map(class_costs, done), preds)]
            per_class = {
                k: {
                    "setting": setting[k],
                    **{f: mean([c[k][f] for c in costs]) for f in MEANS},
                    "peak_gib_max": max((x for c in costs if (x := c[k]["peak_gib_max"]) is not None), default=None),
                }
                for k in CLASSES
            }
            out.append({"method": method, "arm": arm, "accuracy_mean": m, "accuracy_std": sd, "finished": n,
                        "loss_mean": loss[0], "loss_std": loss[1], "classes": per_class})  # fmt: skip
    return out


def paired(runs: list[RunSpec], field: str = "accuracy") -> list[dict]:
    """Per method, the planned arm minus each other arm, paired by seed (the seeds both finished): the
    mean difference of each run's mean of its last :data:`LAST` evaluations (accuracy in points;
    ``field="loss"``: nats), its standard error (sample std / sqrt(n)) and n. A difference is resolved
    where it is over twice its SE."""

    def value(s: RunSpec) -> float | None:
        if field == "accuracy":
            a = run_accuracy(s, LAST)
            return None if a is None else 100 * a
        return mean_of_last(load_rounds(s), LAST, field) if load_summary(s) else None

    by = {(s.labels["method"], s.labels["arm"], s.labels["seed"]): value(s) for s in runs}
    out = []
    for method, arm in dict.fromkeys((m, a) for m, a, _ in by if a != "planned"):
        diffs = []
        for (m, a, seed), v in by.items():
            planned = by.get((m, "planned", seed))
            if (m, a) == (method, arm) and v is not None and planned is not None:
                diffs.append(planned - v)
        mu, sd = mean_std(diffs)
        se = None if sd is None or len(diffs) < 2 else sd / len(diffs) ** 0.5
        out.append({"method": method, "versus": arm, "diff_mean": mu, "diff_se": se, "n": len(diffs)})
    return out


def paired_lines(table: list[dict], unit: str = "points") -> list[str]:
    """:func:`paired`'s rows as a markdown table, with whether each difference is over 2 SE."""
    header = ["method", "planned minus", f"mean ({unit})", "SE", "n", "resolved (mean beyond 2 SE)"]
    body = [
        [r["method"], r["versus"], cell(r["diff_mean"], "+.2f"), cell(r["diff_se"], ".2f"), str(r["n"]),
         "–" if r["diff_se"] is None else ("yes" if abs(r["diff_mean"]) > 2 * r["diff_se"] else "no")]
        for r in table
    ]  # fmt: skip
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(row)} |" for row in body)]


def paired_section(runs: list[RunSpec], pairs: list[dict], loss: bool) -> list[str]:
    """The README's paired differences: ``pairs`` (:func:`paired` of ``runs``' accuracy), and with
    ``loss`` the held-out loss's too."""
    out = ["Paired by seed: the planned arm's accuracy minus each other arm's (points), mean and standard error "
           "over the seeds both finished.", "", *paired_lines(pairs), ""]  # fmt: skip
    return out + ([*paired_lines(paired(runs, "loss"), "nats; negative: planned lower"), ""] if loss else [])


COST_HEADER = ["method", "arm", "class", "setting", "trained", "dropped"]
COST_HEADER += ["peak GiB pred / mean / max", "s pred / meas", "MB up pred / meas"]


def cell(v, spec=".3f"):
    return "–" if v is None else format(v, spec)


def accuracy(row: dict, field: str = "accuracy", spec: str = ".2f") -> str:
    if row[f"{field}_mean"] is None:
        return "pending"
    return f"{row[f'{field}_mean']:{spec}} ± {row[f'{field}_std']:{spec}} (n={row['finished']})"


def ratio(x: dict) -> float:
    """A class's measured over predicted mean peak (0 where either is missing)."""
    return x["peak_gib"] / x["peak_gib_pred"] if x["peak_gib"] and x["peak_gib_pred"] else 0
