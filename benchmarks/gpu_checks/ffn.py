"""H200 check of the Triton swiglu_ffn prefill GEMMs: pointer kernels vs TMA persistent kernels (< 60 s).

    PYTHONPATH=python:. python benchmarks/gpu_checks/ffn.py [--T 4096 --D 4096 --F 11008] [--rep-ms 50]

1. Correctness in bf16 of `_gemm="ptr"` and `_gemm="tma"` against the float64 reference (relative error,
   outputs NaN-poisoned first): T=4096 without norm, T=333 with the RMSNorm prologue (ragged M tiles).
2. Device time (triton.testing.do_bench median, L2 flushed) at T x D x F bf16 without norm: ptr, tma, the
   automatic choice, cuBLAS (three torch matmuls) and torch.compile of the native-bf16 MLP (skipped once
   past --budget-s), in TFLOP/s (6*T*D*F FLOPs), and every candidate the selector timed with its pick.
Prints a summary; with $OUT set it also writes $OUT/ffn_check.json. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as Fn

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT / "python"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import triton  # noqa: E402
from _out import save_json  # noqa: E402 (benchmarks/gpu_checks/_out.py: the script's folder is on sys.path)

import kernels_triton.swiglu_ffn as ffn  # noqa: E402
from fusekit.ops.swiglu_ffn import reference_forward  # noqa: E402

TOL_BF16 = 1e-2
warnings.simplefilter("always")  # every excluded TMA config is reported


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def inputs(T: int, D: int, F: int, norm: bool, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    wg = (torch.randn(F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    wu = (torch.randn(F, D, device="cuda", generator=g) / D**0.5).bfloat16()
    wd = (torch.randn(D, F, device="cuda", generator=g) / F**0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).bfloat16() if norm else None
    return x, wg, wu, wd, nw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--F", type=int, default=11008)
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--budget-s", type=float, default=50.0, help="skip torch.compile once past this")
    args = ap.parse_args()
    t0 = time.time()
    T, D, F = args.T, args.D, args.F
    print(
        f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True
    )
    res: dict = {"triton": triton.__version__, "T": T, "D": D, "F": F, "errors": {}, "tflops": {}}

    def check(t: int, norm: bool) -> bool:
        x, wg, wu, wd, nw = inputs(t, D, F, norm, seed=t)
        ref = reference_forward(x.double(), wg.double(), wu.double(), wd.double(),
                                None if nw is None else nw.double(), 1e-6)[0]  # fmt: skip
        good_all = True
        for gemm in ("ptr", "tma"):
            out = torch.full_like(x, float("nan"))
            try:
                ffn.swiglu_ffn(out, x, wg, wu, wd, nw, 1e-6, _path="prefill", _gemm=gemm)
                torch.cuda.synchronize()
                err = rel(out, ref)
            except Exception as exc:  # report and go on: the other path may still be fine
                err = float("nan")
                print(f"  {gemm} T={t}: {type(exc).__name__}: {exc}", flush=True)
            good = err < TOL_BF16
            good_all &= good
            res["errors"][f"{gemm}_T{t}_norm{int(norm)}"] = err
            print(f"correct {gemm:3s} T={t:5d} norm={int(norm)}  rel err {err:.2e}  {'ok' if good else 'FAIL'}"
                  f"  ({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
        return good_all

    def mlp(x, wg, wu, wd):
        return (Fn.silu(x @ wg.T) * (x @ wu.T)) @ wd.T

    def timed(name: str, fn) -> bool:
        try:
            fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median")
        except Exception as exc:
            print(f"time   {name:14s} {type(exc).__name__}: {exc}", flush=True)
            return False
        res["tflops"][name] = flops / ms / 1e9
        print(f"time   {name:14s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s  ({time.time() - t0:.0f} s)",
              flush=True)  # fmt: skip
        return True

    # Order: the numbers that matter first; the T=333 check (new ptr autotuning) and torch.compile's
    # compile time come last, torch.compile only while inside --budget-s.
    ok = check(T, False)
    x, wg, wu, wd, _ = inputs(T, D, F, False, seed=1)
    out = torch.empty_like(x)
    flops = 6.0 * T * D * F
    ok &= timed("triton-ptr", lambda: ffn.swiglu_ffn(out, x, wg, wu, wd, None, 1e-6, _gemm="ptr"))
    ok &= timed("triton-tma", lambda: ffn.swiglu_ffn(out, x, wg, wu, wd, None, 1e-6, _gemm="tma"))
    ok &= timed("triton-auto", lambda: ffn.swiglu_ffn(out, x, wg, wu, wd, None, 1e-6))
    ok &= timed("cublas", lambda: mlp(x, wg, wu, wd))
    ok &= check(333, True)
    if time.time() - t0 < args.budget_s:
        cm = torch.compile(mlp, dynamic=False)
        ok &= timed("torch-compile", lambda: cm(x, wg, wu, wd))
    else:
        print(f"time   torch-compile  skipped (past --budget-s {args.budget_s:.0f} s; last H200 run: 667)")

    # ---- what the selector timed and chose
    res["choices"] = []
    for kind in ("gate_up", "down"):  # the pointer kernels' autotuned configs, per (M, N, K)
        for k, cfg in getattr(ffn._tuned(kind), "cache", {}).items():
            print(f"ptr    {kind:7s} autotuned {k}: {cfg}", flush=True)
    for key, times in ffn.TIMINGS.items():
        if len(times) < 2:
            continue  # a single candidate is not timed
        pick = ffn._CHOICE[key]
        kind, bucket, n, k, dt, gemm = key[0], key[1], key[2], key[3], key[4], key[-1]
        line = f"{kind:7s} T<={bucket:<5d} N={n} K={k} {str(dt)[6:]} _gemm={gemm}: chose {pick}"
        cand = "; ".join(f"{c}={ms * 1e3:.0f}us" for c, ms in times)
        print(f"choice {line}\n         timed: {cand}", flush=True)
        res["choices"].append(
            {"key": str(key), "chose": str(pick), "timed": [[str(c), ms] for c, ms in times]}
        )
    tf = res["tflops"]
    if "triton-auto" in tf and "torch-compile" in tf:
        print(f"triton-auto / torch-compile = {tf['triton-auto'] / tf['torch-compile']:.3f}", flush=True)
    print(f"{'PASS' if ok else 'FAIL'} in {time.time() - t0:.0f} s", flush=True)
    save_json("ffn_check.json", res)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
