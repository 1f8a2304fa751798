"""Harness body shared by run_rms_norm and run_layer_norm (LN = layer_norm): forward and backward.

Instantiates `execute["gpu"]` of fusekit.<op> and fusekit.<op>_backward for (x, w) dtypes (f32, f32),
(f16, f16), (bf16, bf16), (bf16, f32); on a GPU checks them against float64 host references of
CONTRACT.md (fused residual, rms_norm casting modes, bias, dh), checks that two backward runs are
bit-identical, and times the plain forward and the backward.
"""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer, HostBuffer
from std.utils import IndexList
from std.sys import size_of
from std.math import sqrt
from std.os import getenv

from ..rms_norm import RmsNorm, RmsNormBackward
from ..layer_norm import LayerNorm, LayerNormBackward
from .._norm import norm_gpu
from ._common import _mut, fill_random, poison, to_host, RelErr, check, tol_for, now_ns, report_bw, device_params, sample_rows
from ._common import sm_count, workspace

comptime F32 = DType.float32
comptime F64 = DType.float64


def _t2[dtype: DType](b: DeviceBuffer[dtype], m: Int, n: Int) -> InputTensor[static_spec=StaticTensorSpec[dtype, 2, ...].get_unknown()]:
    return InputTensor[static_spec=StaticTensorSpec[dtype, 2, ...].get_unknown()](
        _mut(b.unsafe_ptr()), IndexList[2](m, n), IndexList[2](n, 1)
    )


def _t1[dtype: DType](b: DeviceBuffer[dtype], n: Int) -> InputTensor[static_spec=StaticTensorSpec[dtype, 1, ...].get_unknown()]:
    return InputTensor[static_spec=StaticTensorSpec[dtype, 1, ...].get_unknown()](
        _mut(b.unsafe_ptr()), IndexList[1](n), IndexList[1](1)
    )


def _o2[dtype: DType](
    b: DeviceBuffer[dtype], m: Int, n: Int
) -> MutableInputTensor[static_spec=StaticTensorSpec[dtype, 2, ...].get_unknown()]:
    return MutableInputTensor[static_spec=StaticTensorSpec[dtype, 2, ...].get_unknown()](
        _mut(b.unsafe_ptr()), IndexList[2](m, n), IndexList[2](n, 1)
    )


def _o1[dtype: DType](b: DeviceBuffer[dtype], n: Int) -> MutableInputTensor[static_spec=StaticTensorSpec[dtype, 1, ...].get_unknown()]:
    return MutableInputTensor[static_spec=StaticTensorSpec[dtype, 1, ...].get_unknown()](
        _mut(b.unsafe_ptr()), IndexList[1](n), IndexList[1](1)
    )


def _f64[dtype: DType](v: Scalar[dtype]) -> Float64:
    return v.cast[F64]()


def _rx[dtype: DType](v: Float64) -> Float64:
    """round_x: the value rounded to x's dtype, back in float64."""
    return v.cast[dtype]().cast[F64]()


struct Flags(Copyable, Movable):
    """One case's optional parts: casting (rms_norm), residual / dh, bias / db (layer_norm)."""

    var casting: Int
    var res: Bool
    var bias: Bool

    def __init__(out self, casting: Int, res: Bool, bias: Bool):
        self.casting = casting
        self.res = res
        self.bias = bias

    def params[LN: Bool](self, ctx: DeviceContext, eps: Float32) raises -> DeviceBuffer[F32]:
        comptime if LN:
            return device_params(ctx, eps, Float32(1.0 if self.res else 0.0), Float32(1.0 if self.bias else 0.0))
        else:
            return device_params(ctx, eps, Float32(self.casting), Float32(1.0 if self.res else 0.0))

    def name[LN: Bool](self) -> String:
        var s = String(" residual=", self.res)
        comptime if LN:
            s += String(" bias=", self.bias)
        else:
            s += String(" casting=", self.casting)
        return s


