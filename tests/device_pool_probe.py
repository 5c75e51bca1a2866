"""A probe client for :class:`fedtune.engines.device_pool.DevicePool`, imported by its worker
processes (by name: spawn pickles ``probe_context`` as a reference), so it imports nothing heavy.

Its reply tells where it ran (the worker's pid, ``device``, torch threads), how many requests
its worker has served in all, and the count of its own requests, kept in its client state. A
request's ``meta`` may ask clients to raise (``raise``: client ids) or to sleep first (``sleepers``,
for ``sleep`` seconds); its array ``x`` comes back doubled."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.profiles import ClientProfile

SERVED = [0]  # requests this worker process has served


class ProbeClient(Client):
    def fit(self, message: Message) -> Message:
        SERVED[0] += 1
        if self.cid in message.meta.get("raise", []):
            raise ValueError(f"client {self.cid} broke")
        if self.cid in message.meta.get("sleepers", []):
            time.sleep(float(message.meta["sleep"]))
        count = int(self.state.get("count", 0)) + 1
        self.state = {"count": np.asarray(count)}
        meta = {
            "cid": self.cid,
            "count": count,
            "pid": os.getpid(),
            "device": self.config.device,
            "threads": torch.get_num_threads(),
            "served": SERVED[0],
        }
        return Message({"x": message.arrays["x"] * 2}, meta)


class ProbeContext:
    def __init__(self, config) -> None:
        self.config, self.options = config, None

    def client(self, cid: int, state: dict | None = None) -> ProbeClient:
        return ProbeClient(cid, ClientProfile(), self, state)


def probe_context(config) -> ProbeContext:
    return ProbeContext(config)
