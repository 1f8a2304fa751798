"""RMSNorm: out = x * rsqrt(mean(x^2) + eps) * w (fp32 math, one cast), rstd[M] fp32.

Byte floor: read x once, write out once (+ N weights, M rstd), 2 x M x N x elsize: 32768 x 8192 bf16 =
1.07 GB -> 251 us at the H200's measured 4274 GB/s copy rate; 16384 x 65536 bf16 = 4.29 GB -> 1004 us.
Arithmetic is negligible, so the shape of every mode follows from keeping ~26 KB of x in flight per SM
(see the table in kernels_triton/_config.py):
- "reg" (N <= 16384): a tile of rows in registers, one program per tile; one HBM read of x.
- "rows": the same tile, persistent programs that load the next tile before storing this one.
- "reload" (any N, the only choice past 16384): persistent programs, one row at a time, two passes (the
  second from L2), loads one step ahead and across rows; progs x SMs rows in flight fit the L2.
- "split" (M < 2 x SMs, N > 16384): two kernels, per-chunk partial sums then normalize.
Large problems pick among these by timing (`norm_tuned`); the interpreter and small ones by heuristic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._config import (
    NormConfig,
    device_index,
    div16_attrs,
    norm_aot_configs,
    norm_check,
    norm_grid,
    norm_select,
    split_chunks,
)
from kernels_triton._tiles import load_row_tile

# Heuristic (untuned) step of "reload": 32 KB of x, 4 x 16-byte vectors per thread (16 warps on NVIDIA);
# with one program of one row per SM it is the old one-row-per-program kernel's best step (H200, 16384 x
# 65536 bf16, before persistence: 32 KB / 16 warps beat 16 KB / 16, 8 KB / 8 and 32 KB / 32 warps).
# "split" caps it at 16 KB / 2 vectors. Tuned runs choose from NORM_RELOAD_SET instead.
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
def _rms_rows_kernel(
    x_ptr, w_ptr, out_ptr, rstd_ptr, M, N, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    # Persistent "reg": program p takes row tiles p, p + G, ...; the next tile is loaded (still bf16/fp16:
    # half the registers of its fp32 copy) before this tile is reduced and stored.
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    r = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows = pid * BLOCK_M + r
    xn = load_row_tile(x_ptr, rows, cols, M, N)
    for t in range(pid, tl.cdiv(M, BLOCK_M), G):
        rows = t * BLOCK_M + r
        rmask = rows < M
        m = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = xn.to(tl.float32)
        nrows = rows + G * BLOCK_M
        xn = load_row_tile(x_ptr, nrows, cols, M, N)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (x * rstd[:, None] * w[None, :]).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_reload_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, M, N, eps, BLOCK: tl.constexpr):
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
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        tl.store(rstd_ptr + row, rstd)
        nxt = row + G
        n_nxt = tl.where(nxt < M, N, 0)  # elements of the next row to load: none past the last row
        nbase = nxt.to(tl.int64) * N
        xa = tl.load(x_ptr + nbase + cols, mask=cols < n_nxt, other=0.0, eviction_policy="evict_last")
        xb = tl.load(
            x_ptr + nbase + BLOCK + cols, mask=BLOCK + cols < n_nxt, other=0.0, eviction_policy="evict_last"
        )
        # Pass 2 re-reads the row from L2 (last use: evict_first); out is never re-read (evict_first too,
        # so its dirty lines go before the x lines pass 2 still needs).
        for k in range(0, N, BLOCK):
            c = k + cols
            cm = c < N
            x = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w = tl.load(w_ptr + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
            y = (x * rstd * w).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + base + c, y, mask=cm, eviction_policy="evict_first")


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


def _launch(cfg: NormConfig, out, rstd, x, weight, eps: float) -> None:
    M, N = x.shape
    dev = device_index(x)
    grid = (norm_grid(cfg, M, dev),)
    if cfg.mode == "reg":
        _rms_reg_kernel[grid](
            x, weight, out, rstd, M, N, eps, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block, num_warps=cfg.num_warps
        )
    elif cfg.mode == "rows":
        _rms_rows_kernel[grid](
            x, weight, out, rstd, M, N, eps, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block, num_warps=cfg.num_warps
        )
    elif cfg.mode == "reload":
        _rms_reload_kernel[grid](x, weight, out, rstd, M, N, eps, BLOCK=cfg.block, num_warps=cfg.num_warps)
    else:
        split, chunk = split_chunks(N, cfg.split, cfg.block, SPLIT_MAX)
        part = torch.empty((M, split), dtype=torch.float32, device=x.device)
        grid = (M * split,)
        _rms_partial_kernel[grid](x, part, N, split, chunk, BLOCK=cfg.block, num_warps=cfg.num_warps)
        _rms_split_norm_kernel[grid](
            x, weight, out, rstd, part, N, split, chunk, eps, BLOCK=cfg.block,
            BLOCK_S=SPLIT_MAX, num_warps=cfg.num_warps,
        )  # fmt: skip


def _reference(xs: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch RMSNorm of rows `xs` (fp32): (out, rstd), the tuner's correctness check."""
    rstd = torch.rsqrt(xs.square().mean(-1) + eps)
    return xs * rstd[:, None] * weight.float(), rstd


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
    _progs: int | None = None,
) -> None:
    """out[M, N], rstd[M] <- RMSNorm(x[M, N]) * weight[N]. Private `_mode`/... force a config (tests)."""
    force = dict(mode=_mode, split=_split, block=_block, num_warps=_num_warps, block_m=_block_m, progs=_progs)
    cfg = norm_select(
        ("rms_norm", x.shape[1], x.dtype),
        x,
        (STREAM_BYTES, STREAM_VECS),
        force,
        lambda c: _launch(c, out, rstd, x, weight, eps),
        lambda: norm_check(x, (out, rstd), lambda xs: _reference(xs, weight, eps), params=(weight,)),
    )
    _launch(cfg, out, rstd, x, weight, eps)


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
AOT_NS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # bf16 row lengths whose tuned sets compile