def _fwd_op[dtype: DType, wdtype: DType, LN: Bool](
    ctx: DeviceContext, yb: DeviceBuffer[dtype], hb: DeviceBuffer[dtype], mb: DeviceBuffer[F32], rb: DeviceBuffer[F32],
    xb: DeviceBuffer[dtype], resb: DeviceBuffer[dtype], wb: DeviceBuffer[wdtype], bb: DeviceBuffer[wdtype],
    pb: DeviceBuffer[F32], m: Int, n: Int, f: Flags
) raises:
    """Run the op as MAX would: absent optional tensors are 1-element dummies of the declared rank."""
    var hm = m if f.res else 1
    var hn = n if f.res else 1
    var np = 3
    comptime if LN:
        LayerNorm.execute["gpu"](
            _o2(yb, m, n), _o2(hb, hm, hn), _o1(mb, m), _o1(rb, m), _t2(xb, m, n), _t2(resb, hm, hn), _t1(wb, n),
            _t1(bb, n if f.bias else 1), _t1(pb, np), ctx
        )
    else:
        RmsNorm.execute["gpu"](
            _o2(yb, m, n), _o2(hb, hm, hn), _o1(rb, m), _t2(xb, m, n), _t2(resb, hm, hn), _t1(wb, n), _t1(pb, np), ctx
        )


def _bwd_op[dtype: DType, wdtype: DType, LN: Bool](
    ctx: DeviceContext, dxb: DeviceBuffer[dtype], dwb: DeviceBuffer[wdtype], dbb: DeviceBuffer[wdtype],
    dyb: DeviceBuffer[dtype], dhb: DeviceBuffer[dtype], xb: DeviceBuffer[dtype], wb: DeviceBuffer[wdtype],
    mb: DeviceBuffer[F32], rb: DeviceBuffer[F32], pb: DeviceBuffer[F32], m: Int, n: Int, f: Flags
) raises:
    var hm = m if f.res else 1
    var hn = n if f.res else 1
    # the caller's workspaces, per call as the Python side does: sums [M, 2], and [P, N] partials with
    # P <= max(1, min(M, 16 SMs)) on every plan of norm_bwd_gpu (blocks of >= 64 threads, ~1024 per SM)
    var np = max(1, min(m, 16 * sm_count(ctx))) * n
    var sb = workspace[F32](ctx, 2 * m)
    var pwb = workspace[F32](ctx, np)
    comptime if LN:
        var pbb = workspace[F32](ctx, np)
        LayerNormBackward.execute["gpu"](
            _o2(dxb, m, n), _o1(dwb, n), _o1(dbb, n if f.bias else 1), _o1(sb, 2 * m), _o1(pwb, np), _o1(pbb, np),
            _t2(dyb, m, n), _t2(dhb, hm, hn), _t2(xb, m, n), _t1(wb, n), _t1(mb, m), _t1(rb, m), _t1(pb, 3), ctx
        )
    else:
        RmsNormBackward.execute["gpu"](
            _o2(dxb, m, n), _o1(dwb, n), _o1(sb, 2 * m), _o1(pwb, np), _t2(dyb, m, n), _t2(dhb, hm, hn),
            _t2(xb, m, n), _t1(wb, n), _t1(rb, m), _t1(pb, 3), ctx
        )


