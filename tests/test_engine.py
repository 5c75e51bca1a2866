"""The engine is method-agnostic, deterministic, and accounts bytes exactly."""

import json
from pathlib import Path

import numpy as np
import pytest

from fedtune.engines.embedded import run_rounds
from fedtune.engines.rounds import sample_clients
from fedtune.methods import get_method, list_methods
from fedtune.protocol.client import Client
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import Strategy
from fedtune.registry import MethodOptions, register
from fedtune.runtime import RunContext, resolve_run


class VectorOptions(MethodOptions):
    dim: int = 3


class VectorMean(Strategy):
    """Toy: the global state is a vector; clients send back their id added to it; server averages."""

    def initialize(self):
        self.x = np.zeros(self.options.dim)

    def configure_fit(self, rnd, client_ids):
        return {cid: Message({"x": self.x}, {"round": rnd}) for cid in client_ids}

    def aggregate_fit(self, rnd, replies):
        self.x = np.mean([m.arrays["x"] for m in replies.values()], axis=0)
        return {"n": len(replies)}

    def state_dict(self):
        return {"x": self.x}

    def load_state_dict(self, state):
        self.x = state["x"]


class VectorClient(Client):
    def fit(self, message):
        self.state["calls"] = self.state.get("calls", 0) + 1
        return Message({"x": message.arrays["x"] + self.cid}, {"steps": self.state["calls"], "num_examples": 1})


def test_a_method_defined_here_runs_through_the_registry(tiny_config):
    register_toy("toy-vector-mean", VectorMean, VectorClient, VectorOptions)
    ctx = RunContext(resolve_run(tiny_config("method=toy-vector-mean", "options.dim=2", "rounds=3")))
    strategy = ctx.strategy()
    strategy.initialize()
    history = run_rounds(strategy, ctx.client, 4, 4, 3, seed=0)
    # each round: x <- mean(x + cid) = x + 1.5
    assert np.allclose(strategy.x, [4.5, 4.5])
    assert history[-1].client_steps == {0: 3, 1: 3, 2: 3, 3: 3}  # per-client state persisted
    down = Message({"x": np.zeros(2)}, {"round": 1}).nbytes
    assert history[0].client_bytes_down[0] == down


def test_sampling_is_seeded_and_without_replacement():
    a = [sample_clients(100, 10, seed=1, rnd=r) for r in range(1, 6)]
    assert a == [sample_clients(100, 10, seed=1, rnd=r) for r in range(1, 6)]
    assert all(len(set(s)) == 10 for s in a) and a[0] != a[1]
    assert sample_clients(5, 10, seed=0, rnd=1) == [0, 1, 2, 3, 4]


def test_fedit_upload_is_parameter_count_times_dtype_plus_header(tiny_config):
    from fedtune.run import run_experiment

    cfg = tiny_config("method=fedit", "model.lora_rank=4", "federation.clients_per_round=3")
    ctx = RunContext(resolve_run(cfg))
    adapter = ctx.workspace.state(4)
    n_params = sum(a.size for a in adapter.values())
    # 2 layers x (query, value) x (A: 4x32 + B: 32x4) + head (3x32 + 3)
    assert n_params == 2 * 2 * (4 * 32 + 32 * 4) + 3 * 32 + 3
    strategy = ctx.strategy()
    strategy.initialize()
    reply = ctx.client(0).fit(strategy.configure_fit(1, [0])[0])
    specs = [[k, "<f4", list(v.shape)] for k, v in adapter.items()]
    header = 8 + len(json.dumps({"meta": reply.meta, "arrays": specs}, separators=(",", ":")).encode())
    assert len(reply.encode()) == reply.nbytes == n_params * 4 + header

    summary = run_experiment(cfg)
    lines = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert len(lines) == 2
    for line in lines:
        assert len(line["clients"]) == 3
        for cid in line["clients"]:
            overhead = line["client_bytes_up"][str(cid)] - n_params * 4
            assert len(json.dumps({"arrays": specs})) < overhead < header + 40  # only the header differs
    assert summary["total_bytes_up"] == sum(line["bytes_up"] for line in lines)


def test_same_seed_same_numbers(tiny_config):
    from fedtune.run import run_experiment

    a = run_experiment(tiny_config("name=a"))
    b = run_experiment(tiny_config("name=b"))
    assert a["final_accuracy"] == b["final_accuracy"] and a["final_loss"] == b["final_loss"]


def test_local_reports_mean_of_client_accuracies(tiny_config):
    from fedtune.run import run_experiment

    summary = run_experiment(tiny_config("method=local", "rounds=1"))
    line = json.loads(open(f"{summary['run_dir']}/metrics.jsonl").readline())
    assert 0 <= line["accuracy"] <= 1 and "accuracy_std" in line
    assert line["bytes_up"] < 2000  # local uploads metrics only, never weights


