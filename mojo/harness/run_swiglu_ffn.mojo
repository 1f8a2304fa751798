"""Harness entry for fusekit.swiglu_ffn: execute["gpu"] checks (host float64 with the reference's
rounding points; the GEMV path as the GPU reference for the tensor-core prefill path) and timing."""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer, HostBuffer
from std.utils import IndexList
from std.math import exp, sqrt

from ..swiglu_ffn import SwigluFfnBackward, FfnScratch, _tc_rows
from ..tc.swiglu_ffn_tc import SwigluFfnTc, swiglu_ffn_gpu
from ._common import _mut, fill_random, poison, to_host, RelErr, check, now_ns, device_params, workspace


struct _Bufs[dtype: DType](Movable):
    var x: DeviceBuffer[Self.dtype]
    var wg: DeviceBuffer[Self.dtype]
    var wu: DeviceBuffer[Self.dtype]
    var wd: DeviceBuffer[Self.dtype]
    var nw: DeviceBuffer[Self.dtype]
    var o: DeviceBuffer[Self.dtype]
    var r: DeviceBuffer[Self.dtype]
    var rstd: DeviceBuffer[DType.float32]
    # the op's workspaces, sized for either path: Tp rows (>= the GEMV path's T and 16-row chunk)
    var xn: DeviceBuffer[Self.dtype]
    var h: DeviceBuffer[Self.dtype]
    var g: DeviceBuffer[DType.float32]
    var out_pad: DeviceBuffer[Self.dtype]
    var tp: Int
    var d: Int
    var f: Int

    def __init__(out self, ctx: DeviceContext, T: Int, D: Int, F: Int, seed: Int) raises:
        self.x = ctx.enqueue_create_buffer[Self.dtype](T * D)
        self.wg = ctx.enqueue_create_buffer[Self.dtype](F * D)
        self.wu = ctx.enqueue_create_buffer[Self.dtype](F * D)
        self.wd = ctx.enqueue_create_buffer[Self.dtype](D * F)
        self.nw = ctx.enqueue_create_buffer[Self.dtype](D)
        self.o = ctx.enqueue_create_buffer[Self.dtype](T * D)
        self.r = ctx.enqueue_create_buffer[Self.dtype](T * D)
        self.rstd = ctx.enqueue_create_buffer[DType.float32](T)
        self.tp = _tc_rows(T)
        self.d = D
        self.f = F
        self.xn = workspace[Self.dtype](ctx, self.tp * D)
        self.h = workspace[Self.dtype](ctx, self.tp * F)
        self.g = workspace[DType.float32](ctx, self.tp * F)
        self.out_pad = workspace[Self.dtype](ctx, self.tp * D)
        var a = 1.7 / sqrt(Float64(D))  # uniform(-a, a): std ~ 1/sqrt(D)
        var b = 1.7 / sqrt(Float64(F))
        fill_random(ctx, self.x, T * D, seed, -1.0, 1.0)
        fill_random(ctx, self.wg, F * D, seed + 1, -a, a)
        fill_random(ctx, self.wu, F * D, seed + 2, -a, a)
        fill_random(ctx, self.wd, D * F, seed + 3, -b, b)
        fill_random(ctx, self.nw, D, seed + 4, 0.8, 1.2)
        poison(ctx, self.o)
        poison(ctx, self.r)

    def scratch(self) -> FfnScratch[Self.dtype]:
        var nd = self.tp * self.d
        var nf = self.tp * self.f
        return FfnScratch[Self.dtype](
            _mut(self.xn.unsafe_ptr()), nd, _mut(self.h.unsafe_ptr()), nf, _mut(self.g.unsafe_ptr()), nf,
            _mut(self.out_pad.unsafe_ptr()), nd,
        )


