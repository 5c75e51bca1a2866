"""The table ``fedtune eval`` prints: per set its size, each accuracy with its binomial standard
error, any other metric with a standard error (lm-eval's: ``exact_match``, ...), ROUGE-L and the
response loss; the commonsense average last."""

from __future__ import annotations

from rich.table import Table

from fedtune.trained.evaluate import ACCURACIES


def _pct(row: dict, key: str) -> str:
    if key not in row:
        return "–"
    return f"{100 * row[key]:.1f} ± {100 * row[f'{key}_se']:.1f}"


def eval_table(result: dict) -> Table:
    """A rich table of an :func:`~fedtune.trained.evaluate.evaluate` result."""
    rows, avg = result["sets"], result["average"]
    shown = [k for k in ACCURACIES if any(k in r for r in rows.values())]
    other = sorted({k for r in rows.values() for k in r if f"{k}_se" in r and k not in ACCURACIES})  # lm-eval's
    protocol = result["protocol"]["name"]
    table = Table(title=f"{result['target']}, protocol {protocol} (accuracy % ± standard error)")
    table.add_column("set")
    table.add_column("n", justify="right")
    for key in shown:
        table.add_column(key, justify="right")
    for key in [*other, "rouge_l", "loss"]:
        table.add_column(key, justify="right")
    for name, row in rows.items():
        rouge = f"{row['rouge_l']:.4f}" if "rouge_l" in row else "–"
        loss = f"{row['loss']:.4f}" if "loss" in row else "–"
        extra = [f"{row[k]:.4f} ± {row[f'{k}_se']:.4f}" if k in row else "–" for k in other]
        table.add_row(name, str(row["n"]), *(_pct(row, k) for k in shown), *extra, rouge, loss)
    if avg.get("sets", 0) > 1:
        table.add_row(f"average ({avg['sets']} sets)", "", *(_pct(avg, k) for k in shown), *[""] * len(other), "", "")
    return table


def paired_table(result: dict) -> Table:
    """The run - base difference per set (``--baseline``): each metric's mean per-question
    difference with its paired standard error (accuracies and ROUGE-L in points)."""
    rows, avg = result["paired"]["sets"], result["paired"]["average"]
    shown = [k for k in ("acc", "acc_norm", "gen_acc", "rouge_l", "loss") if any(k in r for r in rows.values())]
    table = Table(title=f"run - base on protocol {result['protocol']['name']} (paired difference ± standard error)")
    table.add_column("set")
    table.add_column("n", justify="right")
    for key in shown:
        table.add_column(key, justify="right")

    def cell(row: dict, key: str) -> str:
        if key not in row:
            return "–"
        scale, digits = (1, 4) if key == "loss" else (100, 1)
        return f"{scale * row[key]:+.{digits}f} ± {scale * row[f'{key}_se']:.{digits}f}"

    for name, row in rows.items():
        table.add_row(name, str(row["n"]), *(cell(row, k) for k in shown))
    if avg.get("sets", 0) > 1:
        table.add_row(f"average ({avg['sets']} sets)", "", *(cell(avg, k) for k in shown))
    return table
