"""Backward of the SwiGLU feed-forward block (kernels_triton/swiglu_ffn.py's `backward`).

    backward(dx, dw_gate, dw_up, dw_down, dnorm_weight?, dy, x, w_gate, w_up, w_down, norm_weight?, rstd?, gu, eps)

Saved by the forward (training call): x, the three weights, norm_weight, rstd [T] fp32 (with a norm) and
gu [T, 2F] = [round_x(g), round_x(u)] (pre-activation, x's dtype). Recomputed here: xn = round_x(x * rstd *
norm_weight) (or x) and h = round_x(silu(g) * u) from the saved, rounded g and u. Nothing else is stored.

Steps (T tokens, D model dim, F hidden dim; all GEMMs are torch.matmul into preallocated buffers, i.e.
cuBLAS/hipBLASLt on the GPU, as Liger-Kernel's MLP does; everything element-wise is a Triton kernel):
  1. dh = dy @ W_down                         [T, F]   GEMM, 2*T*D*F FLOPs
  2. `_swiglu_bwd_kernel`: reads dh, gu; writes dg = round(dh * u * silu'(g)), du = round(dh * silu(g)),
     h = round(silu(g) * u)                 (silu'(g) = sig(g) (1 + g (1 - sig(g))))
  3. dW_down = dy^T @ h                        [D, F]   GEMM, 2*T*D*F
  4. with a norm, `_xn_kernel`: xn = round(x * rstd * norm_weight)   [T, D]
  5. dW_gate = dg^T @ xn, dW_up = du^T @ xn    [F, D]   GEMMs, 2 x 2*T*D*F
  6. dxn = dg @ W_gate + du @ W_up             [T, D]   GEMM + accumulating GEMM (addmm_), 4*T*D*F;
     written straight into dx without a norm
  7. with a norm, `_norm_bwd_kernel`: dx = rstd * (gw - xhat * mean(gw * xhat)), gw = dxn * nw,
     xhat = x * rstd, and per-program fp32 partials of dnorm_weight = sum_rows dxn * xhat; `_col_sum_kernel`
     adds the [P, D] partials in a fixed order (deterministic, no atomics) into dnorm_weight (w dtype).
     Rows longer than _NORM_ONE_CHUNK_MAX first get mean(gw * xhat) from `_norm_dot_kernel` and are then
     processed in column chunks (grid rows x chunks).
Floors: 12*T*D*F FLOPs (T=4096, D=4096, F=14336: 2.89 PFLOP -> ~3.7 ms at 790 TFLOP/s); element-wise bytes
6*T*F (step 2: read dh, g, u, write dg, du, h) + 2*T*D (xn) + 4*T*D (x, dxn in, dx out) elements, noise
next to the GEMMs (0.2 ms at that size).
Measured (H200, bf16, T=4096, D=4096, no norm, torch 2.11 / triton 3.6): 3.43 ms at F=11008, 4.36 ms at
F=14336 (12*T*D*F at 650-670 TFLOP/s end to end); each GEMM 660-770 TFLOP/s (writing the weight gradients
through transposed views, out=dw.t(), was no faster); `_swiglu_bwd_kernel` 137 / 176 us = 4.0 TB/s (tiles of
8192 or 16384 elements were 3-20% slower).
Rounding: dh, dg, du, h, xn and dxn are stored in x's dtype (the GEMMs round their outputs), so a bf16 call
stacks a few bf16 roundings; the contract's gradient tolerance (2x the forward's) covers them. fp32 GEMMs
follow torch's matmul precision setting (full fp32 by default; `torch.backends.cuda.matmul.allow_tf32`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_triton._config import device_index, next_pow2, num_sms, on_device, warps_for
from kernels_triton._launch import fast_launch


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _tile_rows_cols(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program p of a flat grid over [BLOCK_M, BLOCK_N] tiles (no 65535 limit of grid axis 1)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    rows = (pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, (rows < M)[:, None] & (cols < N)[None, :]


@fast_launch
@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr, gu_ptr, h_ptr, dg_ptr, du_ptr, T, F, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr
):  # fmt: skip
    """From dh [T, F] and gu [T, 2F]: h = silu(g) u, dg = dh u silu'(g), du = dh silu(g), each rounded once."""
    rows, cols, mask = _tile_rows_cols(T, F, BLOCK_T, BLOCK_F)
    r64 = rows.to(tl.int64)[:, None]
    off = r64 * F + cols[None, :]
    g_ptrs = gu_ptr + r64 * (2 * F) + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    u = tl.load(g_ptrs + F, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    dh = tl.load(dh_ptr + off, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    tl.store(h_ptr + off, (silu * u).to(h_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + off, (dh * u * (sig * (1.0 + g * (1.0 - sig)))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + off, (dh * silu).to(du_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _xn_kernel(x_ptr, nw_ptr, rstd_ptr, xn_ptr, T, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """xn = round(x * rstd * nw) from the saved rstd (the forward's "fp32" casting, same operation order)."""
    rows, cols, mask = _tile_rows_cols(T, D, BLOCK_T, BLOCK_D)
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rstd_ptr + rows, mask=rows < T, other=0.0)
    w = tl.load(nw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(xn_ptr + off, ((x * r[:, None]) * w[None, :]).to(xn_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _norm_dot_kernel(dxn_ptr, x_ptr, nw_ptr, rstd_ptr, c_ptr, D, BLOCK: tl.constexpr):
    """Long rows only: c[row] = mean(dxn * nw * x * rstd) (fp32), one program per row, D in BLOCK chunks."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * D
    r = tl.load(rstd_ptr + row)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, D, BLOCK):
        m = k + offs < D
        g = tl.load(dxn_ptr + base + k + offs, mask=m, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + base + k + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + k + offs, mask=m, other=0.0).to(tl.float32)
        acc += g * w * (x * r)
    tl.store(c_ptr + row, tl.sum(acc, axis=0) / D)


@fast_launch
@triton.jit
def _norm_bwd_kernel(
    dxn_ptr, x_ptr, nw_ptr, rstd_ptr, c_ptr, dx_ptr, part_ptr, T, D,
    BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    """RMSNorm backward through xn = x * rstd * nw, for column chunk program_id(1) of rows program_id(0),
    program_id(0) + P, ... (P = programs on axis 0): dx = rstd * (gw - xhat * c), gw = dxn * nw, xhat = x *
    rstd, c = mean(gw * xhat) over the whole row (computed here when ONE_CHUNK, i.e. BLOCK_D covers D; else
    read from c_ptr); part[p, cols] = sum over the program's rows of dxn * xhat, in row order (fp32)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, tl.cdiv(T - pid, P)):
        row = pid + i * P  # rows pid, pid + P, ... (a tensor in the interpreter too, unlike range's ints)
        off = row.to(tl.int64) * D + cols
        g = tl.load(dxn_ptr + off, mask=cmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x = tl.load(x_ptr + off, mask=cmask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        r = tl.load(rstd_ptr + row)
        xhat = x * r
        gw = g * w
        if ONE_CHUNK:
            c = tl.sum(gw * xhat, axis=0) / D
        else:
            c = tl.load(c_ptr + row)
        tl.store(dx_ptr + off, (r * (gw - xhat * c)).to(dx_ptr.dtype.element_ty), mask=cmask)
        acc += g * xhat
    tl.store(part_ptr + pid.to(tl.int64) * D + cols, acc, mask=cmask)


@fast_launch
@triton.jit
def _col_sum_kernel(part_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[cols] = sum_p part[p, cols] (fp32, then out's dtype), always in the same order: deterministic."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    ps = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for k in range(0, P, BLOCK_P):
        m = ((k + ps) < P)[:, None] & cmask[None, :]
        acc += tl.load(part_ptr + (k + ps).to(tl.int64)[:, None] * D + cols[None, :], mask=m, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------------
# Element-wise tiles: 4096 elements (8 KB of bf16 per tensor; step 2 moves 6 tensors, 48 KB per program),
# each thread 2 x 16-byte vectors. Rows of up to 1024 columns, the rest of the tile in rows.
_EW_TILE = 4096
_EW_MAX_COLS = 1024
# A row of up to 8192 columns sits in registers (fp32 x, dxn, nw, dx, partials: ~5 x 8192 / 256 threads
# = 160 values per thread at 8 warps; 16 warps for 8192); longer rows go through the chunked path.
_NORM_ONE_CHUNK_MAX = 8192
_NORM_CHUNK = 2048  # columns per program of the chunked path (and BLOCK of `_norm_dot_kernel`)
_NORM_PROGS_PER_SM = 2  # persistent row programs: 2 x 132 on an H200 -> [264, D] fp32 partials (4 MB at 4096)
_COL_BLOCK_P, _COL_BLOCK_D = 16, 256


def _ew_tile(M: int, N: int, elsize: int, dev: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the element-wise kernels."""
    block_n = min(next_pow2(N), _EW_MAX_COLS)
    block_m = max(1, min(_EW_TILE // block_n, next_pow2(M)))
    return block_m, block_n, warps_for(block_m * block_n, 2 * 16 // elsize, dev, lo=1, hi=8)


def _norm_tile(D: int, elsize: int, dev: int, block_d: int | None) -> tuple[int, int]:
    """(BLOCK_D, num_warps) of `_norm_bwd_kernel`; BLOCK_D >= D means one chunk per row."""
    bd = block_d or (next_pow2(D) if next_pow2(D) <= _NORM_ONE_CHUNK_MAX else _NORM_CHUNK)
    return bd, warps_for(bd, 2 * 16 // elsize, dev, lo=4, hi=16)


def _norm_programs(T: int, chunks: int, dev: int) -> int:
    return max(1, min(T, triton.cdiv(_NORM_PROGS_PER_SM * num_sms(dev), chunks)))


def _ew_grid(M: int, N: int, bm: int, bn: int) -> tuple[int]:
    return (triton.cdiv(M, bm) * triton.cdiv(N, bn),)


# ----------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------
def backward(
    dx: torch.Tensor,
    dw_gate: torch.Tensor,
    dw_up: torch.Tensor,
    dw_down: torch.Tensor,
    dnorm_weight: torch.Tensor | None,
    dy: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    norm_weight: torch.Tensor | None,
    rstd: torch.Tensor | None,
    gu: torch.Tensor,
    eps: float,
    *,
    _norm_block_d: int | None = None,
) -> None:
    """Gradients of swiglu_ffn (see the module docstring): writes dx [T, D], dw_gate/dw_up [F, D], dw_down
    [D, F] (x's dtype) and, with norm_weight, dnorm_weight [D] (its dtype). `eps` is not needed (rstd is
    saved). `_norm_block_d` forces the norm kernel's column chunk (tests of the chunked path)."""
    del eps
    T, D = x.shape
    F = w_gate.shape[0]
    has_norm = norm_weight is not None
    if has_norm and (rstd is None or dnorm_weight is None):
        raise ValueError("swiglu_ffn backward with norm_weight needs rstd and dnorm_weight")
    dev = device_index(x)
    es = x.element_size()
    with on_device(x):
        dh = torch.empty((T, F), device=x.device, dtype=x.dtype)
        torch.matmul(dy, w_down, out=dh)  # 1
        h, dg, du = (torch.empty_like(dh) for _ in range(3))
        bm, bn, nw = _ew_tile(T, F, es, dev)
        _swiglu_bwd_kernel[_ew_grid(T, F, bm, bn)](
            dh, gu, h, dg, du, T, F, BLOCK_T=bm, BLOCK_F=bn, num_warps=nw
        )
        del dh
        torch.matmul(dy.t(), h, out=dw_down)  # 3
        del h
        xn = x
        if has_norm:  # 4
            xn = torch.empty_like(x)
            bm, bn, nw = _ew_tile(T, D, es, dev)
            _xn_kernel[_ew_grid(T, D, bm, bn)](
                x, norm_weight, rstd, xn, T, D, BLOCK_T=bm, BLOCK_D=bn, num_warps=nw
            )
        torch.matmul(dg.t(), xn, out=dw_gate)  # 5
        torch.matmul(du.t(), xn, out=dw_up)
        del xn
        dxn = torch.empty_like(x) if has_norm else dx
        torch.matmul(dg, w_gate, out=dxn)  # 6
        dxn.addmm_(du, w_up)
        del dg, du
        if not has_norm:
            return
        bd, nw = _norm_tile(D, es, dev, _norm_block_d)  # 7
        chunks = triton.cdiv(D, bd)
        one = chunks == 1
        c = rstd  # a dummy the one-chunk kernel never reads
        if not one:
            c = torch.empty((T,), device=x.device, dtype=torch.float32)
            _norm_dot_kernel[(T,)](dxn, x, norm_weight, rstd, c, D, BLOCK=min(bd, _NORM_CHUNK), num_warps=nw)
        P = _norm_programs(T, chunks, dev)
        part = torch.empty((P, D), device=x.device, dtype=torch.float32)
        _norm_bwd_kernel[(P, chunks)](
            dxn, x, norm_weight, rstd, c, dx, part, T, D, BLOCK_D=bd, ONE_CHUNK=one, num_warps=nw
        )
        _col_sum_kernel[(triton.cdiv(D, _COL_BLOCK_D),)](
            part, dnorm_weight, P, D, BLOCK_P=_COL_BLOCK_P, BLOCK_D=_COL_BLOCK_D, num_warps=4
        )


# ----------------------------------------------------------------------------------------------------
# ahead-of-time specs
# ----------------------------------------------------------------------------------------------------
_ES = {"fp16": 2, "bf16": 2, "fp32": 4}


def aot_specs() -> list[tuple[str, object, dict, dict, dict]]:
    """The backward's element-wise kernels for fp16/bf16 x at Llama-style sizes (F, D multiples of 1024);
    other combinations (fp32, other row lengths) are served by the JIT."""
    specs: list[tuple[str, object, dict, dict, dict]] = []
    for dt in ("fp16", "bf16"):
        p, es = f"*{dt}", _ES[dt]
        # bf16 (how models train): norm weights bf16 or fp32, rows of 4096 and 8192 in registers, a chunked
        # long row; fp16: its own-dtype weight at 4096 only
        weights = (dt, "fp32") if dt == "bf16" else (dt,)
        bm, bn, nw = _ew_tile(1 << 16, 1 << 14, es, 0)
        sig = {"dh_ptr": p, "gu_ptr": p, "h_ptr": p, "dg_ptr": p, "du_ptr": p, "T": "i32", "F": "i32"}
        sig |= {"BLOCK_T": "constexpr", "BLOCK_F": "constexpr"}
        specs.append(
            (
                f"ffn_bwd_swiglu_{dt}",
                _swiglu_bwd_kernel,
                sig,
                {"BLOCK_T": bm, "BLOCK_F": bn},
                {"num_warps": nw},
            )
        )
        for wt in weights:
            q = f"*{wt}"
            sig = {"x_ptr": p, "nw_ptr": q, "rstd_ptr": "*fp32", "xn_ptr": p, "T": "i32", "D": "i32"}
            sig |= {"BLOCK_T": "constexpr", "BLOCK_D": "constexpr"}
            specs.append(
                (f"ffn_bwd_xn_{dt}_w{wt}", _xn_kernel, sig, {"BLOCK_T": bm, "BLOCK_D": bn}, {"num_warps": nw})
            )
            for d in ((4096, 8192, 1 << 14) if wt == dt else (4096, 8192)) if dt == "bf16" else (4096,):
                bd, nwn = _norm_tile(d, es, 0, None)
                one = bd >= d
                sig = {"dxn_ptr": p, "x_ptr": p, "nw_ptr": q, "rstd_ptr": "*fp32", "c_ptr": "*fp32", "dx_ptr": p,
                       "part_ptr": "*fp32", "T": "i32", "D": "i32", "BLOCK_D": "constexpr", "ONE_CHUNK": "constexpr"}  # fmt: skip
                specs.append((f"ffn_bwd_norm_{dt}_w{wt}_{bd}{'' if one else 'chunk'}", _norm_bwd_kernel, sig,
                              {"BLOCK_D": bd, "ONE_CHUNK": one}, {"num_warps": nwn}))  # fmt: skip
                if not one:
                    sig = {"dxn_ptr": p, "x_ptr": p, "nw_ptr": q, "rstd_ptr": "*fp32", "c_ptr": "*fp32",
                           "D": "i32", "BLOCK": "constexpr"}  # fmt: skip
                    specs.append((f"ffn_bwd_norm_dot_{dt}_w{wt}", _norm_dot_kernel, sig, {"BLOCK": _NORM_CHUNK},
                                  {"num_warps": nwn}))  # fmt: skip
    for wt in ("fp16", "bf16", "fp32"):
        sig = {"part_ptr": "*fp32", "out_ptr": f"*{wt}", "P": "i32", "D": "i32"}
        sig |= {"BLOCK_P": "constexpr", "BLOCK_D": "constexpr"}
        const = {"BLOCK_P": _COL_BLOCK_P, "BLOCK_D": _COL_BLOCK_D}
        specs.append((f"ffn_bwd_colsum_{wt}", _col_sum_kernel, sig, const, {"num_warps": 4}))
    return specs
