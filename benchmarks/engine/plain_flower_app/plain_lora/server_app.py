"""The ServerApp: Flower's FedAvg over every node each round, the round ends timed."""

from __future__ import annotations

import json
import time

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from plain_lora.task import get_model, trainable_state

app = ServerApp()


def slowest(records: list[RecordDict], weighting_key: str) -> MetricRecord:
    """Per round, the largest of each metric over the clients (FedAvg's default: the weighted mean)."""
    metrics = [next(iter(r.metric_records.values())) for r in records]
    return MetricRecord({k: max(float(m[k]) for m in metrics) for k in metrics[0]})


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    nodes = int(cfg["num-nodes"])
    model = get_model(int(cfg["lora-rank"]), float(cfg["lora-alpha"]), int(cfg["seed"]))
    strategy = FedAvg(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=nodes,
        min_available_nodes=nodes,
        train_metrics_aggr_fn=slowest,  # the benchmark's only change: the slowest client's seconds
    )
    out = str(cfg["times-file"])

    def round_end(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if out:  # called before round 1 (round 0) and after every round: the rounds' ends
            with open(out, "a") as f:
                f.write(json.dumps({"round": server_round, "t": time.time()}) + "\n")
        return MetricRecord({})

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(trainable_state(model)),
        num_rounds=int(cfg["num-server-rounds"]),
        train_config=ConfigRecord({}),
        evaluate_fn=round_end,
    )
    if out:
        with open(out, "a") as f:
            train = {r: dict(m) for r, m in result.train_metrics_clientapp.items()}
            f.write(json.dumps({"done": True, "train_metrics": train}) + "\n")
