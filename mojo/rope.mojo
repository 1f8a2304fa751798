"""Ops fusekit.rope / fusekit.rope_backward: rotate pairs of x[B, S, H, D] by angle
p * theta^(-2i/D), p = start_pos + s or positions[b, s]; the backward rotates dy by the negative angle (the transpose of a
rotation), (a, b) -> (a c + b s, b c - a s): the same kernel with a compile-time flag NEG.

Layouts: HF halves, pairs (i, i + D/2); interleaved, pairs (2i, 2i + 1). cos/sin come from the tables
[St, D/2] f32 at row p when has_tables, else are computed in-kernel (fp32 angle as
reference.py; exp in fp64, cos/sin to ~1 fp32 ulp after an exact reduction: the GPU's fast `cos.approx`
is wrong for large angles).
params = [start_pos, theta, interleaved (0/1), has_tables (0/1), has_positions (0/1)] (mojo/README.md),
read on the device (the backward's has_k after them is not read: an absent k is told by its dummy).
Signatures: rope(y [B,S,H,D], yk?, x, cos?, sin?, positions?, k? [B,S,Hk,D], params),
rope_backward(dx [B,S,H,D], dk?, dy, cos?, sin?, positions?, dyk?, params); absent tables are [1, 1]
dummies (has_tables = 0), an absent positions a [1, 1] int32 dummy (has_positions = 0), an absent k / yk
a [1, 1, 1, 1] dummy (head dim 1: a real one has x's even head dim), never read nor written. q and k
are one launch: a decode step's one-token rope was two launches, two nodes of its replayed graph.
positions (int32 [B, S] contiguous, ops/rope.py `_positions`) replace start_pos + s by positions[b, s]:
one scalar load per (b, s) row. Their values are untrusted (CUDA callers skip the host-synced check), so
they are clamped to [0, St - 1] with tables (St = the shorter table's rows) or [0, 2^24] without, as
kernels_triton/rope.py does: no value reads outside the tables. Every scalar-dependent step is bounded
(_util.mojo): theta = inf / 0 / NaN gives NaN outputs, never a hang; sin/cos are right for every
finite fp32 angle (Payne-Hanek reduction), e.g. theta = 1e-30 makes inv_freq up to ~1e29.

Byte floor: read x + write out = 2 * B*S*H*D * sizeof; 16x4096x32x128 bf16 = 1.07 GB -> 0.25 ms at the
H200's 4283 GB/s copy ceiling. cos/sin tables (if any) are St*D*4 bytes, read once per (b, s) row.

GPU plan: one thread per (b, s, group of W pair indices) computes (or loads) its W cos/sin values once
and applies them to all H heads of that row (loop over heads, 4 heads of loads in flight before the
stores), so each cos/sin is computed once per (b, s) and reused across heads, with no shared memory or
barrier. W = 16 bytes of x: halves use an a-vector and a b-vector per head, interleaved 2 vectors
deinterleaved in registers. Unaligned shapes (D/2 not a multiple of W) take the W = 1 path. Fewer rows
(below ROWS_PER_UNIT_MIN_UNITS units) split a row's heads into chunks of HU; up to PAIR_UNIT_MAX_ROWS
rows (decode) a unit is one pair (W = 1) of HU heads, so a thread computes one cos/sin, not W in a row.
Measured on the H200 (16x4096x32x128 bf16, GB/s; copy ceiling 4283): halves 3741, interleaved 3686,
tables 3873. After the issue-#16 fixes (exact sin/cos for every fp32 angle, bounded exp/log), a
same-run A/B against the old kernel on another H200 (GB/s): halves 3483 vs 3538, interleaved 3404 vs
3456, tables 3729 vs 3713, 16x4096x8x64 halves 2273 vs 2475 (the fp64 range reduction shows where a
row has few heads to share it). Tried and slower: 8 heads in flight with the first loads issued before the cos/sin math
(3559 / 3150 / 3537); a block per (b, s) with cos/sin in shared memory behind a barrier (2669 / 2661 /
2746: latency-bound, one 8 KB row per block).
"""

# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, global_idx, grid_dim, block_dim
from max.gpu.host import DeviceContext
from std.utils import StaticTuple
from std.sys import align_of

