"""exp2 on the FMA pipe (software, for fp32 tensors), and a score-tile exp2 that splits its work between it and
the MUFU unit: FlashAttention-4's answer to softmax-bound attention (issue #13).

Why: at head dim 64 a [BLOCK_M, BLOCK_N] score tile needs as many exponentials as at D128 for half the MMA
work. Hopper's MUFU runs ex2 at 16 results / clock / SM, the FP32 pipe 128 FMA / clock / SM, and the softmax
gives the FP32 pipe only ~3-4 ops per score (scale FMA, max, sum, cvt). A polynomial exp2 costs ~10 issue
slots of FP32/INT work, so moving a fraction f of the exponentials to it balances the two pipes around
f ~ 1/4 (issue-bound estimate: 8 (1 - f) = 4 + 10 f gives f ~ 0.22). FlashAttention-4 (flash_attn/cute,
`ex2_emulation` / `apply_exp2_convert`) emulates 4 of every 16 exponentials of a row with a degree-3
polynomial on [0, 1) (10-25% of a row, per its paper).

exp2_poly(x, DEGREE) (this module's own; not FA4's code): Cody-Waite range reduction with round-to-nearest
    x = max(x, -127)                  (NaN-propagating max: -inf -> -127, NaN stays NaN)
    t = x + 1.5 * 2^23                (fp32 add, round to nearest even: t's low mantissa bits hold n = rint(x))
    f = x - (t - 1.5 * 2^23)          (exact; f in [-0.5, 0.5])
    2^f ~ minimax polynomial of degree DEGREE (relative error, Horner: DEGREE FMAs)
    2^n = bits((bits(t) << 23) + (127 << 23))   (bits(t) = 0x4B400000 + n: the shift drops the 0x4B4 part)
    result = 2^f * 2^n                 (a multiply, not an integer add into the polynomial's exponent: 2^-127
                                        gives bits 0 = 0.0, so every x <= -126.5 gives exactly +0, and a NaN
                                        polynomial stays NaN whatever the integer part made of NaN's bits)
Plain Triton ops only (no inline asm), so it also runs under TRITON_INTERPRET=1, and fp32 adds round to nearest
everywhere (the GPU's add.rn, numpy on the CPU); Triton sets no reassociation flags, so (x + C) - C is not
folded (the sm_90 PTX keeps both adds). Per element on sm_90: max, 3 adds, DEGREE FMAs, shl + add (INT pipe),
one multiply: 9 instructions at degree 3, against one MUFU ex2.approx.

Domain and accuracy (tests/test_triton_exp2_poly.py sweeps [-130, 0] densely, plus -inf, against float64):
- x in [-126, 127]: relative error <= 7.5e-5 (degree 3), 2.6e-6 (4), 7.5e-8 (5) from the minimax fits on
  [-0.5, 0.5] below, plus fp32 evaluation (measured over 2e6 + 1 points of [-126, 0] in the interpreter:
  degree 3 7.48e-5 max / 4.7e-5 mean, 4 2.71e-6, 5 2.34e-7). The hardware ex2.approx.f32 is ~2 ulp (2.4e-7).
  x = 0 gives 0.99993 at degree 3 (not exactly 1: c0 is the fit's).
- x in [-126.5, -126): results in [2^-126.5, 2^-126] (normal or subnormal; no FTZ on the multiply).
- x < -126.5, and -inf: exactly +0.0 (the true value is below 2^-126.5 ~ 1.1e-38: flushed, as ex2.approx.ftz).
- NaN -> NaN. x > 127.5 is outside the domain (2^n overflows the exponent field: garbage, not inf); the
  softmax feeds x = s - rowmax <= 0 (+ rounding), and +inf scores arrive as NaN (inf - inf), as with MUFU.

sm_90 code (attention.py's _attn_fwd_kernel, D64 128x64 tile, 8 warps: 32 scores per thread per tile; SASS of
the whole kernel, unmasked + masked loop bodies, Triton 3.6; 3.9 the same counts): MUFU.EX2 68 / FFMA 60
(MUFU only) -> 60 / 92 (1/8 through the polynomial) -> 52 / 124 (1/4) -> 36 / 188 (1/2); per polynomial
exp2 +4 FFMA (3 Horner + the multiply fused into the row sum), +2 FADD, +1 FMUL, +1 FMNMX and the integer
shift/add. The column split (tl.reshape / tl.split / tl.join on register bits of the MMA layout) adds no
shuffles, shared-memory round trips or barriers (SHFL, STS, BAR counts unchanged) and no spills.

What the softmax loses (fraction f of the scores through the polynomial, degree 3): each such p carries a
relative error <= 7.6e-5, before P is rounded to bf16 (2^-9 = 2e-3) / fp16 (2^-11 = 4.9e-4) for P V, so o
moves by well under one output ulp. The row sum l is a sum of positive terms, so its relative error is at most
the largest term's, 7.6e-5 (typically f * that, averaged): lse = (m + log2 l) ln 2 moves by <= 7.6e-5 in
absolute terms (natural-log units). The backward recomputes p = exp2(s * scale * log2e - lse * log2e) with
MUFU from the saved lse, so its p is off by the same <= 7.6e-5 relative, far inside the gradient tolerances.

Measured: a loss on Hopper, so it stays off by default (opt-in for probes and for Blackwell-class parts, where
FA4 found MUFU the bottleneck). H100 SXM, Triton 3.6, torch 2.11, 15cdd56, benchmarks/gpu_checks/
attn_exp2_poly.py --causal 0 (do_bench, L2 flushed, bf16 H32, same process), speed against the same kernel
with it off: _attn_fwd_kernel D64 1/4 0.88-0.94x, 1/2 0.85-0.89x (B32 S512, B16 S1024, B4 S4096; the one
gain, B1 H32/8 S2048 1.11x, is a shape that routes to Gluon at 1.7x that speed anyway); Gluon persistent D64
1/4 0.96-0.99x, 1/2 0.86-0.88x; Gluon D128 1/4 0.95-0.98x. Accuracy as predicted: lse within 2.3e-5 of the
MUFU kernel's, o within 1.1e-3 (bf16 rounding), gradients from its (o, lse) within 1.1e-3. 59 GPU tests
passed (tests/test_triton_exp2_poly.py --device cuda).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Environment switch value -> POLY_LOG2 (log2 of 1 / the fraction of a tile's exponentials through the
# polynomial), shared by attention.py's FUSEKIT_TRITON_ATTN_EXP2_POLY and _attention_hopper.py's
# FUSEKIT_HOPPER_ATTN_EXP2_POLY.
_ENV_FRACTIONS = {"": 0, "0": 0, "1": 2, "2": 1, "4": 2, "8": 3}


def env_config(var: str) -> tuple[int, int]:
    """(POLY_LOG2, DEGREE) from the switch `var` (unset / "0": off; "1" or "4": a quarter of each score tile's
    exponentials through the polynomial, "2" a half, "8" an eighth) and `var`_DEGREE (3, the default: <= 7.5e-5
    relative error; 4 or 5): (0, 3) when off, the kernels' defaults; a ValueError naming `var` otherwise."""
    raw = os.environ.get(var, "").strip()
    deg = os.environ.get(f"{var}_DEGREE", "3").strip() or "3"
    if raw not in _ENV_FRACTIONS or deg not in ("3", "4", "5"):
        raise ValueError(f"{var}={raw!r} / _DEGREE={deg!r}: expected 0, 1, 2, 4 or 8 / 3, 4 or 5")
    poly = _ENV_FRACTIONS[raw]
    return poly, (int(deg) if poly else 3)


