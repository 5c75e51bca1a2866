"""The paper's optimizer and its deviations: ``train.momentum`` (heavy-ball SGD on the clients) and
the server step on the aggregated update (``[server]``) for every LoRA method: plain
SGD at server lr 1 is eq. (5) bit for bit; ``adam`` is FedAdam (Reddi et al. 2021), checked against
a hand-written step and against torch's AdamW as the published FSLoRA code calls it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fedtune.checkpoint import load_state, save_state
from fedtune.config import ConfigError, load_config
from fedtune.methods.fslora import SHARED_SKETCH
from fedtune.models.training import make_optimizer
from fedtune.protocol.messages import Message
from fedtune.run import run_experiment
from fedtune.runtime import RunContext, resolve_run

RANK = 8
TINY = [
    "model.name=tiny-bert",
    "data=sst2",
    "data.max_train_samples=60",
    "data.max_test_samples=32",
    "data.max_length=16",
    f"model.lora_rank={RANK}",
    "federation.num_clients=3",
    "train.local_steps=1",
    "train.batch_size=8",
    "rounds=2",
]
SKETCH = "federation.profiles=[{sketch_ratio=0.25},{sketch_ratio=0.5},{sketch_ratio=1.0}]"
LORA_METHODS = ["fedit", "fslora", "heterolora", "flexlora", "fedstacklora"]


def tiny(method: str, *extra: str):
    return load_config(None, [f"method={method}", *TINY, *extra])


def strategy_of(config):
    strategy = RunContext(resolve_run(config)).strategy()
    strategy.initialize()
    return strategy


def fslora_replies(strategy, rnd: int, rng) -> dict[int, Message]:
    """Random sliced updates of the right shapes for every client, with their sketches."""
    replies = {}
    for cid, msg in strategy.configure_fit(rnd, [0, 1, 2]).items():
        k = len(msg.arrays[SHARED_SKETCH])
        arrays = {}
        for name, v in strategy.global_arrays.items():
            shape = (k, v.shape[1]) if ".lora_A." in name else (v.shape[0], k) if ".lora_B." in name else v.shape
            arrays[name] = rng.normal(scale=0.1, size=shape).astype(np.float32)
        replies[cid] = Message({**arrays, SHARED_SKETCH: msg.arrays[SHARED_SKETCH]}, {"num_examples": 10 + cid})
    return replies


# -- server SGD: eq. (5) ---------------------------------------------------------------------------
@pytest.mark.parametrize("server", [[], ["server.optimizer=sgd", "server.lr=1"], ["server.lr=0.5"]])
def test_server_sgd_is_eq5_bit_for_bit_at_lr_1_and_scales_the_sum_otherwise(server):
    """X^{t+1} = X^t + eta sum_i (1/N) scatter_I_i(Delta X_i), written out here with plain numpy
    (float32, clients in reply order): equal bit for bit at eta = 1 (the default) and eta = 1/2."""
    strategy = strategy_of(tiny("fslora", SKETCH, *server))
    rng = np.random.default_rng(0)
    for rnd in (1, 2):
        before = {k: v.copy() for k, v in strategy.global_arrays.items()}
        replies = fslora_replies(strategy, rnd, rng)
        strategy.aggregate_fit(rnd, replies)
        eta = 0.5 if "server.lr=0.5" in server else 1.0
        for name, x in before.items():
            total = np.zeros_like(x)
            for reply in replies.values():
                idx, u = reply.arrays[SHARED_SKETCH], reply.arrays[name]
                if ".lora_A." in name:
                    total[idx, :] += (1 / 3) * u
                elif ".lora_B." in name:
                    total[:, idx] += (1 / 3) * u
                else:
                    total += (1 / 3) * u
            np.testing.assert_array_equal(strategy.global_arrays[name], x + eta * total, err_msg=name)


# -- server Adam: FedAdam --------------------------------------------------------------------------
def fedit_round(strategy, rng) -> tuple[dict[int, Message], dict[str, np.ndarray]]:
    """Random FedIT replies and their data-size weighted mean (float64)."""
    replies, n = {}, np.array([30.0, 10.0, 20.0])
    for cid in range(3):
        u = {k: rng.normal(scale=0.1, size=v.shape).astype(np.float32) for k, v in strategy.global_arrays.items()}
        replies[cid] = Message(u, {"num_examples": int(n[cid])})
    mean = {
        k: sum(n[c] / n.sum() * replies[c].arrays[k].astype(np.float64) for c in range(3))
        for k in strategy.global_arrays
    }
    return replies, mean


def test_server_adam_without_bias_correction_matches_a_hand_written_fedadam_step():
    """Reddi et al. (2021) Alg. 2, three rounds: m = b1 m + (1 - b1) D, v = b2 v + (1 - b2) D^2,
    x += eta m / (sqrt(v) + tau), D the data-size weighted mean update."""
    eta, b1, b2, tau = 0.01, 0.9, 0.99, 1e-3
    strategy = strategy_of(
        tiny(
            "fedit",
            "server.optimizer=adam",
            f"server.lr={eta}",
            f"server.betas=[{b1}, {b2}]",
            f"server.eps={tau}",
            "server.bias_correction=false",
        )
    )
    rng = np.random.default_rng(1)
    x = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    m = {k: np.zeros_like(v) for k, v in x.items()}
    v2 = {k: np.zeros_like(v) for k, v in x.items()}
    for rnd in (1, 2, 3):
        replies, d = fedit_round(strategy, rng)
        strategy.aggregate_fit(rnd, replies)
        for k in x:
            m[k] = b1 * m[k] + (1 - b1) * d[k]
            v2[k] = b2 * v2[k] + (1 - b2) * d[k] ** 2
            x[k] = x[k] + eta * m[k] / (np.sqrt(v2[k]) + tau)
            np.testing.assert_allclose(strategy.global_arrays[k], x[k], rtol=1e-5, atol=1e-7, err_msg=f"{rnd} {k}")
        x = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}  # continue from the float32 state


def test_server_adam_with_bias_correction_is_torch_adamw_on_the_negated_mean_as_in_the_published_code(tmp_path):
    """The published FSLoRA server: ``torch.optim.AdamW(params, lr=server_lr)`` (betas (0.9, 0.999),
    eps 1e-8, weight decay 0.01) stepped with grad = -(mean update); three rounds, and the moments
    survive a checkpoint round trip."""
    eta = 5e-4
    config = tiny(
        "fedit",
        "server.optimizer=adam",
        f"server.lr={eta}",
        "server.weight_decay=0.01",
    )
    strategy = strategy_of(config)
    params = {k: torch.tensor(v) for k, v in strategy.global_arrays.items()}
    reference = torch.optim.AdamW(params.values(), lr=eta)
    rng = np.random.default_rng(2)
    for rnd in (1, 2, 3):
        replies, d = fedit_round(strategy, rng)
        if rnd == 3:  # resume from a checkpoint before the last round
            save_state(tmp_path / "s.npz", strategy.state_dict())
            strategy = RunContext(resolve_run(config)).strategy()
            strategy.load_state_dict(load_state(tmp_path / "s.npz"))
        strategy.aggregate_fit(rnd, replies)
        for k, p in params.items():
            p.grad = torch.tensor(-d[k], dtype=torch.float32)
        reference.step()
        for k, p in params.items():
            np.testing.assert_allclose(strategy.global_arrays[k], p.numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{rnd} {k}")


def test_server_momentum_is_heavy_ball_on_the_mean_update_and_survives_a_checkpoint(tmp_path):
    """FedAvgM (Hsu et al. 2019): b^t = mu b^{t-1} + Delta^t, x^{t+1} = x^t + eta b^t, Delta^t the
    data-size weighted mean, by hand over three rounds with a checkpoint round trip before the third.
    Wrong versions caught: no buffer (x += eta Delta), an EMA buffer (mu b + (1 - mu) Delta), a
    buffer lost on resume."""
    eta, mu = 0.5, 0.9
    config = tiny("fedit", f"server.lr={eta}", f"server.momentum={mu}")
    strategy = strategy_of(config)
    rng = np.random.default_rng(3)
    x = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    b = {k: np.zeros_like(v) for k, v in x.items()}
    for rnd in (1, 2, 3):
        replies, d = fedit_round(strategy, rng)
        if rnd == 3:
            save_state(tmp_path / "s.npz", strategy.state_dict())
            strategy = RunContext(resolve_run(config)).strategy()
            strategy.load_state_dict(load_state(tmp_path / "s.npz"))
        strategy.aggregate_fit(rnd, replies)
        for k in x:
            b[k] = mu * b[k] + d[k]
            x[k] = x[k] + eta * b[k]
            np.testing.assert_allclose(strategy.global_arrays[k], x[k], rtol=1e-5, atol=1e-7, err_msg=f"{rnd} {k}")
        x = {k: v.astype(np.float64) for k, v in strategy.global_arrays.items()}
    assert set(strategy.state_dict()["server_opt"]["buffer"]) == set(x)


def test_server_momentum_is_refused_with_adam_and_by_a_method_that_does_not_take_a_server_step():
    """server.momentum belongs to the sgd server step: with adam it is one line naming it; a method
    with no server step (local training alone) refuses it as it refuses any other server step."""
    with pytest.raises(ConfigError, match=r"^server.momentum: applies to server.optimizer='sgd'"):
        tiny("fedit", "server.optimizer=adam", "server.lr=0.1", "server.momentum=0.9")
    with pytest.raises(ConfigError, match="server.momentum"):
        tiny("fedit", "server.momentum=1.0")  # mu < 1: else the buffer never forgets
    with pytest.raises(ConfigError, match=r"^server.optimizer: method 'local' does not support it"):
        RunContext(resolve_run(load_config(None, ["method=local", *TINY, "server.momentum=0.5"])))
    assert strategy_of(tiny("fedit", "server.momentum=0.5")).aggregation.server_opt.momentum == 0.5


HETLORA = ["options.self_pruning=true", "options.weighting=sparsity", "options.aggregate=modules"]


@pytest.mark.parametrize(
    "method, extra", [(m, []) for m in LORA_METHODS] + [("heterolora", HETLORA)], ids=[*LORA_METHODS, "hetlora"]
)
def test_every_lora_method_runs_with_server_adam_and_client_momentum(method, extra, tmp_path):
    """Two rounds with FedAdam on the server and SGD momentum on the clients; the checkpoint holds
    the server optimizer's moments and restores them exactly."""
    config = tiny(
        method,
        SKETCH,
        "server.optimizer=adam",
        "server.lr=1e-3",
        "train.optimizer=sgd",
        "train.momentum=0.9",
        "train.lr=0.01",
        "train.local_steps=2",
        f"output_dir={tmp_path}",
        *extra,
    )
    summary = run_experiment(config)
    state = load_state(Path(summary["run_dir"]) / "checkpoint.npz")
    assert state["server_opt"]["t"] == 2 and state["server_opt"]["m"] and state["server_opt"]["v"]
    fresh = RunContext(resolve_run(config)).strategy()
    fresh.load_state_dict(state)
    again = fresh.state_dict()["server_opt"]
    assert again["t"] == 2
    for k, v in state["server_opt"]["m"].items():
        np.testing.assert_array_equal(again["m"][k], v)


