"""A finished causal-LM run put to use (tiny-llama): the adapter names its base portably and
reloads through plain PEFT with the run's own loss, ``fedtune export`` (adapter, merged),
``fedtune eval`` (the run's own numbers back; a bare model; not the base in the adapter's place),
the hub-cache entry that makes a packaged model's hub id resolve offline, and one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedtune.cli import app
from fedtune.config import load_config
from fedtune.models.hub_ids import hub_id
from fedtune.tasks.causal_lm import CausalLM
from fedtune.trained.loader import ADAPTER_CONFIG, open_run

runner = CliRunner()
TINY = ["task.kind=causal-lm", *CausalLM.test_overrides]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from fedtune.run import run_experiment

    out = tmp_path_factory.mktemp("trained")
    cfg = load_config(
        None,
        [
            *TINY,
            f"output_dir={out}",
            "name=tiny",
            "method=fedit",
            "rounds=2",
            "federation.num_clients=2",
            "train.local_steps=3",
            "train.lr=5e-2",
            "train.threads=1",
        ],
    )
    return Path(run_experiment(cfg)["run_dir"])


def _batch(task):
    return task.batch(task.test_rows, np.arange(len(task.test)))


def test_hub_ids_name_packaged_models_by_hub_id_and_folders_by_absolute_path(tmp_path, monkeypatch):
    assert hub_id("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id("minilm") == "sentence-transformers/all-MiniLM-L6-v2"
    assert hub_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert hub_id("m") == str(tmp_path / "m")
    assert hub_id("tiny-llama") == "tiny-llama"


def test_export_writes_an_adapter_plain_peft_loads_with_the_runs_loss(run_dir, tmp_path):
    from peft import AutoPeftModelForCausalLM

    assert json.loads((run_dir / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "tiny-llama"
    )
    out = tmp_path / "export"
    result = runner.invoke(app, ["export", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()  # plain PEFT, nothing of fedtune
    run = open_run(run_dir)
    task = run.task()
    batch = _batch(task)
    with torch.no_grad():
        expected = task.loss(run.model(task), batch)
        assert torch.allclose(task.loss(reloaded, batch), expected, atol=1e-5)
        base = task.loss(task.build_model(run.config.seed).eval(), batch)
        assert not torch.allclose(base, expected, atol=1e-3)  # the adapter acts: a base-only reload fails
    assert (out / "tokenizer.json").is_file() and (out / "prompt_template.json").is_file()
    assert "library_name: peft" in (out / "README.md").read_text()


def test_merged_export_gives_the_adapter_models_logits(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    result = runner.invoke(app, ["export", str(run_dir), "--merged", "--out", str(out)])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    run = open_run(run_dir)
    task = run.task()
    batch = _batch(task)
    adapter = run.model(task)
    with torch.no_grad():
        want = adapter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        base = task.build_model(run.config.seed)(input_ids=batch["input_ids"]).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-3)
    card = (out / "README.md").read_text()  # the model card: base weights, method, rounds, data, evaluation
    assert "library_name: transformers" in card and "built in code from the run's seed" in card
    assert "method: fedit; rounds: 2; clients: 2" in card and "data: commonsense (sets: arc_easy, boolq)" in card
    assert "last round, the run's own test set" in card and f"accuracy {run_final(run_dir)['accuracy']:.4f}" in card


def test_model_card_reports_the_runs_eval_json_with_its_protocol(run_dir, tmp_path):
    from fedtune.trained.export import model_card

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    result = {"protocol": {"name": "lm-eval"}, "sets": {"arc_easy": {"n": 4, "acc": 0.5}, "dolly": {"n": 3}}}
    (copy / "eval.json").write_text(json.dumps(result))
    card = model_card(open_run(copy), merged=False)
    assert "`fedtune eval` (`eval.json`, protocol lm-eval): arc_easy acc 0.5000 (n=4)" in card
    assert "base_model:" not in card  # tiny-llama exists on no hub


def run_final(run_dir: Path) -> dict:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]


def gguf_marked(build):
    """``build`` (plm.build_language_model) whose models transformers takes for GGUF-read ones (as
    the packaged SmolLM2's): marked quantized with gguf, which ``save_pretrained`` refuses."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    def marked(*args, **kwargs):
        model = build(*args, **kwargs)
        model.config.quantization_config = GgufConfig()
        model.hf_quantizer = GgufHfQuantizer(model.config.quantization_config)
        return model

    return marked


def test_merged_export_of_a_gguf_read_base_saves_plain_weights(run_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from fedtune.models import prefix_lm as plm

    monkeypatch.setattr(plm, "build_language_model", gguf_marked(plm.build_language_model))
    run = open_run(run_dir)
    task = run.task()
    with pytest.raises(ValueError, match="not serializable"):  # what --merged failed on before
        task.build_model(0).save_pretrained(tmp_path / "plain")
    out = tmp_path / "merged"
    result = runner.invoke(app, ["export", str(run_dir), "--merged", "--out", str(out)])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert getattr(merged.config, "quantization_config", None) is None
    batch = _batch(task)
    with torch.no_grad():
        want = run.model(task)(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(got, want, atol=1e-5)


def test_eval_of_the_run_folder_gives_the_runs_final_metrics_not_the_bases(run_dir):
    from fedtune.trained.evaluate import Target, evaluate

    final = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = runner.invoke(app, ["eval", str(run_dir), "--batch-size", "5", "--baseline"])
        assert torch.get_num_threads() == 1  # the run's train.threads
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    assert "arc_easy" in result.output and "±" in result.output
    saved = json.loads((run_dir / "eval.json").read_text())
    own = saved["metrics"]["run test set"]
    assert own["accuracy"] == pytest.approx(final["accuracy"]) and own["acc_norm"] == pytest.approx(final["acc_norm"])
    assert own["loss"] == pytest.approx(final["loss"], abs=1e-5)
    assert saved["average"]["acc"] == pytest.approx(final["accuracy"])
    n = saved["sets"]["arc_easy"]["n"]
    p = saved["sets"]["arc_easy"]["acc"]
    assert saved["sets"]["arc_easy"]["acc_se"] == pytest.approx((p * (1 - p) / n) ** 0.5)
    # the base in the adapter's place scores another loss on the same examples
    bare = evaluate(Target(open_run(run_dir).config, None, "base", run_dir), [])
    assert abs(bare["metrics"]["run test set"]["loss"] - final["loss"]) > 1e-3
    # --baseline without --tasks: the base on the run's own test set and protocol
    assert saved["protocol"]["name"] == "run" and saved["protocol"]["prompt_template"] == "chat"
    assert saved["baseline"]["metrics"]["run test set"] == pytest.approx(bare["metrics"]["run test set"], abs=1e-5)
    assert saved["paired"]["sets"]["arc_easy"]["acc"] == pytest.approx(
        saved["sets"]["arc_easy"]["acc"] - saved["baseline"]["sets"]["arc_easy"]["acc"]
    )


def test_eval_of_a_bare_model_on_named_sets(tmp_path):
    out = tmp_path / "bare.json"
    result = runner.invoke(app, ["eval", "tiny-llama", "--tasks", "arc_easy,dolly", "--limit", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["adapter"] is None and saved["sets"]["arc_easy"]["n"] == 3 and saved["sets"]["dolly"]["n"] == 3
    assert 0 <= saved["sets"]["arc_easy"]["acc"] <= 1 and 0 <= saved["sets"]["dolly"]["rouge_l"] <= 1
    again = runner.invoke(app, ["eval", "tiny-llama", "--tasks", "arc_easy", "--limit", "3", "--out", str(out)])
    assert again.exit_code == 0, again.output  # --limit: the first N, the same questions again
    assert json.loads(out.read_text())["sets"]["arc_easy"] == saved["sets"]["arc_easy"]
    assert saved["protocol"]["name"] == "lm-eval" and saved["protocol"]["chat_template"] is None
    assert saved["versions"]["fedtune"] and saved["versions"]["transformers"] and saved["versions"]["torch"]


def test_a_local_question_file_is_a_set(tmp_path):
    """``--tasks FILE.jsonl``: a file of ``{question, choices, gold}`` rows, asked as ARC is: ARC-Easy's
    first questions written to a file score as ``arc_easy`` does."""
    import os

    from fedtune.data import llm_text

    rows = llm_text.read_jsonl(Path(os.environ["FEDTUNE_DATA_DIR"]) / "commonsense" / "arc_easy_test.jsonl.gz")[:4]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({k: r[k] for k in ("question", "choices", "gold")}) + "\n" for r in rows))
    out = tmp_path / "e.json"
    args = ["eval", "tiny-llama", "--tasks", f"{path},arc_easy", "--limit", "3", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert saved["sets"][str(path)]["n"] == 3
    assert saved["examples"][str(path)]["pick"] == saved["examples"]["arc_easy"]["pick"]
    assert saved["examples"][str(path)]["loss"] == pytest.approx(saved["examples"]["arc_easy"]["loss"], abs=1e-5)
    _one_line_error(["eval", "tiny-llama", "--tasks", str(tmp_path / "none.jsonl")], "none.jsonl", "not a file")
    _one_line_error(["eval", "tiny-llama", "--tasks", str(path), "--num-fewshot", "1"], "--num-fewshot")


def test_limit_takes_the_first_questions_and_truncation_warns(tmp_path):
    from fedtune.trained.evaluate import evaluate, target_of

    five = evaluate(target_of("tiny-llama"), ["arc_easy"], limit=5)["examples"]["arc_easy"]
    two = evaluate(target_of("tiny-llama"), ["arc_easy"], limit=2)["examples"]["arc_easy"]
    assert two["pick"] == five["pick"][:2] and two["loss"] == pytest.approx(five["loss"][:2], abs=1e-5)
    assert len(set(five["loss"])) == 5  # five distinct questions
    out = tmp_path / "run-protocol.json"
    args = ["eval", "tiny-llama", "--tasks", "arc_easy", "--limit", "2", "--protocol", "run", "--out", str(out)]
    result = runner.invoke(app, args)  # a bare model under a run's defaults: 64 tokens, prompts cut
    assert result.exit_code == 0, result.output
    assert "warning: arc_easy: 2 of 2 examples cut to 64 tokens" in result.output
    saved = json.loads(out.read_text())
    assert saved["truncated"] == {"arc_easy": 2} and saved["protocol"]["name"] == "run"
    assert saved["protocol"]["prompt_template"] == "chat" and saved["protocol"]["chat_template"]
    with pytest.warns(UserWarning, match="arc_easy: 2 of 2 examples cut"):
        evaluate(target_of("tiny-llama"), ["arc_easy"], limit=2, protocol="run")
    lm_eval = runner.invoke(app, [*args[:-4], "--out", str(out)])
    assert lm_eval.exit_code == 0 and "warning" not in lm_eval.output
    assert json.loads(out.read_text())["truncated"] == {"arc_easy": 0}


def test_a_run_and_its_base_on_one_protocol_with_the_paired_difference(run_dir, tmp_path):
    from fedtune.trained.evaluate import Target, evaluate

    out = tmp_path / "eval.json"
    args = ["eval", str(run_dir), "--tasks", "arc_easy,csqa", "--limit", "6", "--baseline", "--out", str(out)]
    result = runner.invoke(app, [*args, "--batch-size", "7"])
    assert result.exit_code == 0, result.output
    assert "run - base on protocol lm-eval" in result.output
    saved = json.loads(out.read_text())
    # acc_norm where lm-eval's task reports it: ARC's options differ in length, CSQA's letters do not
    assert "acc_norm" in saved["sets"]["arc_easy"] and "acc_norm" not in saved["sets"]["csqa"]
    bare = runner.invoke(app, ["eval", "tiny-llama", "--tasks", "arc_easy", "--out", str(tmp_path / "bare.json")])
    assert bare.exit_code == 0, bare.output
    assert json.loads((tmp_path / "bare.json").read_text())["protocol"] == saved["protocol"]  # one protocol
    # the baseline is the run's base scored on the run's units and protocol
    base = evaluate(Target(open_run(run_dir).config, None, "base", run_dir), ["arc_easy", "csqa"], limit=6)
    for name in ("arc_easy", "csqa"):
        mine, theirs = saved["baseline"]["examples"][name], base["examples"][name]
        assert mine["pick"] == theirs["pick"] and mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert saved["examples"][name]["loss"] != pytest.approx(mine["loss"], abs=1e-4)  # the adapter acts
        d = np.array(saved["examples"][name]["acc"]) - np.array(mine["acc"])
        row = saved["paired"]["sets"][name]
        assert row["acc"] == pytest.approx(d.mean()) and row["n"] == 6
        assert row["acc_se"] == pytest.approx(d.std(ddof=1) / np.sqrt(6), nan_ok=True)
        dl = np.array(saved["examples"][name]["loss"]) - np.array(mine["loss"])
        assert row["loss"] == pytest.approx(dl.mean()) and row["loss_se"] == pytest.approx(dl.std(ddof=1) / np.sqrt(6))


def test_packaged_hub_id_resolves_offline_through_the_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants
    from transformers import AutoConfig

    from fedtune.models.hub_cache import link_packaged
    from fedtune.models.loading import resolve_model_path

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    hub = "sentence-transformers/all-MiniLM-L6-v2"
    snapshot = link_packaged(hub)
    assert snapshot is not None and (snapshot / "config.json").resolve().parent == Path(resolve_model_path("minilm"))
    assert AutoConfig.from_pretrained(hub).hidden_size == 384  # HF_HUB_OFFLINE=1: only the cache answers
    # a real download is never replaced
    other = tmp_path / "other"
    (other / "models--sentence-transformers--all-MiniLM-L6-v2" / "refs").mkdir(parents=True)
    (other / "models--sentence-transformers--all-MiniLM-L6-v2" / "refs" / "main").write_text("a" * 40)
    assert link_packaged(hub, root=other) is None
    assert link_packaged("Qwen/Qwen2.5-0.5B") is None


def _one_line_error(args, *expected):
    result = runner.invoke(app, args)
    assert result.exit_code != 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for text in expected:
        assert text in lines[0], lines[0]


def test_bad_input_gives_one_line_naming_the_path(run_dir, tmp_path, monkeypatch):
    _one_line_error(["export", str(tmp_path / "nope")], "nope", "not a run folder")
    (tmp_path / "empty").mkdir()
    _one_line_error(["export", str(tmp_path / "empty")], "empty", "no config.toml")
    _one_line_error(["eval", str(tmp_path / "empty")], "empty", "no config.toml")
    bad = tmp_path / "bad"
    shutil.copytree(run_dir, bad)
    (bad / "config.toml").write_text("rounds = [")
    _one_line_error(["export", str(bad)], str(bad / "config.toml"), "invalid TOML")
    noadapter = tmp_path / "noadapter"
    shutil.copytree(run_dir, noadapter)
    shutil.rmtree(noadapter / "adapter")
    _one_line_error(["export", str(noadapter)], str(noadapter / "adapter"), "no adapter")
    (noadapter / "adapter").mkdir()
    (noadapter / "adapter" / "adapter_config.json").write_text("{")
    _one_line_error(["eval", str(noadapter)], "adapter_config.json", "cannot be read")
    _one_line_error(["eval", str(run_dir), "--tasks", "arc"], "--tasks", "'arc'")
    _one_line_error(["eval", "tiny-llama"], "--tasks")
    _one_line_error(["eval", "tiny-llama", "--tasks", "arc_easy", "--baseline"], "--baseline", "bare model")
    _one_line_error(["eval", "tiny-llama", "--tasks", "arc_easy", "--protocol", "x"], "--protocol", "'x'")
    _one_line_error(
        ["eval", "tiny-llama", "--tasks", "csqa", "--protocol", "run", "--num-fewshot", "2"], "--num-fewshot"
    )
    _one_line_error(["eval", "tiny-llama", "--tasks", "arc_easy", "--generate"], "--generate", "--protocol run")
    # --push-to-hub: never the network here; no token -> one line
    monkeypatch.setattr("fedtune.process._resolves", lambda host, timeout: True)  # as if online: to the token check
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    args = ["export", str(run_dir), "--merged", "--out", str(tmp_path / "m"), "--push-to-hub", "me/tiny"]
    _one_line_error(args, "--push-to-hub", "no Hugging Face token")
    _one_line_error(["export", str(run_dir), "--out", str(tmp_path / "a"), "--push-to-hub", "me/t"], "tiny-llama")


@pytest.mark.slow
def test_merged_export_of_a_smollm2_run_reloads_with_the_adapters_logits(tmp_path):
    """The packaged SmolLM2 (read from its Q4_1 GGUF file): a 1-round run's merged export reloads
    with plain ``AutoModelForCausalLM`` and gives the adapter-on-base logits; the card says which
    weights the base is (about 1-2 minutes on one core: the GGUF file is read three times)."""
    from transformers import AutoModelForCausalLM

    from fedtune.run import run_experiment

    overrides = [*TINY, f"output_dir={tmp_path}", "name=smol", "model.name=smollm2", "method=fedit", "rounds=1"]
    overrides += ["federation.num_clients=2", "train.local_steps=1", "train.lr=5e-2", "data.max_train_samples=8"]
    overrides += ["data.max_test_samples=2", "data.max_length=32", "task.generate=false", "model.lora_rank=2"]
    run_dir = Path(run_experiment(load_config(None, overrides))["run_dir"])
    out = tmp_path / "merged"
    result = runner.invoke(app, ["export", str(run_dir), "--merged", "--out", str(out)])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "Q4_1 GGUF file" in card
    assert "de-quantized to float32" in card and "not the hub's bfloat16" in card
    # in float64: the saved float32 weights against the adapter on the base, less float32's rounding
    # through 30 layers (about 6e-4 on logits of up to 30 when both compute in float32)
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval().double()
    run = open_run(run_dir)
    task = run.task()
    batch = _batch(task)
    with torch.no_grad():
        adapter = run.model(task).double()
        want = adapter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = merged(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with adapter.disable_adapter():
            base = adapter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert not torch.allclose(base, want, atol=1e-3)  # the adapter acts


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path -> sha256 (a snapshot to compare after)."""
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_export_never_deletes_or_overwrites_what_it_did_not_write(run_dir, tmp_path, monkeypatch):
    """A user's model folder (config.json and more), the run's own adapter/, another run's adapter/
    and the run folder itself: refused with one line, byte for byte as before. --overwrite moves a
    non-empty folder aside to <name>.old-<n> (the first free n) and writes afresh; the default
    RUN/export is written once, then refused without --overwrite."""
    user = tmp_path / "my-model"
    user.mkdir()
    (user / "config.json").write_text("{}")
    (user / "weights.bin").write_bytes(b"mine")
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    before = {p: _tree(p) for p in (user, run_dir, other)}
    _one_line_error(["export", str(run_dir), "-o", str(user)], str(user), "not empty", "--overwrite")
    _one_line_error(["export", str(run_dir), "-o", str(run_dir / "adapter")], "inside the run folder")
    _one_line_error(["export", str(run_dir), "-o", str(other / "adapter"), "--overwrite"], "inside the run folder")
    _one_line_error(["export", str(run_dir), "-o", str(run_dir)], "inside the run folder")
    _one_line_error(["export", str(run_dir), "-o", str(run_dir.parent), "--overwrite"], "holds the run")
    assert {p: _tree(p) for p in (user, run_dir, other)} == before
    for _ in range(2):
        result = runner.invoke(app, ["export", str(run_dir), "-o", str(user), "--overwrite"])
        assert result.exit_code == 0, result.output
        assert (user / ADAPTER_CONFIG).is_file() and not (user / "weights.bin").exists()
    assert _tree(user.with_name("my-model.old-1")) == before[user]  # the user's files, moved once
    assert _tree(user.with_name("my-model.old-2")) == _tree(user)  # the first export, moved by the second
    default = run_dir / "export"
    assert runner.invoke(app, ["export", str(run_dir)]).exit_code == 0 and (default / ADAPTER_CONFIG).is_file()
    _one_line_error(["export", str(run_dir)], str(default), "not empty")
    shutil.rmtree(default)  # this test's own export


def test_a_run_of_every_engine_exports_as_the_embedded_ones_and_is_left_as_it_was(engine, engine_runs, tmp_path):
    """Export and run-folder safety on every engine (tests/engines.py): a DP run made on it exports
    the embedded run's files, its model card the same but for the mechanism's numbers (every
    decimal masked); a target inside the run folder is refused in one line; the run folder is byte
    for byte as before."""
    import re

    ran, embedded = engine_runs.killed(engine), engine_runs.killed("embedded")
    before = _tree(ran.run_dir)
    _one_line_error(["export", str(ran.run_dir), "-o", str(ran.run_dir / "adapter")], "inside the run folder")
    exported = {}
    for name, run in (("engine", ran), ("embedded", embedded)):
        result = runner.invoke(app, ["export", str(run.run_dir), "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        card = re.sub(r"\d+\.\d+", "#", (tmp_path / name / "README.md").read_text())
        exported[name] = (sorted(_tree(tmp_path / name)), card)
    assert exported["engine"] == exported["embedded"] and "accuracy #" in exported["engine"][1]
    assert _tree(ran.run_dir) == before


def test_a_failed_export_leaves_nothing_half_written(run_dir, tmp_path, monkeypatch):
    """A write that fails part-way (a full disk) or a read-only file system: one line, and no
    folder is left (neither the target nor the temporary one beside it)."""
    import errno

    def full(task, out):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("fedtune.trained.export._save_tokenizer", full)
    _one_line_error(["export", str(run_dir), "-o", str(tmp_path / "out")], "out", "No space left")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    _one_line_error(["export", str(run_dir), "-o", str(tmp_path / "ro" / "out")], "ro", "Read-only file system")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_final_rename_puts_the_folder_moved_aside_back(run_dir, tmp_path, monkeypatch):
    """--overwrite of a user's non-empty folder whose last step, renaming the finished export onto
    it, fails (another process took the name; a file system that refuses): one line, and the
    user's folder is back at its own name byte for byte, with no <name>.old-<n> and no temporary
    folder left beside it."""
    import errno
    import os

    user = tmp_path / "my-model"
    user.mkdir()
    (user / "weights.bin").write_bytes(b"mine")
    before = _tree(user)
    rename = os.rename

    def refuse_the_export(src, dst, *args, **kwargs):
        if ".export-" in os.fspath(src):  # the finished export onto the target: refused
            raise OSError(errno.EACCES, "Permission denied")
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refuse_the_export)
    _one_line_error(["export", str(run_dir), "-o", str(user), "--overwrite"], str(user), "Permission denied")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-model"]
    assert _tree(user) == before


@pytest.mark.parametrize("bits", ["8bit", "4bit"])
def test_merged_refuses_every_quantized_base(run_dir, tmp_path, bits):
    """--merged of a run trained on an 8-bit or a 4-bit base: merging into k-bit weights rounds the
    update away (an 8-bit step is about 1/127 of a row's largest weight, far above a LoRA update),
    so either is refused in one line and nothing is written."""
    run = shutil.copytree(run_dir, tmp_path / "q")
    config = (run / "config.toml").read_text()
    assert config.count('quantization = "none"') == 1
    (run / "config.toml").write_text(config.replace('quantization = "none"', f'quantization = "{bits}"'))
    started = json.loads((run / "run_config.json").read_text())
    started["model"]["quantization"] = bits
    (run / "run_config.json").write_text(json.dumps(started))
    out = tmp_path / "merged"
    _one_line_error(["export", str(run), "--merged", "-o", str(out)], f"model.quantization = '{bits}'")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_a_damaged_or_non_finite_adapter_and_a_missing_folder_are_one_line(run_dir, tmp_path, monkeypatch):
    """eval / export of a run whose adapter_model.safetensors is empty, truncated, corrupted or holds
    NaN: one line naming the file (before: a traceback, or accuracies of a NaN model with exit 0);
    eval of a folder that does not exist says so (before: read as a model name)."""
    from safetensors.torch import load_file, save_file

    weights = run_dir / "adapter" / "adapter_model.safetensors"
    data = weights.read_bytes()
    tensors = load_file(weights)
    damaged = {
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "corrupted": bytes(range(256)) * 8,
    }
    for name, content in damaged.items():
        run = shutil.copytree(run_dir, tmp_path / name)
        (run / "adapter" / "adapter_model.safetensors").write_bytes(content)
        _one_line_error(["eval", str(run), "--limit", "2"], "adapter_model.safetensors", "cannot be read")
        _one_line_error(["export", str(run), "-o", str(tmp_path / f"{name}-out")], "cannot be read")
    nan = shutil.copytree(run_dir, tmp_path / "nan")
    save_file({k: v * float("nan") for k, v in tensors.items()}, nan / "adapter" / "adapter_model.safetensors")
    _one_line_error(["eval", str(nan), "--limit", "2"], "adapter_model.safetensors", "not finite", "NaN")
    mine = tmp_path / "mine.json"
    mine.write_text('{"mine": 1}')
    _one_line_error(["eval", str(run_dir), "--limit", "2", "-o", str(mine)], "mine.json", "not an earlier fedtune")
    assert mine.read_text() == '{"mine": 1}'
    monkeypatch.chdir(tmp_path)
    for missing in (str(tmp_path / "gone"), "./gone", "nan/gone", "a/b/c"):
        _one_line_error(["eval", missing, "--tasks", "arc_easy"], repr(missing), "no such folder")


def _moved_aside(rel: str, digest: str, after: dict[str, str]) -> bool:
    """Whether the file ``rel`` now lies, unchanged, under one of its folders moved aside to
    ``<name>.old-<n>`` (--overwrite)."""
    parts = rel.split("/")
    for i in range(len(parts)):
        for n in range(1, 50):
            moved = "/".join([*parts[:i], f"{parts[i]}.old-{n}", *parts[i + 1 :]])
            if after.get(moved) == digest:
                return True
    return False


def test_fuzz_output_paths_never_remove_or_change_a_file_the_command_did_not_create(run_dir, tmp_path):
    """export -o (with and without --overwrite), eval -o and report -o at seeded random paths among
    a tree of decoy files (a user's model folder, files named like each command's outputs, a copy
    of a run, plain files, new and nested paths): after every command each decoy is byte for byte
    at its path, or moved aside whole by --overwrite, and so is every file of the run exported."""
    import random

    tree = tmp_path / "tree"
    decoy_files = {
        "model/config.json": "{}",
        "model/adapter_config.json": "{}",
        "model/weights.bin": "w",
        "reports/report.md": "| mine |\n",
        "reports/accuracy_vs_round.png": "not a plot",
        "evals/eval.json": '{"mine": 1}',
        "evals/notes.txt": "n",
        "plain": "p",
        "deep/a/b/keep.txt": "k",
    }
    for rel, text in decoy_files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    shutil.copytree(run_dir, tree / "runs" / "copy", ignore=shutil.ignore_patterns("export*", "eval.json"))
    (tree / "empty").mkdir()
    run_dir = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("export*", "eval.json"))
    decoys = _tree(tmp_path)  # from tmp_path: tree/ itself may be moved aside; the run's files too
    folders = sorted({str(Path(rel).parent) for rel in decoys} | {"tree/empty", "tree", "."})
    names = ["report.md", "eval.json", "config.json", "adapter", "new", "new/deeper", "plain", "x.old-1"]
    rng = random.Random(0)
    outcomes = set()
    for trial in range(40):
        command = ("export", "eval", "report", "export")[trial % 4]
        target = tmp_path / rng.choice(folders) / rng.choice([*names, ""])
        if rng.random() < 0.15:
            target = rng.choice([run_dir, run_dir / "adapter", tree / "runs" / "copy" / "adapter", tree / "plain"])
        args = {
            "export": ["export", str(run_dir), "-o", str(target), *(["--overwrite"] if rng.random() < 0.5 else [])],
            "eval": ["eval", str(run_dir), "--tasks", "arc_easy", "--limit", "2", "-o", str(target)],
            "report": ["report", str(run_dir), "-o", str(target)],
        }[command]
        result = runner.invoke(app, args)
        assert result.exit_code in (0, 2) and result.exception is None or isinstance(result.exception, SystemExit), (
            args,
            result.output,
        )
        outcomes.add((command, result.exit_code))
        after = _tree(tmp_path)
        for rel, digest in decoys.items():
            assert after.get(rel) == digest or _moved_aside(rel, digest, after), (trial, args, rel)
    assert outcomes == {(c, code) for c in ("export", "eval", "report") for code in (0, 2)}  # each wrote and refused


def test_the_average_over_sets_has_the_standard_error_of_a_mean_of_independent_estimates():
    """The mean of k sets' accuracies has SE sqrt(sum se_i^2) / k (independent sets), not the mean
    of the SEs nor their root sum of squares; Dolly is not a multiple-choice set and stays out."""
    from fedtune.trained.evaluate import average

    rows = {
        "arc_easy": {"acc": 0.5, "acc_se": 0.03, "acc_norm": 0.4, "acc_norm_se": 0.01},
        "boolq": {"acc": 0.7, "acc_se": 0.04, "acc_norm": 0.6, "acc_norm_se": 0.02},
        "dolly": {"acc": 0.0, "acc_se": 9.0, "rouge_l": 0.1},
    }
    out = average(rows)
    assert out["sets"] == 2
    assert out["acc"] == pytest.approx(0.6) and out["acc_se"] == pytest.approx(0.025)  # sqrt(.03^2 + .04^2) / 2
    assert out["acc_norm"] == pytest.approx(0.5) and out["acc_norm_se"] == pytest.approx(5**0.5 / 200)


def test_export_targets_that_would_move_the_wrong_folder_are_one_line_and_a_link_is_followed(
    run_dir, tmp_path, monkeypatch
):
    """``-o .`` (with or without --overwrite: it would rename the working folder), and ``-o DIR
    --overwrite`` where DIR holds another run folder, are refused, nothing moved; ``-o`` a symbolic
    link to an empty folder writes into that folder (before: "Not a directory")."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    _one_line_error(["export", str(run_dir), "-o", "."], "'.'", "the current folder")
    (work / "notes.txt").write_text("mine")
    _one_line_error(["export", str(run_dir), "-o", ".", "--overwrite"], "'.'", "the current folder")
    runs = tmp_path / "runs"
    shutil.copytree(run_dir, runs / "a" / "other", ignore=shutil.ignore_patterns("export*"))
    before = _tree(tmp_path)
    _one_line_error(["export", str(run_dir), "-o", str(runs), "--overwrite"], "holds the run folder", "other")
    assert _tree(tmp_path) == before and not list(tmp_path.glob("*.old-*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty, target_is_directory=True)
    result = runner.invoke(app, ["export", str(run_dir), "-o", str(tmp_path / "link")])
    assert result.exit_code == 0, result.output
    assert (empty / ADAPTER_CONFIG).is_file() and (tmp_path / "link").is_symlink()


def test_export_of_a_run_with_a_damaged_metrics_or_eval_file_is_one_line_before_anything_is_written(run_dir, tmp_path):
    """The model card reads metrics.jsonl, eval.json and prompt_template.json: a garbage line, a
    non-number accuracy, a non-object are one line naming the file and what to do, exit 2, and no
    export folder is left (before: JSONDecodeError, "Unknown format code 'f'", a fedtune bug)."""
    damage = {
        "metrics.jsonl": (lambda text: text + "{garbage\n", "line 3 is not a round's metrics line"),
        "eval.json": (lambda text: json.dumps({"sets": {"arc_easy": {"n": 5, "acc": "high"}}}), "sets.arc_easy.acc"),
        "prompt_template.json": (lambda text: "[1, 2]", "holds a list, not a JSON object"),
    }
    for name, (damaged, expected) in damage.items():
        run = shutil.copytree(run_dir, tmp_path / f"run-{name[:4]}", ignore=shutil.ignore_patterns("export*"))
        path = run / name
        path.write_text(damaged(path.read_text() if path.is_file() else ""))
        result = runner.invoke(app, ["export", str(run), "-o", str(tmp_path / f"out-{name[:4]}")])
        line = result.output.strip()
        assert result.exit_code == 2 and "\n" not in line, result.output
        assert name in line and expected in line and ("restore" in line or "move it away" in line), line
        assert not (tmp_path / f"out-{name[:4]}").exists() and not list(tmp_path.glob(".*export-*"))