@triton.jit
def exp2_poly(x, DEGREE: tl.constexpr = 3):
    """2^x of an fp32 tensor on the FMA/ALU pipes (no MUFU): see the module docstring for range and error."""
    # 12582912 = 1.5 * 2^23: x + it rounds x to an integer kept in the low mantissa bits. The polynomials are
    # minimax (relative error) fits of 2^f on [-0.5, 0.5] (Remez exchange in 40-digit mpmath), coefficients
    # rounded to fp32; the exact-coefficient fits' max relative error: degree 3 7.48e-5, 4 2.59e-6, 5 7.49e-8.
    x = tl.maximum(x, -127.0, propagate_nan=tl.PropagateNan.ALL)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    if DEGREE == 3:
        p = ((0.0551716685295105 * f + 0.2426111251115799) * f + 0.6932609677314758) * f + 0.9999280571937561
    elif DEGREE == 4:
        p = (0.009570102207362652 * f + 0.05591785907745361) * f + 0.240247443318367
        p = (p * f + 0.6931217908859253) * f + 0.9999992847442627
    else:
        tl.static_assert(DEGREE == 5, "exp2_poly: DEGREE must be 3, 4 or 5")
        p = ((0.0013276472454890609 * f + 0.009675540961325169) * f + 0.05550713092088699) * f
        p = ((p + 0.24022120237350464) * f + 0.6931469440460205) * f + 1.0000001192092896
    scale = ((t.to(tl.int32, bitcast=True) << 23) + 0x3F800000).to(tl.float32, bitcast=True)
    return p * scale


