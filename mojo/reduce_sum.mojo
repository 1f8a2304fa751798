"""Op fusekit.reduce_sum: out[M] = sum(x[M, N], axis=1), fp32 (floats) / int64 (ints) accumulation.

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
"""

# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, thread_idx, block_idx, grid_dim, WARP_SIZE, barrier
from max.gpu.primitives import warp, block
from max.gpu.host import DeviceContext, DeviceAttribute
from std.utils import StaticTuple
from std.sys import size_of

from ._util import vec_width, acc_dtype, cdiv

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
    xp: Pointer[Scalar[in_dtype], MutAnyOrigin],
    m: Int,
    n: Int,
) raises:
    """Enqueue the GPU reduction (see the module docstring for the plan)."""
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
    var part = ctx.enqueue_create_buffer[acc](m * splits)
    ctx.enqueue_function[_sum_blocks_kernel[in_dtype, acc, acc, U]](
        part, xp, Int64(m), Int64(n), Int64(splits), Int64(chunk), grid_dim=min(m * splits, 1 << 30), block_dim=BLOCK
    )
    ctx.enqueue_function[_sum_blocks_kernel[acc, acc, out_dtype, 2]](
        outp, part, Int64(m), Int64(splits), Int64(1), Int64(splits), grid_dim=min(m, 1 << 30), block_dim=BLOCK
    )
    _ = part^


def reduce_sum_cpu[
    in_dtype: DType, out_dtype: DType
](outp: Pointer[Scalar[out_dtype], MutAnyOrigin], xp: Pointer[Scalar[in_dtype], MutAnyOrigin], m: Int, n: Int):
    """Row sums: 8-lane SIMD accumulators over 4096-element blocks; block sums combined in fp64
    (floats) so long rows stay within torch's cascade-sum error; integers are exact in int64."""
    comptime acc = acc_dtype[in_dtype]()
    comptime W = 8
    comptime BLK = 4096
    for row in range(m):
        var p = xp.unsafe_offset(row * n)
        var total_f = Float64(0)
        var total_i = Int64(0)
        var j0 = 0
        while j0 < n:
            var j1 = min(n, j0 + BLK)
            var a = SIMD[acc, W](0)
            var j = j0
            while j + W <= j1:
                a += p.unsafe_load[width=W](j).cast[acc]()
                j += W
            var s = a.reduce_add()
            while j < j1:
                s += p[unsafe_offset=j].cast[acc]()
                j += 1
            comptime if acc.is_integral():
                total_i += s.cast[DType.int64]()
            else:
                total_f += s.cast[DType.float64]()
            j0 = j1
        comptime if acc.is_integral():
            outp[unsafe_offset=row] = total_i.cast[out_dtype]()
        else:
            outp[unsafe_offset=row] = total_f.cast[acc]().cast[out_dtype]()


@register("fusekit.reduce_sum")
struct ReduceSum:
    @staticmethod
    def execute[
        in_dtype: DType, out_dtype: DType, //, target: StaticString
    ](
        res: MutableInputTensor[dtype=out_dtype, rank=1, ...],
        x: InputTensor[dtype=in_dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var n = x.dim_size(1)
        comptime if target == "gpu":
            reduce_sum_gpu[in_dtype, out_dtype](ctx, res.unsafe_ptr(), x.unsafe_ptr(), m, n)
        else:
            reduce_sum_cpu[in_dtype, out_dtype](res.unsafe_ptr(), x.unsafe_ptr(), m, n)
