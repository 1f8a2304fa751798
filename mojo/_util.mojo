"""Shared helpers for the fusekit Mojo ops (not an op: files starting with `_` register nothing).

- vector width: 16 bytes per load/store (`ld.global.v4.b32` on sm_90, `global_load_dwordx4` on gfx942);
- accumulator dtype: fp32 for floating inputs (fp64 stays fp64), int64 for integers (reference.py);
- the check that a caller-owned workspace is large enough for a launch;
- accurate exp / log / sincos in fp64 built from + and * only: the GPU `cos`/`sin` intrinsics are
  `cos.approx.f32` on sm_90 (useless for RoPE angles up to 2^24 rad and beyond) and fp64 `cos` is
  rejected on NVIDIA, so we range-reduce and evaluate polynomials ourselves (same code on CPU and GPU).
  Every one of them is total: a fixed number of steps for any input (NaN in, NaN out; never a loop
  that a scalar such as theta = inf or 0 could keep going, issue #16).
"""

from std.sys import size_of
from std.memory import bitcast
from std.math import exp, sqrt


def vec_width[dtype: DType]() -> Int:
    """Elements per 16-byte vector access."""
    return 16 // size_of[dtype]()


def acc_dtype[dtype: DType]() -> DType:
    """Accumulation dtype of reference.py: int64 for integers, fp64 for fp64, else fp32."""
    comptime if dtype.is_integral():
        return DType.int64
    elif dtype == DType.float64:
        return DType.float64
    else:
        return DType.float32


def cdiv(a: Int, b: Int) -> Int:
    return (a + b - 1) // b


def is_aligned16[dtype: DType](p: Pointer[Scalar[dtype], MutAnyOrigin]) -> Bool:
    return Int(p) % 16 == 0


