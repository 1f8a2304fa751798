# Split-KV (flash-decoding) forward of fusekit.attention for few queries against a long KV: the GPU path
# `attention_gpu` (attention.mojo) takes for S <= DECODE_MAX_S and a GQA group of at most DECODE_MAX_ROWS rows
# (H/Hkv * S), D in {64, 128, 256}, every dtype (fp16 / bf16 / fp32), both vendors. A port of the Triton
# backend's design (kernels_triton/_attention_decode.py), SIMT instead of tensor cores:
#
# 1. `_decode_split_kernel`, one block per (b, kv head, row block) x split: the rows r = g * S + s of the GQA
#    group (g the query head within the group, s the query; row r is also row r of the group's q / o block),
#    at most _dec_rb(D) of them per block (more rows: further row blocks), attend to one chunk of the
#    sequence's keys, so each K / V tile is read once per row block instead of once per query head. The
#    sequence's L_b keys are cut into `splits` chunks of whole BN-key tiles (per sequence: with kv_len each
#    block of a sequence gets an equal share). Per tile: K and V go global -> shared (16-byte loads where
#    aligned), scores s = q.k * scale * log2(e) for the (row, key) pairs a row sees, an online softmax per
#    row (NaN-propagating max, exp2), O += P V with each thread owning one head-dim column of 16 rows.
#    A row only ever touches the keys it sees (loop bounds from indices, not from masked scores), so keys
#    past kv_len are never read and a non-finite V of a key that row does not see cannot reach it.
#    With one split the block writes o and lse itself; otherwise an fp32 partial (o normalized by its own
#    l, and its log2-domain lse) into the caller's workspace `part` [B*H*S * splits * (D + 1)] (specs.py
#    attention_decode_part mirrors `decode_plan`).
# 2. `_decode_combine_kernel`, one warp per output row: lse = log-sum-exp of the partial lses, o = sum_i
#    2^(lse_i - lse) o_i, in split order: deterministic (bit-identical repeats, no atomics).
#
# Non-finite rules (attention.mojo's header): a partial of a chunk with no visible key is (o 0, lse -inf);
# a chunk whose max is NaN or +inf gives (NaN, max); one whose visible scores are all -inf gives (its sum of
# 0 * v, which is 0 or NaN, -inf); the combine decides "the row sees no key" from indices (o 0, lse -inf),
# a non-finite overall max M gives o NaN and lse M (so all visible scores -inf: NaN, -inf; +inf: NaN, +inf),
# and a NaN / inf o_i of a weight-0 split still reaches o (0 * NaN), as a float64 softmax does.
#
# Split count (`decode_plan`, mirrored by specs.py): blocks = B * Hkv * row_blocks * splits should give each
# SM DECODE_CTAS_PER_SM blocks (the split kernel does not pipeline its loads: several resident blocks per SM
# hide the load latency), with at least DECODE_MIN_TILES tiles per split and at most DECODE_MAX_SPLITS.
# The plan uses Skv (the tensor's length), not kv_len (on the device): ragged batches split every sequence
# into the same number of chunks.
#
# Floor: bytes = the KV read, B * Skv * Hkv * D * 2 * es. SIMT FLOPs are 4 * rows * D per key and row block
# against 4 * D * es bytes per key: bandwidth-bound for small groups (S = 1, GQA 4/8: 4 FLOP/B at bf16),
# compute-bound (fp32 FMA) for the largest ones (128 rows), where a tensor-core (mma) variant would be the
# next step. NOT MEASURED ON A GPU YET: compiled for sm_90 and gfx942 only.

from std.math import ceildiv, exp2, log2
from std.memory import unsafe_stack_allocation
from std.sys import llvm_intrinsic, size_of
from max.gpu import thread_idx, block_idx, lane_id, barrier, WARP_SIZE, AddressSpace
from max.gpu.host import DeviceContext, DeviceAttribute
from max.gpu.primitives import warp

from ._util import check_workspace

comptime _LOG2E: Float32 = 1.4426950408889634
comptime _LN2: Float32 = 0.6931471805599453
comptime _NEG_INF = Float32.MIN  # -inf
comptime _F32 = DType.float32

