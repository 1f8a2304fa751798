"""Harness entry for fusekit.rope and fusekit.rope_backward: both layouts, with/without tables, odd head
dims, per-token positions (in range, and untrusted values that must be clamped to [0, St - 1] / [0, 2^24]),
extreme thetas (issue #16: must finish, finite where the fp32 angles are, NaN for an invalid theta);
timing."""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer
from std.utils import IndexList
from std.sys import size_of
from std.math import exp, cos, sin, log

from ..rope import Rope, RopeBackward
from .._util import rope_cos_sin, rope_inv_freq_coef
from ._common import _mut, fill_random, poison, to_host, RelErr, check, tol_for, now_ns, report_bw, device_params, sample_rows


comptime MAX_POSITION = 1 << 24


def _device_ints(ctx: DeviceContext, vals: List[Int32]) raises -> DeviceBuffer[DType.int32]:
    """An int32 device buffer holding vals (at least one element: a [1, 1] dummy when empty)."""
    var n = max(len(vals), 1)
    var h = ctx.enqueue_create_host_buffer[DType.int32](n)
    ctx.synchronize()
    h[0] = 0
    for i in range(len(vals)):
        h[i] = vals[i]
    var d = ctx.enqueue_create_buffer[DType.int32](n)
    ctx.enqueue_copy(d, h)
    ctx.synchronize()
    return d


