"""``instruction``: an image, a recording, or both, plus a question in; an answer text out.

Data (``data.name``, :mod:`fedtune.data.instruction`): questions over ``fashion-mnist`` (the
default), ``digits`` or ``mnist`` images, over ``fsdd`` recordings, or over an image paired with a
recording (``digits+fsdd``, ``mnist+fsdd``); ``task.questions`` picks the question types.
Model (:mod:`fedtune.models.prefix_lm`): a feature encoder and a projector make
``task.prefix_tokens`` prefix embeddings per modality inside the chat prompt of a causal LM
(``model.name``: ``smollm2``, the default, or ``tiny-llama`` for tests). LoRA adapts the LM's
``q_proj`` / ``v_proj`` (``model.target_modules`` overrides, matched over the whole model); the
projectors (and encoders set trainable) are trained in full next to it (PEFT
``modules_to_save``). Parameter groups: ``encoder`` (encoders and projectors) and
``language_model`` (the LM's LoRA), which CoMMIT tunes at different rates.

Loss: cross-entropy over the answer tokens, averaged per example, then over examples. Metrics:
``accuracy`` (exact match of the greedy answer with the reference, both normalized by
:func:`normalize_answer`), ``loss`` (that cross-entropy on the test set), ``rouge_l`` (mean
ROUGE-L F1 from ``rouge-score``, :func:`fedtune.tasks.text_metrics.rouge_l`; it differs from
exact match only where answers run to several words) and ``accuracy_<question>`` per question type. The reference rate
(:meth:`Instruction.majority_rate`) is the accuracy of always answering the test set's most
frequent answer.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import cached_property
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedtune.config import ConfigError
from fedtune.data import instruction as idata
from fedtune.data.text import source_name
from fedtune.models import prefix_lm as plm
from fedtune.models.precision import load_dtype, model_device, to_device
from fedtune.tasks.base import Task, TaskOptions, register_task
from fedtune.tasks.text_metrics import rouge_l

LM_TARGETS = ("q_proj", "v_proj")
ENCODER_PREFIXES = tuple(f"{m}_{part}." for m in plm.MODALITIES for part in ("encoder", "projector"))
LM_PREFIX = "language_model."
_PUNCT = re.compile(r"[\s.,;:!?]+$")


def normalize_answer(text: str) -> str:
    """Lower case, runs of whitespace as one space, no leading or trailing whitespace, no
    trailing punctuation (``. , ; : ! ?``)."""
    return _PUNCT.sub("", " ".join(text.lower().split()))


class InstructionOptions(TaskOptions):
    questions: list[str] | None = Field(None, description="question types (default: every type of data.name)")
    prefix_tokens: int = Field(4, ge=1, le=64, description="prefix embeddings per modality (K)")
    image_encoder: str = Field("mobilenet-v2", description="a model of fedtune.models.vision (features only)")
    audio_encoder: str = Field(
        "audio-cnn", description="audio-cnn or log-mel (over log-mels), tiny-wav2vec2, or a HF audio model"
    )
    train_encoder: bool | None = Field(None, description="train the encoders (default: only those not pretrained)")
    image_size: int | None = Field(
        None, ge=4, description="image encoder input side (default: the encoder's, 64 for conv nets)"
    )
    projector_width: int = Field(512, ge=0, description="projector hidden width (0: one linear layer)")
    n_mels: int = Field(40, ge=8, le=256, description="audio inputs: mel bands of the log-mel features")
    frames: int = Field(64, ge=8, le=1024, description="log-mel frames per recording (hop 10 ms at 8 kHz)")
    audio_seconds: float = Field(1.0, gt=0, le=10, description="recording length a Hugging Face audio encoder gets")
    system_prompt: str | None = Field("Answer briefly.", description="system turn (None: the chat template's default)")
    partition_by: Literal["answer", "question"] = Field(
        "answer", description="the label the partitioner skews: each example's answer or its question"
    )
    max_new_tokens: int | None = Field(None, ge=1, description="generation budget (default: the longest answer)")


def _audio_extractor(name: str):
    from fedtune.models import audio

    return audio.load_audio_extractor(name)


@register_task
class Instruction(Task):
    kind = "instruction"
    description = (
        "image / audio + question -> answer text: fashion-mnist, digits, mnist, fsdd questions; "
        "encoder + projector prefix into SmolLM2 (LoRA)"
    )
    #: "encoder+lm": trainable parameters split into an ``encoder`` and a ``language_model`` group
    #: (:meth:`parameter_groups`), what CoMMIT's two-component trainers need
    capabilities = frozenset({"lora", "transformer", "encoder+lm"})
    defaults = {"data.name": "fashion-mnist", "model.name": plm.SMOLLM2}
    Options = InstructionOptions
    peft_task_type = None  # a custom module: PEFT's generic PeftModel
    test_overrides = (
        f"model.name={plm.TINY_LLAMA}",
        "data.name=digits",
        "data.max_train_samples=64",
        "data.max_test_samples=16",
        "task.image_size=32",
        "task.prefix_tokens=2",
        "task.projector_width=32",
        "train.batch_size=8",
    )
    #: two modalities at once, and an encoder trained from scratch (the audio conv net)
    test_variants = {"image+audio": ("data.name=digits+fsdd", "task.n_mels=16", "task.frames=16")}
    reference_name = "majority-answer rate"
    options: InstructionOptions

    def __init__(self, config, options) -> None:
        super().__init__(config, options)
        self.family, self.modalities = idata.source_of(config.data.name)
        self.questions = idata.select_questions(self.family, options.questions, config.data.name)
        self._check_encoders()

    def _check_encoders(self) -> None:
        """Unknown encoder names stop here, naming the task option (the model modules' own
        messages name ``model.name``)."""
        opts = self.options
        for modality in self.modalities:
            field = f"{modality}_encoder"
            try:
                if modality == "image":
                    plm.image_preprocessing(opts.image_encoder, None)
                elif opts.audio_encoder not in (plm.AUDIO_CNN, plm.LOG_MEL):
                    _audio_extractor(opts.audio_encoder)
            except ConfigError as exc:
                raise ConfigError(f"task.{field}: {str(exc).split(': ', 1)[-1]}") from None

    # -- data --------------------------------------------------------------------------------
    def load(self) -> tuple[idata.InstructionSet, idata.InstructionSet]:
        train, test = self._items()
        return idata.ask(train, test, self.questions, self.options.partition_by)

    def _items(self) -> tuple[idata.Items, idata.Items]:
        cfg = self.config.data
        name = source_name(cfg)
        if self.family == "spoken":
            return self._recordings()
        from fedtune.data.images import load_image_set

        image_set = name.split("+")[0]
        splits = load_image_set(cfg.model_copy(update={"name": image_set}))
        if self.family == "paired":
            out = []
            for images, recordings in zip(splits, self._recordings()):
                pair = idata.pair_recordings(images.labels, recordings.attrs["label"])
                out.append(
                    idata.Items(
                        {"image": images.images, "audio": recordings.media["audio"][pair]},
                        {"label": images.labels, "spoken": recordings.attrs["label"][pair]},
                    )
                )
            return out[0], out[1]
        train, test = (idata.Items({"image": s.images}, {"label": s.labels}) for s in splits)
        return train, test

    def _recordings(self) -> tuple[idata.Items, idata.Items]:
        """FSDD as the audio encoder's input: per-clip standardized log-mels (``audio-cnn``) or
        what a Hugging Face model's feature extractor makes of ``task.audio_seconds`` of each clip."""
        from fedtune.data.audio import load_fsdd, log_mel, standardize_clips
        from fedtune.data.text import data_dir

        opts = self.options
        out = []
        for split in load_fsdd(data_dir(self.config.data)):
            if opts.audio_encoder in (plm.AUDIO_CNN, plm.LOG_MEL):
                feats = standardize_clips(
                    log_mel(split.waves, split.sample_rate, n_mels=opts.n_mels, frames=opts.frames)
                )
            else:
                from fedtune.models.audio import hf_audio_inputs

                extractor = _audio_extractor(opts.audio_encoder)
                inputs = hf_audio_inputs(extractor, split.waves, split.sample_rate, opts.audio_seconds)
                feats = inputs[extractor.model_input_names[0]].numpy().astype(np.float32)
            out.append(idata.Items({"audio": feats}, {"label": split.labels, "speaker": np.array(split.speakers)}))
        return out[0], out[1]

    @property
    def label_names(self) -> list[str]:
        return self.train.label_names

    def majority_rate(self) -> float:
        """Accuracy of always giving the test set's most frequent answer."""
        counts = Counter(normalize_answer(a) for a in self.test.answers())
        return max(counts.values()) / len(self.test)

    @cached_property
    def tokenizer(self):
        return plm.load_tokenizer(self.config.model.name)

    @cached_property
    def prompts(self) -> idata.Prompts:
        """Every question's prompt and every answer, tokenized once."""
        slots = self.options.prefix_tokens * len(self.modalities)
        return idata.Prompts.build(
            self.tokenizer,
            [q.prompt for q in self.questions],
            self.train.answer_names,
            slots,
            self.options.system_prompt,
        )

    @cached_property
    def image_preprocessing(self) -> plm.ImagePreprocessing:
        return plm.image_preprocessing(self.options.image_encoder, self.options.image_size)

    def _media(self, ds: idata.InstructionSet):
        def media(modality: str, items: np.ndarray) -> torch.Tensor:
            array = ds.items.media[modality][items]
            if modality == "audio":
                return torch.from_numpy(np.ascontiguousarray(array))
            from fedtune.data.images import image_tensor

            pre = self.image_preprocessing
            return image_tensor(array, (pre.size, pre.size), 3, pre.mean, pre.std)

        return media

    def batch(self, ds: idata.InstructionSet, idx: np.ndarray, with_answers: bool = True) -> dict[str, torch.Tensor]:
        """The model's batch of examples ``idx`` of ``ds`` (see :func:`fedtune.data.instruction.collate`)."""
        return idata.collate(ds, idx, self.prompts, self._media(ds), with_answers)

    # -- model -------------------------------------------------------------------------------
    def _encoder_trainable(self, pretrained: bool) -> bool:
        return (not pretrained) if self.options.train_encoder is None else self.options.train_encoder

    def build_model(self, seed: int) -> plm.PrefixLM:
        """LM (frozen unless ``model.finetune = "full"`` for methods without LoRA), encoders
        (frozen when pretrained, unless ``task.train_encoder``) and projectors, each random part
        drawn from ``seed`` (image encoder seed, audio encoder seed + 1, projectors seed + 2, + 3)."""
        opts = self.options
        lm = plm.build_language_model(self.model_name, seed, load_dtype(self.config.model))
        lm.requires_grad_(self.config.model.finetune == "full")
        encoders, projectors = {}, {}
        for i, modality in enumerate(self.modalities):
            if modality == "image":
                enc, pre = plm.build_image_encoder(opts.image_encoder, opts.image_size, seed)
                example = torch.zeros(1, 3, pre.size, pre.size)
            else:
                enc = plm.build_audio_encoder(opts.audio_encoder, opts.n_mels, seed + 1)
                example = torch.as_tensor(self.train.items.media["audio"][:1])  # on the meta device for a skeleton
            enc.requires_grad_(self._encoder_trainable(enc.pretrained))
            with torch.random.fork_rng():
                torch.manual_seed(seed + 2 + i)
                projectors[modality] = plm.Projector(
                    plm.feature_dim(enc, example), lm.config.hidden_size, opts.prefix_tokens, opts.projector_width
                )
            encoders[modality] = enc
        return plm.PrefixLM(lm, encoders, projectors)

    def lora_targets(self) -> list[str]:
        """The full names of the LM's ``q_proj`` / ``v_proj`` (full names, so that an encoder's
        modules of the same name are left alone)."""
        names = plm.language_model_module_names(self.config.model.name, self.config.seed)
        return [LM_PREFIX + n for n in names if n.rsplit(".", 1)[-1] in LM_TARGETS]

    def head_modules(self) -> list[str]:
        """The projectors, and the encoders that train."""
        out = [f"{m}_projector" for m in self.modalities]
        pretrained = {
            "image": plm.image_encoder_pretrained(self.options.image_encoder),
            "audio": plm.audio_encoder_pretrained(self.options.audio_encoder),
        }
        return out + [f"{m}_encoder" for m in self.modalities if self._encoder_trainable(pretrained[m])]

    def parameter_groups(self, names: list[str]) -> dict[str, list[str]]:
        """``encoder``: encoders and projectors; ``language_model``: everything of the LM (its LoRA)."""
        groups: dict[str, list[str]] = {"encoder": [], "language_model": []}
        for n in names:
            if n.startswith(ENCODER_PREFIXES):
                groups["encoder"].append(n)
            elif n.startswith(LM_PREFIX):
                groups["language_model"].append(n)
            else:
                raise ValueError(f"parameter {n!r} belongs to neither the encoder nor the language model")
        return groups

    # -- batches, loss, metrics --------------------------------------------------------------
    def train_batches(self, pool: np.ndarray, batch_size: int, steps: int, rng: np.random.Generator):
        from fedtune.data.batches import index_batches

        for idx in index_batches(pool, batch_size, steps, rng):
            yield self.batch(self.train, idx)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return plm.answer_loss(model, batch)

    def step_shape(self) -> tuple[int, int]:
        """(the longest training row: prompt with its prefix slots, then answer; the longest
        training answer + 1): a batch is padded to its longest row, and :func:`~fedtune.models.prefix_lm.answer_logits`
        computes the LM head over its longest answer and the position before it."""
        prompts, ds = self.prompts, self.train
        answers = np.array([len(a) for a in prompts.answers])[ds.answer]
        rows = np.array([len(p) for p in prompts.prompts])[ds.question] + answers
        return int(rows.max()), int(answers.max()) + 1

    def public_step_shape(self) -> tuple[int, int]:
        """:meth:`step_shape` over every prompt and answer the task can form (its question
        templates and its answer vocabulary, public as a classifier's labels are), not over the
        training rows."""
        answer = self.prompts.max_answer_tokens
        return max(len(p) for p in self.prompts.prompts) + answer, answer + 1

    def generate(self, model: torch.nn.Module, ds: idata.InstructionSet, idx: np.ndarray) -> list[str]:
        """Greedy answers of ``model`` to the examples ``idx`` of ``ds`` (decoded text)."""
        budget = self.options.max_new_tokens or self.prompts.max_answer_tokens
        batch = to_device(self.batch(ds, idx, with_answers=False), model_device(model))
        tokens = plm.unwrap(model).generate(batch, budget, self.prompts.eos_id)
        out = []
        for row in tokens.tolist():
            if self.prompts.eos_id in row:
                row = row[: row.index(self.prompts.eos_id)]
            out.append(self.tokenizer.decode(row, skip_special_tokens=True))
        return out

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, batch_size: int) -> dict[str, float]:
        model.eval()
        ds = self.test
        losses, exact, rouge = np.zeros(len(ds)), np.zeros(len(ds)), np.zeros(len(ds))
        for idx in idata.chunks(idata.eval_order(ds, self.prompts), batch_size):
            logits, targets = plm.answer_logits(model, to_device(self.batch(ds, idx), model_device(model)))
            losses[idx] = plm.example_losses(logits, targets).cpu().numpy()
            for j, text in zip(idx, self.generate(model, ds, idx)):
                reference = ds.answer_names[ds.answer[j]]
                exact[j] = normalize_answer(text) == normalize_answer(reference)
                rouge[j] = rouge_l(text, reference)
        metrics = {"accuracy": float(exact.mean()), "loss": float(losses.mean()), "rouge_l": float(rouge.mean())}
        if len(self.questions) > 1:
            for q, name in enumerate(ds.question_names):
                asked = ds.question == q
                if asked.any():
                    metrics[f"accuracy_{name}"] = float(exact[asked].mean())
        return metrics
