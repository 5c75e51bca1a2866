"""The ClientApp: on every train message, build the model, load the partition, train, reply."""

from __future__ import annotations

import time

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from plain_lora.task import get_model, load_partition, train, trainable_state

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    entered = time.perf_counter()
    cfg = context.run_config
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    model = get_model(int(cfg["lora-rank"]), float(cfg["lora-alpha"]), int(cfg["seed"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict(), strict=False)
    data = load_partition(pid, parts, int(cfg["train-samples"]), int(cfg["max-length"]), int(cfg["seed"]))
    seed = int(cfg["seed"]) * 1000 + int(msg.metadata.group_id or 0) * 10 + pid
    loss, seconds = train(
        model, data, int(cfg["local-steps"]), int(cfg["batch-size"]), float(cfg["learning-rate"]), seed
    )
    metrics = {"train_loss": loss, "num-examples": len(data[2]), "compute_s": seconds}
    metrics["handler_s"] = time.perf_counter() - entered
    content = RecordDict({"arrays": ArrayRecord(trainable_state(model)), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