def aot_configs(n: int, es: int) -> list[NormConfig]:
    """Every config the launcher can pick for rows of n (see `norm_aot_configs`)."""
    return norm_aot_configs(n, es, (STREAM_BYTES, STREAM_VECS))


def aot_specs() -> list[tuple]:
    """Per dtype (bf16: every AOT_NS; fp16/fp32: n = 4096 and 65536) the heuristic and tuned configs."""
    specs: list[tuple] = []
    seen: set[tuple] = set()
    for dt in ("bf16", "fp16", "fp32"):
        es = 4 if dt == "fp32" else 2
        ptr = f"*{dt}"
        io = {"x_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "rstd_ptr": "*fp32"}
        for n in AOT_NS if dt == "bf16" else (4096, 65536):
            for c in aot_configs(n, es):
                if c.mode in ("reg", "rows"):
                    fn = _rms_reg_kernel if c.mode == "reg" else _rms_rows_kernel
                    sig = io | {
                        "M": "i32",
                        "N": "i32",
                        "eps": "fp32",
                        "BLOCK_M": "constexpr",
                        "BLOCK_N": "constexpr",
                    }
                    ce = {"BLOCK_M": c.block_m, "BLOCK_N": c.block, "num_warps": c.num_warps}
                    todo = [(f"rms_{c.mode}_{dt}_{c.block_m}x{c.block}_w{c.num_warps}", fn, sig, ce)]
                elif c.mode == "reload":
                    sig = io | {"M": "i32", "N": "i32", "eps": "fp32", "BLOCK": "constexpr"}
                    ce = {"BLOCK": c.block, "num_warps": c.num_warps}
                    todo = [(f"rms_reload_{dt}_b{c.block}_w{c.num_warps}", _rms_reload_kernel, sig, ce)]
                else:
                    ce = {"BLOCK": c.block, "num_warps": c.num_warps}
                    sig = {"x_ptr": ptr, "part_ptr": "*fp32", "N": "i32", "SPLIT": "i32", "CHUNK": "i32"}
                    sig |= {"BLOCK": "constexpr"}
                    todo = [(f"rms_partial_{dt}_b{c.block}_w{c.num_warps}", _rms_partial_kernel, sig, ce)]
                    sig = io | {
                        "part_ptr": "*fp32",
                        "N": "i32",
                        "SPLIT": "i32",
                        "CHUNK": "i32",
                        "eps": "fp32",
                    }
                    sig |= {"BLOCK": "constexpr", "BLOCK_S": "constexpr"}
                    ce = ce | {"BLOCK_S": SPLIT_MAX}
                    todo.append(
                        (f"rms_split_norm_{dt}_b{c.block}_w{c.num_warps}", _rms_split_norm_kernel, sig, ce)
                    )
                for name, fn, sig, ce in todo:
                    if name not in seen:
                        seen.add(name)
                        specs.append((name, fn, sig, ce, {}, div16_attrs(sig)))
    return specs
