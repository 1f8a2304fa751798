"""Row-normalization kernels shared by fusekit.rms_norm and fusekit.layer_norm (LN = layer_norm).

Byte floor per call: read x (M*N*s) + write y (M*N*s) + weight/bias (N*s, L2-resident) + stats
(4-8 B/row). 32768x8192 bf16: 1.07 GB -> 0.25 ms at the 4283 GB/s copy ceiling of the H200.

GPU plan: one block per row (grid-stride over rows), 16-byte vector loads/stores, fp32 math.
- "register" kernels (row fits in BLK*NV vectors of 16 B, <= 128 KB): each thread keeps its NV vectors
  in registers, so x is read from HBM exactly once; block.sum (warp shuffles + shared memory) gives the
  row statistics; the normalize pass reuses the registers. (BLK, NV) is picked from a small table by
  row length so that threads have 1-8 vectors each and small rows do not get 1024-thread blocks.
- "loop" kernel (rows > 128 KB, or N / pointers not 16-byte aligned -> W = 1): re-reads the row for each
  pass; one row (<= a few MB) per block stays in L2 between passes, so HBM still sees ~one read.
layer_norm: two-pass mean / biased variance (stable: sum((x - mean)^2) from registers, as torch).
Numerics as reference.py: rstd = 1/sqrt(mean + eps); y = (x * rstd) * w [+ b] in fp32, one cast.
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, thread_idx, block_idx, grid_dim, barrier
from max.gpu.primitives import block
from max.gpu.host import DeviceContext
from std.math import sqrt
from std.utils import StaticTuple
from std.sys import align_of

from ._util import vec_width, is_aligned16

comptime F32 = DType.float32
comptime FPtr = Pointer[Float32, MutAnyOrigin]


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _norm_reg_kernel[
    dtype: DType, LN: Bool, BLK: Int, NV: Int
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    comptime VW = vec_width[dtype]()
    var n = Int(n_cols)
    var nv = n // VW
    var eps = params[unsafe_offset=0]
    var has_bias = False
    comptime if LN:
        has_bias = params[unsafe_offset=1] != 0
    var tid = thread_idx.x
    var row = block_idx.x
    while row < Int(n_rows):
        var xr = x.unsafe_offset(row * n)
        var cache = SIMD[dtype, NV * VW](0)
        comptime for k in range(NV):  # issue all NV loads before any use: NV x 16 B in flight
            var j = tid + k * BLK
            if j < nv:
                cache = cache.insert[offset = k * VW](xr.unsafe_load[width=VW, alignment=16](j * VW))
        var mean = Float32(0)
        comptime if LN:
            var s = SIMD[F32, VW](0)
            comptime for k in range(NV):
                s += cache.slice[VW, offset = k * VW]().cast[F32]()  # padding lanes are 0
            mean = block.sum[block_size=BLK, broadcast=True](s.reduce_add()) / Float32(n)
            barrier()  # block.sum's shared scratch is reused below
        var ss = SIMD[F32, VW](0)
        comptime for k in range(NV):
            if tid + k * BLK < nv:
                var d = cache.slice[VW, offset = k * VW]().cast[F32]() - mean
                ss += d * d
        var r = 1.0 / sqrt(block.sum[block_size=BLK, broadcast=True](ss.reduce_add()) / Float32(n) + eps)
        if tid == 0:
            rstd_out[unsafe_offset=row] = r
            comptime if LN:
                mean_out[unsafe_offset=row] = mean
        var yr = y.unsafe_offset(row * n)
        comptime for k in range(NV):
            var j = tid + k * BLK
            if j < nv:
                var wv = w.unsafe_load[width=VW, alignment=16](j * VW).cast[F32]()
                var o = ((cache.slice[VW, offset = k * VW]().cast[F32]() - mean) * r) * wv
                comptime if LN:
                    if has_bias:
                        o += b.unsafe_load[width=VW, alignment=16](j * VW).cast[F32]()
                yr.unsafe_store[alignment=16](j * VW, o.cast[dtype]())
        row += grid_dim.x
        barrier()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _norm_loop_kernel[
    dtype: DType, LN: Bool, BLK: Int, W: Int
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    """Any N / alignment (W = 1) or very long rows (W = VW): one pass per statistic plus the output
    pass, each re-reading the row (from L2 for rows up to a few MB)."""
    comptime AL = 16 if W > 1 else align_of[dtype]()
    var n = Int(n_cols)
    var nw = n // W
    var eps = params[unsafe_offset=0]
    var has_bias = False
    comptime if LN:
        has_bias = params[unsafe_offset=1] != 0
    var tid = thread_idx.x
    var row = block_idx.x
    while row < Int(n_rows):
        var xr = x.unsafe_offset(row * n)
        var mean = Float32(0)
        comptime if LN:
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
        var j = tid
        while j + BLK < nw:
            var d0 = xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() - mean
            var d1 = xr.unsafe_load[width=W, alignment=AL]((j + BLK) * W).cast[F32]() - mean
            q0 += d0 * d0
            q1 += d1 * d1
            j += 2 * BLK
        if j < nw:
            var d = xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() - mean
            q0 += d * d
        var r = 1.0 / sqrt(block.sum[block_size=BLK, broadcast=True]((q0 + q1).reduce_add()) / Float32(n) + eps)
        if tid == 0:
            rstd_out[unsafe_offset=row] = r
            comptime if LN:
                mean_out[unsafe_offset=row] = mean
        var yr = y.unsafe_offset(row * n)
        j = tid
        while j < nw:
            var wv = w.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
            var o = ((xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() - mean) * r) * wv
            comptime if LN:
                if has_bias:
                    o += b.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
            yr.unsafe_store[alignment=AL](j * W, o.cast[dtype]())
            j += BLK
        row += grid_dim.x
        barrier()


def norm_gpu[
    dtype: DType, LN: Bool, FORCE_LOOP: Bool = False
](
    ctx: DeviceContext,
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    params: FPtr,
    m: Int,
    n: Int,
) raises:
    """Pick the kernel variant by row length (in 16-byte vectors) and alignment, then launch."""
    comptime VW = vec_width[dtype]()
    var grid = min(m, 1 << 30)
    var M = Int64(m)
    var N = Int64(n)
    var vec_ok = n % VW == 0 and is_aligned16(x) and is_aligned16(y) and is_aligned16(w)
    comptime if LN:
        vec_ok = vec_ok and is_aligned16(b)
    comptime if FORCE_LOOP:  # benchmarking the reload kernel against the register one
        if vec_ok:
            ctx.enqueue_function[_norm_loop_kernel[dtype, LN, 1024, VW]](
                y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=1024
            )
            return
    if not vec_ok:
        if n <= 4096:
            ctx.enqueue_function[_norm_loop_kernel[dtype, LN, 128, 1]](
                y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=128
            )
        else:
            ctx.enqueue_function[_norm_loop_kernel[dtype, LN, 512, 1]](
                y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=512
            )
        return
    var nv = n // VW
    # (threads, vectors per thread): smallest block whose registers hold the row, 1-8 vectors/thread
    if nv <= 64 * 2:
        ctx.enqueue_function[_norm_reg_kernel[dtype, LN, 64, 2]](
            y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=64
        )
    elif nv <= 128 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, LN, 128, 4]](
            y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=128
        )
    elif nv <= 256 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, LN, 256, 4]](
            y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=256
        )
    elif nv <= 512 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, LN, 512, 4]](
            y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=512
        )
    elif nv <= 1024 * 4:
        ctx.enqueue_function[_norm_reg_kernel[dtype, LN, 1024, 4]](
            y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=1024
        )
    elif nv <= 1024 * 8:
        ctx.enqueue_function[_norm_reg_kernel[dtype, LN, 1024, 8]](
            y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=1024
        )
    else:
        ctx.enqueue_function[_norm_loop_kernel[dtype, LN, 1024, VW]](
            y, mean_out, rstd_out, x, w, b, params, M, N, grid_dim=grid, block_dim=1024
        )


def norm_cpu[
    dtype: DType, LN: Bool
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    mean_out: FPtr,
    rstd_out: FPtr,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[dtype], MutAnyOrigin],
    b: Pointer[Scalar[dtype], MutAnyOrigin],
    params: FPtr,
    m: Int,
    n: Int,
):
    """Reference-order fp32 math with 8-lane SIMD; one row at a time."""
    comptime W = 8
    var eps = params[unsafe_offset=0]
    var has_bias = False
    comptime if LN:
        has_bias = params[unsafe_offset=1] != 0
    var nb = (n // W) * W
    for row in range(m):
        var xr = x.unsafe_offset(row * n)
        var yr = y.unsafe_offset(row * n)
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
        for j in range(0, nb, W):
            var d = xr.unsafe_load[width=W](j).cast[F32]() - mean
            q += d * d
        var qt = q.reduce_add()
        for j in range(nb, n):
            var d = xr[unsafe_offset=j].cast[F32]() - mean
            qt += d * d
        var r = 1.0 / sqrt(qt / Float32(n) + eps)
        rstd_out[unsafe_offset=row] = r
        comptime if LN:
            mean_out[unsafe_offset=row] = mean
        for j in range(0, nb, W):
            var o = ((xr.unsafe_load[width=W](j).cast[F32]() - mean) * r) * w.unsafe_load[width=W](j).cast[F32]()
            comptime if LN:
                if has_bias:
                    o += b.unsafe_load[width=W](j).cast[F32]()
            yr.unsafe_store(j, o.cast[dtype]())
        for j in range(nb, n):
            var o = ((xr[unsafe_offset=j].cast[F32]() - mean) * r) * w[unsafe_offset=j].cast[F32]()
            comptime if LN:
                if has_bias:
                    o += b[unsafe_offset=j].cast[F32]()
            yr[unsafe_offset=j] = o.cast[dtype]()
