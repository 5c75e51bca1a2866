"""Model scale: peak memory against the number of simulated clients, training speed against a bare
transformers + PEFT loop, and a Llama-3.2-3B-shaped model in bfloat16 and 4-bit (issue 26).

Every measurement runs in a fresh process (peak memory is per process: ``ru_maxrss`` on the CPU,
``torch.cuda.max_memory_allocated`` on a GPU), side by side with the bare loop on the same model,
dtype, batch and sequence length:

- **fedtune**: ``causal-lm`` runs of one round, every one of N clients training ``--steps`` local
  steps (FedIT, LoRA r = 8 on q/v), on a local JSONL of synthetic prompts long enough that every
  row is cut to ``--length`` tokens; tokens/s = trained tokens / the clients' compute seconds.
- **bare**: ``AutoModelForCausalLM`` (+ ``BitsAndBytesConfig`` NF4 for 4-bit) + ``get_peft_model``
  + AdamW, the same number of steps on batches of the same shape.

The models are random weights in the shapes of SmolLM2-135M and of Llama-3.2-3B (built from their
configurations and saved once to a scratch folder: no download; memory and speed do not depend on
the values), with a byte-level tokenizer.

    python benchmarks/llm/llm_scale.py                      # CPU: (a) and (b) at N = 2, 8, 32
    python benchmarks/llm/llm_scale.py --device cuda --size # a GPU, and (c) the 3B-shaped model
    python benchmarks/llm/llm_scale.py --report-only        # rewrite the page from the saved numbers
    python benchmarks/llm/llm_scale.py --name cpu-bf16 ...  # another CPU kind: its own file and section

Results: ``benchmarks/results/llm_scale/<device>.json`` and ``README.md`` (one table per device).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "llm_scale"
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
    ),
}  # fmt: skip
DTYPES = ("float32", "bfloat16", "4bit")


def build_model_folder(shape: str, folder: Path) -> Path:
    """A random-weight Llama of ``shape`` with the byte tokenizer, saved in bfloat16 (once)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedtune.models.prefix_lm import byte_tokenizer

    path = folder / shape
    if (path / "config.json").exists():
        return path
    tok = byte_tokenizer()
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device="cpu")  # bfloat16 from the start: a 3B model never exists in float32
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def synthetic_data(folder: Path, rows: int) -> Path:
    """``rows`` prompts of 400 random words with a short response (every row truncated)."""
    import numpy as np

    path = folder / f"synthetic-{rows}.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta"]
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(words, 400))
            f.write(json.dumps({"prompt": prompt, "response": " ".join(rng.choice(words, 8))}) + "\n")
    return path


def peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_fedtune(args) -> dict:
    from fedtune.config import load_config
    from fedtune.run import run_experiment

    scale = {"float32": [], "bfloat16": ["model.dtype=bfloat16"], "4bit": ["model.quantization=4bit"]}
    if args.dtype == "4bit" and args.device.startswith("cuda"):
        scale["4bit"].append("model.dtype=bfloat16")  # QLoRA's compute dtype on a GPU
    out = Path(args.scratch) / "runs"
    cfg = load_config(None, [
        "task.kind=causal-lm", f"model.name={args.model}", f"data.name={args.data}", "method=fedit",
        f"device={args.device}", "rounds=1", f"federation.num_clients={args.clients}",
        f"train.local_steps={args.steps}", f"train.batch_size={args.batch}", f"data.max_length={args.length}",
        "data.max_test_samples=2", "task.generate=false", "model.lora_rank=8",
        'model.target_modules=["q_proj", "v_proj"]', "data.partition=iid", f"output_dir={out}",
        f"name=n{args.clients}-{args.dtype}", *scale[args.dtype],
    ])  # fmt: skip
    summary = run_experiment(cfg, overwrite=True)
    line = json.loads((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()[-1])
    tokens = args.clients * args.steps * args.batch * args.length
    return {"peak_bytes": peak_bytes(args.device), "tokens_per_s": tokens / line["compute_s"]}


def measure_bare(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = {"dtype": torch.bfloat16 if args.dtype == "bfloat16" else torch.float32}
    if args.dtype == "4bit":
        compute = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        )  # fmt: skip
        kwargs["device_map"] = {"": args.device}
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    if args.dtype != "4bit":
        model.to(args.device)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    steps = args.clients * args.steps
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (args.batch, args.length), generator=g).to(args.device)
    labels = ids.clone()
    labels[:, : args.length - 8] = -100  # the response tokens only, as fedtune's loss
    model.train()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"peak_bytes": peak_bytes(args.device), "tokens_per_s": steps * args.batch * args.length / seconds}


