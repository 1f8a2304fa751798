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
