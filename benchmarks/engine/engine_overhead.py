"""Engine overhead: R rounds of FedIT in fedtune's embedded engine vs. a bare PyTorch loop.

The bare loop is what most training scripts do: keep the texts, tokenize each batch as it goes
(dynamic padding), load the global adapter into the model, train the same local steps on the
same examples (same index batches), FedAvg the adapters, evaluate the test set in batches
of the training batch size. fedtune tokenizes each set once, and evaluates in large length-sorted
no-grad batches; it also encodes/decodes every message (the price of exact byte accounting).

Both start after the same model and text loading; the two are interleaved ``--repeats`` times and
the minimum of each is kept. Prints the ratio and writes benchmarks/results/engine_overhead.{md,json}.

The image row (``--tasks image``) does the same for ``image-classification``: FedAvg of the small conv
net trained from scratch on Fashion-MNIST (``--image-data``). The bare loop is the usual
script: a ``Dataset`` whose ``__getitem__`` turns one uint8 image into a normalized float tensor
(torchvision's ToTensor + Normalize), a ``DataLoader`` over the same index batches, FedAvg of the
state dicts, evaluation in batches of the training batch size. fedtune resizes the images once into
a uint8 cache, normalizes whole batches, evaluates in ``train.eval_batch_size`` batches and
encodes/decodes every message. Both start after the same model and raw image loading (fedtune's
cache is built inside the timed part); written to benchmarks/results/engine_overhead_image.{md,json},
so the text row's results stay when only the image row is rerun.

    python benchmarks/engine/engine_overhead.py [--rounds 3 --clients 4 --steps 10 --repeats 2] [--tasks text,image]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=FutureWarning)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedtune.config import load_config  # noqa: E402
from fedtune.engines.embedded import run_rounds  # noqa: E402
from fedtune.engines.rounds import sample_clients  # noqa: E402
from fedtune.models.training import seed_for  # noqa: E402
from fedtune.runtime import RunContext, resolve_run  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def fedtune_job(config, model: str = "workspace") -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and final accuracy of the embedded engine (model already loaded:
    ``model`` is the context's LoRA ``workspace``, or its plain ``model`` for FedAvg)."""
    server, clients = RunContext(resolve_run(config)), RunContext(resolve_run(config))
    # load models and data (tokenizing / image caching is timed)
    getattr(server, model), getattr(clients, model), server.task.data, clients.task.data
    start, cpu = time.perf_counter(), time.process_time()
    strategy = server.strategy()
    strategy.initialize()
    fed = config.federation
    history = run_rounds(strategy, clients.client, fed.num_clients, fed.sample_size(), config.rounds, config.seed)
    return time.perf_counter() - start, time.process_time() - cpu, history[-1].metrics["accuracy"]


def bare_job(config) -> tuple[float, float, float]:
    """The same job as a plain script: per-batch tokenization, state-dict FedAvg."""
    ctx = RunContext(resolve_run(config))
    train, test = ctx.task.data
    parts, tokenizer, model = ctx.partitions, ctx.task.tokenizer, ctx.workspace.base
    rank, tc = config.model.lora_rank, config.train
    from peft import get_peft_model

    from fedtune.models.lora import lora_config

    with torch.random.fork_rng():
        torch.manual_seed(config.seed + 1)
        model = get_peft_model(model, lora_config(ctx.task, rank))
    start, cpu = time.perf_counter(), time.process_time()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    global_state = {n: p.detach().clone() for n, p in trainable.items()}

    def batch_of(texts, labels):
        enc = tokenizer(texts, padding=True, truncation=True, max_length=config.data.max_length, return_tensors="pt")
        return {**enc, "labels": torch.as_tensor(labels)}

    fed = config.federation
    for rnd in range(1, config.rounds + 1):
        new_states, sizes = [], []
        for cid in sample_clients(fed.num_clients, fed.sample_size(), config.seed, rnd):
            with torch.no_grad():
                for n, p in trainable.items():
                    p.copy_(global_state[n])
            seed = seed_for(config.seed, rnd, cid)
            torch.manual_seed(seed)
            rng = np.random.default_rng(seed)
            pool, steps = parts[cid], 0
            optimizer = torch.optim.AdamW(trainable.values(), lr=tc.lr, weight_decay=tc.weight_decay)
            model.train()
            while steps < tc.local_steps:  # the same index batches as fedtune without length grouping
                order = pool[rng.permutation(len(pool))]
                for i in range(0, len(order), tc.batch_size):
                    if steps == tc.local_steps:
                        break
                    idx = order[i : i + tc.batch_size]
                    loss = model(**batch_of([train.texts[j] for j in idx], train.labels[idx])).loss
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    steps += 1
            new_states.append({n: p.detach().clone() for n, p in trainable.items()})
            sizes.append(len(pool))
        weights = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        global_state = {n: sum(w * s[n] for w, s in zip(weights, new_states)) for n in global_state}
        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(global_state[n])
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(test), tc.batch_size):
                b = batch_of(test.texts[i : i + tc.batch_size], test.labels[i : i + tc.batch_size])
                correct += (model(**b).logits.argmax(-1) == b["labels"]).sum().item()
        accuracy = correct / len(test)
    return time.perf_counter() - start, time.process_time() - cpu, accuracy


