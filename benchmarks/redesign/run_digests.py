"""Run-folder digests: does a change keep every run folder byte-identical (issue 53)?

``python benchmarks/redesign/run_digests.py --out DIR`` runs a matrix of seconds-long real runs
(:func:`fedtune.launch.launch`, the path ``fedtune run`` takes, each under ``DIR/<case>/``): every
registered method on the embedded engine (on text-classification where it supports it, else its
first task kind; :func:`fedtune.testing.tiny_config`), a few methods on ``flower-sim``, a central-DP
run (``privacy.insecure_reproducible_noise``: the noise is seeded, so it repeats), a SecAgg+ run on
``flower-sim``, a budget-planned run (``plan.json``), a resume (2 rounds, then ``--resume`` to 3),
a DP resume and an ``--overwrite`` that moves an earlier run aside. It then writes
``DIR/digests.json``: ``{"case/run/file": {"sha256": ..., "mode": "0644"}}`` for every file under
``DIR`` (a case that fails records its one-line error instead), and ``DIR/timings.json`` (seconds
per case, not compared). ``--redigest DIR`` digests an earlier ``--out DIR`` again (after a change
to this script). Run it on a quiet machine: under heavy load a ``flower-sim`` case can fail
("RuntimeError: An error was encountered"); rerun such a case alone with ``--only``.

Normalised away before hashing, and nothing else:

- timing: in JSON (``.json``, ``.jsonl``, a checkpoint's ``__json__`` member) every value whose key
  ends in ``_s`` (``wall_s``, ``compute_s``, ``client_compute_s``, ``total_compute_s``) and the
  ``environment`` record of ``summary.json`` (the machine, not the code);
- absolute paths: the text of ``DIR`` (as given and resolved) becomes ``<OUT>`` in every text file;
- reply order in a timing file (a name with ``timing``: ``flower_timing.jsonl`` records each reply as
  it arrived): its keys are sorted;
- zip metadata of ``.npz`` files (numpy stamps each member with the time): an ``.npz`` is hashed as
  its members' names and bytes, in order.

The matrix runs under ``PYTHONHASHSEED=0`` (the script re-executes itself so): PEFT writes
``adapter_config.json``'s ``target_modules`` from a set, whose order the hash seed decides.

A JSON file is re-written with the indent that reproduces it (none or 2); one that neither does is
hashed as its text (so a formatting change shows). ``--compare A B`` (two digests.json or the
folders holding them) prints the files compared, identical and differing, names the differing
ones, and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import zipfile
from pathlib import Path

TEXT_SUFFIXES = {".json", ".jsonl", ".toml", ".txt", ".md", ".csv", ".yaml", ".yml"}
KIND = "text-classification"
SHOWN = 30  # differing files --compare names
#: the methods' own tiny settings (as tests/conftest.py's): distillation and finite differences kept short
SHORT = {
    "fedpft": ("options.distill_steps=2", "options.distill_batch_size=8", "options.distill_samples=64"),
    "fedot": ("options.distill_steps=2", "options.distill_batch_size=8", "options.distill_samples=64"),
    "rafbo": ("options.fd_coordinates=8",),
}
SIM = ('engine="flower-sim"',)
CENTRAL = (
    'privacy.mode="central"',
    "privacy.clip=0.05",
    "privacy.noise_multiplier=0.8",
    "privacy.insecure_reproducible_noise=true",
)
SECURE = (
    "secure_aggregation.enabled=true",
    "secure_aggregation.clipping_range=0.5",
    f"secure_aggregation.quantization_range={2**24}",
    "federation.clients_per_round=3",
)
BUDGETS = ("federation.profiles=[{memory_gib=64}, {memory_gib=64, capacity=0.25}, {memory_gib=1e-9}]",)


def cases() -> dict[str, tuple]:
    """``name -> (method, task kind, overrides, steps)``; ``steps``: the launches, each
    ``(extra overrides, resume, overwrite)``."""
    from fedtune.methods import list_methods

    once: tuple = (((), False, False),)
    out: dict[str, tuple] = {}
    for spec in list_methods():
        kinds = spec.supported_tasks()
        out[spec.name] = (spec.name, KIND if KIND in kinds else kinds[0], (), once)
    for method in ("fedit", "fslora", "fedpft"):
        out[f"sim-{method}"] = (method, KIND, SIM, once)
    out["dp-central"] = ("fedit", KIND, CENTRAL, once)
    out["secagg-sim"] = ("fedit", KIND, (*SECURE, *SIM), once)
    out["budget-plan"] = ("rabo", "few-shot", (*BUDGETS, "federation.clients_per_round=3"), once)
    resumed = ((("rounds=2",), False, False), (("rounds=3",), True, False))
    out["resume"] = ("fslora", KIND, (), resumed)
    out["resume-dp"] = ("fedit", KIND, CENTRAL, resumed)
    out["overwrite"] = ("fedit", KIND, (), (((), False, False), (("seed=1",), False, True)))
    return out


def run_case(out: Path, name: str, case: tuple) -> str | None:
    """Run case ``name`` under ``out/name``; its one-line error, or None."""
    from fedtune.launch import launch
    from fedtune.testing import tiny_config

    method, kind, overrides, steps = case
    try:
        for extra, resume, overwrite in steps:
            config = tiny_config(method, kind, out / name, *SHORT.get(method, ()), *overrides, *extra)
            launch(config, resume=resume, overwrite=overwrite)
    except Exception as exc:  # noqa: BLE001 - recorded in the digests: a change that breaks a case shows
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _untimed(node, key: str = ""):
    """``node`` (parsed JSON) with every value under a key ending in ``_s``, and ``environment``,
    replaced by ``"<normalised>"``."""
    if key.endswith("_s") or key == "environment":
        return "<normalised>"
    if isinstance(node, dict):
        return {k: _untimed(v, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_untimed(v) for v in node]
    return node


def _json_text(text: str, arrival: bool = False) -> str:
    """JSON (or JSON lines) text with its timing normalised, written as it was (else as is);
    ``arrival``: its mappings' order is the replies' arrival order (timing too): keys sorted."""
    try:
        if "\n" in text.rstrip("\n") and not text.lstrip().startswith(("{\n", "[\n")):  # JSON lines
            lines = [json.loads(line) for line in text.splitlines() if line.strip()]
            redone = "".join(json.dumps(x) + "\n" for x in lines)
            return "".join(json.dumps(_untimed(x), sort_keys=arrival) + "\n" for x in lines) if redone == text else text
        node = json.loads(text)
    except ValueError:
        return text
    for indent in (None, 2):
        if json.dumps(node, indent=indent) == text.rstrip("\n"):
            return json.dumps(_untimed(node), indent=indent, sort_keys=arrival) + text[len(text.rstrip("\n")) :]
    return text


def file_digest(path: Path, roots: tuple[str, ...]) -> str:
    """sha256 of ``path`` with timing, absolute paths and zip metadata normalised (module docstring)."""
    digest = hashlib.sha256()
    if path.suffix == ".npz" and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():
                data = z.read(member)
                if member == "__json__.npy":  # the plain values, behind a 128-byte-aligned .npy header
                    head = data[: data.index(b"\n") + 1]
                    body = _json_text(data[len(head) :].decode()).encode()
                    data = head + body
                digest.update(member.encode() + b"\0" + hashlib.sha256(data).digest())
        return digest.hexdigest()
    raw = path.read_bytes()
    if path.suffix in TEXT_SUFFIXES:
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            return hashlib.sha256(raw).hexdigest()
        for root in roots:
            text = text.replace(root, "<OUT>")
        if path.suffix in (".json", ".jsonl"):
            text = _json_text(text, arrival="timing" in path.name)
        raw = text.encode()
    return hashlib.sha256(raw).hexdigest()


def digests(out: Path, errors: dict[str, str]) -> dict[str, dict]:
    """Every file under ``out`` (but the digests' own files): its normalised sha256 and mode; each
    failed case as ``case/ERROR``."""
    roots = tuple(sorted({str(out), str(out.resolve())}, key=len, reverse=True))
    found = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = str(path.relative_to(out))
        if rel in ("digests.json", "timings.json"):
            continue
        found[rel] = {"sha256": file_digest(path, roots), "mode": oct(path.stat().st_mode & 0o777)}
    for name, error in errors.items():
        found[f"{name}/ERROR"] = {"error": error.replace(roots[0], "<OUT>").replace(roots[-1], "<OUT>")}
    return found


def compare(a: Path, b: Path) -> int:
    """Print files compared / identical / differing between two digests; 1 when any differs."""
    left, right = (json.loads((p / "digests.json" if p.is_dir() else p).read_text()) for p in (a, b))
    names = sorted(left.keys() | right.keys())
    differing = [n for n in names if left.get(n) != right.get(n)]
    print(f"files compared: {len(names)}, identical: {len(names) - len(differing)}, differing: {len(differing)}")
    for name in differing[:SHOWN]:
        where = "only in A" if name not in right else "only in B" if name not in left else "differs"
        print(f"  {where}: {name}  A={left.get(name)}  B={right.get(name)}")
    if len(differing) > SHOWN:
        print(f"  ... and {len(differing) - SHOWN} more")
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    """Run the matrix into ``--out`` and write its digests, or ``--compare`` two digests."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="an empty (or new) folder for the runs and digests.json")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="two digests.json (or folders)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these cases (by name)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--redigest", type=Path, metavar="DIR", help="digest an earlier --out DIR's runs again")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.redigest:  # the runs kept, digested by this version of the script; failed cases kept failed
        before = json.loads((args.redigest / "digests.json").read_text())
        errors = {k.removesuffix("/ERROR"): v["error"] for k, v in before.items() if k.endswith("/ERROR")}
        (args.redigest / "digests.json").write_text(
            json.dumps(digests(args.redigest, errors), indent=1, sort_keys=True)
        )
        return 0
    matrix = cases()
    if args.list:
        print("\n".join(f"{n}: {c[0]} on {c[1]} {' '.join(c[2])}" for n, c in matrix.items()))
        return 0
    if args.out is None or (args.out.exists() and any(args.out.iterdir())):
        print("--out: expected a new or empty folder", file=sys.stderr)
        return 2
    unknown = set(args.only or ()) - set(matrix)
    if unknown:
        print(f"--only: unknown cases {sorted(unknown)}; --list names them", file=sys.stderr)
        return 2
    if os.environ.get("PYTHONHASHSEED") != "0":  # PEFT writes target_modules from a set: one order every time
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    import torch

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    errors, timings = {}, {}
    for name, case in matrix.items():
        if args.only is not None and name not in args.only:
            continue
        start = time.perf_counter()
        error = run_case(args.out, name, case)
        timings[name] = round(time.perf_counter() - start, 1)
        print(f"[digests] {name}: {'ERROR ' + error if error else 'ok'} in {timings[name]} s", file=sys.stderr)
        if error:
            errors[name] = error
    found = digests(args.out, errors)
    (args.out / "digests.json").write_text(json.dumps(found, indent=1, sort_keys=True))
    (args.out / "timings.json").write_text(json.dumps({**timings, "total": round(sum(timings.values()), 1)}))
    print(f"{len(found)} files digested, {len(errors)} failed cases, {sum(timings.values()):.0f} s: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