def norm_case[dtype: DType, wdtype: DType, LN: Bool](
    ctx: DeviceContext, m: Int, n: Int, f: Flags, mut failures: Int, seed: Int
) raises:
    var eps = Float32(1e-5)
    var xb = ctx.enqueue_create_buffer[dtype](m * n)
    var resb = ctx.enqueue_create_buffer[dtype](m * n if f.res else 1)
    var wb = ctx.enqueue_create_buffer[wdtype](n)
    var bb = ctx.enqueue_create_buffer[wdtype](n if f.bias else 1)
    var yb = ctx.enqueue_create_buffer[dtype](m * n)
    var hb = ctx.enqueue_create_buffer[dtype](m * n if f.res else 1)
    var mb = ctx.enqueue_create_buffer[F32](m)
    var rb = ctx.enqueue_create_buffer[F32](m)
    fill_random(ctx, xb, m * n, seed, -1.5, 2.5)  # nonzero mean: exercises the two-pass variance
    fill_random(ctx, wb, n, seed + 1000, 0.5, 1.5)
    if f.res:
        fill_random(ctx, resb, m * n, seed + 3000, -1.0, 1.0)
    else:
        poison(ctx, resb)  # a dummy: NaN reaches y if it is read
    if f.bias:
        fill_random(ctx, bb, n, seed + 2000, -0.5, 0.5)
    else:
        poison(ctx, bb)
    poison(ctx, yb)
    poison(ctx, hb)
    poison(ctx, mb)
    poison(ctx, rb)
    var pb = f.params[LN](ctx, eps)
    _fwd_op[dtype, wdtype, LN](ctx, yb, hb, mb, rb, xb, resb, wb, bb, pb, m, n, f)
    var hx = to_host(ctx, xb, m * n)
    var hres = to_host(ctx, resb, m * n if f.res else 1)
    var hw = to_host(ctx, wb, n)
    var hbias = to_host(ctx, bb, n if f.bias else 1)
    var hy = to_host(ctx, yb, m * n)
    var hh = to_host(ctx, hb, m * n if f.res else 1)
    var hm = to_host(ctx, mb, m)
    var hr = to_host(ctx, rb, m)
    var ey = RelErr()
    var er = RelErr()
    var em = RelErr()
    var h_bad = 0
    var xin = List[Float64](length=n, fill=0)
    for i in range(min(m, 48)):
        var r = sample_rows(m, i, 48)
        for j in range(n):
            var v = hx[r * n + j]
            if f.res:
                var hv = (v.cast[F32]() + hres[r * n + j].cast[F32]()).cast[dtype]()
                if not (hh[r * n + j] == hv):
                    h_bad += 1
                v = hv
            xin[j] = _f64(v)
        var mean = Float64(0)
        comptime if LN:
            for j in range(n):
                mean += xin[j]
            mean /= Float64(n)
            em.add(_f64(hm[r]), mean)
        var q = Float64(0)
        for j in range(n):
            q += (xin[j] - mean) * (xin[j] - mean)
        var rstd = 1.0 / sqrt(q / Float64(n) + Float64(eps))
        er.add(_f64(hr[r]), rstd)
        for j in range(n):
            var t = (xin[j] - mean) * rstd
            var wv = _f64(hw[j])
            if not LN and f.casting == 1:
                t = _rx[dtype](t)
            if not LN and f.casting == 2:
                wv += 1.0
            var want = t * wv
            if LN and f.bias:
                want += _f64(hbias[j])
            ey.add(_f64(hy[r * n + j]), want)
    if not f.res and not (hh[0] != hh[0]):
        h_bad += 1  # the h dummy was written
    var name = String("layer_norm" if LN else "rms_norm", " ", dtype, "/", wdtype, " M=", m, " N=", n, f.name[LN]())
    check(name + " out", ey.value(), tol_for[dtype](), failures)
    check(name + " rstd", er.value(), 1e-5, failures)
    if LN:
        check(name + " mean", em.value(), 1e-5, failures)
    check(name + " h (exact, or dummy untouched)", Float64(h_bad), 0.0, failures)


