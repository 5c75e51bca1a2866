"""The causal-LM task (tiny-llama): response-only loss, the log-likelihood protocol against a
direct transformers computation, answer extraction, ROUGE-L, the data loaders on the real files
(Table B.1 templates, FedIT's client split, bad input) and a FedIT run whose adapter reloads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError, load_config
from fedtune.data import llm_text
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.causal_lm import CausalLM
from fedtune.tasks.text_metrics import extract_answer, rouge_l
from tests.conftest import acting_adapter_model

TINY = ["task.kind=causal-lm", *CausalLM.test_overrides]
DATA = Path(os.environ["FEDTUNE_DATA_DIR"])  # tests/conftest.py: ../shared/data unless set


def config(tmp_path, *overrides):
    return load_config(None, [*TINY, f"output_dir={tmp_path / 'runs'}", *overrides])


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return RunContext(resolve_run(config(tmp_path_factory.mktemp("clm"), "model.lora_rank=4")))


@pytest.fixture(scope="module")
def model(ctx):
    """The tiny LM with an adapter that acts and attention that depends on positions
    (:func:`tests.conftest.acting_adapter_model`)."""
    return acting_adapter_model(ctx.workspace, rank=4)


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# -- (a) the loss covers the response tokens only ----------------------------------------------
def test_rows_mask_the_prompt_and_the_loss_is_the_response_cross_entropy(ctx, model):
    task, tok = ctx.task, ctx.task.tokenizer
    ds = task.train
    lengths = [len(r) for r in task.train_rows[0]]
    i, j = int(np.argmin(lengths)), int(np.argmax(lengths))  # rows of different lengths: padding
    batch = task.batch(task.train_rows, [i, j])
    # the hand-built row: the chat template around the Table B.1 instruction, then the answer + eos
    chat = tok.apply_chat_template(
        [{"role": "user", "content": ds.instructions[i]}], tokenize=False, add_generation_prompt=True
    )
    prompt, answer = _encode(tok, chat), _encode(tok, ds.responses[i]) + [tok.eos_token_id]
    assert ds.responses[i].startswith("the correct answer is ")
    length = task.config.data.max_length
    keep = length - len(answer)
    expected = prompt[len(prompt) - keep :] + answer  # the prompt cut from the left, the answer whole
    real = batch["attention_mask"][0].bool()
    assert batch["input_ids"][0][real].tolist() == expected
    assert batch["labels"][0][real].tolist() == [-100] * keep + answer
    assert (batch["labels"][0][~real] == -100).all()
    # the loss: per row, the mean of -log p(response token | everything before), then the mean
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([expected])).logits[0], -1)
        row_i = -logp[keep - 1 : -1].gather(-1, torch.tensor(answer)[:, None]).mean()
        ids_j = batch["input_ids"][1][batch["attention_mask"][1].bool()]
        k_j = int((batch["labels"][1] == -100).sum()) - int((~batch["attention_mask"][1].bool()).sum())
        logp_j = torch.log_softmax(model(input_ids=ids_j[None]).logits[0], -1)
        row_j = -logp_j[k_j - 1 : -1].gather(-1, ids_j[k_j:, None]).mean()
        assert torch.allclose(task.loss(model, batch), (row_i + row_j) / 2, atol=1e-5)


class _Perturb:
    """A forward hook adding noise to the logits that predict the token at column ``target``
    of row ``row`` (the logits of column ``target - 1``), wherever the model computed them."""

    def __init__(self, row: int, target: int, width: int) -> None:
        self.row, self.target, self.width, self.hit = row, target, width, False

    def __call__(self, module, args, kwargs, out):
        kept = out.logits.shape[1]
        col = self.target - 1 - (self.width - kept)
        if col >= 0:
            self.hit = True
            out.logits[self.row, col] += 5.0 * torch.randn_like(out.logits[self.row, col])
        return out


def test_a_prompt_tokens_prediction_does_not_move_the_loss_a_response_tokens_does(ctx, model):
    """Noise on what the model predicts for the last prompt token leaves the loss as it was (an
    off-by-one mask that counted it would not); noise on the first response token's prediction
    changes it, in both rows (a mask that dropped it, or the first computed column, would not)."""
    from fedtune.models.lm_scoring import language_model

    task = ctx.task
    labels = task.train.labels  # an ARC-Easy row ("... answer2") and a BoolQ row ("... true"): answers of two lengths
    rows = [int(np.flatnonzero(labels == 0)[0]), int(np.flatnonzero(labels == 1)[0])]
    batch = task.batch(task.train_rows, rows)
    width = batch["labels"].shape[1]
    first = [int(torch.nonzero(batch["labels"][b] != -100)[0]) for b in range(2)]
    row = int(np.argmax(first))  # the row whose response starts latest: its last prompt token is in view
    with torch.no_grad():
        base = task.loss(model, batch)
        other = 1 - row  # the row whose response starts first: its first token is the earliest target
        for r, target, moves in ((row, first[row] - 1, False), (row, first[row], True), (other, first[other], True)):
            hook = _Perturb(r, target, width)
            handle = language_model(model).register_forward_hook(hook, with_kwargs=True)
            try:
                torch.manual_seed(0)
                loss = task.loss(model, batch)
            finally:
                handle.remove()
            assert hook.hit, "the perturbed position lies outside the computed logits: the test would be vacuous"
            assert (not torch.allclose(loss, base, atol=1e-6)) == moves, (r, target, float(loss), float(base))


# -- (b) the log-likelihood protocol equals a direct computation ---------------------------------
ITEMS = [  # non-ASCII options: characters != byte tokens, so acc_norm per character != per token
    {"question": "Question: Which drink is hot?\nAnswer:", "choices": ["café crème", "iced tea", "ü"], "gold": 0},
    {"question": "Question: Où est la gare?\nAnswer:", "choices": ["là-bas, près du pont", "ici"], "gold": 1},
    {"question": "Question: 2 + 2 = ?\nAnswer:", "choices": ["four", "四", "22", "fünf"], "gold": 0},
    {"question": "Question: Pick a colour.\nAnswer:", "choices": ["ʁouge", "blue", "grün"], "gold": 2},
    {"question": "Question: Is ice cold?\nAnswer:", "choices": ["yes", "no"], "gold": 0},
    {"question": "Question: Name a fruit.\nAnswer:", "choices": ["ñame", "apple", "日本の梨"], "gold": 1},
]


def _direct_scores(lm, tok, context: str, continuations: list[str]) -> list[float]:
    """Summed log p(continuation tokens | context), one unpadded row per option, straight from
    transformers (default positions, no batching)."""
    ctx_ids = _encode(tok, context)
    out = []
    for c in continuations:
        cont = _encode(tok, c)
        with torch.no_grad():
            logp = torch.log_softmax(lm(input_ids=torch.tensor([ctx_ids + cont])).logits[0].double(), -1)
        out.append(float(sum(logp[len(ctx_ids) + t - 1, tok_id] for t, tok_id in enumerate(cont))))
    return out


def _sharp_lm():
    """The tiny random Llama of seed 3, its weights x3 (option scores far apart)."""
    from fedtune.models import prefix_lm as plm

    lm = plm.build_language_model(plm.TINY_LLAMA, 3).eval()
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(3.0)
    return lm


def _chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("scoring", ["text", "answer"])
def test_loglikelihood_acc_and_acc_norm_equal_a_direct_transformers_computation(tmp_path, scoring):
    from fedtune.models import prefix_lm as plm

    tok, lm = plm.load_lm_tokenizer(plm.TINY_LLAMA), _sharp_lm()
    items = [dict(x) for x in ITEMS]
    for x in items:  # gold: the per-character pick where per-token normalisation picks another option
        direct = np.array(_direct_scores(lm, tok, _chat(tok, x["question"]), x["choices"]))
        by_char = int(np.argmax(direct / [len(c) for c in x["choices"]]))
        by_token = int(np.argmax(direct / [len(_encode(tok, c)) for c in x["choices"]]))
        x["gold"] = by_char if by_char != by_token else x["gold"]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in items))
    c = RunContext(
        resolve_run(
            config(
                tmp_path,
                f"data.name={path}",
                f"data.test_path={path}",
                "data.max_test_samples=1000",
                "data.max_length=512",
                f"task.choice_scoring={scoring}",
                "task.generate=false",
            )
        )
    )
    task = c.task
    ds = task.test
    scores = task.choice_scores(lm, ds, batch_size=3)  # batches mix lengths: padding and positions matter
    acc, by_char, by_token = [], [], []
    for i in range(len(ds)):
        if scoring == "text":
            context, conts = ds.questions[i], ds.choices[i]
        else:
            context, conts = ds.instructions[i], [f"the correct answer is {t}" for t in ds.tags[i]]
        direct = _direct_scores(lm, tok, _chat(tok, context), conts)
        assert np.allclose(scores[i][0], direct, atol=1e-3), (i, scores[i][0], direct)
        acc.append(int(np.argmax(direct)) == ds.gold[i])
        by_char.append(int(np.argmax(np.array(direct) / [len(x) for x in conts])) == ds.gold[i])
        by_token.append(int(np.argmax(np.array(direct) / [len(_encode(tok, x)) for x in conts])) == ds.gold[i])
    metrics = task.evaluate(lm, batch_size=3)
    assert metrics["acc"] == pytest.approx(np.mean(acc)) and metrics["accuracy"] == metrics["acc"]
    assert metrics["acc_norm"] == pytest.approx(np.mean(by_char))
    if scoring == "text":  # the items tell characters from tokens apart, and acc from acc_norm
        assert np.mean(by_char) != np.mean(by_token) and np.mean(by_char) != np.mean(acc)


@pytest.mark.parametrize("max_length", [64, 512])
def test_shared_prompt_scoring_equals_scoring_every_row_in_full(tmp_path, max_length):
    """The fast path (each question's prompt encoded once, its KV cache reused by its options and
    its answer row) gives the plain path's option log-likelihoods, losses and metrics, on the
    LoRA model with its adapter acting, in batches that mix questions of several lengths and
    option counts; at 64 tokens the prompts are cut (differently per option length)."""
    c = RunContext(
        resolve_run(config(tmp_path, "model.lora_rank=4", f"data.max_length={max_length}", "task.generate=false"))
    )
    task = c.task
    c.workspace.activate(4)
    with torch.no_grad():
        for name, p in c.workspace.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model = c.workspace.model.eval()
    ds = task.test
    items = task.choice_items(ds)
    cut = sum(k < len(task.prompts(ds)[0]) for i, _, k, _ in items if i == 0)
    assert (cut > 0) == (max_length == 64)
    fast, plain = task.choice_scores(model, ds, 5), task.choice_scores(model, ds, 5, shared=False)
    assert fast.keys() == plain.keys() and len(fast) == len(ds)
    for i in fast:
        assert fast[i][1] == plain[i][1]
        assert np.allclose(fast[i][0], plain[i][0], atol=1e-4), (i, fast[i][0], plain[i][0])
    shared, full = task.evaluate(model, 5), task.evaluate(model, 5, shared=False)
    assert shared.keys() == full.keys()
    for key in full:
        assert shared[key] == pytest.approx(full[key], abs=1e-5), key


def test_answer_extraction_follows_llm_adapters():
    tags = ["answer1", "answer2", "answer3", "answer4"]
    assert extract_answer("the correct answer is answer3", tags) == 2
    assert extract_answer("answer2, not answer1", tags) == 1  # the first match
    assert extract_answer("The Correct Answer Is Answer1", tags) == -1  # case-sensitive, as theirs
    assert extract_answer("the correct answer is true", ["true", "false"]) == 0
    assert extract_answer("falsetrue", ["true", "false"]) == 1
    assert extract_answer("ending4 it is", [f"ending{i}" for i in range(1, 5)]) == 3
    assert extract_answer("", ["option1", "option2"]) == -1


def test_rouge_l_is_rouge_score():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    pairs = [
        ("The cat sat on the mat.", "the cat on the mat"),
        ("a b c d", "d c b a"),
        ("Rincon, Malibu, Trestles", "Malibu and Rincon are right point breaks"),
        ("über café 42", "uber cafe 42"),  # non-ASCII letters are not words to rouge-score
        ("yes", ""),
    ]
    for pred, ref in pairs:
        assert rouge_l(pred, ref) == pytest.approx(scorer.score(ref, pred)["rougeL"].fmeasure)
    assert rouge_l("The cat sat on the mat.", "the cat on the mat") == pytest.approx(10 / 11)
    assert rouge_l("", "") == 1.0  # two empty answers agree (the package says 0)
    stemmed = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    pred, ref = "The cats were Running", "the cat was run"  # stemming would match cat and run
    assert stemmed.score(ref, pred)["rougeL"].fmeasure == pytest.approx(0.75)
    assert rouge_l(pred, ref) == pytest.approx(0.25)  # "the" alone: unstemmed, as FedIT's scorer


# -- (d) data on the real files ---------------------------------------------------------------
ADAPTERS = {
    "arc_challenge": "ARC-Challenge_test.json",
    "arc_easy": "ARC-Easy_test.json",
    "boolq": "boolq_test.json",
    "openbookqa": "openbookqa_test.json",
    "piqa": "piqa_test.json",
    "socialiqa": "social_i_qa_test.json",
    "winogrande": "winogrande_test.json",
}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_commonsense_prompts_are_llm_adapters_table_b1_prompts(name):
    """The first 40 evaluation questions of each set, rendered with Table B.1, are word for word
    LLM-Adapters' own test records (instruction and "the correct answer is ..." output)."""
    reference = {}
    for r in json.loads((DATA / "llm-adapters" / ADAPTERS[name]).read_text()):
        reference.setdefault(r["instruction"], set()).add(r["output"])
    path = DATA / "commonsense" / f"{name}_{llm_text.eval_split(DATA, name)}.jsonl.gz"
    rows = llm_text.read_jsonl(path)[:40]
    ds = llm_text.multiple_choice_set(rows, path, name, 0, [name])
    for i in range(len(ds)):
        assert ds.instructions[i] in reference, ds.instructions[i]
        assert ds.responses[i] in reference[ds.instructions[i]]


