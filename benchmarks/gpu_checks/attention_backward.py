"""H200 check of the Triton attention backward's tile tables (pointer and TMA kernels), ~2 min.

    PYTHONPATH=python:. python benchmarks/gpu_checks/attention_backward.py [--d 64,128,256] [--causal 0,1]
    TRITON_INTERPRET=1 PYTHONPATH=python:. python benchmarks/gpu_checks/attention_backward.py --device cpu

Per head dim and causal flag, at B4 S=Skv=4096 bf16 (H32, H16 at D256): SDPA's forward and forward +
backward, fusekit's autotuned forward and backward, then each kernel alone (do_bench median, L2 flushed) at
every tile of `attention_backward._CUDA_DKDV` / `_CUDA_DQ` (pointer and TMA rows) with its registers and
spills, in TFLOP/s of the kernel's own matmuls (4 for dk/dv, 3 for dq). The tables' measured figures came
from this sweep (.dev probe at f08967a); a table's first entry slower than its best by more than ~5% means
the table needs another look. Every tile's outputs are checked against the autotuned backward (relative
error <= 2e-2; exit status 1 otherwise). `--device cpu` runs the same code at a tiny shape in Triton's
interpreter (fp16, 16 x 16 tiles: a smoke test of the script, no timings worth reading).
`--atomic` adds the alternative the tables' comment rejects: FlashAttention-2's 5-matmul backward, dq
accumulated in fp32 from the dk/dv program with atomics (MODE 1: TMA reduce-add of the [BLOCK_M, D] tile,
MODE 2: red.global per element), timed as zero + kernel + cast, dq checked like the tiles (probe-level
kernel: S % BLOCK_M == 0, no kv_len, MHA or GQA). Measured at f08967a (D128): 8304 us non-causal / 4614
causal at its best tile against 7000 / 3800 for the two deterministic kernels.
With $OUT set, writes $OUT/attention_backward_check.json.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from _out import save_json  # benchmarks/gpu_checks/_out.py (the script's folder is on sys.path)

_LOG2E = 1.4426950408889634
_ATOMIC_TILES = {
    64: [(64, 64, 4, 2), (64, 128, 8, 3)],
    128: [(64, 128, 8, 3), (32, 64, 4, 2)],
    256: [(64, 64, 8, 2)],
}


# The 5-matmul dk/dv/dq kernel with atomic dq (see --atomic).
@triton.jit
def _atomic_step(dk, dv, k, v, q_desc, do_desc, dq_desc, dq32_ptr, lse2_ptr, delta_ptr, row0, m, offs_n, offs_d,
         diag, qk_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
         MODE: tl.constexpr):  # fmt: skip
    offs_m = m + tl.arange(0, BLOCK_M)
    rows = row0 + offs_m
    q = q_desc.load([(row0 + m).to(tl.int32), 0])
    pt = tl.math.exp2(tl.dot(k, q.T) * qk_scale - tl.load(lse2_ptr + rows)[None, :])
    if MASK:
        pt = tl.where(offs_n[:, None] - offs_m[None, :] <= diag, pt, 0.0)
    do = do_desc.load([(row0 + m).to(tl.int32), 0])
    dst = pt * (tl.dot(v, do.T) - tl.load(delta_ptr + rows)[None, :])
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dk = tl.dot(dst.to(q.dtype), q, dk)
    dqp = tl.dot(tl.trans(dst.to(q.dtype)), k) * sm_scale
    if MODE == 1:
        dq_desc.atomic_add([(row0 + m).to(tl.int32), 0], dqp)
    else:
        tl.atomic_add(dq32_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], dqp, sem="relaxed")
    return dk, dv


@triton.jit
def _atomic_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, dq32_ptr, lse2_ptr, delta_ptr, H, HKV, S, SKV,
           qk_scale, sm_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    bhkv = tl.program_id(1)
    group = H // HKV
    kb = bhkv.to(tl.int64) * SKV * HEAD_DIM
    rows_all = tl.num_programs(1) * group * S

    k_desc = tl.make_tensor_descriptor(k_ptr + kb, shape=[SKV, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
    v_desc = tl.make_tensor_descriptor(v_ptr + kb, shape=[SKV, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[rows_all, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
    do_desc = tl.make_tensor_descriptor(do_ptr, shape=[rows_all, HEAD_DIM], strides=[HEAD_DIM, 1],
                                        block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
    dq_desc = tl.make_tensor_descriptor(dq32_ptr, shape=[rows_all, HEAD_DIM], strides=[HEAD_DIM, 1],
                                        block_shape=[BLOCK_M, HEAD_DIM])  # fmt: skip
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = k_desc.load([n0, 0])
    v = v_desc.load([n0, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    diag = SKV - S
    m_lo = 0
    m_full = 0
    if CAUSAL:
        m_lo = (tl.maximum(n0 - diag, 0) // BLOCK_M) * BLOCK_M
        i_full = tl.minimum(n0 + BLOCK_N, SKV) - 1 - diag
        m_full = tl.minimum(m_lo + tl.cdiv(tl.maximum(i_full - m_lo, 0), BLOCK_M) * BLOCK_M, S)
    n_u = (S - m_full) // BLOCK_M
    n_d = (m_full - m_lo) // BLOCK_M
    head0 = (bhkv // HKV).to(tl.int64) * H + (bhkv % HKV) * group
    for it in range(0, group * n_u):
        g = it // n_u
        dk, dv = _atomic_step(dk, dv, k, v, q_desc, do_desc, dq_desc, dq32_ptr, lse2_ptr, delta_ptr, (head0 + g) * S,
                      m_full + (it - g * n_u) * BLOCK_M, offs_n, offs_d, diag, qk_scale, sm_scale, HEAD_DIM,
                      BLOCK_M, False, MODE)  # fmt: skip
    for it in range(0, group * n_d):
        g = it // n_d
        dk, dv = _atomic_step(dk, dv, k, v, q_desc, do_desc, dq_desc, dq32_ptr, lse2_ptr, delta_ptr, (head0 + g) * S,
                      m_lo + (it - g * n_d) * BLOCK_M, offs_n, offs_d, diag, qk_scale, sm_scale, HEAD_DIM,
                      BLOCK_M, True, MODE)  # fmt: skip
    dk_desc = tl.make_tensor_descriptor(dk_ptr + kb, shape=[SKV, HEAD_DIM], strides=[HEAD_DIM, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
    dv_desc = tl.make_tensor_descriptor(dv_ptr + kb, shape=[SKV, HEAD_DIM], strides=[HEAD_DIM, 1],
                                        block_shape=[BLOCK_N, HEAD_DIM])  # fmt: skip
    dk_desc.store([n0, 0], (dk * sm_scale).to(dk_ptr.dtype.element_ty))
    dv_desc.store([n0, 0], dv.to(dv_ptr.dtype.element_ty))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _timer(device: str):
    """us per call: do_bench's median on CUDA (L2 flushed); one timed call on the CPU (a smoke test)."""
    if device == "cuda":
        import triton

        return lambda f: triton.testing.do_bench(f, warmup=25, rep=200) * 1e3

    def once(f) -> float:
        t0 = time.perf_counter()
        f()
        return (time.perf_counter() - t0) * 1e6

    return once


