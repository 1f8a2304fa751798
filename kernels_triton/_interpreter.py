"""Corrections to Triton's CPU interpreter (TRITON_INTERPRET=1), so kernels run there as they do on a GPU.

Two interpreter defects (Triton 3.6 and 3.9, runtime/interpreter.py), each a wrong answer on the CPU:
- fp32 -> bf16 truncates: `InterpreterBuilder.cast_impl` calls `_convert_float(..., rounding_mode=None)`,
  which drops the low 16 bits, and its RTNE branch (an explicit `fp_downcast_rounding="rtne"`) rounds ties
  up without carrying into the exponent. Compiled kernels round to nearest even (cvt.rn.bf16.f32), as torch
  does, so every bf16 result carried up to 1 ulp where the GPU carries 0.5 (a fuzz case, layer_norm N=2 bf16
  with a residual, missed its tolerance on the CPU only, 2026-11-27).
- bf16 `tl.dot` multiplies the bit patterns: bf16 tensors are numpy uint16 arrays there and `create_dot` hands
  them to np.matmul as integers (16x16 inputs: errors of 2.7e10, TRITON_FACTS.md), so the triton backend had
  to refuse bf16 attention and FFN on the CPU.

`install()` replaces, for those cases only, the conversions the kernels reach - the implicit one
(`.to(tl.bfloat16)`, a store into a bf16 pointer: `cast_impl`) and the explicit-rounding one
(`create_fp_to_fp`, "rtz" still truncates) - with round to nearest, ties to even, overflow to inf, NaN kept a
quiet NaN; and a bf16 `create_dot` with the operands widened to fp32 (exact: bf16 products fit fp32's
mantissa) and accumulated in fp32 into the fp32 accumulator, as a GPU's tensor cores do. Every other case
goes to Triton's own code. Installed on import of kernels_triton under the interpreter (and by the tests'
conftest); it changes nothing for compiled kernels. A Triton whose interpreter lacks these names is left as
it is: `install()` returns False and the triton backend keeps refusing bf16 matrix ops on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_INSTALLED: bool | None = None


def fp32_to_bf16_bits(values: np.ndarray, round_to_zero: bool = False) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 `values`, rounded to nearest even (or toward zero)."""
    values = np.asarray(values, dtype=np.float32)
    flat = np.ascontiguousarray(values)  # at least 1-d: a 0-d value is reshaped back at the end
    bits = flat.view(np.uint32).astype(np.uint64)
    if round_to_zero:
        out = bits >> 16
    else:  # adding 0x7FFF plus the kept lsb rounds half to even; a carry moves into the exponent (to inf)
        out = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(flat)
    if nan.any():  # keep NaN a NaN (the rounding could carry a low-payload NaN into inf): quiet bit set
        out[nan] = (bits[nan] >> 16) | 0x40
    return out.astype(np.uint16).reshape(values.shape)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (uint16): exact."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def install() -> bool:
    """Patch the interpreter (idempotent); False if this Triton lacks what the patches replace."""
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        _INSTALLED = False
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    cast = getattr(builder, "cast_impl", None)
    to_fp = getattr(builder, "create_fp_to_fp", None)
    dot = getattr(builder, "create_dot", None)
    if None in (builder, handle, cast, to_fp, dot):
        _INSTALLED = False
        return False

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

    def widen(h: Any) -> np.ndarray:
        return bf16_bits_to_fp32(h.data) if h.dtype.scalar == tl.bfloat16 else h.data.astype(np.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = np.matmul(widen(a), widen(b), dtype=np.float32)
        if d.dtype.scalar == tl.bfloat16:  # a bf16 accumulator: add in fp32, round once
            return handle(fp32_to_bf16_bits(acc + bf16_bits_to_fp32(d.data)), d.dtype.scalar)
        return handle((acc + d.data).astype(d.data.dtype), d.dtype.scalar)

    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_dot = create_dot
    _INSTALLED = True
    return True