def test_hellaswag_prompt_follows_table_b1():
    text, tags = llm_text.commonsense_instruction(
        "hellaswag", "Removing ice from car: Then, the man writes. Then", [", a", ", b", ", c", ", d"]
    )
    assert text == (
        "Please choose the correct ending to complete the given sentence: Removing ice from car: Then, the man "
        "writes. Then\n\nEnding1: , a Ending2: , b Ending3: , c Ending4: , d\n\n"
        "Answer format: ending1/ending2/ending3/ending4"
    )
    assert tags == ["ending1", "ending2", "ending3", "ending4"]


def test_commonsense_mix_labels_sets_and_evaluates_test_or_validation(tmp_path):
    c = RunContext(resolve_run(config(tmp_path, 'task.sets=["openbookqa", "piqa"]', "task.test_per_set=30")))
    train, test = c.task.load()
    assert train.label_names == ["openbookqa", "piqa"]
    assert np.bincount(train.labels).tolist() == [4957, 16113]  # the train splits
    assert np.bincount(test.labels).tolist() == [30, 30]
    assert llm_text.eval_split(DATA, "openbookqa") == "test" and llm_text.eval_split(DATA, "piqa") == "validation"


def test_fedit_client_column_gives_fedits_ten_clients(tmp_path):
    cfg = config(
        tmp_path,
        "data.name=dolly",
        "data.max_train_samples=2000",
        "data.max_test_samples=100",
        "data.partition=column",
        "data.client_column=fedit_client",
        "federation.num_clients=10",
    )
    task = RunContext(resolve_run(cfg)).task
    parts = task.partition(10, cfg.seed)
    column = task.train.columns["fedit_client"]
    assert len(parts) == 10 and sum(len(p) for p in parts) == len(task.train)
    for client, part in enumerate(parts):
        assert (column[part] == client).all()
    # the column is the file's own assignment
    raw = [json.loads(line) for line in (DATA / llm_text.DOLLY_TRAIN).read_text().splitlines()]
    by_text = {(r["instruction"], r["response"]): r["fedit_client"] for r in raw}
    ds = task.train
    assert all(by_text[(ds.instructions[i], ds.responses[i])] == column[i] for i in range(0, len(ds), 50))
    assert len(task.test) == 80 and task.label_names == sorted({r["category"] for r in raw})