def _regs(kernel) -> str:
    try:
        return f"regs {kernel.n_regs} spills {kernel.n_spills}"
    except Exception:  # the interpreter's launches return no compiled kernel
        return ""


def check(D: int, causal: bool, device: str, atomic: bool = False) -> tuple[dict, bool]:
    from kernels_triton import attention as A
    from kernels_triton import attention_backward as AB
    from kernels_triton._config import ensure_tma_allocator

    cpu = device == "cpu"
    B, H, S = (1, 2, 48) if cpu else (4, 32 if D <= 128 else 16, 4096)
    Hkv, dt = H, torch.float16 if cpu else torch.bfloat16
    g = torch.Generator().manual_seed(D + causal)
    q, k, v, do = (torch.randn(B, n, S, D, generator=g).to(device, dt) for n in (H, Hkv, Hkv, H))
    scale = 1 / math.sqrt(D)
    bench = _timer(device)
    fl = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    row: dict = {"D": D, "causal": causal, "B": B, "H": H, "S": S}
    if not cpu:
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def sdpa_fb():
            F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).backward(do)

        row["sdpa_fwd_us"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        row["sdpa_fwd_bwd_us"] = bench(sdpa_fb)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=device, dtype=torch.float32)
    A.forward(o, lse, q, k, v, None, causal, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    A.backward(dq, dk, dv, do, q, k, v, o, lse, None, causal, scale)
    row["fwd_us"] = bench(lambda: A.forward(o, lse, q, k, v, None, causal, scale))
    row["bwd_us"] = bench(lambda: A.backward(dq, dk, dv, do, q, k, v, o, lse, None, causal, scale))
    if not cpu:
        row["fwd_bwd_vs_sdpa"] = row["sdpa_fwd_bwd_us"] / (row["fwd_us"] + row["bwd_us"])
        ensure_tma_allocator()
    delta = (o.float() * do.float()).sum(-1)
    lse2 = lse * _LOG2E
    strides = (*k.stride()[:3], *v.stride()[:3])
    common = (lse2.view(torch.int32), H, Hkv, S, S, scale * _LOG2E, scale, *strides, 0, 0, 1, 0, 0)  # chunk 1
    kw = {"HEAD_DIM": D, "CAUSAL": causal, "IEEE": False}
    ok = True
    tables = (
        ("dkdv", AB._CUDA_DKDV[D], AB._bwd_dkdv_kernel, 1.6),
        ("dq", AB._CUDA_DQ[D], AB._bwd_dq_kernel, 1.2),
    )
    for kind, table, kernel, mm in tables:
        for tile in [(16, 16, 1, 1), (16, 16, 1, 1, True)] if cpu else table:
            bm, bn = tile[:2]
            if kind == "dkdv":
                outs = [torch.full_like(dk, math.nan), torch.full_like(dv, math.nan)]
                args = (q, k, v, do, *outs, lse2, delta, *common)
                grid = (-(-S // bn) * B * Hkv,)
                want = (dk, dv)
            else:
                outs = [torch.full_like(dq, math.nan)]
                args = (q, k, v, do, *outs, lse2, delta, *common)
                grid = (-(-S // bm) * B * H,)
                want = (dq,)
            launch = AB._launch_kw(tile)

            def run(args=args, grid=grid, launch=launch, kernel=kernel):
                return kernel[grid](*args, **kw, **launch)

            compiled = run()
            err = max(_rel(a, b) for a, b in zip(outs, want, strict=True))
            us = bench(run)
            good = err <= 2e-2
            ok &= good
            name = f"{kind} {bm}x{bn} w{tile[2]} s{tile[3]}{' tma' if AB._tma(tile) else ''}"
            print(f"  D{D} causal={int(causal)} {name}: {us:9.1f} us {mm * fl / us / 1e6:5.0f} TF/s  err {err:.1e} "
                  f"{_regs(compiled)}{'' if good else '  WRONG'}")  # fmt: skip
            row.setdefault("tiles", []).append(
                {"kernel": kind, "tile": list(tile), "us": us, "rel_error": err}
            )
    if not cpu:
        print(f"D{D} causal={int(causal)}: SDPA fwd {row['sdpa_fwd_us']:.0f} us, "
              f"fwd+bwd {row['sdpa_fwd_bwd_us']:.0f}; fusekit fwd {row['fwd_us']:.0f}, bwd {row['bwd_us']:.0f}: "
              f"{row['fwd_bwd_vs_sdpa']:.3f}x SDPA")  # fmt: skip
    if atomic:
        modes = (2,) if cpu else (1, 2)  # the interpreter has no TMA reduce-add
        for tile in [(16, 16, 1, 1)] if cpu else _ATOMIC_TILES[D]:
            bm, bn, w, st = tile
            for mode in modes:
                dq32 = torch.zeros(B, H, S, D, device=device, dtype=torch.float32)
                dk2, dv2 = torch.full_like(dk, math.nan), torch.full_like(dv, math.nan)

                def run(bm=bm, bn=bn, w=w, st=st, mode=mode, dq32=dq32, dk2=dk2, dv2=dv2):
                    dq32.zero_()
                    _atomic_kernel[(-(-S // bn), B * Hkv)](
                        q, k, v, do, dk2, dv2, dq32, lse2, delta, H, Hkv, S, S, scale * _LOG2E, scale, HEAD_DIM=D,
                        CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, MODE=mode, num_warps=w, num_stages=st,
                    )  # fmt: skip
                    return dq32.to(dq.dtype)

                got = run()
                err = max(_rel(got, dq), _rel(dk2, dk), _rel(dv2, dv))
                us = bench(run)
                good = err <= 2e-2
                ok &= good
                print(f"  D{D} causal={int(causal)} atomic mode {mode} {bm}x{bn} w{w} s{st}: {us:9.1f} us "
                      f"(zero + kernel + cast) err {err:.1e}{'' if good else '  WRONG'}")  # fmt: skip
                row.setdefault("atomic", []).append(
                    {"tile": list(tile), "mode": mode, "us": us, "rel_error": err}
                )
    return row, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--atomic", action="store_true", help="also time the 5-matmul backward with atomic dq")
    args = ap.parse_args(argv)
    from kernels_triton._config import is_interpreter

    if args.device == "cpu" and not is_interpreter():
        print("--device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    rows, ok = [], True
    for d in (int(x) for x in args.d.split(",")):
        for causal in (bool(int(c)) for c in args.causal.split(",")):
            row, good = check(d, causal, args.device, args.atomic)
            rows.append(row)
            ok &= good
    save_json("attention_backward_check.json", {"device": args.device, "rows": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