def test_local_averages_every_metric_all_clients_report_and_cannot_forge_the_accounting(tiny_config):
    """Local's evaluation is the plain mean over clients of each metric every client reports as a
    finite number (ROUGE-L, per-set values: what a task evaluates beyond accuracy and loss), the
    accuracies' spread beside it; a metric some client lacks, or sends non-finite, is left out; a
    metric named like a round field does not replace the engine's accounting in metrics.jsonl."""
    from fedtune.engines.rounds import RoundRecord
    from fedtune.protocol.messages import Message
    from fedtune.runtime import RunContext

    strategy = RunContext(resolve_run(tiny_config("method=local"))).strategy()
    strategy.initialize()
    metas = [
        {"accuracy": 0.2, "loss": 2.0, "rouge_l": 0.10, "loss_a": 1.0, "only_here": 5.0, "bytes_up": 0, "odd": 1.0},
        {"accuracy": 0.6, "loss": 4.0, "rouge_l": 0.30, "loss_a": 3.0, "bytes_up": 0, "odd": float("nan")},
    ]
    got = strategy.aggregate_evaluate(1, {cid: Message({}, m) for cid, m in enumerate(metas)})
    assert got == pytest.approx(
        {"accuracy": 0.4, "accuracy_std": 0.2, "loss": 3.0, "rouge_l": 0.2, "loss_a": 2.0, "bytes_up": 0.0}
    )
    record = RoundRecord(1, [0, 1], metrics=got, client_bytes_up={0: 100, 1: 50})
    line = record.to_json()
    assert line["bytes_up"] == 150 and line["rouge_l"] == pytest.approx(0.2) and line["accuracy"] == 0.4


def test_run_folder_and_saved_adapter_reproduce_final_predictions(tiny_config):
    import torch
    from peft import PeftModel

    from fedtune.checkpoint import load_state
    from fedtune.run import run_experiment

    cfg = tiny_config("method=fedit")
    summary = run_experiment(cfg)
    run_dir = Path(summary["run_dir"])
    for name in ("config.toml", "metrics.jsonl", "summary.json", "label_histograms.json", "checkpoint.npz", "adapter"):
        assert (run_dir / name).exists(), name
    assert summary["environment"]["torch"] == torch.__version__  # where it ran: timings depend on it
    # the run's final model: the strategy's global state loaded into a fresh workspace
    ctx = RunContext(resolve_run(cfg))
    state = load_state(run_dir / "checkpoint.npz")
    ws = ctx.workspace
    ws.load(state["global"], int(state["rank"]))
    # the saved adapter, loaded the standard PEFT way onto the task's base model
    loaded = PeftModel.from_pretrained(ctx.task.build_model(cfg.seed), str(run_dir / "adapter"))
    test = ctx.task.tokenized[1]
    batch = test.collate(np.arange(len(test)))
    ws.model.eval(), loaded.eval()
    with torch.no_grad():
        expected, got = ws.model(**batch).logits, loaded(**batch).logits
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.allclose(got, expected, atol=1e-5)
    assert summary["majority_accuracy"] > 0 and summary["final_accuracy"] is not None


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(Exception, match="fedit"):
        get_method("nope")


class TwoPhase(Strategy):
    """Toy two-exchange round: fit sends x and gets x + cid back (averaged); the phase "sum"
    then sends the new x to the clients that answered and gets cid * x back (summed)."""

    def initialize(self):
        self.x, self.total = np.zeros(2), np.zeros(2)

    def configure_fit(self, rnd, client_ids):
        return {cid: Message({"x": self.x}, {"round": rnd}) for cid in client_ids}

    def aggregate_fit(self, rnd, replies):
        self.x = np.mean([m.arrays["x"] for m in replies.values()], axis=0)
        return {}

    def phases(self, rnd):
        return ("sum",)

    def configure_phase(self, phase, rnd, client_ids):
        return {cid: Message({"x": self.x}, {"round": rnd, "phase": phase}) for cid in client_ids}

    def aggregate_phase(self, phase, rnd, replies):
        self.total = self.total + sum(m.arrays["y"] for m in replies.values())
        return {"phase_replies": len(replies)}

    def reply_spec(self, rnd, cid, sent):
        from fedtune.protocol.validation import spec_like

        return spec_like({"y" if "phase" in sent.meta else "x": sent.arrays["x"]})

    def state_dict(self):
        return {"x": self.x, "total": self.total}

    def load_state_dict(self, state):
        self.x, self.total = state["x"], state["total"]


class TwoPhaseClient(Client):
    def fit(self, message):
        return Message({"x": message.arrays["x"] + self.cid}, {"steps": 1, "num_examples": 1})

    def phase(self, name, message):
        assert name == "sum"
        if self.cid == 3:  # answers with the wrong array: dropped from the phase only
            return Message({"x": message.arrays["x"]}, {})
        return Message({"y": self.cid * message.arrays["x"]}, {})


