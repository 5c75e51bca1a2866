"""Where a deployment's idle SuperNodes slept: one FedIT job (poll_cost.py's setting: MiniLM / SST-2,
4 clients all sampled, 1 torch thread) on a loopback deployment of NODES nodes, its SuperNodes
logging at Flower's DEBUG level (timestamps) and their logs kept. Read back from the logs: per node,
how long it held each standby (``query.standby``) and every time it slept (it sent a reply and took
its next message more than 1 s later: Flower's 3 s idle sleep, found an empty queue), and each
training reply's way out (:func:`read_replies`: its objects, and whether the SuperNode took it
before they were all pushed); from the run's ``flower_timing.jsonl``, each round's dispatch seconds
per message (push to the task's claim).
Writes ``OUT/trace.json`` and prints a summary.

    python benchmarks/engine/standby_trace.py NODES OUT [--steps 10] [--rounds 6]

Numbers and the changes they led to: benchmarks/results/flower_standby.md, flower_return.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path

from flower_deployment import engines_job

SLEEP_S = 1.0  # a reply and the node's next message further apart than this: the node slept
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})")
EVENT = re.compile(r"(Receiving|Sending): (\S+) message")


def node_events(log: Path) -> list[tuple[float, str, str]]:
    """(epoch s, "Receiving" | "Sending", message type) of each message a SuperNode's DEBUG log shows."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        stamp, event = STAMP.search(line), EVENT.search(line)
        if stamp and event:
            when = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
            events.append((when.timestamp() + int(stamp[2]) / 1000, event[1], event[2]))
    return events


def read_node(events: list[tuple[float, str, str]]) -> dict:
    """A node's standby holds (s) and its sleeps: (the type it had answered, the type it got after)."""
    holds, sleeps, taken, sent = [], [], None, None
    for when, kind, message_type in events:
        if kind == "Receiving":
            if sent is not None and when - sent[0] > SLEEP_S:
                sleeps.append({"after": sent[1], "then": message_type, "gap_s": round(when - sent[0], 2)})
            taken, sent = (when, message_type), None
        elif taken is not None and taken[1] == message_type:
            if message_type == "query.standby":
                holds.append(round(when - taken[0], 3))
            sent, taken = (when, message_type), None
    return {"holds": holds, "sleeps": sleeps}


RUNTIME = re.compile(
    r"Runtime\.(PushMessages|PushObject|PushTaskOutput)|(Sending: train|Receiving: train|Sent successfully)"
)


def read_replies(log: Path) -> list[dict]:
    """Each training reply's way out of a SuperNode (its DEBUG log): how many objects the node's
    executor pushed and over how long (its ``PushMessages`` to its last ``PushObject``), when the
    SuperNode took the reply (``Sending``, counted from that last push: negative when it took it
    mid-push, and then waited 0.5 s for each object not there yet) and how long it took to send it
    on to the SuperLink (``Sending`` to ``Sent successfully``), in seconds."""
    replies, current = [], None
    for line in log.read_text(errors="replace").splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)
        stamp, event = STAMP.search(line), RUNTIME.search(line)
        if not (stamp and event):
            continue
        when = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
        when += int(stamp[2]) / 1000
        name = event[1] or event[2]
        if name == "Receiving: train":
            current = {"objects": 0}
        elif current is None:
            continue
        elif name == "PushMessages" and "push" not in current:
            current["push"] = current["last_object"] = when
        elif name == "PushObject" and "push" in current and "output" not in current:
            current["objects"] += 1
            current["last_object"] = when
        elif name == "PushTaskOutput" and "push" in current:
            current["output"] = when
        elif name == "Sending: train" and "push" in current:
            current["sending"] = when
        elif name == "Sent successfully" and "sending" in current:
            replies.append(
                {
                    "objects": current["objects"],
                    "push_s": round(current["last_object"] - current["push"], 3),
                    "taken_after_push_s": round(current["sending"] - current["last_object"], 3),
                    "send_s": round(when - current["sending"], 3),
                }
            )
            current = None
    return replies


def read_rounds(timing: Path) -> list[dict]:
    """Per training round, each message's dispatch seconds (by its clients, "0+1")."""
    rounds = []
    for line in timing.read_text().splitlines():
        entry = json.loads(line)
        if entry["kind"] == "train":
            rounds.append({k: v["dispatch_s"] for k, v in entry["clients"].items()} | {"round": entry["round"]})
    return rounds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nodes", type=int, help="loopback deployment nodes")
    parser.add_argument("out", type=Path, help="folder for the run folder, the logs and trace.json")
    parser.add_argument("--steps", type=int, default=10, help="local steps per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    os.environ["FLWR_LOG_LEVEL"] = "DEBUG"  # the SuperNodes' logs with timestamps (they inherit it)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fedtune.config import load_config
    from fedtune.engines.flower.deployment import run_flower_deployment

    name = f"trace-{args.nodes}"
    overrides = engines_job(4, args.rounds, args.steps)
    overrides += [f"name={name}", f"output_dir={args.out}", "engine=flower", f"placement.nodes={args.nodes}"]
    run_flower_deployment(load_config(None, overrides), timeout=1800, keep_logs=args.out / "logs")
    nodes = {log.stem: read_node(node_events(log)) for log in sorted((args.out / "logs").glob("supernode*[0-9].log"))}
    replies = [r for log in sorted((args.out / "logs").glob("supernode*[0-9].log")) for r in read_replies(log)]
    rounds = read_rounds(args.out / name / "flower_timing.jsonl")
    later = [v for r in rounds[1:] for k, v in r.items() if k != "round"]  # round 1 builds the model
    holds = sorted(h for n in nodes.values() for h in n["holds"])
    summary = {
        "nodes": args.nodes,
        "steps": args.steps,
        "rounds": args.rounds,
        "sleeps": sum(len(n["sleeps"]) for n in nodes.values()),
        "standbys": len(holds),
        "holds_under_0_3_s": sum(h < 0.3 for h in holds),
        "hold_median_s": statistics.median(holds) if holds else None,
        "dispatch_median_s": statistics.median(later) if later else None,
        "dispatch_max_s": max(later) if later else None,
        "dispatch_first_round_max_s": max(v for k, v in rounds[0].items() if k != "round") if rounds else None,
        "replies_taken_mid_push": sum(r["taken_after_push_s"] < 0 for r in replies),
        "reply_objects_median": statistics.median(r["objects"] for r in replies) if replies else None,
        "reply_send_median_s": statistics.median(r["send_s"] for r in replies) if replies else None,
        "per_node": nodes,
        "per_round": rounds,
        "replies": replies,
    }
    (args.out / "trace.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("per_node", "per_round", "replies")}))
    for node, seen in nodes.items():
        print(node, "sleeps:", [(s["after"], s["then"], s["gap_s"]) for s in seen["sleeps"]])


if __name__ == "__main__":
    main()
