"""H200 check of the Triton rms_norm / layer_norm: tuned configs vs torch.compile, bf16 (< 60 s).

    TRITON_PRINT_AUTOTUNING=1 PYTHONPATH=python:. python benchmarks/gpu_checks/norms.py [--budget-s 40]

Per shape (default 32768x8192, 16384x65536, 8192x32768, 4096x65536) and op:
1. The first call tunes (times every candidate of `norm_candidates`, prints them with
   TRITON_PRINT_AUTOTUNING=1) and its output is checked: no NaN left in the poisoned output, and the
   relative error of 512 sampled rows (+ the last row) against the float64 reference <= 1e-2.
2. Device time (triton.testing.do_bench median, L2 flushed) of fusekit's Triton op (tuned choice) and of
   torch.compile(reference, dynamic=False), as the benchmarks time them; ratio = torch.compile / ours,
   and % of the byte floor at --copy-gbps.
--shapes MxN,... picks other shapes (16384x16384: layer_norm's 89.9 % on the H200 at 187ab72); --loop3 times
layer_norm twice, tuned afresh each time: without its "loop3" candidates (FUSEKIT_NORM_LOOP3=0: one program
per row, three passes, N constexpr), then with them, beside torch.compile (see kernels_triton/_config.py).
Once past --budget-s no new shape starts (the skipped ones are listed). With $OUT set it also writes
$OUT/norms_check.json. Exit status 1 if a correctness check fails.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT / "python"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import triton  # noqa: E402

_ln_spec = importlib.import_module("fusekit.ops.layer_norm")  # the module (fusekit.ops.layer_norm is the op)
_rms_spec = importlib.import_module("fusekit.ops.rms_norm")
from _out import save_json  # noqa: E402 (benchmarks/gpu_checks/_out.py: the script's folder is on sys.path)

from kernels_triton import _config  # noqa: E402
from kernels_triton.layer_norm import layer_norm  # noqa: E402
from kernels_triton.rms_norm import rms_norm  # noqa: E402

SHAPES = ((32768, 8192), (16384, 65536), (8192, 32768), (4096, 65536))


def bench(fn, rep_ms: int) -> float:
    t = triton.testing.do_bench(fn, warmup=10, rep=rep_ms, quantiles=[0.5])
    return 1e3 * float(t[0] if isinstance(t, (list, tuple)) else t)


def sampled_rel(out: torch.Tensor, ref_fn, x: torch.Tensor, seed: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.randint(0, x.shape[0], (512,), device="cuda", generator=g)
    rows = torch.cat([rows, torch.tensor([x.shape[0] - 1], device="cuda")])
    ref = ref_fn(x[rows].double())
    return float((out[rows].double() - ref).norm() / ref.norm())


def run_case(op: str, M: int, N: int, rep_ms: int, copy_gbps: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(M + N)
    x = (torch.randn(M, N, device="cuda", generator=g) + (0.3 if op == "layer_norm" else 0.0)).bfloat16()
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).bfloat16()
    b = (0.1 * torch.randn(N, device="cuda", generator=g)).bfloat16()
    out = torch.full_like(x, float("nan"))
    mean = torch.full((M,), float("nan"), device="cuda")
    rstd = torch.full((M,), float("nan"), device="cuda")
    t0 = time.time()
    if op == "rms_norm":
        ours = lambda: rms_norm(out, rstd, x, w, 1e-6)
        ref_fn = lambda xd: _rms_spec.reference_forward(xd, None, w.double(), 1e-6, "fp32")[0]
        native = lambda x, weight: _rms_spec.reference_forward(x, None, weight, 1e-6, "fp32")[0]
        args = (x, w)
    else:
        ours = lambda: layer_norm(out, mean, rstd, x, w, b, 1e-5)
        ref_fn = lambda xd: _ln_spec.reference_forward(xd, None, w.double(), b.double(), 1e-5)[0]
        native = lambda x, weight, bias: _ln_spec.reference_forward(x, None, weight, bias, 1e-5)[0]
        args = (x, w, b)
    ours()  # tunes on the first call
    torch.cuda.synchronize()
    tune_s = time.time() - t0
    nan_left = bool(torch.isnan(out).any())
    err = sampled_rel(out, ref_fn, x, M)
    key = [k for k in _config._NORM_TUNED if k[0] == op and k[1] == N]
    choice = _config._NORM_TUNED[key[-1]].label() if key else "untuned default"
    t_ours = bench(ours, rep_ms)
    t0 = time.time()
    torch._dynamo.reset()
    tc = torch.compile(native, dynamic=False)
    tc(*args)
    torch.cuda.synchronize()
    tc_compile_s = time.time() - t0
    t_tc = bench(lambda: tc(*args), rep_ms)
    floor_us = (2 * M * N * 2) / (copy_gbps * 1e3)
    return {
        "op": op, "M": M, "N": N, "ours_us": t_ours, "torch_compile_us": t_tc, "ratio": t_tc / t_ours,
        "pct_floor": 100 * floor_us / t_ours, "choice": choice, "rel_err": err, "nan_left": nan_left,
        "ok": (not nan_left) and err <= 1e-2, "tune_s": tune_s, "tc_compile_s": tc_compile_s,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=40.0, help="no new shape starts after this")
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--copy-gbps", type=float, default=4274.0, help="measured H200 copy rate (floor)")
    ap.add_argument("--ops", default="rms_norm,layer_norm")
    ap.add_argument("--shapes", default=None, help="MxN[,MxN...] (default: the four above)")
    ap.add_argument(
        "--loop3", action="store_true",
        help='time layer_norm twice, re-tuned: without its "loop3" candidates (FUSEKIT_NORM_LOOP3=0), then with them',
    )  # fmt: skip
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    start = time.time()
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__, flush=True)
    rows: list[dict] = []
    skipped: list[str] = []
    variants = [False, True] if args.loop3 else [True]  # layer_norm's loop3 candidates left out / offered
    todo = [(mn, op, v) for mn in shapes for op in args.ops.split(",") for v in variants]
    for (M, N), op, loop3 in todo:
        if op != "layer_norm" and loop3 != variants[0]:  # rms_norm has no loop3 mode: timed once
            continue
        if time.time() - start > args.budget_s:
            skipped.append(f"{op} {M}x{N}{' loop3' if loop3 and args.loop3 else ''}")
            continue
        os.environ[_config.NORM_LOOP3_ENV] = "1" if loop3 else "0"
        _config._NORM_TUNED.clear()  # tune again, with or without the loop3 candidates
        _config._NORM_SELECTED.clear()
        r = run_case(op, M, N, args.rep_ms, args.copy_gbps) | {"loop3": loop3 and op == "layer_norm"}
        rows.append(r)
        print(
            f"{op:10s} {M:6d}x{N:<6d} ours {r['ours_us']:8.1f} us  torch.compile {r['torch_compile_us']:8.1f} us"
            f"  ratio {r['ratio']:.3f}  floor {r['pct_floor']:5.1f}%  err {r['rel_err']:.2e}"
            f"{'' if r['ok'] else '  FAIL'}  [{r['choice']}] tune {r['tune_s']:.1f}s tc {r['tc_compile_s']:.1f}s",
            flush=True,
        )
    if skipped:
        print("skipped (budget):", ", ".join(skipped))
    print(f"total {time.time() - start:.0f} s")
    save_json("norms_check.json", {"rows": rows, "skipped": skipped})
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
