"""Shared helpers for the fusekit Mojo ops (not an op: files starting with `_` register nothing).

- vector width: 16 bytes per load/store (`ld.global.v4.b32` on sm_90, `global_load_dwordx4` on gfx942);
- accumulator dtype: fp32 for floating inputs (fp64 stays fp64), int64 for integers (reference.py);
- accurate exp / sincos in fp64 built from + and * only: the GPU `cos`/`sin` intrinsics are
  `cos.approx.f32` on sm_90 (useless for RoPE angles up to 2^24 rad) and fp64 `cos` is rejected on
  NVIDIA, so we range-reduce and evaluate polynomials ourselves (same code on CPU and GPU).
"""

from std.sys import size_of


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


def exp_f64(x: Float64) -> Float64:
    """Return exp(x) for |x| <= ~45 (RoPE: x = -2 i ln(theta) / D): exp(x/64)^64, Taylor to degree 16.

    |x/64| <= 0.7 so the series error is < 1e-17; 6 squarings amplify it 64x, still ~1e-15 relative,
    far below the fp32 rounding that follows.
    """
    var r = x * (1.0 / 64.0)
    var p: Float64 = 1.0
    comptime for k in range(16, 0, -1):
        p = 1.0 + p * r * (1.0 / Float64(k))
    comptime for _ in range(6):
        p = p * p
    return p


def sincos_f64(a: Float64) -> Tuple[Float64, Float64]:
    """(sin a, cos a) for 0 <= a < ~2^26: Cody-Waite reduction by pi/2, then Taylor on [-pi/4, pi/4]."""
    comptime TWO_OVER_PI = 0.63661977236758134308
    comptime PIO2_1 = 1.57079632673412561417e00  # first 33 bits of pi/2
    comptime PIO2_1T = 6.07710050650619224932e-11  # pi/2 - PIO2_1
    var kf = Float64(Int(a * TWO_OVER_PI + 0.5))  # a >= 0: truncation == round-half-up
    var r = (a - kf * PIO2_1) - kf * PIO2_1T
    var r2 = r * r
    # sin r = r (1 - r2/3! + r2^2/5! ...), cos r = 1 - r2/2! + ... ; |r| <= pi/4: degree 17/18 is exact in fp64
    var s: Float64 = 1.0
    comptime for k in range(8, 0, -1):
        s = 1.0 - s * r2 * (1.0 / Float64((2 * k) * (2 * k + 1)))
    s = s * r
    var c: Float64 = 1.0
    comptime for k in range(9, 0, -1):
        c = 1.0 - c * r2 * (1.0 / Float64((2 * k - 1) * (2 * k)))
    var q = Int(kf) & 3
    if q == 0:
        return (s, c)
    elif q == 1:
        return (c, -s)
    elif q == 2:
        return (-s, -c)
    return (-c, s)


def log_f64(x: Float64) -> Float64:
    """Return ln(x) for x > 0 (RoPE theta): halve/double into [sqrt(1/2), sqrt(2)), then 2 atanh(z) series.

    Only + * / so it compiles on every target (fp64 transcendental intrinsics do not on NVIDIA).
    """
    comptime LN2 = 0.69314718055994530942
    var m = x
    var k = 0
    while m >= 1.4142135623730951:
        m *= 0.5
        k += 1
    while m < 0.7071067811865476:
        m *= 2.0
        k -= 1
    var z = (m - 1.0) / (m + 1.0)  # |z| <= 0.172: z^23 / 23 < 1e-18
    var z2 = z * z
    var s: Float64 = 0.0
    comptime for j in range(11, -1, -1):
        s = s * z2 + (1.0 / Float64(2 * j + 1))
    return Float64(k) * LN2 + 2.0 * z * s


def rope_inv_freq_coef(theta: Float32, dim: Int) -> Float32:
    """Return the fp32 scalar c with inv_freq[i] = exp(f32(i) * c), as reference.rope_tables computes it
    (`-2.0 * math.log(theta) / head_dim` in fp64, used as an fp32 scalar)."""
    return Float32(-2.0 * log_f64(Float64(theta)) / Float64(dim))


def rope_cos_sin(pos: Float32, i: Int, c: Float32) -> Tuple[Float32, Float32]:
    """Return (cos, sin) of angle f32(pos) * f32(exp(f32(i) * c)): the fp32 products of reference.py,
    with exp / cos / sin evaluated accurately in fp64 and rounded once."""
    var inv = Float32(exp_f64(Float64(Float32(i) * c)))
    var ang = pos * inv
    var sc = sincos_f64(Float64(ang))
    return (Float32(sc[1]), Float32(sc[0]))
