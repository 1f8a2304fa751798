"""Op fusekit.linear_cross_entropy: the row kernel of the fused LM-head loss (Liger-Kernel's scheme).

Not the spec's forward phase but its per-chunk part (signature in python/fusekit/backends/mojo/specs.py,
LINEAR_CROSS_ENTROPY_ROWS): the provider cuts the tokens into chunks (ops/linear_cross_entropy.py
chunk_rows), makes each chunk's logits = x_c @ weight^T (+ bias) with a torch matmul into one reused
buffer, calls this op on it, then runs d x / d weight / d bias as torch matmuls from what it left there
(exactly as the Triton backend, kernels_triton/linear_cross_entropy.py). The backward (the saved gradients
times the loss's gradient) is torch multiplies: no Mojo op.

outputs: logits [C, V] (x's dtype; read, and overwritten with d loss / d logits when grad), rows [C] f32
inputs:  labels [C] int64, scale [1] f32 (d loss / d row loss: 1 / rows not ignored for "mean", else 1;
         on the device, so the host never syncs)
params:  [ignore_hi, ignore_mid, ignore_lo, label_smoothing, grad]: ignore_index = hi 2^48 + mid 2^24 + lo
         (24-bit pieces, each exact in f32: any int64), grad 0/1.

Per row (fp32 math, the reference's formulas): lse = logsumexp(z), loss = lse - (1 - eps) z_y - eps mean(z);
when grad, d logits = (softmax(z) - (1 - eps) onehot(y) - eps / V) * scale, rounded to x's dtype. lse = m +
log(s) (m the row's max, s its sum of exp(z - m)) is never rounded as one number: loss = (1 - eps)(m - z_y)
+ eps (m - mean(z)) + log(s) and softmax(z) = exp((z - m) - log(s)). A row
whose label is ignore_index gets loss 0 and exact zero gradients (its logits are never read); a label
outside [0, V) gives NaN (loss and gradients).

GPU: one block per row (grid-stride over rows), threads striding over V in 16-byte vectors when V is a
whole number of vectors and the buffer is 16-byte aligned (else one element per step). Pass 1: each
thread keeps an online (max, sum of exps) over its elements and the sum of its logits, combined with
block.max / block.sum (fixed-order trees, WARP_SIZE-agnostic: 32 NVIDIA, 64 AMD; no atomics: the result
is bit-identical run to run). Pass 2 (grad) re-reads the row (L2-resident: 256 KB at V 128256 bf16) and
overwrites it. The label's logit is read by thread 0 before the block reductions, whose barriers order it
before any thread of pass 2 overwrites it.
Index widths: row offsets row * V are Int (64-bit; the chunk C x V passes 2^31 elements from T ~ 2^31 / H
tokens, as the chunk is about x's size), sizes arrive as Int64; the grid is min(C, 2^30) blocks, striding.
Byte floor per chunk: read C V logits twice, write them once (3 * 2 * C * V bytes in bf16): 788 MB at
Llama-3-8B (C 1024, V 128256) -> ~0.18 ms at 4.3 TB/s, against ~4.8 ms of the chunk's three GEMMs.
"""

from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, thread_idx, block_idx, grid_dim, barrier
from max.gpu.primitives import block
from max.gpu.host import DeviceContext
from std.math import exp, log
from std.sys import align_of
from std.utils import StaticTuple
from std.utils.numerics import nan, neg_inf

from ._util import vec_width, is_aligned16, exp_keep_nan

comptime F32 = DType.float32
comptime FPtr = Pointer[Float32, MutAnyOrigin]
comptime IPtr = Pointer[Int64, MutAnyOrigin]
# Threads per row: 1024 once a thread would walk more than 4 vectors of a 256-thread block (V > 8192 in
# bf16: Llama-2/3, Mistral, Qwen2 vocabularies), else 256 (small vocabularies, few loop steps). Both are
# multiples of 64, as block.sum / block.max need on AMD (64-wide wavefronts).
comptime BIG_BLK = 1024
comptime SMALL_BLK = 256
comptime SMALL_MAX_STEPS = 4


struct LceFlags(Copyable, Movable):
    """The op's runtime scalars, read from `params` on the device."""

    var ignore: Int64
    var eps: Float32
    var grad: Bool

    @always_inline
    def __init__(out self, params: FPtr):
        self.ignore = (
            params[unsafe_offset=0].cast[DType.int64]() * (1 << 48)
            + params[unsafe_offset=1].cast[DType.int64]() * (1 << 24)
            + params[unsafe_offset=2].cast[DType.int64]()
        )
        self.eps = params[unsafe_offset=3]
        self.grad = params[unsafe_offset=4] != 0