def _positions(kind: Int, b: Int, s: Int, top: Int, hi: Int, seed: Int) -> List[Int32]:
    """[B, S] positions: kind 1 in [0, top) (out of order, repeats, a left-padded first row);
    kind 2 also untrusted values past both ends (-7, INT32_MIN, hi + 1, INT32_MAX), to be clamped to [0, hi]."""
    var res = List[Int32]()
    for row in range(b * s):
        var v = (row * 7 + seed * 13) % max(top, 1)
        if row < min(2, s):
            v = 1  # left padding as HF's position_ids have it
        res.append(Int32(v))
    if kind == 2:
        comptime extremes = (-7, -2147483648, -1, 2147483647)
        comptime for k in range(4):
            res[min((k * b * s) // 4 + 1, b * s - 1)] = Int32(extremes[k])
        res[(b * s) // 2] = Int32(hi + 1)
    return res^


def _run[dtype: DType, NEG: Bool = False](
    ctx: DeviceContext, ob: DeviceBuffer[dtype], xb: DeviceBuffer[dtype], cb: DeviceBuffer[DType.float32],
    sb: DeviceBuffer[DType.float32], pb: DeviceBuffer[DType.float32], b: Int, s: Int, h: Int, d: Int, st: Int, tw: Int
) raises:
    """Without positions: a [1, 1] int32 dummy (has_positions = 0 in pb, never read)."""
    var dummy = _device_ints(ctx, List[Int32]())
    _run_pos[dtype, NEG](ctx, ob, xb, cb, sb, dummy, pb, b, s, h, d, st, tw, False)


def _run_pos[dtype: DType, NEG: Bool = False](
    ctx: DeviceContext, ob: DeviceBuffer[dtype], xb: DeviceBuffer[dtype], cb: DeviceBuffer[DType.float32],
    sb: DeviceBuffer[DType.float32], posb: DeviceBuffer[DType.int32], pb: DeviceBuffer[DType.float32], b: Int, s: Int,
    h: Int, d: Int, st: Int, tw: Int, has_pos: Bool,
) raises:
    comptime s4 = StaticTensorSpec[dtype, 4, ...].get_unknown()
    comptime f2 = StaticTensorSpec[DType.float32, 2, ...].get_unknown()
    comptime i2 = StaticTensorSpec[DType.int32, 2, ...].get_unknown()
    comptime f1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var shp = IndexList[4](b, s, h, d)
    var strd = IndexList[4](s * h * d, h * d, d, 1)
    var o = MutableInputTensor[static_spec=s4](_mut(ob.unsafe_ptr()), shp, strd)
    var x = InputTensor[static_spec=s4](_mut(xb.unsafe_ptr()), shp, strd)
    var c = InputTensor[static_spec=f2](_mut(cb.unsafe_ptr()), IndexList[2](st, tw), IndexList[2](tw, 1))
    var sn = InputTensor[static_spec=f2](_mut(sb.unsafe_ptr()), IndexList[2](st, tw), IndexList[2](tw, 1))
    var pshape = IndexList[2](b, s) if has_pos else IndexList[2](1, 1)
    var pos = InputTensor[static_spec=i2](_mut(posb.unsafe_ptr()), pshape, IndexList[2](pshape[1], 1))
    var p = InputTensor[static_spec=f1](_mut(pb.unsafe_ptr()), IndexList[1](5), IndexList[1](1))
    # no k: the [1, 1, 1, 1] dummies the dispatcher passes for an absent k / yk (never read nor written)
    var kb = ctx.enqueue_create_buffer[dtype](1)
    var one = IndexList[4](1, 1, 1, 1)
    var ok = MutableInputTensor[static_spec=s4](_mut(kb.unsafe_ptr()), one, one)
    var k = InputTensor[static_spec=s4](_mut(kb.unsafe_ptr()), one, one)
    comptime if NEG:
        RopeBackward.execute["gpu"](o, ok, x, c, sn, pos, k, p, ctx)
    else:
        Rope.execute["gpu"](o, ok, x, c, sn, pos, k, p, ctx)


def rope_case[dtype: DType, NEG: Bool = False](
    ctx: DeviceContext, b: Int, s: Int, h: Int, d: Int, start: Int, inter: Bool, tables: Bool, mut failures: Int, seed: Int,
    theta: Float32 = 10000.0, pos_kind: Int = 0,
) raises:
    """pos_kind 0: token s at start + s; 1, 2: positions [B, S] (see _positions) drawn below start + s
    (the tables' St), start_pos 0."""
    var half = d // 2
    var st = start + s if tables else 1  # dummy [1, 1] tables when has_tables == 0
    var tw = half if tables else 1
    var n = b * s * h * d
    var xb = ctx.enqueue_create_buffer[dtype](n)
    var ob = ctx.enqueue_create_buffer[dtype](n)
    var cb = ctx.enqueue_create_buffer[DType.float32](st * tw)
    var sb = ctx.enqueue_create_buffer[DType.float32](st * tw)
    fill_random(ctx, xb, n, seed, -2.0, 2.0)
    fill_random(ctx, cb, st * tw, seed + 1, -1.0, 1.0)
    fill_random(ctx, sb, st * tw, seed + 2, -1.0, 1.0)
    poison(ctx, ob)
    var hi = st - 1 if tables else MAX_POSITION  # clamping bound of untrusted positions
    var posl = _positions(pos_kind, b, s, start + s, hi, seed) if pos_kind > 0 else List[Int32]()
    var posb = _device_ints(ctx, posl)
    var has_pos = pos_kind > 0
    var pstart = 0 if has_pos else start
    var pb = device_params(
        ctx, Float32(pstart), theta, Float32(1.0 if inter else 0.0), Float32(1.0 if tables else 0.0),
        Float32(1.0 if has_pos else 0.0),
    )
    _run_pos[dtype, NEG](ctx, ob, xb, cb, sb, posb, pb, b, s, h, d, st, tw, has_pos)
    var hx = to_host(ctx, xb, n)
    var ho = to_host(ctx, ob, n)
    var hc = to_host(ctx, cb, st * tw)
    var hs = to_host(ctx, sb, st * tw)
    var e = RelErr()
    var coef = Float32(-2.0 * log(Float64(theta)) / Float64(d))
    for k in range(min(b * s, 40)):
        var row = sample_rows(b * s, k, 40)
        var pos = start + row % s
        if has_pos:
            pos = min(max(Int(posl[row]), 0), hi)
        for i in range(half):
            var c: Float64
            var sn: Float64
            if tables:
                c = hc[pos * half + i].cast[DType.float64]()
                sn = hs[pos * half + i].cast[DType.float64]()
            elif pos >= 65536 or start >= 65536 or theta < 1.0 or theta > 1e30:
                # fp32 angles ~2^20 rad: a 1-ulp difference in fp32 exp (ours vs the host's) moves the
                # angle by ~0.06 rad, so check layout/rotation against the kernel's own angle function
                var cs = rope_cos_sin(Float32(pos), i, rope_inv_freq_coef(theta, d))
                c = cs[0].cast[DType.float64]()
                sn = cs[1].cast[DType.float64]()
            else:  # reference.py: fp32 inv_freq and angle, cos/sin of that fp32 angle
                var ang = Float32(pos) * exp(Float32(i) * coef)
                c = cos(Float64(ang))
                sn = sin(Float64(ang))
            comptime if NEG:
                sn = -sn
            for hh in range(h):
                var base = (row * h + hh) * d
                var ia = base + (2 * i if inter else i)
                var ib = base + (2 * i + 1 if inter else i + half)
                var a = hx[ia].cast[DType.float64]()
                var bb = hx[ib].cast[DType.float64]()
                e.add(ho[ia].cast[DType.float64](), a * c - bb * sn)
                e.add(ho[ib].cast[DType.float64](), bb * c + a * sn)
    var name = String("rope_backward " if NEG else "rope ", dtype, " theta=", theta, " B=", b, " S=", s, " H=", h, " D=", d, " start=", start, " inter=", inter, " tables=", tables, " positions=", pos_kind)
    check(name, e.value(), tol_for[dtype](), failures)


def _nan_theta_case(ctx: DeviceContext, mut failures: Int) raises:
    """theta = inf or 0 in fp32 (1e39, 1e-46): validation rejects them, but the kernel must finish with
    NaN (this used to loop forever in log_f64)."""
    comptime dtype = DType.float32
    var b = 1
    var s = 4
    var h = 2
    var d = 64
    var n = b * s * h * d
    var xb = ctx.enqueue_create_buffer[dtype](n)
    var ob = ctx.enqueue_create_buffer[dtype](n)
    var cb = ctx.enqueue_create_buffer[DType.float32](1)
    var sb = ctx.enqueue_create_buffer[DType.float32](1)
    fill_random(ctx, xb, n, 77, -2.0, 2.0)
    for ti in range(2):
        var theta = Float32(1e30) * Float32(1e30) if ti == 0 else Float32(0.0)
        ob.enqueue_fill(Float32(3.0))  # not NaN: the kernel must write the NaN
        var pb = device_params(ctx, Float32(0.0), theta, Float32(0.0), Float32(0.0), Float32(0.0))
        _run[dtype](ctx, ob, xb, cb, sb, pb, b, s, h, d, 1, 1)
        var ho = to_host(ctx, ob, n)
        var nan_count = 0
        for i in range(n):
            if ho[i] != ho[i]:
                nan_count += 1
        check(String("rope theta=", theta, " finishes with NaN (", nan_count, "/", n, ")"), 0.0 if nan_count == n else 1.0, 0.0, failures)


def rope_bench[dtype: DType](
    ctx: DeviceContext, b: Int, s: Int, h: Int, d: Int, inter: Bool, tables: Bool, iters: Int, positions: Bool = False
) raises:
    var n = b * s * h * d
    var half = d // 2
    var st = s if tables else 1
    var tw = half if tables else 1
    var xb = ctx.enqueue_create_buffer[dtype](n)
    var ob = ctx.enqueue_create_buffer[dtype](n)
    var cb = ctx.enqueue_create_buffer[DType.float32](st * tw)
    var sb = ctx.enqueue_create_buffer[DType.float32](st * tw)
    fill_random(ctx, xb, n, 5, -2.0, 2.0)
    fill_random(ctx, cb, st * tw, 6, -1.0, 1.0)
    fill_random(ctx, sb, st * tw, 7, -1.0, 1.0)
    var posb = _device_ints(ctx, _positions(1, b, s, s, st - 1, 3) if positions else List[Int32]())
    var pb = device_params(
        ctx, Float32(0.0), Float32(10000.0), Float32(1.0 if inter else 0.0), Float32(1.0 if tables else 0.0),
        Float32(1.0 if positions else 0.0),
    )
    _run_pos[dtype](ctx, ob, xb, cb, sb, posb, pb, b, s, h, d, st, tw, positions)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        _run_pos[dtype](ctx, ob, xb, cb, sb, posb, pb, b, s, h, d, st, tw, positions)
    ctx.synchronize()
    var dt = Float64(now_ns() - t0) / Float64(iters)
    var name = String("rope ", dtype, " ", b, "x", s, "x", h, "x", d, " inter=", inter, " tables=", tables)
    report_bw(name + String(" positions=", positions), 2 * n * size_of[dtype](), dt)


def run(bench: Bool = True) raises:
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        comptime for di in range(3):
            comptime dtype = DType.float32 if di == 0 else (DType.float16 if di == 1 else DType.bfloat16)
            var sd = 100 * di
            for li in range(2):
                var inter = li == 1
                for ti in range(2):
                    var tables = ti == 1
                    sd += 10
                    rope_case[dtype](ctx, 1, 1, 1, 2, 0, inter, tables, failures, sd + 1)
                    rope_case[dtype](ctx, 3, 9, 40, 128, 5, inter, tables, failures, sd + 10)
                    rope_case[dtype](ctx, 2, 5, 3, 6, 3, inter, tables, failures, sd + 2)
                    rope_case[dtype](ctx, 2, 7, 4, 64, 0, inter, tables, failures, sd + 3)
                    rope_case[dtype](ctx, 1, 3, 5, 128, 1000, inter, tables, failures, sd + 4)
                    rope_case[dtype](ctx, 2, 33, 8, 256, 17, inter, tables, failures, sd + 5)
                    rope_case[dtype](ctx, 1, 4, 2, 128, 1 << 20, inter, tables, failures, sd + 6)
                    rope_case[dtype, True](ctx, 2, 5, 3, 6, 3, inter, tables, failures, sd + 7)
                    rope_case[dtype, True](ctx, 2, 33, 8, 256, (1 << 24) - 33, inter, tables, failures, sd + 8)
                    rope_case[dtype, True](ctx, 3, 9, 40, 128, 5, inter, tables, failures, sd + 9)
                    # per-token positions (start = their range), then untrusted ones that must be clamped
                    rope_case[dtype](ctx, 3, 7, 5, 128, 40, inter, tables, failures, sd + 11, 10000.0, 1)
                    rope_case[dtype](ctx, 2, 5, 3, 6, 9, inter, tables, failures, sd + 12, 10000.0, 2)
                    rope_case[dtype, True](ctx, 2, 33, 8, 256, 1000, inter, tables, failures, sd + 13, 10000.0, 1)
                    rope_case[dtype, True](ctx, 4, 9, 4, 64, 20, inter, tables, failures, sd + 14, 10000.0, 2)
        # extreme thetas (issue #16): finite fp32 angles up to ~5.7e36, inv_freq ~2.5e37 or ~1e-38
        for ni in range(2):
            rope_case[DType.float32](ctx, 1, 9, 2, 128, (1 << 24) - 9, ni == 1, False, failures, 900 + ni, Float32(1e-30))
            rope_case[DType.float32, True](ctx, 1, 9, 2, 128, 0, ni == 1, False, failures, 902 + ni, Float32(1e-38))
            rope_case[DType.bfloat16](ctx, 1, 9, 2, 128, 13, ni == 1, False, failures, 904 + ni, Float32(3e38))
        _nan_theta_case(ctx, failures)
        if bench:
            rope_bench[DType.bfloat16](ctx, 16, 4096, 32, 128, False, False, 20)
            rope_bench[DType.bfloat16](ctx, 16, 4096, 32, 128, True, False, 20)
            rope_bench[DType.bfloat16](ctx, 16, 4096, 32, 128, False, True, 20)
            rope_bench[DType.bfloat16](ctx, 16, 4096, 8, 64, False, False, 20)
            rope_bench[DType.bfloat16](ctx, 16, 4096, 32, 128, False, False, 20, True)
            rope_bench[DType.bfloat16](ctx, 16, 4096, 32, 128, False, True, 20, True)
    print("rope failures:", failures)
    if failures > 0:
        raise Error("rope: ", failures, " checks failed")