def bare_image_job(config) -> tuple[float, float, float]:
    """The image job as a plain script: per-image ToTensor + Normalize in a Dataset, a DataLoader
    over the same index batches, state-dict FedAvg."""
    ctx = RunContext(resolve_run(config))
    train, test = ctx.task.data
    parts, model, task = ctx.partitions, ctx.model, ctx.task
    size, channels, tc = task.input_size, task.input_channels, config.train
    mean = torch.tensor(task.spec.mean, dtype=torch.float32).reshape(-1, 1, 1)
    std = torch.tensor(task.spec.std, dtype=torch.float32).reshape(-1, 1, 1)
    start, cpu = time.perf_counter(), time.process_time()

    class Images(torch.utils.data.Dataset):
        def __init__(self, ds):
            self.ds = ds

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):  # (C, H, W) float, normalized; the label
            x = torch.from_numpy(np.array(self.ds.images[i])).permute(2, 0, 1).float() / 255.0
            if tuple(x.shape[1:]) != tuple(size):
                x = torch.nn.functional.interpolate(x[None], size=size, mode="bilinear", antialias=True)[0]
            if x.shape[0] != channels:
                x = x.expand(channels, -1, -1)
            return (x - mean) / std, int(self.ds.labels[i])

    train_ds, test_ds = Images(train), Images(test)
    global_state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    fed = config.federation
    for rnd in range(1, config.rounds + 1):
        new_states, sizes = [], []
        for cid in sample_clients(fed.num_clients, fed.sample_size(), config.seed, rnd):
            model.load_state_dict(global_state)
            seed = seed_for(config.seed, rnd, cid)
            torch.manual_seed(seed)
            rng = np.random.default_rng(seed)
            pool, batches = parts[cid], []
            while len(batches) < tc.local_steps:  # the same index batches as fedtune
                order = pool[rng.permutation(len(pool))]
                batches += [order[i : i + tc.batch_size].tolist() for i in range(0, len(order), tc.batch_size)]
            loader = torch.utils.data.DataLoader(train_ds, batch_sampler=batches[: tc.local_steps])
            optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
            model.train()
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            new_states.append({n: t.detach().clone() for n, t in model.state_dict().items()})
            sizes.append(len(pool))
        weights = torch.tensor(sizes, dtype=torch.float32) / sum(sizes)
        global_state = {n: sum(w * s[n] for w, s in zip(weights, new_states)) for n in global_state}
        model.load_state_dict(global_state)
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in torch.utils.data.DataLoader(test_ds, batch_size=tc.batch_size):
                correct += (model(x).argmax(-1) == y).sum().item()
        accuracy = correct / len(test)
    return time.perf_counter() - start, time.process_time() - cpu, accuracy


