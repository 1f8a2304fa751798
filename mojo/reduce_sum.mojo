"""Ops fusekit.reduce_sum: out[M] = sum(x[M, N], axis=1), fp32 (floats) / int64 (ints) accumulation,
and fusekit.reduce_sum_backward: dx[M, N] (x dtype) = dout[M] broadcast along N (float dtypes only).
Signatures: reduce_sum(out [M], part [P] (workspace, accumulator dtype), x [M, N]);
reduce_sum_backward(dx [M, N], dout [M]); no params.

Byte floor: the op reads M*N*sizeof(x) bytes once and writes M outputs, so it is bound by HBM read
bandwidth. H200: copy 4283 GB/s (read+write), CUB device-wide sum 4530 GB/s (read-only). Target
>= 0.95x CUB: 2^30 fp32 (4 GiB) in <= ~0.99 ms.

GPU design (one pass over x, deterministic, no atomics):
- rows with N <= WARP_ROW_MAX: one warp per row (a block would leave most threads idle);
- otherwise "work items" = (row, chunk): each row is split into `splits` contiguous chunks so that the
  grid fills the machine (~ SMs x 2048/BLOCK blocks, one wave) even for M == 1 and N = 2^30;
  splits == 1 for M >= one wave of blocks (one block per row, grid-stride over rows);
- each thread streams its chunk with 16-byte vector loads, UNROLL independent vector accumulators
  (UNROLL x 16 B in flight per thread = memory-level parallelism), Int indexing (64-bit);
- block reduction: warp shuffles + shared memory (`block.sum`, WARP_SIZE-agnostic: 32 NV / 64 AMD);
- splits > 1: partials [M, splits] in the accumulator dtype, then a second tiny launch (one block per
  row over `splits` partials) casts to the output dtype: same order every run, so bitwise reproducible.
  The partials live in the caller's `part` workspace (fp32 / int64 = the accumulator dtype), sized in
  python/fusekit/backends/mojo/specs.py: splits > 1 only while m < wave = sms * (2048 // BLOCK), and
  splits <= cdiv(wave, m) (the chunk rounding only lowers it), so m * splits <= wave + m - 1.

Backward byte floor: write M*N*sizeof(x) (+ read M*sizeof(out)), store-bound: 2^30 bf16 = 2.1 GB ->
~0.45 ms at ~4.8 TB/s. GPU: a grid-stride loop over 16-byte vectors of the flat dx; each vector finds
its row with an fp64 reciprocal estimate of idx / N plus one exact integer correction (no 64-bit
integer division per vector), splats dout[row] when the vector lies in one row, else fills it
element by element (rows shorter than a vector or a row boundary inside it); one 16-byte store.
An unaligned dx takes the same kernel with 1-element vectors.
"""

# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, thread_idx, block_idx, grid_dim, block_dim, global_idx
from max.gpu import WARP_SIZE, barrier
from max.gpu.primitives import warp, block
from max.gpu.host import DeviceContext, DeviceAttribute
from std.utils import StaticTuple
from std.sys import size_of

from ._util import vec_width, acc_dtype, cdiv, is_aligned16, check_workspace

comptime BLOCK = 256  # threads per block: 8 blocks/SM = 2048 threads on H100/H200
comptime UNROLL = 8  # independent 16-byte loads in flight per thread (H200: U=8 4390 GB/s, U=4 4286)
comptime WARP_ROW_MAX = 2048  # rows up to this length are summed by one warp
comptime ROWS_PER_BLOCK_HOST = BLOCK // 32  # host-side upper bound of warps/block (WARP_SIZE >= 32)