def norm_bwd_case[dtype: DType, wdtype: DType, LN: Bool](
    ctx: DeviceContext, m: Int, n: Int, f: Flags, mut failures: Int, seed: Int
) raises:
    """Backward against float64 (dx on sampled rows, dw / db over all rows), plus a bitwise rerun."""
    var eps = Float32(1e-5)
    var xb = ctx.enqueue_create_buffer[dtype](m * n)
    var dyb = ctx.enqueue_create_buffer[dtype](m * n)
    var dhb = ctx.enqueue_create_buffer[dtype](m * n if f.res else 1)
    var wb = ctx.enqueue_create_buffer[wdtype](n)
    var dxb = ctx.enqueue_create_buffer[dtype](m * n)
    var dwb = ctx.enqueue_create_buffer[wdtype](n)
    var dbb = ctx.enqueue_create_buffer[wdtype](n if f.bias else 1)
    fill_random(ctx, xb, m * n, seed, -1.5, 2.5)
    fill_random(ctx, dyb, m * n, seed + 500, -1.0, 1.0)
    fill_random(ctx, wb, n, seed + 1000, 0.5, 1.5)
    if f.res:
        fill_random(ctx, dhb, m * n, seed + 1500, -1.0, 1.0)
    else:
        poison(ctx, dhb)
    poison(ctx, dxb)
    poison(ctx, dwb)
    poison(ctx, dbb)
    var hx = to_host(ctx, xb, m * n)
    var hdy = to_host(ctx, dyb, m * n)
    var hdh = to_host(ctx, dhb, m * n if f.res else 1)
    var hw = to_host(ctx, wb, n)
    # statistics as the forward stores them (fp32), computed here in float64
    var hmean = ctx.enqueue_create_host_buffer[F32](m)
    var hrstd = ctx.enqueue_create_host_buffer[F32](m)
    ctx.synchronize()
    for r in range(m):
        var mean = Float64(0)
        comptime if LN:
            for j in range(n):
                mean += _f64(hx[r * n + j])
            mean /= Float64(n)
        var q = Float64(0)
        for j in range(n):
            var d = _f64(hx[r * n + j]) - mean
            q += d * d
        hmean[r] = Float32(mean)
        hrstd[r] = Float32(1.0 / sqrt(q / Float64(n) + Float64(eps)))
    var mb = ctx.enqueue_create_buffer[F32](m)
    var rb = ctx.enqueue_create_buffer[F32](m)
    ctx.enqueue_copy(mb, hmean)
    ctx.enqueue_copy(rb, hrstd)
    var pb = f.params[LN](ctx, eps)
    _bwd_op[dtype, wdtype, LN](ctx, dxb, dwb, dbb, dyb, dhb, xb, wb, mb, rb, pb, m, n, f)
    var hdx = to_host(ctx, dxb, m * n)
    var hdw = to_host(ctx, dwb, n)
    var hdb = to_host(ctx, dbb, n if f.bias else 1)
    # second run into fresh (poisoned) outputs: must be bit-identical
    var dx2 = ctx.enqueue_create_buffer[dtype](m * n)
    var dw2 = ctx.enqueue_create_buffer[wdtype](n)
    var db2 = ctx.enqueue_create_buffer[wdtype](n if f.bias else 1)
    poison(ctx, dx2)
    poison(ctx, dw2)
    poison(ctx, db2)
    _bwd_op[dtype, wdtype, LN](ctx, dx2, dw2, db2, dyb, dhb, xb, wb, mb, rb, pb, m, n, f)
    var hdx2 = to_host(ctx, dx2, m * n)
    var hdw2 = to_host(ctx, dw2, n)
    var hdb2 = to_host(ctx, db2, n if f.bias else 1)
    var nondet = 0
    for i in range(m * n):
        if hdx[i] != hdx2[i]:
            nondet += 1
    for j in range(n):
        if hdw[j] != hdw2[j]:
            nondet += 1
        if LN and f.bias and hdb[j] != hdb2[j]:
            nondet += 1
    # references: dx on sampled rows (error scaled by |rstd * g|, see tests/test_mojo_norm_grad.py),
    # dw / db over all rows (scaled by the 2-norm of the summed terms)
    var dx_num = Float64(0)
    var dx_den = Float64(0)
    var dx_nan = 0
    var sw = List[Float64](length=n, fill=0)
    var sw2 = List[Float64](length=n, fill=0)
    var sb = List[Float64](length=n, fill=0)
    var sb2 = List[Float64](length=n, fill=0)
    var g = List[Float64](length=n, fill=0)
    var xh = List[Float64](length=n, fill=0)
    var checked = 0
    for r in range(m):
        var mean = _f64(hmean[r])
        var rstd = _f64(hrstd[r])
        var c1 = Float64(0)
        var c2 = Float64(0)
        for j in range(n):
            xh[j] = (_f64(hx[r * n + j]) - mean) * rstd
            var wv = _f64(hw[j])
            if not LN and f.casting == 2:
                wv += 1.0
            var dyv = _f64(hdy[r * n + j])
            g[j] = dyv * wv
            c1 += g[j] * xh[j]
            c2 += g[j]
            var xw = xh[j]
            if not LN and f.casting == 1:
                xw = _rx[dtype](xw)
            sw[j] += dyv * xw
            sw2[j] += (dyv * xw) * (dyv * xw)
            sb[j] += dyv
            sb2[j] += dyv * dyv
        c1 /= Float64(n)
        c2 /= Float64(n)
        if checked < 48 and r == sample_rows(m, checked, 48):
            checked += 1
            for j in range(n):
                var want = g[j] - xh[j] * c1
                if LN:
                    want -= c2
                want *= rstd
                if f.res:
                    want += _f64(hdh[r * n + j])
                var got = _f64(hdx[r * n + j])
                if got != got:
                    dx_nan += 1
                dx_num += (got - want) * (got - want)
                dx_den += max(want * want, rstd * rstd * g[j] * g[j])
    var ew = RelErr()
    var eb = RelErr()
    var w_den = Float64(0)
    var b_den = Float64(0)
    for j in range(n):
        ew.add(_f64(hdw[j]), sw[j])
        w_den += sw2[j]
        if f.bias:
            eb.add(_f64(hdb[j]), sb[j])
            b_den += sb2[j]
    ew.den = max(ew.den, w_den)
    eb.den = max(eb.den, b_den)
    var name = String(
        "layer_norm_backward" if LN else "rms_norm_backward", " ", dtype, "/", wdtype, " M=", m, " N=", n, f.name[LN]()
    )
    var tol = 2.0 * tol_for[dtype]()
    var dx_err = Float64.MAX_FINITE if dx_nan > 0 else sqrt(dx_num / max(dx_den, 1e-300))
    check(name + " dx", dx_err, tol, failures)
    check(name + " dw", ew.value(), tol, failures)
    if LN and f.bias:
        check(name + " db", eb.value(), tol, failures)
    if LN and not f.bias and not (hdb[0] != hdb[0]):
        nondet += 1  # the db dummy was written
    check(name + " bit-identical rerun (and db dummy untouched)", Float64(nondet), 0.0, failures)


