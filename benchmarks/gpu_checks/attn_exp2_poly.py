"""H200 probe of the opt-in polynomial exp2 in the attention forwards (issue #13; kernels_triton/_exp2_poly.py):
FUSEKIT_TRITON_ATTN_EXP2_POLY (attention.py's _attn_fwd_kernel) and FUSEKIT_HOPPER_ATTN_EXP2_POLY (the Gluon
FA3-style kernels of _attention_hopper.py, persistent and one-tile), ~5 min.

    PYTHONPATH=python:. python benchmarks/gpu_checks/attn_exp2_poly.py [--variants 8,4,2,4d4] [--causal 0,1]
        [--gluon-causal 0] [--d128 1]
    TRITON_INTERPRET=1 PYTHONPATH=python:. python benchmarks/gpu_checks/attn_exp2_poly.py --device cpu

D64 bf16, H32: B32 S512, B16 S1024, B4 S4096, B1 H32/8 S2048 (S = Skv), causal and not. In one process, per
case (do_bench median, L2 flushed, TFLOP/s of 4*B*H*S*Skv*D, halved causal):
- sdpa: F.scaled_dot_product_attention (GQA: k/v repeated to H heads first, so SDPA runs its MHA kernel);
- route: attention.forward as dispatched by default (Gluon persistent at D64 non-causal, _attn_fwd_kernel
  causal), switch off;
- off: attention.py's _attn_fwd_kernel (GLUON off), MUFU only: today's kernel;
- poly 1/n: the same kernel with 1/n of each score tile's exponentials through the degree-3 polynomial
  ("4d4": 1/4 at degree 4); each variant autotunes its own tile (the tuner keys on EXP2_POLY);
Accuracy, per variant: o's relative error against float64 attention on the first 4 (b, h) heads (err_f64;
SDPA's own err_f64 beside it: flash-attention's rule wants err <= 2 err_sdpa + ~1e-3 at bf16), lse's max
abs difference against float64 logsumexp (lse_f64), and the backward (attention.backward, which recomputes p
with MUFU exp2 from the forward's lse) from that forward's (o, lse): dq/dk/dv relative differences against the
backward from the MUFU-only forward (grad_vs_off; ~1e-3 is bf16 rounding of o differences).
- gluon: the Gluon kernels (sm_90; run_hopper, no routing) at the same shapes, non-causal (causal too with
  --gluon-causal 1: D64 causal is not routed there), persistent ("glp", FUSEKIT_HOPPER_ATTN_PERSIST=1) and
  one-tile ("gl1", =0), each off ("glp_off") and with each variant ("glp_poly4"; the env switch set per call):
  TFLOP/s, err_f64, lse_f64, *_vs_off (speed against the same kernel off), *_lse_vs_off and *_o_vs_off
  (o's relative difference) against it, *_vs_sdpa;
- --d128 1 (default): D128 reference rows (B16 S1024, B4 S4096, non-causal): SDPA, route and the Gluon
  variants only (no _attn_fwd_kernel variants: D128 is not softmax-bound).
One JSON line per (case, causal); with $OUT set, also $OUT/attn_exp2_poly.json. `--device cpu` runs a tiny
fp16 shape in the interpreter (a smoke test of the script: no timings worth reading).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from _out import save_json  # benchmarks/gpu_checks/_out.py (the script's folder is on sys.path)

CASES = [(32, 32, 32, 512), (16, 32, 32, 1024), (4, 32, 32, 4096), (1, 32, 8, 2048)]  # (B, H, Hkv, S), D64
CASES_D128 = [(16, 32, 32, 1024), (4, 32, 32, 4096)]  # Gluon reference rows, non-causal
D = 64
_GLUON_ENV = (
    "FUSEKIT_HOPPER_ATTN_PERSIST",
    "FUSEKIT_HOPPER_ATTN_EXP2_POLY",
    "FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE",
)
_LOG2E = 1.4426950408889634


def _variant(tag: str) -> tuple[int, int]:
    """'4' -> (EXP2_POLY 2, degree 3): 1/4 of the exponentials; '4d5' -> degree 5."""
    n, _, deg = tag.partition("d")
    return {"2": 1, "4": 2, "8": 3}[n], int(deg or 3)


def _timer(device: str):
    if device == "cuda":
        import triton

        return lambda f: triton.testing.do_bench(f, warmup=25, rep=100)

    def once(f) -> float:
        t0 = time.perf_counter()
        f()
        return (time.perf_counter() - t0) * 1e3

    return once


def _f64(q, k, v, causal, scale, heads):
    """float64 (o, lse) of the first `heads` (b, h) pairs (flattened b*H + h), GQA by repeating k/v."""
    H, S = q.shape[1], q.shape[2]
    g = H // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    qf, kf, vf = (t.flatten(0, 1)[:heads].double() for t in (q, kk, vv))
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        Skv = kf.shape[1]
        i = torch.arange(S, device=q.device)[:, None]
        j = torch.arange(Skv, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Skv - S), -math.inf)
    return torch.softmax(s, -1) @ vf, torch.logsumexp(s, -1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def run_case(B, H, Hkv, S, causal, variants, device, bench, D=D, triton_variants=True, gluon=True) -> dict:
    from kernels_triton import attention as A

    dt = torch.float16 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(B * S + causal)
    q = torch.randn(B, H, S, D, generator=g).to(device, dt)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(device, dt) for _ in range(2))
    do = torch.randn(B, H, S, D, generator=g).to(device, dt)
    scale = D**-0.5
    heads = min(4, B * H)
    ref_o, ref_lse = _f64(q, k, v, causal, scale, heads)
    flop = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    row: dict = {
        "case": f"B{B} H{H}/{Hkv} S{S} D{D}",
        "causal": causal,
        "dtype": str(dt).removeprefix("torch."),
    }

    def record(name: str, f, o, lse=None):
        f()
        if device == "cuda":
            torch.cuda.synchronize()
        ms = bench(f)
        row[f"{name}_tflops"] = round(flop / ms / 1e9, 1)
        row[f"{name}_us"] = round(ms * 1e3, 1)
        row[f"{name}_err_f64"] = float(f"{_rel(o.flatten(0, 1)[:heads], ref_o):.3e}")
        if lse is not None:
            d = (lse.flatten(0, 1)[:heads].double() - ref_lse).abs()
            row[f"{name}_lse_f64"] = float(f"{d[torch.isfinite(ref_lse)].max().item():.3e}")

    if device == "cuda":
        kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        o_sd = F.scaled_dot_product_attention(q, kk, vv, is_causal=causal)
        record("sdpa", lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=causal), o_sd)

    o, lse = torch.empty_like(q), torch.empty(B, H, S, device=device, dtype=torch.float32)

    def fwd():
        A.forward(o, lse, q, k, v, None, causal, scale)

    saved = (A.GLUON, A.EXP2_POLY)
    try:
        A.EXP2_POLY = (0, 3)
        row["route"] = "gluon" if A.use_hopper(q, k, v, o, causal) else "triton"
        record("route", fwd, o, lse)
        if "sdpa_us" in row:
            row["route_vs_sdpa"] = round(row["sdpa_us"] / row["route_us"], 3)
        if triton_variants:  # not at the D128 reference rows
            _triton_variants(row, record, fwd, o, lse, q, k, v, do, causal, scale, variants)
    finally:
        A.GLUON, A.EXP2_POLY = saved
    if gluon:
        _gluon_variants(row, record, q, k, v, causal, scale, variants, device)
    try:  # the tiles the tuner picked, per key (S, Skv buckets, causal[, EXP2_POLY, EXP2_DEGREE], dtypes)
        row["tuned"] = {
            str(kk): str(c) for t in (A._tuned(D, False), A._tuned(D, True)) for kk, c in t.cache.items()
        }
    except Exception as exc:  # the interpreter runs no tuner
        row["tuned"] = repr(exc)[:80]
    return row


def _triton_variants(row, record, fwd, o, lse, q, k, v, do, causal, scale, variants) -> None:
    """attention.py's _attn_fwd_kernel (GLUON off) MUFU-only, then with each polynomial variant (the module
    global EXP2_POLY flipped in-process; run_case restores it and GLUON)."""
    from kernels_triton import attention as A

    A.GLUON = False
    record("off", fwd, o, lse)
    o_off, lse_off = o.clone(), lse.clone()
    grads_off = [torch.empty_like(t) for t in (q, k, v)]
    A.backward(*grads_off, do, q, k, v, o_off, lse_off, None, causal, scale)
    for tag in variants:
        A.EXP2_POLY = _variant(tag)
        name = f"poly{tag}"
        record(name, fwd, o, lse)
        row[f"{name}_vs_off"] = round(row["off_us"] / row[f"{name}_us"], 3)
        if "sdpa_us" in row:
            row[f"{name}_vs_sdpa"] = round(row["sdpa_us"] / row[f"{name}_us"], 3)
        row[f"{name}_lse_vs_off"] = float(f"{(lse - lse_off).abs().max().item():.3e}")
        grads = [torch.empty_like(t) for t in (q, k, v)]
        A.backward(*grads, do, q, k, v, o.clone(), lse.clone(), None, causal, scale)
        row[f"{name}_grad_vs_off"] = [float(f"{_rel(a, b):.2e}") for a, b in zip(grads, grads_off)]
    if "sdpa_us" in row:
        row["off_vs_sdpa"] = round(row["sdpa_us"] / row["off_us"], 3)


def _gluon_variants(row, record, q, k, v, causal, scale, variants, device) -> None:
    """The Gluon kernels (run_hopper, not routed), persistent ("glp") and one-tile ("gl1"), off and with each
    polynomial variant through FUSEKIT_HOPPER_ATTN_EXP2_POLY[_DEGREE] (read per call), against the same kernel
    off: speed, o and lse differences."""
    from kernels_triton import _attention_hopper as H

    if not H.hopper_supported(q, k, v, None):
        row["gluon"] = "unsupported here (sm_90 CUDA with Gluon only)"
        return
    B, Hq, S, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, S, device=device, dtype=torch.float32)
    saved = {n: os.environ.get(n) for n in _GLUON_ENV}
    try:
        for kind, persist in (("glp", "1"), ("gl1", "0")):
            os.environ["FUSEKIT_HOPPER_ATTN_PERSIST"] = persist
            os.environ["FUSEKIT_HOPPER_ATTN_EXP2_POLY"] = "0"
            os.environ.pop("FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE", None)

            def fwd():
                H.run_hopper(o, lse, q, k, v, causal, scale * _LOG2E)

            record(f"{kind}_off", fwd, o, lse)
            o_off, lse_off = o.clone(), lse.clone()
            if "sdpa_us" in row:
                row[f"{kind}_off_vs_sdpa"] = round(row["sdpa_us"] / row[f"{kind}_off_us"], 3)
            for tag in variants:
                n, _, deg = tag.partition("d")
                os.environ["FUSEKIT_HOPPER_ATTN_EXP2_POLY"] = n
                os.environ["FUSEKIT_HOPPER_ATTN_EXP2_POLY_DEGREE"] = deg or "3"
                name = f"{kind}_poly{tag}"
                record(name, fwd, o, lse)
                row[f"{name}_vs_off"] = round(row[f"{kind}_off_us"] / row[f"{name}_us"], 3)
                if "sdpa_us" in row:
                    row[f"{name}_vs_sdpa"] = round(row["sdpa_us"] / row[f"{name}_us"], 3)
                fin = torch.isfinite(lse_off)
                row[f"{name}_lse_vs_off"] = float(f"{(lse - lse_off)[fin].abs().max().item():.3e}")
                row[f"{name}_o_vs_off"] = float(f"{_rel(o, o_off):.3e}")
    finally:
        for n, val in saved.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--variants", default="8,4,2,4d4", help="fractions 1/n (8, 4, 2), 'd<deg>' for a degree")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--cases", default="", help="indices into CASES (default all)")
    ap.add_argument("--gluon-causal", default="0", help="1: the Gluon variants at causal rows too")
    ap.add_argument("--d128", default="1", help="0: no D128 reference rows (Gluon only)")
    args = ap.parse_args(argv)
    for p in ("python", "."):
        if p not in sys.path:
            sys.path.insert(0, p)
    variants = [t for t in args.variants.split(",") if t]
    cases = CASES if args.device == "cuda" else [(1, 2, 1, 70)]
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    bench = _timer(args.device)
    os.environ["FUSEKIT_HOPPER_ATTN_EXP2_POLY"] = "0"  # the route runs switch-off; _gluon_variants sets it
    rows = []
    for B, H, Hkv, S in cases:
        for c in args.causal.split(","):
            causal = c == "1"
            gluon = not causal or args.gluon_causal == "1"
            row = run_case(B, H, Hkv, S, causal, variants, args.device, bench, gluon=gluon)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.device == "cuda" and args.d128 == "1":
        for B, H, Hkv, S in CASES_D128:
            row = run_case(B, H, Hkv, S, False, variants, args.device, bench, D=128, triton_variants=False)
            print(json.dumps(row), flush=True)
            rows.append(row)
    save_json("attn_exp2_poly.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
