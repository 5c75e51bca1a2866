"""The instruction task: answer-only loss, prefix placement, KV-cache generation, parameter groups,
metrics, and a tiny FedIT run whose saved adapter reloads (tiny-llama, digits images)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedtune.config import ConfigError, load_config
from fedtune.models import prefix_lm as plm
from fedtune.runtime import RunContext, resolve_run
from fedtune.tasks.instruction import Instruction, normalize_answer, rouge_l
from tests import test_task_causal_lm

TINY = ["task.kind=instruction", *Instruction.test_overrides]
model = test_task_causal_lm.model  # the fixture: this module's ctx with an adapter that acts


def config(tmp_path, *overrides):
    return load_config(None, [*TINY, f"output_dir={tmp_path / 'runs'}", *overrides])


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """A tiny context: tiny-llama, digits questions (digit, parity, describe), LoRA rank 4."""
    return RunContext(resolve_run(config(tmp_path_factory.mktemp("instr"), "model.lora_rank=4")))


def rows_by_question(task, ds, question):
    return np.flatnonzero(ds.question == ds.question_names.index(question))


def test_loss_counts_answer_tokens_only(ctx, model):
    task = ctx.task
    ds = task.train
    i, j = rows_by_question(task, ds, "digit")[0], rows_by_question(task, ds, "describe")[0]
    batch = task.batch(ds, np.array([i, j]))
    # the hand-built row of example i: chat prompt with the slots, then the answer and <|im_end|>
    tok = task.tokenizer
    answer = ds.answer_names[ds.answer[i]]
    left = "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
    right = "Which digit is this?<|im_end|>\n<|im_start|>assistant\n"
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    slots = task.options.prefix_tokens
    expected = enc(left) + [tok.pad_token_id] * slots + enc(right) + enc(answer) + [tok.eos_token_id]
    row = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    assert row == expected
    labels = batch["labels"][0][batch["attention_mask"][0].bool()].tolist()
    n_answer = len(enc(answer)) + 1
    assert labels == [-100] * (len(expected) - n_answer) + expected[-n_answer:]
    slot_row = batch["prefix_mask"][0][batch["attention_mask"][0].bool()].tolist()
    assert slot_row == [False] * len(enc(left)) + [True] * slots + [False] * (len(expected) - len(enc(left)) - slots)
    # the loss: per example, the mean over its answer tokens of -log p(token | everything before)
    with torch.no_grad():
        logp = torch.log_softmax(plm.unwrap(model)(batch), -1)
        per_example = []
        for b in range(2):
            pos = torch.nonzero(batch["labels"][b] != -100).flatten()
            per_example.append(-logp[b, pos - 1, batch["labels"][b, pos]].mean())
        assert torch.allclose(task.loss(model, batch), torch.stack(per_example).mean(), atol=1e-5)
        # counting the prompt tokens too would give another number
        ids = batch["input_ids"]
        every = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0][batch["attention_mask"][:, 1:].bool()].mean()
        assert not torch.allclose(task.loss(model, batch), every, atol=1e-3)


def test_prefix_fills_its_slots_and_padding_changes_nothing(ctx, model):
    task = ctx.task
    ds = task.train
    short, long_ = rows_by_question(task, ds, "digit")[0], rows_by_question(task, ds, "describe")[1]
    inner = plm.unwrap(model)
    with torch.no_grad():
        alone = task.batch(ds, np.array([short]))
        padded = task.batch(ds, np.array([short, long_]))
        assert padded["attention_mask"][0].sum() < padded["attention_mask"].shape[1]  # row 0 is left-padded
        emb, _, _ = inner.embed(alone)
        slots = alone["prefix_mask"][0]
        assert torch.equal(emb[0, slots], inner.prefix(alone)[0])
        plain = inner.language_model.get_input_embeddings()(alone["input_ids"])
        assert torch.equal(emb[0, ~slots], plain[0, ~slots])
        a, b = inner(alone)[0], inner(padded)[0]
        assert torch.allclose(a, b[-a.shape[0] :], atol=1e-5)
        # another image (same question and answer tokens): other logits
        other = dict(alone, image=task.batch(ds, np.array([long_]))["image"])
        assert not torch.allclose(inner(other)[0], a, atol=1e-3)


def reference_greedy(inner, batch, steps, eos):
    """Greedy decoding without a cache: the whole sequence through the LM at every step."""
    emb, mask, _ = inner.embed(batch)
    table = inner.language_model.get_input_embeddings()
    done = torch.zeros(emb.shape[0], dtype=torch.bool)
    out = []
    for _ in range(steps):
        logits = inner.language_model(inputs_embeds=emb, attention_mask=mask, position_ids=plm.positions(mask)).logits
        nxt = logits[:, -1].argmax(-1).masked_fill(done, eos)
        out.append(nxt)
        done |= nxt == eos
        if bool(done.all()):
            break
        emb = torch.cat([emb, table(nxt)[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(out, 1)


def test_greedy_generation_with_cache_equals_stepwise_argmax(ctx, model):
    task = ctx.task
    ds = task.test
    idx = np.concatenate([rows_by_question(task, ds, q)[:2] for q in ("digit", "describe")])
    batch = task.batch(ds, idx, with_answers=False)
    inner = plm.unwrap(model)
    with torch.no_grad():
        cached = inner.generate(batch, 12, task.prompts.eos_id)
        ref = reference_greedy(inner, batch, 12, task.prompts.eos_id)
        assert torch.equal(cached, ref)
        # a row that stops (an end token chosen as the one row 0 emits first) keeps emitting it
        first = int(ref[0, 0])
        stopped = inner.generate(batch, 12, first)
        assert torch.equal(stopped, reference_greedy(inner, batch, 12, first))
        assert (stopped[0] == first).all()


def test_parameter_groups_split_encoder_and_language_model_exactly(tmp_path):
    for overrides, encoder_trains in (
        ([], False),
        (["task.train_encoder=true"], True),
        (["task.image_encoder=small-cnn"], True),
    ):
        c = RunContext(resolve_run(config(tmp_path, "model.lora_rank=2", *overrides)))
        names = list(c.workspace.activate(2))
        groups = c.task.parameter_groups(names)
        assert set(groups) == {"encoder", "language_model"}
        assert sorted(groups["encoder"] + groups["language_model"]) == sorted(names)
        assert all(n.startswith("language_model.") and ".lora_" in n for n in groups["language_model"])
        assert all(n.startswith(("image_encoder.", "image_projector.")) for n in groups["encoder"])
        assert any(n.startswith("image_projector.") for n in groups["encoder"])
        assert any(n.startswith("image_encoder.") for n in groups["encoder"]) == encoder_trains
        assert len(groups["language_model"]) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    with pytest.raises(ValueError, match="neither"):
        c.task.parameter_groups(["classifier.weight"])


def test_answer_normalization_and_rouge_l():
    assert normalize_answer("  Ankle   Boot. ") == "ankle boot"
    assert normalize_answer("Yes!?") == "yes"
    assert normalize_answer("T-Shirt") == "t-shirt"
    assert normalize_answer("a, b") == "a, b"  # only trailing punctuation goes
    # LCS("the cat sat on the mat", "the cat on the mat") = 5: P = 5/6, R = 1, F = 10/11
    assert rouge_l("The cat sat on the mat.", "the cat on the mat") == pytest.approx(10 / 11)
    assert rouge_l("a b c d", "d c b a") == pytest.approx(0.25)  # LCS 1
    assert rouge_l("a sneaker, worn on the feet", "a sneaker worn on the feet") == 1.0
    assert rouge_l("", "") == 1.0 and rouge_l("yes", "") == 0.0 and rouge_l("no", "yes") == 0.0


def test_majority_rate_and_bad_options(ctx, tmp_path):
    answers = [normalize_answer(a) for a in ctx.task.test.answers()]
    assert ctx.task.majority_rate() == max(answers.count(a) for a in set(answers)) / len(answers)
    with pytest.raises(ConfigError, match=r"^task\.questions: 'colour' is not a question about digits"):
        RunContext(resolve_run(config(tmp_path, "task.questions=['colour']")))
    with pytest.raises(ConfigError, match=r"^data\.name: 'sst2' has no instruction questions"):
        RunContext(resolve_run(config(tmp_path, "data.name=sst2")))
    with pytest.raises(ConfigError, match=r"^task\.prefix_tokens"):
        RunContext(resolve_run(config(tmp_path, "task.prefix_tokens=0")))


def test_fedit_run_saves_an_adapter_that_reloads_with_equal_outputs(tmp_path):
    from peft import PeftModel

    from fedtune.checkpoint import load_state
    from fedtune.run import run_experiment

    cfg = config(
        tmp_path,
        "method=fedit",
        "rounds=1",
        "federation.num_clients=2",
        "train.local_steps=2",
        "task.questions=['digit', 'parity']",
    )
    summary = run_experiment(cfg)
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and np.isfinite(summary["final_loss"])
    run_dir = tmp_path / "runs" / cfg.run_name
    ctx = RunContext(resolve_run(cfg))
    task = ctx.task
    batch = task.batch(task.test, np.arange(6))
    ctx.workspace.load(load_state(run_dir / "checkpoint.npz")["global"], cfg.model.lora_rank)
    reloaded = PeftModel.from_pretrained(task.build_model(cfg.seed), str(run_dir / "adapter")).eval()
    fresh = task.build_model(cfg.seed).eval()
    with torch.no_grad():
        expected = plm.unwrap(ctx.workspace.model.eval())(batch)
        assert torch.allclose(plm.unwrap(reloaded)(batch), expected, atol=1e-5)
        assert not torch.allclose(fresh(batch), expected, atol=1e-4)  # the adapter changed something


def test_pairing_matches_half_the_images_and_never_mismatches_a_match():
    from fedtune.data.instruction import pair_recordings

    image_labels = np.arange(1000) % 10
    audio_labels = np.repeat(np.arange(10), 7)
    pair = pair_recordings(image_labels, audio_labels)
    assert np.array_equal(pair, pair_recordings(image_labels, audio_labels))  # seeded
    same = audio_labels[pair] == image_labels
    assert 0.45 < same.mean() < 0.55
    assert set(np.unique(audio_labels[pair][~same])) == set(range(10))  # mismatches spread over the digits


def test_image_and_audio_questions_give_two_prefixes_and_two_trained_encoders(tmp_path):
    c = RunContext(
        resolve_run(config(tmp_path, "data.name=digits+fsdd", "model.lora_rank=2", "task.n_mels=16", "task.frames=16"))
    )
    task = c.task
    ds = task.train
    assert task.modalities == ("image", "audio") and ds.question_names == ["match", "spoken", "written"]
    attrs = ds.items.attrs
    for k in np.flatnonzero(ds.question == 0)[:20]:  # "match" answers follow the pairing
        i = ds.item[k]
        assert ds.answer_names[ds.answer[k]] == ("yes" if attrs["label"][i] == attrs["spoken"][i] else "no")
    batch = task.batch(ds, np.arange(4))
    assert batch["prefix_mask"].sum(1).tolist() == [2 * task.options.prefix_tokens] * 4
    assert tuple(batch["audio"].shape) == (4, 16, 16) and tuple(batch["image"].shape) == (4, 3, 32, 32)
    params = c.workspace.activate(2)
    groups = task.parameter_groups(list(params))
    # the image encoder is pretrained (frozen), the audio conv net learns from scratch
    assert {n.split(".")[0] for n in groups["encoder"]} == {"image_projector", "audio_projector", "audio_encoder"}
    loss = task.loss(c.workspace.model, batch)
    loss.backward()
    assert all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in groups["encoder"])
    c.workspace.model.zero_grad(set_to_none=True)


def test_hugging_face_encoders_by_name(tmp_path):
    """The Hugging Face paths (tiny random ViT and wav2vec2 built in code): their attention's
    query / value and q_proj / v_proj stay without LoRA, and random encoders train."""
    for overrides, encoder in (
        (["task.image_encoder=tiny-vit"], "image_encoder"),
        (["data.name=fsdd", "task.audio_encoder=tiny-wav2vec2", "task.audio_seconds=0.25"], "audio_encoder"),
    ):
        c = RunContext(resolve_run(config(tmp_path, "model.lora_rank=2", "data.max_train_samples=16", *overrides)))
        params = c.workspace.activate(2)
        groups = c.task.parameter_groups(list(params))
        assert any(n.startswith(encoder + ".") for n in groups["encoder"])
        assert not any(".lora_" in n for n in groups["encoder"])
        assert len(groups["language_model"]) == 8
        batch = c.task.batch(c.task.train, np.arange(3))
        assert np.isfinite(c.task.loss(c.workspace.model, batch).item())
    with pytest.raises(ConfigError, match=r"^task\.image_encoder: "):
        RunContext(resolve_run(config(tmp_path, "task.image_encoder=/no/such/encoder")))
