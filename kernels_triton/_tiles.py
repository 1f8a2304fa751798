"""@triton.jit helpers shared by the kernels of several ops."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_row_tile(x_ptr, rows, cols, M, N):
    """x[rows, cols] of a row-major [M, N] tensor, in its own dtype; 0 outside the tensor."""
    return tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
        mask=(rows < M)[:, None] & (cols < N)[None, :],
        other=0.0,
    )


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b in fp32; IEEE keeps fp32 operands fp32 (input_precision="ieee", no tf32)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def rsqrt_full_range(v):
    """1 / sqrt(v) for every fp32 v >= 0. On NVIDIA tl.rsqrt (and 1 / tl.sqrt) is rsqrt.approx.ftz, which reads
    v < 2^-126 as 0: with eps 0 (or a subnormal eps) a row whose mean square is ~1e-40 got rstd inf and y inf /
    NaN. Such v is scaled by 2^64 (exact) and the root by 2^32; a select per row, the fast rsqrt kept."""
    tiny = v < 1.1754943508222875e-38
    r = tl.rsqrt(tl.where(tiny, v * 18446744073709551616.0, v))
    return tl.where(tiny, r * 4294967296.0, r)
