"""One process-setup function for every entry point (CLI, engines, Flower nodes, benchmark workers)."""

from __future__ import annotations

import os
import warnings


def setup_process(threads: int | None = None) -> None:
    """Prepare this process for fedtune work: no tokenizer thread pool (it deadlocks after fork
    and fights torch for the cores), quiet deprecation noise from the libraries, and ``threads``
    torch threads when given (``train.threads``; None leaves torch's choice)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    if threads:
        import torch

        torch.set_num_threads(int(threads))
