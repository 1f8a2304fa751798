"""bf16 in a Triton kernel as on a GPU: fp32 -> bf16 rounds to nearest even, as torch does (compiled cvt.rn;
on the CPU through kernels_triton/_interpreter.py's correction of the interpreter, which truncates on its own),
and a bf16 tl.dot accumulates exact products in fp32 (the interpreter's own multiplies the bit patterns).

    pytest tests/test_triton_bf16_rounding.py                 # CPU: Triton's interpreter (conftest sets it)
    pytest tests/test_triton_bf16_rounding.py --device cuda   # GPU: the compiled kernel

Bitwise against torch's `.to(torch.bfloat16)`: random values, exact ties (to even, both ways), values one
bit either side of a tie, the overflow edge (rounds to inf), subnormals, +-0, +-inf and NaN (stays NaN).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kernels_triton._config import is_interpreter
from kernels_triton._interpreter import fp32_to_bf16_bits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

if importlib.util.find_spec("triton") is not None:  # after conftest set TRITON_INTERPRET on the CPU
    import triton
    import triton.language as tl

    @triton.jit
    def _to_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(y_ptr + offs, x.to(tl.bfloat16), mask=m)  # the implicit conversion every kernel uses

    @triton.jit
    def _store_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)  # fp32 into a bf16 pointer

    @triton.jit
    def _dot_kernel(
        a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, OUT_BF16: tl.constexpr
    ):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        c = tl.dot(a, b)  # fp32 accumulator
        if OUT_BF16:
            tl.store(c_ptr + rm[:, None] * N + rn[None, :], c.to(tl.bfloat16))
        else:
            tl.store(c_ptr + rm[:, None] * N + rn[None, :], c)

    @triton.jit
    def _rtne_bf16_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(y_ptr + offs, x.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=m)


def _edge_values() -> torch.Tensor:
    """fp32 values whose bf16 rounding is decided by the low 16 bits' edge cases."""
    g = torch.Generator().manual_seed(7)
    hi = torch.randint(0, 1 << 16, (4096,), generator=g, dtype=torch.int64)
    special = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,  # ties, +-1 bit either side
         0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF,  # the overflow edge: rounds to +-inf, or not
         0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,  # subnormals, ties among them
         0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
         0x7FC00000, 0x7F800001, 0xFFFFFFFF],  # NaNs (a low-payload one the rounding must not make inf)
        dtype=torch.int64,
    )  # fmt: skip
    lows = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = torch.cat([(hi[:, None] << 16 | lows[None, :]).flatten(), special])
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)
    rand = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-30, 30, (4096,), generator=g).float())
    return torch.cat([bits.view(torch.float32), rand])


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    g, w = got.view(torch.int16), want.view(torch.int16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    bad = (g != w) & ~nan
    assert not bad.any(), f"{int(bad.sum())} values differ, first at fp32 {want.float()[bad][:4].tolist()}"


def test_reference_rounding_matches_torch() -> None:
    x = _edge_values()
    bits = torch.from_numpy(fp32_to_bf16_bits(x.numpy()).view(np.int16))
    _same_bits(bits.view(torch.bfloat16), x.to(torch.bfloat16))
    x2 = x[5]  # a 0-d value keeps its shape
    assert fp32_to_bf16_bits(x2.numpy()).shape == ()


@pytest.mark.parametrize("kernel", ["to", "store", "rtne"])
def test_kernel_rounds_to_nearest_even(dev: str, kernel: str) -> None:
    if dev == "cpu" and not is_interpreter():
        pytest.skip("CPU needs the interpreter")
    fn = {"to": _to_bf16_kernel, "store": _store_bf16_kernel, "rtne": _rtne_bf16_kernel}[kernel]
    x = _edge_values().to(dev)
    y = torch.full_like(x, float("nan"), dtype=torch.bfloat16)
    n = x.numel()
    fn[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)
    _same_bits(y.cpu(), x.cpu().to(torch.bfloat16))


@pytest.mark.parametrize("out_bf16", [False, True], ids=["fp32-out", "bf16-out"])
def test_bf16_dot_accumulates_in_fp32(dev: str, out_bf16: bool) -> None:
    """bf16 [32, 64] @ [64, 16] against torch's float64 product of the same bf16 values: fp32 accumulation of
    exact products (relative 1e-5 on the CPU's one-pass numpy sum, 1e-4 on tensor cores), rounded once when
    stored as bf16 (0.5 ulp: 4e-3)."""
    g = torch.Generator().manual_seed(11)
    a = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(64, 16, generator=g).to(torch.bfloat16)
    want = a.double() @ b.double()
    c = torch.full((32, 16), float("nan"), dtype=torch.bfloat16 if out_bf16 else torch.float32, device=dev)
    _dot_kernel[(1,)](a.to(dev), b.to(dev), c, M=32, N=16, K=64, OUT_BF16=out_bf16)
    got = c.cpu().double()
    err = ((got - want).norm() / want.norm()).item()
    assert err < (4e-3 if out_bf16 else 1e-4), err