def _thread_sum[
    dtype: DType, acc: DType, NTH: Int, U: Int
](p: Pointer[Scalar[dtype], MutAnyOrigin], count: Int, tid: Int) -> Scalar[acc]:
    """This thread's share (of NTH threads) of sum(p[0:count]).

    Unaligned head (< VW elements) and tail (< VW) are scalar; the body uses 16-byte loads with
    U independent accumulators. NTH >= 16 >= VW so one scalar element per thread covers head/tail.
    """
    comptime VW = vec_width[dtype]()
    var head = min(((16 - Int(p) % 16) % 16) // size_of[dtype](), count)
    var total = Scalar[acc](0)
    if tid < head:
        total = p[unsafe_offset=tid].cast[acc]()
    var q = p.unsafe_offset(head)
    var nvec = (count - head) // VW
    var a = SIMD[acc, U * VW](0)  # U independent vector accumulators, kept in registers
    var i = tid
    while i + (U - 1) * NTH < nvec:
        comptime for u in range(U):
            var v = q.unsafe_load[width=VW, alignment=16]((i + u * NTH) * VW).cast[acc]()
            a = a.insert[offset = u * VW](a.slice[VW, offset = u * VW]() + v)
        i += U * NTH
    while i < nvec:
        var v = q.unsafe_load[width=VW, alignment=16](i * VW).cast[acc]()
        a = a.insert[offset=0](a.slice[VW, offset=0]() + v)
        i += NTH
    var t = head + nvec * VW + tid
    if t < count:
        total += p[unsafe_offset=t].cast[acc]()
    return total + a.reduce_add()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK)))
def _sum_blocks_kernel[
    in_dtype: DType, acc: DType, res_dtype: DType, U: Int
](
    res: Pointer[Scalar[res_dtype], MutAnyOrigin],
    x: Pointer[Scalar[in_dtype], MutAnyOrigin],
    n_rows: Int64,
    n_cols: Int64,
    splits: Int64,
    chunk: Int64,
):
    """One block per work item (row, chunk); res[row * splits + chunk] = chunk sum."""
    var n = Int(n_cols)
    var sp = Int(splits)
    var items = Int(n_rows) * sp
    var w = block_idx.x
    while w < items:
        var row = w // sp
        var lo = (w % sp) * Int(chunk)
        var hi = min(n, lo + Int(chunk))
        var s = Scalar[acc](0)
        if lo < hi:
            s = _thread_sum[in_dtype, acc, BLOCK, U](x.unsafe_offset(row * n + lo), hi - lo, thread_idx.x)
        var t = block.sum[block_size=BLOCK, broadcast=False](s)
        if thread_idx.x == 0:
            res[unsafe_offset=w] = t.cast[res_dtype]()
        w += grid_dim.x
        barrier()  # block.sum's shared scratch is reused by the next item


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK)))
def _sum_warps_kernel[
    in_dtype: DType, acc: DType, res_dtype: DType
](
    res: Pointer[Scalar[res_dtype], MutAnyOrigin],
    x: Pointer[Scalar[in_dtype], MutAnyOrigin],
    n_rows: Int64,
    n_cols: Int64,
):
    """One warp per row (short rows); rows are grid-strided over all warps of the grid."""
    comptime WPB = BLOCK // WARP_SIZE
    var n = Int(n_cols)
    var lane = thread_idx.x % WARP_SIZE
    var row = block_idx.x * WPB + thread_idx.x // WARP_SIZE
    while row < Int(n_rows):
        var s = _thread_sum[in_dtype, acc, WARP_SIZE, 2](x.unsafe_offset(row * n), n, lane)
        var t = warp.sum(s)
        if lane == 0:
            res[unsafe_offset=row] = t.cast[res_dtype]()
        row += grid_dim.x * WPB


