"""What the server's polling costs a node trained in its process: one FedIT job on MiniLM / SST-2
(4 clients, all sampled, 10 local steps, 5 rounds, 1 torch thread; flower_deployment.py's setting),
on ``embedded`` or a loopback deployment of ``NODES`` nodes, with the code's polling or with both
polls slowed to a fixed 0.25 s (``slow``: the reply pull and the standby tick), to compare the
clients' compute seconds and the rounds' wall time. Each call prints one line per round to stdout and
leaves the run folder (metrics.jsonl, flower_timing.jsonl) in ``OUT``.

    python benchmarks/engine/poll_cost.py current|slow embedded|flower NODES OUT

Numbers and the before / after of the change they led to: benchmarks/results/flower_poll_cost.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from deployment_jobs import job
from flower_deployment import MINILM

SETTING = ["federation.num_clients=4", "federation.clients_per_round=4", "rounds=5", "eval_every=5"]
SETTING += ["train.local_steps=10"]


def slow_polls(period_s: float = 0.25) -> None:
    """Both of the server's polls at a fixed ``period_s``: replies (``exchange``) and standbys."""
    from fedtune.engines.flower import codec, standby, transport

    codec.POLL_MAX_S = period_s
    defaults = list(transport.exchange.__defaults__ or ())
    defaults[0] = period_s  # poll_s
    transport.exchange.__defaults__ = tuple(defaults)
    transport.POLL_MAX_S = period_s
    standby.Standby.__init__.__defaults__ = (standby.LEAD_S, period_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=["current", "slow"], help="the code's polling, or both polls at 0.25 s")
    parser.add_argument("kind", choices=["embedded", "flower"])
    parser.add_argument("nodes", type=int, help="deployment nodes (0 for embedded)")
    parser.add_argument("out", type=Path, help="folder for the run folder")
    args = parser.parse_args(argv)
    if args.variant == "slow":
        slow_polls()
    name = f"{args.variant}-{args.kind}-{args.nodes}"
    job(args.kind, args.nodes, [*MINILM, *SETTING, f"name={name}", f"output_dir={args.out}"])
    for line in (args.out / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        print(r["round"], f"wall {r['wall_s']:.2f}", f"compute {sum(r['client_compute_s'].values()):.2f}")


if __name__ == "__main__":
    main()