def _host_ref_err[
    dtype: DType
](
    ctx: DeviceContext, bufs: _Bufs[dtype], T: Int, D: Int, F: Int, eps: Float64, has_norm: Bool, row_step: Int = 1
) raises -> Float64:
    """float64 math with the reference's rounding points (xn and h rounded to dtype); rows t with
    t % row_step == 0 and the last row (row_step > 1: large shapes, where host float64 is slow)."""
    var hx = to_host(ctx, bufs.x, T * D)
    var hg = to_host(ctx, bufs.wg, F * D)
    var hu = to_host(ctx, bufs.wu, F * D)
    var hd = to_host(ctx, bufs.wd, D * F)
    var hn = to_host(ctx, bufs.nw, D)
    var ho = to_host(ctx, bufs.o, T * D)
    var e = RelErr()
    var xn = List[Float64](length=D, fill=0)
    var hh = List[Float64](length=F, fill=0)
    for t in range(T):
        if t % row_step != 0 and t != T - 1:
            continue
        var ss = Float64(0)
        for j in range(D):
            var v = hx[t * D + j].cast[DType.float64]()
            ss += v * v
        var rstd = 1.0 / sqrt(ss / Float64(D) + eps)
        for j in range(D):
            var v = hx[t * D + j].cast[DType.float64]()
            if has_norm:
                v = (v * rstd * hn[j].cast[DType.float64]()).cast[dtype]().cast[DType.float64]()
            xn[j] = v
        for f in range(F):
            var g = Float64(0)
            var u = Float64(0)
            for j in range(D):
                g += xn[j] * hg[f * D + j].cast[DType.float64]()
                u += xn[j] * hu[f * D + j].cast[DType.float64]()
            hh[f] = (g / (1.0 + exp(-g)) * u).cast[dtype]().cast[DType.float64]()
        for d in range(D):
            var acc = Float64(0)
            for f in range(F):
                acc += hh[f] * hd[d * F + f].cast[DType.float64]()
            e.add(ho[t * D + d].cast[DType.float64](), acc)
    return e.value()


def _run_op[dtype: DType](ctx: DeviceContext, bufs: _Bufs[dtype], T: Int, D: Int, F: Int, pb: DeviceBuffer[DType.float32]) raises:
    comptime s2 = StaticTensorSpec[dtype, 2, ...].get_unknown()
    comptime s1 = StaticTensorSpec[dtype, 1, ...].get_unknown()
    comptime sp = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var x = InputTensor[static_spec=s2](_mut(bufs.x.unsafe_ptr()), IndexList[2](T, D), IndexList[2](D, 1))
    var wg = InputTensor[static_spec=s2](_mut(bufs.wg.unsafe_ptr()), IndexList[2](F, D), IndexList[2](D, 1))
    var wu = InputTensor[static_spec=s2](_mut(bufs.wu.unsafe_ptr()), IndexList[2](F, D), IndexList[2](D, 1))
    var wd = InputTensor[static_spec=s2](_mut(bufs.wd.unsafe_ptr()), IndexList[2](D, F), IndexList[2](F, 1))
    var nw = InputTensor[static_spec=s1](_mut(bufs.nw.unsafe_ptr()), IndexList[1](D), IndexList[1](1))
    var p = InputTensor[static_spec=sp](_mut(pb.unsafe_ptr()), IndexList[1](3), IndexList[1](1))
    var o = MutableInputTensor[static_spec=s2](_mut(bufs.o.unsafe_ptr()), IndexList[2](T, D), IndexList[2](D, 1))
    comptime sr = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var rs = MutableInputTensor[static_spec=sr](_mut(bufs.rstd.unsafe_ptr()), IndexList[1](T), IndexList[1](1))
    # gu is a [1, 1] dummy (save = 0): the op never touches it
    var gu = MutableInputTensor[static_spec=s2](_mut(bufs.r.unsafe_ptr()), IndexList[2](1, 1), IndexList[2](1, 1))
    var nd = bufs.tp * D
    var nf = bufs.tp * F
    var xn = MutableInputTensor[static_spec=s1](_mut(bufs.xn.unsafe_ptr()), IndexList[1](nd), IndexList[1](1))
    var h = MutableInputTensor[static_spec=s1](_mut(bufs.h.unsafe_ptr()), IndexList[1](nf), IndexList[1](1))
    var g = MutableInputTensor[static_spec=sr](_mut(bufs.g.unsafe_ptr()), IndexList[1](nf), IndexList[1](1))
    var op = MutableInputTensor[static_spec=s1](_mut(bufs.out_pad.unsafe_ptr()), IndexList[1](nd), IndexList[1](1))
    SwigluFfnTc.execute["gpu"](o, rs, gu, xn, h, g, op, x, wg, wu, wd, nw, p, ctx)  # the op with the wgmma path


