"""Round-to-nearest-even fp32 -> bf16 conversions in Triton's CPU interpreter (a test-harness correction).

The interpreter (Triton 3.6 and 3.9) converts fp32 to bf16 by truncation: `InterpreterBuilder.cast_impl`
calls `_convert_float(..., rounding_mode=None)`, which drops the low 16 bits, and its RTNE branch (reached
only through an explicit `fp_downcast_rounding="rtne"`) rounds ties up, not to even, without carrying into
the exponent. Compiled kernels round to nearest even (cvt.rn.bf16.f32), as torch does. So every bf16 output
of a Triton kernel in the CPU suite carried up to 1 ulp of error where the GPU carries 0.5: the fuzz case
layer_norm N=2 bf16 with a residual (h = x + r stored 1 ulp low, then amplified by h - mean) failed its
tolerance on the interpreter only (FUSEKIT_FUZZ_SEED=12, 2026-11-27).

`install()` (tests/conftest.py, CPU runs) replaces the two conversions the kernels reach - the implicit one
(`.to(tl.bfloat16)`, a store into a bf16 pointer: `cast_impl`) and the explicit-rounding one
(`create_fp_to_fp`) - for fp32 -> bf16 only, with the GPU's rounding: round to nearest, ties to even,
overflow to inf, NaN kept a quiet NaN of the same sign; "rtz" in `create_fp_to_fp` truncates, as on the
GPU. Every other conversion goes to Triton's own code. A Triton whose interpreter lacks these names is
left as it is (`install` returns False).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def fp32_to_bf16_bits(values: np.ndarray, round_to_zero: bool = False) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 `values`, rounded to nearest even (or toward zero)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    if round_to_zero:
        out = bits >> 16
    else:  # adding 0x7FFF plus the kept lsb rounds half to even; a carry moves into the exponent (to inf)
        out = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(values)
    if nan.any():  # keep NaN a NaN (the rounding could carry a low-payload NaN into inf): quiet bit set
        out[nan] = (bits[nan] >> 16) | 0x40
    return out.astype(np.uint16).reshape(np.shape(values))


def install() -> bool:
    """Patch the interpreter's fp32 -> bf16 conversions (idempotent); False if this Triton lacks them."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    cast, to_fp = getattr(builder, "cast_impl", None), getattr(builder, "create_fp_to_fp", None)
    if builder is None or handle is None or cast is None or to_fp is None:
        return False
    if getattr(cast, "_fusekit_rne", False):
        return True

    def is_down(src: Any, dst_type: Any) -> bool:
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    def cast_impl(self, src, dst_type):
        if is_down(src, dst_type):
            return handle(fp32_to_bf16_bits(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if is_down(src, dst_type):
            rtz = "RTZ" in str(rounding_mode).upper()
            return handle(fp32_to_bf16_bits(src.data, round_to_zero=rtz), dst_type.scalar)
        return to_fp(self, src, dst_type, rounding_mode)

    cast_impl._fusekit_rne = True
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    return True