from ._util import vec_width, is_aligned16, cdiv, rope_inv_freq_coef, rope_cos_sin

comptime F32 = DType.float32
comptime FPtr = Pointer[Float32, MutAnyOrigin]
comptime HU = 4  # heads whose loads are in flight together (2 x 16 B each)
comptime TPB = 256
comptime ROWS_PER_UNIT_MIN_UNITS = 32768  # (row, 16 B group) units from which a unit takes all H heads
# (b, s) rows up to which a unit is one pair of HU heads (W = 1). H200, q 32 + k 8 heads, D128 bf16, kernel
# us with pair / 16 B units (7337e4e): 1 row 3.2 / 6.4, 64 rows 4.3 / 7.2, 256 rows 8.5 / 7.5.
comptime PAIR_UNIT_MAX_ROWS = 64
comptime IPtr = Pointer[Int32, MutAnyOrigin]
comptime MAX_POSITION = 1 << 24  # in-kernel angles: positions are clamped to [0, 2^24] (exact in fp32)


@always_inline
def _position(
    row: Int, seq: Int, start: Int, pos_t: IPtr, has_pos: Bool, tables: Bool, table_rows: Int
) -> Int:
    """Token row (b * S + s)'s position: start_pos + s, or positions[row] clamped to [0, St - 1]
    (tables) / [0, 2^24] (untrusted values never index outside the tables)."""
    if not has_pos:
        return start + row % seq
    var hi = max(table_rows - 1, 0) if tables else MAX_POSITION
    return min(max(Int(pos_t[unsafe_offset=row]), 0), hi)


@always_inline
def _rot[dtype: DType, W: Int](
    v0: SIMD[dtype, W], v1: SIMD[dtype, W], c: SIMD[F32, W], s: SIMD[F32, W], inter: Bool
) -> Tuple[SIMD[dtype, W], SIMD[dtype, W]]:
    """Rotate W pairs. Halves: v0 = a's, v1 = b's. Interleaved: v0|v1 = a0 b0 a1 b1 ..."""
    if inter:
        var ab = v0.join(v1).deinterleave()
        var a = rebind[SIMD[F32, W]](ab[0].cast[F32]())
        var b = rebind[SIMD[F32, W]](ab[1].cast[F32]())
        var o = (a * c - b * s).interleave(b * c + a * s).cast[dtype]()
        return (o.slice[W, offset=0](), o.slice[W, offset=W]())
    var a = v0.cast[F32]()
    var b = v1.cast[F32]()
    return ((a * c - b * s).cast[dtype](), (b * c + a * s).cast[dtype]())


