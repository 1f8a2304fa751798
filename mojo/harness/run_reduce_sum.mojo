"""Harness entry for fusekit.reduce_sum and fusekit.reduce_sum_backward: every dtype pair through
execute["gpu"], checks and timing."""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext
from std.utils import IndexList
from std.sys import size_of


def _part_len(ctx: DeviceContext, m: Int) raises -> Int:
    """Split partials reduce_sum_gpu may need: m * splits <= wave + m - 1 (reduce_sum.mojo)."""
    return sm_count(ctx) * (2048 // BLOCK) + m

from ..reduce_sum import ReduceSum, ReduceSumBackward, reduce_sum_gpu, reduce_sum_backward_gpu, BLOCK
from .._util import acc_dtype
from ._common import _mut, fill_random, poison, to_host, RelErr, check, tol_for, now_ns, report_bw, sm_count, workspace


def _case[in_dtype: DType, out_dtype: DType](ctx: DeviceContext, m: Int, n: Int, mut failures: Int, seed: Int) raises:
    comptime s2 = StaticTensorSpec[in_dtype, 2, ...].get_unknown()
    comptime s1 = StaticTensorSpec[out_dtype, 1, ...].get_unknown()
    var xb = ctx.enqueue_create_buffer[in_dtype](m * n)
    var ob = ctx.enqueue_create_buffer[out_dtype](m)
    comptime if in_dtype.is_integral():
        fill_random(ctx, xb, m * n, seed, -1000.0, 1000.0)
    else:
        fill_random(ctx, xb, m * n, seed, -0.5, 1.0)
    poison(ctx, ob)
    var x = InputTensor[static_spec=s2](xb.unsafe_ptr(), IndexList[2](m, n), IndexList[2](n, 1))
    var o = MutableInputTensor[static_spec=s1](ob.unsafe_ptr(), IndexList[1](m), IndexList[1](1))
    comptime acc = acc_dtype[in_dtype]()
    comptime sp = StaticTensorSpec[acc, 1, ...].get_unknown()
    var np = _part_len(ctx, m)
    var pb = workspace[acc](ctx, np)
    var part = MutableInputTensor[static_spec=sp](pb.unsafe_ptr(), IndexList[1](np), IndexList[1](1))
    ReduceSum.execute["gpu"](o, part, x, ctx)
    var hx = to_host(ctx, xb, m * n)
    var ho = to_host(ctx, ob, m)
    var e = RelErr()
    for r in range(m):
        var want = Float64(0)
        for j in range(n):
            want += hx[r * n + j].cast[DType.float64]()
        comptime if out_dtype.is_integral():
            want = Float64(Int64(want).cast[out_dtype]())  # wrap like the integer cast
        var got = ho[r].cast[DType.float64]()
        if abs(want) > 65504.0 and out_dtype == DType.float16:  # overflows fp16: must be inf, as torch
            if abs(got) <= Float64.MAX_FINITE or (got > 0) != (want > 0):
                e.bad += 1
            continue
        e.add(got, want)
    var tol = max(tol_for[out_dtype](), 1e-6 if in_dtype == DType.float32 else 0.0)
    check(String("reduce_sum ", in_dtype, "->", out_dtype, " M=", m, " N=", n), e.value(), tol, failures)


def _all_shapes[in_dtype: DType, out_dtype: DType](ctx: DeviceContext, mut failures: Int) raises:
    _case[in_dtype, out_dtype](ctx, 1, 1, failures, 1)
    _case[in_dtype, out_dtype](ctx, 3, 37, failures, 2)
    _case[in_dtype, out_dtype](ctx, 5, 1000, failures, 3)
    _case[in_dtype, out_dtype](ctx, 2, 4097, failures, 4)
    _case[in_dtype, out_dtype](ctx, 7, 100003, failures, 5)
    _case[in_dtype, out_dtype](ctx, 1, 3000017, failures, 6)
    _case[in_dtype, out_dtype](ctx, 4000, 33, failures, 7)
    _case[in_dtype, out_dtype](ctx, 3000, 3000, failures, 8)


def _bwd_case[x_dtype: DType, g_dtype: DType](
    ctx: DeviceContext, m: Int, n: Int, unaligned: Bool, mut failures: Int, seed: Int
) raises:
    """dx[M, N] = dout[M] broadcast; `unaligned` shifts dx by one element (the 1-element-vector path)."""
    comptime s2 = StaticTensorSpec[x_dtype, 2, ...].get_unknown()
    comptime s1 = StaticTensorSpec[g_dtype, 1, ...].get_unknown()
    var sh = 1 if unaligned else 0
    var gb = ctx.enqueue_create_buffer[g_dtype](m)
    var db = ctx.enqueue_create_buffer[x_dtype](m * n + 1)
    fill_random(ctx, gb, m, seed, -3.0, 3.0)
    poison(ctx, db)
    var dx = MutableInputTensor[static_spec=s2](_mut(db.unsafe_ptr()).unsafe_offset(sh), IndexList[2](m, n), IndexList[2](n, 1))
    var dout = InputTensor[static_spec=s1](_mut(gb.unsafe_ptr()), IndexList[1](m), IndexList[1](1))
    ReduceSumBackward.execute["gpu"](dx, dout, ctx)
    var hg = to_host(ctx, gb, m)
    var hd = to_host(ctx, db, m * n + 1)
    var bad = 0
    for r in range(m):
        var want = hg[r].cast[x_dtype]()
        for j in range(n):
            var got = hd[sh + r * n + j]
            if got != want:  # exact: one rounding of dout to x's dtype
                bad += 1
    check(
        String("reduce_sum_backward ", g_dtype, "->", x_dtype, " M=", m, " N=", n, " unaligned=", unaligned, " bad=", bad),
        Float64(bad), 0.0, failures,
    )


def _bwd_shapes[x_dtype: DType, g_dtype: DType](ctx: DeviceContext, mut failures: Int) raises:
    for ui in range(2):
        var un = ui == 1
        _bwd_case[x_dtype, g_dtype](ctx, 1, 1, un, failures, 11)
        _bwd_case[x_dtype, g_dtype](ctx, 37, 33, un, failures, 12)
        _bwd_case[x_dtype, g_dtype](ctx, 5, 760, un, failures, 13)
        _bwd_case[x_dtype, g_dtype](ctx, 3, 4097, un, failures, 14)
        _bwd_case[x_dtype, g_dtype](ctx, 1000, 3, un, failures, 15)
        _bwd_case[x_dtype, g_dtype](ctx, 4000, 1, un, failures, 16)


def _bwd_bench[x_dtype: DType, g_dtype: DType](ctx: DeviceContext, m: Int, n: Int, iters: Int) raises:
    var gb = ctx.enqueue_create_buffer[g_dtype](m)
    var db = ctx.enqueue_create_buffer[x_dtype](m * n)
    fill_random(ctx, gb, m, 98, -1.0, 1.0)
    reduce_sum_backward_gpu[x_dtype, g_dtype](ctx, _mut(db.unsafe_ptr()), _mut(gb.unsafe_ptr()), m, n)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        reduce_sum_backward_gpu[x_dtype, g_dtype](ctx, _mut(db.unsafe_ptr()), _mut(gb.unsafe_ptr()), m, n)
    ctx.synchronize()
    var dt = Float64(now_ns() - t0) / Float64(iters)
    report_bw(String("reduce_sum_backward ", g_dtype, "->", x_dtype, " M=", m, " N=", n), m * n * size_of[x_dtype](), dt)


def _bench[in_dtype: DType, out_dtype: DType, U: Int](ctx: DeviceContext, m: Int, n: Int, iters: Int, label: String) raises:
    var xb = ctx.enqueue_create_buffer[in_dtype](m * n)
    var ob = ctx.enqueue_create_buffer[out_dtype](m)
    var np = _part_len(ctx, m)
    var pb = workspace[acc_dtype[in_dtype]()](ctx, np)
    fill_random(ctx, xb, m * n, 99, -0.5, 1.0)
    reduce_sum_gpu[in_dtype, out_dtype, U](
        ctx, _mut(ob.unsafe_ptr()), _mut(pb.unsafe_ptr()), np, _mut(xb.unsafe_ptr()), m, n
    )  # warm-up
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        reduce_sum_gpu[in_dtype, out_dtype, U](
            ctx, _mut(ob.unsafe_ptr()), _mut(pb.unsafe_ptr()), np, _mut(xb.unsafe_ptr()), m, n
        )
    ctx.synchronize()
    var dt = Float64(now_ns() - t0) / Float64(iters)
    var ho = to_host(ctx, ob, 1)
    var expect = Float64(m * n) * 0.25  # mean of U[-0.5, 1)
    print("  (sum[0]=", ho[0], "~", expect / Float64(m), ")")
    report_bw(String("reduce_sum ", label, " ", in_dtype, "->", out_dtype, " M=", m, " N=", n, " U=", U), m * n * size_of[in_dtype](), dt)


def run(bench: Bool = True) raises:
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        _all_shapes[DType.float32, DType.float32](ctx, failures)
        _all_shapes[DType.float16, DType.float16](ctx, failures)
        _all_shapes[DType.bfloat16, DType.bfloat16](ctx, failures)
        _all_shapes[DType.float16, DType.float32](ctx, failures)
        _all_shapes[DType.bfloat16, DType.float32](ctx, failures)
        _all_shapes[DType.float32, DType.float16](ctx, failures)
        _all_shapes[DType.float32, DType.bfloat16](ctx, failures)
        _all_shapes[DType.int32, DType.int64](ctx, failures)
        _all_shapes[DType.int64, DType.int64](ctx, failures)
        _all_shapes[DType.int32, DType.int32](ctx, failures)
        _all_shapes[DType.int64, DType.int32](ctx, failures)
        _bwd_shapes[DType.float32, DType.float32](ctx, failures)
        _bwd_shapes[DType.bfloat16, DType.bfloat16](ctx, failures)
        _bwd_shapes[DType.bfloat16, DType.float32](ctx, failures)
        _bwd_shapes[DType.float16, DType.float32](ctx, failures)
        _bwd_shapes[DType.float32, DType.float16](ctx, failures)
        if bench:
            _bench[DType.float32, DType.float32, 4](ctx, 1, 1 << 30, 20, "1x2^30")
            _bench[DType.float32, DType.float32, 8](ctx, 1, 1 << 30, 20, "1x2^30")
            _bench[DType.bfloat16, DType.float32, 4](ctx, 1, 1 << 30, 20, "1x2^30")
            _bench[DType.float32, DType.float32, 4](ctx, 32768, 8192, 20, "rows")
            _bench[DType.float32, DType.float32, 4](ctx, 1 << 22, 256, 20, "short-rows")
            _bwd_bench[DType.bfloat16, DType.float32](ctx, 32768, 8192, 20)
            _bwd_bench[DType.float32, DType.float32](ctx, 1 << 22, 255, 20)
            _bwd_bench[DType.float32, DType.float32](ctx, 1, 1 << 30, 20)
    print("reduce_sum failures:", failures)
    if failures > 0:
        raise Error("reduce_sum: ", failures, " checks failed")
