"""`python -m fusekit.bench`: time every installed backend and the baselines over the op suites.

    python -m fusekit.bench [--ops a,b] [--suite sweep,train,small|all] [--backends triton,mojo|none]
                            [--baselines ...|none] [--quick] [--device cuda|cpu] [--out DIR]
                            [--case LABEL | --filter SUBSTR[|SUBSTR...]] [--budget-s SECONDS]

Suites: "sweep" (forward size sweeps), "train" (forward + backward at training shapes), "small"
(model shapes where per-call overhead shows). Writes <out>/<device slug>/<op>.json ("sweep") or
<op>.<suite>.json after each op (so an interrupted run keeps the finished ones) and prints a short
table per op, with what was skipped and why. GPU results go to benchmarks/results (committed); CPU
results to build/bench/results (git-ignored): CPU timings never enter the committed report.

Beyond single ops: `python -m fusekit.bench.model` times a Llama decoder layer built from fusekit ops
(decode and prefill, eager and CUDA-graphed, against torch eager / torch.compile), and
`python -m fusekit.bench.e2e` a patched Hugging Face model (prefill, decode, training step).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from fusekit.bench import baselines, cases, ceilings, results
from fusekit.bench.run import run_case


def _list(s: str | None) -> list[str] | None:
    if s is None:
        return None
    if s.strip().lower() in ("", "none"):
        return []
    return [x.strip() for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m fusekit.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=None, help="comma-separated ops (default: all of fusekit.ops.OPS)")
    ap.add_argument(
        "--suite",
        "--group",
        dest="suite",
        default="all",
        help=f"comma-separated suites of {', '.join(cases.SUITES)}, or 'all' (default)",
    )
    ap.add_argument("--backends", default=None, help="fusekit backends (default: all available)")
    ap.add_argument("--baselines", default=None, help="baselines or 'none' (default: all that run here)")
    ap.add_argument("--quick", action="store_true", help="a few sizes per op")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    ap.add_argument(
        "--out",
        default=None,
        help=f"results root (default: {results.COMMITTED_RESULTS} on a GPU, {results.LOCAL_RESULTS} on the CPU)",
    )
    ap.add_argument("--case", default=None, help="run only the case with exactly this label")
    ap.add_argument(
        "--filter", default=None, help="run only cases whose label contains this ('a|b': either of them)"
    )
    ap.add_argument("--rep-ms", type=float, default=None, help="timed milliseconds per measurement")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new cases after this long")
    ap.add_argument("--no-kernel-time", action="store_true", help="skip the torch-profiler kernel time")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return ap.parse_args(argv)


def select_cases(op_cases: list, case: str | None, filt: str | None) -> list:
    """The cases named by --case (exact label) and --filter (label substrings, '|'-separated: any)."""
    if case:
        op_cases = [c for c in op_cases if c.label == case]
    if filt:
        wanted = filt.split("|")
        op_cases = [c for c in op_cases if any(w in c.label for w in wanted)]
    return op_cases


def _progress(total: int, desc: str, enabled: bool):
    """A tqdm bar if tqdm is importable (optional dependency), else a no-op."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, mininterval=2.0, file=sys.stderr, leave=False)
        except ImportError:
            pass

    class _Null:
        def update(self, n: int = 1) -> None: ...
        def close(self) -> None: ...

    return _Null()


def _fmt(row: dict) -> str:
    if row["status"] != "ok":
        return f"  {row['case']:<44} {row['provider']:<14} {row['status']}: {str(row['reason'])[:160]}"
    rate = f"{row['tflops']:8.3g} TFLOP/s" if row.get("tflops") else f"{row['gbps']:8.4g} GB/s   "
    timer = "gpu" if row.get("timer") == "cuda-events" else "host"
    mem = f" peak {row['peak_mem_bytes'] / 2**20:8.1f} MiB" if row.get("peak_mem_bytes") is not None else ""
    return (
        f"  {row['case']:<44} {row['provider']:<14} {timer} {row['time_us']:11.1f} us {rate} "
        f"{row['pct_of_ceiling']:5.1f}% wall {row['wall_us']:9.1f} us/call{mem} err {row['rel_error']:.1e}"
    )