@always_inline
def _row_cos_sin[W: Int, NEG: Bool](
    cos_t: FPtr, sin_t: FPtr, tables: Bool, pos: Int, i0: Int, half: Int, coef: Float64
) -> Tuple[SIMD[F32, W], SIMD[F32, W]]:
    var c = SIMD[F32, W](0)
    var s = SIMD[F32, W](0)
    if tables:
        comptime for k in range(W):
            c[k] = cos_t[unsafe_offset=pos * half + i0 + k]
            s[k] = sin_t[unsafe_offset=pos * half + i0 + k]
    else:
        comptime for k in range(W):
            var cs = rope_cos_sin(Float32(pos), i0 + k, coef)
            c[k] = cs[0]
            s[k] = cs[1]
    comptime if NEG:
        s = -s  # rotation by the negative angle: cos(-t) = cos t, sin(-t) = -sin t
    return (c, s)


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPB)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(2 if W > 1 else 3))  # registers capped: see the kernel
def _rope_kernel[dtype: DType, W: Int, NEG: Bool](
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    res_k: Pointer[Scalar[dtype], MutAnyOrigin],
    xk: Pointer[Scalar[dtype], MutAnyOrigin],
    cos_t: FPtr,
    sin_t: FPtr,
    pos_t: IPtr,
    params: FPtr,
    n_rows: Int64,
    seq: Int64,
    heads: Int64,
    heads_k: Int64,
    dim: Int64,
    table_rows: Int64,
    head_chunk: Int64,
):
    """Registers are capped at 2 resident blocks per SM for 16-byte units (<= 128) and 3 for W = 1 (as
    they were): the head chunks (b5f625f) took the 16-byte kernels from 122-128 to 154-164 registers, one
    256-thread block per SM, and B16 S4096 H32 D128 bf16 from 309 to 402 us in the H200 harness (HEAD
    before this cap: 366; 03fbe55, before the chunks: 309; fd8ab88 302). With the cap ptxas reports 120-128
    registers and no spills. Not yet re-timed on a GPU."""
    comptime AL = 16 if W > 1 else align_of[dtype]()
    var d = Int(dim)
    var half = d // 2
    var groups = half // W
    var hc = Int(head_chunk)  # heads per unit (rope_gpu: all of them, or HU where rows are few)
    var cq = (Int(heads) + hc - 1) // hc  # x's head chunks, then k's (0 without k): one launch for both
    var chunks = cq + (Int(heads_k) + hc - 1) // hc
    var start = Int(params[unsafe_offset=0])
    var inter = params[unsafe_offset=2] != 0
    var tables = params[unsafe_offset=3] != 0
    var has_pos = params[unsafe_offset=4] != 0
    var coef = rope_inv_freq_coef(params[unsafe_offset=1], d)
    # element offsets of a unit's two vectors inside one head
    # unit u = (row, head chunk, group of W pairs), the group fastest: a warp's loads are contiguous
    var total = Int(n_rows) * chunks * groups
    var u = global_idx.x
    while u < total:
        var row = u // (chunks * groups)
        var i0 = (u % groups) * W
        var c = (u // groups) % chunks
        var src = x
        var dst = res
        var nh = Int(heads)
        if c >= cq:  # one of k's chunks: same row, same positions, same cos/sin
            src = xk
            dst = res_k
            nh = Int(heads_k)
            c -= cq
        var h = c * hc
        var h_end = min(h + hc, nh)
        var pos = _position(row, Int(seq), start, pos_t, has_pos, tables, Int(table_rows))
        var cs = _row_cos_sin[W, NEG](cos_t, sin_t, tables, pos, i0, half, coef)
        var o0 = 2 * i0 if inter else i0
        var o1 = 2 * i0 + W if inter else i0 + half
        var base = row * nh * d
        while h + HU <= h_end:
            var A = SIMD[dtype, HU * W](0)
            var B = SIMD[dtype, HU * W](0)
            comptime for t in range(HU):
                var p = src.unsafe_offset(base + (h + t) * d)
                A = A.insert[offset = t * W](p.unsafe_load[width=W, alignment=AL](o0))
                B = B.insert[offset = t * W](p.unsafe_load[width=W, alignment=AL](o1))
            comptime for t in range(HU):
                var r = _rot[dtype, W](A.slice[W, offset = t * W](), B.slice[W, offset = t * W](), cs[0], cs[1], inter)
                var q = dst.unsafe_offset(base + (h + t) * d)
                q.unsafe_store[alignment=AL](o0, r[0])
                q.unsafe_store[alignment=AL](o1, r[1])
            h += HU
        while h < h_end:
            var p = src.unsafe_offset(base + h * d)
            var r = _rot[dtype, W](
                p.unsafe_load[width=W, alignment=AL](o0), p.unsafe_load[width=W, alignment=AL](o1), cs[0], cs[1], inter
            )
            var q = dst.unsafe_offset(base + h * d)
            q.unsafe_store[alignment=AL](o0, r[0])
            q.unsafe_store[alignment=AL](o1, r[1])
            h += 1
        u += grid_dim.x * block_dim.x


def rope_gpu[dtype: DType, NEG: Bool = False](
    ctx: DeviceContext,
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    res_k: Pointer[Scalar[dtype], MutAnyOrigin],
    xk: Pointer[Scalar[dtype], MutAnyOrigin],
    cos_t: FPtr,
    sin_t: FPtr,
    pos_t: IPtr,
    params: FPtr,
    b: Int,
    s: Int,
    h: Int,
    hk: Int,
    d: Int,
    table_rows: Int,
) raises:
    """x [B, S, H, D] and (hk > 0) k [B, S, Hk, D] at the same positions, in one launch."""
    comptime VW = vec_width[dtype]()
    var half = d // 2
    var vec_ok = half % VW == 0 and is_aligned16(x) and is_aligned16(res)
    if hk > 0:
        vec_ok = vec_ok and is_aligned16(xk) and is_aligned16(res_k)
    var units = b * s * (half // VW if vec_ok else half)
    # Few rows (decode: one token, 8 units of 16 B per row at D128 bf16): a unit per HU heads instead of
    # one looping over all H, so a row's heads are rotated in parallel. H200, bench small suite, one token
    # with q 32 and k 8 heads, kernel time: 23.1 -> 14.7 us (Triton's 1.5; then q and k were two
    # launches, two graph nodes). Many rows keep a unit per row and tensor: its cos/sin (fp64 range
    # reduction) are then computed once per row, not once per chunk. The threshold was not measured.
    var most = max(h, hk)
    var hc = max(most if units >= ROWS_PER_UNIT_MIN_UNITS else min(most, HU), 1)
    var chunks = cdiv(h, hc) + cdiv(hk, hc)
    # Fewer rows still (decode): a unit per pair (W = 1), so a thread computes one cos/sin, not W in a
    # row: the unit's work is a dependent chain (params -> log -> exp -> reduction -> polynomials -> x).
    # H200, one token, kernel time 7.49 -> 3.18 us (7337e4e, with the fp32 polynomials).
    var pair_units = b * s <= PAIR_UNIT_MAX_ROWS
    if pair_units:
        vec_ok = False
        units = b * s * half
    if units * chunks == 0:
        return  # nothing to rotate (no launch of an empty grid)
    var grid = min(cdiv(units * chunks, TPB), 1 << 30)
    if vec_ok:
        ctx.enqueue_function[_rope_kernel[dtype, VW, NEG]](
            res, x, res_k, xk, cos_t, sin_t, pos_t, params, Int64(b * s), Int64(s), Int64(h), Int64(hk), Int64(d),
            Int64(table_rows), Int64(hc), grid_dim=grid, block_dim=TPB,
        )
    else:
        ctx.enqueue_function[_rope_kernel[dtype, 1, NEG]](
            res, x, res_k, xk, cos_t, sin_t, pos_t, params, Int64(b * s), Int64(s), Int64(h), Int64(hk), Int64(d),
            Int64(table_rows), Int64(hc), grid_dim=grid, block_dim=TPB,
        )


def rope_cpu[dtype: DType, NEG: Bool = False](
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    cos_t: FPtr,
    sin_t: FPtr,
    pos_t: IPtr,
    params: FPtr,
    b: Int,
    s: Int,
    h: Int,
    d: Int,
    table_rows: Int,
):
    """Per (b, s) row: cos/sin for the D/2 pairs once, then every head."""
    var half = d // 2
    var start = Int(params[unsafe_offset=0])
    var inter = params[unsafe_offset=2] != 0
    var tables = params[unsafe_offset=3] != 0
    var has_pos = params[unsafe_offset=4] != 0
    var coef = rope_inv_freq_coef(params[unsafe_offset=1], d)
    var c = List[Float32]()
    var sn = List[Float32]()
    for _ in range(half):
        c.append(0)
        sn.append(0)
    for row in range(b * s):
        var pos = _position(row, s, start, pos_t, has_pos, tables, table_rows)
        for i in range(half):
            if tables:
                c[i] = cos_t[unsafe_offset=pos * half + i]
                sn[i] = sin_t[unsafe_offset=pos * half + i]
            else:
                var cs = rope_cos_sin(Float32(pos), i, coef)
                c[i] = cs[0]
                sn[i] = cs[1]
            comptime if NEG:
                sn[i] = -sn[i]
        for hh in range(h):
            var base = (row * h + hh) * d
            for i in range(half):
                var ia = base + (2 * i if inter else i)
                var ib = base + (2 * i + 1 if inter else i + half)
                var a = x[unsafe_offset=ia].cast[F32]()
                var bb = x[unsafe_offset=ib].cast[F32]()
                res[unsafe_offset=ia] = (a * c[i] - bb * sn[i]).cast[dtype]()
                res[unsafe_offset=ib] = (bb * c[i] + a * sn[i]).cast[dtype]()


def _rope_execute[dtype: DType, //, target: StaticString, NEG: Bool](
    res: MutableInputTensor[dtype=dtype, rank=4, ...],
    res_k: MutableInputTensor[dtype=dtype, rank=4, ...],
    x: InputTensor[dtype=dtype, rank=4, ...],
    cos: InputTensor[dtype=DType.float32, rank=2, ...],
    sin: InputTensor[dtype=DType.float32, rank=2, ...],
    positions: InputTensor[dtype=DType.int32, rank=2, ...],
    k: InputTensor[dtype=dtype, rank=4, ...],
    params: InputTensor[dtype=DType.float32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    var b = x.dim_size(0)
    var s = x.dim_size(1)
    var h = x.dim_size(2)
    var d = x.dim_size(3)
    # an absent k (and yk) is a [1, 1, 1, 1] dummy: a real one has x's head dim, which is even
    var hk = k.dim_size(2) if k.dim_size(3) == d and d % 2 == 0 else 0
    var rp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](res.unsafe_ptr())
    var xp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](x.unsafe_ptr())
    var rkp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](res_k.unsafe_ptr())
    var kp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](k.unsafe_ptr())
    var cp = rebind[FPtr](cos.unsafe_ptr())
    var sp = rebind[FPtr](sin.unsafe_ptr())
    var ip = rebind[IPtr](positions.unsafe_ptr())
    var pp = rebind[FPtr](params.unsafe_ptr())
    var table_rows = min(cos.dim_size(0), sin.dim_size(0))  # dummies (no tables): 1, never read
    comptime if target == "gpu":
        rope_gpu[dtype, NEG](ctx, rp, xp, rkp, kp, cp, sp, ip, pp, b, s, h, hk, d, table_rows)
    else:
        rope_cpu[dtype, NEG](rp, xp, cp, sp, ip, pp, b, s, h, d, table_rows)
        if hk > 0:
            rope_cpu[dtype, NEG](rkp, kp, cp, sp, ip, pp, b, s, hk, d, table_rows)


