#!/usr/bin/env python3
"""The mojo backend's GPU kernels on misaligned and ragged caller layouts, against backend="torch".

    PYTHONPATH=python:. python benchmarks/gpu_checks/mojo_align.py [--cases a,b] [--timeout 300] [--budget 1500]

MAX staged (source /tmp/maxsite/env.sh on the device machine). The host hands every tensor to the Mojo
launchers without a copy (backends/mojo/dispatch.py), so each launcher picks its 16-byte vector / cp.async /
TMA / wgmma kernels from the pointers (`is_aligned16`, `Int(p) % 16`, python/fusekit/backends/mojo
`ffn_route` for the opt-in wgmma FFN) and a scalar variant otherwise. On the CPU unaligned SIMD loads work,
so only a GPU shows a wrong guard: a vector access through a misaligned pointer faults the context
("misaligned address") or, where the compiler was promised an alignment it does not get, reads wrong bytes.
Every case runs in its own process under a timeout (a fault poisons the CUDA context for the rest of the
process), first on aligned tensors (compiles; the vector kernels) and then with every argument a contiguous
view one element into its storage (`buf[1:].view(...)`: 2-byte aligned bf16 rows) and row lengths that are
not whole 16-byte vectors; each output and gradient is compared with backend="torch" on aligned copies
(relative error of the norm; NaN / inf fail) after a synchronize (a fault surfaces there).

Cases (bf16 unless said):
  norm_fwd        rms_norm / layer_norm with residual, fp32 and bf16 weights, N 4096 / 4100 / 4097 / 65536
                  (register kernels, loop kernel W = VW, W = 1)
  norm_bwd        their backward: rms_norm's cp.async kernel (N 4096), the register kernel, the column-tiled
                  kernel (N 32768), the W = 1 loop kernel; misaligned dy (a caller's gradient) too
  rope            q + k in one launch, positions / tables, halves / interleaved, D 128 / 72 (half % 8 != 0),
                  prefill rows and decode rows (pair units); the backward
  reduce_sum      split rows (M 2, N 2^20), block rows, warp rows, ragged N; the backward
  swiglu          decode GEMVs T 1 / 5 (the session-52 fault: 16-byte weight loads), T 64 (GEMM route: the
                  element-wise h kernel), the backward (h / dg / du and xn kernels) with misaligned x, weights
  lce             linear_cross_entropy, V 32000 / 32001, misaligned x / weight / target / bias
  attn_prefill    fa2 / the sm_90 wgmma (TMA) kernel / the tensor-core backward, D 64 / 128 / 256, causal,
                  kv_len; misaligned q / k / v; a fused-qkv bshd view (strided: copied)
  attn_decode     split-KV decode: register kernel (GQA 4), tensor-core kernel (GQA 16, D 128), the SIMT tile
                  kernel (GQA 16 at D 256: its shared K / V tiles now declared 16-byte aligned, aligned and
                  misaligned), S 16; misaligned q (2-byte: q's 4-byte pair loads) and k / v (cp.async)
  ffn_tc          FUSEKIT_MOJO_FFN_TC=1, bf16 D 4096 F 11008 T 32 with one weight misaligned: must route to
                  the GEMM path (MAX's sm90 matmul builds TMA maps over the weights). Slow (~70 s compile).
Writes $OUT/mojo_align.json when $OUT is set (the device tool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _isolated import run_case  # benchmarks/gpu_checks/_isolated.py (the script's folder is on sys.path)

SLOW = {"attn_prefill": 600.0, "attn_decode": 450.0, "ffn_tc": 600.0}


def _progress(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------ child side
class _Checker:
    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.n = 0
        self.worst = 0.0

    def odd(self, t):
        """t's values, contiguous, one element past its storage's start (misaligned for any vector)."""
        buf = self.torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        assert out.is_contiguous() and out.data_ptr() % 16 != 0
        return out

    def run(self, what: str, fn, bound: float) -> None:
        """fn(backend, make) -> list of tensors (or None); mojo aligned, mojo misaligned, torch aligned."""
        torch = self.torch
        _progress(f"{what}: aligned ...")
        got_a = fn("mojo", lambda t: t.clone())
        torch.cuda.synchronize()
        _progress(f"{what}: misaligned ...")
        got_m = fn("mojo", self.odd)
        torch.cuda.synchronize()
        want = fn("torch", lambda t: t.clone())
        for label, got in (("aligned", got_a), ("misaligned", got_m)):
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                if b is None:
                    if a is not None:
                        raise SystemExit(f"MISMATCH {what} {label}[{i}]: a gradient where torch has none")
                    continue
                a64, b64 = a.double(), b.double()
                if not torch.isfinite(a64).all() and torch.isfinite(b64).all():
                    raise SystemExit(f"MISMATCH {what} {label}[{i}]: non-finite values")
                err = float((a64 - b64).norm() / b64.norm().clamp_min(1e-30))
                self.worst = max(self.worst, err)
                if not err <= bound:
                    raise SystemExit(f"MISMATCH {what} {label}[{i}]: relative error {err:.3g} > {bound:.1g}")
        self.n += 1
        _progress(f"ok {what}")


def _grads(out, leaves, seed: int):
    import torch

    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device="cuda").manual_seed(seed)
    cot = [torch.randn(o.shape, device="cuda", generator=g).to(o.dtype) for o in outs]
    return list(torch.autograd.grad(outs, leaves, cot, allow_unused=True))


def _norm(ck: _Checker, backward: bool) -> None:
    import torch

    from fusekit import ops

    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(64, 4096), (64, 4100), (64, 4097), (8, 65536)] + ([(16, 32768)] if backward else [])
    for m, n in shapes:
        for ln in (False, True):
            for wdt in (bf, torch.float32):
                x, r = (torch.randn(m, n, device="cuda", generator=g).to(bf) for _ in range(2))
                w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(wdt)
                b = torch.randn(n, device="cuda", generator=g).to(wdt)

                def fn(backend, mk, x=x, r=r, w=w, b=b, ln=ln, n=n):
                    leaves = [mk(t).requires_grad_(backward) for t in (x, r, w, b)]
                    if ln:
                        out = ops.layer_norm(
                            leaves[0], leaves[2], leaves[3], residual=leaves[1], backend=backend
                        )
                    else:
                        out = ops.rms_norm(leaves[0], leaves[2], residual=leaves[1], backend=backend)
                        leaves = leaves[:3]
                    if not backward:
                        return list(out)
                    outs = out if isinstance(out, tuple) else (out,)
                    gg = torch.Generator(device="cuda").manual_seed(n)
                    cot = [mk(torch.randn(o.shape, device="cuda", generator=gg).to(o.dtype)) for o in outs]
                    return list(torch.autograd.grad(outs, leaves, cot))

                what = f"{'layer' if ln else 'rms'}_norm{' bwd' if backward else ''} {m}x{n} w {wdt}"
                ck.run(what, fn, 4e-2 if backward else 2e-2)


def _rope(ck: _Checker) -> None:
    import torch

    from fusekit import ops

    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(3)
    for b, s, d in ((2, 64, 128), (2, 64, 72), (1, 1, 128), (4, 3, 72)):
        for inter in (False, True):
            for tables in (False, True):
                q = torch.randn(b, s, 32, d, device="cuda", generator=g).to(bf)
                k = torch.randn(b, s, 8, d, device="cuda", generator=g).to(bf)
                pos = torch.randint(0, 500, (b, s), device="cuda", generator=g, dtype=torch.int32)
                cos = torch.randn(512, d // 2, device="cuda", generator=g)
                sin = torch.randn(512, d // 2, device="cuda", generator=g)

                def fn(backend, mk, q=q, k=k, pos=pos, cos=cos, sin=sin, inter=inter, tables=tables):
                    leaves = [mk(t).requires_grad_() for t in (q, k)]
                    kw = {"cos": mk(cos), "sin": mk(sin)} if tables else {}
                    out = ops.rope(
                        leaves[0], leaves[1], positions=mk(pos), interleaved=inter, backend=backend, **kw
                    )
                    return [*out, *_grads(out, leaves, 3)]

                ck.run(f"rope B{b} S{s} D{d} interleaved={inter} tables={tables}", fn, 4e-2)


def _reduce_sum(ck: _Checker) -> None:
    import torch

    from fusekit import ops

    g = torch.Generator(device="cuda").manual_seed(4)
    for m, n in ((2, 1 << 20), (2, (1 << 20) + 3), (4096, 4096), (512, 1000), (512, 37)):
        x = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)

        def fn(backend, mk, x=x):
            leaf = mk(x).requires_grad_()
            out = ops.reduce_sum(leaf, -1, backend=backend)
            return [out, *_grads(out, [leaf], 4)]

        ck.run(f"reduce_sum {m}x{n}", fn, 4e-2)


def _swiglu(ck: _Checker) -> None:
    import torch

    from fusekit import ops

    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(5)
    for t, d, f in ((1, 1024, 2816), (5, 1024, 2816), (64, 1024, 2816), (5, 1028, 2820), (64, 1028, 2820)):
        x = torch.randn(t, d, device="cuda", generator=g).to(bf)
        ws = [(torch.randn(*s, device="cuda", generator=g) / 30).to(bf) for s in ((f, d), (f, d), (d, f))]
        nw = (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(bf)

        def fn(backend, mk, x=x, ws=ws, nw=nw):
            leaves = [mk(v).requires_grad_() for v in (x, *ws, nw)]
            out = ops.swiglu_ffn(leaves[0], *leaves[1:4], norm_weight=leaves[4], backend=backend)
            return [out, *_grads(out, leaves, 5)]

        ck.run(f"swiglu_ffn T{t} D{d} F{f}", fn, 4e-2)


def _lce(ck: _Checker) -> None:
    import torch

    from fusekit import ops

    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(6)
    for v in (32000, 32001):
        x = torch.randn(64, 512, device="cuda", generator=g).to(bf)
        w = (torch.randn(v, 512, device="cuda", generator=g) / 20).to(bf)
        b = torch.randn(v, device="cuda", generator=g).to(bf)
        y = torch.randint(0, v, (64,), device="cuda", generator=g)
        y[3] = -100

        def fn(backend, mk, x=x, w=w, b=b, y=y):
            leaves = [mk(t).requires_grad_() for t in (x, w, b)]
            out = ops.linear_cross_entropy(leaves[0], leaves[1], mk(y), leaves[2], backend=backend)
            return [out, *_grads(out, leaves, 6)]

        ck.run(f"linear_cross_entropy V{v}", fn, 4e-2)


def _attn(ck: _Checker, decode: bool) -> None:
    import torch

    from fusekit import ops

    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(7)
    if decode:  # (B, H, Hkv, S, Skv, D)
        shapes = [(4, 32, 8, 1, 2049, 128), (2, 32, 2, 1, 1500, 128), (2, 32, 2, 1, 1500, 256),
                  (1, 8, 8, 16, 700, 64), (2, 16, 4, 16, 333, 128)]  # fmt: skip
    else:
        shapes = [(2, 8, 2, 300, 300, d) for d in (64, 128, 256)] + [(1, 4, 4, 129, 1000, 128)]
    for bsz, h, hkv, s, skv, d in shapes:
        q = torch.randn(bsz, h, s, d, device="cuda", generator=g).to(bf)
        k, v = (torch.randn(bsz, hkv, skv, d, device="cuda", generator=g).to(bf) for _ in range(2))
        lens = torch.randint(1, skv + 1, (bsz,), device="cuda", generator=g, dtype=torch.int32)
        for kv_len in (None, lens):

            def fn(backend, mk, q=q, k=k, v=v, kv_len=kv_len):
                leaves = [mk(t).requires_grad_() for t in (q, k, v)]
                kl = None if kv_len is None else mk(kv_len)
                out = ops.attention(*leaves, causal=True, kv_len=kl, backend=backend)
                return [out, *_grads(out, leaves, 7)]

            what = f"attention B{bsz} H{h}/{hkv} S{s} Skv{skv} D{d} kv_len={kv_len is not None}"
            ck.run(what, fn, 4e-2)
    if not decode:  # a fused qkv projection read as bshd views (strided: the library copies them)
        qkv = torch.randn(2, 200, 3, 8, 128, device="cuda", generator=g).to(bf)

        def fn(backend, mk, qkv=qkv):
            src = mk(qkv)
            q, k, v = (src[:, :, i] for i in range(3))
            return [ops.attention(q, k, v, causal=True, layout="bshd", backend=backend)]

        ck.run("attention fused qkv bshd", fn, 4e-2)


def _ffn_tc(ck: _Checker) -> None:
    import torch

    import fusekit.backends.mojo as mb
    from fusekit import ops

    os.environ[mb.FFN_TC_ENV] = "1"
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(8)
    t, d, f = 32, 4096, 11008
    x = torch.randn(t, d, device="cuda", generator=g).to(bf)
    ws = [(torch.randn(*s, device="cuda", generator=g) / 60).to(bf) for s in ((f, d), (f, d), (d, f))]
    for odd in range(3):

        def fn(backend, mk, odd=odd):
            w = [mk(v) if i == odd else v.clone() for i, v in enumerate(ws)]
            if backend == "mojo":
                route = mb.ffn_route(x.device, x, w[0], tuple(w[1:]))
                aligned = all(v.data_ptr() % 16 == 0 for v in w)
                if route != ("tc" if aligned else "gemm"):
                    raise SystemExit(f"MISMATCH ffn_tc: route {route} with weights aligned={aligned}")
            return [ops.swiglu_ffn(mk(x), *w, backend=backend)]

        ck.run(f"swiglu_ffn wgmma route, weight {odd} misaligned", fn, 4e-2)


# case -> what its child process runs (the parent runs them in this order)
_RUNS = {
    "norm_fwd": lambda ck: _norm(ck, backward=False),
    "norm_bwd": lambda ck: _norm(ck, backward=True),
    "rope": _rope,
    "reduce_sum": _reduce_sum,
    "swiglu": _swiglu,
    "lce": _lce,
    "attn_decode": lambda ck: _attn(ck, decode=True),
    "attn_prefill": lambda ck: _attn(ck, decode=False),
    "ffn_tc": _ffn_tc,
}
CASES = list(_RUNS)


def child(case: str) -> None:
    import torch

    _progress(f"{case}: {torch.cuda.get_device_name()} torch {torch.__version__}")
    ck = _Checker()
    _RUNS[case](ck)
    _progress(f"done: {ck.n} checks, worst relative error {ck.worst:.2e}")


# ----------------------------------------------------------------------------------------------- parent side
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per case (compiles included)")
    ap.add_argument("--budget", type=float, default=1500.0, help="start no case after this many seconds")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child)
        return
    t0 = time.time()
    rows = []
    for case in [c for c in a.cases.split(",") if c]:
        if case not in CASES:
            rows.append({"case": case, "status": "UNKNOWN"})
            continue
        if time.time() - t0 > a.budget:
            rows.append({"case": case, "status": "SKIPPED (budget)"})
            continue
        status, secs, last = run_case(__file__, [case], max(a.timeout, SLOW.get(case, 0.0)), "TIMEOUT")
        rows.append({"case": case, "status": status, "seconds": round(secs, 1), "last": last})
        print(f"{case:14s} {status:12s} {secs:6.1f}s  {last[:160]}", flush=True)
    print("\nsummary")
    for r in rows:
        print(f"  {r['case']:14s} {r['status']}")
    print(f"total {time.time() - t0:.1f}s")
    if out_dir := os.environ.get("OUT"):
        with open(os.path.join(out_dir, "mojo_align.json"), "w") as fh:
            json.dump(
                {"commit": os.environ.get("FUSEKIT_GIT_COMMIT", "unknown"), "cases": rows}, fh, indent=1
            )
    sys.exit(0 if all(r["status"] in ("ok", "SKIPPED (budget)") for r in rows) else 1)


if __name__ == "__main__":
    main()