def register_toy(name: str, strategy, client, options=MethodOptions) -> None:
    """Register a toy method once per process (a name registered twice is an error; tests here and
    in test_flower share the toys). Registered inside tests, so the contract test never collects them."""
    if name not in {spec.name for spec in list_methods()}:
        register(name, strategy, client, options, "toy")


def test_a_round_with_a_second_exchange_runs_it_on_the_clients_that_answered(tiny_config):
    register_toy("toy-two-phase", TwoPhase, TwoPhaseClient)
    ctx = RunContext(resolve_run(tiny_config("method=toy-two-phase")))
    strategy = ctx.strategy()
    strategy.initialize()
    history = run_rounds(strategy, ctx.client, 4, 4, 1, seed=0)
    # fit: x = mean(0 + cid) = 1.5; phase: clients 0, 1, 2 send cid * 1.5, client 3 is dropped
    assert np.allclose(strategy.x, 1.5) and np.allclose(strategy.total, (0 + 1 + 2) * 1.5)
    record = history[0]
    assert record.metrics["phase_replies"] == 3
    assert record.dropped == {3: "sum: array 'y' missing"}
    fit_down = Message({"x": np.zeros(2)}, {"round": 1}).nbytes
    phase_down = Message({"x": np.zeros(2)}, {"round": 1, "phase": "sum"}).nbytes
    assert record.client_bytes_down[0] == fit_down + phase_down  # both exchanges accounted


def test_a_method_name_registered_twice_is_an_error_naming_both_modules():
    from fedtune.registry import DuplicateMethodError

    with pytest.raises(
        DuplicateMethodError, match=r"'fedit' is registered twice: by fedtune\.methods\.fedit and by tests\.test_engine"
    ):
        register("fedit", TwoPhase, TwoPhaseClient, MethodOptions, "toy")
    assert get_method("fedit").strategy.__name__ == "FedITStrategy"  # the first registration stands


def test_only_modules_that_register_are_methods():
    """The shared bases (fedtune.methods.base) are never scanned; every method's registering module
    is a method module, not a shared one."""
    modules = {spec.module for spec in list_methods() if spec.module.startswith("fedtune.")}
    assert modules and not any(m.startswith("fedtune.methods.base") for m in modules)


def test_a_round_record_round_trips_through_its_metrics_line(tiny_config):
    """RoundRecord.from_json is to_json's inverse (a deployment shows progress from metrics.jsonl)."""
    from fedtune.engines.rounds import RoundRecord

    record = RoundRecord(
        3,
        [0, 2],
        {"accuracy": 0.5, "loss": 1.25, "train_loss": 0.75},
        {0: 10, 2: 12},
        {0: 20, 2: 20},
        {0: 3, 2: 3},
        {0: 0.5, 2: 0.25},
        {1: "attempt 1: no reply"},
        2,
        7,
        1.5,
    )
    line = json.loads(json.dumps(record.to_json()))
    assert RoundRecord.from_json(line) == record
    assert RoundRecord.from_json(line).to_json() == record.to_json()


def test_tensors_cross_as_host_arrays_from_any_dtype():
    """bfloat16 (which numpy lacks) becomes float32 exactly; the array owns its memory."""
    import torch

    from fedtune.models.tensors import to_numpy

    x = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    a = to_numpy(x)
    assert a.dtype == np.float32 and a.tolist() == [1.5, -2.25, 3.0]
    y = torch.ones(2)
    b = to_numpy(y)
    y.add_(1)
    assert b.tolist() == [1.0, 1.0]


def test_bytes_up_of_a_multi_exchange_round_are_summed_over_its_exchanges(tiny_config):
    """Mistake: ``client_bytes_up`` overwritten, not summed, across the exchanges of a round (RABO's
    two phases): a client's upload is its fit reply plus its phase reply, byte for byte."""
    register_toy("toy-two-phase", TwoPhase, TwoPhaseClient)
    ctx = RunContext(resolve_run(tiny_config("method=toy-two-phase")))
    strategy = ctx.strategy()
    strategy.initialize()
    record = run_rounds(strategy, ctx.client, 4, 4, 1, seed=0)[0]
    x = np.zeros(2)  # the round-1 global both exchanges start from is x = 0, then 1.5
    for cid in (0, 1, 2):
        fit_up = Message({"x": x + cid}, {"steps": 1, "num_examples": 1}).nbytes
        phase_up = Message({"y": cid * (x + 1.5)}, {}).nbytes
        assert record.client_bytes_up[cid] == fit_up + phase_up


def test_the_last_round_is_evaluated_when_rounds_is_not_a_multiple_of_eval_every(tiny_config):
    """Mistake: evaluating only every ``eval_every`` rounds, so a run of 5 rounds at eval_every 2
    ends without a final accuracy."""
    from fedtune.run import run_experiment

    summary = run_experiment(tiny_config("rounds=5", "eval_every=2"))
    lines = [json.loads(x) for x in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert [line["round"] for line in lines if line["accuracy"] is not None] == [2, 4, 5]
    assert summary["final_accuracy"] == lines[-1]["accuracy"] is not None
