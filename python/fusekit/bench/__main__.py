"""`python -m fusekit.bench`: time every installed backend and the baselines over the op sweeps.

    python -m fusekit.bench [--ops a,b] [--backends triton,mojo|none] [--baselines ...|none]
                            [--quick] [--device cuda|cpu] [--out benchmarks/results]
                            [--case LABEL | --filter SUBSTR[|SUBSTR...]] [--budget-s SECONDS]

Writes <out>/<device slug>/<op>.json after each op (so an interrupted run keeps the finished ops) and
prints a short table per op.
"""

from __future__ import annotations

import argparse
import sys
import time
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
    ap.add_argument("--ops", default=",".join(cases.OPS), help="comma-separated ops (default: all)")
    ap.add_argument("--backends", default=None, help="fusekit backends (default: all available)")
    names = ",".join(baselines.BASELINE_NAMES)
    ap.add_argument("--baselines", default=None, help=f"baselines or 'none' (default: all of {names})")
    ap.add_argument("--quick", action="store_true", help="a few sizes per op")
    ap.add_argument("--device", default=None, choices=["cuda", "cpu"], help="default: cuda if available")
    ap.add_argument("--out", default="benchmarks/results", help="results root (default: benchmarks/results)")
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
        return f"  {row['case']:<44} {row['provider']:<14} {row['status']}: {str(row['reason'])[:90]}"
    rate = f"{row['tflops']:8.3g} TFLOP/s" if row.get("tflops") else f"{row['gbps']:8.4g} GB/s   "
    return (
        f"  {row['case']:<44} {row['provider']:<14} {row['time_us']:11.1f} us {rate} "
        f"{row['pct_of_ceiling']:5.1f}% e2e {row['e2e_us']:9.1f} us err {row['rel_error']:.1e}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev_type == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but torch sees no CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device(dev_type, 0) if dev_type == "cuda" else torch.device("cpu")
    ops = _list(args.ops) or []
    bad = [o for o in ops if o not in cases.OPS]
    if bad:
        print(f"unknown ops {bad}; valid: {', '.join(cases.OPS)}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()

    backend_provs, skipped = baselines.backend_providers(_list(args.backends))
    providers = backend_provs + baselines.baseline_providers(_list(args.baselines))
    meta = results.environment(device)
    meta["skipped_backends"] = skipped
    meta["providers"] = {p.name: {"kind": p.kind, "description": p.description} for p in providers}
    names = [p.name for p in providers]
    print(f"fusekit.bench on {results.device_name(device)}: providers {names}", flush=True)
    for name, why in skipped.items():
        print(f"  backend {name} not available: {why[:200]}", flush=True)

    ceil = ceilings.measure(device)
    print(
        f"ceilings: copy {ceil['copy']['gbps']:.0f} GB/s, {ceil['matmul']['name']} "
        f"{ceil['matmul']['tflops']:.3g} TFLOP/s",
        flush=True,
    )
    rep_ms = args.rep_ms or (50.0 if args.quick else 100.0)
    written: list[Path] = []
    for op in ops:
        op_cases = cases.sweep(op, quick=args.quick, cpu=device.type == "cpu")
        op_cases = select_cases(op_cases, args.case, args.filter)
        if not op_cases:
            continue
        bar = _progress(len(op_cases) * len(providers), op, not args.no_progress)
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
        extra = {"quick": args.quick, "truncated": truncated}
        path = results.write(Path(args.out), device, op, meta, ceil, rows, **extra)
        written.append(path)
        print(f"{op}: {path}" + (" (budget reached: truncated)" if truncated else ""), flush=True)
        for r in rows:
            if r["status"] != "skipped":
                print(_fmt(r), flush=True)
    print(f"done in {time.perf_counter() - t_start:.0f} s; wrote {len(written)} file(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
