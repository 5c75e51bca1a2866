"""Instruction data: questions with one-phrase answers about images and spoken digits, and the
token rows a prefix language model (:mod:`fedtune.models.prefix_lm`) trains on.

Data sets (``data.name``) and their question types (``task.questions``, default: all of them):

- ``fashion-mnist`` (images): ``class`` "What item of clothing is this?" -> "ankle boot";
  ``feet`` "Is this worn on the feet?" -> "yes" / "no"; ``category`` "Is this clothing,
  footwear or a bag?" -> "clothing" / "footwear" / "bag"; ``describe`` "Describe the picture."
  -> "a sneaker, worn on the feet" (longer answers, scored by ROUGE-L too).
- ``digits`` / ``mnist`` (images of handwritten digits): ``digit`` "Which digit is this?" ->
  "three"; ``parity`` "Is the digit even or odd?" -> "odd"; ``describe`` "Describe the picture."
  -> "a handwritten three, an odd digit".
- ``fsdd`` (recordings of spoken digits, the official split): ``digit`` "Which digit is
  spoken?" -> "three"; ``parity`` "Is the spoken digit even or odd?"; ``speaker`` "Who is
  speaking?" -> "jackson"; ``describe`` "Describe the recording." -> "jackson says three".
- ``digits+fsdd`` / ``mnist+fsdd`` (an image and a recording together): each image is paired
  with one recording of the same split, of the same digit for half of the images and of a
  uniformly drawn other digit for the rest (seed 0, :func:`pair_recordings`); ``match`` "Is the
  spoken digit the one in the picture?" -> "yes" / "no"; ``spoken`` "Which digit is spoken?";
  ``written`` "Which digit is written?".

Every media item is asked every chosen question: example ``k`` is item ``k // Q`` asked
question ``k % Q``. The labels the partitioners see are the answers (``task.partition_by =
"answer"``) or the question types (``"question"``).

Token rows: the prompt is the tokenizer's chat template over ``[system, user]`` turns, the
user turn holding P placeholder slots (K prefix tokens per modality) and then the question;
the answer follows the assistant header and ends with the end-of-turn token. The prompt of
each question type and each answer are tokenized once. Rows are left-padded; ``labels`` are
-100 except on the answer tokens (the end-of-turn token included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from fedtune.config import ConfigError

DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
FASHION_ITEMS = ["t-shirt", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]
FASHION_NOUNS = [
    "t-shirt",
    "pair of trousers",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
]
FASHION_WORN = [
    "worn on the upper body",
    "worn on the legs",
    "worn on the upper body",
    "worn on the body",
    "worn on the upper body",
    "worn on the feet",
    "worn on the upper body",
    "worn on the feet",
    "carried",
    "worn on the feet",
]
FASHION_CATEGORY = ["clothing"] * 5 + ["footwear", "clothing", "footwear", "bag", "footwear"]
IMAGE_SETS = ("fashion-mnist", "digits", "mnist")
PAIR_SEED = 0


@dataclass(frozen=True)
class Question:
    name: str
    prompt: str
    answer: Callable[[dict], str]  # an item's attributes -> the answer text


def _parity(d: int) -> str:
    return "even" if d % 2 == 0 else "odd"


QUESTIONS: dict[str, list[Question]] = {
    "fashion": [
        Question("class", "What item of clothing is this?", lambda a: FASHION_ITEMS[a["label"]]),
        Question(
            "feet", "Is this worn on the feet?", lambda a: "yes" if FASHION_WORN[a["label"]].endswith("feet") else "no"
        ),
        Question("category", "Is this clothing, footwear or a bag?", lambda a: FASHION_CATEGORY[a["label"]]),
        Question(
            "describe", "Describe the picture.", lambda a: f"a {FASHION_NOUNS[a['label']]}, {FASHION_WORN[a['label']]}"
        ),
    ],
    "digits": [
        Question("digit", "Which digit is this?", lambda a: DIGIT_WORDS[a["label"]]),
        Question("parity", "Is the digit even or odd?", lambda a: _parity(a["label"])),
        Question(
            "describe",
            "Describe the picture.",
            lambda a: f"a handwritten {DIGIT_WORDS[a['label']]}, an {_parity(a['label'])} digit",
        ),
    ],
    "spoken": [
        Question("digit", "Which digit is spoken?", lambda a: DIGIT_WORDS[a["label"]]),
        Question("parity", "Is the spoken digit even or odd?", lambda a: _parity(a["label"])),
        Question("speaker", "Who is speaking?", lambda a: a["speaker"]),
        Question("describe", "Describe the recording.", lambda a: f"{a['speaker']} says {DIGIT_WORDS[a['label']]}"),
    ],
    "paired": [
        Question(
            "match",
            "Is the spoken digit the one in the picture?",
            lambda a: "yes" if a["label"] == a["spoken"] else "no",
        ),
        Question("spoken", "Which digit is spoken?", lambda a: DIGIT_WORDS[a["spoken"]]),
        Question("written", "Which digit is written?", lambda a: DIGIT_WORDS[a["label"]]),
    ],
}


def source_of(name: str | None) -> tuple[str, tuple[str, ...]]:
    """(question family, modalities) of ``data.name``."""
    if name == "fashion-mnist":
        return "fashion", ("image",)
    if name in ("digits", "mnist"):
        return "digits", ("image",)
    if name == "fsdd":
        return "spoken", ("audio",)
    if name in ("digits+fsdd", "mnist+fsdd"):
        return "paired", ("image", "audio")
    raise ConfigError(
        f"data.name: {name!r} has no instruction questions; expected fashion-mnist, digits, mnist, fsdd, "
        "digits+fsdd or mnist+fsdd"
    )


def select_questions(family: str, names: list[str] | None, data_name: str) -> list[Question]:
    """The question types ``names`` of ``family`` (all of them when None), in the order given."""
    known = {q.name: q for q in QUESTIONS[family]}
    if names is None:
        return list(known.values())
    if not names:
        raise ConfigError("task.questions: expected at least one question type")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"task.questions: {unknown[0]!r} is not a question about {data_name}; expected one of {', '.join(known)}"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"task.questions: a question type is listed twice ({names})")
    return [known[n] for n in names]


# -- items and examples -------------------------------------------------------------------------
@dataclass
class Items:
    """Media items: aligned arrays per modality (``image``: (N, H, W, C) uint8; ``audio``:
    (N, n_mels, frames) float32) and per-item attributes (``label``, ``speaker``, ``spoken``)."""

    media: dict[str, np.ndarray]
    attrs: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.attrs.values())))


@dataclass
class InstructionSet:
    """Examples (item, question, answer) over shared media arrays; ``labels`` for partitioning."""

    items: Items
    item: np.ndarray  # (N,) index into the media arrays
    question: np.ndarray  # (N,) index into question_names
    answer: np.ndarray  # (N,) index into answer_names
    question_names: list[str]
    answer_names: list[str]
    partition_by: str = "answer"
    labels: np.ndarray = field(init=False)
    label_names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        by_answer = self.partition_by == "answer"
        self.labels = (self.answer if by_answer else self.question).astype(np.int64)
        self.label_names = list(self.answer_names if by_answer else self.question_names)

    def __len__(self) -> int:
        return len(self.item)

    def subset(self, idx: np.ndarray) -> InstructionSet:
        idx = np.asarray(idx, dtype=np.int64)
        return InstructionSet(
            self.items,
            self.item[idx],
            self.question[idx],
            self.answer[idx],
            self.question_names,
            self.answer_names,
            self.partition_by,
        )

    def answers(self) -> list[str]:
        return [self.answer_names[a] for a in self.answer]


def ask(
    train: Items, test: Items, questions: list[Question], partition_by: str
) -> tuple[InstructionSet, InstructionSet]:
    """Every item asked every question (example k = item k // Q, question k % Q); one answer
    vocabulary over both splits, in order of first appearance (training pool first)."""
    texts = []
    for items in (train, test):
        rows = [
            {k: v[i].item() if hasattr(v[i], "item") else v[i] for k, v in items.attrs.items()}
            for i in range(len(items))
        ]
        texts.append([q.answer(r) for r in rows for q in questions])
    vocab = list(dict.fromkeys(texts[0] + texts[1]))
    index = {a: i for i, a in enumerate(vocab)}
    out = []
    for items, answers in zip((train, test), texts):
        n, q = len(items), len(questions)
        out.append(
            InstructionSet(
                items,
                np.repeat(np.arange(n), q),
                np.tile(np.arange(q), n),
                np.array([index[a] for a in answers], dtype=np.int64),
                [x.name for x in questions],
                vocab,
                partition_by,
            )
        )
    return out[0], out[1]


def pair_recordings(image_labels: np.ndarray, audio_labels: np.ndarray, seed: int = PAIR_SEED) -> np.ndarray:
    """For each image, the index of one recording: of the image's digit for a random half of
    the images, of a uniformly drawn other digit otherwise (digits with recordings only);
    the recording is drawn uniformly among those of the chosen digit."""
    rng = np.random.default_rng([seed, 7])
    by_digit = {d: np.flatnonzero(audio_labels == d) for d in np.unique(audio_labels)}
    digits = np.array(sorted(by_digit))
    out = np.empty(len(image_labels), dtype=np.int64)
    same = rng.random(len(image_labels)) < 0.5
    for i, (label, keep) in enumerate(zip(image_labels, same)):
        others = digits[digits != label]
        d = label if (keep and label in by_digit) or len(others) == 0 else rng.choice(others)
        out[i] = rng.choice(by_digit[d])
    return out


# -- token rows ---------------------------------------------------------------------------------
SLOT = "\x00"  # marks where the prefix slots go in the rendered chat text


@dataclass
class Prompts:
    """Token ids of every question's prompt (prefix slots included) and of every answer."""

    prompts: list[np.ndarray]  # per question: ids, slots filled with pad_id
    slots: list[np.ndarray]  # per question: bool, True on the prefix slots
    answers: list[np.ndarray]  # per answer text: ids + end-of-turn
    pad_id: int
    eos_id: int

    @classmethod
    def build(cls, tokenizer, questions: list[str], answers: list[str], num_slots: int, system: str | None) -> Prompts:
        """Render each question with the chat template (``system`` as the system turn; None
        leaves the template's default) and tokenize the text around the slot marker."""
        prompts, slots = [], []
        for question in questions:
            turns = ([{"role": "system", "content": system}] if system is not None else []) + [
                {"role": "user", "content": SLOT + question}
            ]
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
            left, right = text.split(SLOT)
            ids_l, ids_r = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (left, right))
            ids = np.array([*ids_l, *[tokenizer.pad_token_id] * num_slots, *ids_r], dtype=np.int64)
            mask = np.zeros(len(ids), dtype=bool)
            mask[len(ids_l) : len(ids_l) + num_slots] = True
            prompts.append(ids)
            slots.append(mask)
        eos = tokenizer.eos_token_id
        encoded = [
            np.array([*tokenizer(a, add_special_tokens=False)["input_ids"], eos], dtype=np.int64) for a in answers
        ]
        return cls(prompts, slots, encoded, tokenizer.pad_token_id, eos)

    @property
    def max_answer_tokens(self) -> int:
        return max(len(a) for a in self.answers)