# ---- the plan (mirrored in python/fusekit/backends/mojo/specs.py; tests/test_mojo_attention_decode.py) ----
comptime DECODE_MAX_S = 16  # queries per sequence up to which attention_gpu takes this path
comptime DECODE_MAX_ROWS = 128  # GQA group rows (H/Hkv * S) up to which it does
comptime DECODE_THREADS = 256  # threads per block (a multiple of 32 and of 64: both vendors' warps)
comptime DECODE_CTAS_PER_SM = 4  # blocks per SM the split count aims at
comptime DECODE_MIN_TILES = 2  # KV tiles per split at least
comptime DECODE_MAX_SPLITS = 256
comptime DECODE_TILE_BYTES = 8192  # one K (or V) tile: BN keys x D x es
comptime DECODE_MAX_BN = 32
comptime DECODE_Q_ELEMS = 4096  # fp32 q rows in shared memory per block: rows x D (16 KB)


@always_inline
def _dec_bn(d: Int, es: Int) -> Int:
    """Keys per tile: bf16/fp16 D64 32, D128 32, D256 16; fp32 D64 32, D128 16, D256 8."""
    return max(1, min(DECODE_MAX_BN, DECODE_TILE_BYTES // (d * es)))


@always_inline
def _dec_rb(d: Int) -> Int:
    """Rows per block at most: D64 64, D128 32, D256 16 (q rows in fp32 in shared memory, 16 KB)."""
    return min(64, DECODE_Q_ELEMS // d)


def decode_applies(H: Int, Hkv: Int, S: Int, D: Int) -> Bool:
    """Whether attention_gpu runs the split-KV kernels (few queries, small GQA group, a compiled head dim)."""
    if D != 64 and D != 128 and D != 256:
        return False
    return S <= DECODE_MAX_S and (H // Hkv) * S <= DECODE_MAX_ROWS


def decode_plan(B: Int, H: Int, Hkv: Int, S: Int, Skv: Int, D: Int, es: Int, sms: Int) -> Tuple[Int, Int, Int]:
    """(row_blocks, rows per block, splits) of a decode call."""
    var rows = (H // Hkv) * S
    var row_blocks = max(1, ceildiv(rows, _dec_rb(D)))
    var rpp = max(1, ceildiv(rows, row_blocks))
    var groups = B * Hkv * row_blocks
    var tiles = ceildiv(Skv, _dec_bn(D, es))
    var max_s = max(1, min(DECODE_MAX_SPLITS, tiles // DECODE_MIN_TILES))
    var splits = max(1, min(max_s, ceildiv(sms * DECODE_CTAS_PER_SM, max(groups, 1))))
    return (row_blocks, rpp, splits)


# ---- helpers (as attention.mojo's; a copy: that file imports this one) ------------------------------


@always_inline
def _nmax(a: Float32, b: Float32) -> Float32:
    """max that returns NaN when either operand is NaN (IEEE maximum)."""
    return llvm_intrinsic["llvm.maximum.f32", Float32](a, b)


@always_inline
def _nonfinite(x: Float32) -> Bool:
    return x * 0 != 0


@always_inline
def _seq_len(kv_len: Pointer[Int32, MutAnyOrigin], has_len: Bool, b: Int, skv: Int) -> Int:
    if not has_len:
        return skv
    return min(max(Int(kv_len[unsafe_offset=b]), 0), skv)


@always_inline
def _last_key(i: Int, s_len: Int, n_keys: Int, causal: Bool) -> Int:
    """The last key query i sees (-1: none); bottom-right causal against the sequence's n_keys."""
    if causal:
        return min(n_keys - 1, i + n_keys - s_len)
    return n_keys - 1


@always_inline
def _warp_nmax(x: Float32) -> Float32:
    var r = x
    comptime for i in range(7):
        comptime off = WARP_SIZE >> (i + 1)
        comptime if off > 0:
            r = _nmax(r, warp.shuffle_xor(r, UInt32(off)))
    return r


# ---- kernels --------------------------------------------------------------------------------------


def _decode_split_kernel[
    dtype: DType, D: Int
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    part: Pointer[Float32, MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
    row_blocks: Int32,
    rpp: Int32,
    splits: Int32,
    plse_off: Int64,
    vec: Int32,
):
    comptime es = size_of[dtype]()
    comptime BN = _dec_bn(D, es)
    comptime RB = _dec_rb(D)
    comptime NT = DECODE_THREADS
    comptime KW = 4 // es  # elements per 4-byte shared-memory word
    comptime LD = D + KW  # padded shared row: an odd number of words (conflict-free key-per-lane reads)
    comptime VW = 16 // es  # elements per 16-byte global load
    comptime RL = NT // D  # row lanes of the P.V step (threads per head-dim column)
    comptime RPT = RB // RL  # rows per thread in the P.V step (16 for every D)
    comptime NWARP = NT // WARP_SIZE

    var ks = unsafe_stack_allocation[BN * LD, dtype, address_space=AddressSpace.SHARED]()
    var vs = unsafe_stack_allocation[BN * LD, dtype, address_space=AddressSpace.SHARED]()
    var qs = unsafe_stack_allocation[RB * D, _F32, address_space=AddressSpace.SHARED]()
    var ps = unsafe_stack_allocation[RB * BN, _F32, address_space=AddressSpace.SHARED]()
    var m_s = unsafe_stack_allocation[RB, _F32, address_space=AddressSpace.SHARED]()
    var l_s = unsafe_stack_allocation[RB, _F32, address_space=AddressSpace.SHARED]()
    var a_s = unsafe_stack_allocation[RB, _F32, address_space=AddressSpace.SHARED]()

    var tid = thread_idx.x
    var h_n = Int(H)
    var hkv_n = Int(Hkv)
    var s_len = Int(S)
    var skv = Int(Skv)
    var n_split = Int(splits)
    var group = h_n // hkv_n
    var rows = group * s_len
    var pid = block_idx.x
    var sp = block_idx.y
    var bhkv = pid // Int(row_blocks)
    var rb = pid % Int(row_blocks)
    var b = bhkv // hkv_n
    var hk = bhkv % hkv_n
    var r_lo = rb * Int(rpp)
    var nrows = max(0, min(Int(rpp), rows - r_lo))  # rows of this block (<= RB)
    var causal = params[unsafe_offset=0] != 0
    var scale2 = params[unsafe_offset=1] * _LOG2E
    var L = _seq_len(kv_len, params[unsafe_offset=2] != 0, b, skv)
    # this block's keys: the sequence's L keys in n_split chunks of whole tiles
    var chunk = ceildiv(ceildiv(L, BN), n_split) * BN
    var lo = min(sp * chunk, L)
    var hi = min(lo + chunk, L)
    var row0 = (b * h_n + hk * group) * s_len + r_lo  # the block's first row in q / o / lse
    var kv_base = ((b * hkv_n + hk) * skv) * D

    # q rows -> shared (fp32); per-row state
    for e in range(tid, nrows * D, NT):
        qs[unsafe_offset=e] = q[unsafe_offset=row0 * D + e].cast[_F32]()
    if tid < RB:
        m_s[unsafe_offset=tid] = _NEG_INF
        l_s[unsafe_offset=tid] = 0
        a_s[unsafe_offset=tid] = 1

    # the P.V step's ownership: column dcol, rows rl + RL * i
    var dcol = tid % D
    var rl = tid // D
    var acc = SIMD[_F32, RPT](0)
    # keys each owned row sees in [lo, hi): [lo, vend)
    var vend = SIMD[DType.int32, RPT](0)
    comptime for i in range(RPT):
        var r = rl + RL * i
        if r < nrows:
            var sq = (r_lo + r) % s_len
            vend[i] = Int32(max(lo, min(hi, _last_key(sq, s_len, L, causal) + 1)))
    barrier()

    var kg = k.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var aligned = vec != 0
    var kbase = lo
    while kbase < hi:
        var nk = min(BN, hi - kbase)
        # ---- K, V tile -> shared (rows < nk only: keys past hi, and so past L, are never read)
        comptime CPR = D // VW  # 16-byte chunks per key row
        for c in range(tid, nk * CPR, NT):
            var j = c // CPR
            var col = (c % CPR) * VW
            var src = kv_base + (kbase + j) * D + col
            var xk = SIMD[dtype, VW](0)
            var xv = SIMD[dtype, VW](0)
            if aligned:
                xk = kg.unsafe_load[width=VW, alignment=16](src)
                xv = vg.unsafe_load[width=VW, alignment=16](src)
            else:
                comptime for e in range(VW):
                    xk[e] = k[unsafe_offset=src + e]
                    xv[e] = v[unsafe_offset=src + e]
            comptime for u in range(VW // KW):
                ks.unsafe_store[alignment=4](j * LD + col + u * KW, xk.slice[KW, offset=u * KW]())
                vs.unsafe_store[alignment=4](j * LD + col + u * KW, xv.slice[KW, offset=u * KW]())
        barrier()

        # ---- scores (log2 domain) of the (row, key) pairs a row sees; -inf for the others
        for item in range(tid, nrows * BN, NT):
            var r = item // BN
            var j = item % BN
            var sq = (r_lo + r) % s_len
            var kend = min(hi, _last_key(sq, s_len, L, causal) + 1)
            var sc = _NEG_INF
            if kbase + j < kend:
                var accv = SIMD[_F32, KW](0)
                for d in range(0, D, KW):
                    var kk = ks.unsafe_load[width=KW, alignment=4](j * LD + d).cast[_F32]()
                    var qq = qs.unsafe_load[width=KW, alignment=4](r * D + d)
                    accv += qq * kk
                sc = accv.reduce_add() * scale2
            ps[unsafe_offset=r * BN + j] = sc
        barrier()

        # ---- online softmax, one warp per row: p = 2^(s - m_new) in place, rescale factor alpha
        var wid = tid // WARP_SIZE
        var lane = tid % WARP_SIZE
        for r in range(wid, nrows, NWARP):
            var mx = _NEG_INF
            for j in range(lane, BN, WARP_SIZE):
                mx = _nmax(mx, ps[unsafe_offset=r * BN + j])
            mx = _warp_nmax(mx)
            var m_old = m_s[unsafe_offset=r]
            var m_new = _nmax(m_old, mx)
            # a row with nothing visible yet keeps -inf: use 0 there so masked scores give 2^-inf = 0
            var mref = m_new if m_new > _NEG_INF else Float32(0)
            var lsum: Float32 = 0
            for j in range(lane, BN, WARP_SIZE):
                var p = exp2(ps[unsafe_offset=r * BN + j] - mref)
                ps[unsafe_offset=r * BN + j] = p
                lsum += p
            lsum = warp.sum(lsum)
            if lane == 0:
                var alpha = exp2(m_old - mref)
                m_s[unsafe_offset=r] = m_new
                l_s[unsafe_offset=r] = l_s[unsafe_offset=r] * alpha + lsum
                a_s[unsafe_offset=r] = alpha
        barrier()

        # ---- O += P V over the keys each row sees (a masked key's V is never multiplied, even by 0)
        comptime for i in range(RPT):
            var r = rl + RL * i
            if r < nrows:
                var a = acc[i] * a_s[unsafe_offset=r]
                var jend = min(BN, Int(vend[i]) - kbase)
                for j in range(jend):
                    a += ps[unsafe_offset=r * BN + j] * vs[unsafe_offset=j * LD + dcol].cast[_F32]()
                acc[i] = a
        barrier()  # the tiles and P are refilled next iteration
        kbase += BN

    # ---- finish: this block's rows
    comptime for i in range(RPT):
        var r = rl + RL * i
        if r < nrows:
            var grow = row0 + r
            var sees = Int(vend[i]) > lo  # this chunk holds a key row r sees
            var m = m_s[unsafe_offset=r]
            var l = l_s[unsafe_offset=r]
            if n_split == 1:  # the answer itself (lo = 0, hi = L: sees = the row sees any key)
                var inv: Float32 = 0
                var lrow = _NEG_INF
                if sees:
                    if _nonfinite(m):  # NaN or +-inf: the float64 softmax is NaN, lse = m
                        inv = m * 0
                        lrow = m * _LN2
                    else:
                        inv = 1.0 / l
                        lrow = (m + log2(l)) * _LN2
                o[unsafe_offset=grow * D + dcol] = (acc[i] * inv).cast[dtype]()
                if dcol == 0:
                    lse[unsafe_offset=grow] = lrow
            else:  # partials: o [rows * splits, D] then lse [rows * splits] (log2 domain)
                var val: Float32 = 0
                var lp = _NEG_INF
                if sees:
                    if m != m or m > 0 and _nonfinite(m):  # NaN or +inf
                        val = acc[i] * (m * 0)
                        lp = m
                    elif _nonfinite(m):  # every visible score -inf: weight 0, keeps a 0 * NaN of V
                        val = acc[i]
                    else:
                        val = acc[i] / l
                        lp = m + log2(l)
                var prow = grow * n_split + sp
                part[unsafe_offset=prow * D + dcol] = val
                if dcol == 0:
                    part[unsafe_offset=Int(plse_off) + prow] = lp


def _decode_combine_kernel[
    dtype: DType, D: Int
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    part: Pointer[Float32, MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    n_rows: Int64,
    H: Int32,
    S: Int32,
    Skv: Int32,
    splits: Int32,
    plse_off: Int64,
):
    """One warp per output row (b, h, s); lanes split the head dim; splits summed in order."""
    comptime WPB = 4
    var lane = lane_id()
    var row = block_idx.x * WPB + thread_idx.x // WARP_SIZE
    if row >= Int(n_rows):
        return
    var s_len = Int(S)
    var n_split = Int(splits)
    var b = row // (Int(H) * s_len)
    var sq = row % s_len
    var causal = params[unsafe_offset=0] != 0
    var L = _seq_len(kv_len, params[unsafe_offset=2] != 0, b, Int(Skv))
    var sees = _last_key(sq, s_len, L, causal) >= 0
    var base = row * n_split
    var plse = part.unsafe_offset(Int(plse_off))
    var M = _NEG_INF
    for i in range(n_split):
        M = _nmax(M, plse[unsafe_offset=base + i])
    var lrow = _NEG_INF
    var finite_m = not _nonfinite(M)
    var wsum: Float32 = 0
    if sees and finite_m:
        for i in range(n_split):
            wsum += exp2(plse[unsafe_offset=base + i] - M)
        lrow = (M + log2(wsum)) * _LN2
    elif sees:  # NaN, +inf, or every visible score -inf: o NaN, lse M
        lrow = M * _LN2
    for d in range(lane, D, WARP_SIZE):
        var val: Float32 = 0
        if sees and finite_m:
            var a: Float32 = 0
            for i in range(n_split):
                a += exp2(plse[unsafe_offset=base + i] - M) * part[unsafe_offset=(base + i) * D + d]
            val = a / wsum
        elif sees:
            val = M * 0
        o[unsafe_offset=row * D + d] = val.cast[dtype]()
    if lane == 0:
        lse[unsafe_offset=row] = lrow


def decode_part_len(B: Int, H: Int, S: Int, D: Int, splits: Int) -> Int:
    """Workspace elements the partials need: B*H*S * splits * (D + 1) fp32 (none with one split)."""
    return 0 if splits <= 1 else B * H * S * splits * (D + 1)


def attention_decode_gpu[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    part: Pointer[Float32, MutAnyOrigin],
    part_len: Int,
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
    ctx: DeviceContext,
    force_splits: Int = 0,
) raises:
    """Enqueue the split-KV decode kernels (the caller checked decode_applies). force_splits > 0 forces the
    split count (harness), within the workspace given."""
    if B * H * S == 0:
        return
    var sms = ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
    var plan = decode_plan(B, H, Hkv, S, Skv, D, size_of[dtype](), sms)
    var row_blocks = plan[0]
    var rpp = plan[1]
    var splits = plan[2]
    if force_splits > 0:
        splits = force_splits
    var n = B * H * S * splits
    if splits > 1:
        check_workspace("fusekit.attention", "part", part_len, decode_part_len(B, H, S, D, splits))
    var vec = Int32(1) if Int(k) % 16 == 0 and Int(v) % 16 == 0 else Int32(0)
    var plse_off = Int64(n * D if splits > 1 else 0)  # the lse partials follow the o partials

    @always_inline
    def launch[HD: Int]() raises {var}:
        ctx.enqueue_function[_decode_split_kernel[dtype, HD]](
            o, lse, part, q, k, v, kv_len, params, Int32(H), Int32(Hkv), Int32(S), Int32(Skv), Int32(row_blocks),
            Int32(rpp), Int32(splits), plse_off, vec, grid_dim=(B * Hkv * row_blocks, splits), block_dim=DECODE_THREADS,
        )
        if splits > 1:
            ctx.enqueue_function[_decode_combine_kernel[dtype, HD]](
                o, lse, part, kv_len, params, Int64(B * H * S), Int32(H), Int32(S), Int32(Skv), Int32(splits), plse_off,
                grid_dim=ceildiv(B * H * S, 4), block_dim=4 * WARP_SIZE,
            )

    if D == 64:
        launch[64]()
    elif D == 128:
        launch[128]()
    elif D == 256:
        launch[256]()
    else:
        raise Error("fusekit.attention: the decode path takes head dims 64 / 128 / 256")