def exp_keep_nan[W: SIMDLength, //](x: SIMD[DType.float32, W]) -> SIMD[DType.float32, W]:
    """exp(x) with NaN in, NaN out: Mojo's CPU exp returns +inf for NaN (a NaN logit's loss was +inf, not
    NaN). The test is x.eq(x): SIMD x.ne(x) is an ordered compare, false for NaN lanes."""
    return x.eq(x).select(exp(x), x)


def rsqrt_full_range(v: Float32) -> Float32:
    """1 / sqrt(v) for every v >= 0. On NVIDIA 1 / sqrt(v) compiles to rsqrt.approx.ftz.f32, which reads
    v < 2^-126 as 0: with eps 0 (or a subnormal eps) a row whose mean square is ~1e-40 got rstd inf and y
    inf / NaN. Such v is scaled by 2^64 (exact) and the root by 2^32; the fast rsqrt is kept."""
    var tiny = v < Float32(1.1754943508222875e-38)
    var r = 1.0 / sqrt(v * Float32(18446744073709551616.0) if tiny else v)
    return r * Float32(4294967296.0) if tiny else r


def check_workspace(op: StaticString, name: StaticString, have: Int, need: Int) raises:
    """Raise unless the caller's workspace `name` (have elements) holds what the launch needs.

    GPU scratch memory is the caller's (a MutableInputTensor, allocated by torch: an allocation inside
    the op would make MAX reserve most of the GPU after a device-graph capture), sized by the op's
    Workspace size function in python/fusekit/backends/mojo/specs.py. A kernel whose launch plan
    outgrows that function fails here instead of writing past the buffer.
    """
    if have < need:
        raise Error(
            op, ": workspace '", name, "' has ", have, " elements, the launch needs ", need,
            " (its size function in python/fusekit/backends/mojo/specs.py is out of date)",
        )


def pow2_f64(k: Int) -> Float64:
    """Return 2^k exactly for -1022 <= k <= 1023 (built from the exponent bits, no loop)."""
    return bitcast[DType.float64](UInt64(k + 1023) << 52)


def exp_f64(x: Float64) -> Float64:
    """Return exp(x) to ~1 fp64 ulp for every x (NaN stays NaN; no loop depends on x).

    x is clamped to [-200, 200] first: exp(+-200) already over/underflows fp32, this function's only
    consumer (RoPE inv_freq = exp(i * c), |i * c| <= |ln theta| <= 103.3 for any fp32 theta > 0).
    Reduction x = k ln2 + r with a two-word ln2 (k * LN2_HI is exact for |k| < 2^20), |r| <= ln2/2,
    then Taylor to degree 14 (r^15/15! < 1e-19) and an exact scaling by 2^k.
    """
    if x != x:
        return x
    comptime LOG2E = 1.4426950408889634
    comptime LN2_HI = 6.93147180369123816490e-01  # fdlibm's ln2_hi: 32 significant bits
    comptime LN2_LO = 1.90821492927058770002e-10
    var xc = min(max(x, -200.0), 200.0)
    var t = xc * LOG2E
    var k = Int(t + 0.5) if t >= 0 else -Int(0.5 - t)  # round to nearest; |k| <= 289
    var kf = Float64(k)
    var r = (xc - kf * LN2_HI) - kf * LN2_LO
    var p: Float64 = 1.0
    comptime for j in range(14, 0, -1):
        p = 1.0 + (r * (1.0 / Float64(j))) * p  # r / j off the chain: one FMA per step
    return p * pow2_f64(k)


# 2/pi in 8 chunks of 26 bits: TWO_OVER_PI_26[i] = (bits 26i+1 .. 26i+26 of 2/pi) * 2^-26(i+1). An fp32
# value has 24 significant bits, so x * chunk (<= 50 bits) is exact in fp64. 8 chunks (208 bits) leave
# a tail x * 2^-208 < 2^-80 for every finite fp32 x (< 2^128). Generated with mpmath at 400 bits:
#   m_i = floor(2/pi * 2^(26(i+1))) mod 2^26.
comptime _M26 = 1.0 / 67108864.0  # 2^-26


@always_inline
def _two_over_pi_chunk[i: Int]() -> Float64:
    comptime M = (42722829, 48555073, 21659401, 56087029, 13858563, 28715353, 38736100, 4324945)
    var c = Float64(M[i])
    comptime for _ in range(i + 1):
        c *= _M26  # exact: scaling by a power of two, far from the subnormal range
    return c


def reduce_pio2(a: Float32) -> Tuple[Int, Float32]:
    """Return (q, r) with a = (4n + q) pi/2 + r, |r| <= pi/4 (r rounded once to fp32), for EVERY finite fp32
    angle a; NaN or +-inf give r = NaN.

    RoPE angles reach 2^24 * theta^0 and beyond (tiny theta gives inv_freq up to ~1e38), so a Cody-Waite
    reduction (exact only to ~2^26) is not enough: above 2^20 this is a Payne-Hanek reduction done in fp64
    with exact splits: |a| * 2/pi = sum_i |a| * C_i with every product exact (24 + 26 bits); each product
    contributes (t mod 4) = its integer part mod 4 (to the quadrant) plus its fraction (exact), and the
    fractions are summed with TwoSum, so the reduced argument keeps full relative precision even for
    the fp32 angles closest to a multiple of pi/2. No loop depends on a.
    """
    var x = Float64(a)
    if not (abs(x) <= 3.5e38):  # NaN, +-inf
        return (0, Float32(Float64(0) / Float64(0)))
    var ax = abs(x)
    var q: Int
    var hi: Float64
    var lo: Float64
    if ax < 1048576.0:  # 2^20: RoPE's usual range; a cheaper Cody-Waite reduction is exact here
        # fdlibm's 3 x 33-bit pi/2: k < 2^20, so every k * PIO2_i is exact; a - k PIO2_1 is exact
        # (Sterbenz); the rest rounds at the size of the result, so r keeps its relative precision
        comptime TWO_OVER_PI = 0.63661977236758134308
        comptime PIO2_1 = 1.57079632673412561417e00
        comptime PIO2_2 = 6.07710050630396597660e-11
        comptime PIO2_3 = 2.02226624871116645580e-21
        comptime PIO2_3T = 8.47842766036889956997e-32
        var k = Int(ax * TWO_OVER_PI + 0.5)
        var kf = Float64(k)
        q = k & 3
        var r1 = ax - kf * PIO2_1
        var w = kf * PIO2_2
        var r2 = r1 - w
        var w2 = kf * PIO2_3 - ((r1 - r2) - w)  # what the rounding of r1 - w lost, plus the next word
        hi = r2 - w2
        lo = (r2 - hi) - w2 - kf * PIO2_3T
    else:
        var hl = _payne_hanek(ax)
        q = hl[0]
        hi = hl[1]
        lo = hl[2]
    if x < 0:  # a = -(4n + q) pi/2 - r = (4n' + (-q mod 4)) pi/2 + (-r)
        return ((-q) & 3, Float32(-(hi + lo)))
    return (q & 3, Float32(hi + lo))


def sincos_f32_angle(a: Float32) -> Tuple[Float32, Float32]:
    """Return (sin a, cos a) to ~1 fp32 ulp for EVERY finite fp32 angle a (NaN for NaN / +-inf).

    The reduction (reduce_pio2) is exact; the result is fp32, so after it the polynomials run in fp32:
    Taylor on |r| <= pi/4 to r^9 / r^10 (the first dropped terms are 2.5e-9 / 1.1e-10 relative, below
    half an fp32 ulp), one FMA per term. They were fp64 before (degree 17 / 18): a decode token's rope
    is one short dependent chain per thread, and fp64 runs at half fp32's rate on the H200 (1/64 on
    consumer parts).
    """
    var qr = reduce_pio2(a)
    var r = qr[1]
    var r2 = r * r
    var sn = r * (1.0 + r2 * (-1.0 / 6.0 + r2 * (1.0 / 120.0 + r2 * (-1.0 / 5040.0 + r2 * (1.0 / 362880.0)))))
    var c = 1.0 + r2 * (
        -0.5 + r2 * (1.0 / 24.0 + r2 * (-1.0 / 720.0 + r2 * (1.0 / 40320.0 + r2 * (-1.0 / 3628800.0))))
    )
    var q = qr[0]
    if q == 0:
        return (sn, c)
    if q == 1:
        return (c, -sn)
    if q == 2:
        return (-sn, -c)
    return (-c, sn)


def _payne_hanek(ax: Float64) -> Tuple[Int, Float64, Float64]:
    """(quadrant, hi, lo) with ax = (4n + quadrant) pi/2 + hi + lo (radians, |hi + lo| <= pi/4 + tiny)
    for an fp32 value 0 <= ax < 2^128 (see sincos_f32_angle)."""
    var q = 0
    var s: Float64 = 0  # sum of the fractions: s + e
    var e: Float64 = 0
    comptime for i in range(8):
        var t = ax * _two_over_pi_chunk[i]()  # exact
        if t < 36028797018963968.0:  # 2^55; a larger t has ulp >= 8, so t mod 4 == 0
            var k = Int64(t)  # floor (t >= 0); exact in fp64 (a subset of t's bits)
            q += Int(k & 3)
            var f = t - Float64(k)  # exact, in [0, 1)
            var s2 = s + f  # TwoSum(s, f)
            var bb = s2 - s
            e += (s - (s2 - bb)) + (f - bb)
            s = s2
    var n = Int64(s + 0.5)  # s in [0, 8)
    s -= Float64(n)  # exact, |s| <= 1/2
    q += Int(n & 3)
    var hi = s + e  # TwoSum(s, e)
    var bb = hi - s
    var lo = (s - (hi - bb)) + (e - bb)
    if hi > 0.5:  # exact (Sterbenz)
        hi -= 1.0
        q += 1
    elif hi < -0.5:
        hi += 1.0
        q -= 1
    comptime PIO2_HI = 1.5707963267948966
    comptime PIO2_LO = 6.123233995736766e-17
    var rh = hi * PIO2_HI
    var rl = hi * PIO2_LO + lo * PIO2_HI  # + the rounding of rh, which is below fp64's reach here
    return (q, rh, rl)


def log_f64(x: Float64) -> Float64:
    """Return ln(x) for finite x > 0 (RoPE theta), NaN for anything else (0, negative, inf, NaN).

    Normalize m = x * 2^-k into [sqrt(1/2), sqrt(2)) from x's exponent bits (subnormals scaled by 2^54
    first; a binary search on the exponent took 20 dependent steps), then the 2 atanh(z) series. Only
    + * / and bit operations, so it compiles on every target (fp64 transcendental intrinsics do not on
    NVIDIA).
    """
    if not (x > 0 and x <= Float64.MAX_FINITE):
        return Float64(0) / Float64(0)
    comptime LN2 = 0.69314718055994530942
    var xn = x
    var k = 0
    if xn < 2.2250738585072014e-308:  # subnormal: make it normal
        xn *= pow2_f64(54)
        k = -54
    var bits = bitcast[DType.uint64](xn)
    k += Int((bits >> 52) & 0x7FF) - 1023
    var m = bitcast[DType.float64]((bits & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000)
    # now m in [1, 2)
    if m >= 1.4142135623730951:
        m *= 0.5
        k += 1
    var z = (m - 1.0) / (m + 1.0)  # |z| <= 0.172: z^23 / 23 < 1e-18
    var z2 = z * z
    var s: Float64 = 0.0
    comptime for j in range(11, -1, -1):
        s = s * z2 + (1.0 / Float64(2 * j + 1))
    return Float64(k) * LN2 + 2.0 * z * s


def rope_inv_freq_coef(theta: Float32, dim: Int) -> Float64:
    """Return the fp64 scalar c with inv_freq[i] = f32(exp(i * c)), as fusekit.ops.rope.inv_freq computes it
    (`-2.0 * math.log(theta) / head_dim` in fp64)."""
    return -2.0 * log_f64(Float64(theta)) / Float64(dim)


def rope_cos_sin(pos: Float32, i: Int, c: Float64) -> Tuple[Float32, Float32]:
    """Return (cos, sin) of angle f32(pos) * f32(exp(i * c)): inv_freq in fp64, rounded once (the same bits as
    every backend's: an angle of 2^24 magnifies inv_freq's error 2^24 times), the product in fp32 as
    fusekit.ops.rope.tables, cos / sin to ~1 fp32 ulp after an exact range reduction."""
    var inv = Float32(exp_f64(Float64(i) * c))
    var sc = sincos_f32_angle(pos * inv)
    return (sc[1], sc[0])