@register("fusekit.rope")
struct Rope:
    """RoPE forward, y = rope(x) and yk = rope(k) at the same positions in one launch: outputs (y [B,S,H,D],
    yk [B,S,Hk,D] or a [1,1,1,1] dummy), inputs (x, cos?, sin?, positions? [B,S] int32, k? [B,S,Hk,D],
    params [start_pos, theta, interleaved, has_tables, has_positions])."""

    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString
    ](
        res: MutableInputTensor[dtype=dtype, rank=4, ...],
        res_k: MutableInputTensor[dtype=dtype, rank=4, ...],
        x: InputTensor[dtype=dtype, rank=4, ...],
        cos: InputTensor[dtype=DType.float32, rank=2, ...],
        sin: InputTensor[dtype=DType.float32, rank=2, ...],
        positions: InputTensor[dtype=DType.int32, rank=2, ...],
        k: InputTensor[dtype=dtype, rank=4, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        _rope_execute[target, False](res, res_k, x, cos, sin, positions, k, params, ctx)


@register("fusekit.rope_backward")
struct RopeBackward:
    """RoPE backward, dx = rotation of dy by the negative angle (dk of dyk likewise): outputs (dx [B,S,H,D],
    dk or a dummy), inputs (dy, cos?, sin?, positions?, dyk?, params as rope plus has_k)."""

    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString
    ](
        dx: MutableInputTensor[dtype=dtype, rank=4, ...],
        dk: MutableInputTensor[dtype=dtype, rank=4, ...],
        dy: InputTensor[dtype=dtype, rank=4, ...],
        cos: InputTensor[dtype=DType.float32, rank=2, ...],
        sin: InputTensor[dtype=DType.float32, rank=2, ...],
        positions: InputTensor[dtype=DType.int32, rank=2, ...],
        dyk: InputTensor[dtype=dtype, rank=4, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        _rope_execute[target, True](dx, dk, dy, cos, sin, positions, dyk, params, ctx)
