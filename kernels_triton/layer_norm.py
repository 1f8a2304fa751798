"""LayerNorm, forward and backward (CONTRACT.md): optional fused residual add, weight/bias in x's dtype or fp32,
biased variance, fp32 math, one cast; mean/rstd[M] fp32.

    forward(y, h, mean, rstd, x, residual, weight, bias, eps)      h = x + residual (or None), y = norm(h or x)
    backward(dx, dw, db, dy, dh, xin, weight, mean, rstd, eps)      (kernels in kernels_triton/_norm_bwd.py)

Forward byte floor: read x once, write y once (+ 2N weights/bias, 2M statistics), 2 x M x N x elsize:
32768 x 8192 bf16 = 1.07 GB -> 251 us at the H200's measured 4274 GB/s copy rate; 16384 x 65536 bf16 =
4.29 GB -> 1004 us; with the fused residual add 4 x M x N x elsize (read x and residual, write h and y).
The modes ("reg", "rows", "reload", "split", "coop") are shaped exactly as in rms_norm.py (the table is in
kernels_triton/_config.py); large problems pick among them by timing (`norm_tuned`, every candidate first
checked against an fp32 reference of the same residual/bias/weight variant).

Statistics: "reg"/"rows" hold the row and do the corrected two-pass (mean, then the deviations' sum and
sum of squares in one tuple reduction: the sum corrects the fp32 mean's rounding), as the reference. "reload"/"split" stream the row once for the statistics, using sums of d = xin - K with the
shift K = xin[row, 0]: var = E[d^2] - E[d]^2 loses almost nothing because K lies within a few standard
deviations of the mean, so rows with a large mean (1e4 +- 1) stay accurate, unlike raw E[x^2] - E[x]^2.
With a residual, "reload" pass 1 writes h (evict_last) and pass 2 re-reads h from L2. "loop3" (no
residual, rows of 16-64 KB; FUSEKIT_NORM_LOOP3=0 leaves it out) does torch.compile's exact two-pass from L2
instead: one program per row, three passes of one accumulator each, N a constexpr so each pass unrolls.

Backward byte floor: read dy and xin, write dx (+ read dh with a residual): 3 (4) x M x N x elsize, e.g.
32768 x 4096 bf16: 805 MB -> 188 us; the dw/db partials [P, N] fp32 add ~4 x P x N x 4 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton import _norm_bwd
from kernels_triton._config import (
    NORM_COOP_SETS,
    NORM_NOT_FORCED,
    NormConfig,
    device_index,
    norm_aot_configs,
    norm_aot_specs,
    norm_check,
    norm_grid,
    norm_select,
    norm_selected,
    split_chunks,
)
from kernels_triton._coop import COOP_SPLIT_MAX, coop_chunk, coop_launch, row_barrier, widen_again
from kernels_triton._launch import fast_launch
from kernels_triton._norm_bwd import _add2
from kernels_triton._tiles import load_row_tile, rsqrt_full_range

# Heuristic (untuned) step of "reload"/"split": 16 KB of x, 2 x 16-byte vectors per thread (16 warps on
# NVIDIA); the two fp32 accumulators per element made wider steps slower than for rms_norm in the old
# one-row-per-program kernel (H200, 16384 x 65536 bf16). Tuned runs choose from NORM_RELOAD_SET instead.
STREAM_BYTES, STREAM_VECS = 16384, 2
SPLIT_MAX = 1024  # chunks per row in "split"; kernel 2 reads all partials of a row in one [SPLIT_MAX] load


@triton.jit
def _add_res(x, r):
    """h = x + residual, computed in fp32 and rounded once to x's dtype (as torch's x + residual)."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@triton.jit