def measure(variants: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Run every (job, config) of ``variants`` ``repeats`` times, interleaved: wall and CPU seconds, accuracy."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    acc: dict[str, float] = {}
    for rep in range(repeats):
        for name, (job, cfg) in variants.items():
            seconds, cpu_s, acc[name] = job(cfg)
            times[name].append(seconds)
            cpu[name].append(cpu_s)
            print(
                f"repeat {rep + 1}: {name:<16} {seconds:7.2f} s wall {cpu_s:7.2f} s CPU  accuracy {acc[name]:.4f}",
                flush=True,
            )
    return times, cpu, acc


def write_result(name: str, title: str, flags: str, args, times, cpu, acc, extra: dict, note: str = "") -> dict:
    """Write ``RESULTS/<name>.{json,md}`` (each variant's best wall and CPU seconds, its accuracy and
    its ratios to the bare loop, ``extra`` in the JSON, ``note`` after the command); the best wall
    seconds per variant."""
    best = {k: min(v) for k, v in times.items()}
    best_cpu = {k: min(v) for k, v in cpu.items()}
    result = {"args": vars(args), "seconds": times, "cpu_seconds": cpu, "best_s": best, "best_cpu_s": best_cpu}
    result |= {"accuracy": acc, "ratio_same_batches": best["fedtune"] / best["bare"], **extra}
    result["threads"] = torch.get_num_threads()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    rows = "".join(
        f"| {k} | {best[k]:.2f} | {best_cpu[k]:.2f} | {acc[k]:.4f} | {best[k] / best['bare']:.3f} | "
        f"{best_cpu[k] / best_cpu['bare']:.3f} |\n"
        for k in times
    )
    (RESULTS / f"{name}.md").write_text(
        f"# {title}\n\nCommand: `python benchmarks/engine/engine_overhead.py {flags}`; min of {args.repeats} "
        f"interleaved repeats, torch threads {torch.get_num_threads()}{note}.\n\n"
        "| variant | best wall s | best CPU s | final accuracy | wall ratio to bare loop | CPU ratio |\n"
        "|---|---|---|---|---|---|\n" + rows
    )
    return best


def image_row(args) -> None:
    """The image-classification row: FedAvg of the small conv net, fedtune vs the bare loop."""
    common = [
        "method=fedavg",
        "task.kind=image-classification",
        "model.name=small-cnn",
        f"data.name={args.image_data}",
        "data.max_train_samples=8000",
        "data.max_test_samples=2000",
        f"federation.num_clients={args.clients}",
        f"rounds={args.rounds}",
        f"train.local_steps={args.steps}",
        "train.batch_size=32",
        "train.lr=1e-3",
        "data.partition=iid",
    ]
    cfg = load_config(None, common)
    variants = {"bare": (bare_image_job, cfg), "fedtune": (lambda c: fedtune_job(c, "model"), cfg)}
    times, cpu, acc = measure(variants, args.repeats)
    title = (
        f"Engine overhead, image-classification: FedAvg of small-cnn on {args.image_data}, {args.rounds} rounds x "
        f"{args.clients} clients x {args.steps} steps (batch 32)"
    )
    flags = f"--tasks image --rounds {args.rounds} --clients {args.clients} --steps {args.steps} "
    flags += f"--repeats {args.repeats} --image-data {args.image_data}"
    note = "; 8,000 training / 2,000 test images"
    best = write_result("engine_overhead_image", title, flags, args, times, cpu, acc, {"config": common}, note)
    ratio = best["fedtune"] / best["bare"]
    print(f"image-classification ratio fedtune / bare loop: {ratio:.3f} (same batches)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--tasks", default="text,image", help="rows to measure: text, image or both")
    ap.add_argument("--image-data", default="fashion-mnist", help="data set of the image row")
    args = ap.parse_args()
    tasks = {t.strip() for t in args.tasks.split(",")}
    if "image" in tasks:
        image_row(args)
    if "text" not in tasks:
        return
    common = [
        "method=fedit",
        f"model.name={args.model}",
        "data.name=tweets",
        "data.max_train_samples=2000",
        "data.max_test_samples=1000",
        f"federation.num_clients={args.clients}",
        f"rounds={args.rounds}",
        f"train.local_steps={args.steps}",
        "train.batch_size=16",
        "data.partition=iid",
    ]
    variants = {
        "bare": (bare_job, load_config(None, common)),
        "fedtune": (fedtune_job, load_config(None, common + ["train.group_by_length=false"])),
        "fedtune+grouped": (fedtune_job, load_config(None, common + ["train.group_by_length=true"])),
    }
    times, cpu, acc = measure(variants, args.repeats)
    best = {k: min(v) for k, v in times.items()}
    ratio = best["fedtune"] / best["bare"]
    ratio_grouped = best["fedtune+grouped"] / best["bare"]
    print(f"ratio fedtune / bare loop: {ratio:.3f} (same batches), {ratio_grouped:.3f} (length-grouped batches)")
    title = f"Engine overhead: FedIT, {args.rounds} rounds x {args.clients} clients x {args.steps} steps ({args.model})"
    flags = f"--rounds {args.rounds} --clients {args.clients} --steps {args.steps} --repeats {args.repeats} "
    flags += f"--model {args.model}"
    write_result("engine_overhead", title, flags, args, times, cpu, acc, {"ratio_grouped": ratio_grouped})


if __name__ == "__main__":
    main()
