"""Harness entry for fusekit.linear_cross_entropy (the per-chunk row kernel): execute["gpu"] for f32 / f16 /
bf16 logits, checked against float64 host math on the logits as stored (loss per row; d loss / d logits
rounded to the dtype; an ignored row exact zeros, an out-of-range label NaN), every launch variant (vector
/ scalar, 256 / 1024 threads), and a timing of one Llama-3-8B chunk (C 1024, V 128256, bf16)."""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer
from std.utils import IndexList
from std.math import exp, log
from std.utils.numerics import nan, neg_inf

from ..linear_cross_entropy import LinearCrossEntropyRows
from ._common import _mut, fill_random, poison, to_host, RelErr, check, tol_for, now_ns, device_params, report_bw

comptime IGNORE = -100


def _labels(ctx: DeviceContext, c: Int, v: Int, seed: Int) raises -> DeviceBuffer[DType.int64]:
    """Row 1 ignored, row 2 out of range (V + 5), the others spread over [0, V) (the last column included)."""
    var h = ctx.enqueue_create_host_buffer[DType.int64](c)
    ctx.synchronize()
    for i in range(c):
        h[i] = Int64((i * 7919 + seed * 104729) % v)
    h[0] = Int64(v - 1)
    if c > 1:
        h[1] = IGNORE
    if c > 2:
        h[2] = Int64(v + 5)
    var d = ctx.enqueue_create_buffer[DType.int64](c)
    ctx.enqueue_copy(d, h)
    ctx.synchronize()
    return d


def _launch[
    dtype: DType
](
    ctx: DeviceContext,
    zb: DeviceBuffer[dtype],
    rb: DeviceBuffer[DType.float32],
    lb: DeviceBuffer[DType.int64],
    sb: DeviceBuffer[DType.float32],
    pb: DeviceBuffer[DType.float32],
    c: Int,
    v: Int,
) raises:
    comptime s2 = StaticTensorSpec[dtype, 2, ...].get_unknown()
    comptime f1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    comptime i1 = StaticTensorSpec[DType.int64, 1, ...].get_unknown()
    var z = MutableInputTensor[static_spec=s2](_mut(zb.unsafe_ptr()), IndexList[2](c, v), IndexList[2](v, 1))
    var r = MutableInputTensor[static_spec=f1](_mut(rb.unsafe_ptr()), IndexList[1](c), IndexList[1](1))
    var lab = InputTensor[static_spec=i1](_mut(lb.unsafe_ptr()), IndexList[1](c), IndexList[1](1))
    var sc = InputTensor[static_spec=f1](_mut(sb.unsafe_ptr()), IndexList[1](1), IndexList[1](1))
    var p = InputTensor[static_spec=f1](_mut(pb.unsafe_ptr()), IndexList[1](5), IndexList[1](1))
    LinearCrossEntropyRows.execute["gpu"](z, r, lab, sc, p, ctx)