def _run_forced[dtype: DType, LN: Bool](
    ctx: DeviceContext, yb: DeviceBuffer[dtype], mb: DeviceBuffer[F32], rb: DeviceBuffer[F32],
    xb: DeviceBuffer[dtype], wb: DeviceBuffer[dtype], pb: DeviceBuffer[F32], m: Int, n: Int
) raises:
    norm_gpu[dtype, dtype, LN, True](
        ctx, _mut(yb.unsafe_ptr()), _mut(yb.unsafe_ptr()), _mut(mb.unsafe_ptr()), _mut(rb.unsafe_ptr()),
        _mut(xb.unsafe_ptr()), _mut(xb.unsafe_ptr()), _mut(wb.unsafe_ptr()), _mut(wb.unsafe_ptr()),
        _mut(pb.unsafe_ptr()), m, n
    )


def norm_bench[dtype: DType, LN: Bool, FORCE_LOOP: Bool = False](
    ctx: DeviceContext, m: Int, n: Int, iters: Int, res: Bool = False
) raises:
    """Forward timing; `res` adds the fused residual (reads x and residual, writes y and h)."""
    var xb = ctx.enqueue_create_buffer[dtype](m * n)
    var rsb = ctx.enqueue_create_buffer[dtype](m * n if res else 1)
    var wb = ctx.enqueue_create_buffer[dtype](n)
    var yb = ctx.enqueue_create_buffer[dtype](m * n)
    var hb = ctx.enqueue_create_buffer[dtype](m * n if res else 1)
    var mb = ctx.enqueue_create_buffer[F32](m)
    var rb = ctx.enqueue_create_buffer[F32](m)
    fill_random(ctx, xb, m * n, 7, -1.5, 2.5)
    fill_random(ctx, rsb, m * n if res else 1, 9, -1.0, 1.0)
    fill_random(ctx, wb, n, 8, 0.5, 1.5)
    var f = Flags(0, res, True)
    var pb = f.params[LN](ctx, Float32(1e-5))
    _fwd_op[dtype, dtype, LN](ctx, yb, hb, mb, rb, xb, rsb, wb, wb, pb, m, n, f)  # warm-up (bias = weight)
    _run_forced[dtype, LN](ctx, yb, mb, rb, xb, wb, pb, m, n)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        comptime if FORCE_LOOP:
            _run_forced[dtype, LN](ctx, yb, mb, rb, xb, wb, pb, m, n)
        else:
            _fwd_op[dtype, dtype, LN](ctx, yb, hb, mb, rb, xb, rsb, wb, wb, pb, m, n, f)
    ctx.synchronize()
    var dt = Float64(now_ns() - t0) / Float64(iters)
    var bytes = (4 if res else 2) * m * n * size_of[dtype]() + m * 4 * (2 if LN else 1)
    var name = String("layer_norm" if LN else "rms_norm", " ", dtype, " M=", m, " N=", n)
    if FORCE_LOOP:
        name += " (reload kernel)"
    if res:
        name += " +residual"
    report_bw(name, bytes, dt)


