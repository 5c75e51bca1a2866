"""``causal-lm``: a text prompt in, a text answer out, on a causal language model tuned through LoRA.

Data (``data.name``, :mod:`fedtune.data.llm_text`): ``dolly`` (Dolly-15k in FedIT's 10-client
split; ``data.partition = "column"`` with ``data.client_column = "fedit_client"`` gives FedIT's
own clients, any other partitioner skews the 8 categories; test: FedIT's 80-example global test
set), ``commonsense`` (the eight Commonsense170K sets of FSLoRA's Table 5.2 with the Table B.1
templates, ``task.sets`` picks some; labels = the set, so partitioners skew clients by task;
evaluation per set on its test split, validation where there is none; ``task.test_per_set``
caps each), a local ``.jsonl`` / ``.csv`` of ``{prompt, response}`` or
``{question, choices, gold}``, or ``hub:<dataset>`` (the ``datasets`` library; a folder that
``save_to_disk`` wrote too); ``task.columns`` maps those names to a file's or set's own columns.

Model (``model.name``): ``smollm2`` (SmolLM2-135M-Instruct, packaged; the default),
``gemma3-270m`` (Gemma-3-270M base, the optional extra ``fedtune[gemma]``),
``tiny-llama`` (tests) or any Hugging Face causal LM by name or path
(:mod:`fedtune.models.prefix_lm` loads them). LoRA (PEFT task type ``CAUSAL_LM``) adapts
``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj`` where the model has them
(Llama, Qwen2, Mistral, Gemma); ``model.target_modules`` names others.

Prompts (:mod:`fedtune.data.prompting`): the tokenizer's chat template when it has one, else the
plain Alpaca template (``task.template`` forces one); the run folder's ``prompt_template.json``
records the template used, the same in training and evaluation. Rows hold at most
``data.max_length`` tokens, the prompt cut from ``task.truncation_side`` (default ``left``, so
the answer and the assistant header survive); training batches group similar lengths
(``train.group_by_length``).

Loss: cross-entropy of the response tokens only (prompt tokens are -100), the mean over each
example's response tokens, then over examples (:func:`fedtune.models.lm_scoring.response_loss`).

Metrics (:meth:`CausalLM.evaluate`, batched over the test set subsampled by
``data.max_test_samples`` with seed 0): ``loss`` (that response loss) always, then

- free-form examples (Dolly, local prompt/response files): ``rouge_l``, the mean ROUGE-L F1
  (``rouge-score``) of greedy generations (``task.max_new_tokens``) against the references;
  for these sets ``accuracy`` IS this ROUGE-L (a score in [0, 1], not an exact match);
- multiple-choice examples (commonsense, local question files), two protocols:
  (a) ``gen_acc``: greedy generation, then LLM-Adapters' answer extraction (the first answer tag
  found in the output, :func:`fedtune.tasks.text_metrics.extract_answer`);
  (b) ``acc`` / ``acc_norm``: the options ranked by the summed log-likelihood of a continuation
  given a context, as lm-evaluation-harness does, ``acc_norm`` dividing by the continuation's
  length in characters. ``task.choice_scoring = "answer"`` (default) scores each option's
  response in the trained format ("the correct answer is answer2") after the training prompt;
  ``"text"`` scores the option's text after the data's bare question ("Question: ...\\nAnswer:",
  through the same template: lm-evaluation-harness's ranked classification).
  ``task.answer_format = "text"`` (with ``choice_scoring = "text"``) also trains in that form: each
  multiple-choice example's prompt is its bare question and its response the gold option's text
  (:func:`fedtune.data.llm_text.as_option_texts`), so training, the response loss and the ranking
  share one format; the default ``"tag"`` trains on the Table B.1 prompts and tags.
  ``"lm-eval"`` scores lm-evaluation-harness's task format of each set
  (:mod:`fedtune.data.lm_eval_formats`: raw text, no template, ``" " + option``, ``acc_norm``
  dividing by the option's length without that space, as lm-eval does; a question's
  ``loss`` is its gold option's), ``task.num_fewshot`` solved training examples before each
  question (``fedtune eval``'s ``lm-eval`` protocol).
  ``accuracy`` = ``acc``. On ``commonsense`` every metric is the mean over sets (the eight-task
  average), each set's own value under ``<metric>_<set>``; elsewhere the mean over examples, with
  a value per label (Dolly category) beside it.

Reference (:meth:`CausalLM.majority_rate`): multiple choice, always answering the most frequent
gold index of each set, averaged over sets; free-form, the ROUGE-L of echoing the prompt
(instruction and input) as the answer.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from fedtune.config import ConfigError
from fedtune.data import llm_text, lm_eval_formats, prompting
from fedtune.data.batches import index_batches, length_grouped_batches, longest_row, row_lengths
from fedtune.models import lm_scoring
from fedtune.models import prefix_lm as plm
from fedtune.models.generation import greedy_generate
from fedtune.models.precision import load_dtype
from fedtune.steps import advance, step
from fedtune.tasks.base import Task, majority_rate, register_task
from fedtune.tasks.causal_lm_options import (
    BY_LABEL,
    FFN_TARGETS,
    FREE_FORM_NEW_TOKENS,
    LLAMA_TARGETS,
    CausalLMOptions,
)
from fedtune.tasks.text_metrics import extract_answer, per_label_means, rouge_l


@register_task
class CausalLM(Task):
    kind = "causal-lm"
    description = (
        "text prompt -> text answer: dolly (FedIT split), commonsense (8 sets, Table B.1), local files; "
        "causal LMs (SmolLM2, HF) with LoRA"
    )
    capabilities = frozenset({"lora", "transformer"})
    defaults = {"data.name": "commonsense", "model.name": plm.SMOLLM2}
    Options = CausalLMOptions
    peft_task_type = "CAUSAL_LM"
    test_overrides = (
        f"model.name={plm.TINY_LLAMA}",
        "data.name=commonsense",
        'task.sets=["arc_easy", "boolq"]',
        "data.max_train_samples=48",
        "data.max_test_samples=8",
        "data.max_length=64",
        "task.max_new_tokens=4",
    )
    #: LoRA on the attention projections only: the FFNs stay plain layers that FedPFT / FedOT compress
    test_variants = {"attention-lora": ('model.target_modules=["q_proj", "v_proj"]',)}
    options: CausalLMOptions

    @classmethod
    def capabilities_for(cls, config) -> frozenset[str]:
        """``transformer`` (FFNs that FedPFT / FedOT compress into a proxy) only when
        ``model.target_modules`` leaves the FFN projections out of LoRA: by default LoRA adapts
        them, and an FFN with LoRA layers in it is not a plain FFN to prune."""
        targets = config.model.target_modules
        if targets is None or any(t.rsplit(".", 1)[-1] in FFN_TARGETS for t in targets):
            return cls.capabilities - {"transformer"}
        return cls.capabilities

    def __init__(self, config, options) -> None:
        super().__init__(config, options)
        if config.data.name == "commonsense" or options.sets is not None:
            llm_text.check_sets(options.sets)
        if options.answer_format == "text" and options.choice_scoring != "text":
            raise ConfigError(
                "task.answer_format: 'text' trains on the option texts; set task.choice_scoring = 'text' to score them"
            )
        if options.answer_format == "text" and options.generate:
            raise ConfigError(
                "task.generate: answers in the 'text' format carry no answer tag to extract; set task.generate = false"
            )
        if options.choice_scoring == "lm-eval" and options.generate:
            raise ConfigError("task.generate: the lm-eval protocol ranks options only; set task.generate = false")
        if options.num_fewshot and options.choice_scoring != "lm-eval":
            raise ConfigError("task.num_fewshot: few-shot prompts need task.choice_scoring = 'lm-eval'")
        self.reference_name = (
            "majority gold-index rate (mean over sets)"
            if config.data.name == "commonsense"
            else "ROUGE-L of echoing the prompt (free-form) / majority gold-index rate (multiple choice)"
        )

    # -- data --------------------------------------------------------------------------------
    def load(self) -> tuple[llm_text.PromptSet, llm_text.PromptSet]:
        from fedtune.data.text import data_dir

        cfg = self.config.data
        opts = self.options
        train, test = llm_text.load_prompt_set(cfg, data_dir(cfg), opts.sets, opts.test_per_set, opts.columns)
        if opts.answer_format == "text":
            train, test = llm_text.as_option_texts(train), llm_text.as_option_texts(test)
        return train, test

    @property
    def label_names(self) -> list[str]:
        return self.train.label_names

    def partition_columns(self) -> dict[str, np.ndarray]:
        """The pool's given client assignments (``task.columns``; :attr:`PromptSet.columns`)."""
        return self.train.columns

    @cached_property
    def tokenizer(self):
        return plm.load_lm_tokenizer(self.config.model.name)

    @cached_property
    def prompt_format(self) -> prompting.PromptFormat:
        """The template used in training and evaluation alike."""
        opts = self.options
        fmt = prompting.PromptFormat.choose(opts.template, self.tokenizer, opts.system_prompt)
        if fmt.template == "chat" and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"task.template: the tokenizer of {self.config.model.name!r} has no chat template")
        return fmt

    @cached_property
    def keep_start(self) -> int:
        """Prompt tokens a left cut keeps: the beginning-of-sequence token of a tokenizer that
        writes one before every text (:func:`fedtune.data.prompting.bos_prefix`), else none."""
        return 1 if prompting.bos_prefix(self.tokenizer) else 0

    def run_files(self) -> dict[str, str]:
        """``prompt_template.json``: the template (its name and text), system turn and truncation."""
        info = self.prompt_format.describe(self.tokenizer)
        info.update(truncation_side=self.options.truncation_side, max_length=self.config.data.max_length)
        return {"prompt_template.json": json.dumps(info, indent=1)}

    def prompts(self, ds: llm_text.PromptSet) -> list[np.ndarray]:
        """Token ids of each example's rendered prompt."""
        fmt, tok = self.prompt_format, self.tokenizer
        return prompting.encode(tok, [fmt.render(tok, i, x) for i, x in zip(ds.instructions, ds.inputs)])

    def responses(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each response, the end-of-sequence token after it."""
        eos = np.array([self.tokenizer.eos_token_id], dtype=np.int64)
        return [np.concatenate([r, eos]) for r in prompting.encode(self.tokenizer, texts)]

    def rows(self, ds: llm_text.PromptSet) -> tuple[list[np.ndarray], list[int]]:
        """(prompt + response rows, the prompt's length in each), truncated to ``data.max_length``."""
        pairs = [
            prompting.encode_pair(p, r, self.config.data.max_length, self.options.truncation_side, self.keep_start)
            for p, r in zip(self.prompts(ds), self.responses(ds.responses))
        ]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    @cached_property
    def train_rows(self) -> tuple[list[np.ndarray], list[int]]:
        return self.rows(self.train)

    @cached_property
    def test_rows(self) -> tuple[list[np.ndarray], list[int]]:
        return self.rows(self.test)

    def batch(self, rows: tuple[list[np.ndarray], list[int]], idx) -> dict[str, torch.Tensor]:
        return prompting.collate_left([rows[0][i] for i in idx], [rows[1][i] for i in idx], self.tokenizer.pad_token_id)

    # -- reference ---------------------------------------------------------------------------
    def majority_rate(self) -> float:
        """Multiple choice: the rate of always giving each set's most frequent gold index, averaged
        over sets; free-form: the mean ROUGE-L of answering with the prompt itself (instruction and
        input), a copy baseline (a little above 0 wherever prompt and answer share words)."""
        ds = self.test
        mc = ds.multiple_choice
        rates = [majority_rate(ds.gold[mc & (ds.labels == s)]) for s in np.unique(ds.labels[mc])]
        free = np.flatnonzero(~mc)
        if len(free):
            echo = [rouge_l(f"{ds.instructions[i]} {ds.inputs[i]}", ds.responses[i]) for i in free]
            rates.append(float(np.mean(echo)))
        return float(np.mean(rates))

    # -- model -------------------------------------------------------------------------------
    def build_model(self, seed: int) -> torch.nn.Module:
        """The LM, every weight trainable (LoRA methods freeze them under PEFT); with
        ``model.finetune = "head"`` only the output embedding (tied to the input one in SmolLM2)."""
        model = plm.build_language_model(self.model_name, seed, load_dtype(self.config.model))
        if self.config.model.finetune == "full":
            return model.requires_grad_(True)
        model.get_output_embeddings().weight.requires_grad_(True)
        return model

    def lora_targets(self) -> list[str]:
        """The Llama-style projections the model has (none: the user names them)."""
        names = {
            n.rsplit(".", 1)[-1] for n in plm.language_model_module_names(self.config.model.name, self.config.seed)
        }
        return [t for t in LLAMA_TARGETS if t in names]

    # -- batches, loss -----------------------------------------------------------------------
    def train_batches(self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator):
        rows = self.train_rows
        if self.config.train.group_by_length:
            order = length_grouped_batches(pool, row_lengths(rows[0]), batch_size, steps, rng)
        else:
            order = index_batches(pool, batch_size, steps, rng)
        for idx in order:
            yield self.batch(rows, idx)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_scoring.response_loss(model, batch)

    def step_shape(self) -> tuple[int, int]:
        """(the longest training row, cut to ``data.max_length``; its longest response + 1): a
        batch is padded to its longest row, and :func:`~fedtune.models.lm_scoring.response_logits`
        computes the LM head over its longest response and the position before it."""
        rows, prompt_lengths = self.train_rows
        longest = longest_row(rows)
        return longest, min(longest, max(len(r) - k for r, k in zip(rows, prompt_lengths)) + 1)

    def public_step_shape(self) -> tuple[int, int]:
        """(``data.max_length``, the same): every row is cut to it, a response at most fills it."""
        return self.config.data.max_length, self.config.data.max_length

    # -- evaluation --------------------------------------------------------------------------
    def generation_budget(self, ds: llm_text.PromptSet) -> int:
        """``task.max_new_tokens``, else the longest reference response in tokens (multiple
        choice) or that capped at 64 (free-form)."""
        if self.options.max_new_tokens is not None:
            return self.options.max_new_tokens
        longest = max(len(r) for r in self.responses(ds.responses))
        return longest if ds.multiple_choice.all() else min(longest, FREE_FORM_NEW_TOKENS)

    def generate(self, model: torch.nn.Module, prompts: list[np.ndarray], max_new_tokens: int) -> list[str]:
        """Greedy continuations of ``prompts`` (token ids, each cut to ``data.max_length`` from the
        truncation side), decoded up to the first end-of-sequence token."""
        length, side, eos = self.config.data.max_length, self.options.truncation_side, self.tokenizer.eos_token_id
        cut = [prompting.cut_prompt(p, length, side, self.keep_start) for p in prompts]
        batch = lm_scoring.on_device(
            prompting.collate_left(cut, [len(p) for p in cut], self.tokenizer.pad_token_id), model
        )
        tokens = greedy_generate(
            lm_scoring.language_model(model),
            batch["attention_mask"],
            max_new_tokens,
            eos,
            input_ids=batch["input_ids"],
        )
        out = []
        for row in tokens.tolist():
            row = row[: row.index(eos)] if eos in row else row
            out.append(self.tokenizer.decode(row, skip_special_tokens=True))
        return out

    def answers(self, model: torch.nn.Module, ds: llm_text.PromptSet, batch_size: int) -> list[str]:
        """Greedy answers (:meth:`generate`, :meth:`generation_budget`'s tokens) to every prompt of
        ``ds``, in batches of ``batch_size`` prompts of similar length; in ``ds``'s order."""
        texts = [""] * len(ds)
        prompts = self.prompts(ds)
        budget = self.generation_budget(ds)
        for chunk in _length_chunks([len(p) for p in prompts], batch_size):
            for k, text in zip(chunk, self.generate(model, [prompts[k] for k in chunk], budget)):
                texts[k] = text
        return texts

    def choice_continuations(self, ds: llm_text.PromptSet, i: int) -> tuple[str, str, list[str]]:
        """(instruction, input, continuation texts) that the log-likelihood protocol scores for
        multiple-choice example ``i`` (``task.choice_scoring``)."""
        if self.options.choice_scoring == "text":
            return ds.questions[i], "", list(ds.choices[i])
        return ds.instructions[i], ds.inputs[i], [llm_text.ANSWER_PREFIX + t for t in ds.tags[i]]

    def set_name(self, ds: llm_text.PromptSet, i: int) -> str:
        """The set of example ``i``: its commonsense set or MMLU subject (``local``: a file's or hub
        set's question)."""
        return ds.label_names[ds.labels[i]] if self.config.data.name in BY_LABEL else "local"

    def fewshot_prefix(self, ds: llm_text.PromptSet, i: int) -> str:
        """``task.num_fewshot`` solved examples of example ``i``'s set, the first of its training
        split (:func:`fedtune.data.lm_eval_formats.fewshot_prefix`)."""
        k = self.options.num_fewshot
        if not k:
            return ""
        pool = self.train
        same = np.flatnonzero(pool.labels == ds.labels[i]) if self.config.data.name in BY_LABEL else None
        first = (same if same is not None else np.arange(len(pool)))[:k]
        if len(first) < k:
            raise ConfigError(
                f"task.num_fewshot: {k} shots of {self.set_name(ds, i)!r}, but its few-shot pool (training or dev "
                f"split) has {len(first)}"
            )
        shots = [(pool.questions[j], pool.choices[j], int(pool.gold[j])) for j in first]
        return lm_eval_formats.fewshot_prefix(self.set_name(ds, i), shots)

    def choice_pairs(self, ds: llm_text.PromptSet, i: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """(context ids, continuation ids, the continuation's length in characters) of each option
        of example ``i``: the context rendered through the prompt template (``answer``, ``text``),
        or lm-eval's raw context, few-shot examples before it, encoded as lm-eval encodes a pair
        (the continuation's ids are those of context + continuation after the context's)."""
        tok = self.tokenizer
        if self.options.choice_scoring == "lm-eval":
            name = self.set_name(ds, i)
            prefix = prompting.bos_prefix(tok) + lm_eval_formats.description(name) + self.fewshot_prefix(ds, i)
            pairs = lm_eval_formats.requests(name, ds.questions[i], list(ds.choices[i]))
            contexts = prompting.encode(tok, [prefix + c for c, _ in pairs])
            wholes = prompting.encode(tok, [prefix + c + x for c, x in pairs])
            # acc_norm divides by the option's length without lm-eval's " " delimiter (its completion_len)
            return [(c, w[len(c) :], len(x.removeprefix(" "))) for c, w, (_, x) in zip(contexts, wholes, pairs)]
        instruction, inp, conts = self.choice_continuations(ds, i)
        prompt = prompting.encode(tok, [self.prompt_format.render(tok, instruction, inp)])[0]
        return [(prompt, ids, len(c)) for c, ids in zip(conts, prompting.encode(tok, conts))]

    def choice_items(self, ds: llm_text.PromptSet) -> list[tuple[int, np.ndarray, int, int]]:
        """(example, row, its prompt's length, the continuation's length in characters): one per
        option of each multiple-choice example of ``ds`` (:meth:`choice_pairs`), truncated to
        ``data.max_length``."""
        items = []
        length, side = self.config.data.max_length, self.options.truncation_side
        for i in np.flatnonzero(ds.multiple_choice).tolist():
            for prompt, ids, chars in self.choice_pairs(ds, i):
                row, k = prompting.encode_pair(prompt, ids, length, side, self.keep_start)
                items.append((int(i), row, k, chars))
        return items

    def truncated(self, ds: llm_text.PromptSet) -> np.ndarray:
        """(N,) bool: the examples of ``ds`` a scored row of which (its answer row, or one of its
        options) is cut to ``data.max_length`` tokens."""
        length = self.config.data.max_length
        cut = np.zeros(len(ds), dtype=bool)
        if self.options.choice_scoring != "lm-eval" or not ds.multiple_choice.all():
            for i, (p, r) in enumerate(zip(self.prompts(ds), self.responses(ds.responses))):
                cut[i] = len(p) + len(r) > length
        for i in np.flatnonzero(ds.multiple_choice).tolist():
            cut[i] |= any(len(p) + len(x) > length for p, x, _ in self.choice_pairs(ds, i))
        return cut

    def score_rows(
        self, model: torch.nn.Module, rows: list[np.ndarray], prompt_lengths: list[int], batch_size: int, shared: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """((N,) summed log-probabilities of each row's tokens after its prompt, (N,) their mean
        losses): ``shared`` encodes each distinct prompt once and reuses its KV cache
        (:func:`~fedtune.models.lm_scoring.shared_prompt_logprobs`), else every row runs in full,
        batched by length (:func:`~fedtune.models.lm_scoring.response_logprobs`). The same numbers
        up to floating-point rounding."""
        if shared:
            return lm_scoring.shared_prompt_logprobs(
                model,
                [r[:k] for r, k in zip(rows, prompt_lengths)],
                [r[k:] for r, k in zip(rows, prompt_lengths)],
                batch_size,
            )
        logp, losses = np.zeros(len(rows)), np.zeros(len(rows))
        for chunk in _length_chunks([len(r) for r in rows], batch_size):
            lp, loss = lm_scoring.response_logprobs(model, self.batch((rows, prompt_lengths), chunk))
            logp[chunk], losses[chunk] = lp.float().cpu().numpy(), loss.float().cpu().numpy()
            advance(len(chunk))  # the scoring step's rows
        return logp, losses

    @staticmethod
    def _by_example(items, logp: np.ndarray) -> dict[int, tuple[list[float], list[int]]]:
        out: dict[int, tuple[list[float], list[int]]] = {}
        for (i, _, _, chars), lp in zip(items, logp):
            out.setdefault(i, ([], []))
            out[i][0].append(float(lp))
            out[i][1].append(chars)
        return out

    @torch.no_grad()
    def choice_scores(self, model: torch.nn.Module, ds: llm_text.PromptSet, batch_size: int, shared: bool = True):
        """{example: (summed log-likelihood per option, the options' lengths in characters)} for
        the multiple-choice examples of ``ds``: one row per (example, option); ``shared``: each
        question's context encoded once for all its options (:meth:`score_rows`)."""
        items = self.choice_items(ds)
        logp, _ = self.score_rows(model, [x[1] for x in items], [x[2] for x in items], batch_size, shared)
        return self._by_example(items, logp)

    @torch.no_grad()
    def example_metrics(self, model: torch.nn.Module, batch_size: int, shared: bool = True) -> dict[str, np.ndarray]:
        """Each test example's metrics ((N,) arrays, NaN where a metric skips the example):
        ``loss``, ``rouge_l`` / ``gen_acc`` (generation), ``acc`` / ``acc_norm`` and ``pick``
        (the option ranked first). ``shared`` (the default) scores the response loss and every
        option in one :meth:`score_rows` call that encodes each distinct prompt once (a question's
        options and its answer row share it under ``choice_scoring = "answer"``); ``shared =
        False`` runs every row in full: the same numbers up to rounding. Under ``choice_scoring =
        "lm-eval"`` a question's loss is that of its gold option's continuation."""
        model.eval()
        ds, mc = self.test, self.test.multiple_choice
        n = len(ds)
        lm_eval = self.options.choice_scoring == "lm-eval"
        rows = ([], []) if lm_eval and mc.all() else self.test_rows
        items = self.choice_items(ds) if mc.any() else []
        m = len(rows[0])
        scored = m + len(items)  # rows: each question's answer row and its options'
        what = ", ".join(self.options.sets or []) or Path(str(self.config.data.name)).name  # arc_easy; dolly
        with step(f"scoring {what}", total=n, unit="questions", scale=n / max(scored, 1)):
            logp, losses = self.score_rows(
                model, [*rows[0], *(x[1] for x in items)], [*rows[1], *(x[2] for x in items)], batch_size, shared
            )
        per: dict[str, np.ndarray] = {"loss": losses[:n] if m else np.full(n, np.nan)}
        if self.options.generate:
            texts = self.answers(model, ds, batch_size)
            if mc.any():
                picked = np.array([extract_answer(texts[i], ds.tags[i]) if mc[i] else -1 for i in range(n)])
                per["gen_acc"] = np.where(mc, picked == ds.gold, np.nan)
            if (~mc).any():
                per["rouge_l"] = np.array([np.nan if mc[i] else rouge_l(texts[i], ds.responses[i]) for i in range(n)])
        if mc.any():
            acc, acc_norm, pick = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
            start = m
            for i, (lp, chars) in self._by_example(items, logp[m:]).items():
                pick[i] = int(np.argmax(lp))
                acc[i] = pick[i] == ds.gold[i]
                acc_norm[i] = int(np.argmax(np.asarray(lp) / np.asarray(chars))) == ds.gold[i]
                if lm_eval:
                    per["loss"][i] = losses[start + int(ds.gold[i])]
                start += len(lp)
            per["acc"], per["acc_norm"], per["pick"] = acc, acc_norm, pick
        return per

    def summarize(self, per: dict[str, np.ndarray]) -> dict[str, float]:
        """The metrics of the module docstring from :meth:`example_metrics`."""
        per = {k: v for k, v in per.items() if k != "pick"}
        macro = self.config.data.name == "commonsense"
        metrics = per_label_means(per, self.test.labels, self.test.label_names, macro=macro)
        metrics["accuracy"] = metrics["acc"] if "acc" in metrics else metrics.get("rouge_l", 0.0)
        return metrics

    def evaluate(self, model: torch.nn.Module, batch_size: int, shared: bool = True) -> dict[str, float]:
        """The metrics of the module docstring (:meth:`example_metrics`, :meth:`summarize`)."""
        return self.summarize(self.example_metrics(model, batch_size, shared))


def _length_chunks(lengths: list[int], size: int) -> list[np.ndarray]:
    """Indices 0..N-1 sorted by length, cut into batches of ``size`` (little padding per batch)."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    return [order[i : i + size] for i in range(0, len(order), size)]