def collate(
    ds: InstructionSet,
    idx: np.ndarray,
    prompts: Prompts,
    media: Callable[[str, np.ndarray], torch.Tensor],
    with_answers: bool,
) -> dict[str, torch.Tensor]:
    """The batch of examples ``idx``: left-padded token rows (prompt, then the answer when
    ``with_answers``), ``prefix_mask``, ``labels`` (with answers) and each modality's tensor,
    ``media(modality, item indices)``."""
    rows, slot_rows, label_rows = [], [], []
    for i in idx:
        q = ds.question[i]
        ans = prompts.answers[ds.answer[i]] if with_answers else np.zeros(0, dtype=np.int64)
        rows.append(np.concatenate([prompts.prompts[q], ans]))
        slot_rows.append(np.concatenate([prompts.slots[q], np.zeros(len(ans), dtype=bool)]))
        label_rows.append(np.concatenate([np.full(len(prompts.prompts[q]), -100, dtype=np.int64), ans]))
    width = max(len(r) for r in rows)
    n = len(rows)
    input_ids = np.full((n, width), prompts.pad_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.int64)
    slots = np.zeros((n, width), dtype=bool)
    labels = np.full((n, width), -100, dtype=np.int64)
    for j, (r, s, lab) in enumerate(zip(rows, slot_rows, label_rows)):
        input_ids[j, width - len(r) :] = r
        mask[j, width - len(r) :] = 1
        slots[j, width - len(r) :] = s
        labels[j, width - len(r) :] = lab
    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "prefix_mask": torch.from_numpy(slots),
    }
    if with_answers:
        batch["labels"] = torch.from_numpy(labels)
    items = ds.item[np.asarray(idx, dtype=np.int64)]
    for modality in ds.items.media:
        batch[modality] = media(modality, items)
    return batch


def eval_order(ds: InstructionSet, prompts: Prompts) -> np.ndarray:
    """Every example once, grouped by prompt length (so a batch needs little padding)."""
    lengths = np.array([len(prompts.prompts[q]) for q in ds.question])
    return np.argsort(lengths, kind="stable")


def chunks(order: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for i in range(0, len(order), size):
        yield order[i : i + size]