def _ln_tile(x, w_ptr, b_ptr, cols, cmask, m, N, eps, HAS_BIAS: tl.constexpr):
    """(y fp32, mean, rstd) of a [BLOCK_M, BLOCK_N] fp32 tile by the corrected two-pass statistics: the
    deviations' own sum (one tuple reduction with their squares) corrects the fp32 mean's rounding, so a
    constant row normalizes to exactly 0 (with the mean an ulp off, y was +-0.3 at eps 1e-5 for 12345.678)."""
    # div_rn: Triton's `/` is div.full.f32 on NVIDIA (2 ulp); the correction must be exactly the deviations'
    # mean, else a constant row's centred value is ~1e-10 and eps 1e-12 scales it to ~1e-4 (H200, N 37).
    mean = tl.div_rn(tl.sum(x, axis=1), N * 1.0)
    xc = tl.where(m, x - mean[:, None], 0.0)
    s1, s2 = tl.reduce((xc, xc * xc), 1, _add2)
    c = tl.div_rn(s1, N * 1.0)
    mean += c
    xc = tl.where(m, xc - c[:, None], 0.0)
    rstd = rsqrt_full_range(tl.maximum(s2 / N - c * c, 0.0) + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return y, mean, rstd


@fast_launch
@triton.jit
def _ln_reg_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, M, N, eps,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    m = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    # Plain loads, weight/bias read after the statistics: on the H200 this ran 283 us vs 362 us for
    # evict_first/evict_last hints with the weight load hoisted (32768 x 8192 bf16, 16 warps).
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if HAS_RES:
        x = _add_res(x, tl.load(r_ptr + offs, mask=m, other=0.0))
        tl.store(h_ptr + offs, x, mask=m)
    y, mean, rstd = _ln_tile(x.to(tl.float32), w_ptr, b_ptr, cols, cmask, m, N, eps, HAS_BIAS)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@fast_launch
@triton.jit
def _ln_rows_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, M, N, eps,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Persistent "reg" (same statistics as _ln_reg_kernel): program p takes row tiles p, p + G, ...; the next
    # tile is loaded (still in the input dtype: half the registers of fp32) before this one is processed.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    r = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows = pid * BLOCK_M + r
    xn = load_row_tile(x_ptr, rows, cols, M, N)
    if HAS_RES:
        rn = load_row_tile(r_ptr, rows, cols, M, N)
    for t in range(pid, tl.cdiv(M, BLOCK_M), G):
        rows = t * BLOCK_M + r
        rmask = rows < M
        m = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = xn
        if HAS_RES:
            x = _add_res(x, rn)
        nrows = rows + G * BLOCK_M
        xn = load_row_tile(x_ptr, nrows, cols, M, N)
        if HAS_RES:
            rn = load_row_tile(r_ptr, nrows, cols, M, N)
            tl.store(h_ptr + offs, x, mask=m)
        y, mean, rstd = _ln_tile(x.to(tl.float32), w_ptr, b_ptr, cols, cmask, m, N, eps, HAS_BIAS)
        tl.store(mean_ptr + rows, mean, mask=rmask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_normalize(
    x_ptr, w_ptr, b_ptr, y_ptr, base, wbase, n, shift, md, rstd, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    # Streams x[base : base + n] (usually from L2, last use: evict_first) into y (never re-read here:
    # evict_first, so its lines leave L2 before the x lines still to be re-read). (x - K) - E[d] rather
    # than x - mean: x - K is exact for x near K, so the fp32 rounding of a large mean never enters y.
    cols = tl.arange(0, BLOCK)
    for k in range(0, n, BLOCK):
        c = k + cols
        cm = c < n
        x = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(w_ptr + wbase + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = ((x - shift) - md) * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + wbase + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_ptr + base + c, y.to(y_ptr.dtype.element_ty), mask=cm, eviction_policy="evict_first")


@triton.jit
def _ln_stats(s1, s2, shift, N, eps):
    """(E[d] = mean - K, mean, rstd) from the shifted sums s1 = Σ d, s2 = Σ d^2 of a row, d = xin - K."""
    md = tl.div_rn(s1, N * 1.0)  # div_rn: see _ln_tile
    rstd = rsqrt_full_range(tl.maximum(s2 / N - md * md, 0.0) + eps)
    return md, shift + md, rstd


@fast_launch
@triton.jit
def _ln_reload_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    # Persistent: program p normalizes rows p, p + G, ... (G = grid <= M), so the rows in flight are G.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    # xn / shift_n: the next step of x and the next row's shift K, loaded one step ahead (pass 1) and across
    # the row switch (before pass 2), so the statistics pass never starts with an empty load queue.
    base0 = pid.to(tl.int64) * N
    xn = tl.load(x_ptr + base0 + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
    shift_n = tl.load(x_ptr + base0).to(tl.float32)
    for row in range(pid, M, G):
        base = tl.cast(row, tl.int64) * N  # tl.cast: a loop index is a Python int in the interpreter
        shift = shift_n
        s1 = tl.zeros((BLOCK,), dtype=tl.float32)
        s2 = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, N, BLOCK):
            cm = k + cols < N
            d = tl.where(cm, xn.to(tl.float32) - shift, 0.0)
            c = k + BLOCK + cols
            # evict_last: pass 2 re-reads this row from L2.
            xn = tl.load(x_ptr + base + c, mask=c < N, other=0.0, eviction_policy="evict_last")
            s1 += d
            s2 += d * d
        md, mean, rstd = _ln_stats(tl.sum(s1, axis=0), tl.sum(s2, axis=0), shift, N, eps)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
        nxt = row + G
        n_nxt = tl.where(nxt < M, N, 0)  # elements of the next row to load: none past the last row
        nbase = tl.minimum(nxt, M - 1).to(tl.int64) * N
        xn = tl.load(x_ptr + nbase + cols, mask=cols < n_nxt, other=0.0, eviction_policy="evict_last")
        shift_n = tl.load(x_ptr + nbase).to(tl.float32)
        _ln_normalize(x_ptr, w_ptr, b_ptr, y_ptr, base, 0, N, shift, md, rstd, HAS_BIAS, BLOCK)


@fast_launch
@triton.jit
def _ln_loop3_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N: tl.constexpr, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row, three passes over it, each with ONE fp32 accumulator vector (torch.compile's
    # layer_norm, ~32 registers: the SM keeps 2048 threads of rows in flight): Σx, Σ(x - mean)^2 (the exact
    # two-pass statistics of the reference) and y. Passes 2 and 3 re-read the row from L2 (evict_last).
    # N constexpr: the constant trip counts let ptxas unroll each pass, so a thread has several steps'
    # loads in flight (see NORM_LOOP3_SET in _config.py).
    row = tl.program_id(0)
    base = row.to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, N, BLOCK):
        c = k + cols
        acc += tl.load(x_ptr + base + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    mean = tl.div_rn(tl.sum(acc, axis=0), N * 1.0)  # div_rn: see _ln_tile
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK,), dtype=tl.float32)  # Σ(x - mean): corrects the fp32 mean's rounding (_ln_tile)
    for k in range(0, N, BLOCK):
        c = k + cols
        cm = c < N
        x = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
        d = tl.where(cm, x - mean, 0.0)
        acc += d * d
        acc1 += d
    s1, s2 = tl.reduce((acc1, acc), 0, _add2)
    corr = tl.div_rn(s1, N * 1.0)
    mean += corr
    rstd = rsqrt_full_range(tl.maximum(s2 / N - corr * corr, 0.0) + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    _ln_normalize(x_ptr, w_ptr, b_ptr, y_ptr, base, 0, N, mean, 0.0, rstd, HAS_BIAS, BLOCK)


@fast_launch
@triton.jit
def _ln_reload_res_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, M, N, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # "reload" with the fused residual add: pass 1 reads x and residual once (evict_first), writes h
    # (evict_last) and takes the shifted sums of h; pass 2 re-reads h from L2 (one stream instead of two).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    for row in range(pid, M, G):
        base = tl.cast(row, tl.int64) * N
        shift = _add_res(tl.load(x_ptr + base), tl.load(r_ptr + base)).to(tl.float32)  # K = h[row, 0]
        s1 = tl.zeros((BLOCK,), dtype=tl.float32)
        s2 = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, N, BLOCK):
            c = k + cols
            cm = c < N
            x = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first")
            r = tl.load(r_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first")
            h = _add_res(x, r)
            tl.store(h_ptr + base + c, h, mask=cm, eviction_policy="evict_last")
            d = tl.where(cm, h.to(tl.float32) - shift, 0.0)
            s1 += d
            s2 += d * d
        md, mean, rstd = _ln_stats(tl.sum(s1, axis=0), tl.sum(s2, axis=0), shift, N, eps)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
        tl.debug_barrier()  # h written by every thread of the program is visible to pass 2's loads
        _ln_normalize(h_ptr, w_ptr, b_ptr, y_ptr, base, 0, N, shift, md, rstd, HAS_BIAS, BLOCK)


@fast_launch
@triton.jit
def _ln_partial_kernel(
    x_ptr, r_ptr, h_ptr, part_ptr, N, SPLIT, CHUNK, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    # Kernel 1 of "split": shifted sums of one chunk of a row (and, with a residual, h of that chunk).
    pid = tl.program_id(0)
    row = pid // SPLIT
    start = (pid % SPLIT).to(tl.int64) * CHUNK
    rbase = row.to(tl.int64) * N
    base = rbase + start
    n = tl.minimum(N - start, CHUNK)
    if HAS_RES:  # the same K = h[row, 0] for every chunk of the row
        shift = _add_res(tl.load(x_ptr + rbase), tl.load(r_ptr + rbase)).to(tl.float32)
    else:
        shift = tl.load(x_ptr + rbase).to(tl.float32)
    cols = tl.arange(0, BLOCK)
    s1 = tl.zeros((BLOCK,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, n, BLOCK):
        c = k + cols
        cm = c < n
        # evict_last: the normalize kernel re-reads this chunk (from L2 when x fits there).
        xv = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_last")
        if HAS_RES:
            xv = _add_res(xv, tl.load(r_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first"))
            tl.store(h_ptr + base + c, xv, mask=cm, eviction_policy="evict_last")
        d = tl.where(cm, xv.to(tl.float32) - shift, 0.0)
        s1 += d
        s2 += d * d
    tl.store(part_ptr + 2 * pid, tl.sum(s1, axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(s2, axis=0))


@fast_launch
@triton.jit
def _ln_split_norm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, part_ptr, N, SPLIT, CHUNK, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # Kernel 2 of "split": x_ptr is the normalized input (x, or h written by kernel 1).
    pid = tl.program_id(0)
    row = pid // SPLIT
    part = pid % SPLIT
    rbase = row.to(tl.int64) * N
    shift = tl.load(x_ptr + rbase).to(tl.float32)
    s = tl.arange(0, BLOCK_S)
    sm = s < SPLIT
    # Fixed-order combine: every chunk of the row derives bitwise the same mean/rstd.
    pbase = row.to(tl.int64) * SPLIT
    s1 = tl.sum(tl.load(part_ptr + 2 * (pbase + s), mask=sm, other=0.0), axis=0)
    s2 = tl.sum(tl.load(part_ptr + 2 * (pbase + s) + 1, mask=sm, other=0.0), axis=0)
    md, mean, rstd = _ln_stats(s1, s2, shift, N, eps)
    if part == 0:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    start = part.to(tl.int64) * CHUNK
    n = tl.minimum(N - start, CHUNK)
    _ln_normalize(x_ptr, w_ptr, b_ptr, y_ptr, rbase + start, start, n, shift, md, rstd, HAS_BIAS, BLOCK)


@triton.jit
def _ln_coop_load(x_ptr, r_ptr, base, c, m, HAS_RES: tl.constexpr):
    """One chunk of x (and residual) of a row and the row's shift K = xin[row, 0] (h[row, 0] with a residual)."""
    x = tl.load(x_ptr + base + c, mask=m, other=0.0)
    k0 = tl.load(x_ptr + base)
    if HAS_RES:
        r = tl.load(r_ptr + base + c, mask=m, other=0.0)
        k0 = _add_res(k0, tl.load(r_ptr + base))
    else:
        r = x
    return x, r, k0.to(tl.float32)


@fast_launch
@triton.jit
def _ln_coop_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr, h_ptr, mean_ptr, rstd_ptr, part_ptr, cnt_ptr, M, N, SPLIT, eps,
    HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # "coop" (kernels_triton/_coop.py): program k of group g holds chunk k of rows g, g + G, ... in registers;
    # the row's SPLIT partial shifted sums (as "split": d = xin - K, K = xin[row, 0]) meet at row_barrier and
    # are combined in a fixed order. The next row's chunk is loaded before the barrier.
    G, grp, k, c, cm = coop_chunk(N, SPLIT, BLOCK)
    s = tl.arange(0, BLOCK_S)
    w = tl.load(w_ptr + c, mask=cm, other=0.0)  # x's dtype or fp32, widened at use
    if HAS_BIAS:
        b = tl.load(b_ptr + c, mask=cm, other=0.0)
    xn, rn, kn = _ln_coop_load(x_ptr, r_ptr, grp.to(tl.int64) * N, c, cm, HAS_RES)
    for row in range(grp, M, G):
        base = tl.cast(row, tl.int64) * N
        x = xn
        shift = kn
        if HAS_RES:
            x = _add_res(x, rn)
            tl.store(h_ptr + base + c, x, mask=cm)
        ds = tl.where(cm, widen_again(x) - shift, 0.0)
        pbase = 2 * (tl.cast(row, tl.int64) * SPLIT)
        tl.store(part_ptr + pbase + 2 * k, tl.sum(ds, axis=0))
        tl.store(part_ptr + pbase + 2 * k + 1, tl.sum(ds * ds, axis=0))
        nxt = tl.minimum(row + G, M - 1)  # past the last row: a masked-off chunk of the last row
        xn, rn, kn = _ln_coop_load(x_ptr, r_ptr, tl.cast(nxt, tl.int64) * N, c, cm & (row + G < M), HAS_RES)
        row_barrier(cnt_ptr, row, SPLIT)
        sm = s < SPLIT
        s1 = tl.sum(tl.load(part_ptr + pbase + 2 * s, mask=sm, other=0.0, cache_modifier=".cg"), axis=0)
        s2 = tl.sum(tl.load(part_ptr + pbase + 2 * s + 1, mask=sm, other=0.0, cache_modifier=".cg"), axis=0)
        md, mean, rstd = _ln_stats(s1, s2, shift, N, eps)
        if k == 0:
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)
        y = ((x.to(tl.float32) - shift) - md) * rstd * w.to(tl.float32)
        if HAS_BIAS:
            y += b.to(tl.float32)
        tl.store(y_ptr + base + c, y.to(y_ptr.dtype.element_ty), mask=cm)


def _launch(cfg: NormConfig, y, h, mean, rstd, x, residual, weight, bias, eps: float) -> None:
    M, N = x.shape
    dev = device_index(x)
    has_bias = bias is not None
    has_res = residual is not None
    b = bias if has_bias else weight  # never read when HAS_BIAS is False
    r_, h_ = (residual, h) if has_res else (x, y)  # dummies, never touched when HAS_RES is False
    grid = (norm_grid(cfg, M, dev),)
    if cfg.mode in ("reg", "rows"):
        fn = _ln_reg_kernel if cfg.mode == "reg" else _ln_rows_kernel
        fn[grid](
            x, r_, weight, b, y, h_, mean, rstd, M, N, eps,
            HAS_RES=has_res, HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block, num_warps=cfg.num_warps,
        )  # fmt: skip
    elif cfg.mode == "reload":
        if has_res:
            _ln_reload_res_kernel[grid](
                x, residual, weight, b, y, h, mean, rstd, M, N, eps,
                HAS_BIAS=has_bias, BLOCK=cfg.block, num_warps=cfg.num_warps,
            )  # fmt: skip
        else:
            _ln_reload_kernel[grid](
                x, weight, b, y, mean, rstd, M, N, eps,
                HAS_BIAS=has_bias, BLOCK=cfg.block, num_warps=cfg.num_warps,
            )  # fmt: skip
    elif cfg.mode == "loop3":
        if has_res:
            raise ValueError("layer_norm: mode 'loop3' has no fused residual variant")
        _ln_loop3_kernel[grid](
            x, weight, b, y, mean, rstd, N, eps, HAS_BIAS=has_bias, BLOCK=cfg.block, num_warps=cfg.num_warps
        )  # N: a constexpr of this kernel
    elif cfg.mode == "coop":
        key = ("ln", x.dtype, weight.dtype, has_res, has_bias)
        kw = dict(HAS_RES=has_res, HAS_BIAS=has_bias)
        coop_launch(_ln_coop_kernel, key, x, cfg, 2, [x, r_, weight, b, y, h_, mean, rstd], [eps], kw)
    else:
        split, chunk = split_chunks(N, cfg.split, cfg.block, SPLIT_MAX)
        part = torch.empty((M, split, 2), dtype=torch.float32, device=x.device)
        grid = (M * split,)
        _ln_partial_kernel[grid](
            x, r_, h_, part, N, split, chunk, HAS_RES=has_res, BLOCK=cfg.block, num_warps=cfg.num_warps
        )
        _ln_split_norm_kernel[grid](
            h if has_res else x, weight, b, y, mean, rstd, part, N, split, chunk, eps,
            HAS_BIAS=has_bias, BLOCK=cfg.block, BLOCK_S=SPLIT_MAX, num_warps=cfg.num_warps,
        )  # fmt: skip


def _reference(
    xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 torch LayerNorm of rows `xs` (fp32 copies of xin): (y, mean, rstd), the tuner's check."""
    mean = xs.mean(-1)
    mean = mean + (xs - mean[:, None]).mean(-1)  # the op reference's refined mean (ops/layer_norm.py)
    xc = xs - mean[:, None]
    rstd = torch.rsqrt(xc.square().mean(-1) + eps)
    out = xc * rstd[:, None] * weight.float()
    return (out if bias is None else out + bias.float()), mean, rstd


def forward(
    y: torch.Tensor,
    h: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    _mode: str | None = None,
    _split: int | None = None,
    _block: int | None = None,
    _num_warps: int | None = None,
    _block_m: int | None = None,
    _progs: int | None = None,
) -> None:
    """y[M, N], mean[M], rstd[M] fp32 <- LayerNorm(xin) with weight[N], bias[N] | None (x's dtype or fp32);
    xin = x, or with `residual` given h[M, N] = x + residual (x's dtype), written once, and xin = h.
    Private `_mode` ("reg", "rows", "reload", "loop3", "split", "coop"), `_split`, `_block`, `_num_warps`,
    `_block_m`, `_progs` force a launch config (tests)."""
    if (h is None) != (residual is None):
        raise ValueError("layer_norm forward: h and residual must be given together")
    key = ("layer_norm", x.shape[1], x.dtype, weight.dtype, residual is not None, bias is not None)
    forced = (_mode, _split, _block, _num_warps, _block_m, _progs) != NORM_NOT_FORCED
    step = (STREAM_BYTES, STREAM_VECS)
    cfg = None if forced else norm_selected(key, x, step, res=residual is not None)
    if cfg is not None:  # the hot path: decided before for this problem
        _launch(cfg, y, h, mean, rstd, x, residual, weight, bias, eps)
        return
    force = dict(mode=_mode, split=_split, block=_block, num_warps=_num_warps, block_m=_block_m, progs=_progs)
    cfg = norm_select(
        key,
        x,
        step,
        force,
        lambda c: _launch(c, y, h, mean, rstd, x, residual, weight, bias, eps),
        lambda: norm_check(
            x,
            (y, mean, rstd),
            lambda xs: _reference(xs, weight, bias, eps),
            params=(weight, bias),
            mean_stat=(True, False),
            residual=residual,
            h=h,
        ),
        res=residual is not None,
    )
    _launch(cfg, y, h, mean, rstd, x, residual, weight, bias, eps)


def backward(
    dx: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor | None,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    xin: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    *,
    _mode: str | None = None,
    **force: int | None,
) -> None:
    """dx[M, N] (x's dtype), dw[N] and db[N] | None (weight's dtype) <- LayerNorm backward at xin (x, or h
    with a residual): x̂ = (xin - mean) * rstd, g = dy * w, dx = rstd * (g - mean(g) - x̂ * mean(g x̂)) [+ dh];
    dw = Σ_rows dy * x̂, db = Σ_rows dy, deterministic (fixed-order partials, no atomics). `eps` is unused
    (rstd is given). Private `_mode` ("rows", "col") and `_block_m`, `_num_warps`, `_progs`, `_split`,
    `_groups` force a launch config (tests)."""
    del eps
    force = {k.removeprefix("_"): v for k, v in force.items()}
    _norm_bwd.launch(dx, dw, db, dy, dh, xin, weight, mean, rstd, is_rms=False, mode=_mode, **force)


def layer_norm(
    out: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    **force,
) -> None:
    """The pre-contract entry point: forward without residual."""
    forward(out, None, mean, rstd, x, None, weight, bias, eps, **force)


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
AOT_NS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144)  # bf16 rows whose tuned sets compile
AOT_RES_NS = (
    4096,
    8192,
    16384,
    65536,
    262144,
)  # bf16 rows whose residual candidates all compile (else heuristic)


def aot_configs(n: int, es: int, res: bool = False) -> list[NormConfig]:
    """Every config the launcher can pick for rows of n, with a fused residual or not (`norm_aot_configs`),
    "loop3" included."""
    return norm_aot_configs(n, es, (STREAM_BYTES, STREAM_VECS), res, NORM_COOP_SETS["layer_norm"], True)


def _fwd_specs(dt: str, wt: str, has_res: bool, has_bias: bool, c: NormConfig, n: int) -> list[tuple]:
    px, pw = f"*{dt}", f"*{wt}"
    var = f"_w{wt}{'_res' if has_res else ''}{'_bias' if has_bias else ''}"
    nw = c.num_warps
    stat = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
    if c.mode in ("reg", "rows"):
        fn = _ln_reg_kernel if c.mode == "reg" else _ln_rows_kernel
        sig = {"x_ptr": px, "r_ptr": px, "w_ptr": pw, "b_ptr": pw, "y_ptr": px, "h_ptr": px} | stat
        sig |= {"M": "i32", "N": "i32", "eps": "fp32", "HAS_RES": "constexpr", "HAS_BIAS": "constexpr"}
        sig |= {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
        ce = {
            "HAS_RES": has_res,
            "HAS_BIAS": has_bias,
            "BLOCK_M": c.block_m,
            "BLOCK_N": c.block,
            "num_warps": nw,
        }
        return [(f"ln_{c.mode}_{dt}{var}_{c.block_m}x{c.block}_w{nw}", fn, sig, ce)]
    if c.mode == "reload":
        if has_res:
            sig = {"x_ptr": px, "r_ptr": px, "w_ptr": pw, "b_ptr": pw, "y_ptr": px, "h_ptr": px} | stat
            fn = _ln_reload_res_kernel
        else:
            sig = {"x_ptr": px, "w_ptr": pw, "b_ptr": pw, "y_ptr": px} | stat
            fn = _ln_reload_kernel
        sig |= {"M": "i32", "N": "i32", "eps": "fp32", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"}
        ce = {"HAS_BIAS": has_bias, "BLOCK": c.block, "num_warps": nw}
        return [(f"ln_reload_{dt}{var}_b{c.block}_w{nw}", fn, sig, ce)]
    if c.mode == "loop3":  # N is a constexpr of this kernel: one build per row length
        sig = {"x_ptr": px, "w_ptr": pw, "b_ptr": pw, "y_ptr": px} | stat
        sig |= {"N": "constexpr", "eps": "fp32", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"}
        ce = {"N": n, "HAS_BIAS": has_bias, "BLOCK": c.block, "num_warps": nw}
        return [(f"ln_loop3_{dt}{var}_n{n}_b{c.block}_w{nw}", _ln_loop3_kernel, sig, ce)]
    if c.mode == "coop":
        sig = {"x_ptr": px, "r_ptr": px, "w_ptr": pw, "b_ptr": pw, "y_ptr": px, "h_ptr": px} | stat
        sig |= {"part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "SPLIT": "i32", "eps": "fp32"}
        sig |= {"HAS_RES": "constexpr", "HAS_BIAS": "constexpr", "BLOCK": "constexpr", "BLOCK_S": "constexpr"}
        ce = {
            "HAS_RES": has_res,
            "HAS_BIAS": has_bias,
            "BLOCK": c.block,
            "BLOCK_S": COOP_SPLIT_MAX,
            "num_warps": nw,
        }
        return [(f"ln_coop_{dt}{var}_b{c.block}_w{nw}", _ln_coop_kernel, sig, ce)]
    sig = {"x_ptr": px, "r_ptr": px, "h_ptr": px, "part_ptr": "*fp32", "N": "i32", "SPLIT": "i32"}
    sig |= {"CHUNK": "i32", "HAS_RES": "constexpr", "BLOCK": "constexpr"}
    ce = {"HAS_RES": has_res, "BLOCK": c.block, "num_warps": nw}
    todo = [(f"ln_partial_{dt}{'_res' if has_res else ''}_b{c.block}_w{nw}", _ln_partial_kernel, sig, ce)]
    sig = {"x_ptr": px, "w_ptr": pw, "b_ptr": pw, "y_ptr": px} | stat
    sig |= {"part_ptr": "*fp32", "N": "i32", "SPLIT": "i32", "CHUNK": "i32", "eps": "fp32"}
    sig |= {"HAS_BIAS": "constexpr", "BLOCK": "constexpr", "BLOCK_S": "constexpr"}
    ce = {"HAS_BIAS": has_bias, "BLOCK": c.block, "BLOCK_S": SPLIT_MAX, "num_warps": nw}
    todo.append((f"ln_split_norm_{dt}_w{wt}{'_bias' if has_bias else ''}_b{c.block}_w{nw}",
                 _ln_split_norm_kernel, sig, ce))  # fmt: skip
    return todo


def aot_specs() -> list[tuple]:
    """Forward: per dtype (bf16: every AOT_NS; fp16/fp32: n = 4096 and 65536) the heuristic and tuned
    configs with bias, plain (weight in x's dtype, no residual) and heaviest (fp32 weight/bias +
    residual; fp32 x: the heuristic config); without bias for bf16 at n = 4096 / 65536.
    Backward: `_norm_bwd.aot_specs` (layer-norm variants)."""
    specs: list[tuple] = []
    for dt in ("bf16", "fp16", "fp32"):
        es = 4 if dt == "fp32" else 2
        for n in AOT_NS if dt == "bf16" else (4096, 65536):
            for c in aot_configs(n, es):
                specs += _fwd_specs(dt, dt, False, True, c, n)
                if dt == "bf16" and n in (4096, 65536):
                    specs += _fwd_specs(dt, dt, False, False, c, n)
            res_cfgs = aot_configs(n, es, res=True)
            if not (dt == "bf16" and n in AOT_RES_NS):  # elsewhere the heuristic plans only
                res_cfgs = [c for i, c in enumerate(res_cfgs) if i == 0 or c.mode == "split"]
            for c in res_cfgs:
                specs += _fwd_specs(dt, "fp32" if dt != "fp32" else dt, True, True, c, n)
    specs += _norm_bwd.aot_specs(is_rms=False)
    return norm_aot_specs(specs)
