"""MMLU's row for a bare model by subject group, written incrementally and resumable: the model
scores MMLU under ``fedtune eval``'s ``lm-eval`` protocol (0-shot) in passes, pass k the
questions ``[k * step, (k + 1) * step)`` of every subject (in the data file's order), each pass's
per-question picks appended to ``<out>/questions.jsonl`` as it ends; a rerun skips what is there.
``--table`` writes ``<out>/table.md`` and ``<out>/summary.json`` from the first N questions of
every subject, N the most that every subject has scored (all of a subject where it is shorter):
per group (STEM, humanities, social sciences, other) and whole, acc as the mean over the
questions (lm-eval's groups) with its binomial standard error.

    FEDTUNE_DATA_DIR=/tmp/mmludata python benchmarks/eval/mmlu_row.py smollm2 out/ --upto 50
    python benchmarks/eval/mmlu_row.py smollm2 out/ --table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from fedtune.data.llm_text import MMLU, MMLU_GROUPS, MMLU_SUBJECTS

QUESTIONS = "questions.jsonl"
GROUP_NAMES = {"stem": "STEM", "humanities": "humanities", "social_sciences": "social sciences", "other": "other"}


def done(out: Path) -> dict[tuple[str, int], dict]:
    """{(subject, rank within subject): its record} of the questions scored so far."""
    path = out / QUESTIONS
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["subject"], r["rank"]): r for r in records}


def score(model_name: str, out: Path, step: int, upto: int | None, batch: int) -> None:
    """Score passes of ``step`` questions per subject up to ``upto`` per subject (None: all)."""
    from fedtune.trained.evaluate import LM_EVAL, _lm_eval_length, target_of, unit_config
    from fedtune.trained.loader import evaluation_task, prepared_base

    config = target_of(model_name).config
    first = evaluation_task(unit_config(config, MMLU, False, LM_EVAL))
    model = prepared_base(first)
    task = evaluation_task(unit_config(config, MMLU, False, LM_EVAL, 0, _lm_eval_length(model)))
    train, test = task.data
    subjects = [MMLU_SUBJECTS[s] for s in test.labels]
    ranks = np.zeros(len(test), dtype=np.int64)
    seen: dict[str, int] = {}
    for i, s in enumerate(subjects):
        ranks[i] = seen[s] = seen.get(s, -1) + 1
    largest = int(ranks.max()) + 1 if upto is None else upto
    out.mkdir(parents=True, exist_ok=True)
    for start in range(0, largest, step):
        have = done(out)
        window = (ranks >= start) & (ranks < min(start + step, largest))
        keep = np.array([i for i in np.flatnonzero(window) if (subjects[i], int(ranks[i])) not in have], dtype=int)
        if not len(keep):
            continue
        task.__dict__["data"] = (train, test.subset(keep))
        t0 = time.time()
        per = task.example_metrics(model, batch)
        with (out / QUESTIONS).open("a") as f:
            for j, i in enumerate(keep):
                row = {"subject": subjects[i], "rank": int(ranks[i]), "gold": int(test.gold[i])}
                row.update(pick=int(per["pick"][j]), acc=float(per["acc"][j]))
                f.write(json.dumps(row) + "\n")
        print(f"ranks {start}-{start + step - 1}: {len(keep)} questions in {time.time() - t0:.0f} s", flush=True)


def table(out: Path, sizes: dict[str, int]) -> dict:
    """Per group and whole: n and acc ± SE over the first N questions of every subject (see the
    module docstring); ``sizes``: each subject's number of test questions (groups without
    questions left out)."""
    have = done(out)
    counts = {s: sum(1 for subject, _ in have if subject == s) for s in sizes}
    n_per = min((counts[s] for s in sizes if counts[s] < sizes[s]), default=math.inf)
    chosen = [r for (s, rank), r in have.items() if rank < n_per]
    if not chosen:
        raise SystemExit(f"{out / QUESTIONS}: no question scored in every subject yet")
    rows = {}
    for key, members in [*MMLU_GROUPS.items(), ("all", MMLU_SUBJECTS)]:
        acc = np.array([r["acc"] for r in chosen if r["subject"] in members])
        if len(acc):
            p = float(acc.mean())
            rows[GROUP_NAMES.get(key, "MMLU")] = {"n": len(acc), "acc": p, "acc_se": math.sqrt(p * (1 - p) / len(acc))}
    summary = {"first_per_subject": None if n_per == math.inf else int(n_per), "groups": rows}
    lines = ["| group | n | acc % ± SE |", "|---|---:|---:|"]
    for name, r in rows.items():
        cell = f"{100 * r['acc']:.1f} ± {100 * r['acc_se']:.1f}"
        lines.append(f"| {name} | {r['n']} | {cell} |" if name != "MMLU" else f"| **MMLU** | {r['n']} | **{cell}** |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model name (smollm2), hub id or folder")
    parser.add_argument("out", type=Path, help="folder for questions.jsonl, table.md, summary.json")
    parser.add_argument("--step", type=int, default=5, help="questions per subject in one pass")
    parser.add_argument("--upto", type=int, default=None, help="stop after this many per subject (default: all)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--table", action="store_true", help="only tabulate what is scored")
    args = parser.parse_args()
    if not args.table:
        score(args.model, args.out, args.step, args.upto, args.batch_size)
    from fedtune.data.llm_text import load_mmlu

    test = load_mmlu(Path(os.environ["FEDTUNE_DATA_DIR"]))[1]
    sizes = {s: int((test.labels == k).sum()) for k, s in enumerate(MMLU_SUBJECTS) if (test.labels == k).any()}
    print(json.dumps(table(args.out, sizes), indent=1))


if __name__ == "__main__":
    main()