@always_inline
def _rescale(m: Float32, m_new: Float32) -> Float32:
    """exp(m - m_new), 1 when equal (an empty running sum at -inf stays 0 instead of NaN)."""
    return Float32(1) if m == m_new else exp(m - m_new)


@always_inline
def _row_loss(m: Float32, ls: Float32, zy: Float32, zsum: Float32, v: Int, y: Int64, f: LceFlags) -> Float32:
    """lse - (1 - eps) z_y - eps mean(z) with lse = m + ls, as (1 - eps)(m - z_y) + eps (m - mean(z)) + ls
    (lse itself, rounded at |m|, would carry ~u |m|); NaN for a label outside [0, V) (ignored rows never
    get here)."""
    if y < 0 or y >= Int64(v):
        return nan[F32]()
    var loss = (1 - f.eps) * (m - zy) + ls
    if f.eps != 0:
        loss += f.eps * (m - zsum / Float32(v))
    return loss


@always_inline
def _grad_vec[
    dtype: DType, W: Int
](
    z: SIMD[F32, W], m: Float32, ls: Float32, col: Int, y: Int64, inside: Bool, sc: Float32, v: Int, f: LceFlags
) -> SIMD[dtype, W]:
    """d loss / d logits for W logits starting at column `col`, in the reference's order of operations."""
    var g = exp_keep_nan((z - m) - ls)
    if f.eps != 0:
        g -= f.eps / Float32(v)
    var k = Int(y) - col
    if k >= 0 and k < W:
        g[k] = g[k] - (1 - f.eps)
    g = g * sc
    if not inside:
        g = SIMD[F32, W](nan[F32]())
    return g.cast[dtype]()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _lce_rows_kernel[
    dtype: DType, BLK: Int, W: Int
](
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: FPtr,
    labels: IPtr,
    scale: FPtr,
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    comptime AL = 16 if W > 1 else align_of[dtype]()
    var v = Int(n_cols)
    var nw = v // W
    var f = LceFlags(params)
    var tid = thread_idx.x
    var row = block_idx.x
    while row < Int(n_rows):
        var zr = logits.unsafe_offset(row * v)
        var y = labels[unsafe_offset=row]
        if y == f.ignore:  # uniform over the block: loss 0, exact zero gradients, the row is not read
            if tid == 0:
                rows[unsafe_offset=row] = 0
            if f.grad:
                var j = tid
                while j < nw:
                    zr.unsafe_store[alignment=AL](j * W, SIMD[dtype, W](0))
                    j += BLK
            row += grid_dim.x
            continue
        var inside = y >= 0 and y < Int64(v)
        # pass 1: online (max, sum of exps) and the sum of logits per thread, fp32
        var m = neg_inf[F32]()
        var s = Float32(0)
        var zs = SIMD[F32, W](0)
        var j = tid
        while j < nw:
            var z = zr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
            var mn = max(m, z.reduce_max())
            # a thread's share of only -inf (classes masked by a -inf bias) leaves mn -inf: z - mn was NaN
            var m_sub = Float32(0) if mn == neg_inf[F32]() else mn
            s = s * _rescale(m, mn) + exp_keep_nan(z - m_sub).reduce_add()
            m = mn
            zs += z
            j += BLK
        var zy = Float32(0)
        if tid == 0 and inside:  # before the barriers below: pass 2 may overwrite it afterwards
            zy = zr[unsafe_offset=Int(y)].cast[F32]()
        var mb = block.max[block_size=BLK, broadcast=True](m)
        barrier()  # block reductions' shared scratch is reused below
        var sb = block.sum[block_size=BLK, broadcast=True](s * _rescale(m, mb))
        barrier()
        var zsum = Float32(0)
        if f.eps != 0:
            zsum = block.sum[block_size=BLK, broadcast=True](zs.reduce_add())
            barrier()
        var ls = log(sb)
        if tid == 0:
            rows[unsafe_offset=row] = _row_loss(mb, ls, zy, zsum, v, y, f)
        if f.grad:  # pass 2: d loss / d logits in place, x's dtype
            var sc = scale[unsafe_offset=0]
            j = tid
            while j < nw:
                var z = zr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
                zr.unsafe_store[alignment=AL](j * W, _grad_vec[dtype, W](z, mb, ls, j * W, y, inside, sc, v, f))
                j += BLK
        row += grid_dim.x


def lce_rows_gpu[
    dtype: DType
](
    ctx: DeviceContext,
    logits: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: FPtr,
    labels: IPtr,
    scale: FPtr,
    params: FPtr,
    c: Int,
    v: Int,
) raises:
    """Pick the variant (vector width by alignment, threads by row length) and launch one block per row."""
    if c == 0:
        return
    comptime VW = vec_width[dtype]()
    var grid = min(c, 1 << 30)
    var C = Int64(c)
    var V = Int64(v)
    if v % VW == 0 and is_aligned16(logits):
        if v // VW > SMALL_BLK * SMALL_MAX_STEPS:
            ctx.enqueue_function[_lce_rows_kernel[dtype, BIG_BLK, VW]](
                logits, rows, labels, scale, params, C, V, grid_dim=grid, block_dim=BIG_BLK
            )
        else:
            ctx.enqueue_function[_lce_rows_kernel[dtype, SMALL_BLK, VW]](
                logits, rows, labels, scale, params, C, V, grid_dim=grid, block_dim=SMALL_BLK
            )
    elif v > SMALL_BLK * SMALL_MAX_STEPS:
        ctx.enqueue_function[_lce_rows_kernel[dtype, BIG_BLK, 1]](
            logits, rows, labels, scale, params, C, V, grid_dim=grid, block_dim=BIG_BLK
        )
    else:
        ctx.enqueue_function[_lce_rows_kernel[dtype, SMALL_BLK, 1]](
            logits, rows, labels, scale, params, C, V, grid_dim=grid, block_dim=SMALL_BLK
        )


def lce_rows_cpu[
    dtype: DType
](logits: Pointer[Scalar[dtype], MutAnyOrigin], rows: FPtr, labels: IPtr, scale: FPtr, params: FPtr, c: Int, v: Int):
    """Plain loops, the same math (two passes for the logsumexp: max, then the sum of exps)."""
    var f = LceFlags(params)
    var sc = scale[unsafe_offset=0]
    for row in range(c):
        var zr = logits.unsafe_offset(row * v)
        var y = labels[unsafe_offset=row]
        if y == f.ignore:
            rows[unsafe_offset=row] = 0
            if f.grad:
                for j in range(v):
                    zr[unsafe_offset=j] = 0
            continue
        var inside = y >= 0 and y < Int64(v)
        var m = neg_inf[F32]()
        var zsum = Float32(0)
        for j in range(v):
            var z = zr[unsafe_offset=j].cast[F32]()
            m = max(m, z)
            zsum += z
        var s = Float32(0)
        for j in range(v):
            s += exp_keep_nan(zr[unsafe_offset=j].cast[F32]() - m)
        var ls = log(s)
        var zy = zr[unsafe_offset=Int(y)].cast[F32]() if inside else Float32(0)
        rows[unsafe_offset=row] = _row_loss(m, ls, zy, zsum, v, y, f)
        if f.grad:
            for j in range(v):
                var z = SIMD[F32, 1](zr[unsafe_offset=j].cast[F32]())
                zr[unsafe_offset=j] = _grad_vec[dtype, 1](z, m, ls, j, y, inside, sc, v, f)[0]


@register("fusekit.linear_cross_entropy")
struct LinearCrossEntropyRows:
    """The per-chunk row kernel (see the module docstring): outputs logits [C, V] x (in place), rows [C]
    f32; inputs labels [C] int64, scale [1] f32; params [ignore_hi, ignore_mid, ignore_lo, eps, grad]."""

    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString
    ](
        logits: MutableInputTensor[dtype=dtype, rank=2, ...],
        rows: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        labels: InputTensor[dtype=DType.int64, rank=1, ...],
        scale: InputTensor[dtype=DType.float32, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var c = logits.dim_size(0)
        var v = logits.dim_size(1)
        var zp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](logits.unsafe_ptr())
        var rp = rebind[FPtr](rows.unsafe_ptr())
        var lp = rebind[IPtr](labels.unsafe_ptr())
        var sp = rebind[FPtr](scale.unsafe_ptr())
        var pp = rebind[FPtr](params.unsafe_ptr())
        comptime if target == "gpu":
            lce_rows_gpu[dtype](ctx, zp, rp, lp, sp, pp, c, v)
        else:
            lce_rows_cpu[dtype](zp, rp, lp, sp, pp, c, v)
