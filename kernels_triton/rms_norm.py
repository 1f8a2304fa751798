"""RMSNorm, forward and backward (CONTRACT.md): optional fused residual add, weight in x's dtype or fp32,
casting "fp32" | "llama" | "gemma"; fp32 math, rstd[M] fp32.

    forward(y, h, rstd, x, residual, weight, eps, casting)     h = x + residual (or None), y = norm(h or x)
    backward(dx, dw, dy, dh, xin, weight, rstd, eps, casting)  (kernels in kernels_triton/_norm_bwd.py)

Forward byte floor: read x once, write y once (+ N weights, M rstd), 2 x M x N x elsize: 32768 x 8192 bf16
= 1.07 GB -> 251 us at the H200's measured 4274 GB/s copy rate; 16384 x 65536 bf16 = 4.29 GB -> 1004 us.
With the fused residual add: read x and residual, write h and y, 4 x M x N x elsize (twice that). Arithmetic
is negligible, so the shape of every mode follows from keeping ~26 KB of input in flight per SM (see the
table in kernels_triton/_config.py):
- "reg" (N <= 16384): a tile of rows in registers, one program per tile; one HBM read of x (and residual).
- "rows": the same tile, persistent programs that load the next tile before storing this one.
- "reload" (any N, the only choice past 16384): persistent programs, one row at a time, two passes (the
  second from L2), loads one step ahead and across rows; progs x SMs rows in flight fit the L2. With a
  residual, pass 1 writes h (evict_last) and pass 2 re-reads h from L2 (one stream, not x and residual).
- "split" (M < 2 x SMs, N > 16384): two kernels, per-chunk partial sums (and h) then normalize.
- "coop" (rows > 128 KB, tuned runs on a GPU only): a row cut into register-resident chunks, one program
  each, whose partial sums meet at a per-row barrier in global memory (cooperative launch): one HBM read
  of x, no L2 re-read (kernels_triton/_coop.py; 1.15-1.22x "reload" at 131072-262144 bf16 on the H100).
Large problems pick among these by timing (`norm_tuned`, every candidate first checked against an fp32
reference of the same residual/casting/weight variant); the interpreter and small ones by heuristic.

Casting (the constexpr CASTING: 0 "fp32", 1 "llama", 2 "gemma"):
  fp32:  y = round_x(xin * rstd * w);  llama: y = round_x(round_x(xin * rstd) * w) (HF LlamaRMSNorm casts
  the normalized row to x's dtype before the weight);  gemma: y = round_x(xin * rstd * (1 + w)).
The weight is loaded through its own pointer type (fp32 under AMP, or x's dtype), always widened to fp32.

Backward byte floor: read dy and xin, write dx (+ read dh with a residual): 3 (4) x M x N x elsize, e.g.
16384 x 8192 bf16: 805 MB -> 188 us; the dw partials [P, N] fp32 add ~2 x P x N x 4 bytes (P ~ 132-264).
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
from kernels_triton._tiles import load_row_tile, rsqrt_full_range

# Heuristic (untuned) step of "reload": 32 KB of x, 4 x 16-byte vectors per thread (16 warps on NVIDIA);
# with one program of one row per SM it is the old one-row-per-program kernel's best step (H200, 16384 x
# 65536 bf16, before persistence: 32 KB / 16 warps beat 16 KB / 16, 8 KB / 8 and 32 KB / 32 warps).
# "split" caps it at 16 KB / 2 vectors. Tuned runs choose from NORM_RELOAD_SET instead.
STREAM_BYTES, STREAM_VECS = 32768, 4
# Chunks per row in "split" mode are capped so kernel 2 combines them in one fixed-size [SPLIT_MAX] load.
SPLIT_MAX = 1024
CASTINGS = {"fp32": 0, "llama": 1, "gemma": 2}


@triton.jit
def _rms_y(x, rstd, w, CASTING: tl.constexpr, out_ty: tl.constexpr):
    """y in the output dtype from fp32 xin, rstd and weight (broadcastable), per the casting mode."""
    if CASTING == 1:  # llama: the normalized row is rounded to x's dtype, then scaled and rounded again
        return ((x * rstd).to(out_ty).to(tl.float32) * w).to(out_ty)
    elif CASTING == 2:  # gemma: weight stored as an offset from 1
        return (x * rstd * (1.0 + w)).to(out_ty)
    else:
        return (x * rstd * w).to(out_ty)


@triton.jit
def _add_res(x, r):
    """h = x + residual, computed in fp32 and rounded once to x's dtype (as torch's x + residual)."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)


