"""What planning buys on the causal-LM task (issue 41, item 5): three_classes.py's federation, arms
and budgets on commonsense questions with SmolLM2-135M-Instruct; written to
``benchmarks/results/budgets/causal-lm/`` (README.md, results.json, causal_lm.png).

Task: configs/commonsense-fslora.toml's (ARC-Easy and ARC-Challenge train splits, Dirichlet 0.5
over the sets, answers trained as the gold option's text, evaluation ranking the options' texts by
log-likelihood), scaled down in configs/benchmarks/budgets-causal-lm.toml. Arms (planned /
smallest / drop), device classes (2 of each in 6 clients by ``cid % 3``) and budgets (multiples of
the predicted cost at rank r = 64) are three_classes.py's; HeteroLoRA's knob is the rank, FSLoRA's
the sketch ratio. The planner reads the budgets through SmolLM2's memory model: on this model rank
64 on q/k/v/up/down_proj uploads 53 MB a round, rank 4 3.3 MB, so the upload decides each
class's setting, as on MiniLM.

Figures: a run's mean of its last 2 evaluations (rounds 2 and 4), mean +- sample std over seeds:
the held-out response loss (nats per answer token on the test questions' gold options; the
measure that moves at this scale) and the multiple-choice accuracy (``acc``, the mean over the two
sets of 25 test questions each: one question is 4 points of a set, so accuracy is mostly noise
here). Learning rate AdamW 1e-3 (the commonsense recipe's), not swept. Per class, from
metrics.jsonl and plan.json: predicted against measured peak memory, compute seconds and MB up.

    HF_HUB_OFFLINE=1 FEDTUNE_DATA_DIR=../shared/data .venv/bin/python benchmarks/budgets/causal_lm.py --plan
    ... --only heterolora (one method first; resumable: rerun the same command) | --report-only | --quick
"""

from __future__ import annotations

import sys
from pathlib import Path

import three_classes as tc

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "benchmarks" / "budgets-causal-lm.toml"
RESULTS = REPO / "benchmarks" / "results" / "budgets" / "causal-lm"
QUICK_RESULTS = REPO / "benchmarks" / "results" / "_scratch" / "budgets-causal-lm-quick"
RUN_S = (480.0, 20.0)  # one run's CPU seconds, full and --quick (the timing run: README)
QUICK = ["model.name=tiny-llama", "model.lora_rank=16", "rounds=2", "eval_every=1", "data.max_train_samples=48"]
QUICK += ["task.test_per_set=4", "data.max_length=64", "train.local_steps=1"]
LORA = ("heterolora", "fslora")  # one experiment per method, so that --only heterolora runs it first

SUITE = tc.Suite(
    __doc__,
    "benchmarks/budgets/causal_lm.py",
    RESULTS,
    QUICK_RESULTS,
    "commonsense",
    {m: m for m in LORA},
    dict.fromkeys(LORA, tc.ARMS[:3]),
    dict.fromkeys(LORA, RECIPE),
    dict.fromkeys(LORA, QUICK),
    dict.fromkeys(LORA, RUN_S),
    loss=True,
    # three_classes.PINNED's kind: the multiples at rank 64 as SmolLM2 was priced for the eleventh session's runs
    pinned=dict.fromkeys(
        LORA, {"phone": (1.4303, 4.2467), "laptop": (2.8607, 15.9252), "workstation": (8.5821, 106.1683)}
    ),
)

if __name__ == "__main__":
    sys.exit(tc.main(suite=SUITE))