def _one_line_error(match: str, make) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_bad_input_stops_with_one_line_naming_the_field_or_file(tmp_path):
    def ctx_of(*o):
        return lambda: RunContext(resolve_run(config(tmp_path, *o))).task.train

    _one_line_error(r"^task\.sets: unknown set 'arc'", ctx_of('task.sets=["arc"]'))
    _one_line_error(r"^task\.truncation_side", ctx_of("task.truncation_side=middle"))
    _one_line_error(r"^task\.answer_format: 'text' .*choice_scoring", ctx_of("task.answer_format=text"))
    _one_line_error(r"^task\.generate: .*'text' format", ctx_of("task.answer_format=text", "task.choice_scoring=text"))
    _one_line_error(
        r"^data\.name: 'dolly' needs .*fedit_10clients_train\.jsonl",
        ctx_of("data.name=dolly", f"data.data_dir={tmp_path}"),
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hi", "label": 1}\n')
    _one_line_error(r"bad\.jsonl: expected columns prompt and response", ctx_of(f"data.name={bad}"))
    gold = tmp_path / "gold.jsonl"
    gold.write_text('{"question": "q", "choices": ["a", "b"], "gold": 2}\n')
    _one_line_error(r"gold\.jsonl: row 1: column 'gold' must be an index 0-1", ctx_of(f"data.name={gold}"))
    for choices in (["a", "a"], ["a", " "], ["x", "y ", "y"]):
        repeated = tmp_path / "repeated.jsonl"
        repeated.write_text(json.dumps({"question": "q", "choices": choices, "gold": 0}) + "\n")
        _one_line_error(
            r"repeated\.jsonl: row 1: column 'choices' holds a blank or repeated", ctx_of(f"data.name={repeated}")
        )
    for name, data in [
        ("bom.jsonl", b'{"prompt": "a", "response": "b"}\n'),
        ("bom.csv", b"prompt,response\na,b\n"),
    ]:
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + data)
        assert llm_text._read_rows(tmp_path / name) == [{"prompt": "a", "response": "b"}]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
    _one_line_error(r"latin\.jsonl: line 2: not UTF-8 text", ctx_of(f"data.name={latin}"))
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    _one_line_error(r"broken\.jsonl\.gz: not a readable gzip file", lambda: llm_text.read_jsonl(broken))
    _one_line_error(
        r"^data\.client_column: data 'commonsense' has no column 'fedit_client'",
        lambda: (
            RunContext(
                resolve_run(config(tmp_path, "data.partition=column", "data.client_column=fedit_client"))
            ).partitions
        ),
    )
    _one_line_error(
        r"^federation\.num_clients: data\.client_column 'fedit_client' assigns the pool to 10 clients",
        lambda: (
            RunContext(
                resolve_run(
                    config(
                        tmp_path,
                        "data.name=dolly",
                        "data.partition=column",
                        "data.client_column=fedit_client",
                        "federation.num_clients=3",
                    )
                )
            ).partitions
        ),
    )


