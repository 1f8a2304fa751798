"""Backward of the row norms (rms_norm, layer_norm), shared: one set of kernels with IS_RMS / CASTING / HAS_DH /
HAS_DB constexprs. Called through `rms_norm.backward` and `layer_norm.backward` (CONTRACT.md):

  x̂ = xin * rstd (RMS) or (xin - mean) * rstd (LN);  g = dy * weff (w; gemma 1 + w)
  dx = rstd * (g - [mean(g)] - x̂ * mean(g * x̂)) [+ dh]          (mean(g) only for LN)
  dw = Σ_rows dy * x̂  (llama: dy * round_x(x̂));  db = Σ_rows dy   (LN with bias)

Byte floor: read dy and xin, write dx, 3 x M x N x elsize (4 x with dh), plus the dw/db partials [P, N] fp32
written and read once (P = programs: 132-264 x N x 4 B, ~0.5-1 % of the rest). 16384 x 8192 and
32768 x 4096 bf16 both move 805 MB: 188 us at the H200's measured 4274 GB/s copy rate. Measured there
(Triton 3.6, default configs): RMS 205 / 207 us, LN (with db) 208 / 212 us, i.e. 89-92 % of the floor;
fwd + bwd 340-358 us against the 314 us floor of both, 1.27-1.6x torch.compile and 1.5-1.7x Liger-Kernel.

Weight gradients are deterministic: every program accumulates its rows' contributions in fp32 registers
and writes one partial row [N]; `_sum_parts_kernel` adds the P partial rows in a fixed order (no atomics),
so two runs on the same device give bit-identical dw/db (P depends only on M, N, dtype and the SM count).

Modes (the planner `bwd_plan` picks; tests force each):
- "rows" (N <= BWD_ROWS_MAX): like Liger-Kernel's RMSNorm backward, a persistent grid of progs x SMs
  programs walks tiles of BLOCK_M whole rows (one HBM read of dy, xin, dh; dx written once), with the dw
  (db) accumulator [BLOCK_M, BLOCK_N] fp32 in registers, reduced over BLOCK_M and stored once per
  program. The loads of the next tiles are software-pipelined by Triton (tl.range num_stages), so two
  tiles stay in flight behind the one being reduced; sizing is in the constants below.
- "col" (any N; the choice past BWD_ROWS_MAX): kernel 1 (`_bwd_stats_kernel`, SPLIT chunks per row)
  computes the per-row sums Σ g x̂ (and Σ g) into fp32 partials; kernel 2 (`_bwd_col_kernel`) takes a
  column slice of BLOCK_N and a group of rows, re-reads dy, xin (dh), writes dx and keeps the dw/db
  accumulator of its slice in registers; partials [groups, N]. dy and xin are read twice from HBM:
  5 x M x N x elsize (6 x with dh), but every N (1 .. 262144 and beyond) and every M runs with the whole
  GPU busy (a row's dw partial never has to fit in a program). H200, bf16 RMS (before the last tuning of
  "rows"): 4096 x 16384 192 us, 2048 x 65536 352 us, ~49-53 % of the 3-pass floor (~82 % of its own).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels_triton._config import (
    device_index,
    is_interpreter,
    next_pow2,
    num_sms,
    split_chunks,
    warp_size,
)
from kernels_triton._launch import fast_launch

# "rows" sizing, measured on the H200 (bf16, 16384 x 8192 and 32768 x 4096 and 131072 x 1024, Triton 3.6):
# with register look-ahead (one tile in flight per program) the best configs reached 85-91 % of the byte
# floor for RMS and 70-82 % for LN (LN's extra mean, db and second row sum); with the loads pipelined by
# Triton (3 stages: cp.async into shared memory, two tiles in flight behind the one computed on) both reach
# 89-92 %: RMS 205 / 208 us, LN 208 / 212 us against the 188 us floor. The fastest shape was the same for
# every N: 32 elements per thread (4 x 16-byte vectors of bf16), 256 threads per SM (one 8-warp program
# of one 8192-row, two 4-warp programs of 4096-element tiles), 3 stages; 8 elements per thread at 1024
# threads ran 5-20 % slower and leaves 64 registers, where the LN/dh/fp32-weight variants spilled.
# A tile is >= BWD_TILE_BYTES of each input (short rows: BLOCK_M rows of it), so the shared memory of the
# stages, stages x inputs x tile x programs, is 96 KB at 8192 bf16 (144 KB with dh); BWD_SMEM caps
# it (sm_90: 228 KB per SM). On gfx942 (not measured) the AMD pipeliner keeps the stages in registers (AOT:
# LDS holds only the reduction scratch, 148-236 VGPRs, no spills), so the same budget applies.
BWD_TILE_BYTES = 8192
BWD_ELEMS_PER_THREAD = 32
BWD_THREADS_PER_SM = 256
BWD_STAGES = 3
BWD_SMEM = 200 * 1024
BWD_ROWS_MAX = 8192  # = 256 threads x 32: longer rows would need more threads, i.e. < 128 registers each (the
# rows kernel takes 150-240 at 32 elements per thread, AOT sm_90): they take "col"
BWD_BLOCK_M_MAX = 64
# "rows" with one program ("direct"): a backward of at most BWD_DIRECT_TILES row tiles and BWD_DIRECT_ELEMS
# elements (decode / a few-token step: 4 x 4096) runs as a single program that stores dw (db) itself, in the
# weight's dtype: no partials buffer and no _sum_parts_kernel launch, host time that at such sizes is most of
# the step (cProfile on the H200's host, 4 x 4096 bf16 fwd+bwd: 5 allocations at ~3 us and 3 launches at ~9 us
# each, inflated by the profiler; the step 109 us against torch's 66), while the lone program walks <= 4 tiles.
BWD_DIRECT_TILES = 4
BWD_DIRECT_ELEMS = 65536
# "col": kernel 2 tiles are BLOCK_M x BLOCK_N (2 x 1024: 2 KB row segments of bf16, 8 elements per thread
# at 8 warps), ~BWD_COL_PROGS_PER_SM programs per SM in all; kernel 1 steps 8 KB per row chunk.
BWD_COL_BLOCK_M, BWD_COL_BLOCK_N, BWD_COL_WARPS = 2, 1024, 8
BWD_COL_PROGS_PER_SM = 8
BWD_STAT_STEP_BYTES, BWD_STAT_WARPS = 8192, 8
BWD_SPLIT_MAX = 64  # chunks per row in kernel 1; kernel 2 combines them in one [BLOCK_M, 64] load
# Partial-sum reduction: [BLOCK_P, BLOCK_N] tiles, columns across programs, the P rows in a fixed order.
# Narrow column slices so N = 4096..8192 still spreads over 64-128 programs (latency-bound otherwise).
SUM_BLOCK_P, SUM_BLOCK_N, SUM_WARPS = 32, 64, 4


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """One backward launch. "rows": tiles BLOCK_M x BLOCK_N, `progs` programs per SM. "col": kernel 2 tiles
    BLOCK_M x BLOCK_N over `groups` row groups; kernel 1 steps `block` elements over `split` row chunks."""

    mode: str
    block_m: int
    block_n: int
    num_warps: int
    progs: int = 0
    split: int = 1
    stages: int = 1
    groups: int = 1
    block: int = 0
    stat_warps: int = BWD_STAT_WARPS
    direct: int = 0  # "rows": 1 = one program writes dw (db) directly (BWD_DIRECT_TILES)

    def label(self) -> str:
        s = f"{self.mode} {self.block_m}x{self.block_n} warps={self.num_warps}"
        if self.mode == "rows":
            return s + (" direct" if self.direct else f" progs/SM={self.progs}") + f" stages={self.stages}"
        return s + f" groups={self.groups} split={self.split} step={self.block}"


def bwd_rows_config(M: int, N: int, es: int, dev: int, streams: int = 2) -> BwdConfig:
    """The "rows" tile for x[M, N] (`streams`: row inputs read per tile, 2 or 3 with dh): >= BWD_TILE_BYTES
    of each input, BWD_ELEMS_PER_THREAD elements per thread, programs per SM to fill BWD_THREADS_PER_SM,
    and as many pipeline stages (<= 3) as the shared-memory budget holds for all of them."""
    block_n = next_pow2(N)
    tile = max(block_n, BWD_TILE_BYTES // es)
    block_m = max(1, min(tile // block_n, next_pow2(M), BWD_BLOCK_M_MAX))
    ws = warp_size(dev)
    nw = max(1, block_m * block_n // BWD_ELEMS_PER_THREAD // ws)
    progs = max(1, min(8, BWD_THREADS_PER_SM // (nw * ws)))
    stage_bytes = streams * block_m * block_n * es * progs
    stages = max(1, min(BWD_STAGES, BWD_SMEM // stage_bytes))
    direct = int(-(-M // block_m) <= BWD_DIRECT_TILES and M * N <= BWD_DIRECT_ELEMS)
    return BwdConfig("rows", block_m, block_n, nw, progs=progs, stages=stages, direct=direct)


def bwd_col_config(M: int, N: int, es: int, dev: int) -> BwdConfig:
    """The "col" plan for x[M, N]: enough row chunks (kernel 1) and row groups (kernel 2) to fill the GPU."""
    sms = num_sms(dev)
    block = 256 if is_interpreter() else BWD_STAT_STEP_BYTES // es
    split = max(1, min(BWD_SPLIT_MAX, -(-4 * sms // M), -(-N // block)))
    block_n = min(BWD_COL_BLOCK_N, next_pow2(N))
    cols = -(-N // block_n)
    groups = max(1, min(-(-BWD_COL_PROGS_PER_SM * sms // cols), -(-M // BWD_COL_BLOCK_M)))
    nw = max(1, min(BWD_COL_WARPS, BWD_COL_BLOCK_M * block_n // (16 // es) // warp_size(dev)))
    return BwdConfig("col", BWD_COL_BLOCK_M, block_n, nw, split=split, groups=groups, block=block)


def bwd_plan(M: int, N: int, es: int, dev: int, streams: int = 2) -> BwdConfig:
    """The heuristic config: "rows" while a row fits the register tile, else "col"."""
    if next_pow2(N) <= BWD_ROWS_MAX:
        return bwd_rows_config(M, N, es, dev, streams)
    return bwd_col_config(M, N, es, dev)


_SELECTED: dict[tuple, BwdConfig] = {}


def bwd_select(
    M: int, N: int, es: int, dev: int, streams: int = 2, mode: str | None = None, **force: int | None
) -> BwdConfig:
    """The tests' forced mode/fields over the heuristic config of that mode (the plain heuristic pick
    is remembered per (M, N, es, device, streams): it is on every training step's host path)."""
    if mode is None and not any(v is not None for v in force.values()):
        key = (M, N, es, dev, streams)
        cfg = _SELECTED.get(key)
        if cfg is None:
            cfg = _SELECTED[key] = bwd_plan(M, N, es, dev, streams)
        return cfg
    if mode is None:
        cfg = bwd_plan(M, N, es, dev, streams)
    elif mode == "rows":
        cfg = bwd_rows_config(M, N, es, dev, streams)
    elif mode == "col":
        cfg = bwd_col_config(M, N, es, dev)
    else:
        raise ValueError(f"norm backward mode must be 'rows' or 'col', got {mode!r}")
    repl = {k: v for k, v in force.items() if v is not None}
    unknown = set(repl) - {f.name for f in dataclasses.fields(BwdConfig)}
    if unknown:
        raise TypeError(f"unknown norm backward overrides {sorted(unknown)}")
    return dataclasses.replace(cfg, **repl)