def norm_bwd_bench[dtype: DType, wdtype: DType, LN: Bool](
    ctx: DeviceContext, m: Int, n: Int, iters: Int, res: Bool
) raises:
    """Backward timing (dy, xin [, dh] read, dx written; partials and their reduction included)."""
    var xb = ctx.enqueue_create_buffer[dtype](m * n)
    var dyb = ctx.enqueue_create_buffer[dtype](m * n)
    var dhb = ctx.enqueue_create_buffer[dtype](m * n if res else 1)
    var wb = ctx.enqueue_create_buffer[wdtype](n)
    var dxb = ctx.enqueue_create_buffer[dtype](m * n)
    var dwb = ctx.enqueue_create_buffer[wdtype](n)
    var dbb = ctx.enqueue_create_buffer[wdtype](n)
    var mb = ctx.enqueue_create_buffer[F32](m)
    var rb = ctx.enqueue_create_buffer[F32](m)
    fill_random(ctx, xb, m * n, 7, -1.5, 2.5)
    fill_random(ctx, dyb, m * n, 8, -1.0, 1.0)
    fill_random(ctx, dhb, m * n if res else 1, 9, -1.0, 1.0)
    fill_random(ctx, wb, n, 10, 0.5, 1.5)
    fill_random(ctx, mb, m, 11, -0.1, 0.1)
    fill_random(ctx, rb, m, 12, 0.5, 1.5)
    var f = Flags(0, res, True)
    var pb = f.params[LN](ctx, Float32(1e-5))
    _bwd_op[dtype, wdtype, LN](ctx, dxb, dwb, dbb, dyb, dhb, xb, wb, mb, rb, pb, m, n, f)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        _bwd_op[dtype, wdtype, LN](ctx, dxb, dwb, dbb, dyb, dhb, xb, wb, mb, rb, pb, m, n, f)
    ctx.synchronize()
    var dt = Float64(now_ns() - t0) / Float64(iters)
    var bytes = (4 if res else 3) * m * n * size_of[dtype]() + m * 4 * (2 if LN else 1)
    var name = String("layer_norm_backward" if LN else "rms_norm_backward", " ", dtype, "/", wdtype, " M=", m, " N=", n)
    if res:
        name += " +dh"
    report_bw(name, bytes, dt)