@fast_launch
@triton.jit
def _rms_reg_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, N, eps,
    HAS_RES: tl.constexpr, CASTING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    m = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    # Plain loads, weight read after the reduction: on the H200 this beat evict_first/evict_last hints
    # with the weight load hoisted (more live registers during the reduction).
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if HAS_RES:
        x = _add_res(x, tl.load(r_ptr + offs, mask=m, other=0.0))
        tl.store(h_ptr + offs, x, mask=m)
    x = x.to(tl.float32)
    rstd = rsqrt_full_range(tl.sum(x * x, axis=1) / N + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _rms_y(x, rstd[:, None], w[None, :], CASTING, y_ptr.dtype.element_ty), mask=m)


@fast_launch
@triton.jit
def _rms_rows_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, N, eps,
    HAS_RES: tl.constexpr, CASTING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # Persistent "reg": program p takes row tiles p, p + G, ...; the next tile is loaded (still bf16/fp16:
    # half the registers of its fp32 copy) before this tile is reduced and stored.
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
        x = x.to(tl.float32)
        rstd = rsqrt_full_range(tl.sum(x * x, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = _rms_y(x, rstd[:, None], w[None, :], CASTING, y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, y, mask=m)


@triton.jit
def _rms_normalize(src_ptr, w_ptr, y_ptr, base, wbase, n, rstd, CASTING: tl.constexpr, BLOCK: tl.constexpr):
    # Streams src[base : base + n] (x or h, usually from L2, last use: evict_first) into y (never re-read
    # here: evict_first too, so its dirty lines go before the src lines still to be re-read).
    cols = tl.arange(0, BLOCK)
    for k in range(0, n, BLOCK):
        c = k + cols
        cm = c < n
        x = tl.load(src_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(w_ptr + wbase + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = _rms_y(x, rstd, w, CASTING, y_ptr.dtype.element_ty)
        tl.store(y_ptr + base + c, y, mask=cm, eviction_policy="evict_first")


@fast_launch
@triton.jit
def _rms_reload_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, eps, CASTING: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    # Persistent: program p normalizes rows p, p + G, ... (G = grid <= M), so the rows in flight are G.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    # xa, xb: the next two steps of x. Pass 1 consumes xa while xb and the step after it are in flight (two
    # steps per program in flight, not one: +1 landing vector per thread); both are loaded for the next row
    # before pass 2, so the row switch does not drain the loads either.
    base0 = pid.to(tl.int64) * N
    xa = tl.load(x_ptr + base0 + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
    xb = tl.load(x_ptr + base0 + BLOCK + cols, mask=BLOCK + cols < N, other=0.0, eviction_policy="evict_last")
    for row in range(pid, M, G):
        base = tl.cast(row, tl.int64) * N  # tl.cast: a loop index is a Python int in the interpreter
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, N, BLOCK):
            x = xa.to(tl.float32)
            xa = xb
            c = k + 2 * BLOCK + cols
            xb = tl.load(x_ptr + base + c, mask=c < N, other=0.0, eviction_policy="evict_last")
            acc += x * x
        rstd = rsqrt_full_range(tl.sum(acc, axis=0) / N + eps)
        tl.store(rstd_ptr + row, rstd)
        nxt = row + G
        n_nxt = tl.where(nxt < M, N, 0)  # elements of the next row to load: none past the last row
        nbase = nxt.to(tl.int64) * N
        xa = tl.load(x_ptr + nbase + cols, mask=cols < n_nxt, other=0.0, eviction_policy="evict_last")
        xb = tl.load(
            x_ptr + nbase + BLOCK + cols, mask=BLOCK + cols < n_nxt, other=0.0, eviction_policy="evict_last"
        )
        # Pass 2 re-reads the row from L2.
        _rms_normalize(x_ptr, w_ptr, y_ptr, base, 0, N, rstd, CASTING, BLOCK)


@fast_launch
@triton.jit
def _rms_reload_res_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, N, eps, CASTING: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    # "reload" with the fused residual add. Pass 1 reads x and residual once from HBM (evict_first: never
    # re-read), writes h = x + residual (evict_last: pass 2 re-reads it from L2) and sums h^2; pass 2 streams
    # h, not x and residual, so L2 serves one re-read stream. Two input streams keep a program's loads in
    # flight without the explicit look-ahead of _rms_reload_kernel (which would double its landing registers).
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    for row in range(pid, M, G):
        base = tl.cast(row, tl.int64) * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, N, BLOCK):
            c = k + cols
            cm = c < N
            x = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first")
            r = tl.load(r_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first")
            h = _add_res(x, r)
            tl.store(h_ptr + base + c, h, mask=cm, eviction_policy="evict_last")
            hf = h.to(tl.float32)
            acc += hf * hf
        rstd = rsqrt_full_range(tl.sum(acc, axis=0) / N + eps)
        tl.store(rstd_ptr + row, rstd)
        tl.debug_barrier()  # h written by every thread of the program is visible to pass 2's loads
        _rms_normalize(h_ptr, w_ptr, y_ptr, base, 0, N, rstd, CASTING, BLOCK)


@fast_launch
@triton.jit
def _rms_partial_kernel(
    x_ptr, r_ptr, h_ptr, part_ptr, N, SPLIT, CHUNK, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    # Kernel 1 of "split": sum of squares of one chunk of a row (and, with a residual, h of that chunk).
    pid = tl.program_id(0)
    row = pid // SPLIT
    start = (pid % SPLIT).to(tl.int64) * CHUNK
    base = row.to(tl.int64) * N + start
    n = tl.minimum(N - start, CHUNK)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, n, BLOCK):
        c = k + cols
        cm = c < n
        x = tl.load(x_ptr + base + c, mask=cm, other=0.0)
        if HAS_RES:
            x = _add_res(x, tl.load(r_ptr + base + c, mask=cm, other=0.0))
            tl.store(h_ptr + base + c, x, mask=cm)
        x = x.to(tl.float32)
        acc += x * x
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


@fast_launch
@triton.jit
def _rms_split_norm_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, part_ptr, N, SPLIT, CHUNK, eps,
    CASTING: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # Kernel 2 of "split": x_ptr is the normalized input (x, or h written by kernel 1).
    pid = tl.program_id(0)
    row = pid // SPLIT
    part = pid % SPLIT
    # Every chunk of a row combines the same partials in the same order: identical rstd, reproducible.
    s = tl.arange(0, BLOCK_S)
    p = tl.load(part_ptr + row.to(tl.int64) * SPLIT + s, mask=s < SPLIT, other=0.0)
    rstd = rsqrt_full_range(tl.sum(p, axis=0) / N + eps)
    if part == 0:
        tl.store(rstd_ptr + row, rstd)
    start = part.to(tl.int64) * CHUNK
    n = tl.minimum(N - start, CHUNK)
    _rms_normalize(x_ptr, w_ptr, y_ptr, row.to(tl.int64) * N + start, start, n, rstd, CASTING, BLOCK)


@fast_launch
@triton.jit
def _rms_coop_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, part_ptr, cnt_ptr, M, N, SPLIT, eps,
    HAS_RES: tl.constexpr, CASTING: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # "coop" (kernels_triton/_coop.py): program k of group g holds chunk k of rows g, g + G, ... in registers;
    # the row's SPLIT partial sums of squares meet at row_barrier. The next row's chunk (and residual) is
    # loaded before the barrier, so it is in flight while the group waits.
    G, grp, k, c, cm = coop_chunk(N, SPLIT, BLOCK)
    s = tl.arange(0, BLOCK_S)
    w = tl.load(w_ptr + c, mask=cm, other=0.0)  # x's dtype or fp32, widened at use
    base = grp.to(tl.int64) * N
    xn = tl.load(x_ptr + base + c, mask=cm, other=0.0)
    if HAS_RES:
        rn = tl.load(r_ptr + base + c, mask=cm, other=0.0)
    for row in range(grp, M, G):
        base = tl.cast(row, tl.int64) * N
        x = xn
        if HAS_RES:
            x = _add_res(x, rn)
            tl.store(h_ptr + base + c, x, mask=cm)
        xs = widen_again(x)
        pbase = tl.cast(row, tl.int64) * SPLIT
        tl.store(part_ptr + pbase + k, tl.sum(xs * xs, axis=0))
        nm = cm & (row + G < M)
        xn = tl.load(x_ptr + base + G * N + c, mask=nm, other=0.0)
        if HAS_RES:
            rn = tl.load(r_ptr + base + G * N + c, mask=nm, other=0.0)
        row_barrier(cnt_ptr, row, SPLIT)
        p = tl.load(part_ptr + pbase + s, mask=s < SPLIT, other=0.0, cache_modifier=".cg")
        rstd = rsqrt_full_range(tl.sum(p, axis=0) / N + eps)
        if k == 0:
            tl.store(rstd_ptr + row, rstd)
        tl.store(
            y_ptr + base + c,
            _rms_y(x.to(tl.float32), rstd, w.to(tl.float32), CASTING, y_ptr.dtype.element_ty),
            mask=cm,
        )


def _launch(cfg: NormConfig, y, h, rstd, x, residual, weight, eps: float, casting: int) -> None:
    M, N = x.shape
    dev = device_index(x)
    has_res = residual is not None
    r_, h_ = (residual, h) if has_res else (x, y)  # dummies, never touched when HAS_RES is False
    grid = (norm_grid(cfg, M, dev),)
    if cfg.mode in ("reg", "rows"):
        fn = _rms_reg_kernel if cfg.mode == "reg" else _rms_rows_kernel
        fn[grid](
            x, r_, weight, y, h_, rstd, M, N, eps,
            HAS_RES=has_res, CASTING=casting, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block, num_warps=cfg.num_warps,
        )  # fmt: skip
    elif cfg.mode == "reload":
        if has_res:
            _rms_reload_res_kernel[grid](
                x, residual, weight, y, h, rstd, M, N, eps,
                CASTING=casting, BLOCK=cfg.block, num_warps=cfg.num_warps,
            )  # fmt: skip
        else:
            _rms_reload_kernel[grid](
                x, weight, y, rstd, M, N, eps, CASTING=casting, BLOCK=cfg.block, num_warps=cfg.num_warps
            )
    elif cfg.mode == "coop":
        key = ("rms", x.dtype, weight.dtype, has_res, casting)
        kw = dict(HAS_RES=has_res, CASTING=casting)
        coop_launch(_rms_coop_kernel, key, x, cfg, 1, [x, r_, weight, y, h_, rstd], [eps], kw)
    else:
        split, chunk = split_chunks(N, cfg.split, cfg.block, SPLIT_MAX)
        part = torch.empty((M, split), dtype=torch.float32, device=x.device)
        grid = (M * split,)
        _rms_partial_kernel[grid](
            x, r_, h_, part, N, split, chunk, HAS_RES=has_res, BLOCK=cfg.block, num_warps=cfg.num_warps
        )
        _rms_split_norm_kernel[grid](
            h if has_res else x, weight, y, rstd, part, N, split, chunk, eps,
            CASTING=casting, BLOCK=cfg.block, BLOCK_S=SPLIT_MAX, num_warps=cfg.num_warps,
        )  # fmt: skip


def _reference(
    xs: torch.Tensor, weight: torch.Tensor, eps: float, casting: int = 0, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch RMSNorm of rows `xs` (fp32 copies of xin): (y, rstd), the tuner's correctness check.
    `dtype` (x's) is where "llama" rounds the normalized rows."""
    rstd = torch.rsqrt(xs.square().mean(-1) + eps)
    xn = xs * rstd[:, None]
    w = weight.float()
    if casting == 1:
        return xn.to(dtype or xs.dtype).float() * w, rstd
    return xn * (1.0 + w if casting == 2 else w), rstd


def _casting_code(casting: str | int) -> int:
    if isinstance(casting, int) and casting in CASTINGS.values():
        return casting
    if casting not in CASTINGS:
        raise ValueError(f"rms_norm casting must be one of {sorted(CASTINGS)}, got {casting!r}")
    return CASTINGS[casting]


def forward(
    y: torch.Tensor,
    h: torch.Tensor | None,
    rstd: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    casting: str = "fp32",
    *,
    _mode: str | None = None,
    _split: int | None = None,
    _block: int | None = None,
    _num_warps: int | None = None,
    _block_m: int | None = None,
    _progs: int | None = None,
) -> None:
    """y[M, N], rstd[M] fp32 <- RMSNorm(xin) * weight[N] per `casting`; xin = x, or with `residual` given
    h[M, N] = x + residual (x's dtype), written once, and xin = h. weight: x's dtype or fp32.
    Private `_mode` ("reg", "rows", "reload", "split", "coop"), `_split`, `_block`, `_num_warps`, `_block_m`,
    `_progs` force a launch config (tests)."""
    if (h is None) != (residual is None):
        raise ValueError("rms_norm forward: h and residual must be given together")
    cc = _casting_code(casting)
    key = ("rms_norm", x.shape[1], x.dtype, weight.dtype, residual is not None, cc)
    forced = (_mode, _split, _block, _num_warps, _block_m, _progs) != NORM_NOT_FORCED
    step = (STREAM_BYTES, STREAM_VECS)
    cfg = None if forced else norm_selected(key, x, step, res=residual is not None)
    if cfg is not None:  # the hot path: decided before for this problem
        _launch(cfg, y, h, rstd, x, residual, weight, eps, cc)
        return
    force = dict(mode=_mode, split=_split, block=_block, num_warps=_num_warps, block_m=_block_m, progs=_progs)
    cfg = norm_select(
        key,
        x,
        step,
        force,
        lambda c: _launch(c, y, h, rstd, x, residual, weight, eps, cc),
        lambda: norm_check(
            x,
            (y, rstd),
            lambda xs: _reference(xs, weight, eps, cc, x.dtype),
            params=(weight,),
            residual=residual,
            h=h,
        ),
        res=residual is not None,
    )
    _launch(cfg, y, h, rstd, x, residual, weight, eps, cc)


def backward(
    dx: torch.Tensor,
    dw: torch.Tensor,
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    xin: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    casting: str = "fp32",
    *,
    _mode: str | None = None,
    **force: int | None,
) -> None:
    """dx[M, N] (x's dtype), dw[N] (weight's dtype) <- RMSNorm backward at xin (x, or h with a residual):
    x̂ = xin * rstd, g = dy * weff (w; gemma 1 + w), dx = rstd * (g - x̂ * mean(g x̂)) [+ dh];
    dw = Σ_rows dy * x̂ (llama: dy * round_x(x̂)), deterministic (fixed-order partials, no atomics).
    `eps` is unused (rstd is given). Private `_mode` ("rows", "col") and `_block_m`, `_num_warps`,
    `_progs`, `_split`, `_groups` force a launch config (tests)."""
    del eps
    force = {k.removeprefix("_"): v for k, v in force.items()}
    _norm_bwd.launch(
        dx, dw, None, dy, dh, xin, weight, None, rstd, is_rms=True, casting=_casting_code(casting),
        mode=_mode, **force,
    )  # fmt: skip


def rms_norm(
    out: torch.Tensor, rstd: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, **force
) -> None:
    """The pre-contract entry point: forward without residual, "fp32" casting."""
    forward(out, None, rstd, x, None, weight, eps, "fp32", **force)


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
AOT_NS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144)  # bf16 rows whose tuned sets compile
# (weight dtype, residual, casting) variants: every config of the plain one (weight in x's dtype, no residual,
# "fp32") and the heaviest one (fp32 weight under AMP + residual: a second input stream and an h store; its
# own candidate list, `norm_candidates(res=True)`): every candidate for bf16 at AOT_RES_NS, the heuristic
# configs elsewhere (each config costs ~1-3 s per target in the CI AOT session). The llama/gemma castings change a few epilogue instructions only: heuristic configs at AOT_CAST_NS.
AOT_CAST_NS = (4096, 65536)
AOT_RES_NS = (4096, 8192, 16384, 65536, 262144)  # bf16 rows whose residual tuning candidates all compile


def aot_configs(n: int, es: int, res: bool = False) -> list[NormConfig]:
    """Every config the launcher can pick for rows of n, with a fused residual or not (`norm_aot_configs`)."""
    return norm_aot_configs(n, es, (STREAM_BYTES, STREAM_VECS), res, NORM_COOP_SETS["rms_norm"])


def _fwd_specs(dt: str, wt: str, has_res: bool, casting: int, c: NormConfig) -> list[tuple]:
    px, pw = f"*{dt}", f"*{wt}"
    tag = f"{dt}_w{wt}{'_res' if has_res else ''}{['', '_llama', '_gemma'][casting]}"
    nw = c.num_warps
    io = {"x_ptr": px, "r_ptr": px, "w_ptr": pw, "y_ptr": px, "h_ptr": px, "rstd_ptr": "*fp32"}
    if c.mode in ("reg", "rows"):
        fn = _rms_reg_kernel if c.mode == "reg" else _rms_rows_kernel
        sig = io | {"M": "i32", "N": "i32", "eps": "fp32", "HAS_RES": "constexpr", "CASTING": "constexpr"}
        sig |= {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
        ce = {
            "HAS_RES": has_res,
            "CASTING": casting,
            "BLOCK_M": c.block_m,
            "BLOCK_N": c.block,
            "num_warps": nw,
        }
        return [(f"rms_{c.mode}_{tag}_{c.block_m}x{c.block}_w{nw}", fn, sig, ce)]
    if c.mode == "reload":
        if has_res:
            sig = io | {"M": "i32", "N": "i32", "eps": "fp32", "CASTING": "constexpr", "BLOCK": "constexpr"}
            fn = _rms_reload_res_kernel
        else:
            sig = {"x_ptr": px, "w_ptr": pw, "y_ptr": px, "rstd_ptr": "*fp32", "M": "i32", "N": "i32"}
            sig |= {"eps": "fp32", "CASTING": "constexpr", "BLOCK": "constexpr"}
            fn = _rms_reload_kernel
        ce = {"CASTING": casting, "BLOCK": c.block, "num_warps": nw}
        return [(f"rms_reload_{tag}_b{c.block}_w{nw}", fn, sig, ce)]
    if c.mode == "coop":
        sig = io | {
            "part_ptr": "*fp32",
            "cnt_ptr": "*i32",
            "M": "i32",
            "N": "i32",
            "SPLIT": "i32",
            "eps": "fp32",
        }
        sig |= {"HAS_RES": "constexpr", "CASTING": "constexpr", "BLOCK": "constexpr", "BLOCK_S": "constexpr"}
        ce = {
            "HAS_RES": has_res,
            "CASTING": casting,
            "BLOCK": c.block,
            "BLOCK_S": COOP_SPLIT_MAX,
            "num_warps": nw,
        }
        return [(f"rms_coop_{tag}_b{c.block}_w{nw}", _rms_coop_kernel, sig, ce)]
    sig = {"x_ptr": px, "r_ptr": px, "h_ptr": px, "part_ptr": "*fp32", "N": "i32", "SPLIT": "i32"}
    sig |= {"CHUNK": "i32", "HAS_RES": "constexpr", "BLOCK": "constexpr"}
    ce = {"HAS_RES": has_res, "BLOCK": c.block, "num_warps": nw}
    todo = [(f"rms_partial_{dt}{'_res' if has_res else ''}_b{c.block}_w{nw}", _rms_partial_kernel, sig, ce)]
    sig = {"x_ptr": px, "w_ptr": pw, "y_ptr": px, "rstd_ptr": "*fp32", "part_ptr": "*fp32", "N": "i32"}
    sig |= {"SPLIT": "i32", "CHUNK": "i32", "eps": "fp32"}
    sig |= {"CASTING": "constexpr", "BLOCK": "constexpr", "BLOCK_S": "constexpr"}
    ce = {"CASTING": casting, "BLOCK": c.block, "BLOCK_S": SPLIT_MAX, "num_warps": nw}
    todo.append((f"rms_split_norm_{dt}_w{wt}{['', '_llama', '_gemma'][casting]}_b{c.block}_w{nw}",
                 _rms_split_norm_kernel, sig, ce))  # fmt: skip
    return todo


def aot_specs() -> list[tuple]:
    """Forward: per dtype (bf16: every AOT_NS; fp16/fp32: n = 4096 and 65536) the heuristic and tuned
    configs, plain (weight in x's dtype, no residual, "fp32") and heaviest (fp32 weight + residual); the
    llama/gemma castings at the heuristic config. Backward: `_norm_bwd.aot_specs` (rms variants)."""
    specs: list[tuple] = []
    for dt in ("bf16", "fp16", "fp32"):
        es = 4 if dt == "fp32" else 2
        for n in AOT_NS if dt == "bf16" else (4096, 65536):
            for c in aot_configs(n, es):
                specs += _fwd_specs(dt, dt, False, 0, c)
            res_cfgs = aot_configs(n, es, res=True)
            heuristic = [c for i, c in enumerate(res_cfgs) if i == 0 or c.mode == "split"]
            for c in res_cfgs if dt == "bf16" and n in AOT_RES_NS else heuristic:
                specs += _fwd_specs(dt, "fp32" if dt != "fp32" else dt, True, 0, c)
            if dt == "bf16" and n in AOT_CAST_NS:
                for c in heuristic:
                    specs += _fwd_specs(dt, "fp32", True, 1, c) + _fwd_specs(dt, dt, False, 2, c)
    specs += _norm_bwd.aot_specs(is_rms=True)
    return norm_aot_specs(specs)
