"""Row-normalization forward kernels shared by fusekit.rms_norm and fusekit.layer_norm (LN = layer_norm).

Semantics (CONTRACT.md): xin = round_x(x + residual) when the residual flag is set (h = xin is then
written once), else xin = x; statistics in fp32 from xin as stored; rstd = 1/sqrt(var + eps).
- layer_norm: y = round_x(((xin - mean) * rstd) * w [+ b])
- rms_norm casting 0 ("fp32"):  y = round_x((xin * rstd) * w)
           casting 1 ("llama"): y = round_x(round_x(xin * rstd) * w)
           casting 2 ("gemma"): y = round_x((xin * rstd) * (1 + w))
w and b are in `wdtype` (x's dtype or float32), always read into fp32.
The flags (casting, has_residual, has_bias) are read on the device from `params` (the host never
sees them without a sync), so every kernel holds all variants behind uniform branches; the plain path
pays two well-predicted branches per vector, nothing else.

Byte floor per call: read x (M*N*s) [+ residual M*N*s] + write y (M*N*s) [+ h M*N*s] + weight/bias
(N*s_w, L2-resident) + stats (4-8 B/row). 32768x8192 bf16 plain: 1.07 GB -> 0.25 ms at the 4283 GB/s
copy ceiling of the H200.

GPU plan: one block per row (grid-stride over rows), 16-byte vector loads/stores, fp32 math.
- "register" kernels (row fits in BLK*NV vectors of 16 B, <= 64 KB): each thread keeps its NV vectors
  in registers, so x is read from HBM exactly once; (BLK, NV) comes from a small table by row length so
  threads hold 2-4 vectors and small rows do not get 1024-thread blocks. With a residual, the residual
  vectors are loaded alongside x and h = round_x(x + r) replaces them in the registers.
- "loop" kernel (rows > 64 KB, or N / pointers not 16-byte aligned -> W = 1): a statistics pass and an
  output pass that re-reads the row from L2 (2 resident rows of 1024 threads per SM). Measured on the
  H200 at 16384x65536 bf16: register kernel with (1024 threads, 8 vectors) 2404 GB/s (one block per
  SM: no overlap of one row's reduction with the next row's loads), this reload kernel 2923 GB/s.
  With a residual, a first pass writes h and the later passes read h back: every pass gives element
  vector j to thread j % BLK, so each thread re-reads only what it wrote itself (program order, no
  barrier or fence needed).
  (Hopper clusters splitting a row over 2-4 CTAs with DSMEM reductions would lift this: not done.)
- rms_norm's block reduction costs one barrier: warp butterflies, per-warp partials in shared memory,
  then every thread adds the partials in the same order (no broadcast round).
layer_norm: exact two-pass statistics (mean, then sum((x - mean)^2)) with block.sum, from registers in
the register kernels. Measured (H200, GB/s over the byte floor, copy 4283; harness/_normh.mojo), plain
path: 32768x8192 bf16 rms 4111 / ln 3660, fp32 rms 4206 / ln 4148; 16384x65536 bf16 rms 2868 / ln
2770 -- the same as the kernels before the residual / casting / wdtype additions in the same run (ln
3621, 4145, 2742; earlier runs: rms 4093, 4202, 2941); with the residual (x, residual read, y, h
written) 32768x8192 bf16 rms 4090 / ln 4091.
Row offsets are Int (64-bit): M*N > 2^31 is fine.
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, WARP_SIZE, thread_idx, block_idx, grid_dim, barrier
from max.gpu.primitives import warp, block
from std.memory import unsafe_stack_allocation
from max.gpu.host import DeviceContext
from std.utils import StaticTuple
from std.sys import align_of

from ._util import vec_width, is_aligned16, rsqrt_full_range

comptime F32 = DType.float32
comptime FPtr = Pointer[Float32, MutAnyOrigin]


comptime MAX_WARPS = 32  # 1024 threads / 32 lanes (AMD: 16 wavefronts of 64)


@always_inline
def _block_allsum[
    BLK: Int, K: Int
](v: SIMD[F32, K], red: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]) -> SIMD[F32, K]:
    """The K sums of v over the block, in every thread, one barrier (the caller's loop-end barrier protects
    `red`, K * MAX_WARPS floats, before its next use); every thread adds the per-warp partials in the same
    order. The forward reduces K = 1 sum, the backward 1 or 2 per row (_norm_backward)."""
    comptime NW = BLK // WARP_SIZE
    var lane = thread_idx.x % WARP_SIZE
    var wv = SIMD[F32, K](0)
    comptime for i in range(K):
        wv[i] = warp.sum(v[i])
    if lane == 0:
        comptime for i in range(K):
            red[unsafe_offset=i * MAX_WARPS + thread_idx.x // WARP_SIZE] = wv[i]
    barrier()
    # every warp reduces the NW partials with the same butterfly: K shared loads + K warp.sums per thread
    # instead of K * NW loads (64 at 1024 threads and K = 2: half of the backward kernel's instructions)
    var t = SIMD[F32, K](0)
    if lane < NW:
        comptime for i in range(K):
            t[i] = red[unsafe_offset=i * MAX_WARPS + lane]
    comptime for i in range(K):
        t[i] = warp.sum(t[i])
    return t


struct NormFlags(Copyable, Movable):
    """The forward op's runtime flags, read from `params` (rms_norm: [eps, casting, has_residual];
    layer_norm: [eps, has_residual, has_bias])."""

    var eps: Float32
    var llama: Bool
    var gemma: Bool
    var has_res: Bool
    var has_bias: Bool

    @always_inline
    def __init__(out self, eps: Float32, llama: Bool, gemma: Bool, has_res: Bool, has_bias: Bool):
        self.eps = eps
        self.llama = llama
        self.gemma = gemma
        self.has_res = has_res
        self.has_bias = has_bias


@always_inline
def norm_flags[LN: Bool](params: FPtr) -> NormFlags:
    comptime if LN:
        return NormFlags(params[unsafe_offset=0], False, False, params[unsafe_offset=1] != 0, params[unsafe_offset=2] != 0)
    else:
        var c = params[unsafe_offset=1]
        return NormFlags(params[unsafe_offset=0], c == 1, c == 2, params[unsafe_offset=2] != 0, False)


@always_inline
def _out_vec[
    dtype: DType, wdtype: DType, LN: Bool, W: Int, AW: Int, EARLY: Bool
](
    v: SIMD[F32, W],
    mean: Float32,
    r: Float32,
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    b: Pointer[Scalar[wdtype], MutAnyOrigin],
    off: Int,
    f: NormFlags,
) -> SIMD[dtype, W]:
    """y for W elements of xin (already fp32) at column `off` (AW: alignment of w/b accesses).

    EARLY: issue the bias load together with the weight load, before any math. Measured on the H200
    (layer_norm bf16): the loop kernel needs it (16384x65536: 2748 GB/s early vs 2313 late), the
    register kernel runs better without it (32768x8192: 3665 late vs 3522 early)."""
    var wv = w.unsafe_load[width=W, alignment=AW](off).cast[F32]()
    var bv = SIMD[F32, W](0)
    comptime if LN and EARLY:
        if f.has_bias:
            bv = b.unsafe_load[width=W, alignment=AW](off).cast[F32]()
    var t = (v - mean) * r
    comptime if not LN:
        if f.llama:  # HF Llama: normalize, cast to x's dtype, then scale in fp32
            t = t.cast[dtype]().cast[F32]()
        if f.gemma:  # HF Gemma: scale by (1 + w)
            wv = wv + 1.0
    var o = t * wv
    comptime if LN:
        if f.has_bias:
            comptime if EARLY:
                o += bv
            else:
                o += b.unsafe_load[width=W, alignment=AW](off).cast[F32]()
    return o.cast[dtype]()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _norm_reg_kernel[
    dtype: DType, wdtype: DType, LN: Bool, BLK: Int, NV: Int
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    h: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    b: Pointer[Scalar[wdtype], MutAnyOrigin],
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    comptime VW = vec_width[dtype]()
    var red = unsafe_stack_allocation[3 * MAX_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var n = Int(n_cols)
    var nv = n // VW
    var f = norm_flags[LN](params)
    var tid = thread_idx.x
    var row = block_idx.x
    while row < Int(n_rows):
        var off = row * n
        var xr = x.unsafe_offset(off)
        var cache = SIMD[dtype, NV * VW](0)
        comptime for k in range(NV):  # issue all NV loads before any use: NV x 16 B in flight
            var j = tid + k * BLK
            if j < nv:
                cache = cache.insert[offset = k * VW](xr.unsafe_load[width=VW, alignment=16](j * VW))
        if f.has_res:  # h = round_x(x + residual), written once, normalized from registers
            var rr = res.unsafe_offset(off)
            var hr = h.unsafe_offset(off)
            var rc = SIMD[dtype, NV * VW](0)
            comptime for k in range(NV):
                var j = tid + k * BLK
                if j < nv:
                    rc = rc.insert[offset = k * VW](rr.unsafe_load[width=VW, alignment=16](j * VW))
            comptime for k in range(NV):
                var j = tid + k * BLK
                if j < nv:
                    var hv = (
                        cache.slice[VW, offset = k * VW]().cast[F32]() + rc.slice[VW, offset = k * VW]().cast[F32]()
                    ).cast[dtype]()
                    cache = cache.insert[offset = k * VW](hv)
                    hr.unsafe_store[alignment=16](j * VW, hv)
        var mean = Float32(0)
        var r: Float32
        comptime if LN:
            # exact two-pass from registers: mean, then sum((x - mean)^2) (block.sum: 2 barriers each;
            # a one-barrier Chan (count, mean, M2) merge measured slower: 3577 vs 3638 GB/s bf16, 3478 vs
            # 4153 fp32 at 32768x8192, its serial merge chain of divisions costs more than the barriers)
            var s = SIMD[F32, VW](0)
            comptime for k in range(NV):
                s += cache.slice[VW, offset = k * VW]().cast[F32]()  # padding lanes are 0
            mean = block.sum[block_size=BLK, broadcast=True](s.reduce_add()) / Float32(n)
            barrier()  # block.sum's shared scratch is reused below
            var q = SIMD[F32, VW](0)
            var e = SIMD[F32, VW](0)  # sum of (x - mean): the fp32 mean's own rounding
            comptime for k in range(NV):
                if tid + k * BLK < nv:
                    var dd = cache.slice[VW, offset = k * VW]().cast[F32]() - mean
                    q += dd * dd
                    e += dd
            # corrected two-pass: mean += sum(d) / n, sum((x - mean)^2) = sum(d^2) - sum(d)^2 / n (a constant
            # row whose fp32 mean is an ulp off normalizes to exactly 0); both sums in one reduction
            var sums = _block_allsum[BLK, 2](SIMD[F32, 2](e.reduce_add(), q.reduce_add()), red)
            var c = sums[0] / Float32(n)
            mean += c
            r = rsqrt_full_range(max(sums[1] / Float32(n) - c * c, 0) + f.eps)
        else:
            var ss = SIMD[F32, VW](0)
            comptime for k in range(NV):  # padding lanes are 0
                var v = cache.slice[VW, offset = k * VW]().cast[F32]()
                ss += v * v
            r = rsqrt_full_range(_block_allsum[BLK, 1](ss.reduce_add(), red)[0] / Float32(n) + f.eps)
        if tid == 0:
            rstd_out[unsafe_offset=row] = r
            comptime if LN:
                mean_out[unsafe_offset=row] = mean
        var yr = y.unsafe_offset(off)
        comptime for k in range(NV):
            var j = tid + k * BLK
            if j < nv:
                var o = _out_vec[dtype, wdtype, LN, VW, 16, False](
                    cache.slice[VW, offset = k * VW]().cast[F32](), mean, r, w, b, j * VW, f
                )
                yr.unsafe_store[alignment=16](j * VW, o)
        row += grid_dim.x
        barrier()  # `red` is rewritten for the next row


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _norm_loop_kernel[
    dtype: DType, wdtype: DType, LN: Bool, BLK: Int, W: Int
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    h: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    b: Pointer[Scalar[wdtype], MutAnyOrigin],
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    """Any N / alignment (W = 1) or long rows (W = VW): [h pass,] statistics pass(es) (rms_norm 1,
    layer_norm 2: mean then variance; a one-pass per-vector Chan merge measured slower, 2620 vs 2743
    GB/s) and an output pass, each re-reading the row from L2 for rows up to a few MB (2 rows of 1024
    threads/SM)."""
    comptime AL = 16 if W > 1 else align_of[dtype]()
    comptime AW = 16 if W > 1 else align_of[wdtype]()
    comptime U = 4  # vectors in flight per thread in the statistics pass
    var red = unsafe_stack_allocation[3 * MAX_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var n = Int(n_cols)
    var nw = n // W
    var f = norm_flags[LN](params)
    var tid = thread_idx.x
    var row = block_idx.x
    while row < Int(n_rows):
        var off = row * n
        var xr = x.unsafe_offset(off)
        if f.has_res:
            # h pass: the same element -> thread mapping (j = tid + i * BLK) as every later pass, so each
            # thread reads back only its own stores
            var rr = res.unsafe_offset(off)
            var hr = h.unsafe_offset(off)
            var j = tid
            while j < nw:
                var hv = (
                    xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
                    + rr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
                ).cast[dtype]()
                hr.unsafe_store[alignment=AL](j * W, hv)
                j += BLK
            xr = hr
        var mean = Float32(0)
        var r: Float32
        comptime if LN:
            # mean pass, then variance pass (row re-read from L2): exact two-pass statistics
            var s0 = SIMD[F32, W](0)
            var s1 = SIMD[F32, W](0)
            var j = tid
            while j + BLK < nw:  # two independent loads in flight per thread
                s0 += xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
                s1 += xr.unsafe_load[width=W, alignment=AL]((j + BLK) * W).cast[F32]()
                j += 2 * BLK
            if j < nw:
                s0 += xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
            mean = block.sum[block_size=BLK, broadcast=True]((s0 + s1).reduce_add()) / Float32(n)
            barrier()
            var q0 = SIMD[F32, W](0)
            var q1 = SIMD[F32, W](0)
            var e = SIMD[F32, W](0)  # sum of (x - mean): the fp32 mean's own rounding
            j = tid
            while j + BLK < nw:
                var d0 = xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() - mean
                var d1 = xr.unsafe_load[width=W, alignment=AL]((j + BLK) * W).cast[F32]() - mean
                q0 += d0 * d0
                q1 += d1 * d1
                e += d0 + d1
                j += 2 * BLK
            if j < nw:
                var dd = xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() - mean
                q0 += dd * dd
                e += dd
            # corrected two-pass (the register kernel's): both sums in one reduction
            var sums = _block_allsum[BLK, 2](SIMD[F32, 2](e.reduce_add(), (q0 + q1).reduce_add()), red)
            var c = sums[0] / Float32(n)
            mean += c
            r = rsqrt_full_range(max(sums[1] / Float32(n) - c * c, 0) + f.eps)
        else:
            var q = SIMD[F32, W](0)
            var j = tid
            while j < nw:
                var vs = SIMD[dtype, U * W](0)
                comptime for u in range(U):
                    if j + u * BLK < nw:
                        vs = vs.insert[offset = u * W](xr.unsafe_load[width=W, alignment=AL]((j + u * BLK) * W))
                comptime for u in range(U):
                    var v = vs.slice[W, offset = u * W]().cast[F32]()
                    q += v * v
                j += U * BLK
            r = rsqrt_full_range(_block_allsum[BLK, 1](q.reduce_add(), red)[0] / Float32(n) + f.eps)
        if tid == 0:
            rstd_out[unsafe_offset=row] = r
            comptime if LN:
                mean_out[unsafe_offset=row] = mean
        var yr = y.unsafe_offset(off)
        var j = tid
        while j < nw:
            var o = _out_vec[dtype, wdtype, LN, W, AW, True](
                xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32](), mean, r, w, b, j * W, f
            )
            yr.unsafe_store[alignment=AL](j * W, o)
            j += BLK
        row += grid_dim.x
        barrier()


def norm_gpu[
    dtype: DType, wdtype: DType, LN: Bool, FORCE_LOOP: Bool = False
](
    ctx: DeviceContext,
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    h: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    b: Pointer[Scalar[wdtype], MutAnyOrigin],
    params: FPtr,
    m: Int,
    n: Int,
) raises:
    """Pick the kernel variant by row length (in 16-byte vectors) and alignment, then launch.

    h / res (and b for rms_norm) may be [1, 1] dummies: only their addresses are looked at here (a
    misaligned dummy just costs the W = 1 loop kernel), the kernels touch them only when flagged."""
    comptime VW = vec_width[dtype]()
    var grid = min(m, 1 << 30)
    var M = Int64(m)
    var N = Int64(n)
    var vec_ok = n % VW == 0 and is_aligned16(x) and is_aligned16(y) and is_aligned16(w)
    vec_ok = vec_ok and is_aligned16(h) and is_aligned16(res)
    comptime if LN:
        vec_ok = vec_ok and is_aligned16(b)
    comptime if FORCE_LOOP:  # benchmarking the reload kernel against the register one
        if vec_ok:
            ctx.enqueue_function[_norm_loop_kernel[dtype, wdtype, LN, 1024, VW]](
                y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=1024
            )
            return
    if not vec_ok:
        if n <= 4096:
            ctx.enqueue_function[_norm_loop_kernel[dtype, wdtype, LN, 128, 1]](
                y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=128
            )
        else:
            ctx.enqueue_function[_norm_loop_kernel[dtype, wdtype, LN, 512, 1]](
                y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=512
            )
        return
    var nv = n // VW
    # (threads, vectors per thread): smallest block whose registers hold the row, 1-8 vectors/thread
    if nv <= 64 * 2:
        ctx.enqueue_function[_norm_reg_kernel[dtype, wdtype, LN, 64, 2]](
            y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=64
        )
    elif nv <= 128 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, wdtype, LN, 128, 4]](
            y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=128
        )
    elif nv <= 256 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, wdtype, LN, 256, 4]](
            y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=256
        )
    elif nv <= 512 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, wdtype, LN, 512, 4]](
            y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=512
        )
    elif nv <= 1024 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, wdtype, LN, 1024, 4]](
            y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=1024
        )
    else:
        ctx.enqueue_function[_norm_loop_kernel[dtype, wdtype, LN, 1024, VW]](
            y, h, mean_out, rstd_out, x, res, w, b, params, M, N, grid_dim=grid, block_dim=1024
        )


def norm_cpu[
    dtype: DType, wdtype: DType, LN: Bool
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    h: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    b: Pointer[Scalar[wdtype], MutAnyOrigin],
    params: FPtr,
    m: Int,
    n: Int,
):
    """Reference-order fp32 math with 8-lane SIMD; one row at a time (h written first, then read)."""
    comptime W = 8
    var f = norm_flags[LN](params)
    var nb = (n // W) * W
    for row in range(m):
        var off = row * n
        var xr = x.unsafe_offset(off)
        var yr = y.unsafe_offset(off)
        if f.has_res:
            var rr = res.unsafe_offset(off)
            var hr = h.unsafe_offset(off)
            for j in range(0, nb, W):
                var s = xr.unsafe_load[width=W](j).cast[F32]() + rr.unsafe_load[width=W](j).cast[F32]()
                hr.unsafe_store(j, s.cast[dtype]())
            for j in range(nb, n):
                hr[unsafe_offset=j] = (xr[unsafe_offset=j].cast[F32]() + rr[unsafe_offset=j].cast[F32]()).cast[dtype]()
            xr = hr
        var mean = Float32(0)
        comptime if LN:
            var s = SIMD[F32, W](0)
            for j in range(0, nb, W):
                s += xr.unsafe_load[width=W](j).cast[F32]()
            var t = s.reduce_add()
            for j in range(nb, n):
                t += xr[unsafe_offset=j].cast[F32]()
            mean = t / Float32(n)
        var q = SIMD[F32, W](0)
        var e = SIMD[F32, W](0)  # layer_norm: sum of (x - mean), the fp32 mean's own rounding
        for j in range(0, nb, W):
            var d = xr.unsafe_load[width=W](j).cast[F32]() - mean
            q += d * d
            comptime if LN:
                e += d
        var qt = q.reduce_add()
        var et = e.reduce_add()
        for j in range(nb, n):
            var d = xr[unsafe_offset=j].cast[F32]() - mean
            qt += d * d
            comptime if LN:
                et += d
        comptime if LN:
            # Corrected two-pass: mean += sum(d) / n, sum((x - mean)^2) = sum(d^2) - sum(d)^2 / n. A constant
            # row whose fp32 mean is an ulp off then normalizes to exactly 0 (it gave +-1.57 at eps 1e-12).
            var c = et / Float32(n)
            mean += c
            qt = max(qt - et * c, 0)
        var r = rsqrt_full_range(qt / Float32(n) + f.eps)
        rstd_out[unsafe_offset=row] = r
        comptime if LN:
            mean_out[unsafe_offset=row] = mean
        for j in range(0, nb, W):
            var o = _out_vec[dtype, wdtype, LN, W, align_of[wdtype](), False](xr.unsafe_load[width=W](j).cast[F32](), mean, r, w, b, j, f)
            yr.unsafe_store(j, o)
        for j in range(nb, n):
            var o = _out_vec[dtype, wdtype, LN, 1, align_of[wdtype](), False](xr[unsafe_offset=j].cast[F32](), mean, r, w, b, j, f)
            yr[unsafe_offset=j] = o[0]
