"""A round's record (:class:`RoundRecord`): its sample, the bytes that crossed, steps, timings,
peaks, drops and metrics, and its ``metrics.jsonl`` line (written and read back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RoundRecord:
    """What one round did: its clients, metrics, per-client bytes, steps, seconds, peaks and drops,
    and its timings; :meth:`to_json` is its ``metrics.jsonl`` line."""

    round: int
    clients: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    client_bytes_up: dict[int, int] = field(default_factory=dict)
    client_bytes_down: dict[int, int] = field(default_factory=dict)
    client_steps: dict[int, int] = field(default_factory=dict)
    client_compute_s: dict[int, float] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)  # client -> why (every attempt of the round)
    attempts: int = 1
    eval_bytes: int = 0
    wall_s: float = 0.0
    private: bool = False  # a round under client-level DP: its line releases no per-client number
    client_peak_bytes: dict[int, int] = field(default_factory=dict)  # measured (clients with a memory budget)
    client_memory_budget_bytes: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # for the operator's console only: never in metrics.jsonl

    def to_json(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line for this round: the record's own fields, and the metrics
        between them; a metric named like a field (a strategy passing on what clients reported)
        never replaces the engine's accounting. A private round's line is only what the privacy
        mechanism releases: the round, the metrics (the server's evaluation of the released state,
        epsilon) and ``"private": true``; not the sample, bytes, timings, steps or drops, which
        depend on who was sampled and on their data."""
        if self.private:
            return {"round": self.round, **{k: v for k, v in self.metrics.items() if k != "private"}, "private": True}
        own = {
            "round": self.round,
            "accuracy": self.metrics.get("accuracy"),
            "loss": self.metrics.get("loss"),
            "bytes_up": sum(self.client_bytes_up.values()),
            "bytes_down": sum(self.client_bytes_down.values()),
            "eval_bytes": self.eval_bytes,
            "wall_s": self.wall_s,
            "compute_s": sum(self.client_compute_s.values()),
            "clients": self.clients,
        }
        tail = {
            "client_bytes_up": {str(k): v for k, v in self.client_bytes_up.items()},
            "client_bytes_down": {str(k): v for k, v in self.client_bytes_down.items()},
            "client_steps": {str(k): v for k, v in self.client_steps.items()},
            "client_compute_s": {str(k): round(v, 4) for k, v in self.client_compute_s.items()},
            "dropped": {str(k): v for k, v in self.dropped.items()},  # on every line, {} when none was
            "attempts": self.attempts,
        }
        if self.client_peak_bytes:  # only runs with memory budgets
            tail["client_peak_bytes"] = {str(k): v for k, v in self.client_peak_bytes.items()}
            tail["client_memory_budget_bytes"] = {str(k): v for k, v in self.client_memory_budget_bytes.items()}
        metrics = {k: v for k, v in self.metrics.items() if k not in own and k not in tail}
        return {**own, **metrics, **tail}

    #: The keys of a :meth:`to_json` line that are the record's own fields (the rest are metrics).
    FIELDS = (
        "round",
        "bytes_up",
        "bytes_down",
        "eval_bytes",
        "wall_s",
        "compute_s",
        "clients",
        "client_bytes_up",
        "client_bytes_down",
        "client_steps",
        "client_compute_s",
        "client_peak_bytes",
        "client_memory_budget_bytes",
        "dropped",
        "attempts",
    )

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> RoundRecord:
        """The record of a ``metrics.jsonl`` line (:meth:`to_json`'s inverse; the per-client
        totals are recomputed from the per-client maps, and a metric that was None is left out)."""

        def by_client(key: str) -> dict[int, Any]:
            return {int(k): v for k, v in (line.get(key) or {}).items()}

        return cls(
            round=int(line["round"]),
            clients=[int(c) for c in line.get("clients", [])],
            metrics={k: v for k, v in line.items() if k not in (*cls.FIELDS, "private") and v is not None},
            client_bytes_up=by_client("client_bytes_up"),
            client_bytes_down=by_client("client_bytes_down"),
            client_steps=by_client("client_steps"),
            client_compute_s=by_client("client_compute_s"),
            client_peak_bytes=by_client("client_peak_bytes"),
            client_memory_budget_bytes=by_client("client_memory_budget_bytes"),
            dropped=by_client("dropped"),
            attempts=int(line.get("attempts", 1)),
            eval_bytes=int(line.get("eval_bytes", 0)),
            wall_s=float(line.get("wall_s", 0.0)),
            private=bool(line.get("private", False)),
        )
