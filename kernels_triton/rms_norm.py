"""RMSNorm: out = x * rsqrt(mean(x^2) + eps) * w (fp32 math, one cast), rstd[M] fp32.

Byte floor: read x once, write out once (+ N weights, M rstd): 32768 x 8192 bf16 = 1.07 GB -> 0.25 ms at
~4.3 TB/s; 16384 x 65536 bf16 = 4.29 GB -> 1.0 ms. Arithmetic is negligible. Modes ("reg", "reload",
"split") and the thresholds between them are in kernels_triton/_config.py (`norm_plan`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._config import (
    device_index,
    norm_block,
    norm_plan_forced,
    norm_reg_tile,
    norm_stream_warps,
    split_chunks,
)

# Streaming step of "reload"/"split": 32 KB of x per step, 4 x 16-byte vectors per thread (16 warps on
# NVIDIA). On the H200 at 16384 x 65536 bf16: 1405 us vs 1524 us for 16 KB / 16 warps, 1579 us for 8 KB /
# 8 warps, 1449 us for 32 KB / 32 warps.
STREAM_BYTES, STREAM_VECS = 32768, 4
# Chunks per row in "split" mode are capped so kernel 2 combines them in one fixed-size [SPLIT_MAX] load.
SPLIT_MAX = 1024


@triton.jit
def _rms_reg_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    m = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    # Plain loads, weight read after the reduction: on the H200 this beat evict_first/evict_last hints
    # with the weight load hoisted (more live registers during the reduction).
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_reload_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, N, BLOCK):
        c = k + cols
        x = tl.load(x_ptr + base + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    tl.store(rstd_ptr + row, rstd)
    # Second pass re-reads the row: it was streamed microseconds ago and is still in L2.
    for k in range(0, N, BLOCK):
        c = k + cols
        cm = c < N
        x = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(w_ptr + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_ptr + base + c, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _rms_partial_kernel(x_ptr, part_ptr, N, SPLIT, CHUNK, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // SPLIT
    start = (pid % SPLIT).to(tl.int64) * CHUNK
    base = row.to(tl.int64) * N + start
    n = tl.minimum(N - start, CHUNK)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, n, BLOCK):
        c = k + cols
        x = tl.load(x_ptr + base + c, mask=c < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _rms_split_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rstd_ptr,
    part_ptr,
    N,
    SPLIT,
    CHUNK,
    eps,
    BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // SPLIT
    part = pid % SPLIT
    # Every chunk of a row combines the same partials in the same order: identical rstd, reproducible.
    s = tl.arange(0, BLOCK_S)
    p = tl.load(part_ptr + row * SPLIT + s, mask=s < SPLIT, other=0.0)
    rstd = tl.rsqrt(tl.sum(p, axis=0) / N + eps)
    if part == 0:
        tl.store(rstd_ptr + row, rstd)
    start = part.to(tl.int64) * CHUNK
    base = row.to(tl.int64) * N + start
    n = tl.minimum(N - start, CHUNK)
    cols = tl.arange(0, BLOCK)
    for k in range(0, n, BLOCK):
        c = k + cols
        cm = c < n
        x = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(w_ptr + start + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_ptr + base + c, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=cm)


def rms_norm(
    out: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    _mode: str | None = None,
    _split: int | None = None,
    _block: int | None = None,
    _num_warps: int | None = None,
    _block_m: int | None = None,
) -> None:
    """out[M, N], rstd[M] <- RMSNorm(x[M, N]) * weight[N]. Private `_mode`/... force a config (tests)."""
    M, N = x.shape
    dev = device_index(x)
    es = x.element_size()
    mode, split = norm_plan_forced(M, N, es, dev, _mode, _split)
    if mode == "reg":
        bm, bn, nw = norm_reg_tile(M, N, es, dev)
        bm = _block_m or bm
        _rms_reg_kernel[(triton.cdiv(M, bm),)](
            x, weight, out, rstd, M, N, eps, BLOCK_M=bm, BLOCK_N=bn, num_warps=_num_warps or nw
        )
        return
    block = _block or norm_block(es, STREAM_BYTES)
    nw = _num_warps or norm_stream_warps(block, es, STREAM_VECS, dev)
    if mode == "reload":
        _rms_reload_kernel[(M,)](x, weight, out, rstd, N, eps, BLOCK=block, num_warps=nw)
        return
    split, chunk = split_chunks(N, split, block, SPLIT_MAX)
    part = torch.empty((M, split), dtype=torch.float32, device=x.device)
    grid = (M * split,)
    _rms_partial_kernel[grid](x, part, N, split, chunk, BLOCK=block, num_warps=nw)
    _rms_split_norm_kernel[grid](
        x, weight, out, rstd, part, N, split, chunk, eps, BLOCK=block,
        BLOCK_S=SPLIT_MAX, num_warps=nw,
    )  # fmt: skip


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
def aot_specs() -> list[tuple[str, object, dict, dict]]:
    """Reg tiles for N = 2^k (128 .. 16384), reload and split kernels, for bf16 (all) and fp16/fp32 (some)."""
    specs: list[tuple[str, object, dict, dict]] = []
    for dt in ("bf16", "fp16", "fp32"):
        es = 4 if dt == "fp32" else 2
        ptr = f"*{dt}"
        ns = (128, 512, 1024, 2048, 4096, 8192, 16384) if dt == "bf16" else (4096,)
        for n in ns:
            bm, bn, nw = norm_reg_tile(1 << 20, n, es, 0)
            sig = {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "rstd_ptr": "*fp32", "M": "i32", "N": "i32"}
            sig |= {"eps": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
            specs.append(
                (f"rms_reg_{dt}_n{n}", _rms_reg_kernel, sig, {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": nw})
            )
        block = STREAM_BYTES // es
        nw = norm_stream_warps(block, es, STREAM_VECS, 0)
        sig = {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "rstd_ptr": "*fp32", "N": "i32", "eps": "fp32"}
        sig |= {"BLOCK": "constexpr"}
        specs.append((f"rms_reload_{dt}", _rms_reload_kernel, sig, {"BLOCK": block, "num_warps": nw}))
        sig = {
            "x_ptr": ptr,
            "part_ptr": "*fp32",
            "N": "i32",
            "SPLIT": "i32",
            "CHUNK": "i32",
            "BLOCK": "constexpr",
        }
        specs.append((f"rms_partial_{dt}", _rms_partial_kernel, sig, {"BLOCK": block, "num_warps": nw}))
        sig = {
            "x_ptr": ptr,
            "w_ptr": ptr,
            "out_ptr": ptr,
            "rstd_ptr": "*fp32",
            "part_ptr": "*fp32",
            "N": "i32",
        }
        sig |= {"SPLIT": "i32", "CHUNK": "i32", "eps": "fp32", "BLOCK": "constexpr", "BLOCK_S": "constexpr"}
        ce = {"BLOCK": block, "BLOCK_S": SPLIT_MAX, "num_warps": nw}
        specs.append((f"rms_split_norm_{dt}", _rms_split_norm_kernel, sig, ce))
    return specs
