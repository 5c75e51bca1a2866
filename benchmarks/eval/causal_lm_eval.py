"""Evaluate a causal-LM model (the untuned base, or a run's saved LoRA adapter) on the causal-LM
task's evaluation set, with its speed (examples per second of :meth:`CausalLM.evaluate`) and the
binomial standard error of each accuracy: the numbers behind the LM recipes' headers.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data python benchmarks/eval/causal_lm_eval.py \\
        [--config configs/commonsense-fslora.toml] [--set key=value ...] [--adapter RUN_DIR/adapter] \\
        [--plain] [--batch-size 16] [--threads 1]

Without ``--config`` the evaluation is the eight commonsense sets, 5 questions each (seed 0),
``data.max_length = 256``, generation on. ``--plain`` scores every row in full (the path before
prompts were shared); ``--adapter`` loads a saved adapter (a run folder's ``adapter/``) onto the
base model, else the base model is evaluated as it is (the untuned reference).
Measured (untuned SmolLM2, the default 40 questions, one thread, on a 2-core machine that other
jobs kept at load 3-6, so +-30 %): generation off, ``--plain`` 71.0 s (0.56 questions/s) against
47.5 s (0.84/s) with shared prompts, the same acc (0.275) and loss (2.50171 / 2.50184; a direct
unbatched transformers computation is within 3e-5 of the shared path's); generation on, 94.3 s
(0.42/s) before this path against 55.8 s (0.72/s).
``--set-file S --set-n N`` evaluates on N questions (seed 0) of commonsense set S alone, the
questions ``task.sets`` with ``task.test_per_set = N`` evaluates: a recipe's held-out set.
``--correct FILE.npy`` saves each question's (acc, acc_norm) correctness instead (for a paired
comparison of two models on the same questions).
``--dolly-category C`` evaluates on ``--dolly-n`` records (seed 0) of Dolly category C drawn from
FedIT's training pool (as a local prompt/response file): configs/dolly.toml's held-out category.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

DEFAULTS = [
    "task.kind=causal-lm",
    "model.name=smollm2",
    "data.name=commonsense",
    "task.test_per_set=5",
    "data.max_length=256",
]


def standard_errors(metrics: dict[str, float], counts: dict[str, int]) -> dict[str, float]:
    """sqrt(p (1 - p) / n) for each accuracy-type metric: per set with that set's n; for the
    mean over sets (``acc``, ``acc_norm``, ``gen_acc``) the standard error of that mean,
    sqrt(sum_s p_s (1 - p_s) / n_s) / S."""
    out = {}
    for key in ("acc", "acc_norm", "gen_acc"):
        if key not in metrics:
            continue
        per = {s: metrics[f"{key}_{s}"] for s in counts if f"{key}_{s}" in metrics}
        for s, p in per.items():
            out[f"{key}_{s}"] = math.sqrt(p * (1 - p) / counts[s])
        if per:
            out[key] = math.sqrt(sum(p * (1 - p) / counts[s] for s, p in per.items())) / len(per)
        else:
            n = sum(counts.values())
            out[key] = math.sqrt(metrics[key] * (1 - metrics[key]) / n)
    return out


def dolly_category_file(category: str, n: int) -> str:
    """A local prompt/response file of ``n`` records (seed 0) of one Dolly category from FedIT's
    training pool (instruction -> prompt, context -> input), in a temporary folder. No category
    column: one category is one label, and a task needs two (the labels become answer-length
    quartiles, which only name the per-label metrics)."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from fedtune.config import DataConfig
    from fedtune.data.llm_text import DOLLY_TRAIN, read_jsonl
    from fedtune.data.text import data_dir

    rows = [r for r in read_jsonl(data_dir(DataConfig(name="dolly")) / DOLLY_TRAIN) if r["category"] == category]
    if not rows:
        raise SystemExit(f"--dolly-category: no Dolly records of category {category!r}")
    pick = np.sort(np.random.default_rng(0).permutation(len(rows))[:n])
    path = Path(tempfile.mkdtemp(prefix="dolly-")) / f"{category}.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": rows[i]["instruction"],
                    "input": rows[i]["context"],
                    "response": rows[i]["response"],
                }
            )
            + "\n"
            for i in pick
        )
    )
    return str(path)


