"""Harness body shared by run_rms_norm and run_layer_norm (LN = layer_norm)."""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer
from std.utils import IndexList
from std.sys import size_of
from std.math import sqrt

from ..rms_norm import RmsNorm
from ..layer_norm import LayerNorm
from .._norm import norm_gpu
from ._common import _mut, fill_random, poison, to_host, RelErr, check, tol_for, now_ns, report_bw, device_params, sample_rows


def _run_op[dtype: DType, LN: Bool](
    ctx: DeviceContext, yb: DeviceBuffer[dtype], mb: DeviceBuffer[DType.float32], rb: DeviceBuffer[DType.float32],
    xb: DeviceBuffer[dtype], wb: DeviceBuffer[dtype], bb: DeviceBuffer[dtype], pb: DeviceBuffer[DType.float32], m: Int, n: Int
) raises:
    comptime s2 = StaticTensorSpec[dtype, 2, ...].get_unknown()
    comptime s1 = StaticTensorSpec[dtype, 1, ...].get_unknown()
    comptime f1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var y = MutableInputTensor[static_spec=s2](_mut(yb.unsafe_ptr()), IndexList[2](m, n), IndexList[2](n, 1))
    var rs = MutableInputTensor[static_spec=f1](_mut(rb.unsafe_ptr()), IndexList[1](m), IndexList[1](1))
    var x = InputTensor[static_spec=s2](_mut(xb.unsafe_ptr()), IndexList[2](m, n), IndexList[2](n, 1))
    var w = InputTensor[static_spec=s1](_mut(wb.unsafe_ptr()), IndexList[1](n), IndexList[1](1))
    var p = InputTensor[static_spec=f1](_mut(pb.unsafe_ptr()), IndexList[1](2), IndexList[1](1))
    comptime if LN:
        var mu = MutableInputTensor[static_spec=f1](_mut(mb.unsafe_ptr()), IndexList[1](m), IndexList[1](1))
        var b = InputTensor[static_spec=s1](_mut(bb.unsafe_ptr()), IndexList[1](n), IndexList[1](1))
        LayerNorm.execute["gpu"](y, mu, rs, x, w, b, p, ctx)
    else:
        RmsNorm.execute["gpu"](y, rs, x, w, p, ctx)


def norm_case[dtype: DType, LN: Bool](ctx: DeviceContext, m: Int, n: Int, has_bias: Bool, mut failures: Int, seed: Int) raises:
    var eps = Float32(1e-5)
    var xb = ctx.enqueue_create_buffer[dtype](m * n)
    var wb = ctx.enqueue_create_buffer[dtype](n)
    var bb = ctx.enqueue_create_buffer[dtype](n)
    var yb = ctx.enqueue_create_buffer[dtype](m * n)
    var mb = ctx.enqueue_create_buffer[DType.float32](m)
    var rb = ctx.enqueue_create_buffer[DType.float32](m)
    fill_random(ctx, xb, m * n, seed, -1.5, 2.5)  # nonzero mean: exercises the two-pass variance
    fill_random(ctx, wb, n, seed + 1000, 0.5, 1.5)
    fill_random(ctx, bb, n, seed + 2000, -0.5, 0.5)
    poison(ctx, yb)
    poison(ctx, mb)
    poison(ctx, rb)
    var pb = device_params(ctx, eps, Float32(1.0 if has_bias else 0.0))
    _run_op[dtype, LN](ctx, yb, mb, rb, xb, wb, bb, pb, m, n)
    var hx = to_host(ctx, xb, m * n)
    var hw = to_host(ctx, wb, n)
    var hb = to_host(ctx, bb, n)
    var hy = to_host(ctx, yb, m * n)
    var hm = to_host(ctx, mb, m)
    var hr = to_host(ctx, rb, m)
    var ey = RelErr()
    var er = RelErr()
    var em = RelErr()
    for i in range(min(m, 48)):
        var r = sample_rows(m, i, 48)
        var mean = Float64(0)
        comptime if LN:
            for j in range(n):
                mean += hx[r * n + j].cast[DType.float64]()
            mean /= Float64(n)
            em.add(hm[r].cast[DType.float64](), mean)
        var q = Float64(0)
        for j in range(n):
            var d = hx[r * n + j].cast[DType.float64]() - mean
            q += d * d
        var rstd = 1.0 / sqrt(q / Float64(n) + Float64(eps))
        er.add(hr[r].cast[DType.float64](), rstd)
        for j in range(n):
            var want = (hx[r * n + j].cast[DType.float64]() - mean) * rstd * hw[j].cast[DType.float64]()
            if LN and has_bias:
                want += hb[j].cast[DType.float64]()
            ey.add(hy[r * n + j].cast[DType.float64](), want)
    var name = String("layer_norm" if LN else "rms_norm", " ", dtype, " M=", m, " N=", n)
    if LN:
        name += String(" bias=", has_bias)
    check(name + " out", ey.value(), tol_for[dtype](), failures)
    check(name + " rstd", er.value(), 1e-5, failures)
    if LN:
        check(name + " mean", em.value(), 1e-5, failures)