def reduce_sum_gpu[
    in_dtype: DType, out_dtype: DType, U: Int = UNROLL
](
    ctx: DeviceContext,
    outp: Pointer[Scalar[out_dtype], MutAnyOrigin],
    part: Pointer[Scalar[acc_dtype[in_dtype]()], MutAnyOrigin],
    part_len: Int,
    xp: Pointer[Scalar[in_dtype], MutAnyOrigin],
    m: Int,
    n: Int,
) raises:
    """Enqueue the GPU reduction (see the module docstring for the plan); `part` is the caller's
    workspace of `part_len` elements for the split partials (m * splits <= wave + m - 1)."""
    comptime acc = acc_dtype[in_dtype]()
    comptime VW = vec_width[in_dtype]()
    var sms = ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
    if n <= WARP_ROW_MAX:
        var grid = min(cdiv(m, ROWS_PER_BLOCK_HOST), sms * 64)
        ctx.enqueue_function[_sum_warps_kernel[in_dtype, acc, out_dtype]](
            outp, xp, Int64(m), Int64(n), grid_dim=grid, block_dim=BLOCK
        )
        return
    var wave = sms * (2048 // BLOCK)  # blocks resident at once: one full wave
    var splits = 1
    if m < wave:
        # each chunk keeps >= 2 full unrolled iterations per thread
        splits = max(1, min(cdiv(wave, m), n // (BLOCK * VW * U * 2)))
    if splits == 1:
        ctx.enqueue_function[_sum_blocks_kernel[in_dtype, acc, out_dtype, U]](
            outp, xp, Int64(m), Int64(n), Int64(1), Int64(n), grid_dim=min(m, 1 << 30), block_dim=BLOCK
        )
        return
    var chunk = cdiv(cdiv(n, splits), VW) * VW  # multiple of VW: chunks stay 16-byte aligned
    splits = cdiv(n, chunk)
    check_workspace("fusekit.reduce_sum", "part", part_len, m * splits)
    ctx.enqueue_function[_sum_blocks_kernel[in_dtype, acc, acc, U]](
        part, xp, Int64(m), Int64(n), Int64(splits), Int64(chunk), grid_dim=min(m * splits, 1 << 30), block_dim=BLOCK
    )
    ctx.enqueue_function[_sum_blocks_kernel[acc, acc, out_dtype, 2]](
        outp, part, Int64(m), Int64(splits), Int64(1), Int64(splits), grid_dim=min(m, 1 << 30), block_dim=BLOCK
    )


def reduce_sum_cpu[
    in_dtype: DType, out_dtype: DType
](outp: Pointer[Scalar[out_dtype], MutAnyOrigin], xp: Pointer[Scalar[in_dtype], MutAnyOrigin], m: Int, n: Int):
    """Row sums in 8 SIMD lanes of fp64 for floats (fp32 lanes, each summing 512 elements one after another,
    gave 1.5e-6 relative error at 2^20, 7x torch's cascade sum): a float row sum is fp64-accurate until its
    final rounding to fp32 (then out_dtype, as torch rounds its fp32 sum); integers are exact in int64."""
    comptime acc = acc_dtype[in_dtype]()
    comptime lane = acc if acc.is_integral() else DType.float64
    comptime W = 8
    for row in range(m):
        var p = xp.unsafe_offset(row * n)
        var a = SIMD[lane, W](0)
        var j = 0
        while j + W <= n:
            a += p.unsafe_load[width=W](j).cast[lane]()
            j += W
        var total = a.reduce_add()
        while j < n:
            total += p[unsafe_offset=j].cast[lane]()
            j += 1
        outp[unsafe_offset=row] = total.cast[acc]().cast[out_dtype]()


@register("fusekit.reduce_sum")
struct ReduceSum:
    @staticmethod
    def execute[
        in_dtype: DType, out_dtype: DType, acc: DType, //, target: StaticString
    ](
        res: MutableInputTensor[dtype=out_dtype, rank=1, ...],
        part: MutableInputTensor[dtype=acc, rank=1, ...],
        x: InputTensor[dtype=in_dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        # its own dtype parameter: MAX cannot match a graph dtype against acc_dtype[in_dtype]() itself
        comptime assert acc == acc_dtype[in_dtype](), "fusekit.reduce_sum: part must have x's accumulator dtype"
        var m = x.dim_size(0)
        var n = x.dim_size(1)
        comptime if target == "gpu":
            var pp = rebind[Pointer[Scalar[acc_dtype[in_dtype]()], MutAnyOrigin]](part.unsafe_ptr())
            reduce_sum_gpu[in_dtype, out_dtype](ctx, res.unsafe_ptr(), pp, part.dim_size(0), x.unsafe_ptr(), m, n)
        else:  # no partials on the CPU: `part` is a 1-element dummy, never read
            reduce_sum_cpu[in_dtype, out_dtype](res.unsafe_ptr(), x.unsafe_ptr(), m, n)


# ---- backward: dx[M, N] = dout[M] broadcast -------------------------------------------------------


@always_inline
def _row_of(idx: Int, n: Int, inv_n: Float64) -> Int:
    """idx // n without a 64-bit integer division: the fp64 estimate is off by at most 1 (idx < 2^52)."""
    var q = Int(Float64(idx) * inv_n)
    var r = idx - q * n
    if r < 0:
        q -= 1
    elif r >= n:
        q += 1
    return q


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLOCK)))
def _broadcast_rows_kernel[
    x_dtype: DType, g_dtype: DType, W: Int
](
    dx: Pointer[Scalar[x_dtype], MutAnyOrigin],
    dout: Pointer[Scalar[g_dtype], MutAnyOrigin],
    n_rows: Int64,
    n_cols: Int64,
):
    """dx viewed as flat vectors of W elements (the tail vector may be partial)."""
    comptime AL = 16 if W > 1 else size_of[x_dtype]()
    var n = Int(n_cols)
    var total = Int(n_rows) * n
    var inv_n = 1.0 / Float64(n)
    var nvec = cdiv(total, W)
    var v = global_idx.x
    while v < nvec:
        var i0 = v * W
        var row = _row_of(i0, n, inv_n)
        if i0 + W <= total:
            var val = SIMD[x_dtype, W](dout[unsafe_offset=row].cast[x_dtype]())
            var bnd = (row + 1) * n
            if i0 + W > bnd:  # the vector crosses one or more row boundaries
                comptime for k in range(W):
                    if i0 + k >= bnd:
                        row += 1
                        bnd += n
                    val[k] = dout[unsafe_offset=row].cast[x_dtype]()
            dx.unsafe_store[alignment=AL](i0, val)
        else:  # partial tail vector: scalar stores
            var bnd = (row + 1) * n
            for k in range(total - i0):
                if i0 + k >= bnd:
                    row += 1
                    bnd += n
                dx[unsafe_offset=i0 + k] = dout[unsafe_offset=row].cast[x_dtype]()
        v += grid_dim.x * block_dim.x


def reduce_sum_backward_gpu[
    x_dtype: DType, g_dtype: DType
](
    ctx: DeviceContext,
    dx: Pointer[Scalar[x_dtype], MutAnyOrigin],
    dout: Pointer[Scalar[g_dtype], MutAnyOrigin],
    m: Int,
    n: Int,
) raises:
    comptime VW = vec_width[x_dtype]()
    var sms = ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
    var wave = sms * (2048 // BLOCK) * 4  # enough blocks in flight to saturate stores
    if is_aligned16(dx):
        var grid = max(1, min(cdiv(cdiv(m * n, VW), BLOCK), wave))
        ctx.enqueue_function[_broadcast_rows_kernel[x_dtype, g_dtype, VW]](
            dx, dout, Int64(m), Int64(n), grid_dim=grid, block_dim=BLOCK
        )
    else:
        var grid = max(1, min(cdiv(m * n, BLOCK), wave))
        ctx.enqueue_function[_broadcast_rows_kernel[x_dtype, g_dtype, 1]](
            dx, dout, Int64(m), Int64(n), grid_dim=grid, block_dim=BLOCK
        )


def reduce_sum_backward_cpu[
    x_dtype: DType, g_dtype: DType
](dx: Pointer[Scalar[x_dtype], MutAnyOrigin], dout: Pointer[Scalar[g_dtype], MutAnyOrigin], m: Int, n: Int):
    comptime W = 8
    for row in range(m):
        var val = dout[unsafe_offset=row].cast[x_dtype]()
        var p = dx.unsafe_offset(row * n)
        var j = 0
        while j + W <= n:
            p.unsafe_store(j, SIMD[x_dtype, W](val))
            j += W
        while j < n:
            p[unsafe_offset=j] = val
            j += 1


@register("fusekit.reduce_sum_backward")
struct ReduceSumBackward:
    """Gradient of reduce_sum, dx[M, N] = dout[M] broadcast: outputs (dx, x dtype), inputs
    (dout [M], out dtype); floating dtypes only."""

    @staticmethod
    def execute[
        in_dtype: DType, out_dtype: DType, //, target: StaticString
    ](
        dx: MutableInputTensor[dtype=in_dtype, rank=2, ...],
        dout: InputTensor[dtype=out_dtype, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime if not in_dtype.is_floating_point() or not out_dtype.is_floating_point():
            raise Error("fusekit.reduce_sum_backward: only floating dtypes have a gradient")
        else:
            var m = dx.dim_size(0)
            var n = dx.dim_size(1)
            var dxp = rebind[Pointer[Scalar[in_dtype], MutAnyOrigin]](dx.unsafe_ptr())
            var gp = rebind[Pointer[Scalar[out_dtype], MutAnyOrigin]](dout.unsafe_ptr())
            comptime if target == "gpu":
                reduce_sum_backward_gpu[in_dtype, out_dtype](ctx, dxp, gp, m, n)
            else:
                reduce_sum_backward_cpu[in_dtype, out_dtype](dxp, gp, m, n)