def test_nothing_is_written_before_the_data_is_read_and_partitioned(tmp_path):
    """A data file that is not UTF-8, a row without its response, and a partition the data cannot
    give: one line each and no run folder, so the corrected rerun under the same name starts
    (before, config.toml and run_config.json were written first: "holds an earlier run")."""
    from fedtune.run import run_experiment

    bad = tmp_path / "bad.jsonl"
    good = "".join(json.dumps({"prompt": f"q{i}", "response": "b" * (1 + i % 8)}) + "\n" for i in range(40)).encode()
    for data, extra in [
        (good + b'{"prompt": "caf\xe9", "response": "b"}\n', ()),
        (good + b'{"prompt": "a", "response": 3}\n', ()),
        (good, ("data.partition=column", "data.client_column=client")),
    ]:
        bad.write_bytes(data)
        with pytest.raises(ConfigError):
            run_experiment(config(tmp_path, f"data.name={bad}", "name=x", "rounds=1", *extra))
        assert not (tmp_path / "runs").exists()
    run = run_experiment(config(tmp_path, f"data.name={bad}", "name=x", "rounds=1", "train.local_steps=1"))
    assert Path(run["run_dir"], "summary.json").is_file()


def test_answer_format_text_trains_on_the_row_the_ranking_scores_for_the_gold_option(tmp_path, ctx):
    """``task.answer_format = "text"``: every multiple-choice row, in training and in the test
    loss, is the chat template around the bare question, then the gold option's text and eos: the
    very row the ranked classification scores for the gold option (plus eos); the question, options
    and gold are those of the tag-format task's same example."""
    c = RunContext(
        resolve_run(
            config(
                tmp_path,
                "task.answer_format=text",
                "task.choice_scoring=text",
                "task.generate=false",
                "data.max_length=512",
            )
        )
    )
    task, tok = c.task, c.task.tokenizer
    eos = tok.eos_token_id
    for ds, rows, tagged in ((task.train, task.train_rows, ctx.task.train), (task.test, task.test_rows, ctx.task.test)):
        assert ds.questions == tagged.questions and list(ds.gold) == list(tagged.gold)
        assert all(r.startswith("the correct answer is ") for r in tagged.responses)
        for i in range(0, len(ds), max(1, len(ds) // 6)):
            prompt = _encode(tok, _chat(tok, tagged.questions[i]))
            answer = _encode(tok, tagged.choices[i][tagged.gold[i]]) + [eos]
            prompt = prompt[max(0, len(prompt) + len(answer) - 512) :]  # a long passage: cut from the left
            assert rows[0][i].tolist() == prompt + answer and rows[1][i] == len(prompt), i
    items = task.choice_items(task.test)
    option = {}
    for i, row, k, _ in items:
        option.setdefault(i, []).append((row, k))
    whole = 0
    for i, opts in option.items():
        row, k = opts[task.test.gold[i]]
        if len(row) < 512:  # (a row at the limit loses one more prompt token to the eos)
            assert task.test_rows[0][i].tolist() == [*row.tolist(), eos] and task.test_rows[1][i] == k
            whole += 1
    assert len(option) == len(task.test) and whole >= 4


# -- (e) a FedIT run whose adapter reloads --------------------------------------------------------
def test_fedit_run_saves_an_adapter_that_reloads_with_the_same_loss(tmp_path):
    from peft import PeftModel

    from fedtune.checkpoint import load_state
    from fedtune.run import run_experiment

    cfg = config(
        tmp_path, "method=fedit", "rounds=2", "federation.num_clients=2", "train.local_steps=2", "train.lr=5e-2"
    )
    summary = run_experiment(cfg)
    run_dir = Path(summary["run_dir"])
    assert json.loads((run_dir / "prompt_template.json").read_text())["template"] == "chat"
    ctx = RunContext(resolve_run(cfg))
    task = ctx.task
    batch = task.batch(task.test_rows, np.arange(len(task.test)))
    ctx.workspace.load(load_state(run_dir / "checkpoint.npz")["global"], cfg.model.lora_rank)
    reloaded = PeftModel.from_pretrained(task.build_model(cfg.seed), str(run_dir / "adapter")).eval()
    with torch.no_grad():
        expected = task.loss(ctx.workspace.model.eval(), batch)
        assert torch.allclose(task.loss(reloaded, batch), expected, atol=1e-5)
        assert not torch.allclose(task.loss(task.build_model(cfg.seed).eval(), batch), expected, atol=1e-4)
    assert summary["final_loss"] == pytest.approx(task.evaluate(reloaded, 16)["loss"], abs=1e-4)


# -- greedy generation stops at the end-of-sequence token ---------------------------------------------
class ScriptedLM(torch.nn.Module):
    """A causal LM whose step ``s`` argmax for row ``b`` is ``script[b][s]`` (vocabulary 16); counts
    its forward passes."""

    def __init__(self, script: list[list[int]]) -> None:
        super().__init__()
        self.script, self.calls = script, 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, attention_mask=None, **_):
        from types import SimpleNamespace

        logits = torch.zeros(len(self.script), 1, 16)
        for b, row in enumerate(self.script):
            logits[b, -1, row[min(self.calls, len(row) - 1)]] = 1.0
        self.calls += 1
        return SimpleNamespace(logits=logits, past_key_values=None)


def test_greedy_generation_stops_at_eos_and_a_finished_row_emits_only_eos():
    """Row 0 says EOS (15) at step 2 and would go on; row 1 at step 4: row 0 is EOS from step 2 on,
    and decoding stops once both have (4 forward passes, not max_new_tokens = 10)."""
    from fedtune.models.generation import greedy_generate

    lm = ScriptedLM([[3, 15, 7, 8, 9], [4, 4, 4, 15, 9]])
    tokens = greedy_generate(lm, torch.ones(2, 3, dtype=torch.long), 10, 15, input_ids=torch.zeros(2, 3).long())
    assert tokens.tolist() == [[3, 15, 15, 15], [4, 4, 4, 15]] and lm.calls == 4


def test_causal_lm_answers_end_at_the_first_eos_even_where_tokens_follow(ctx, monkeypatch):
    """The decoded answer is the tokens before the first end-of-sequence token, whatever follows it
    (here ordinary tokens, which skip_special_tokens would keep)."""
    from fedtune.tasks import causal_lm

    tok, eos = ctx.task.tokenizer, ctx.task.tokenizer.eos_token_id
    hello, world = _encode(tok, " hello"), _encode(tok, " world")
    rows = torch.tensor([[*hello, eos, *world], [*world, *hello, eos]])
    monkeypatch.setattr(causal_lm, "greedy_generate", lambda *args, **kwargs: rows)
    prompts = [np.array(_encode(tok, "q"), dtype=np.int64)] * 2
    texts = ctx.task.generate(torch.nn.Linear(1, 1), prompts, rows.shape[1])
    assert texts == [tok.decode(hello), tok.decode([*world, *hello])]