def _case[
    dtype: DType
](ctx: DeviceContext, T: Int, D: Int, F: Int, has_norm: Bool, host_ref: Bool, mut failures: Int, seed: Int) raises:
    var bufs = _Bufs[dtype](ctx, T, D, F, seed)
    var eps = 1e-6
    var pb = device_params(ctx, Float32(eps), Float32(1.0) if has_norm else Float32(0.0), Float32(0.0))
    _run_op[dtype](ctx, bufs, T, D, F, pb)
    var name = String("swiglu_ffn ", dtype, " T=", T, " D=", D, " F=", F, " norm=", has_norm)
    var tol = 1e-2 if dtype == DType.bfloat16 else 2e-3
    if host_ref:
        check(name + " vs host f64", _host_ref_err[dtype](ctx, bufs, T, D, F, eps, has_norm), tol, failures)
    else:
        # the GEMV path (fp32 u, no tensor cores) as the GPU reference for the prefill path
        swiglu_ffn_gpu[dtype](
            _mut(bufs.r.unsafe_ptr()), _mut(bufs.rstd.unsafe_ptr()), _mut(bufs.x.unsafe_ptr()), _mut(bufs.wg.unsafe_ptr()),
            _mut(bufs.wu.unsafe_ptr()), _mut(bufs.wd.unsafe_ptr()), _mut(bufs.nw.unsafe_ptr()),
            _mut(pb.unsafe_ptr()), T, D, F, ctx, bufs.scratch(), allow_tc=False,
        )
        var ho = to_host(ctx, bufs.o, T * D)
        var hr = to_host(ctx, bufs.r, T * D)
        var e = RelErr()
        for i in range(T * D):
            e.add(ho[i].cast[DType.float64](), hr[i].cast[DType.float64]())
        check(name + " vs GEMV GPU path", e.value(), tol, failures)