def _run_forced[dtype: DType, LN: Bool](
    ctx: DeviceContext, yb: DeviceBuffer[dtype], mb: DeviceBuffer[DType.float32], rb: DeviceBuffer[DType.float32],
    xb: DeviceBuffer[dtype], wb: DeviceBuffer[dtype], pb: DeviceBuffer[DType.float32], m: Int, n: Int
) raises:
    norm_gpu[dtype, LN, True](
        ctx, _mut(yb.unsafe_ptr()), _mut(mb.unsafe_ptr()), _mut(rb.unsafe_ptr()), _mut(xb.unsafe_ptr()),
        _mut(wb.unsafe_ptr()), _mut(wb.unsafe_ptr()), _mut(pb.unsafe_ptr()), m, n
    )


def norm_bench[dtype: DType, LN: Bool, FORCE_LOOP: Bool = False](ctx: DeviceContext, m: Int, n: Int, iters: Int) raises:
    var xb = ctx.enqueue_create_buffer[dtype](m * n)
    var wb = ctx.enqueue_create_buffer[dtype](n)
    var yb = ctx.enqueue_create_buffer[dtype](m * n)
    var mb = ctx.enqueue_create_buffer[DType.float32](m)
    var rb = ctx.enqueue_create_buffer[DType.float32](m)
    fill_random(ctx, xb, m * n, 7, -1.5, 2.5)
    fill_random(ctx, wb, n, 8, 0.5, 1.5)
    var pb = device_params(ctx, Float32(1e-5), Float32(1.0))
    _run_op[dtype, LN](ctx, yb, mb, rb, xb, wb, wb, pb, m, n)  # warm-up (bias = weight: a real read)
    _run_forced[dtype, LN](ctx, yb, mb, rb, xb, wb, pb, m, n)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        comptime if FORCE_LOOP:
            _run_forced[dtype, LN](ctx, yb, mb, rb, xb, wb, pb, m, n)
        else:
            _run_op[dtype, LN](ctx, yb, mb, rb, xb, wb, wb, pb, m, n)
    ctx.synchronize()
    var dt = Float64(now_ns() - t0) / Float64(iters)
    var bytes = 2 * m * n * size_of[dtype]() + m * 4 * (2 if LN else 1)
    report_bw(String("layer_norm" if LN else "rms_norm", " ", dtype, " M=", m, " N=", n, " (reload kernel)" if FORCE_LOOP else ""), bytes, dt)


def norm_run[LN: Bool](bench: Bool) raises:
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        comptime for di in range(3):
            comptime dtype = DType.float32 if di == 0 else (DType.float16 if di == 1 else DType.bfloat16)
            var s = 10 * di
            norm_case[dtype, LN](ctx, 1, 1, True, failures, s + 1)
            norm_case[dtype, LN](ctx, 3, 37, True, failures, s + 2)
            norm_case[dtype, LN](ctx, 5, 1000, False, failures, s + 3)
            norm_case[dtype, LN](ctx, 2, 4097, True, failures, s + 4)
            norm_case[dtype, LN](ctx, 300, 128, True, failures, s + 5)
            norm_case[dtype, LN](ctx, 64, 8192, True, failures, s + 6)
            norm_case[dtype, LN](ctx, 9, 16384, False, failures, s + 7)
            norm_case[dtype, LN](ctx, 3, 65536, True, failures, s + 8)
            norm_case[dtype, LN](ctx, 2, 100000, True, failures, s + 9)
            norm_case[dtype, LN](ctx, 2, 200003, False, failures, s + 10)
        if bench:
            norm_bench[DType.bfloat16, LN](ctx, 32768, 8192, 20)
            norm_bench[DType.bfloat16, LN](ctx, 16384, 65536, 5)
            norm_bench[DType.bfloat16, LN, True](ctx, 16384, 65536, 5)
            norm_bench[DType.float32, LN](ctx, 32768, 8192, 10)
    var op = "layer_norm" if LN else "rms_norm"
    print(op, "failures:", failures)
    if failures > 0:
        raise Error(op, ": ", failures, " checks failed")
