"""Paired comparison on FedIT's 80-record Dolly test set: each record's ROUGE-L (greedy
generation, the causal-LM task's own prompts, budget and ``rouge-score``) for the untuned base and
for each run's final adapter, and the paired difference of each run (and of their mean over
runs) against the untuned model, with the standard error of a mean difference over records,
SE = sd_i(d_i) / sqrt(n), d_i = ROUGE-L_run(i) - ROUGE-L_untuned(i).

The table's report has only the seed spread as noise for ROUGE-L (the records' sampling is not in
it); this measures the records' part.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data python benchmarks/llm/dolly_paired.py \\
        RUN_DIR [RUN_DIR ...] --out FILE.json [--workers 2]

Each model is one worker job (one thread); the untuned base is scored with the first run's config.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from fedtune.harness import imap_unordered


def record_rouge(job: tuple[str, bool]) -> list[float]:
    """Each test record's ROUGE-L for run folder ``job[0]``'s adapter (``job[1]``: its base alone)."""
    from fedtune.tasks.text_metrics import rouge_l
    from fedtune.trained.loader import evaluation_task, open_run, prepared_base

    run = open_run(Path(job[0]))
    task = evaluation_task(run.config)
    model = prepared_base(task) if job[1] else run.model(task)
    ds = task.test
    texts = task.answers(model, ds, run.config.train.eval_batch_size)
    return [rouge_l(texts[i], ds.responses[i]) for i in range(len(ds))]


def paired(run: np.ndarray, base: np.ndarray) -> dict[str, float]:
    d = run - base
    return {"mean": float(d.mean()), "se": float(d.std(ddof=1) / math.sqrt(len(d)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (config.toml and adapter/)")
    parser.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    jobs = [(args.runs[0], True), *((r, False) for r in args.runs)]
    scores = {}
    for job, result, error in imap_unordered(record_rouge, jobs, args.workers):
        if error is not None:
            raise SystemExit(f"{job[0]}: {error.strip().splitlines()[-1]}")
        scores["untuned" if job[1] else job[0]] = np.asarray(result)
        print(f"{'untuned' if job[1] else job[0]}: ROUGE-L {np.mean(result):.4f}", flush=True)
    base = scores["untuned"]
    runs = np.stack([scores[r] for r in args.runs])
    report = {
        "records": len(base),
        "rouge_l": {k: float(v.mean()) for k, v in scores.items()},
        "per_run_minus_untuned": {r: paired(scores[r], base) for r in args.runs},
        "mean_of_runs_minus_untuned": paired(runs.mean(axis=0), base),
        "per_record": {k: v.tolist() for k, v in scores.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "per_record"}, indent=1))


if __name__ == "__main__":
    main()