@triton.jit
def _cols_split(x, ROWS: tl.constexpr, COLS: tl.constexpr, HALVES: tl.constexpr):
    # x [ROWS, COLS] -> two [ROWS, COLS // 2]: HALVES the first / last half of the columns, else the even / odd
    # columns. On sm_80/sm_90 MMA accumulators a thread holds column bit 0 and the bits from 3 up in registers
    # (bits 1-2 are lanes), so both splits stay inside each thread's registers (no shuffles).
    if HALVES:
        return tl.split(tl.permute(tl.reshape(x, [ROWS, 2, COLS // 2]), [0, 2, 1]))
    return tl.split(tl.reshape(x, [ROWS, COLS // 2, 2]))


@triton.jit
def _cols_join(a, b, ROWS: tl.constexpr, COLS: tl.constexpr, HALVES: tl.constexpr):
    # the inverse of _cols_split: two [ROWS, COLS // 2] -> [ROWS, COLS]
    if HALVES:
        return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [ROWS, COLS])
    return tl.reshape(tl.join(a, b), [ROWS, COLS])


@triton.jit
def exp2_mixed(x, ROWS: tl.constexpr, COLS: tl.constexpr, POLY_LOG2: tl.constexpr, DEGREE: tl.constexpr = 3):
    """2^x of an fp32 [ROWS, COLS] score tile, 1 / 2^POLY_LOG2 of its columns through exp2_poly, the rest
    through tl.math.exp2 (MUFU ex2.approx): POLY_LOG2 = 0 all MUFU (tl.math.exp2 itself), 1 the odd columns,
    2 the odd columns of the last half, 3 the odd columns of the last quarter. COLS >= 2^(POLY_LOG2 + 1)."""
    if POLY_LOG2 == 0:
        return tl.math.exp2(x)
    elif POLY_LOG2 == 1:
        a, b = _cols_split(x, ROWS, COLS, False)
        return _cols_join(tl.math.exp2(a), exp2_poly(b, DEGREE), ROWS, COLS, False)
    elif POLY_LOG2 == 2:
        a, b = _cols_split(x, ROWS, COLS, True)
        b0, b1 = _cols_split(b, ROWS, COLS // 2, False)
        b = _cols_join(tl.math.exp2(b0), exp2_poly(b1, DEGREE), ROWS, COLS // 2, False)
        return _cols_join(tl.math.exp2(a), b, ROWS, COLS, True)
    else:
        tl.static_assert(POLY_LOG2 == 3, "exp2_mixed: POLY_LOG2 must be 0, 1, 2 or 3")
        a, b = _cols_split(x, ROWS, COLS, True)
        b0, b1 = _cols_split(b, ROWS, COLS // 2, True)
        c0, c1 = _cols_split(b1, ROWS, COLS // 4, False)
        b1 = _cols_join(tl.math.exp2(c0), exp2_poly(c1, DEGREE), ROWS, COLS // 4, False)
        b = _cols_join(tl.math.exp2(b0), b1, ROWS, COLS // 2, True)
        return _cols_join(tl.math.exp2(a), b, ROWS, COLS, True)


# --- Gluon (explicit layouts) versions, for _attention_hopper.py's softmax ------------------------------------
# exp2_poly above serves Gluon too (a @triton.jit function called from @gluon.jit on a tensor of any layout: the
# sm_90 PTX of the 48 D64/D128 opt-in variants is identical, debug info aside, to a Gluon copy of it, Triton 3.6
# and 3.9); the column split / join need Gluon's layout-aware ops. Gluon infers the layouts of reshape / permute / split /
# join from their operand's, so on a wgmma accumulator (NVMMADistributedLayout v3: a thread holds column bit 0
# and the bits from 3 up in registers, bits 1-2 are lanes) the column splits below are register renamings; the
# rejoined tile comes back in a linear layout equal to the accumulator's, and exp2_mixed_gluon's final
# convert_layout to the input's layout is a no-op (no shuffles, shared memory or barriers in the sm_90 PTX:
# Triton 3.6 and 3.9).
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    HAS_GLUON = hasattr(gl, "split") and hasattr(gl, "join") and hasattr(gl, "convert_layout")
except Exception:  # no Gluon in this Triton: the Triton versions above still work
    HAS_GLUON = False

if HAS_GLUON:

    @gluon.jit
    def _cols_split_gluon(x, HALVES: gl.constexpr):
        # as _cols_split: [R, C] -> two [R, C // 2], first / last half of the columns or even / odd ones
        R: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        if HALVES:
            a, b = gl.split(gl.permute(gl.reshape(x, [R, 2, C // 2]), [0, 2, 1]))
        else:
            a, b = gl.split(gl.reshape(x, [R, C // 2, 2]))
        return a, b

    @gluon.jit
    def _cols_join_gluon(a, b, HALVES: gl.constexpr):
        # the inverse of _cols_split_gluon. join wants both operands in one layout: after a nested split, a (a
        # slice of one split's parent) and b (rejoined from the next split) hold the same register mapping under
        # two layout objects, so this convert is a renaming.
        b = gl.convert_layout(b, a.type.layout)
        R: gl.constexpr = a.shape[0]
        C: gl.constexpr = 2 * a.shape[1]
        if HALVES:
            y = gl.reshape(gl.permute(gl.join(a, b), [0, 2, 1]), [R, C])
        else:
            y = gl.reshape(gl.join(a, b), [R, C])
        return y

    @gluon.jit
    def exp2_mixed_gluon(x, POLY_LOG2: gl.constexpr, DEGREE: gl.constexpr = 3):
        """exp2_mixed for a Gluon [R, C] fp32 tile: the same columns through exp2_poly_gluon (POLY_LOG2 = 1 the
        odd columns, 2 the odd columns of the last half, 3 the odd columns of the last quarter; 0 all gl.exp2),
        the result in x's layout. C >= 2^(POLY_LOG2 + 1)."""
        if POLY_LOG2 == 0:
            y = gl.exp2(x)
        elif POLY_LOG2 == 1:
            a, b = _cols_split_gluon(x, False)
            y = _cols_join_gluon(gl.exp2(a), exp2_poly(b, DEGREE), False)
        elif POLY_LOG2 == 2:
            a, b = _cols_split_gluon(x, True)
            b0, b1 = _cols_split_gluon(b, False)
            b = _cols_join_gluon(gl.exp2(b0), exp2_poly(b1, DEGREE), False)
            y = _cols_join_gluon(gl.exp2(a), b, True)
        else:
            gl.static_assert(POLY_LOG2 == 3, "exp2_mixed_gluon: POLY_LOG2 must be 0, 1, 2 or 3")
            a, b = _cols_split_gluon(x, True)
            b0, b1 = _cols_split_gluon(b, True)
            c0, c1 = _cols_split_gluon(b1, False)
            b1 = _cols_join_gluon(gl.exp2(c0), exp2_poly(c1, DEGREE), False)
            b = _cols_join_gluon(gl.exp2(b0), b1, True)
            y = _cols_join_gluon(gl.exp2(a), b, True)
        return gl.convert_layout(y, x.type.layout)