def _case[dtype: DType](ctx: DeviceContext, c: Int, v: Int, eps: Float64, grad: Bool, mut failures: Int, seed: Int) raises:
    var zb = ctx.enqueue_create_buffer[dtype](c * v)
    var rb = ctx.enqueue_create_buffer[DType.float32](c)
    var lb = _labels(ctx, c, v, seed)
    fill_random(ctx, zb, c * v, seed, -8.0, 8.0)
    poison(ctx, rb)
    var scale = 0.25
    var sb = device_params(ctx, Float32(scale))
    # ignore_index = -100 as 24-bit pieces: -1 * 2^48 + (2^24 - 1) * 2^24 + (2^24 - 100)
    var pb = device_params(
        ctx, Float32(-1), Float32(16777215), Float32(16777216 + IGNORE), Float32(eps), Float32(1.0 if grad else 0.0)
    )
    var z0 = to_host(ctx, zb, c * v)
    var lab = to_host(ctx, lb, c)
    _launch[dtype](ctx, zb, rb, lb, sb, pb, c, v)
    var z1 = to_host(ctx, zb, c * v)
    var rows = to_host(ctx, rb, c)
    var el = RelErr()
    var eg = RelErr()
    var fnan = nan[DType.float64]()
    for i in range(c):
        var y = Int(lab[i])
        var m = neg_inf[DType.float64]()
        var zs = Float64(0)
        for j in range(v):
            var zz = z0[i * v + j].cast[DType.float64]()
            m = max(m, zz)
            zs += zz
        var s = Float64(0)
        for j in range(v):
            s += exp(z0[i * v + j].cast[DType.float64]() - m)
        var lse = m + log(s)
        var ign = y == IGNORE
        var inside = y >= 0 and y < v
        var want = Float64(0)
        if not ign:
            want = lse - (1 - eps) * z0[i * v + y].cast[DType.float64]() - eps * zs / Float64(v) if inside else fnan
        el.add_pattern(rows[i].cast[DType.float64](), want)
        for j in range(v):
            var got = z1[i * v + j].cast[DType.float64]()
            if not grad:  # the logits stay as they were
                eg.add(got, z0[i * v + j].cast[DType.float64]())
                continue
            var g = Float64(0)
            if not ign:
                g = exp(z0[i * v + j].cast[DType.float64]() - lse) - eps / Float64(v)
                if j == y:
                    g -= 1 - eps
                g = g * scale if inside else fnan
            if ign and got != 0:
                eg.bad += 1
            eg.add_pattern(got, g)
    var name = String("linear_cross_entropy rows ", dtype, " C=", c, " V=", v, " eps=", eps, " grad=", grad)
    check(name + " loss", el.value(), 1e-5, failures)
    check(name + " dlogits", eg.value(), tol_for[dtype](), failures)


def _bench(ctx: DeviceContext, c: Int, v: Int, iters: Int) raises:
    comptime dt = DType.bfloat16
    var zb = ctx.enqueue_create_buffer[dt](c * v)
    var rb = ctx.enqueue_create_buffer[DType.float32](c)
    var lb = _labels(ctx, c, v, 1)
    var sb = device_params(ctx, Float32(1.0 / Float64(c)))
    var pb = device_params(ctx, Float32(-1), Float32(16777215), Float32(16777216 + IGNORE), Float32(0), Float32(1))
    fill_random(ctx, zb, c * v, 3, -8.0, 8.0)
    _launch[dt](ctx, zb, rb, lb, sb, pb, c, v)  # warm-up (the gradients overwrite the logits: same cost)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        _launch[dt](ctx, zb, rb, lb, sb, pb, c, v)
    ctx.synchronize()
    var ns = Float64(now_ns() - t0) / Float64(iters)
    report_bw(String("linear_cross_entropy rows bf16 C=", c, " V=", v, " grad"), 3 * 2 * c * v, ns)


def run(bench: Bool = True) raises:
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        _case[DType.float32](ctx, 5, 1031, 0.0, True, failures, 1)  # scalar, 256 threads
        _case[DType.float16](ctx, 4, 1031, 0.1, True, failures, 2)
        _case[DType.bfloat16](ctx, 6, 1024, 0.0, True, failures, 3)  # vector, 256 threads
        _case[DType.bfloat16](ctx, 3, 8200, 0.1, True, failures, 4)  # vector, 1024 threads
        _case[DType.float32](ctx, 3, 8203, 0.0, False, failures, 5)  # scalar, 1024 threads, no grad
        _case[DType.bfloat16](ctx, 4, 128256, 0.0, True, failures, 6)  # Llama-3's vocabulary
        _case[DType.float16](ctx, 3, 32000, 0.1, False, failures, 7)
        if bench:
            _bench(ctx, 1024, 128256, 20)
    print("linear_cross_entropy failures:", failures)
    if failures > 0:
        raise Error("linear_cross_entropy: ", failures, " checks failed")