def _backward_case[dtype: DType](ctx: DeviceContext, T: Int, D: Int, F: Int, mut failures: Int, seed: Int) raises:
    """fusekit.swiglu_ffn_backward (the element-wise part; the GEMMs are torch's) against host float64:
    h = g sig u, dg = dh u sig (1 + g (1 - sig)), du = dh g sig from gu = [g, u]; xn = (x rstd) nw."""
    comptime s2 = StaticTensorSpec[dtype, 2, ...].get_unknown()
    comptime s1 = StaticTensorSpec[dtype, 1, ...].get_unknown()
    comptime f1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var gub = ctx.enqueue_create_buffer[dtype](T * 2 * F)
    var dhb = ctx.enqueue_create_buffer[dtype](T * F)
    var hb = ctx.enqueue_create_buffer[dtype](T * F)
    var dgb = ctx.enqueue_create_buffer[dtype](T * F)
    var dub = ctx.enqueue_create_buffer[dtype](T * F)
    var xb = ctx.enqueue_create_buffer[dtype](T * D)
    var xnb = ctx.enqueue_create_buffer[dtype](T * D)
    var nb = ctx.enqueue_create_buffer[dtype](D)
    var rb = ctx.enqueue_create_buffer[DType.float32](T)
    fill_random(ctx, gub, T * 2 * F, seed, -4.0, 4.0)
    fill_random(ctx, dhb, T * F, seed + 1, -1.0, 1.0)
    fill_random(ctx, xb, T * D, seed + 2, -1.0, 1.0)
    fill_random(ctx, nb, D, seed + 3, 0.8, 1.2)
    fill_random(ctx, rb, T, seed + 4, 0.5, 2.0)
    poison(ctx, hb)
    poison(ctx, dgb)
    poison(ctx, dub)
    poison(ctx, xnb)
    var pb = device_params(ctx, Float32(1.0), Float32(0.0), Float32(0.0))  # has_norm = 1
    var tf = IndexList[2](T, F)
    var sf = IndexList[2](F, 1)
    var td = IndexList[2](T, D)
    var sd = IndexList[2](D, 1)
    var h = MutableInputTensor[static_spec=s2](_mut(hb.unsafe_ptr()), tf, sf)
    var dg = MutableInputTensor[static_spec=s2](_mut(dgb.unsafe_ptr()), tf, sf)
    var du = MutableInputTensor[static_spec=s2](_mut(dub.unsafe_ptr()), tf, sf)
    var xn = MutableInputTensor[static_spec=s2](_mut(xnb.unsafe_ptr()), td, sd)
    var dh = InputTensor[static_spec=s2](_mut(dhb.unsafe_ptr()), tf, sf)
    var gu = InputTensor[static_spec=s2](_mut(gub.unsafe_ptr()), IndexList[2](T, 2 * F), IndexList[2](2 * F, 1))
    var x = InputTensor[static_spec=s2](_mut(xb.unsafe_ptr()), td, sd)
    var nw = InputTensor[static_spec=s1](_mut(nb.unsafe_ptr()), IndexList[1](D), IndexList[1](1))
    var rs = InputTensor[static_spec=f1](_mut(rb.unsafe_ptr()), IndexList[1](T), IndexList[1](1))
    var p = InputTensor[static_spec=f1](_mut(pb.unsafe_ptr()), IndexList[1](3), IndexList[1](1))
    SwigluFfnBackward.execute["gpu"](h, dg, du, xn, dh, gu, x, nw, rs, p, ctx)
    var hgu = to_host(ctx, gub, T * 2 * F)
    var hdh = to_host(ctx, dhb, T * F)
    var hh = to_host(ctx, hb, T * F)
    var hdg = to_host(ctx, dgb, T * F)
    var hdu = to_host(ctx, dub, T * F)
    var hx = to_host(ctx, xb, T * D)
    var hxn = to_host(ctx, xnb, T * D)
    var hn = to_host(ctx, nb, D)
    var hr = to_host(ctx, rb, T)
    var eh = RelErr()
    var edg = RelErr()
    var edu = RelErr()
    var exn = RelErr()
    for t in range(T):
        for f in range(F):
            var g = hgu[2 * t * F + f].cast[DType.float64]()
            var u = hgu[2 * t * F + F + f].cast[DType.float64]()
            var d = hdh[t * F + f].cast[DType.float64]()
            var sig = 1.0 / (1.0 + exp(-g))
            eh.add(hh[t * F + f].cast[DType.float64](), g * sig * u)
            edg.add(hdg[t * F + f].cast[DType.float64](), d * u * sig * (1.0 + g * (1.0 - sig)))
            edu.add(hdu[t * F + f].cast[DType.float64](), d * g * sig)
        for j in range(D):
            var want = hx[t * D + j].cast[DType.float64]() * hr[t].cast[DType.float64]() * hn[j].cast[DType.float64]()
            exn.add(hxn[t * D + j].cast[DType.float64](), want)
    var name = String("swiglu_ffn_backward ", dtype, " T=", T, " D=", D, " F=", F)
    var tol = 1e-2 if dtype == DType.bfloat16 else 2e-3
    check(name + " h", eh.value(), tol, failures)
    check(name + " dg", edg.value(), tol, failures)
    check(name + " du", edu.value(), tol, failures)
    check(name + " xn", exn.value(), tol, failures)


def _bench[dtype: DType](ctx: DeviceContext, T: Int, D: Int, F: Int, iters: Int) raises:
    var bufs = _Bufs[dtype](ctx, T, D, F, 5)
    var pb = device_params(ctx, Float32(1e-6), Float32(1.0), Float32(0.0))
    _run_op[dtype](ctx, bufs, T, D, F, pb)  # warm-up
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        _run_op[dtype](ctx, bufs, T, D, F, pb)
    ctx.synchronize()
    var ns = Float64(now_ns() - t0) / Float64(iters)
    var flops = 6.0 * Float64(T) * Float64(D) * Float64(F)
    var bytes = Float64(3 * D * F * 2 + 2 * T * D * 2)
    print("PERF swiglu_ffn", dtype, "T", T, "D", D, "F", F, "us=", ns / 1000.0, "TFLOP/s=", flops / ns / 1000.0,
          "weight GB/s=", bytes / ns, "of_copy_4283=", bytes / ns / 4283.0)


