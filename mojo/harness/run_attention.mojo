"""Harness entry for fusekit.attention (o, lse) and fusekit.attention_backward: execute["gpu"] checks
(host float64 at small shapes, incl. NaN/Inf inputs and per-sequence kv_len with NaN keys past each
length that must never be read; the rowwise fp32 GPU kernel at realistic shapes) and FLOP-rate timing.

FUSEKIT_HARNESS_ONLY=attn_decode runs only the split-KV decode path's checks and timings (`run_decode`).
FUSEKIT_HARNESS_ONLY=attn_fwd runs only the forward (and small-shape gradient) checks and the forward timings,
bf16 with the sm_90 wgmma kernel and with `_fa2_kernel` in the same run.
FUSEKIT_HARNESS_ONLY=attn_perf times one bf16 D128 forward and nothing else (what a profiler run wants).
FUSEKIT_HARNESS_BENCH=0 skips every timing (checks only: what a compute-sanitizer run wants).
FUSEKIT_HARNESS_ONLY=attn_bwd_tc runs only the tensor-core backward's checks and timings (`run_bwd_tc`):
the opt-in path (params' 4th slot, mojo/_attention_backward.mojo) against the SIMT backward and float64."""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, StaticTensorSpec
from max.gpu import global_idx, grid_dim, block_dim
from max.gpu.host import DeviceContext, DeviceBuffer, HostBuffer
from std.utils import IndexList
from std.os import getenv
from std.math import sqrt
from std.sys import size_of

from ..attention import Attention, AttentionBackward, attention_gpu, attention_gpu_ws, attention_backward_gpu
from .._util import exp_f64, log_f64
from .._attention_hopper import attention_hopper_gpu
from .._attention_decode import decode_applies, decode_plan, decode_part_len, attention_decode_gpu
from ._common import _mut, fill_random, poison, to_host, RelErr, check, now_ns, device_params, workspace, sm_count

comptime F64 = DType.float64


def _nmax64(a: Float64, b: Float64) -> Float64:
    return b if (b > a or b != b) else a


struct HostRef(Movable):
    """float64 attention over the VISIBLE keys on the host: o [B,H,S,D], lse [B,H,S], and (given do)
    the gradients dq, dk, dv. Rows with no visible key: o = 0, lse = -inf, no gradient."""

    var o: List[Float64]
    var lse: List[Float64]
    var dq: List[Float64]
    var dk: List[Float64]
    var dv: List[Float64]

    def __init__(out self):
        self.o = List[Float64]()
        self.lse = List[Float64]()
        self.dq = List[Float64]()
        self.dk = List[Float64]()
        self.dv = List[Float64]()


