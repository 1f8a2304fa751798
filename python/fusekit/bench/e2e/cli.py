"""`python -m fusekit.bench.e2e`'s command line: each provider in its own process, then one document."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from fusekit.bench import results
from fusekit.bench.e2e.config import (
    DTYPES,
    MODELS,
    PROVIDERS,
    SCENARIOS,
    SCHEMA,
    Setup,
    _decode_shapes,
    _ids,
    _shapes,
    base_weights,
    file_name,
)
from fusekit.bench.e2e.document import _method, compose, load_for_merge, table
from fusekit.bench.e2e.providers import make_providers
from fusekit.bench.e2e.scenarios import reference, run_provider


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fusekit.bench.e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    ap.add_argument(
        "--model", choices=tuple(MODELS), default=None, help="llama3-8b (cuda default), llama3.2-1b or tiny"
    )
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (llama3-8b: 4, tiny: 2)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="bf16 on cuda, fp32 on cpu")
    ap.add_argument(
        "--attn", default="sdpa", choices=("sdpa", "eager"), help="HF attention (eager, compile, liger)"
    )
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma list, in the order run")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--prefill", default=None, help="BxS[,BxS...] (the first is the gate batch)")
    ap.add_argument("--decode", default=None, help="BxPROMPT+NEW[,BxPROMPT+NEW...] (the first is the gate's)")
    ap.add_argument("--train", default=None, help="BxS[,BxS...]")
    ap.add_argument(
        "--optim", default="foreach", choices=("foreach", "fused"),
        help="the training step's AdamW: torch's default (foreach) or fused=True (HF Trainer's default)",
    )  # fmt: skip
    ap.add_argument(
        "--ab-rounds", type=int, default=3,
        help="same-process decode and train rounds of each patched (not compiled) provider against HF eager (0: off)",
    )  # fmt: skip
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls, the first included (2; quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls, median reported (5; quick 2)")
    ap.add_argument("--quick", action="store_true", help="fewer warm-up and timed calls")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default=None, help="results root (cuda: benchmarks/results, cpu: build/bench/results)"
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows this run does not measure from an existing e2e.json",
    )
    ap.add_argument(
        "--budget-s", type=float, default=None, help="start no new provider or case after S seconds"
    )
    ap.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each provider in its own process (default on CUDA with several providers): what one "
        "provider leaves behind (dynamo's caches and hooks after torch.compile, CUDA-graph pools, a "
        "grown heap) must not slow the next one down",
    )
    return ap


def _isolated(names: list[str], argv: list[str], merge: bool, deadline: float | None, path: Path) -> int:
    """Run each provider as `python -m fusekit.bench.e2e <argv> --providers <p> --no-isolate`, merging
    into one e2e.json (the first keeps --merge as given, the others merge into it), then print the lot.
    Why: in one-process H200 runs, fusekit-triton decode timed after the compile providers took 6.4-6.7
    ms/token and 4.4 when timed first; its own process later gave 7.6, so process state was not the whole
    story there, but no provider's leftovers can bias another's rows this way."""
    rc = 0
    for i, name in enumerate(names):
        extra = ["--providers", name, "--no-isolate"] + (["--merge"] if merge or i else [])
        if deadline is not None:
            extra += ["--budget-s", f"{max(0.0, deadline - time.perf_counter()):.1f}"]
        cmd = [sys.executable, "-m", "fusekit.bench.e2e", *argv, *extra]
        res = subprocess.run(cmd, env={**os.environ, "FUSEKIT_E2E_QUIET_TABLE": "1"}, check=False)
        rc = rc or res.returncode
    if path.exists():
        print(table(json.loads(path.read_text())["rows"]))
    return rc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    model_name = args.model or ("llama3-8b" if device.type == "cuda" else "tiny")
    spec = MODELS[model_name]
    names = [p for p in args.providers.split(",") if p]
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [p for p in names if p not in PROVIDERS] + [s for s in scenarios if s not in SCENARIOS]
    if bad:
        print(f"unknown providers/scenarios {bad}; valid: {PROVIDERS} / {SCENARIOS}", file=sys.stderr)
        return 2
    out_root = Path(args.out) if args.out else results.default_out(device)
    if device.type == "cpu" and results.is_committed_path(out_root):
        print(
            f"refusing to write CPU timings under {results.COMMITTED_RESULTS}; use --out {results.LOCAL_RESULTS}",
            file=sys.stderr,
        )
        return 2
    setup = Setup(
        device=str(device),
        model=model_name,
        layers=args.layers or spec["layers"],
        dtype=args.dtype or ("bf16" if device.type == "cuda" else "fp32"),
        attn_implementation=args.attn,
        prefill=_shapes(args.prefill or spec["prefill"]),
        decode=_decode_shapes(args.decode or spec["decode"]),
        train=_shapes(args.train or spec["train"]),
        seed=args.seed,
        config={**spec["config"], "num_hidden_layers": args.layers or spec["layers"]},
        optim=args.optim,
    )
    warmup = args.warmup or (1 if args.quick else 2)
    reps = args.reps or (2 if args.quick else 5)
    path = (
        out_root / results.slug(results.device_name(device)) / file_name(model_name, setup.layers, args.train)
    )
    setup_doc = json.loads(json.dumps(asdict(setup)))  # tuples -> lists, as a loaded file has them
    old = load_for_merge(path, setup_doc) if args.merge else None
    run_index = len(old["runs"]) if old else 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    deadline = None if args.budget_s is None else t0 + args.budget_s
    isolate = args.isolate if args.isolate is not None else device.type == "cuda" and len(names) > 1
    if isolate:
        return _isolated(names, list(sys.argv[1:] if argv is None else argv), args.merge, deadline, path)
    log = lambda s: print(s, flush=True)
    log(f"e2e: {model_name}, {setup.layers} layers, {setup.dtype} on {device}; providers {', '.join(names)}")
    state = base_weights(setup)
    b, p, n = setup.decode[0]
    gate_ids, prompt = _ids(setup, *setup.prefill[0], salt=1), _ids(setup, b, p, salt=2)
    ref = reference(setup, state, gate_ids, prompt, n, train="train" in scenarios)
    if ref.eager_err is not None:
        log(f"  HF eager {setup.dtype} logits vs fp32: relative error {ref.eager_err:.3g}")

    meta = results.environment(device)
    meta["schema"] = SCHEMA
    meta["command"] = " ".join(["python -m fusekit.bench.e2e", *(sys.argv[1:] if argv is None else argv)])
    meta["transformers"] = transformers.__version__
    doc: dict = {
        "schema": SCHEMA,
        "meta": meta,
        "setup": {**setup_doc, "parameters": sum(v.numel() for v in state.values())},
        "method": _method(setup, warmup, reps, args.quick),
        "reference": {"eager_logits_rel_error_vs_fp32": ref.eager_err},
        "providers": {},
        "rows": [],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    final = doc
    for prov in make_providers(names, setup):
        log(f"{prov.name}:")

        def checkpoint(rec: dict, rows: list[dict], name: str = prov.name) -> None:
            # the rows so far over the old file; the record says the provider has not finished
            part = {
                **doc,
                "providers": {**doc["providers"], name: {**rec, "run": run_index, "partial": True}},
                "rows": doc["rows"] + [{**r, "run": run_index} for r in rows],
            }
            _write(path, compose(part, old))

        rec, rows = run_provider(
            prov, setup, scenarios, state, ref, warmup, reps, deadline, log,
            ab_rounds=args.ab_rounds, checkpoint=checkpoint,
        )  # fmt: skip
        if rec["status"] != "ok":
            log(f"  {prov.name}: {rec['status']}: {rec['reason'][:300]}")
        doc["providers"][prov.name] = {**rec, "run": run_index}
        doc["rows"] += [{**r, "run": run_index} for r in rows]
        final = compose(doc, old)
        _write(path, final)  # after each provider: a run cut short keeps what finished
    if not os.environ.get("FUSEKIT_E2E_QUIET_TABLE"):  # an isolated worker: the parent prints the lot
        print(table(final["rows"]))
    label = "" if device.type == "cuda" else " (CPU host timings, git-ignored)"
    log(f"results -> {path}{label}  ({time.perf_counter() - t0:.0f} s)")
    return 0


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)