def _bench_path[dtype: DType](ctx: DeviceContext, T: Int, D: Int, F: Int, iters: Int, tc_min_t: Int) raises:
    """Time one path explicitly (tc_min_t <= T: tensor-core matmuls, else the GEMV kernels)."""
    var bufs = _Bufs[dtype](ctx, T, D, F, 6)
    var pb = device_params(ctx, Float32(1e-6), Float32(1.0), Float32(0.0))

    var o, x, wg = _mut(bufs.o.unsafe_ptr()), _mut(bufs.x.unsafe_ptr()), _mut(bufs.wg.unsafe_ptr())
    var wu, wd, nw = _mut(bufs.wu.unsafe_ptr()), _mut(bufs.wd.unsafe_ptr()), _mut(bufs.nw.unsafe_ptr())
    var pp = _mut(pb.unsafe_ptr())
    var rs = _mut(bufs.rstd.unsafe_ptr())
    var ws = bufs.scratch()
    swiglu_ffn_gpu[dtype](o, rs, x, wg, wu, wd, nw, pp, T, D, F, ctx, ws, tc_min_t=tc_min_t)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        swiglu_ffn_gpu[dtype](o, rs, x, wg, wu, wd, nw, pp, T, D, F, ctx, ws, tc_min_t=tc_min_t)
    ctx.synchronize()
    var ns = Float64(now_ns() - t0) / Float64(iters)
    print("PERF swiglu_ffn path=", "tc" if tc_min_t <= T else "gemv", "T", T, "us=", ns / 1000.0,
          "TFLOP/s=", 6.0 * Float64(T) * Float64(D) * Float64(F) / ns / 1000.0)


def run(bench: Bool = True) raises:
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        _case[DType.bfloat16](ctx, 5, 256, 384, True, True, failures, 31)
        _case[DType.float16](ctx, 3, 264, 200, False, True, failures, 32)
        _case[DType.float32](ctx, 2, 64, 96, True, True, failures, 33)
        _case[DType.bfloat16](ctx, 37, 128, 96, True, True, failures, 34)  # > 16 rows: chunked GEMV
        _case[DType.bfloat16](ctx, 1, 4096, 11008, True, True, failures, 35)
        _case[DType.bfloat16](ctx, 4, 4096, 11008, False, True, failures, 36)
        _case[DType.bfloat16](ctx, 16, 4096, 11008, True, True, failures, 37)  # tensor-core path (T >= 16)
        _case[DType.bfloat16](ctx, 5, 4096, 11008, False, True, failures, 40)  # GEMV (wgmma was wrong here)
        _case[DType.bfloat16](ctx, 33, 4096, 11008, True, False, failures, 41)  # small-M wgmma configs
        _case[DType.bfloat16](ctx, 64, 4096, 11008, False, False, failures, 42)
        _case[DType.bfloat16](ctx, 4096, 4096, 11008, True, False, failures, 38)  # wgmma prefill path
        _case[DType.bfloat16](ctx, 300, 4096, 11008, False, False, failures, 39)
        _backward_case[DType.float32](ctx, 3, 64, 96, failures, 50)
        _backward_case[DType.float16](ctx, 5, 72, 37, failures, 51)  # odd F: the scalar (W = 1) path
        _backward_case[DType.bfloat16](ctx, 16, 4096, 11008, failures, 52)
        if bench:
            _bench[DType.bfloat16](ctx, 1, 4096, 11008, 50)
            _bench[DType.bfloat16](ctx, 4, 4096, 11008, 50)
            _bench[DType.bfloat16](ctx, 16, 4096, 11008, 50)
            _bench[DType.bfloat16](ctx, 4096, 4096, 11008, 10)
            _bench[DType.bfloat16](ctx, 512, 4096, 11008, 10)
            for t in [2, 3, 4, 8, 16, 32, 64]:
                _bench_path[DType.bfloat16](ctx, t, 4096, 11008, 30, 1)
                _bench_path[DType.bfloat16](ctx, t, 4096, 11008, 30, 1 << 30)
    print("swiglu_ffn failures:", failures)
    if failures > 0:
        raise Error("swiglu_ffn: ", failures, " checks failed")
