"""Live per-round display of a run (round, clients, losses, accuracy, MB up/down)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fedtune.config import RunConfig
from fedtune.engines.rounds import RoundRecord

MB = 1e6


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}%"


def _drops(rec: RoundRecord) -> str:
    """`` dropped 2 (client 3: why; client 5: why)`` when clients were dropped this round."""
    if not rec.dropped:
        return ""
    shown = "; ".join(f"client {cid}: {why}" for cid, why in list(rec.dropped.items())[:3])
    more = f"; +{len(rec.dropped) - 3} more" if len(rec.dropped) > 3 else ""
    return f"  dropped {len(rec.dropped)} ({shown}{more})"


class RoundPrinter:
    """Prints one line per round as it ends, and a final summary."""

    def __init__(self, console: Console, config: RunConfig) -> None:
        self.console = console
        self.config = config
        self.up = self.down = 0

    def start(self, context) -> None:
        c = self.config = context.config  # resolved: the task's default data and model named
        self.console.print(
            f"[bold]{c.run_name}[/]: method {c.method}, task {c.task.kind}, data {c.data.name}, model {c.model.name}, "
            f"{c.federation.num_clients} clients ({c.federation.sample_size()} per round), {c.rounds} rounds",
            soft_wrap=True,
        )

    def __call__(self, rec: RoundRecord) -> None:
        m = rec.metrics
        if rec.private:  # only what the privacy mechanism releases (RoundRecord.to_json)
            clip = f"  clip {m['clip']:.4g}" if m.get("clip") is not None else ""
            self.console.print(
                f"round {rec.round:>3}/{self.config.rounds}  acc {_pct(m.get('accuracy'))}  "
                f"epsilon {m['epsilon']:.4g}{clip}",
                highlight=False,
                soft_wrap=True,
            )
            return
        self.up += sum(rec.client_bytes_up.values())
        self.down += sum(rec.client_bytes_down.values())
        loss = m.get("train_loss")
        self.console.print(
            f"round {rec.round:>3}/{self.config.rounds}  clients {len(rec.clients):>3}  "
            f"train loss {'–' if loss is None else f'{loss:.4f}'}  acc {_pct(m.get('accuracy'))}  "
            f"up {self.up / MB:8.3f} MB  down {self.down / MB:8.3f} MB  {rec.wall_s:6.1f}s"
            + (f"  epsilon {m['epsilon']:.4g}" if m.get("epsilon") is not None else "")  # privacy.mode: spent so far
            + _drops(rec),
            highlight=False,
            soft_wrap=True,
        )

    def finish(self, summary: dict) -> None:
        table = Table(title=f"run folder: {summary['run_dir']}")
        columns = {
            "final accuracy": _pct(summary["final_accuracy"]),
            summary.get("reference_name", "majority-class rate"): _pct(summary["majority_accuracy"]),
        }
        if "privacy" in summary:  # a DP run releases no bytes or timings
            p = summary["privacy"]
            columns.update(
                {"epsilon": f"{p['epsilon']:.4g}", "delta": f"{p['delta']:.3g}", "adjacency": p["adjacency"]}
            )
        else:
            columns.update(
                {
                    "MB up": f"{summary['total_bytes_up'] / MB:.3f}",
                    "MB down": f"{summary['total_bytes_down'] / MB:.3f}",
                    "wall s": f"{summary['wall_s']:.1f}",
                }
            )
        for col in columns:
            table.add_column(col, justify="right")
        table.add_row(*columns.values())
        Console().print(table)
