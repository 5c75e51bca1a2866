"""One run end to end: resolve the config, run the engine, write the run folder.

``runs/<name>/`` holds ``config.toml`` (the resolved config: ``fedtune run`` it to repeat the
run), ``label_histograms.json``, ``metrics.jsonl`` (one line per round, flushed as it ends),
``checkpoint.npz`` (the strategy's final state), ``adapter/`` (PEFT ``save_pretrained``) and
``summary.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from fedtune.checkpoint import save_state
from fedtune.config import ConfigError, RunConfig
from fedtune.engines.embedded import embedded_engine
from fedtune.engines.rounds import RoundRecord
from fedtune.process import setup_process
from fedtune.protocol.strategy import Strategy
from fedtune.runtime import RunContext


def _toml(config: RunConfig) -> str:
    import tomli_w

    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True))


Engine = Callable[[Strategy, Callable[[RoundRecord], None]], list[RoundRecord]]


def run_experiment(
    config: RunConfig,
    on_round: Callable[[RoundRecord], None] | None = None,
    on_start: Callable[[RunContext], None] | None = None,
    engine: Engine | None = None,
    engine_name: str = "embedded",
) -> dict:
    """Run ``config`` and return the summary (also in ``summary.json``). ``engine(strategy,
    on_round)`` runs the rounds (default: :func:`~fedtune.engines.embedded.embedded_engine`,
    clients in this process)."""
    start = time.perf_counter()
    setup_process(config.train.threads)
    server = RunContext(config)
    config = server.config  # resolved: the task's defaults filled in
    run_dir = Path(config.output_dir) / config.run_name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir {config.output_dir!r}: cannot create the run folder ({exc.strerror})") from None
    (run_dir / "config.toml").write_text(_toml(config))
    (run_dir / "label_histograms.json").write_text(
        json.dumps({"label_names": server.task.label_names, "clients": server.histograms()})
    )
    strategy = server.strategy()
    strategy.initialize()  # loads the model: a bad model.name stops here, before any output
    if on_start is not None:
        on_start(server)
    metrics_path = run_dir / "metrics.jsonl"
    with metrics_path.open("w") as sink:

        def record(rec: RoundRecord) -> None:
            sink.write(json.dumps(rec.to_json()) + "\n")
            sink.flush()
            if on_round is not None:
                on_round(rec)

        history = (engine or embedded_engine(config))(strategy, record)
    save_state(run_dir / "checkpoint.npz", strategy.state_dict())
    strategy.save(run_dir)
    evaluated = [r.metrics["accuracy"] for r in history if "accuracy" in r.metrics]
    summary = {
        "name": config.run_name,
        "method": config.method,
        "task": config.task.kind,
        "data": config.data.name,
        "rounds": config.rounds,
        "seed": config.seed,
        "final_accuracy": history[-1].metrics.get("accuracy"),
        "best_accuracy": max(evaluated) if evaluated else None,
        "final_loss": history[-1].metrics.get("loss"),
        "majority_accuracy": server.task.majority_rate(),
        "test_examples": len(server.task.test),
        "total_bytes_up": sum(sum(r.client_bytes_up.values()) for r in history),
        "total_bytes_down": sum(sum(r.client_bytes_down.values()) for r in history),
        "total_compute_s": sum(sum(r.client_compute_s.values()) for r in history),
        "wall_s": time.perf_counter() - start,
        "run_dir": str(run_dir),
        "engine": engine_name,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