def commonsense_set_file(name: str, n: int) -> str:
    """A local ``{question, choices, gold}`` file of the ``n`` evaluation questions of commonsense
    set ``name`` that ``task.sets = [name, ...]`` with ``task.test_per_set = n`` evaluates (seed 0),
    in a temporary folder: one set alone is not a task (its questions would carry one label)."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from fedtune.config import DataConfig
    from fedtune.data.llm_text import COMMONSENSE_DIR, check_sets, eval_split, read_jsonl
    from fedtune.data.text import data_dir

    check_sets([name], "--set-file")
    root = data_dir(DataConfig(name="commonsense"))
    rows = read_jsonl(root / COMMONSENSE_DIR / f"{name}_{eval_split(root, name)}.jsonl.gz")
    pick = np.sort(np.random.default_rng(0).choice(len(rows), size=n, replace=False)) if n < len(rows) else None
    chosen = rows if pick is None else [rows[i] for i in pick]
    path = Path(tempfile.mkdtemp(prefix="commonsense-")) / f"{name}.jsonl"
    path.write_text("".join(json.dumps({k: r[k] for k in ("question", "choices", "gold")}) + "\n" for r in chosen))
    return str(path)


def main() -> None:
    import numpy as np

    from fedtune.config import load_config
    from fedtune.runtime import RunContext, resolve_run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="a recipe (its evaluation settings are used)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    parser.add_argument("--adapter", default=None, help="a saved PEFT adapter folder (default: the untuned base)")
    parser.add_argument("--dolly-category", default=None, help="evaluate on this Dolly category's training records")
    parser.add_argument("--dolly-n", type=int, default=100, help="how many records of --dolly-category (seed 0)")
    parser.add_argument("--set-file", default=None, help="evaluate on this commonsense set alone (a held-out set)")
    parser.add_argument("--set-n", type=int, default=100, help="how many questions of --set-file (seed 0)")
    parser.add_argument("--losses", default=None, help="also save each test example's response loss here (.npy)")
    parser.add_argument("--losses-only", action="store_true", help="only the per-example losses (no evaluate)")
    parser.add_argument(
        "--correct", default=None, help="only save each question's (acc, acc_norm) correctness here (.npy, (N, 2))"
    )
    parser.add_argument("--plain", action="store_true", help="score every row in full (no shared prompts)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = [*([] if args.config else DEFAULTS), *args.set]
    if args.dolly_category:
        path = dolly_category_file(args.dolly_category, args.dolly_n)
        overrides += [f"data.name={path}", f"data.test_path={path}", "data.partition=iid", "data.client_column=null"]
    if args.set_file:
        path = commonsense_set_file(args.set_file, args.set_n)
        overrides += [f"data.name={path}", f"data.test_path={path}", "data.partition=iid"]
    ctx = RunContext(resolve_run(load_config(args.config, overrides)))
    task = ctx.task
    model = task.build_model(ctx.config.seed)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    ds = task.test
    _ = task.test_rows  # tokenized before the clock starts
    if args.losses:
        with torch.no_grad():
            losses = task.score_rows(model, *task.test_rows, args.batch_size, shared=True)[1]
        np.save(args.losses, losses)
        print(
            json.dumps(
                {
                    "examples": len(ds),
                    "loss": float(losses.mean()),
                    "loss_se": float(losses.std(ddof=1) / math.sqrt(len(ds))),
                }
            )
        )
        if args.losses_only:
            return
    if args.correct:  # per question, for a paired comparison of two models on the same questions
        scores = task.choice_scores(model, ds, args.batch_size)
        correct = np.array(
            [
                [np.argmax(lp) == ds.gold[i], np.argmax(np.asarray(lp) / np.asarray(chars)) == ds.gold[i]]
                for i, (lp, chars) in sorted(scores.items())
            ],
            dtype=np.float64,
        )
        np.save(args.correct, correct)
        print(json.dumps({"examples": len(correct), "acc": correct[:, 0].mean(), "acc_norm": correct[:, 1].mean()}))
        return
    start = time.perf_counter()
    metrics = task.evaluate(model, args.batch_size, shared=not args.plain)
    seconds = time.perf_counter() - start
    counts = {ds.label_names[s]: int(c) for s, c in zip(*np.unique(ds.labels, return_counts=True))}
    print(
        json.dumps(
            {
                "model": args.adapter or f"{ctx.config.model.name} (untuned)",
                "examples": len(ds),
                "per_label": counts,
                "seconds": round(seconds, 2),
                "per_second": round(len(ds) / seconds, 3),
                "metrics": metrics,
                "standard_errors": standard_errors(metrics, counts),
            }
        )
    )


if __name__ == "__main__":
    main()