def _cases[dtype: DType, wdtype: DType, LN: Bool](ctx: DeviceContext, mut failures: Int, s: Int) raises:
    # forward: every kernel plan (scalar loop W=1 for odd N, the register tables, the long-row loop),
    # each optional part on and off
    var shapes = [(1, 1), (3, 37), (5, 1000), (2, 4097), (300, 128), (64, 8192), (9, 16384), (3, 65536), (2, 100000), (2, 200003)]
    var k = 0
    for sh in shapes:
        var m = sh[0]
        var n = sh[1]
        k += 1
        norm_case[dtype, wdtype, LN](ctx, m, n, Flags(k % 3, k % 2 == 0, k % 2 == 1), failures, s + k)
        norm_case[dtype, wdtype, LN](ctx, m, n, Flags((k + 1) % 3, k % 2 == 1, k % 2 == 0), failures, s + 50 + k)
    # backward: whole-row register kernels (N <= 8192), column-tiled long rows (M < and > the row groups),
    # the W = 1 loop kernel (odd N), M < and > the persistent grid
    var bshapes = [(1, 1), (7, 33), (300, 760), (1000, 1024), (5, 4097), (2000, 8192), (40, 16384), (300, 24576), (6, 40000), (3, 65536)]
    for sh in bshapes:
        var m = sh[0]
        var n = sh[1]
        k += 1
        norm_bwd_case[dtype, wdtype, LN](ctx, m, n, Flags(k % 3, k % 2 == 0, k % 2 == 1), failures, s + k)
        norm_bwd_case[dtype, wdtype, LN](ctx, m, n, Flags((k + 1) % 3, k % 2 == 1, k % 2 == 0), failures, s + 50 + k)


def norm_run[LN: Bool](bench: Bool) raises:
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        if getenv("FUSEKIT_HARNESS_ONLY") == "norm_bwd":  # the bf16 backward timings alone (for a profiler)
            norm_bwd_bench[DType.bfloat16, DType.bfloat16, LN](ctx, 32768, 8192, 3, False)
            norm_bwd_bench[DType.bfloat16, DType.bfloat16, LN](ctx, 32768, 4096, 3, False)
            norm_bwd_bench[DType.bfloat16, DType.float32, LN](ctx, 32768, 8192, 3, True)
            return
        _cases[DType.float32, DType.float32, LN](ctx, failures, 0)
        _cases[DType.float16, DType.float16, LN](ctx, failures, 100)
        _cases[DType.bfloat16, DType.bfloat16, LN](ctx, failures, 200)
        _cases[DType.bfloat16, DType.float32, LN](ctx, failures, 300)
        if bench and getenv("FUSEKIT_HARNESS_BENCH") != "0":  # "0": checks only (sanitizers)
            norm_bench[DType.bfloat16, LN](ctx, 32768, 8192, 20)
            norm_bench[DType.bfloat16, LN](ctx, 32768, 8192, 20, True)
            norm_bench[DType.bfloat16, LN](ctx, 16384, 16384, 20)  # 512-thread register kernel
            norm_bench[DType.bfloat16, LN](ctx, 524288, 512, 10)  # 64-thread register kernel
            norm_bench[DType.bfloat16, LN](ctx, 16384, 65536, 5)
            norm_bench[DType.bfloat16, LN, True](ctx, 16384, 65536, 5)
            norm_bench[DType.float32, LN](ctx, 32768, 8192, 10)
            norm_bwd_bench[DType.bfloat16, DType.bfloat16, LN](ctx, 32768, 8192, 10, False)
            norm_bwd_bench[DType.bfloat16, DType.float32, LN](ctx, 32768, 8192, 10, True)
            norm_bwd_bench[DType.bfloat16, DType.bfloat16, LN](ctx, 32768, 1024, 20, False)
            norm_bwd_bench[DType.bfloat16, DType.bfloat16, LN](ctx, 32768, 4096, 20, False)
            norm_bwd_bench[DType.bfloat16, DType.bfloat16, LN](ctx, 16384, 16384, 10, False)
            norm_bwd_bench[DType.bfloat16, DType.bfloat16, LN](ctx, 4096, 65536, 5, False)
            norm_bwd_bench[DType.float32, DType.float32, LN](ctx, 32768, 8192, 10, False)
    var op = "layer_norm" if LN else "rms_norm"
    print(op, "failures:", failures)
    if failures > 0:
        raise Error(op, ": ", failures, " checks failed")