def _host_ref[
    dtype: DType
](
    hq: HostBuffer[dtype],
    hk: HostBuffer[dtype],
    hv: HostBuffer[dtype],
    hdo: HostBuffer[dtype],
    grads: Bool,
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
    scale: Float64,
    causal: Bool,
    lens: List[Int],
) -> HostRef:
    """lens: each sequence's key count L_b (already clamped to [0, Skv]); keys past it are not read."""
    var r = HostRef()
    var nan = Float64(0) / Float64(0)
    var inf = Float64(1) / Float64(0)
    r.o = List[Float64](length=B * H * S * D, fill=0)
    r.lse = List[Float64](length=B * H * S, fill=0)
    if grads:
        r.dq = List[Float64](length=B * H * S * D, fill=0)
        r.dk = List[Float64](length=B * Hkv * Skv * D, fill=0)
        r.dv = List[Float64](length=B * Hkv * Skv * D, fill=0)
    var sc = List[Float64](length=Skv, fill=0)
    var p = List[Float64](length=Skv, fill=0)
    for b in range(B):
        for h in range(H):
            var kvb = ((b * Hkv + h // (H // Hkv)) * Skv) * D
            var qb = ((b * H + h) * S) * D
            var kvl = lens[b]
            for i in range(S):
                var last = kvl - 1
                if causal:
                    last = min(last, i + kvl - S)
                var li = (b * H + h) * S + i
                if last < 0:
                    r.lse[li] = -inf
                    continue
                var mx = -inf
                for j in range(last + 1):
                    var s = Float64(0)
                    for d in range(D):
                        s += hq[qb + i * D + d].cast[F64]() * hk[kvb + j * D + d].cast[F64]()
                    sc[j] = s * scale
                    mx = _nmax64(mx, sc[j])
                if mx != mx or mx * 0 != 0:  # NaN / +-inf max: the softmax is NaN; lse as torch.logsumexp
                    r.lse[li] = mx
                    for d in range(D):
                        r.o[qb + i * D + d] = nan
                    if not grads:
                        continue
                    # the gradients follow FlashAttention-2's formulas from the saved lse, as the kernels and
                    # ops/attention.py's reference_backward do: p_j = exp(s_j - lse) (NaN, or 0 beside an
                    # inf score), delta = do . o = NaN, so dq and every visible key's dk are NaN
                    for j in range(last + 1):
                        p[j] = exp_f64(sc[j] - mx)
                else:
                    var l = Float64(0)
                    for j in range(last + 1):
                        p[j] = exp_f64(sc[j] - mx)
                        l += p[j]
                    r.lse[li] = mx + log_f64(l)
                    for j in range(last + 1):
                        p[j] /= l
                    for d in range(D):
                        var acc = Float64(0)
                        for j in range(last + 1):
                            acc += p[j] * hv[kvb + j * D + d].cast[F64]()
                        r.o[qb + i * D + d] = acc
                if grads:
                    var delta = Float64(0)
                    for d in range(D):
                        delta += hdo[qb + i * D + d].cast[F64]() * r.o[qb + i * D + d]
                    for j in range(last + 1):
                        var dp = Float64(0)
                        for d in range(D):
                            dp += hdo[qb + i * D + d].cast[F64]() * hv[kvb + j * D + d].cast[F64]()
                        var ds = p[j] * (dp - delta)
                        for d in range(D):
                            r.dq[qb + i * D + d] += scale * ds * hk[kvb + j * D + d].cast[F64]()
                            r.dk[kvb + j * D + d] += scale * ds * hq[qb + i * D + d].cast[F64]()
                            r.dv[kvb + j * D + d] += p[j] * hdo[qb + i * D + d].cast[F64]()
    return r^


def _tensors[
    dtype: DType
](
    ob: DeviceBuffer[dtype], lb: DeviceBuffer[DType.float32], qb: DeviceBuffer[dtype], kb: DeviceBuffer[dtype],
    vb: DeviceBuffer[dtype], lenb: DeviceBuffer[DType.int32], pb: DeviceBuffer[DType.float32], B: Int, H: Int,
    Hkv: Int, S: Int, Skv: Int, D: Int, has_len: Bool, ctx: DeviceContext,
) raises:
    comptime s4 = StaticTensorSpec[dtype, 4, ...].get_unknown()
    comptime f3 = StaticTensorSpec[DType.float32, 3, ...].get_unknown()
    comptime f1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    comptime i1 = StaticTensorSpec[DType.int32, 1, ...].get_unknown()
    var qs = IndexList[4](B, H, S, D)
    var qst = IndexList[4](H * S * D, S * D, D, 1)
    var ks = IndexList[4](B, Hkv, Skv, D)
    var kst = IndexList[4](Hkv * Skv * D, Skv * D, D, 1)
    var o = MutableInputTensor[static_spec=s4](_mut(ob.unsafe_ptr()), qs, qst)
    var lse = MutableInputTensor[static_spec=f3](_mut(lb.unsafe_ptr()), IndexList[3](B, H, S), IndexList[3](H * S, S, 1))
    var q = InputTensor[static_spec=s4](_mut(qb.unsafe_ptr()), qs, qst)
    var k = InputTensor[static_spec=s4](_mut(kb.unsafe_ptr()), ks, kst)
    var v = InputTensor[static_spec=s4](_mut(vb.unsafe_ptr()), ks, kst)
    var kl = InputTensor[static_spec=i1](_mut(lenb.unsafe_ptr()), IndexList[1](B if has_len else 1), IndexList[1](1))
    var p = InputTensor[static_spec=f1](_mut(pb.unsafe_ptr()), IndexList[1](3), IndexList[1](1))
    var n_part = _decode_part[dtype](ctx, B, H, Hkv, S, Skv, D)
    var partb = workspace[DType.float32](ctx, n_part)  # the caller's workspace (specs.attention_decode_part)
    var part = MutableInputTensor[static_spec=f1](_mut(partb.unsafe_ptr()), IndexList[1](max(n_part, 1)), IndexList[1](1))
    Attention.execute["gpu"](o, lse, part, q, k, v, kl, p, ctx)
    ctx.synchronize()  # partb is freed on return


def _decode_part[dtype: DType](ctx: DeviceContext, B: Int, H: Int, Hkv: Int, S: Int, Skv: Int, D: Int) raises -> Int:
    """The split partials' workspace a decode-shaped forward needs (0 otherwise): specs.attention_decode_part."""
    if not decode_applies(H, Hkv, S, D):
        return 0
    var plan = decode_plan(B, H, Hkv, S, Skv, D, size_of[dtype](), sm_count(ctx))
    return decode_part_len(B, H, S, D, plan[2])


def _bwd_tensors[
    dtype: DType
](
    dqb: DeviceBuffer[dtype], dkb: DeviceBuffer[dtype], dvb: DeviceBuffer[dtype], dob: DeviceBuffer[dtype],
    qb: DeviceBuffer[dtype], kb: DeviceBuffer[dtype], vb: DeviceBuffer[dtype], ob: DeviceBuffer[dtype],
    lb: DeviceBuffer[DType.float32], lenb: DeviceBuffer[DType.int32], pb: DeviceBuffer[DType.float32], B: Int,
    H: Int, Hkv: Int, S: Int, Skv: Int, D: Int, has_len: Bool, ctx: DeviceContext, n_params: Int = 3,
) raises:
    """n_params 4: pb holds [causal, scale, has_kv_len, bwd_tc] (the tensor-core backward's opt-in)."""
    comptime s4 = StaticTensorSpec[dtype, 4, ...].get_unknown()
    comptime f3 = StaticTensorSpec[DType.float32, 3, ...].get_unknown()
    comptime f1 = StaticTensorSpec[DType.float32, 1, ...].get_unknown()
    comptime i1 = StaticTensorSpec[DType.int32, 1, ...].get_unknown()
    var qs = IndexList[4](B, H, S, D)
    var qst = IndexList[4](H * S * D, S * D, D, 1)
    var ks = IndexList[4](B, Hkv, Skv, D)
    var kst = IndexList[4](Hkv * Skv * D, Skv * D, D, 1)
    var dq = MutableInputTensor[static_spec=s4](_mut(dqb.unsafe_ptr()), qs, qst)
    var dk = MutableInputTensor[static_spec=s4](_mut(dkb.unsafe_ptr()), ks, kst)
    var dv = MutableInputTensor[static_spec=s4](_mut(dvb.unsafe_ptr()), ks, kst)
    var do_ = InputTensor[static_spec=s4](_mut(dob.unsafe_ptr()), qs, qst)
    var q = InputTensor[static_spec=s4](_mut(qb.unsafe_ptr()), qs, qst)
    var k = InputTensor[static_spec=s4](_mut(kb.unsafe_ptr()), ks, kst)
    var v = InputTensor[static_spec=s4](_mut(vb.unsafe_ptr()), ks, kst)
    var o = InputTensor[static_spec=s4](_mut(ob.unsafe_ptr()), qs, qst)
    var lse = InputTensor[static_spec=f3](_mut(lb.unsafe_ptr()), IndexList[3](B, H, S), IndexList[3](H * S, S, 1))
    var kl = InputTensor[static_spec=i1](_mut(lenb.unsafe_ptr()), IndexList[1](B if has_len else 1), IndexList[1](1))
    var p = InputTensor[static_spec=f1](_mut(pb.unsafe_ptr()), IndexList[1](n_params), IndexList[1](1))
    var deltab = workspace[DType.float32](ctx, B * H * S)  # the caller's workspace: one fp32 per query row
    var delta = MutableInputTensor[static_spec=f1](_mut(deltab.unsafe_ptr()), IndexList[1](B * H * S), IndexList[1](1))
    AttentionBackward.execute["gpu"](dq, dk, dv, delta, do_, q, k, v, o, lse, kl, p, ctx)


def _set_kernel[dtype: DType](p: Pointer[Scalar[dtype], MutAnyOrigin], idx: Int64, val: Float64):
    if global_idx.x == 0:
        p[unsafe_offset=Int(idx)] = val.cast[dtype]()


def _set[dtype: DType](ctx: DeviceContext, buf: DeviceBuffer[dtype], idx: Int, val: Float64) raises:
    """buf[idx] = val (to plant a NaN / Inf)."""
    ctx.enqueue_function[_set_kernel[dtype]](buf, Int64(idx), val, grid_dim=1, block_dim=32)


def _lens(kvk: Int, B: Int, Skv: Int) -> List[Int32]:
    """Raw kv_len values: kvk 1 in range (Skv, 0, odd, 1, ...); kvk 2 untrusted values past both ends
    first (-3, Skv + 5, INT32_MAX, INT32_MIN: clamped to 0, Skv, Skv, 0)."""
    var res = List[Int32]()
    for b in range(B):
        var n = (b * 37 + 5) % (Skv + 1)
        if b == 0:
            n = Skv
        elif b == 1:
            n = 0
        elif b == 2:
            n = (Skv // 2) | 1
        elif b == 3:
            n = 1
        res.append(Int32(n))
    if kvk == 2:
        res[0] = -3
        if B > 1:
            res[1] = Int32(Skv + 5)
        if B > 2:
            res[2] = Int32.MAX
        if B > 3:
            res[3] = Int32.MIN
    return res^


def _device_ints(ctx: DeviceContext, vals: List[Int32]) raises -> DeviceBuffer[DType.int32]:
    """An int32 device buffer holding vals (one 0 when empty: the [1] dummy of an absent kv_len)."""
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


def _nan_tail_kernel[dtype: DType](
    p: Pointer[Scalar[dtype], MutAnyOrigin], lens: Pointer[Int32, MutAnyOrigin], B: Int64, Hkv: Int64, Skv: Int64,
    D: Int64,
):
    """k or v [B, Hkv, Skv, D]: NaN in every key row j >= lens[b] (a cache's garbage, never to be read)."""
    var nan = Float64(0) / Float64(0)
    var i = global_idx.x
    var n = Int(B * Hkv * Skv * D)
    while i < n:
        var j = (i // Int(D)) % Int(Skv)
        var b = i // Int(Hkv * Skv * D)
        if j >= Int(lens[unsafe_offset=b]):
            p[unsafe_offset=i] = nan.cast[dtype]()
        i += grid_dim.x * block_dim.x


def _nan_tail[dtype: DType](
    ctx: DeviceContext, buf: DeviceBuffer[dtype], lens: DeviceBuffer[DType.int32], B: Int, Hkv: Int, Skv: Int, D: Int
) raises:
    ctx.enqueue_function[_nan_tail_kernel[dtype]](
        buf, lens, Int64(B), Int64(Hkv), Int64(Skv), Int64(D), grid_dim=256, block_dim=256
    )


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
    bad: Int = 0,
    grads: Bool = False,
    kvk: Int = 0,
    rowwise: Bool = False,
) raises:
    """kvk: per-sequence kv_len (0 none; 1, 2 see _lens), keys past each length NaN in k and v;
    rowwise: the forward through the row-wise kernel (the B*H > 65535 path) instead of execute.
    bad: plant non-finite inputs (1 NaN in q row 3 of head 1; 2 NaN in key 6 of kv head 0;
    3 NaN + inf + -inf in v; 4 NaN in k and v of the last key and inf in v of the one before (seen by
    the last rows only under causal); 5 +inf in key 6)."""
    var nq = B * H * S * D
    var nk = B * Hkv * Skv * D
    var qb = ctx.enqueue_create_buffer[dtype](nq)
    var kb = ctx.enqueue_create_buffer[dtype](nk)
    var vb = ctx.enqueue_create_buffer[dtype](nk)
    var ob = ctx.enqueue_create_buffer[dtype](nq)
    var lb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    var rb = ctx.enqueue_create_buffer[dtype](nq)
    var rlb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    fill_random(ctx, qb, nq, seed, -1.0, 1.0)
    fill_random(ctx, kb, nk, seed + 1, -1.0, 1.0)
    fill_random(ctx, vb, nk, seed + 2, -1.0, 1.0)
    var nan = Float64(0) / Float64(0)
    var inf = Float64(1) / Float64(0)
    if bad == 1:
        _set(ctx, qb, ((0 * H + min(1, H - 1)) * S + 3) * D + 7, nan)
    elif bad == 2:
        _set(ctx, kb, (0 * Skv + 6) * D + 10, nan)
    elif bad == 3:
        _set(ctx, vb, (0 * Skv + 6) * D + 5, nan)
        _set(ctx, vb, (0 * Skv + 9) * D + 2, inf)
        _set(ctx, vb, (0 * Skv + 2) * D + 3, -inf)
    elif bad == 4:
        _set(ctx, kb, (0 * Skv + Skv - 1) * D + 3, nan)
        _set(ctx, vb, (0 * Skv + Skv - 1) * D + 4, nan)
        _set(ctx, vb, (0 * Skv + Skv - 2) * D + 4, inf)
    elif bad == 5:
        _set(ctx, kb, (0 * Skv + 6) * D + 10, inf)
    var has_len = kvk > 0
    var raw = _lens(kvk, B, Skv) if has_len else List[Int32]()
    var lens = List[Int]()
    var clamped = List[Int32]()
    for b in range(B):
        var n = min(max(Int(raw[b]), 0), Skv) if has_len else Skv
        lens.append(n)
        clamped.append(Int32(n))
    var lenb = _device_ints(ctx, raw)
    if has_len:
        var clb = _device_ints(ctx, clamped)
        _nan_tail(ctx, kb, clb, B, Hkv, Skv, D)
        _nan_tail(ctx, vb, clb, B, Hkv, Skv, D)
    poison(ctx, ob)
    poison(ctx, lb)
    poison(ctx, rb)
    poison(ctx, rlb)
    var scale = Float32(1.0) / Float32(D).__pow__(Float32(0.5)) * 2  # x2: peakier softmax than 1/sqrt(D)
    var pb = device_params(ctx, Float32(1.0) if causal else Float32(0.0), scale, Float32(1.0) if has_len else Float32(0.0))
    if rowwise:
        attention_gpu[dtype](
            _mut(ob.unsafe_ptr()), _mut(lb.unsafe_ptr()), _mut(qb.unsafe_ptr()), _mut(kb.unsafe_ptr()),
            _mut(vb.unsafe_ptr()), _mut(lenb.unsafe_ptr()), _mut(pb.unsafe_ptr()), B, H, Hkv, S, Skv, D, ctx,
            force_rowwise=True,
        )
    else:
        _tensors[dtype](ob, lb, qb, kb, vb, lenb, pb, B, H, Hkv, S, Skv, D, has_len, ctx)
    var name = String(
        "attention ", dtype, " B", B, " H", H, " Hkv", Hkv, " S", S, " Skv", Skv, " D", D, " causal=", causal, " bad=", bad,
        " kv_len=", kvk, " rowwise=", rowwise,
    )
    var tol = 1e-2 if dtype == DType.bfloat16 else (2e-3 if dtype == DType.float16 else 2e-5)
    var ho = to_host(ctx, ob, nq)
    var hl = to_host(ctx, lb, B * H * S)
    if host_ref:
        var hq = to_host(ctx, qb, nq)
        var hk = to_host(ctx, kb, nk)
        var hv = to_host(ctx, vb, nk)
        var dob = ctx.enqueue_create_buffer[dtype](nq)
        fill_random(ctx, dob, nq, seed + 3, -1.0, 1.0)
        var hdo = to_host(ctx, dob, nq)
        var want = _host_ref[dtype](hq, hk, hv, hdo, grads, B, H, Hkv, S, Skv, D, Float64(scale), causal, lens)
        var eo = RelErr()
        for i in range(nq):
            eo.add_pattern(ho[i].cast[F64](), want.o[i])
        check(name + " o vs host f64", eo.value(), tol, failures)
        var el = RelErr()
        for i in range(B * H * S):
            el.add_pattern(hl[i].cast[F64](), want.lse[i])
        check(name + " lse vs host f64", el.value(), 2e-5 if dtype == DType.float32 else 1e-3, failures)
        if grads:
            var dqb = ctx.enqueue_create_buffer[dtype](nq)
            var dkb = ctx.enqueue_create_buffer[dtype](nk)
            var dvb = ctx.enqueue_create_buffer[dtype](nk)
            poison(ctx, dqb)
            poison(ctx, dkb)
            poison(ctx, dvb)
            _bwd_tensors[dtype](dqb, dkb, dvb, dob, qb, kb, vb, ob, lb, lenb, pb, B, H, Hkv, S, Skv, D, has_len, ctx)
            var hdq = to_host(ctx, dqb, nq)
            var hdk = to_host(ctx, dkb, nk)
            var hdv = to_host(ctx, dvb, nk)
            var e1 = RelErr()
            var e2 = RelErr()
            var e3 = RelErr()
            # add_pattern: with non-finite inputs (bad > 0) the reference gradients hold NaN / inf too
            for i in range(nq):
                e1.add_pattern(hdq[i].cast[F64](), want.dq[i])
            for i in range(nk):
                e2.add_pattern(hdk[i].cast[F64](), want.dk[i])
                e3.add_pattern(hdv[i].cast[F64](), want.dv[i])
            check(name + " dq vs host f64", e1.value(), 2 * tol, failures)
            check(name + " dk vs host f64", e2.value(), 2 * tol, failures)
            check(name + " dv vs host f64", e3.value(), 2 * tol, failures)
            # keys past kv_len: exactly zero gradients (their NaN values never read)
            var tail_bad = 0
            for i in range(nk):
                var j = (i // D) % Skv
                if j >= lens[i // (Hkv * Skv * D)] and (hdk[i] != 0 or hdv[i] != 0):
                    tail_bad += 1
            check(name + " dk/dv past kv_len are 0", Float64(tail_bad), 0.0, failures)
            # deterministic: a second run is bit-identical
            _bwd_tensors[dtype](dqb, dkb, dvb, dob, qb, kb, vb, ob, lb, lenb, pb, B, H, Hkv, S, Skv, D, has_len, ctx)
            var hdk2 = to_host(ctx, dkb, nk)
            var diff = 0
            for i in range(nk):
                var a = hdk2[i]
                var c = hdk[i]
                if a != c and not (a != a and c != c):  # NaN in both runs is the same result
                    diff += 1
            check(name + " dk deterministic", Float64(diff), 0.0, failures)
    else:
        attention_gpu[dtype](
            _mut(rb.unsafe_ptr()), _mut(rlb.unsafe_ptr()), _mut(qb.unsafe_ptr()), _mut(kb.unsafe_ptr()),
            _mut(vb.unsafe_ptr()), _mut(lenb.unsafe_ptr()), _mut(pb.unsafe_ptr()), B, H, Hkv, S, Skv, D, ctx,
            force_rowwise=True,
        )
        var hr = to_host(ctx, rb, nq)
        var hrl = to_host(ctx, rlb, B * H * S)
        var e = RelErr()
        for i in range(nq):
            e.add_pattern(ho[i].cast[F64](), hr[i].cast[F64]())
        check(name + " o vs rowwise fp32 GPU", e.value(), tol, failures)
        var el = RelErr()
        for i in range(B * H * S):
            el.add_pattern(hl[i].cast[F64](), hrl[i].cast[F64]())
        check(name + " lse vs rowwise fp32 GPU", el.value(), 1e-4, failures)


def _bench[
    dtype: DType, HD: Int = 0, NWG: Int = 0, BN: Int = 0, PP: Bool = True
](ctx: DeviceContext, B: Int, H: Int, S: Int, D: Int, causal: Bool, iters: Int, hopper: Bool = True) raises:
    """Forward FLOP rate through attention_gpu (hopper False: `_fa2_kernel` where the sm_90 wgmma kernel would
    run), or with NWG > 0 the wgmma kernel at head dim HD (= D), (consumer warpgroups, key tile) = (NWG, BN)
    and pingpong PP: the tuning sweep."""
    var n = B * H * S * D
    var qb = ctx.enqueue_create_buffer[dtype](n)
    var kb = ctx.enqueue_create_buffer[dtype](n)
    var vb = ctx.enqueue_create_buffer[dtype](n)
    var ob = ctx.enqueue_create_buffer[dtype](n)
    var lb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    fill_random(ctx, qb, n, 7, -1.0, 1.0)
    fill_random(ctx, kb, n, 8, -1.0, 1.0)
    fill_random(ctx, vb, n, 9, -1.0, 1.0)
    var pb = device_params(
        ctx, Float32(1.0) if causal else Float32(0.0), Float32(1.0) / Float32(D).__pow__(Float32(0.5)), Float32(0.0)
    )
    var lenb = _device_ints(ctx, List[Int32]())
    var kl = _mut(lenb.unsafe_ptr())
    var o = _mut(ob.unsafe_ptr())
    var l = _mut(lb.unsafe_ptr())
    var q = _mut(qb.unsafe_ptr())
    var k = _mut(kb.unsafe_ptr())
    var v = _mut(vb.unsafe_ptr())
    var p = _mut(pb.unsafe_ptr())

    @always_inline
    def launch() raises {var}:
        comptime if NWG > 0:
            attention_hopper_gpu[dtype, HD, NWG, BN, PP](o, l, q, k, v, kl, p, B, H, H, S, S, ctx)
        else:
            attention_gpu[dtype](o, l, q, k, v, kl, p, B, H, H, S, S, D, ctx, hopper=hopper)

    launch()  # warm-up (module load)
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        launch()
    ctx.synchronize()
    var ns = Float64(now_ns() - t0) / Float64(iters)
    var flops = 4.0 * Float64(B * H) * Float64(S) * Float64(S) * Float64(D) * (0.5 if causal else 1.0)
    var tf = flops / ns / 1000.0
    comptime if NWG > 0:
        print("PERF hopper_cfg", "pingpong" if PP else "no_pingpong", dtype, "D", D, "NWG", NWG, "BN", BN, "B", B,
              "S", S, "causal=", causal, "us=", ns / 1000.0, "TFLOP/s=", tf)
    else:
        print("PERF attention", dtype, "B", B, "H", H, "S", S, "D", D, "causal=", causal, "hopper=", hopper,
              "us=", ns / 1000.0, "TFLOP/s=", tf, "of_SDPA_604=", tf / 604.0)


def _bench_bwd[dtype: DType](ctx: DeviceContext, B: Int, H: Int, S: Int, D: Int, causal: Bool, iters: Int) raises:
    var n = B * H * S * D
    var qb = ctx.enqueue_create_buffer[dtype](n)
    var kb = ctx.enqueue_create_buffer[dtype](n)
    var vb = ctx.enqueue_create_buffer[dtype](n)
    var ob = ctx.enqueue_create_buffer[dtype](n)
    var dob = ctx.enqueue_create_buffer[dtype](n)
    var dqb = ctx.enqueue_create_buffer[dtype](n)
    var dkb = ctx.enqueue_create_buffer[dtype](n)
    var dvb = ctx.enqueue_create_buffer[dtype](n)
    var lb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    fill_random(ctx, qb, n, 20, -1.0, 1.0)
    fill_random(ctx, kb, n, 21, -1.0, 1.0)
    fill_random(ctx, vb, n, 22, -1.0, 1.0)
    fill_random(ctx, dob, n, 23, -1.0, 1.0)
    var pb = device_params(
        ctx, Float32(1.0) if causal else Float32(0.0), Float32(1.0) / Float32(D).__pow__(Float32(0.5)), Float32(0.0)
    )
    var lenb = _device_ints(ctx, List[Int32]())
    var kl = _mut(lenb.unsafe_ptr())
    var dq = _mut(dqb.unsafe_ptr())
    var dk = _mut(dkb.unsafe_ptr())
    var dv = _mut(dvb.unsafe_ptr())
    var do_ = _mut(dob.unsafe_ptr())
    var q = _mut(qb.unsafe_ptr())
    var k = _mut(kb.unsafe_ptr())
    var v = _mut(vb.unsafe_ptr())
    var o = _mut(ob.unsafe_ptr())
    var l = _mut(lb.unsafe_ptr())
    var p = _mut(pb.unsafe_ptr())
    var deltab = workspace[DType.float32](ctx, B * H * S)
    var delta = _mut(deltab.unsafe_ptr())
    var nd = B * H * S
    attention_gpu[dtype](o, l, q, k, v, kl, p, B, H, H, S, S, D, ctx)
    attention_backward_gpu[dtype](dq, dk, dv, delta, nd, do_, q, k, v, o, l, kl, p, B, H, H, S, S, D, ctx)  # warm-up
    ctx.synchronize()
    var t0 = now_ns()
    for _ in range(iters):
        attention_backward_gpu[dtype](dq, dk, dv, delta, nd, do_, q, k, v, o, l, kl, p, B, H, H, S, S, D, ctx)
    ctx.synchronize()
    var ns = Float64(now_ns() - t0) / Float64(iters)
    var flops = 10.0 * Float64(B * H) * Float64(S) * Float64(S) * Float64(D) * (0.5 if causal else 1.0)
    print("PERF attention_backward", dtype, "B", B, "H", H, "S", S, "D", D, "causal=", causal, "us=", ns / 1000.0,
          "TFLOP/s=", flops / ns / 1000.0)


# ---- the opt-in tensor-core backward (mojo/_attention_backward.mojo) -----------------------------------


def _rows_check(
    name: String, err2: List[Float64], ref2: List[Float64], heads: Int, seq: Int, tol: Float64, mut failures: Int
):
    """The worst row (one D-vector of dq / dk / dv): ||got - ref|| / max(||ref||, rms row norm), and where it
    is (b, head, row): an error confined to a few rows or keys (a tile edge, the causal diagonal, kv_len) that
    the global norm dilutes. Tolerance 4x the global one (a row averages D elements' rounding)."""
    var rows = len(err2)
    var tot = Float64(0)
    for r in range(rows):
        tot += ref2[r]
    var floor2 = tot / Float64(max(rows, 1))
    var worst = Float64(0)
    var wr = 0
    for r in range(rows):
        var den = max(ref2[r], floor2)
        var e = sqrt(err2[r] / den) if den > 0 else sqrt(err2[r])
        if e > worst or e != e:
            worst = e
            wr = r
            if e != e:
                break
    print("  worst row: b", wr // (heads * seq), "head", (wr // seq) % heads, "row", wr % seq, "rel_err=", worst)
    check(name + " worst row", worst, 4 * tol, failures)


def _cmp[
    dtype: DType
](
    name: String, got: HostBuffer[dtype], want: HostBuffer[dtype], n: Int, tol: Float64, mut failures: Int,
    D: Int, heads: Int, seq: Int,
):
    """Relative error (NaN / inf patterns must match), the largest absolute difference, and the worst row
    (`_rows_check`; rows of D elements, `heads` x `seq` per batch)."""
    var e = RelErr()
    var mx = Float64(0)
    var mref = Float64(0)
    var err2 = List[Float64](length=n // D, fill=0)
    var ref2 = List[Float64](length=n // D, fill=0)
    for i in range(n):
        var a = got[i].cast[F64]()
        var b = want[i].cast[F64]()
        e.add_pattern(a, b)
        if b * 0 == 0:
            mx = _nmax64(mx, abs(a - b))
            mref = max(mref, abs(b))
            err2[i // D] += (a - b) * (a - b)
            ref2[i // D] += b * b
    print("  max_abs_err=", mx, "max_abs_ref=", mref)
    check(name, e.value(), tol, failures)
    _rows_check(name, err2, ref2, heads, seq, tol, failures)


def _cmp64[
    dtype: DType
](
    name: String, got: HostBuffer[dtype], want: List[Float64], n: Int, tol: Float64, mut failures: Int,
    D: Int, heads: Int, seq: Int,
):
    var e = RelErr()
    var mx = Float64(0)
    var mref = Float64(0)
    var err2 = List[Float64](length=n // D, fill=0)
    var ref2 = List[Float64](length=n // D, fill=0)
    for i in range(n):
        var a = got[i].cast[F64]()
        e.add_pattern(a, want[i])
        if want[i] * 0 == 0:
            mx = _nmax64(mx, abs(a - want[i]))
            mref = max(mref, abs(want[i]))
            err2[i // D] += (a - want[i]) * (a - want[i])
            ref2[i // D] += want[i] * want[i]
    print("  max_abs_err=", mx, "max_abs_ref=", mref)
    check(name, e.value(), tol, failures)
    _rows_check(name, err2, ref2, heads, seq, tol, failures)


def _same[dtype: DType](a: HostBuffer[dtype], b: HostBuffer[dtype], n: Int) -> Int:
    """Elements whose bits differ (NaN = NaN)."""
    var diff = 0
    for i in range(n):
        if a[i] != b[i] and (a[i] == a[i] or b[i] == b[i]):
            diff += 1
    return diff


def _tc_case[
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
    kvk: Int,
    host_ref: Bool,
    mut failures: Int,
    seed: Int,
) raises:
    """Forward through execute, then the SIMT backward (params [3]) and the tensor-core one (params [4], the
    opt-in slot) through execute: TC against SIMT, against float64 on the host (host_ref), keys past kv_len
    exactly 0 in dk / dv (kvk: per-sequence kv_len as in _case, keys past each length NaN), and a second TC
    run bit-identical (deterministic)."""
    var nq = B * H * S * D
    var nk = B * Hkv * Skv * D
    var qb = ctx.enqueue_create_buffer[dtype](nq)
    var kb = ctx.enqueue_create_buffer[dtype](nk)
    var vb = ctx.enqueue_create_buffer[dtype](nk)
    var ob = ctx.enqueue_create_buffer[dtype](nq)
    var dob = ctx.enqueue_create_buffer[dtype](nq)
    var lb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    fill_random(ctx, qb, nq, seed, -1.0, 1.0)
    fill_random(ctx, kb, nk, seed + 1, -1.0, 1.0)
    fill_random(ctx, vb, nk, seed + 2, -1.0, 1.0)
    fill_random(ctx, dob, nq, seed + 3, -1.0, 1.0)
    var has_len = kvk > 0
    var raw = _lens(kvk, B, Skv) if has_len else List[Int32]()
    var lens = List[Int]()
    var clamped = List[Int32]()
    for b in range(B):
        var n = min(max(Int(raw[b]), 0), Skv) if has_len else Skv
        lens.append(n)
        clamped.append(Int32(n))
    var lenb = _device_ints(ctx, raw)
    if has_len:
        var clb = _device_ints(ctx, clamped)
        _nan_tail(ctx, kb, clb, B, Hkv, Skv, D)
        _nan_tail(ctx, vb, clb, B, Hkv, Skv, D)
    var scale = Float32(1.0) / Float32(D).__pow__(Float32(0.5)) * 2  # x2: peakier softmax than 1/sqrt(D)
    var cf = Float32(1.0) if causal else Float32(0.0)
    var hf = Float32(1.0) if has_len else Float32(0.0)
    var pb = device_params(ctx, cf, scale, hf)
    var pb4 = device_params(ctx, cf, scale, hf, Float32(1.0))
    poison(ctx, ob)
    poison(ctx, lb)
    _tensors[dtype](ob, lb, qb, kb, vb, lenb, pb, B, H, Hkv, S, Skv, D, has_len, ctx)
    var name = String(
        "attn_bwd_tc ", dtype, " B", B, " H", H, " Hkv", Hkv, " S", S, " Skv", Skv, " D", D, " causal=", causal,
        " kv_len=", kvk,
    )
    var tol = 2e-2 if dtype == DType.bfloat16 else 4e-3  # as _case's gradient checks (2x the output tol)

    var sq = ctx.enqueue_create_buffer[dtype](nq)
    var sk = ctx.enqueue_create_buffer[dtype](nk)
    var sv = ctx.enqueue_create_buffer[dtype](nk)
    var tq = ctx.enqueue_create_buffer[dtype](nq)
    var tk = ctx.enqueue_create_buffer[dtype](nk)
    var tv = ctx.enqueue_create_buffer[dtype](nk)
    poison(ctx, sq)
    poison(ctx, sk)
    poison(ctx, sv)
    poison(ctx, tq)
    poison(ctx, tk)
    poison(ctx, tv)
    var t0 = now_ns()
    _bwd_tensors[dtype](sq, sk, sv, dob, qb, kb, vb, ob, lb, lenb, pb, B, H, Hkv, S, Skv, D, has_len, ctx)
    ctx.synchronize()
    var t1 = now_ns()
    _bwd_tensors[dtype](tq, tk, tv, dob, qb, kb, vb, ob, lb, lenb, pb4, B, H, Hkv, S, Skv, D, has_len, ctx, 4)
    ctx.synchronize()
    var t2 = now_ns()
    print("CASE", name, "simt_ms=", Float64(t1 - t0) / 1e6, "tc_ms=", Float64(t2 - t1) / 1e6, "(single cold calls)")
    var hsq = to_host(ctx, sq, nq)
    var hsk = to_host(ctx, sk, nk)
    var hsv = to_host(ctx, sv, nk)
    var htq = to_host(ctx, tq, nq)
    var htk = to_host(ctx, tk, nk)
    var htv = to_host(ctx, tv, nk)
    _cmp[dtype](name + " dq tc vs simt", htq, hsq, nq, tol, failures, D, H, S)
    _cmp[dtype](name + " dk tc vs simt", htk, hsk, nk, tol, failures, D, Hkv, Skv)
    _cmp[dtype](name + " dv tc vs simt", htv, hsv, nk, tol, failures, D, Hkv, Skv)
    # the opt-in path really ran: TC (bf16/fp16-rounded P, dS; other sum orders) and SIMT differ in some bits
    # of any non-trivial case; 0 differing elements means params' 4th slot did not select the TC kernels
    var ndiff = _same(htq, hsq, nq) + _same(htk, hsk, nk) + _same(htv, hsv, nk)
    print("  elements differing from simt:", ndiff, "of", nq + 2 * nk)
    check(name + " tc path taken (bits differ from simt)", Float64(1 if ndiff == 0 else 0), 0.0, failures)
    if host_ref:
        var hq = to_host(ctx, qb, nq)
        var hk = to_host(ctx, kb, nk)
        var hv = to_host(ctx, vb, nk)
        var hdo = to_host(ctx, dob, nq)
        var want = _host_ref[dtype](hq, hk, hv, hdo, True, B, H, Hkv, S, Skv, D, Float64(scale), causal, lens)
        _cmp64[dtype](name + " dq tc vs host f64", htq, want.dq, nq, tol, failures, D, H, S)
        _cmp64[dtype](name + " dk tc vs host f64", htk, want.dk, nk, tol, failures, D, Hkv, Skv)
        _cmp64[dtype](name + " dv tc vs host f64", htv, want.dv, nk, tol, failures, D, Hkv, Skv)
        var context_only = 0  # the SIMT kernels' own error, printed for scale (run() checks them)
        _cmp64[dtype](
            name + " dq simt vs host f64 (context, not counted)", hsq, want.dq, nq, tol, context_only, D, H, S
        )
    # every gradient finite (inputs are; keys past kv_len are NaN and must never be read), and exactly 0
    # for keys past kv_len
    var bad = 0
    for i in range(nq):
        if htq[i].cast[F64]() * 0 != 0:
            bad += 1
    for i in range(nk):
        if htk[i].cast[F64]() * 0 != 0 or htv[i].cast[F64]() * 0 != 0:
            bad += 1
        var j = (i // D) % Skv
        if j >= lens[i // (Hkv * Skv * D)] and (htk[i] != 0 or htv[i] != 0):
            bad += 1
    check(name + " tc grads finite, 0 past kv_len", Float64(bad), 0.0, failures)
    # deterministic: a second TC run is bit-identical
    poison(ctx, tq)
    poison(ctx, tk)
    poison(ctx, tv)
    _bwd_tensors[dtype](tq, tk, tv, dob, qb, kb, vb, ob, lb, lenb, pb4, B, H, Hkv, S, Skv, D, has_len, ctx, 4)
    var diff = _same(to_host(ctx, tq, nq), htq, nq)
    diff += _same(to_host(ctx, tk, nk), htk, nk)
    diff += _same(to_host(ctx, tv, nk), htv, nk)
    check(name + " tc deterministic", Float64(diff), 0.0, failures)


def _bench_bwd_ab[
    dtype: DType
](ctx: DeviceContext, B: Int, H: Int, Hkv: Int, S: Int, D: Int, causal: Bool, iters: Int) raises:
    """The SIMT and the tensor-core backward on the same buffers (delta kernel included in both)."""
    var n = B * H * S * D
    var nk = B * Hkv * S * D
    var qb = ctx.enqueue_create_buffer[dtype](n)
    var kb = ctx.enqueue_create_buffer[dtype](nk)
    var vb = ctx.enqueue_create_buffer[dtype](nk)
    var ob = ctx.enqueue_create_buffer[dtype](n)
    var dob = ctx.enqueue_create_buffer[dtype](n)
    var dqb = ctx.enqueue_create_buffer[dtype](n)
    var dkb = ctx.enqueue_create_buffer[dtype](nk)
    var dvb = ctx.enqueue_create_buffer[dtype](nk)
    var lb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    fill_random(ctx, qb, n, 20, -1.0, 1.0)
    fill_random(ctx, kb, nk, 21, -1.0, 1.0)
    fill_random(ctx, vb, nk, 22, -1.0, 1.0)
    fill_random(ctx, dob, n, 23, -1.0, 1.0)
    var pb = device_params(
        ctx, Float32(1.0) if causal else Float32(0.0), Float32(1.0) / Float32(D).__pow__(Float32(0.5)), Float32(0.0)
    )
    var lenb = _device_ints(ctx, List[Int32]())
    var kl = _mut(lenb.unsafe_ptr())
    var dq = _mut(dqb.unsafe_ptr())
    var dk = _mut(dkb.unsafe_ptr())
    var dv = _mut(dvb.unsafe_ptr())
    var do_ = _mut(dob.unsafe_ptr())
    var q = _mut(qb.unsafe_ptr())
    var k = _mut(kb.unsafe_ptr())
    var v = _mut(vb.unsafe_ptr())
    var o = _mut(ob.unsafe_ptr())
    var l = _mut(lb.unsafe_ptr())
    var p = _mut(pb.unsafe_ptr())
    var deltab = workspace[DType.float32](ctx, B * H * S)
    var delta = _mut(deltab.unsafe_ptr())
    var nd = B * H * S
    attention_gpu[dtype](o, l, q, k, v, kl, p, B, H, Hkv, S, S, D, ctx)
    var flops = 10.0 * Float64(B * H) * Float64(S) * Float64(S) * Float64(D) * (0.5 if causal else 1.0)
    var us = List[Float64]()
    for tc in range(2):
        var on = tc == 1
        attention_backward_gpu[dtype](
            dq, dk, dv, delta, nd, do_, q, k, v, o, l, kl, p, B, H, Hkv, S, S, D, ctx, tensor_cores=on
        )  # warm-up (module load)
        ctx.synchronize()
        var t0 = now_ns()
        for _ in range(iters):
            attention_backward_gpu[dtype](
                dq, dk, dv, delta, nd, do_, q, k, v, o, l, kl, p, B, H, Hkv, S, S, D, ctx, tensor_cores=on
            )
        ctx.synchronize()
        var ns = Float64(now_ns() - t0) / Float64(iters)
        us.append(ns / 1000.0)
        print("PERF attention_backward", "tc  " if on else "simt", dtype, "B", B, "H", H, "Hkv", Hkv, "S", S, "D", D,
              "causal=", causal, "us=", ns / 1000.0, "TFLOP/s=", flops / ns / 1000.0)
    print("PERF attention_backward tc speedup over simt:", us[0] / us[1])


def run_bwd_tc(bench: Bool = True) raises:
    """The tensor-core backward's checks (D 64/128/256, causal and not, GQA 4, S != Skv both ways, kv_len
    with NaN tails, S = Skv = 2048; bf16 and fp16) and its timing against the SIMT backward."""
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        comptime for di in range(3):
            comptime D = 64 * (1 << di)  # 64, 128, 256
            for c in range(2):
                var causal = c == 1
                _tc_case[DType.bfloat16](ctx, 1, 8, 2, 37, 515, D, causal, 0, True, failures, 100 + di)
                _tc_case[DType.float16](ctx, 1, 8, 2, 37, 515, D, causal, 0, True, failures, 110 + di)
                _tc_case[DType.float16](ctx, 2, 4, 1, 130, 70, D, causal, 0, True, failures, 120 + di)
                _tc_case[DType.bfloat16](ctx, 1, 4, 4, 200, 200, D, causal, 0, True, failures, 130 + di)
                for kvk in range(1, 3):
                    _tc_case[DType.bfloat16](ctx, 5, 4, 1, 21, 45, D, causal, kvk, True, failures, 140 + kvk)
                    _tc_case[DType.float16](ctx, 4, 8, 2, 70, 130, D, causal, kvk, True, failures, 150 + kvk)
                _tc_case[DType.bfloat16](ctx, 1, 32, 8, 2048, 2048, D, causal, 0, False, failures, 160 + di)
                _tc_case[DType.float16](ctx, 1, 32, 8, 2048, 2048, D, causal, 0, False, failures, 170 + di)
        if bench:
            _bench_bwd_ab[DType.bfloat16](ctx, 1, 32, 8, 2048, 128, True, 3)  # issue #10's shape
            _bench_bwd_ab[DType.bfloat16](ctx, 1, 32, 8, 2048, 128, False, 3)
            _bench_bwd_ab[DType.bfloat16](ctx, 1, 32, 8, 2048, 64, True, 3)
            _bench_bwd_ab[DType.bfloat16](ctx, 1, 32, 8, 2048, 256, True, 3)
            _bench_bwd_ab[DType.float16](ctx, 1, 32, 8, 2048, 128, True, 3)
    print("attn_bwd_tc failures:", failures)
    if failures > 0:
        raise Error("attention_backward (tensor cores): ", failures, " checks failed")


def _decode_splits_case[
    dtype: DType
](ctx: DeviceContext, B: Int, H: Int, Hkv: Int, S: Int, Skv: Int, D: Int, causal: Bool, kvk: Int, mut failures: Int,
  seed: Int) raises:
    """The split-KV decode kernels at forced split counts (1: direct store; 2, 5, 64: partials + combine)
    against the row-wise fp32 GPU kernel, with kv_len (kvk as _case, keys past each length NaN), and a
    repeat that must be bit-identical (fixed combine order)."""
    var nq = B * H * S * D
    var nk = B * Hkv * Skv * D
    var qb = ctx.enqueue_create_buffer[dtype](nq)
    var kb = ctx.enqueue_create_buffer[dtype](nk)
    var vb = ctx.enqueue_create_buffer[dtype](nk)
    var ob = ctx.enqueue_create_buffer[dtype](nq)
    var lb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    var rb = ctx.enqueue_create_buffer[dtype](nq)
    var rlb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    fill_random(ctx, qb, nq, seed, -1.0, 1.0)
    fill_random(ctx, kb, nk, seed + 1, -1.0, 1.0)
    fill_random(ctx, vb, nk, seed + 2, -1.0, 1.0)
    var has_len = kvk > 0
    var raw = _lens(kvk, B, Skv) if has_len else List[Int32]()
    var lenb = _device_ints(ctx, raw)
    if has_len:
        var clamped = List[Int32]()
        for b in range(B):
            clamped.append(Int32(min(max(Int(raw[b]), 0), Skv)))
        var clb = _device_ints(ctx, clamped)
        _nan_tail(ctx, kb, clb, B, Hkv, Skv, D)
        _nan_tail(ctx, vb, clb, B, Hkv, Skv, D)
    var scale = Float32(1.0) / Float32(D).__pow__(Float32(0.5)) * 2
    var pb = device_params(ctx, Float32(1.0) if causal else Float32(0.0), scale, Float32(1.0) if has_len else Float32(0.0))
    var o = _mut(ob.unsafe_ptr())
    var l = _mut(lb.unsafe_ptr())
    var q = _mut(qb.unsafe_ptr())
    var k = _mut(kb.unsafe_ptr())
    var v = _mut(vb.unsafe_ptr())
    var kl = _mut(lenb.unsafe_ptr())
    var p = _mut(pb.unsafe_ptr())
    poison(ctx, rb)
    poison(ctx, rlb)
    attention_gpu[dtype](_mut(rb.unsafe_ptr()), _mut(rlb.unsafe_ptr()), q, k, v, kl, p, B, H, Hkv, S, Skv, D, ctx,
                         force_rowwise=True)
    var hr = to_host(ctx, rb, nq)
    var hrl = to_host(ctx, rlb, B * H * S)
    var tol = 1e-2 if dtype == DType.bfloat16 else (2e-3 if dtype == DType.float16 else 2e-5)
    var sp_list: List[Int] = [1, 2, 5, 64]
    # 16-bit dtypes: the tensor-core kernel (where the group has >= 2 rows) and the SIMT kernels
    var n_ker = 2 if size_of[dtype]() == 2 else 1
    for si in range(len(sp_list) * n_ker):
        var sp = sp_list[si % len(sp_list)]
        var tc = si < len(sp_list)
        var n_part = decode_part_len(B, H, S, D, sp)
        var partb = workspace[DType.float32](ctx, n_part)
        poison(ctx, ob)
        poison(ctx, lb)
        attention_gpu_ws[dtype](o, l, _mut(partb.unsafe_ptr()), n_part, q, k, v, kl, p, B, H, Hkv, S, Skv, D, ctx,
                                force_splits=sp, decode_mma=tc)
        var ho = to_host(ctx, ob, nq)
        var hl = to_host(ctx, lb, B * H * S)
        var name = String("attn_decode ", dtype, " B", B, " H", H, " Hkv", Hkv, " S", S, " Skv", Skv, " D", D,
                          " causal=", causal, " kv_len=", kvk, " splits=", sp, " mma=", tc)
        var e = RelErr()
        for i in range(nq):
            e.add_pattern(ho[i].cast[F64](), hr[i].cast[F64]())
        check(name + " o vs rowwise fp32 GPU", e.value(), tol, failures)
        var el = RelErr()
        for i in range(B * H * S):
            el.add_pattern(hl[i].cast[F64](), hrl[i].cast[F64]())
        check(name + " lse vs rowwise fp32 GPU", el.value(), 1e-4, failures)
        attention_gpu_ws[dtype](o, l, _mut(partb.unsafe_ptr()), n_part, q, k, v, kl, p, B, H, Hkv, S, Skv, D, ctx,
                                force_splits=sp, decode_mma=tc)
        var diff = _same(to_host(ctx, ob, nq), ho, nq)
        check(name + " deterministic", Float64(diff), 0.0, failures)


def _bench_decode[dtype: DType](ctx: DeviceContext, B: Int, H: Int, Hkv: Int, Skv: Int, D: Int, iters: Int,
                                S: Int = 1) raises:
    """Decode (S queries) through the split-KV kernels (the plan's split count: the tensor-core kernel where it
    runs, then the SIMT kernels) and the prefill path (decode off)."""
    var nq = B * H * S * D
    var nk = B * Hkv * Skv * D
    var qb = ctx.enqueue_create_buffer[dtype](nq)
    var kb = ctx.enqueue_create_buffer[dtype](nk)
    var vb = ctx.enqueue_create_buffer[dtype](nk)
    var ob = ctx.enqueue_create_buffer[dtype](nq)
    var lb = ctx.enqueue_create_buffer[DType.float32](B * H * S)
    fill_random(ctx, qb, nq, 7, -1.0, 1.0)
    fill_random(ctx, kb, nk, 8, -1.0, 1.0)
    fill_random(ctx, vb, nk, 9, -1.0, 1.0)
    var pb = device_params(ctx, Float32(0.0), Float32(1.0) / Float32(D).__pow__(Float32(0.5)), Float32(0.0))
    var lenb = _device_ints(ctx, List[Int32]())
    var plan = decode_plan(B, H, Hkv, S, Skv, D, size_of[dtype](), sm_count(ctx))
    var n_part = _decode_part[dtype](ctx, B, H, Hkv, S, Skv, D)
    var partb = workspace[DType.float32](ctx, n_part)
    var o = _mut(ob.unsafe_ptr())
    var l = _mut(lb.unsafe_ptr())
    var q = _mut(qb.unsafe_ptr())
    var k = _mut(kb.unsafe_ptr())
    var v = _mut(vb.unsafe_ptr())
    var kl = _mut(lenb.unsafe_ptr())
    var p = _mut(pb.unsafe_ptr())
    var pp = _mut(partb.unsafe_ptr())
    var bytes = Float64(2 * nk * size_of[dtype]())
    var n_it = iters * 4  # short calls: enough of them to time
    for dec in range(3):  # prefill kernels, split-KV SIMT, split-KV tensor cores
        attention_gpu_ws[dtype](o, l, pp, n_part, q, k, v, kl, p, B, H, Hkv, S, Skv, D, ctx, decode=dec > 0,
                                decode_mma=dec == 2)
        ctx.synchronize()
        var t0 = now_ns()
        for _ in range(n_it):
            attention_gpu_ws[dtype](o, l, pp, n_part, q, k, v, kl, p, B, H, Hkv, S, Skv, D, ctx, decode=dec > 0,
                                    decode_mma=dec == 2)
        ctx.synchronize()
        var ns = Float64(now_ns() - t0) / Float64(n_it)
        var what = "prefill " if dec == 0 else ("split-kv simt" if dec == 1 else "split-kv mma")
        print("PERF attention_decode", what, dtype, "B", B, "H", H, "Hkv", Hkv, "S", S,
              "Skv", Skv, "D", D, "splits", plan[2], "us=", ns / 1000.0, "GB/s=", bytes / ns,
              "(wall per call, L2 warm)")


def run_decode(bench: Bool = True) raises:
    """The split-KV decode path: S 1/4/16, GQA 1/4/8, D 64/128/256, kv_len ragged (incl. 0, untrusted),
    causal, every dtype; against float64 on the host, the row-wise fp32 GPU kernel, and itself (splits)."""
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name(), "SMs:", sm_count(ctx))
        comptime for di in range(3):
            comptime D = 64 * (1 << di)
            for c in range(2):
                var causal = c == 1
                for kvk in range(3):
                    # through execute (the plan's split count) against float64 on the host
                    _case[DType.bfloat16](ctx, 5, 4, 4, 1, 300, D, causal, True, failures, 200 + kvk, 0, False, kvk)
                    _case[DType.float16](ctx, 5, 8, 2, 4, 300, D, causal, True, failures, 210 + kvk, 0, False, kvk)
                    _case[DType.bfloat16](ctx, 4, 8, 1, 16, 200, D, causal, True, failures, 220 + kvk, 0, False, kvk)
                    _case[DType.float32](ctx, 5, 8, 1, 4, 129, D, causal, True, failures, 230 + kvk, 0, False, kvk)
                    # forced split counts against the row-wise kernel, and determinism
                    _decode_splits_case[DType.bfloat16](ctx, 5, 32, 8, 1, 2100, D, causal, kvk, failures, 240 + kvk)
                    _decode_splits_case[DType.float16](ctx, 4, 16, 2, 16, 777, D, causal, kvk, failures, 250 + kvk)
                    _decode_splits_case[DType.float32](ctx, 4, 8, 8, 3, 500, D, causal, kvk, failures, 260 + kvk)
                    # the register kernel at 1 / 4 / 8 rows (R 1 / 4 / 8): MHA, S 4 without GQA, GQA 8
                    _case[DType.bfloat16](ctx, 5, 8, 8, 1, 300, D, causal, True, failures, 300 + kvk, 0, False, kvk)
                    _case[DType.float32](ctx, 3, 4, 4, 4, 333, D, causal, True, failures, 310 + kvk, 0, False, kvk)
                    _case[DType.float16](ctx, 3, 16, 2, 1, 300, D, causal, True, failures, 320 + kvk, 0, False, kvk)
                    _decode_splits_case[DType.float16](ctx, 3, 64, 8, 1, 1000, D, causal, kvk, failures, 330 + kvk)
                    _decode_splits_case[DType.float32](ctx, 3, 4, 4, 1, 333, D, causal, kvk, failures, 340 + kvk)
                    _decode_splits_case[DType.bfloat16](ctx, 2, 8, 2, 2, 4100, D, causal, kvk, failures, 350 + kvk)
            # non-finite inputs (q NaN, k NaN, v NaN/inf/-inf, tail NaN/inf, k +inf) through the decode path
            for bad in range(1, 6):
                _case[DType.bfloat16](ctx, 1, 8, 2, 4, 70, D, True, True, failures, 270 + bad, bad)
                _case[DType.float32](ctx, 1, 8, 2, 4, 70, D, False, True, failures, 280 + bad, bad)
                # the same through the register kernel (4 rows of 4 queries, causal; 8 rows of GQA 8)
                _case[DType.bfloat16](ctx, 1, 4, 4, 4, 70, D, True, True, failures, 360 + bad, bad)
                _case[DType.float16](ctx, 1, 16, 2, 1, 70, D, False, True, failures, 370 + bad, bad)
            # realistic decode shapes against the row-wise kernel (through execute)
            _case[DType.bfloat16](ctx, 4, 32, 8, 1, 8192, D, False, False, failures, 290)
            _case[DType.bfloat16](ctx, 4, 32, 8, 4, 4099, D, True, False, failures, 291, 0, False, 1)
        if bench:
            for skv in range(3):
                var n = 2048 << (2 * skv)  # 2048, 8192, 32768
                _bench_decode[DType.bfloat16](ctx, 1, 32, 8, n, 128, 20)
                _bench_decode[DType.bfloat16](ctx, 32, 32, 8, n, 128, 10)
            # the register kernel's other row counts (8: GQA 8, 1: MHA), head dims and fp32
            _bench_decode[DType.bfloat16](ctx, 32, 64, 8, 8192, 128, 10)
            _bench_decode[DType.bfloat16](ctx, 8, 32, 32, 8192, 128, 10)
            _bench_decode[DType.bfloat16](ctx, 32, 32, 8, 8192, 64, 10)
            _bench_decode[DType.bfloat16](ctx, 32, 32, 8, 8192, 256, 10)
            _bench_decode[DType.float32](ctx, 32, 32, 8, 8192, 128, 10)
            # the committed attention.decode suite's other shapes: B1 128K, GQA 8 (H32 / 4), D64, D256, S 16
            _bench_decode[DType.bfloat16](ctx, 1, 32, 8, 131072, 128, 10)
            _bench_decode[DType.bfloat16](ctx, 1, 32, 4, 32768, 128, 10)
            _bench_decode[DType.bfloat16](ctx, 1, 32, 8, 32768, 64, 10)
            _bench_decode[DType.bfloat16](ctx, 1, 32, 8, 32768, 256, 10)
            _bench_decode[DType.bfloat16](ctx, 1, 32, 8, 8192, 128, 10, 16)
    print("attn_decode failures:", failures)
    if failures > 0:
        raise Error("attention (decode): ", failures, " checks failed")


def run(bench_default: Bool = True) raises:
    var bench = bench_default and getenv("FUSEKIT_HARNESS_BENCH") != "0"  # "0": checks only (sanitizers)
    if getenv("FUSEKIT_HARNESS_ONLY") == "attn_bwd_tc":
        run_bwd_tc(bench)
        return
    if getenv("FUSEKIT_HARNESS_ONLY") == "attn_decode":
        run_decode(bench)
        return
    if getenv("FUSEKIT_HARNESS_ONLY") == "attn_perf":  # one bf16 D128 forward timing (for a profiler)
        with DeviceContext() as ctx:
            _bench[DType.bfloat16](ctx, 4, 32, 4096, 128, False, 2)
        return
    var failures = 0
    with DeviceContext() as ctx:
        print("device:", ctx.name())
        # small shapes against the host (GQA, S < Skv, S > Skv -> rows with no key write zeros / -inf)
        comptime for di in range(3):
            comptime D = 64 * (1 << di)  # 64, 128, 256
            _case[DType.bfloat16](ctx, 1, 4, 2, 37, 45, D, False, True, failures, 11)
            _case[DType.bfloat16](ctx, 1, 4, 2, 37, 45, D, True, True, failures, 12)
            _case[DType.float16](ctx, 1, 4, 2, 45, 37, D, True, True, failures, 13, 0, True)
            _case[DType.bfloat16](ctx, 2, 2, 1, 130, 70, D, True, True, failures, 14)
            # non-finite inputs reach exactly the rows that see them (tensor-core path on NVIDIA)
            for bad in range(1, 6):
                _case[DType.bfloat16](ctx, 1, 2, 1, 9, 13, D, True, True, failures, 30 + bad, bad)
                _case[DType.float16](ctx, 1, 2, 1, 70, 75, D, True, True, failures, 40 + bad, bad)
                _case[DType.bfloat16](ctx, 1, 2, 1, 9, 13, D, False, True, failures, 50 + bad, bad)
        _case[DType.float32](ctx, 1, 4, 2, 37, 45, 64, True, True, failures, 15, 0, True)
        _case[DType.float32](ctx, 1, 2, 2, 20, 20, 96, False, True, failures, 16, 0, True)
        _case[DType.float32](ctx, 2, 2, 1, 45, 37, 128, True, True, failures, 17, 0, True)
        for bad in range(1, 6):
            _case[DType.float32](ctx, 1, 2, 1, 9, 13, 64, True, True, failures, 60 + bad, bad)
        # per-sequence kv_len (a 0, a full one, odd ones; then untrusted values that must be clamped), keys
        # past each length NaN: tensor-core path (bf16/f16 on NVIDIA), row-wise (f32, forced), and grads
        comptime for di in range(3):
            comptime D = 64 * (1 << di)
            for kvk in range(1, 3):
                for c in range(2):
                    _case[DType.bfloat16](ctx, 5, 4, 2, 21, 45, D, c == 1, True, failures, 70 + kvk, 0, False, kvk)
                    _case[DType.float16](ctx, 4, 4, 1, 3, 37, D, c == 1, True, failures, 72 + kvk, 0, True, kvk)
                    _case[DType.bfloat16](ctx, 4, 2, 2, 70, 130, D, c == 1, True, failures, 74 + kvk, 0, False, kvk)
                    _case[DType.bfloat16](ctx, 4, 2, 1, 9, 45, D, c == 1, True, failures, 76 + kvk, 0, False, kvk, True)
        for c in range(2):
            _case[DType.float32](ctx, 5, 4, 2, 21, 45, 64, c == 1, True, failures, 80, 0, True, 1)
            _case[DType.float32](ctx, 4, 2, 2, 1, 53, 128, c == 1, True, failures, 81, 0, True, 2)
            # a masked tile's non-finite V under kv_len (bad=3/4), and a NaN q row
            for bad in range(1, 5):
                _case[DType.bfloat16](ctx, 4, 2, 1, 9, 13, 64, c == 1, True, failures, 82 + bad, bad, True, 1)
        # realistic shapes against the fp32 rowwise GPU kernel
        comptime for di in range(3):
            comptime D = 64 * (1 << di)
            _case[DType.bfloat16](ctx, 2, 8, 2, 1000, 1037, D, False, False, failures, 21)
            _case[DType.bfloat16](ctx, 2, 8, 2, 1000, 1037, D, True, False, failures, 22)
            _case[DType.float16](ctx, 1, 8, 8, 777, 777, D, True, False, failures, 23)
            _case[DType.bfloat16](ctx, 4, 8, 2, 300, 1037, D, True, False, failures, 24, 0, False, 1)
            _case[DType.bfloat16](ctx, 4, 8, 2, 5, 1037, D, False, False, failures, 25, 0, False, 2)
            # more blocks than SMs at once (the sm_90 kernel's mbarrier rings start fresh in each block)
            _case[DType.bfloat16](ctx, 4, 16, 4, 1000, 1037, D, False, False, failures, 26)
            _case[DType.float16](ctx, 4, 16, 4, 1000, 1037, D, True, False, failures, 27)
            _case[DType.bfloat16](ctx, 16, 8, 2, 200, 300, D, True, False, failures, 28, 0, False, 1)
            _case[DType.bfloat16](ctx, 16, 8, 2, 200, 300, D, False, False, failures, 29, 0, False, 2)
        if bench:
            # bf16 on sm_90: the wgmma kernel (hopper) and _fa2_kernel in the same run
            for causal in range(2):
                for hop in range(2):
                    _bench[DType.bfloat16](ctx, 4, 32, 4096, 128, causal == 1, 10, hop == 1)
                    _bench[DType.bfloat16](ctx, 4, 32, 4096, 64, causal == 1, 10, hop == 1)
                    _bench[DType.bfloat16](ctx, 4, 32, 4096, 256, causal == 1, 5, hop == 1)
            comptime if DeviceContext.default_device_info.compute == 9.0:
                for causal in range(2):
                    _bench[DType.float16](ctx, 4, 32, 4096, 128, causal == 1, 10)
                    _bench[DType.float16](ctx, 4, 32, 4096, 64, causal == 1, 10)
                    _bench[DType.float16](ctx, 4, 32, 4096, 256, causal == 1, 5)
                if getenv("FUSEKIT_HARNESS_SWEEP") == "1":  # the wgmma kernels' (warpgroups, key tile) options
                    for causal in range(2):
                        _bench[DType.bfloat16, 128, 2, 128](ctx, 4, 32, 4096, 128, causal == 1, 10)
                        _bench[DType.bfloat16, 128, 2, 128, False](ctx, 4, 32, 4096, 128, causal == 1, 10)
                        _bench[DType.bfloat16, 128, 2, 128](ctx, 32, 32, 512, 128, causal == 1, 10)
                        _bench[DType.bfloat16, 128, 2, 128, False](ctx, 32, 32, 512, 128, causal == 1, 10)
                        _bench[DType.bfloat16, 128, 2, 128](ctx, 8, 32, 2048, 128, causal == 1, 10)
                        _bench[DType.bfloat16, 128, 2, 128, False](ctx, 8, 32, 2048, 128, causal == 1, 10)
                        _bench[DType.bfloat16, 64, 3, 128](ctx, 4, 32, 4096, 64, causal == 1, 10)
                        _bench[DType.bfloat16, 64, 3, 128, False](ctx, 4, 32, 4096, 64, causal == 1, 10)
                        _bench[DType.bfloat16, 256, 2, 64](ctx, 4, 32, 4096, 256, causal == 1, 5)
                        _bench[DType.bfloat16, 256, 2, 64, False](ctx, 4, 32, 4096, 256, causal == 1, 5)
            if getenv("FUSEKIT_HARNESS_ONLY") != "attn_fwd":
                _bench_bwd[DType.bfloat16](ctx, 1, 8, 2048, 128, True, 3)
    print("attention failures:", failures)
    if failures > 0:
        raise Error("attention: ", failures, " checks failed")
    if getenv("FUSEKIT_HARNESS_ONLY") == "attn_fwd":  # the forward checks and timings only
        return
    run_decode(bench)
    run_bwd_tc(bench)
