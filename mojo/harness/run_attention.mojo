"""Harness entry for fusekit.attention: execute["gpu"] checks (host float64 at small shapes, the rowwise
fp32 GPU kernel at realistic shapes) and FLOP-rate timing of the tensor-core kernel."""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext, DeviceBuffer, HostBuffer
from std.utils import IndexList
from std.math import exp

from ..attention import Attention, attention_gpu
from ._common import _mut, fill_random, poison, to_host, RelErr, check, now_ns, device_params


def _host_ref_err[
    dtype: DType
](
    ho: HostBuffer[dtype],
    hq: HostBuffer[dtype],
    hk: HostBuffer[dtype],
    hv: HostBuffer[dtype],
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
    scale: Float64,
    causal: Bool,
) -> Float64:
    """float64 softmax attention on the host; relative error of ho against it."""
    var e = RelErr()
    var sc = List[Float64](length=Skv, fill=0)
    var acc = List[Float64](length=D, fill=0)
    for b in range(B):
        for h in range(H):
            var kvb = ((b * Hkv + h // (H // Hkv)) * Skv) * D
            var qb = ((b * H + h) * S) * D
            for i in range(S):
                var last = Skv - 1
                if causal:
                    last = min(last, i + Skv - S)
                var mx = -1e300
                for j in range(last + 1):
                    var s = Float64(0)
                    for d in range(D):
                        s += hq[qb + i * D + d].cast[DType.float64]() * hk[kvb + j * D + d].cast[DType.float64]()
                    sc[j] = s * scale
                    mx = max(mx, sc[j])
                for d in range(D):
                    acc[d] = 0
                var l = Float64(0)
                for j in range(last + 1):
                    var p = exp(sc[j] - mx)
                    l += p
                    for d in range(D):
                        acc[d] += p * hv[kvb + j * D + d].cast[DType.float64]()
                for d in range(D):
                    var want = acc[d] / l if l > 0 else 0.0
                    e.add(ho[qb + i * D + d].cast[DType.float64](), want)
    return e.value()


def _case[
    dtype: DType
](
    ctx: DeviceContext,
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
    causal: Bool,
    host_ref: Bool,
    mut failures: Int,
    seed: Int,
) raises:
    comptime s4 = StaticTensorSpec[dtype, 4, ...].get_unknown()
    comptime s1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    var nq = B * H * S * D
    var nk = B * Hkv * Skv * D
    var qb = ctx.enqueue_create_buffer[dtype](nq)
    var kb = ctx.enqueue_create_buffer[dtype](nk)
    var vb = ctx.enqueue_create_buffer[dtype](nk)
    var ob = ctx.enqueue_create_buffer[dtype](nq)
    var rb = ctx.enqueue_create_buffer[dtype](nq)
    fill_random(ctx, qb, nq, seed, -1.0, 1.0)
    fill_random(ctx, kb, nk, seed + 1, -1.0, 1.0)
    fill_random(ctx, vb, nk, seed + 2, -1.0, 1.0)
    poison(ctx, ob)
    poison(ctx, rb)
    var scale = Float32(1.0) / Float32(D).__pow__(Float32(0.5)) * 2  # x2: peakier softmax than 1/sqrt(D)
    var pb = device_params(ctx, scale, Float32(1.0) if causal else Float32(0.0))
    var q = InputTensor[static_spec=s4](qb.unsafe_ptr(), IndexList[4](B, H, S, D), IndexList[4](H * S * D, S * D, D, 1))
    var k = InputTensor[static_spec=s4](
        kb.unsafe_ptr(), IndexList[4](B, Hkv, Skv, D), IndexList[4](Hkv * Skv * D, Skv * D, D, 1)
    )
    var v = InputTensor[static_spec=s4](
        vb.unsafe_ptr(), IndexList[4](B, Hkv, Skv, D), IndexList[4](Hkv * Skv * D, Skv * D, D, 1)
    )
    var p = InputTensor[static_spec=s1](pb.unsafe_ptr(), IndexList[1](2), IndexList[1](1))
    var o = MutableInputTensor[static_spec=s4](ob.unsafe_ptr(), IndexList[4](B, H, S, D), IndexList[4](H * S * D, S * D, D, 1))
    Attention.execute["gpu"](o, q, k, v, p, ctx)
    var name = String("attention ", dtype, " B", B, " H", H, " Hkv", Hkv, " S", S, " Skv", Skv, " D", D, " causal=", causal)
    var ho = to_host(ctx, ob, nq)
    if host_ref:
        var hq = to_host(ctx, qb, nq)
        var hk = to_host(ctx, kb, nk)
        var hv = to_host(ctx, vb, nk)
        var err = _host_ref_err[dtype](ho, hq, hk, hv, B, H, Hkv, S, Skv, D, Float64(scale), causal)
        check(name + " vs host f64", err, 1e-2 if dtype == DType.bfloat16 else 2e-3, failures)
    else:
        attention_gpu[dtype](
            _mut(rb.unsafe_ptr()), _mut(qb.unsafe_ptr()), _mut(kb.unsafe_ptr()), _mut(vb.unsafe_ptr()),
            _mut(pb.unsafe_ptr()), B, H, Hkv, S, Skv, D, ctx, force_rowwise=True,
        )
        var hr = to_host(ctx, rb, nq)
        var e = RelErr()
        for i in range(nq):
            e.add(ho[i].cast[DType.float64](), hr[i].cast[DType.float64]())
        check(name + " vs rowwise fp32 GPU", e.value(), 1e-2 if dtype == DType.bfloat16 else 2e-3, failures)


def _bench[dtype: DType](ctx: DeviceContext, B: Int, H: Int, S: Int, D: Int, causal: Bool, iters: Int) raises:
    var n = B * H * S * D
    var qb = ctx.enqueue_create_buffer[dtype](n)
    var kb = ctx.enqueue_create_buffer[dtype](n)
    var vb = ctx.enqueue_create_buffer[dtype](n)
    var ob = ctx.enqueue_create_buffer[dtype](n)
    fill_random(ctx, qb, n, 7, -1.0, 1.0)
    fill_random(ctx, kb, n, 8, -1.0, 1.0)
    fill_random(ctx, vb, n, 9, -1.0, 1.0)
    var pb = device_params(ctx, Float32(1.0) / Float32(D).__pow__(Float32(0.5)), Float32(1.0) if causal else Float32(0.0))
    var o, q, k, v, p = _mut(ob.unsafe_ptr()), _mut(qb.unsafe_ptr()), _mut(kb.unsafe_ptr()), _mut(vb.unsafe_ptr()), _mut(pb.unsafe_ptr())
    attention_gpu[dtype](o, q, k, v, p, B, H, H, S, S, D, ctx)  # warm-up (module load)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        attention_gpu[dtype](o, q, k, v, p, B, H, H, S, S, D, ctx)
    ctx.synchronize()
    var ns = Float64(now_ns() - t0) / Float64(iters)
    var flops = 4.0 * Float64(B * H) * Float64(S) * Float64(S) * Float64(D) * (0.5 if causal else 1.0)
    var tf = flops / ns / 1000.0
    print("PERF attention", dtype, "B", B, "H", H, "S", S, "D", D, "causal=", causal, "us=", ns / 1000.0, "TFLOP/s=", tf,
          "of_SDPA_604=", tf / 604.0)


def run(bench: Bool = True) raises:
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        # small shapes against the host (GQA, S < Skv, S > Skv -> rows with no key write zeros)
        comptime for di in range(3):
            comptime D = 64 * (1 << di)  # 64, 128, 256
            _case[DType.bfloat16](ctx, 1, 4, 2, 37, 45, D, False, True, failures, 11)
            _case[DType.bfloat16](ctx, 1, 4, 2, 37, 45, D, True, True, failures, 12)
            _case[DType.float16](ctx, 1, 4, 2, 45, 37, D, True, True, failures, 13)
            _case[DType.bfloat16](ctx, 2, 2, 1, 130, 70, D, True, True, failures, 14)
        _case[DType.float32](ctx, 1, 4, 2, 37, 45, 64, True, True, failures, 15)
        _case[DType.float32](ctx, 1, 2, 2, 20, 20, 96, False, True, failures, 16)
        # realistic shapes against the fp32 rowwise GPU kernel
        comptime for di in range(3):
            comptime D = 64 * (1 << di)
            _case[DType.bfloat16](ctx, 2, 8, 2, 1000, 1037, D, False, False, failures, 21)
            _case[DType.bfloat16](ctx, 2, 8, 2, 1000, 1037, D, True, False, failures, 22)
            _case[DType.float16](ctx, 1, 8, 8, 777, 777, D, True, False, failures, 23)
        if bench:
            for causal in range(2):
                _bench[DType.bfloat16](ctx, 4, 32, 4096, 128, causal == 1, 10)
                _bench[DType.bfloat16](ctx, 4, 32, 4096, 64, causal == 1, 10)
                _bench[DType.bfloat16](ctx, 4, 32, 4096, 256, causal == 1, 5)
            _bench[DType.float16](ctx, 4, 32, 4096, 128, False, 10)
    print("attention failures:", failures)
    if failures > 0:
        raise Error("attention: ", failures, " checks failed")