def test_server_adam_moves_flexlora_delta_w_toward_the_new_aggregate():
    """FlexLoRA's aggregate replaces Delta W; with a server optimizer the step is taken on
    (new Delta W - old Delta W): with sgd at server lr 1/2, Delta W^1 = 1/2 of the clients' sum."""
    from tests.test_hetero_baselines import fake_replies

    full = strategy_of(tiny("flexlora", SKETCH))
    half = strategy_of(tiny("flexlora", SKETCH, "server.lr=0.5"))
    for strategy in (full, half):
        messages = strategy.configure_fit(1, [0, 1, 2])
        _, replies = fake_replies(strategy, messages, np.random.default_rng(3))
        strategy.aggregate_fit(1, replies)
    for path, delta in full.delta.items():
        np.testing.assert_allclose(half.delta[path], 0.5 * delta, rtol=1e-12)


# -- client momentum ---------------------------------------------------------------------------------
def test_train_momentum_is_heavy_ball_sgd():
    """Two steps on a linear loss c . w (constant gradient c): w2 = w0 - lr c - lr (0.9 c + c)."""
    cfg = tiny("fedit", "train.optimizer=sgd", "train.momentum=0.9", "train.lr=0.1").train
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    c = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    opt = make_optimizer([w], cfg)
    for _ in range(2):
        opt.zero_grad()
        (c @ w).backward()
        opt.step()
    torch.testing.assert_close(w.detach(), -0.1 * 2.9 * c)
    plain = make_optimizer([w], tiny("fedit", "train.optimizer=sgd").train)
    assert plain.param_groups[0]["momentum"] == 0


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.momentum=0.9"], r"train\.momentum: applies to train\.optimizer='sgd'"),
        (["server.optimizer=adam"], r"server\.lr: required"),
        (["server.eps=1e-3"], r"server\.eps: applies to server\.optimizer='adam'"),
        (
            ["server.optimizer=adam", "server.lr=1", "server.betas=[0.9, 1.0]"],
            r"server\.betas",
        ),
    ],
)
def test_bad_optimizer_settings_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny("fedit", *overrides)


