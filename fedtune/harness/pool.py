"""A worker pool: spawned processes with one torch thread each, results as they finish.

``spawn`` (not ``fork``) gives every worker a fresh interpreter, so no thread pool or tokenizer
state is inherited; each worker runs :func:`fedtune.process.setup_process` once. Ctrl-C stops the
workers: finished runs are kept, and a run in flight continues from its last checkpointed round
when the suite is run again.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import closing
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TypeVar

import tomllib

from fedtune.config import RunConfig
from fedtune.harness.plan import RunSpec, config_key
from fedtune.process import setup_process

Item = TypeVar("Item")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def setup_worker(threads: int = 1) -> None:
    """Initializer of every worker: :func:`setup_process` with ``threads`` torch threads, and
    quiet warnings and transformers logging (the pool's output is the progress lines)."""
    import warnings

    setup_process(threads)
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - logging niceties only
        pass


def imap_unordered(
    fn: Callable[[Item], Any], items: Iterable[Item], workers: int, threads: int = 1
) -> Generator[tuple[Item, Any, str | None], None, None]:
    """``fn(item)`` for every item in ``workers`` spawned processes (``threads`` torch threads each),
    submitted in the given order; yields ``(item, result, None)`` as each finishes, or
    ``(item, None, error)`` when it raised or its worker died. ``fn`` must be importable (a
    module-level function). If the iteration stops early (Ctrl-C, an error in the caller, ``close()``)
    the workers are terminated."""
    for name in THREAD_VARIABLES:  # read by the workers' torch and BLAS when they load
        os.environ.setdefault(name, str(threads))
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=get_context("spawn"), initializer=setup_worker, initargs=(threads,)
    )
    completed = False
    try:
        futures = {pool.submit(fn, item): item for item in items}
        waiting = set(futures)
        while waiting:
            finished, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            for future in finished:
                outcome: tuple[Item, Any, str | None]
                try:
                    outcome = (futures[future], future.result(), None)
                except Exception as exc:  # fn raised, or a worker died (killed, out of memory)
                    outcome = (futures[future], None, "".join(traceback.format_exception(exc, limit=8)))
                yield outcome
        completed = True
    finally:
        if completed:
            pool.shutdown(wait=True)
        else:  # interrupted (Ctrl-C here or in the caller) or abandoned: stop the jobs in flight
            running = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() forgets them
            pool.shutdown(wait=False, cancel_futures=True)
            for process in running:
                process.terminate()
                process.join(timeout=10)


def resumable(config: RunConfig) -> bool:
    """Whether the run folder holds a run of this very config that was cut short (a killed or
    interrupted suite) with a ``checkpoint.npz`` to continue from."""
    run_dir = Path(config.output_dir) / config.run_name
    if not (run_dir / "checkpoint.npz").is_file():
        return False
    try:
        saved = RunConfig.model_validate(tomllib.loads((run_dir / "config.toml").read_text()))
    except Exception:  # absent or unreadable: start afresh
        return False
    return config_key(saved) == config_key(config)


def run_config(config: RunConfig) -> tuple[dict[str, Any], float]:
    """Worker job: ``launch(config)`` on the engine it names (the embedded one, or a Flower
    simulation or deployment started from this worker), continuing from the checkpoint of a
    cut-short run of the same config (:func:`resumable`; a resumed run ends bit-identical to an
    uninterrupted one); any other run in its folder (a stale config, a run killed before its first
    checkpoint) is moved aside, not lost (``overwrite``). Returns its summary and the seconds it took."""
    from fedtune.launch import launch

    start, resume = time.perf_counter(), resumable(config)
    if resume:
        print(f"{config.name}: continuing from its checkpoint", flush=True)
    return launch(config, resume=resume, overwrite=not resume), time.perf_counter() - start


def run_specs(specs: list[RunSpec], costs: dict[str, float], workers: int) -> tuple[list[str], bool]:
    """Run the specs' configs in the pool, longest estimated first (``costs``: seconds by spec key),
    printing one progress line per finished run. Returns the failures (one line each) and whether
    the suite was interrupted (Ctrl-C: finished runs are kept, rerun the same command to resume)."""
    failures: list[str] = []
    total, start, done = len(specs), time.perf_counter(), 0
    remaining = sum(costs[s.key] for s in specs)
    spec_of = {id(s.config): s for s in specs}
    configs = [s.resolved for s in sorted(specs, key=lambda s: -costs[s.key])]
    try:
        with closing(imap_unordered(run_config, configs, workers)) as results:
            for config, result, error in results:
                spec = spec_of[id(config)]
                done += 1
                remaining -= costs[spec.key]
                where = f"[{done}/{total}] {spec.owner}/{config.name}"
                if error is not None:
                    failures.append(f"{spec.owner}/{config.name}: {error.strip().splitlines()[-1]}")
                    print(f"{where}  FAILED\n{error}", flush=True)
                    continue
                summary, seconds = result
                shown = "  ".join(
                    f"{name} {'–' if (v := summary.get(key)) is None else f'{v:.4f}'}"
                    for name, key in (("acc", "final_accuracy"), ("loss", "final_loss"))
                )
                print(
                    f"{where}  {shown}  {seconds:.0f} s  (elapsed "
                    f"{(time.perf_counter() - start) / 60:.1f} min, ~{max(0.0, remaining) / workers / 60:.0f} min "
                    "of estimate left)",
                    flush=True,
                )
    except KeyboardInterrupt:
        print(
            f"\ninterrupted after {done}/{total} runs; finished runs are kept: rerun the same command to resume",
            flush=True,
        )
        return failures, True
    return failures, False