def run_one(args, kind: str, dtype: str, clients: int, model: Path, data: Path, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--measure", kind, "--dtype", dtype, "--clients", str(clients),
           "--model", str(model), "--data", str(data), "--steps", str(steps), "--device", args.device,
           "--batch", str(args.batch), "--length", str(args.length), "--scratch", str(args.scratch),
           "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        print(f"  {kind} {dtype} N={clients}: failed: {tail[0]}", flush=True)
        return {"kind": kind, "dtype": dtype, "clients": clients, "error": tail[0]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(kind=kind, dtype=dtype, clients=clients, steps=steps, wall_s=time.perf_counter() - start)
    print(f"  {kind:8s} {dtype:9s} N={clients:<3d} peak {result['peak_bytes'] / 2**30:6.2f} GiB  "
          f"{result['tokens_per_s']:8.1f} tokens/s  ({result['wall_s']:.0f} s)", flush=True)  # fmt: skip
    return result


def report(device_results: dict[str, dict]) -> str:
    lines = ["# Model scale: memory against clients, speed against a bare loop, a 3B-shaped model", "",
             "Written by `benchmarks/llm/llm_scale.py` (see its docstring for what is measured). Ratios are",
             "measured side by side in one run of the script on one machine. The bare loop runs the",
             "steps of the largest N (N x local steps), so speed compares like with like at the largest N;",
             "at smaller N the process's one-time warm-up falls on fewer fedtune steps.", ""]  # fmt: skip
    for device, res in device_results.items():
        cfg = res["config"]
        commands = ", ".join(f"`{c}`" for c in res.get("commands", {}).values())
        lines += [f"## {device}: {res['machine']}", "",
                  f"Commands: {commands}. Model: {cfg['shape']} shape (random weights), batch "
                  f"{cfg['batch']} x {cfg['length']} tokens, LoRA r = 8 on q/v, {cfg['steps']} local steps per client.",
                  "", "| dtype | N clients | fedtune peak GiB | bare peak GiB | peak ratio | fedtune tokens/s | "
                  "bare tokens/s | speed ratio |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        rows = res["rows"]
        if res.get("note"):
            lines[-2:-2] = [res["note"], ""]
        for dtype in DTYPES:
            bare = next((r for r in rows if r["kind"] == "bare" and r["dtype"] == dtype and "error" not in r), None)
            for r in (r for r in rows if r["kind"] == "fedtune" and r["dtype"] == dtype):
                if "error" in r or bare is None:
                    lines.append(f"| {dtype} | {r['clients']} | failed: {r.get('error', 'no bare loop')} |||||")
                    continue
                lines.append(
                    f"| {dtype} | {r['clients']} | {r['peak_bytes'] / 2**30:.2f} | {bare['peak_bytes'] / 2**30:.2f} | "
                    f"{r['peak_bytes'] / bare['peak_bytes']:.2f} | {r['tokens_per_s']:.0f} | "
                    f"{bare['tokens_per_s']:.0f} | {r['tokens_per_s'] / bare['tokens_per_s']:.2f} |"
                )
        if res.get("size"):
            lines += ["", f"**(c) {SIZE_SHAPE}-shaped model**, 8 clients, one round of 2 local steps each:", "",
                      "| dtype | peak GiB | seconds per step |", "|---|---|---|"]  # fmt: skip
            for r in res["size"]:
                if "error" in r:
                    lines.append(f"| {r['dtype']} | failed: {r['error']} | |")
                else:
                    step_s = args_batch_tokens(res, r) / r["tokens_per_s"]
                    lines.append(f"| {r['dtype']} | {r['peak_bytes'] / 2**30:.2f} | {step_s:.2f} |")
        lines.append("")
    return "\n".join(lines)


SIZE_SHAPE = "llama-3.2-3b"


def args_batch_tokens(res: dict, row: dict) -> int:
    return res["config"]["size_batch"] * res["config"]["size_length"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--clients", default="2,8,32", help="'': only (c)")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--steps", type=int, default=1, help="local steps per client")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    p.add_argument("--kinds", default="bare,fedtune", help="(a)/(b) sides to measure; others keep their saved rows")
    p.add_argument("--size", action="store_true", help="also (c): the Llama-3.2-3B-shaped model")
    p.add_argument("--scratch", default=str(Path(tempfile.gettempdir()) / "fedtune-llm-scale"))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--name", help="results file and section (default: the device, cpu or cuda)")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not set(args.kinds.split(",")) <= {"bare", "fedtune"}:
        p.error(f"--kinds: expected bare and/or fedtune, comma-separated (got {args.kinds!r})")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.measure:
        args.clients = int(args.clients)
        result = measure_fedtune(args) if args.measure == "fedtune" else measure_bare(args)
        print(json.dumps(result))
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    saved = {f.stem: json.loads(f.read_text()) for f in sorted(RESULTS.glob("*.json"))}
    if not args.report_only:
        import platform

        import torch

        scratch = Path(args.scratch)
        scratch.mkdir(parents=True, exist_ok=True)
        clients = [int(n) for n in args.clients.split(",")] if args.clients else []
        data = synthetic_data(scratch, max([8, *clients]) * args.batch * args.steps * 2 + 16)
        if args.device.startswith("cuda"):
            machine = torch.cuda.get_device_name()
        else:
            from fedtune.models.precision import computes_natively

            units = computes_natively(torch.device("cpu"), torch.bfloat16)
            machine = f"{platform.processor() or 'CPU'} ({'with' if units else 'without'} bfloat16 units)"
        device = args.name or ("cuda" if args.device.startswith("cuda") else "cpu")
        res = saved.setdefault(device, {"rows": [], "size": []})
        res["machine"] = f"{machine}, torch {torch.__version__}, {os.cpu_count()} cores"
        if clients or "config" not in res:  # (c) alone leaves the settings of (a) and (b) as they were
            res["config"] = {"shape": "smollm2-135m", "batch": args.batch, "length": args.length,
                             "steps": args.steps, "size_batch": 1, "size_length": 64}  # fmt: skip
        command = "python benchmarks/llm/llm_scale.py " + " ".join(sys.argv[1:])

        def keep(part: str, row: dict) -> None:  # saved after every measurement: a cut run keeps its rows
            res[part] = [r for r in res[part] if (r["kind"], r["dtype"], r["clients"]) != (
                row["kind"], row["dtype"], row["clients"])] + [row]  # fmt: skip
            res.setdefault("commands", {})[part] = command
            (RESULTS / f"{device}.json").write_text(json.dumps(res, indent=1))

        if clients:
            model = build_model_folder("smollm2-135m", scratch)
            kinds = args.kinds.split(",")
            for dtype in args.dtypes.split(","):
                if "bare" in kinds:
                    keep("rows", run_one(args, "bare", dtype, max(clients), model, data, args.steps))
                for n in clients if "fedtune" in kinds else []:
                    keep("rows", run_one(args, "fedtune", dtype, n, model, data, args.steps))
        if args.size:
            big = build_model_folder(SIZE_SHAPE, scratch)
            size_args = argparse.Namespace(**{**vars(args), "batch": 1, "length": 64})
            for dtype in [d for d in args.dtypes.split(",") if d != "float32"]:  # default: bfloat16, 4bit
                keep("size", run_one(size_args, "fedtune", dtype, 8, big, data, 2))
    (RESULTS / "README.md").write_text(report(saved))
    print(f"wrote {RESULTS / 'README.md'}")


if __name__ == "__main__":
    main()