@pytest.mark.parametrize("method, extra", [("local", []), ("fedstacklora", ["options.transport=stacks"])])
def test_a_server_step_the_method_cannot_honour_is_refused(method, extra):
    config = tiny(method, *extra, "server.optimizer=adam", "server.lr=1e-3")
    with pytest.raises(ConfigError, match="server.optimizer|transport"):
        strategy_of(config)


def test_resolved_config_with_the_default_server_step_runs_again(tmp_path):
    """The run folder's config.toml (every field written out) loads again without tripping the
    adam-only checks."""
    summary = run_experiment(tiny("fedit", "rounds=1", f"output_dir={tmp_path}"))
    again = load_config(Path(summary["run_dir"]) / "config.toml")
    assert again.server.optimizer == "sgd" and again.server.resolved_lr() == 1.0


def test_methods_verbose_labels_the_deviations():
    from fedtune.cli import app

    result = CliRunner().invoke(app, ["methods", "--verbose"])
    assert result.exit_code == 0
    block = result.output.split("\nfslora")[1].split("\nheterolora")[0]
    assert "deviation: train.optimizer: 'adamw' (the default) departs from Algorithm 1" in block
    assert "deviation: server.optimizer: 'adam'" in block
    assert "options.per_module_sketch = False" in block
    hetero = result.output.split("\nheterolora")[1]
    assert "deviation: options.self_pruning" in hetero and "options.prune_gamma = 0.99" in hetero