# ---- kernels -----------------------------------------------------------------------------------------------
@triton.jit
def _weff(w_ptr, cols, cmask, CASTING: tl.constexpr):
    """The weight as the normalized row sees it, fp32: w, or 1 + w (gemma)."""
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if CASTING == 2:
        w = w + 1.0
    return w


@triton.jit
def _add2(a1, a2, b1, b2):
    return a1 + b1, a2 + b2


@triton.jit
def _row_sums(gx, g, IS_RMS: tl.constexpr):
    """(Σ g x̂, Σ g) over axis 1; LN's two sums share one reduction (one cross-warp exchange, not two)."""
    if IS_RMS:
        s1 = tl.sum(gx, axis=1)
        s2 = s1
    else:
        s1, s2 = tl.reduce((gx, g), 1, _add2)
    return s1, s2


@triton.jit
def _tile_offs(rows, cols, N, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 offsets of a [BLOCK_M, BLOCK_N] tile; with EVEN_N (N == BLOCK_N) the row stride is the
    constexpr BLOCK_N, so the compiler sees aligned, mask-free rows."""
    if EVEN_N:
        offs = rows.to(tl.int64)[:, None] * BLOCK_N + cols[None, :]
    else:
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    return offs


@triton.jit
def _tile_mask(rows, cols, M, N, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr):
    if EVEN_N:
        m = (rows < M)[:, None] & (cols < BLOCK_N)[None, :]  # all-true columns, folded by the compiler
    else:
        m = (rows < M)[:, None] & (cols < N)[None, :]
    return m


@fast_launch
@triton.jit
def _bwd_rows_kernel(
    dy_ptr, dh_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dwp_ptr, dbp_ptr, M, N,
    IS_RMS: tl.constexpr, CASTING: tl.constexpr, HAS_DH: tl.constexpr, HAS_DB: tl.constexpr,
    EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    # Persistent: program p takes row tiles p, p + G, ... and writes partial row p of dw (db). The loads of
    # the next STAGES - 1 tiles are issued ahead by Triton's software pipeliner (cp.async into shared
    # memory on sm_90), so they stay in flight across this tile's row reductions and stores.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    r = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_DB:
        db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in tl.range(pid, tl.cdiv(M, BLOCK_M), G, num_stages=STAGES):
        rows = t * BLOCK_M + r
        rmask = rows < M
        offs = _tile_offs(rows, cols, N, EVEN_N, BLOCK_N)
        m = _tile_mask(rows, cols, M, N, EVEN_N, BLOCK_N)
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + offs, mask=m, other=0.0)
        if HAS_DH:
            dhv = tl.load(dh_ptr + offs, mask=m, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
        if IS_RMS:
            xhat = xv.to(tl.float32) * rstd
        else:
            xhat = (xv.to(tl.float32) - tl.load(mean_ptr + rows, mask=rmask, other=0.0)[:, None]) * rstd
        g = dy * _weff(w_ptr, cols, cmask, CASTING)[None, :]  # padded columns: dy = 0, so g = 0
        s1, s2 = _row_sums(g * xhat, g, IS_RMS)
        if IS_RMS:
            dx = rstd * (g - xhat * (s1 / N)[:, None])
        else:
            dx = rstd * (g - (s2 / N)[:, None] - xhat * (s1 / N)[:, None])
        if HAS_DH:
            dx += dhv.to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
        if CASTING == 1:  # llama: the weight multiplied the normalized row rounded to x's dtype
            dw += dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            dw += dy * xhat
        if HAS_DB:
            db += dy
    pbase = pid.to(tl.int64) * N  # fp32 partial rows, or (one program, "direct") dw / db in their dtype
    tl.store(dwp_ptr + pbase + cols, tl.sum(dw, axis=0).to(dwp_ptr.dtype.element_ty), mask=cmask)
    if HAS_DB:
        tl.store(dbp_ptr + pbase + cols, tl.sum(db, axis=0).to(dbp_ptr.dtype.element_ty), mask=cmask)


@fast_launch
@triton.jit
def _bwd_stats_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, part_ptr, N, SPLIT, CHUNK,
    IS_RMS: tl.constexpr, CASTING: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # "col" kernel 1: (Σ g x̂, Σ g) over one chunk of a row -> part[row, chunk, 0:2].
    pid = tl.program_id(0)
    row = pid // SPLIT
    start = (pid % SPLIT).to(tl.int64) * CHUNK
    base = row.to(tl.int64) * N + start
    n = tl.minimum(N - start, CHUNK)
    rstd = tl.load(rstd_ptr + row)
    if not IS_RMS:
        mean = tl.load(mean_ptr + row)
    cols = tl.arange(0, BLOCK)
    s1 = tl.zeros((BLOCK,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, n, BLOCK):
        c = k + cols
        cm = c < n
        dy = tl.load(dy_ptr + base + c, mask=cm, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + base + c, mask=cm, other=0.0).to(tl.float32)
        g = dy * _weff(w_ptr + start, c, cm, CASTING)
        if IS_RMS:
            s1 += g * (x * rstd)
        else:
            s1 += g * ((x - mean) * rstd)
            s2 += g
    tl.store(part_ptr + 2 * pid, tl.sum(s1, axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(s2, axis=0))


@fast_launch
@triton.jit
def _bwd_col_kernel(
    dy_ptr, dh_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, part_ptr, dx_ptr, dwp_ptr, dbp_ptr,
    M, N, SPLIT, ROWS_PER_GROUP,
    IS_RMS: tl.constexpr, CASTING: tl.constexpr, HAS_DH: tl.constexpr, HAS_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # "col" kernel 2: program (c, g) owns columns [c*BLOCK_N, +BLOCK_N) of the rows of group g; it writes
    # their dx and partial row g of dw (db) for its columns.
    pc = tl.program_id(0)
    pg = tl.program_id(1)
    cols = pc * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = _weff(w_ptr, cols, cmask, CASTING)[None, :]
    r = tl.arange(0, BLOCK_M)
    s = tl.arange(0, BLOCK_S)
    smask = s < SPLIT
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_DB:
        db = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    r0 = pg * ROWS_PER_GROUP
    r1 = tl.minimum(r0 + ROWS_PER_GROUP, M)
    for m0 in range(r0, r1, BLOCK_M):
        rows = m0 + r
        rmask = rows < r1
        m = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
        # The row's sums from kernel 1, combined in a fixed order: every column slice gets the same value.
        pofs = 2 * (rows.to(tl.int64)[:, None] * SPLIT + s[None, :])
        pm = rmask[:, None] & smask[None, :]
        c1 = tl.sum(tl.load(part_ptr + pofs, mask=pm, other=0.0), axis=1)[:, None] / N
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = (x - tl.load(mean_ptr + rows, mask=rmask, other=0.0)[:, None]) * rstd
        g = dy * w
        if IS_RMS:
            dx = rstd * (g - xhat * c1)
        else:
            c2 = tl.sum(tl.load(part_ptr + pofs + 1, mask=pm, other=0.0), axis=1)[:, None] / N
            dx = rstd * (g - c2 - xhat * c1)
        if HAS_DH:
            dx += tl.load(dh_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=m)
        if CASTING == 1:
            dw += dy * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            dw += dy * xhat
        if HAS_DB:
            db += dy
    pbase = pg.to(tl.int64) * N
    tl.store(dwp_ptr + pbase + cols, tl.sum(dw, axis=0), mask=cmask)
    if HAS_DB:
        tl.store(dbp_ptr + pbase + cols, tl.sum(db, axis=0), mask=cmask)


@fast_launch
@triton.jit
def _sum_parts_kernel(
    p_ptr, out_ptr, out2_ptr, P, N, TWO: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    # out[c] = Σ_p part[0, p, c] (out2 from part[1] when TWO) in a fixed order: BLOCK_P-row steps summed
    # elementwise, then one reduction over BLOCK_P whose tree is fixed by the compiled layout.
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    pr = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if TWO:
        acc2 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + pr
        m = (rows < P)[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        acc += tl.load(p_ptr + offs, mask=m, other=0.0)
        if TWO:
            # (rows * 0 + P): P == 1 is specialized to a constexpr int, which has no .to()
            acc2 += tl.load(p_ptr + (rows * 0 + P).to(tl.int64)[:, None] * N + offs, mask=m, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)
    if TWO:
        tl.store(out2_ptr + cols, tl.sum(acc2, axis=0).to(out2_ptr.dtype.element_ty), mask=cmask)


# ---- launcher ----------------------------------------------------------------------------------------------
def launch(
    dx: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor | None,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    xin: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    is_rms: bool,
    casting: int = 0,
    mode: str | None = None,
    **force: int | None,
) -> BwdConfig:
    """dx, dw (and db) of the norm at xin; `mean` None for RMS. Returns the config it ran (tests)."""
    M, N = xin.shape
    dev = device_index(xin)
    has_dh, has_db = dh is not None, db is not None
    cfg = bwd_select(M, N, xin.element_size(), dev, 2 + has_dh, mode, **force)
    dh_ = dh if has_dh else dy  # dummies, never touched when the flag is off
    mean_ = mean if mean is not None else rstd
    flags = dict(IS_RMS=is_rms, CASTING=casting, HAS_DH=has_dh, HAS_DB=has_db)
    if cfg.mode == "rows":
        # direct: the lone program's partial row is the result; the kernel's store casts it to dw's dtype
        P = 1 if cfg.direct else max(1, min(cfg.progs * num_sms(dev), -(-M // cfg.block_m)))
        if cfg.direct:
            dwp, dbp = dw, (db if has_db else dw)
        else:
            part = torch.empty((2 if has_db else 1, P, N), dtype=torch.float32, device=xin.device)
            dwp, dbp = part[0], part[-1]
        _bwd_rows_kernel[(P,)](
            dy, dh_, xin, weight, mean_, rstd, dx, dwp, dbp, M, N,
            **flags, EVEN_N=cfg.block_n == N, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
            num_warps=cfg.num_warps,
        )  # fmt: skip
        if cfg.direct:
            return cfg
    else:
        split, chunk = split_chunks(N, cfg.split, cfg.block, BWD_SPLIT_MAX)
        stats = torch.empty((M, split, 2), dtype=torch.float32, device=xin.device)
        _bwd_stats_kernel[(M * split,)](
            dy, xin, weight, mean_, rstd, stats, N, split, chunk,
            IS_RMS=is_rms, CASTING=casting, BLOCK=cfg.block, num_warps=cfg.stat_warps,
        )  # fmt: skip
        groups = max(1, min(cfg.groups, -(-M // cfg.block_m)))
        rows_per_group = triton.cdiv(triton.cdiv(M, groups), cfg.block_m) * cfg.block_m
        P = -(-M // rows_per_group)
        part = torch.empty((2 if has_db else 1, P, N), dtype=torch.float32, device=xin.device)
        _bwd_col_kernel[(triton.cdiv(N, cfg.block_n), P)](
            dy, dh_, xin, weight, mean_, rstd, stats, dx, part[0], part[-1], M, N, split, rows_per_group,
            **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_S=BWD_SPLIT_MAX, num_warps=cfg.num_warps,
        )  # fmt: skip
    _sum_parts_kernel[(triton.cdiv(N, SUM_BLOCK_N),)](
        part, dw, db if has_db else dw, P, N,
        TWO=has_db, BLOCK_P=SUM_BLOCK_P, BLOCK_N=SUM_BLOCK_N, num_warps=SUM_WARPS,
    )  # fmt: skip
    return cfg


# ---- ahead-of-time coverage --------------------------------------------------------------------------------
# "rows" tiles compiled (each ~5 s per target on a CI core): the plain bf16 variant at tiles of 32, 4 and 1
# rows (and a masked one); the variants that add live values (fp32 weight, dh, llama/gemma, bias) and the
# other dtypes at the largest tiles, where registers and shared memory peak (512 / 2048 differ from these
# only in BLOCK_M x BLOCK_N at the same 4096 elements per tile).
AOT_ROWS_NS = (128, 1024, 4096, 8192)
AOT_HEAVY_NS = (1024, 8192)


def aot_specs(is_rms: bool) -> list[tuple]:
    """(name, fn, sig, constexprs) of every backward kernel variant the launcher can pick for one op, over
    dtypes x weight dtype x dh x (casting | bias): per config the plain variant (weight in x's dtype, no
    dh, "fp32" casting / no bias) and the heaviest one (fp32 weight, dh, llama casting / bias); gemma (RMS)
    at the largest bf16 tile (see AOT_ROWS_NS). The names carry no op prefix where rms_norm and layer_norm share a binary."""
    op = "rms" if is_rms else "ln"
    specs: list[tuple] = []
    heavy_cast = 1 if is_rms else 0
    for dt in ("bf16", "fp16", "fp32"):
        es = 4 if dt == "fp32" else 2
        px = f"*{dt}"
        variants = [(dt, False, 0, False), ("fp32" if dt != "fp32" else dt, True, heavy_cast, not is_rms)]
        if is_rms and dt == "bf16":
            variants.append((dt, True, 2, False))
        for wt, has_dh, cast, has_db in variants:
            tag = f"{op}_{dt}_w{wt}{'_dh' if has_dh else ''}{['', '_llama', '_gemma'][cast]}"
            tag += "_bias" if has_db else ""
            flags = {"IS_RMS": is_rms, "CASTING": cast, "HAS_DH": has_dh, "HAS_DB": has_db}
            io = {"dy_ptr": px, "dh_ptr": px, "x_ptr": px, "w_ptr": f"*{wt}", "mean_ptr": "*fp32"}
            io |= {"rstd_ptr": "*fp32"}
            outs = {"dx_ptr": px, "dwp_ptr": "*fp32", "dbp_ptr": "*fp32"}
            cexp = {k: "constexpr" for k in flags}
            plain = not (has_dh or has_db or cast or wt != dt)
            if dt != "bf16" or cast == 2:
                ns = (8192,)
            else:
                ns = AOT_ROWS_NS if plain else AOT_HEAVY_NS
            for n in ns:
                c = bwd_rows_config(1 << 20, n, es, 0, 2 + has_dh)
                for even in (True, False) if n == 4096 and plain and dt == "bf16" else (True,):
                    sig = io | outs | {"M": "i32", "N": "i32"} | cexp | {"EVEN_N": "constexpr"}
                    sig |= {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "STAGES": "constexpr"}
                    ce = flags | {
                        "EVEN_N": even,
                        "BLOCK_M": c.block_m,
                        "BLOCK_N": c.block_n,
                        "STAGES": c.stages,
                    }
                    ce |= {"num_warps": c.num_warps}
                    name = f"norm_bwd_rows_{tag}_{c.block_m}x{c.block_n}{'' if even else '_masked'}_w{c.num_warps}"
                    specs.append((name, _bwd_rows_kernel, sig, ce))
            if plain and wt != "fp32":  # "direct" (one program): dw / db stored in the weight's dtype
                c = bwd_rows_config(4, 4096, es, 0, 2)
                sig = io | {"dx_ptr": px, "dwp_ptr": f"*{wt}", "dbp_ptr": f"*{wt}", "M": "i32", "N": "i32"}
                sig |= cexp | {k: "constexpr" for k in ("EVEN_N", "BLOCK_M", "BLOCK_N", "STAGES")}
                ce = flags | {"EVEN_N": True, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "STAGES": c.stages}
                ce |= {"num_warps": c.num_warps}
                name = f"norm_bwd_rows_{tag}_direct_{c.block_m}x{c.block_n}_w{c.num_warps}"
                specs.append((name, _bwd_rows_kernel, sig, ce))
            # "col": kernel 1 (no dh / bias flags) and kernel 2, at the real (non-interpreter) sizes.
            step = BWD_STAT_STEP_BYTES // es
            sig = {"dy_ptr": px, "x_ptr": px, "w_ptr": f"*{wt}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
            sig |= {"part_ptr": "*fp32", "N": "i32", "SPLIT": "i32", "CHUNK": "i32"}
            sig |= {"IS_RMS": "constexpr", "CASTING": "constexpr", "BLOCK": "constexpr"}
            ce = {"IS_RMS": is_rms, "CASTING": cast, "BLOCK": step, "num_warps": BWD_STAT_WARPS}
            specs.append(
                (
                    f"norm_bwd_stats_{op}_{dt}_w{wt}{['', '_llama', '_gemma'][cast]}_b{step}",
                    _bwd_stats_kernel,
                    sig,
                    ce,
                )
            )
            nw = max(1, min(BWD_COL_WARPS, BWD_COL_BLOCK_M * BWD_COL_BLOCK_N // (16 // es) // 32))
            sig = (
                io
                | {"part_ptr": "*fp32"}
                | outs
                | {"M": "i32", "N": "i32", "SPLIT": "i32", "ROWS_PER_GROUP": "i32"}
            )
            sig |= cexp | {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_S": "constexpr"}
            ce = flags | {"BLOCK_M": BWD_COL_BLOCK_M, "BLOCK_N": BWD_COL_BLOCK_N, "BLOCK_S": BWD_SPLIT_MAX}
            ce |= {"num_warps": nw}
            specs.append(
                (f"norm_bwd_col_{tag}_{BWD_COL_BLOCK_M}x{BWD_COL_BLOCK_N}_w{nw}", _bwd_col_kernel, sig, ce)
            )
    for wt in ("bf16", "fp16", "fp32"):
        for two in (False, True) if not is_rms else (False,):
            sig = {"p_ptr": "*fp32", "out_ptr": f"*{wt}", "out2_ptr": f"*{wt}", "P": "i32", "N": "i32"}
            sig |= {"TWO": "constexpr", "BLOCK_P": "constexpr", "BLOCK_N": "constexpr"}
            ce = {"TWO": two, "BLOCK_P": SUM_BLOCK_P, "BLOCK_N": SUM_BLOCK_N, "num_warps": SUM_WARPS}
            specs.append((f"norm_bwd_sum_{wt}{'_two' if two else ''}", _sum_parts_kernel, sig, ce))
    return specs