def _skip_summary(rows: list[dict]) -> list[str]:
    """One line per (provider, reason) of the skipped rows, with how many cases."""
    n = Counter((r["provider"], str(r["reason"])) for r in rows if r["status"] == "skipped")
    return [f"  skipped {p} ({k} case{'s' if k > 1 else ''}): {why[:200]}" for (p, why), k in n.items()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_type == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device(dev_type, 0) if dev_type == "cuda" else torch.device("cpu")
    all_ops = cases.ops()
    ops = _list(args.ops) if args.ops is not None else list(all_ops)
    bad = [o for o in ops if o not in all_ops]
    if bad:
        print(f"unknown ops {bad}; valid: {', '.join(all_ops)}", file=sys.stderr)
        return 2
    suites = list(cases.SUITES) if args.suite.strip() == "all" else _list(args.suite) or []
    bad = [s for s in suites if s not in cases.SUITES]
    if bad or not suites:
        print(f"unknown suites {bad}; valid: {', '.join(cases.SUITES)} or all", file=sys.stderr)
        return 2
    from fusekit import backends as _backends

    bad = [b for b in _list(args.backends) or [] if b not in _backends.names()]
    if bad:
        print(f"unknown backends {bad}; valid: {', '.join(_backends.names())}", file=sys.stderr)
        return 2
    wanted_baselines = _list(args.baselines)
    known = baselines.all_baseline_names()
    bad = [b for b in wanted_baselines or [] if b not in known]
    if bad:
        print(f"unknown baselines {bad}; valid: {', '.join(known)}", file=sys.stderr)
        return 2
    out_root = Path(args.out) if args.out else results.default_out(device)
    if device.type == "cpu" and results.is_committed_path(out_root):
        print(
            f"refusing to write CPU timings under {results.COMMITTED_RESULTS} (the committed GPU results); "
            f"use --out {results.LOCAL_RESULTS} (the default on the CPU)",
            file=sys.stderr,
        )
        return 2
    t_start = time.perf_counter()

    backend_provs, skipped = baselines.backend_providers(_list(args.backends))
    per_op, skipped_base = baselines.baseline_providers(ops, wanted_baselines, device)
    meta = results.environment(device)
    meta["skipped_backends"] = skipped
    meta["skipped_baselines"] = skipped_base
    timer = (
        "CUDA events, cold L2 (device time); wall = host perf_counter over back-to-back calls"
        if device.type == "cuda"
        else "host wall-clock on the CPU (no device timer, no cache flush)"
    )
    meta["timer"] = timer
    where = results.device_name(device)
    print(f"fusekit.bench on {where}: {timer}", flush=True)
    print(f"  suites {', '.join(suites)}; ops {', '.join(ops)}", flush=True)
    print(f"  backends timed: {', '.join(p.name for p in backend_provs) or 'none'}", flush=True)
    for name, why in skipped.items():
        print(f"  backend {name} skipped: {why[:300]}", flush=True)
    timed = list(dict.fromkeys(p.name for provs in per_op.values() for p in provs))
    print(f"  baselines timed: {', '.join(timed) or 'none'}", flush=True)
    for name, why in skipped_base.items():
        print(f"  baseline {name} skipped: {why[:300]}", flush=True)
    for name in wanted_baselines or []:
        if name not in timed and name not in skipped_base:
            print(f"  baseline {name} skipped: none of the ops {', '.join(ops)} has it", flush=True)
    label = "" if device.type == "cuda" else " (git-ignored: CPU timings are never committed)"
    print(f"  results -> {out_root / results.slug(where)}/{label}", flush=True)

    ceil = ceilings.measure(device)
    print(
        f"ceilings: copy {ceil['copy']['gbps']:.0f} GB/s, {ceil['matmul']['name']} "
        f"{ceil['matmul']['tflops']:.3g} TFLOP/s",
        flush=True,
    )
    rep_ms = args.rep_ms or (50.0 if args.quick else 100.0)
    written: list[Path] = []
    for suite in suites:
        for op in ops:
            op_cases = cases.cases(op, suite, quick=args.quick, cpu=device.type == "cpu")
            op_cases = select_cases(op_cases, args.case, args.filter)
            if not op_cases:
                continue
            providers = backend_provs + per_op[op]
            bar = _progress(len(op_cases) * len(providers), f"{op} {suite}", not args.no_progress)
            rows: list[dict] = []
            truncated = False
            for case in op_cases:
                if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                    truncated = True
                    break
                rows += run_case(
                    case,
                    providers,
                    device,
                    ceil,
                    rep_ms=rep_ms,
                    kernel_time=not args.no_kernel_time,
                    on_done=bar.update,
                )
            bar.close()
            op_meta = dict(
                meta, providers={p.name: {"kind": p.kind, "description": p.description} for p in providers}
            )
            extra = {"quick": args.quick, "truncated": truncated}
            path = results.write(out_root, device, op, op_meta, ceil, rows, suite=suite, **extra)
            written.append(path)
            print(
                f"{op} [{suite}]: {path}" + (" (budget reached: truncated)" if truncated else ""), flush=True
            )
            for r in rows:
                if r["status"] != "skipped":
                    print(_fmt(r), flush=True)
            for line in _skip_summary(rows):
                print(line, flush=True)
    print(f"done in {time.perf_counter() - t_start:.0f} s; wrote {len(written)} file(s)", flush=True)
    if written:
        report = Path("build/bench/report") if device.type == "cpu" else Path("benchmarks/report")
        print(f"render: python -m fusekit.report --results {out_root} --out {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
