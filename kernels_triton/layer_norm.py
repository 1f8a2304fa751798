"""LayerNorm: out = (x - mean) * rstd * w (+ b), biased variance, fp32 math, one cast; mean/rstd[M] fp32.

Byte floor: read x once, write out once (+ 2N weights/bias, 2M statistics), 2 x M x N x elsize:
32768 x 8192 bf16 = 1.07 GB -> 251 us at the H200's measured 4274 GB/s copy rate; 16384 x 65536 bf16 =
4.29 GB -> 1004 us. The modes ("reg", "rows", "reload", "split") are shaped exactly as in rms_norm.py (the
table is in kernels_triton/_config.py); large problems pick among them by timing (`norm_tuned`).

Statistics: "reg"/"rows" hold the row and do the exact two-pass (mean, then mean of squared deviations), as
the reference. "reload"/"split" stream the row once for the statistics, using sums of d = x - K with the
shift K = x[row, 0]: var = E[d^2] - E[d]^2 loses almost nothing because K lies within a few standard
deviations of the mean, so rows with a large mean (1e4 +- 1) stay accurate, unlike raw E[x^2] - E[x]^2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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

# Heuristic (untuned) step of "reload"/"split": 16 KB of x, 2 x 16-byte vectors per thread (16 warps on
# NVIDIA); the two fp32 accumulators per element made wider steps slower than for rms_norm in the old
# one-row-per-program kernel (H200, 16384 x 65536 bf16). Tuned runs choose from NORM_RELOAD_SET instead.
STREAM_BYTES, STREAM_VECS = 16384, 2
SPLIT_MAX = 1024  # chunks per row in "split"; kernel 2 reads all partials of a row in one [SPLIT_MAX] load


@triton.jit
def _ln_reg_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, M, N, eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(m, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_rows_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, M, N, eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    for t in range(pid, tl.cdiv(M, BLOCK_M), G):
        rows = t * BLOCK_M + r
        rmask = rows < M
        m = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = xn.to(tl.float32)
        nrows = rows + G * BLOCK_M
        xn = load_row_tile(x_ptr, nrows, cols, M, N)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(m, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(mean_ptr + rows, mean, mask=rmask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _ln_normalize(
    x_ptr, w_ptr, b_ptr, out_ptr, base, wbase, n, shift, md, rstd, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    # Streams x[base : base + n] (usually from L2, last use: evict_first) into out (never re-read here:
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
        tl.store(out_ptr + base + c, y.to(out_ptr.dtype.element_ty), mask=cm, eviction_policy="evict_first")


@triton.jit
def _ln_shifted_sums(x_ptr, base, n, shift, BLOCK: tl.constexpr):
    # (sum d, sum d^2) over x[base : base + n] with d = x - shift, fp32 per-lane accumulators.
    cols = tl.arange(0, BLOCK)
    s1 = tl.zeros((BLOCK,), dtype=tl.float32)
    s2 = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, n, BLOCK):
        c = k + cols
        cm = c < n
        # evict_last: the normalize kernel re-reads this chunk (from L2 when x fits there).
        xv = tl.load(x_ptr + base + c, mask=cm, other=0.0, eviction_policy="evict_last").to(tl.float32)
        d = tl.where(cm, xv - shift, 0.0)
        s1 += d
        s2 += d * d
    return tl.sum(s1, axis=0), tl.sum(s2, axis=0)


@triton.jit
def _ln_reload_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, M, N, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
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
        md = tl.sum(s1, axis=0) / N
        mean = shift + md
        rstd = tl.rsqrt(tl.maximum(tl.sum(s2, axis=0) / N - md * md, 0.0) + eps)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
        nxt = row + G
        n_nxt = tl.where(nxt < M, N, 0)  # elements of the next row to load: none past the last row
        nbase = tl.minimum(nxt, M - 1).to(tl.int64) * N
        xn = tl.load(x_ptr + nbase + cols, mask=cols < n_nxt, other=0.0, eviction_policy="evict_last")
        shift_n = tl.load(x_ptr + nbase).to(tl.float32)
        _ln_normalize(x_ptr, w_ptr, b_ptr, out_ptr, base, 0, N, shift, md, rstd, HAS_BIAS, BLOCK)


@triton.jit
def _ln_partial_kernel(x_ptr, part_ptr, N, SPLIT, CHUNK, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // SPLIT
    start = (pid % SPLIT).to(tl.int64) * CHUNK
    rbase = row.to(tl.int64) * N
    shift = tl.load(x_ptr + rbase).to(tl.float32)  # the same K for every chunk of the row
    s1, s2 = _ln_shifted_sums(x_ptr, rbase + start, tl.minimum(N - start, CHUNK), shift, BLOCK)
    tl.store(part_ptr + 2 * pid, s1)
    tl.store(part_ptr + 2 * pid + 1, s2)


@triton.jit
def _ln_split_norm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, mean_ptr, rstd_ptr, part_ptr, N, SPLIT, CHUNK, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row = pid // SPLIT
    part = pid % SPLIT
    rbase = row.to(tl.int64) * N
    shift = tl.load(x_ptr + rbase).to(tl.float32)
    s = tl.arange(0, BLOCK_S)
    sm = s < SPLIT
    # Fixed-order combine: every chunk of the row derives bitwise the same mean/rstd.
    s1 = tl.sum(tl.load(part_ptr + 2 * (row * SPLIT + s), mask=sm, other=0.0), axis=0)
    s2 = tl.sum(tl.load(part_ptr + 2 * (row * SPLIT + s) + 1, mask=sm, other=0.0), axis=0)
    md = s1 / N
    mean = shift + md
    rstd = tl.rsqrt(tl.maximum(s2 / N - md * md, 0.0) + eps)
    if part == 0:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    start = part.to(tl.int64) * CHUNK
    n = tl.minimum(N - start, CHUNK)
    _ln_normalize(x_ptr, w_ptr, b_ptr, out_ptr, rbase + start, start, n, shift, md, rstd, HAS_BIAS, BLOCK)


def _launch(cfg: NormConfig, out, mean, rstd, x, weight, bias, eps: float) -> None:
    M, N = x.shape
    dev = device_index(x)
    has_bias = bias is not None
    b = bias if has_bias else weight  # never read when HAS_BIAS is False
    grid = (norm_grid(cfg, M, dev),)
    if cfg.mode in ("reg", "rows"):
        fn = _ln_reg_kernel if cfg.mode == "reg" else _ln_rows_kernel
        fn[grid](
            x, weight, b, out, mean, rstd, M, N, eps,
            HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block, num_warps=cfg.num_warps,
        )  # fmt: skip
    elif cfg.mode == "reload":
        _ln_reload_kernel[grid](
            x,
            weight,
            b,
            out,
            mean,
            rstd,
            M,
            N,
            eps,
            HAS_BIAS=has_bias,
            BLOCK=cfg.block,
            num_warps=cfg.num_warps,
        )
    else:
        split, chunk = split_chunks(N, cfg.split, cfg.block, SPLIT_MAX)
        part = torch.empty((M, split, 2), dtype=torch.float32, device=x.device)
        grid = (M * split,)
        _ln_partial_kernel[grid](x, part, N, split, chunk, BLOCK=cfg.block, num_warps=cfg.num_warps)
        _ln_split_norm_kernel[grid](
            x, weight, b, out, mean, rstd, part, N, split, chunk, eps,
            HAS_BIAS=has_bias, BLOCK=cfg.block, BLOCK_S=SPLIT_MAX, num_warps=cfg.num_warps,
        )  # fmt: skip


def _reference(
    xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 torch LayerNorm of rows `xs` (fp32): (out, mean, rstd), the tuner's correctness check."""
    out = F.layer_norm(xs, (xs.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    mean = xs.mean(-1)
    rstd = torch.rsqrt((xs - mean[:, None]).square().mean(-1) + eps)
    return out, mean, rstd


def layer_norm(
    out: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    x: torch.Tensor,
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
    """out[M, N], mean[M], rstd[M] <- LayerNorm(x[M, N]) with weight[N], bias[N] | None."""
    force = dict(mode=_mode, split=_split, block=_block, num_warps=_num_warps, block_m=_block_m, progs=_progs)
    cfg = norm_select(
        ("layer_norm", x.shape[1], x.dtype, bias is not None),
        x,
        (STREAM_BYTES, STREAM_VECS),
        force,
        lambda c: _launch(c, out, mean, rstd, x, weight, bias, eps),
        lambda: norm_check(
            x,
            (out, mean, rstd),
            lambda xs: _reference(xs, weight, bias, eps),
            params=(weight, bias),
            mean_stat=(True, False),
        ),
    )
    _launch(cfg, out, mean, rstd, x, weight, bias, eps)


# ---- ahead-of-time coverage -------------------------------------------------------------------------------
AOT_NS = (128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # bf16 row lengths whose tuned sets compile


def aot_configs(n: int, es: int) -> list[NormConfig]:
    """Every config the launcher can pick for rows of n (see `norm_aot_configs`)."""
    return norm_aot_configs(n, es, (STREAM_BYTES, STREAM_VECS))


def aot_specs() -> list[tuple]:
    """Per dtype (bf16: every AOT_NS; fp16/fp32: n = 4096 and 65536) the heuristic and tuned configs, with
    bias (and, for bf16 n = 4096 / 65536, without)."""
    specs: list[tuple] = []
    seen: set[str] = set()
    for dt in ("bf16", "fp16", "fp32"):
        es = 4 if dt == "fp32" else 2
        p = f"*{dt}"
        io = {"x_ptr": p, "w_ptr": p, "b_ptr": p, "out_ptr": p, "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
        for n in AOT_NS if dt == "bf16" else (4096, 65536):
            for c in aot_configs(n, es):
                tag = f"{dt}_b{c.block}_w{c.num_warps}"
                todo: list[tuple] = []
                for hb in (True, False) if (dt == "bf16" and n in (4096, 65536)) else (True,):
                    bt = "_bias" if hb else ""
                    if c.mode in ("reg", "rows"):
                        fn = _ln_reg_kernel if c.mode == "reg" else _ln_rows_kernel
                        sig = io | {"M": "i32", "N": "i32", "eps": "fp32", "HAS_BIAS": "constexpr"}
                        sig |= {"BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
                        ce = {
                            "HAS_BIAS": hb,
                            "BLOCK_M": c.block_m,
                            "BLOCK_N": c.block,
                            "num_warps": c.num_warps,
                        }
                        todo.append(
                            (f"ln_{c.mode}_{dt}_{c.block_m}x{c.block}_w{c.num_warps}{bt}", fn, sig, ce)
                        )
                    elif c.mode == "reload":
                        sig = io | {"M": "i32", "N": "i32", "eps": "fp32", "HAS_BIAS": "constexpr"}
                        sig |= {"BLOCK": "constexpr"}
                        ce = {"HAS_BIAS": hb, "BLOCK": c.block, "num_warps": c.num_warps}
                        todo.append((f"ln_reload_{tag}{bt}", _ln_reload_kernel, sig, ce))
                    else:
                        sig = io | {"part_ptr": "*fp32", "N": "i32", "SPLIT": "i32", "CHUNK": "i32"}
                        sig |= {
                            "eps": "fp32",
                            "HAS_BIAS": "constexpr",
                            "BLOCK": "constexpr",
                            "BLOCK_S": "constexpr",
                        }
                        ce = {
                            "HAS_BIAS": hb,
                            "BLOCK": c.block,
                            "BLOCK_S": SPLIT_MAX,
                            "num_warps": c.num_warps,
                        }
                        todo.append((f"ln_split_norm_{tag}{bt}", _ln_split_norm_kernel, sig, ce))
                        sig = {"x_ptr": p, "part_ptr": "*fp32", "N": "i32", "SPLIT": "i32", "CHUNK": "i32"}
                        sig |= {"BLOCK": "constexpr"}
                        ce = {"BLOCK": c.block, "num_warps": c.num_warps}
                        todo.append((f"ln_partial_{tag}", _ln_partial_kernel, sig, ce))
                for name, fn, sig, ce in todo:
                    if name not in seen:
                        seen.add(name)
                        specs.append((name, fn, sig, ce, {}, div16_attrs(sig)))
    return specs
