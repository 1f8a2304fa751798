# fusekit.attention_backward on NVIDIA tensor cores (fp16 / bf16, head dims 64 / 128 / 256): the
# FlashAttention-2 backward from the forward's saved lse, deterministic (fixed loop orders, no atomics),
# laid out as kernels_triton/attention_backward.py. mojo/attention.mojo launches it when the backward's
# params carry the 4th slot `bwd_tc` (the default; FUSEKIT_MOJO_ATTN_BWD_TC=0 on the Python side drops
# it); the SIMT kernels there are the path for fp32, AMD and anything not covered here.
#
# With s = scale q k^T (visible keys only), p = exp(s - lse), delta = rowsum(do * o) (the SIMT delta
# kernel in attention.mojo, one fp32 per query row):
#     dv = p^T do,  dp = do v^T,  ds = p (dp - delta),  dq = scale ds k,  dk = scale ds^T q
# and under GQA each kv head's dk / dv sums its H / Hkv query heads, in a loop inside one CTA.
#
# Two kernels, both mma.sync m16n8k16 (fp32 accumulation) with the forward's fragment conventions
# (`_fa2_kernel`: A fragments 16 x 16 row-major, B fragments from ldmatrix x4, .trans where the smem
# tile is [k][n]); operands go global -> shared with cp.async, the streamed tiles double-buffered; smem
# rows are padded by 8 halves (ldmatrix rows in distinct bank groups).
# - `_bwd_dkdv_tc_kernel`, grid (ceil(Skv / BN), B * Hkv): K and V of BN keys stay in shared memory; the
#   CTA walks the GQA group's heads h and, per head, the query blocks of BM rows that can see any of its
#   keys (causal: from row max(0, n0 - (L_b - S)) on), in that fixed order. Computed transposed (keys as
#   MMA rows) so dK / dV accumulate as [16 keys, D] per warp without transposing a product:
#   S^T = K Q^T, P^T = exp2(S^T * scale*log2e - lse*log2e), dV += P^T dO, dP^T = V dO^T,
#   dS^T = P^T (dP^T - delta), dK += dS^T Q. P^T and dS^T go from the accumulators straight into A
#   fragments (rounded to the input dtype, as FlashAttention does), no shared memory round trip.
#   At D 256 two warps share 16 keys (DSPLIT = 2): both compute the full S^T and dP^T (K / V contraction
#   over all of D), each accumulates half of dK / dV's columns: 2 x 16 x 256 fp32 accumulators per warp
#   would not fit the 255-register cap.
# - `_bwd_dq_tc_kernel`, grid (ceil(S / BM), B * H), heaviest (causal) blocks first: Q and dO of BM rows
#   stay in shared memory (16 rows per warp), K / V tiles of BN keys stream through; S = Q K^T,
#   dP = dO V^T, dS = P (dP - delta), dQ += dS K. 7 matmuls in all instead of FlashAttention-2's 5: its
#   dQ is an fp32 atomic sum from the dK/dV program, whose order (hence bits) varies run to run.
#
# Masking: only tiles that cross L_b, S or the causal diagonal are masked, with a select (p = ds = 0), never
# a multiply: a masked score may be NaN / inf (a garbage key) and 0 * NaN = NaN. Rows past S and keys past
# L_b are loaded clamped to the last valid row (finite data, masked), so a KV cache's tail past kv_len is
# never read; dk / dv of keys past L_b are written 0. Rows with no visible key (lse = -inf) are masked in
# every tile they touch (they see no key by the same index test), so they contribute nothing.
# Non-finite values inside the valid ranges (hostile inputs; the conformance suite has none there) follow
# the Triton backend's rule, not the SIMT kernels' stricter one: a NaN / inf in q, k, v or do reaches the
# gradients it touches as in float64 autograd, and also the gradients of entries in the same tile that do
# not see it through the MMA's 0 * NaN (dS = 0 there): a NaN in q row i reaches dk of every key of the
# dK/dV tiles row i is in, a NaN in a (causally) masked key's k reaches the dq rows of its diagonal tile.
# float64 autograd of s = q k^T does the same (its matmuls multiply the 0 gradients by the NaN too).
#
# Tiles (4 warps = 128 threads each; registers = fp32 accumulators per thread, before fragments/addresses):
#   dK/dV  D    BN keys  BM rows/step  DSPLIT   acc regs (dK + dV + S^T + dP^T)   smem (K, V + 2 stages Q, dO)
#          64   64       32            1        32 + 32 + 16 + 16                 2*64*72*2 + 2*2*32*72*2   = 36 KB
#          128  64       32            1        64 + 64 + 16 + 16                 2*64*136*2 + 2*2*32*136*2 = 68 KB
#          256  32       32            2        64 + 64 + 16 + 16                 2*32*264*2 + 2*2*32*264*2 = 99 KB
#   dQ     D    BM rows  BN keys/step           acc regs (dQ + S + dP)            smem (Q, dO + 2 stages K, V)
#          64   64       64                     32 + 32 + 32                      2*64*72*2 + 2*2*64*72*2   = 54 KB
#          128  64       32                     64 + 16 + 16                      2*64*136*2 + 2*2*32*136*2 = 68 KB
#          256  64       32                     128 + 16 + 16                     2*64*264*2 + 2*2*32*264*2 = 132 KB
# ptxas -v (sm_90a, CUDA 13.0, on the PTX that `python -m fusekit.aot_mojo --only attention --work DIR` emits;
# bf16 and fp16 alike): dK/dV D64 238 registers / no spill, D128 255 / 16 B spilled, D256 255 / 8 B;
# dQ D64 196 / none, D128 182 / none, D256 255 / 36 B. (64 query rows per dK/dV step at D64 and 64 keys per
# dQ step at D128 spilled 52 B and 156 B: hence 32.)
# mojo/harness/run_attention.mojo (`FUSEKIT_HARNESS_ONLY=attn_bwd_tc`) checks it against the SIMT backward
# and a float64 host reference and times both. H100 (HEAD 35afcc5): 60 cases (bf16/fp16, D 64/128/256,
# causal or not, GQA, kv_len, S 21..2048) all within tolerance; B1 H32/8 S2048 bf16: D128 causal 1.17 ms
# (73 TFLOP/s, SIMT 29.9 ms), D128 full 1.38 ms (124 TFLOP/s, SIMT 66.6 ms), D64 causal 0.68 ms.

from std.math import ceildiv, exp2
from std.utils import StaticTuple
from max.gpu import thread_idx, block_idx, barrier, external_memory, AddressSpace
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.compute.mma import mma, ld_matrix
from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group

comptime _LOG2E: Float32 = 1.4426950408889634


@always_inline
def _bwd_lse2(lse: Float32) -> Float32:
    """lse * log2(e), what p = exp2(s * scale * log2(e) - it) subtracts; +inf for a row whose lse is -inf
    (every visible score -inf, or no visible key), so p = 0 there: the forward's zero row, the reference's
    rule (exp2(-inf - -inf) would be NaN). A NaN lse stays NaN."""
    var l2 = lse * _LOG2E
    return -l2 if l2 == Float32.MIN else l2


@always_inline
def _kv_count(kv_len: Pointer[Int32, MutAnyOrigin], has_len: Bool, b: Int, skv: Int) -> Int:
    """L_b as attention.mojo's `_seq_len`: kv_len[b] clamped to [0, Skv] (untrusted), or Skv."""
    if not has_len:
        return skv
    return min(max(Int(kv_len[unsafe_offset=b]), 0), skv)


# (BN keys, BM rows per step, DSPLIT) of the dK/dV kernel and (BM rows, BN keys per step) of the dQ kernel
@always_inline
def dkdv_bn(d: Int) -> Int:
    return 32 if d == 256 else 64


@always_inline
def dkdv_bm(d: Int) -> Int:
    return 32


@always_inline
def dkdv_dsplit(d: Int) -> Int:
    return 2 if d == 256 else 1


@always_inline
def dq_bm(d: Int) -> Int:
    return 64


@always_inline
def dq_bn(d: Int) -> Int:
    return 64 if d == 64 else 32


def _bwd_dkdv_tc_kernel[
    dtype: DType, D: Int, BN: Int, BM: Int, DSPLIT: Int
](
    dk: Pointer[Scalar[dtype], MutAnyOrigin],
    dv: Pointer[Scalar[dtype], MutAnyOrigin],
    do_: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    delta: Pointer[Float32, MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
):
    comptime NW = (BN // 16) * DSPLIT
    comptime NT = NW * 32
    comptime LD = D + 8
    comptime DW = D // DSPLIT  # dK / dV columns per warp
    comptime NKC = D // 16  # k-chunks of S^T = K Q^T and dP^T = V dO^T
    comptime NSN = BM // 8  # n-tiles (query columns) of S^T
    comptime NPC = BM // 16  # k-chunks (query rows) of dV += P^T dO
    comptime NON = DW // 8  # n-tiles of this warp's dK / dV columns
    comptime KV_SZ = BN * LD
    comptime STAGE = 2 * BM * LD  # Q tile then dO tile
    comptime KV_CHUNKS = BN * D // 8  # 16-byte chunks per K (or V) tile
    comptime Q_CHUNKS = BM * D // 8

    var smem = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16]()
    var tid = thread_idx.x
    var lane = tid % 32
    var wid = tid // 32
    var kw = wid // DSPLIT  # this warp's 16 keys
    var dw = wid % DSPLIT  # and its slice of dK / dV columns
    var g = lane // 4
    var t4 = lane % 4
    var mi = lane // 8
    var rr = lane % 8

    var s_len = Int(S)
    var skv = Int(Skv)
    var n0 = block_idx.x * BN
    var bhk = block_idx.y
    var b = bhk // Int(Hkv)
    var hk = bhk % Int(Hkv)
    var group = Int(H) // Int(Hkv)
    var causal = params[unsafe_offset=0] != 0
    var scale = params[unsafe_offset=1]
    var scale2 = scale * _LOG2E
    var kvl = _kv_count(kv_len, params[unsafe_offset=2] != 0, b, skv)
    var off = kvl - s_len
    var kv_base = (bhk * skv) * D

    if n0 >= kvl:  # every key of the block is past L_b: zero gradients, nothing read
        for c in range(tid, BN * D // 2, NT):
            var r = c // (D // 2)
            if n0 + r < skv:
                var idx = kv_base + (n0 + r) * D + (c % (D // 2)) * 2
                dk.unsafe_store[width=2, alignment=4](idx, SIMD[dtype, 2](0))
                dv.unsafe_store[width=2, alignment=4](idx, SIMD[dtype, 2](0))
        return

    # query rows that can see a key of this block: causal, from the row that sees key n0 on
    var i_lo = max(0, n0 - off) if causal else 0
    var m_first = (i_lo // BM) * BM
    var n_mblk = ceildiv(s_len - m_first, BM) if i_lo < s_len else 0
    var steps = group * n_mblk

    var kg = k.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var qg = q.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var dog = do_.unsafe_address_space_cast[AddressSpace.GLOBAL]()

    # K and V of this block (rows past L_b clamped to the last key: finite, masked)
    comptime for i in range(ceildiv(KV_CHUNKS, NT)):
        var c = tid + i * NT
        if c < KV_CHUNKS:
            var r = c // (D // 8)
            var col = (c % (D // 8)) * 8
            var src = kv_base + min(n0 + r, kvl - 1) * D + col
            async_copy[16](kg.unsafe_offset(src), smem.unsafe_offset(r * LD + col))
            async_copy[16](vg.unsafe_offset(src), smem.unsafe_offset(KV_SZ + r * LD + col))
    async_copy_commit_group()

    @always_inline
    def load_q(t: Int, stage: Int) {var}:
        var h = hk * group + t // n_mblk
        var m0 = m_first + (t % n_mblk) * BM
        var q_base = ((b * Int(H) + h) * s_len) * D
        comptime for i in range(ceildiv(Q_CHUNKS, NT)):
            var c = tid + i * NT
            if c < Q_CHUNKS:
                var r = c // (D // 8)
                var col = (c % (D // 8)) * 8
                var src = q_base + min(m0 + r, s_len - 1) * D + col  # rows past S: clamped, masked
                var dst = 2 * KV_SZ + stage * STAGE + r * LD + col
                async_copy[16](qg.unsafe_offset(src), smem.unsafe_offset(dst))
                async_copy[16](dog.unsafe_offset(src), smem.unsafe_offset(dst + BM * LD))
        async_copy_commit_group()

    if steps > 0:
        load_q(0, 0)

    var dka = StaticTuple[SIMD[DType.float32, 4], NON](fill=0)
    var dva = StaticTuple[SIMD[DType.float32, 4], NON](fill=0)
    var ks = smem
    var vs = smem.unsafe_offset(KV_SZ)
    var key0 = n0 + kw * 16 + g  # this thread's two keys: key0, key0 + 8

    for t in range(steps):
        var stage = t % 2
        if t + 1 < steps:
            load_q(t + 1, 1 - stage)
            async_copy_wait_group(1)
        else:
            async_copy_wait_group(0)
        barrier()

        var h = hk * group + t // n_mblk
        var m0 = m_first + (t % n_mblk) * BM
        var bh = b * Int(H) + h
        var qs = smem.unsafe_offset(2 * KV_SZ + stage * STAGE)
        var dos = qs.unsafe_offset(BM * LD)

        # ---- S^T = K Q^T and dP^T = V dO^T (16 keys x BM rows per warp, contraction over all of D)
        var sacc = StaticTuple[SIMD[DType.float32, 4], NSN](fill=0)
        var pacc = StaticTuple[SIMD[DType.float32, 4], NSN](fill=0)
        comptime for kc in range(NKC):
            # A (x4): m0 = keys 0-7 / d 0-7, m1 = keys 8-15 / d 0-7, m2, m3 = the same at d 8-15
            var arow = kw * 16 + (mi % 2) * 8 + rr
            var acol = 16 * kc + (mi // 2) * 8
            var ka = ld_matrix[8](ks.unsafe_offset(arow * LD + acol))
            var va = ld_matrix[8](vs.unsafe_offset(arow * LD + acol))
            comptime for jn in range(0, NSN, 2):
                # B (x4): m0 = rows 8jn.. / d 16kc.., m1 = d 16kc+8.., m2 / m3 for n-tile jn+1
                var brow = 8 * jn + (mi // 2) * 8 + rr
                var bcol = 16 * kc + (mi % 2) * 8
                var qb = ld_matrix[8](qs.unsafe_offset(brow * LD + bcol))
                var db = ld_matrix[8](dos.unsafe_offset(brow * LD + bcol))
                mma(sacc[jn], ka, qb.slice[4, offset=0](), sacc[jn])
                mma(sacc[jn + 1], ka, qb.slice[4, offset=4](), sacc[jn + 1])
                mma(pacc[jn], va, db.slice[4, offset=0](), pacc[jn])
                mma(pacc[jn + 1], va, db.slice[4, offset=4](), pacc[jn + 1])

        # ---- P^T, dS^T; masked (key past L_b, row past S, causal j > i + off) -> 0 by select
        var need_mask = n0 + BN > kvl or m0 + BM > s_len or (causal and n0 + kw * 16 + 15 > m0 + off)
        var pf = StaticTuple[SIMD[dtype, 8], NPC](fill=0)
        var sf = StaticTuple[SIMD[dtype, 8], NPC](fill=0)
        comptime for jn in range(NSN):
            var p4 = SIMD[DType.float32, 4](0)
            var s4 = SIMD[DType.float32, 4](0)
            comptime for c in range(2):
                var qi = m0 + 8 * jn + 2 * t4 + c
                var qrow = bh * s_len + min(qi, s_len - 1)
                var lse2 = _bwd_lse2(lse[unsafe_offset=qrow])
                var dl = delta[unsafe_offset=qrow]
                comptime for hh in range(2):
                    comptime e = 2 * hh + c
                    var p = exp2(sacc[jn][e] * scale2 - lse2)
                    var ds = p * (pacc[jn][e] - dl)
                    if need_mask:
                        var key = key0 + 8 * hh
                        var seen = key < kvl and qi < s_len and (not causal or key <= qi + off)
                        if not seen:
                            p = 0
                            ds = 0
                    p4[e] = p
                    s4[e] = ds
            var pc = p4.cast[dtype]()
            var sc = s4.cast[dtype]()
            comptime for e in range(4):
                pf[jn // 2][(jn % 2) * 4 + e] = pc[e]
                sf[jn // 2][(jn % 2) * 4 + e] = sc[e]

        # ---- dV += P^T dO, dK += dS^T Q (this warp's DW columns; k = query rows)
        comptime for kc in range(NPC):
            comptime for jo in range(0, NON, 2):
                # B (x4.trans) from [row][d]: m0 = rows 16kc.. / d 8jo.., m1 = rows 16kc+8.., m2 / m3 for jo+1
                var brow = 16 * kc + (mi % 2) * 8 + rr
                var bcol = dw * DW + 8 * jo + (mi // 2) * 8
                var db = ld_matrix[8, transpose=True](dos.unsafe_offset(brow * LD + bcol))
                var qb = ld_matrix[8, transpose=True](qs.unsafe_offset(brow * LD + bcol))
                mma(dva[jo], pf[kc], db.slice[4, offset=0](), dva[jo])
                mma(dva[jo + 1], pf[kc], db.slice[4, offset=4](), dva[jo + 1])
                mma(dka[jo], sf[kc], qb.slice[4, offset=0](), dka[jo])
                mma(dka[jo + 1], sf[kc], qb.slice[4, offset=4](), dka[jo + 1])

        barrier()  # this stage is refilled next step
    async_copy_wait_group(0)  # no copy left in flight at exit (steps = 0: K / V were never waited on)

    # ---- store: dk = scale * sum, dv = sum; keys past L_b get 0, keys past Skv are not ours
    comptime for hh in range(2):
        var key = key0 + 8 * hh
        if key < skv:
            var live = key < kvl
            comptime for jo in range(NON):
                var idx = kv_base + key * D + dw * DW + 8 * jo + 2 * t4
                var dkv = SIMD[DType.float32, 2](dka[jo][2 * hh], dka[jo][2 * hh + 1]) * scale
                var dvv = SIMD[DType.float32, 2](dva[jo][2 * hh], dva[jo][2 * hh + 1])
                if not live:
                    dkv = 0
                    dvv = 0
                dk.unsafe_store[width=2, alignment=4](idx, dkv.cast[dtype]())
                dv.unsafe_store[width=2, alignment=4](idx, dvv.cast[dtype]())


def _bwd_dq_tc_kernel[
    dtype: DType, D: Int, BM: Int, BN: Int
](
    dq: Pointer[Scalar[dtype], MutAnyOrigin],
    do_: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    delta: Pointer[Float32, MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
):
    comptime NW = BM // 16
    comptime NT = NW * 32
    comptime LD = D + 8
    comptime NKC = D // 16  # k-chunks of S = Q K^T and dP = dO V^T
    comptime NSN = BN // 8  # n-tiles (keys) of S
    comptime NPC = BN // 16  # k-chunks (keys) of dQ += dS K
    comptime NON = D // 8  # n-tiles of dQ
    comptime Q_SZ = BM * LD
    comptime STAGE = 2 * BN * LD  # K tile then V tile
    comptime KV_CHUNKS = BN * D // 8
    comptime Q_CHUNKS = BM * D // 8

    var smem = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16]()
    var tid = thread_idx.x
    var lane = tid % 32
    var wid = tid // 32
    var g = lane // 4
    var t4 = lane % 4
    var mi = lane // 8
    var rr = lane % 8

    var s_len = Int(S)
    var skv = Int(Skv)
    var n_mblk = ceildiv(s_len, BM)
    var mblk = n_mblk - 1 - block_idx.x  # heaviest (causal) blocks first
    var bh = block_idx.y
    var b = bh // Int(H)
    var h = bh % Int(H)
    var hk = h // (Int(H) // Int(Hkv))
    var m0 = mblk * BM
    var causal = params[unsafe_offset=0] != 0
    var scale = params[unsafe_offset=1]
    var scale2 = scale * _LOG2E
    var kvl = _kv_count(kv_len, params[unsafe_offset=2] != 0, b, skv)
    var off = kvl - s_len
    var q_base = (bh * s_len) * D
    var kv_base = ((b * Int(Hkv) + hk) * skv) * D

    var kv_end = kvl
    if causal:
        kv_end = min(kvl, m0 + BM + off)
    var n_tiles = ceildiv(kv_end, BN) if kv_end > 0 else 0

    var kg = k.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var qg = q.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var dog = do_.unsafe_address_space_cast[AddressSpace.GLOBAL]()

    # Q and dO of this block (rows past S clamped to the last row: finite, masked)
    comptime for i in range(ceildiv(Q_CHUNKS, NT)):
        var c = tid + i * NT
        if c < Q_CHUNKS:
            var r = c // (D // 8)
            var col = (c % (D // 8)) * 8
            var src = q_base + min(m0 + r, s_len - 1) * D + col
            async_copy[16](qg.unsafe_offset(src), smem.unsafe_offset(r * LD + col))
            async_copy[16](dog.unsafe_offset(src), smem.unsafe_offset(Q_SZ + r * LD + col))
    async_copy_commit_group()

    @always_inline
    def load_tile(tile: Int, stage: Int) {var}:
        var kbase = tile * BN
        comptime for i in range(ceildiv(KV_CHUNKS, NT)):
            var c = tid + i * NT
            if c < KV_CHUNKS:
                var r = c // (D // 8)
                var col = (c % (D // 8)) * 8
                var src = kv_base + min(kbase + r, kvl - 1) * D + col  # keys past L_b: clamped, masked
                var dst = 2 * Q_SZ + stage * STAGE + r * LD + col
                async_copy[16](kg.unsafe_offset(src), smem.unsafe_offset(dst))
                async_copy[16](vg.unsafe_offset(src), smem.unsafe_offset(dst + BN * LD))
        async_copy_commit_group()

    if n_tiles > 0:
        load_tile(0, 0)

    var row0 = m0 + wid * 16 + g  # this thread's two rows: row0, row0 + 8
    var lse2 = SIMD[DType.float32, 2](0)
    var dl = SIMD[DType.float32, 2](0)
    comptime for hh in range(2):
        var r = bh * s_len + min(row0 + 8 * hh, s_len - 1)
        lse2[hh] = _bwd_lse2(lse[unsafe_offset=r])
        dl[hh] = delta[unsafe_offset=r]

    var dqa = StaticTuple[SIMD[DType.float32, 4], NON](fill=0)
    var qs = smem
    var dos = smem.unsafe_offset(Q_SZ)

    for it in range(n_tiles):
        var stage = it % 2
        if it + 1 < n_tiles:
            load_tile(it + 1, 1 - stage)
            async_copy_wait_group(1)
        else:
            async_copy_wait_group(0)
        barrier()

        var ks = smem.unsafe_offset(2 * Q_SZ + stage * STAGE)
        var vs = ks.unsafe_offset(BN * LD)
        var kbase = it * BN

        # ---- S = Q K^T and dP = dO V^T (16 rows x BN keys per warp)
        var sacc = StaticTuple[SIMD[DType.float32, 4], NSN](fill=0)
        var pacc = StaticTuple[SIMD[DType.float32, 4], NSN](fill=0)
        comptime for kc in range(NKC):
            var arow = wid * 16 + (mi % 2) * 8 + rr
            var acol = 16 * kc + (mi // 2) * 8
            var qa = ld_matrix[8](qs.unsafe_offset(arow * LD + acol))
            var da = ld_matrix[8](dos.unsafe_offset(arow * LD + acol))
            comptime for jn in range(0, NSN, 2):
                var brow = 8 * jn + (mi // 2) * 8 + rr
                var bcol = 16 * kc + (mi % 2) * 8
                var kb = ld_matrix[8](ks.unsafe_offset(brow * LD + bcol))
                var vb = ld_matrix[8](vs.unsafe_offset(brow * LD + bcol))
                mma(sacc[jn], qa, kb.slice[4, offset=0](), sacc[jn])
                mma(sacc[jn + 1], qa, kb.slice[4, offset=4](), sacc[jn + 1])
                mma(pacc[jn], da, vb.slice[4, offset=0](), pacc[jn])
                mma(pacc[jn + 1], da, vb.slice[4, offset=4](), pacc[jn + 1])

        # ---- dS = P (dP - delta); masked -> 0 by select
        var need_mask = kbase + BN > kvl or m0 + wid * 16 + 16 > s_len or (
            causal and kbase + BN - 1 > m0 + wid * 16 + off
        )
        var sf = StaticTuple[SIMD[dtype, 8], NPC](fill=0)
        comptime for jn in range(NSN):
            var s4 = SIMD[DType.float32, 4](0)
            comptime for e in range(4):
                var p = exp2(sacc[jn][e] * scale2 - lse2[e // 2])
                var ds = p * (pacc[jn][e] - dl[e // 2])
                if need_mask:
                    var key = kbase + 8 * jn + 2 * t4 + (e % 2)
                    var qi = row0 + 8 * (e // 2)
                    var seen = key < kvl and qi < s_len and (not causal or key <= qi + off)
                    if not seen:
                        ds = 0
                s4[e] = ds
            var sc = s4.cast[dtype]()
            comptime for e in range(4):
                sf[jn // 2][(jn % 2) * 4 + e] = sc[e]

        # ---- dQ += dS K (k = keys; K tile is [key][d]: B fragments by ldmatrix .trans)
        comptime for kc in range(NPC):
            comptime for jo in range(0, NON, 2):
                var brow = 16 * kc + (mi % 2) * 8 + rr
                var bcol = 8 * jo + (mi // 2) * 8
                var kb = ld_matrix[8, transpose=True](ks.unsafe_offset(brow * LD + bcol))
                mma(dqa[jo], sf[kc], kb.slice[4, offset=0](), dqa[jo])
                mma(dqa[jo + 1], sf[kc], kb.slice[4, offset=4](), dqa[jo + 1])

        barrier()  # this stage is refilled next iteration
    async_copy_wait_group(0)  # no copy left in flight at exit (no tile: Q / dO were never waited on)

    # ---- store dq = scale * sum (rows with no visible key: 0)
    comptime for hh in range(2):
        var r = row0 + 8 * hh
        if r < s_len:
            comptime for jo in range(NON):
                var val = SIMD[DType.float32, 2](dqa[jo][2 * hh], dqa[jo][2 * hh + 1]) * scale
                dq.unsafe_store[width=2, alignment=4](q_base + r * D + 8 * jo + 2 * t4, val.cast[dtype]())


def tc_backward_supported[dtype: DType](B: Int, H: Int, Hkv: Int, D: Int) -> Bool:
    """Whether `attention_backward_tc` covers this call (NVIDIA, fp16 / bf16, D 64 / 128 / 256, grid axis 1
    within CUDA's 65535 blocks); the SIMT kernels take everything else."""
    comptime if DeviceContext.default_device_info.api == "cuda" and (
        dtype == DType.bfloat16 or dtype == DType.float16
    ):
        return (D == 64 or D == 128 or D == 256) and B * H <= 65535
    return False


def attention_backward_tc[
    dtype: DType, HD: Int = 0
](
    dq: Pointer[Scalar[dtype], MutAnyOrigin],
    dk: Pointer[Scalar[dtype], MutAnyOrigin],
    dv: Pointer[Scalar[dtype], MutAnyOrigin],
    delta: Pointer[Float32, MutAnyOrigin],
    do_: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
    ctx: DeviceContext,
) raises:
    """Launch the dK/dV and dQ tensor-core kernels (delta already computed into `delta`). Call only where
    `tc_backward_supported` holds."""

    @always_inline
    def launch[HD: Int]() raises {var}:
        comptime BN = dkdv_bn(HD)
        comptime BMq = dkdv_bm(HD)
        comptime DS = dkdv_dsplit(HD)
        comptime kv_smem = (2 * BN + 4 * BMq) * (HD + 8) * 2
        if Skv > 0:
            ctx.enqueue_function[_bwd_dkdv_tc_kernel[dtype, HD, BN, BMq, DS]](
                dk, dv, do_, q, k, v, lse, delta, kv_len, params, Int32(H), Int32(Hkv), Int32(S), Int32(Skv),
                grid_dim=(ceildiv(Skv, BN), B * Hkv),
                block_dim=(BN // 16) * DS * 32,
                shared_mem_bytes=kv_smem,
                func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(kv_smem)),
            )
        comptime QM = dq_bm(HD)
        comptime QN = dq_bn(HD)
        comptime q_smem = (2 * QM + 4 * QN) * (HD + 8) * 2
        if S > 0:
            ctx.enqueue_function[_bwd_dq_tc_kernel[dtype, HD, QM, QN]](
                dq, do_, q, k, v, lse, delta, kv_len, params, Int32(H), Int32(Hkv), Int32(S), Int32(Skv),
                grid_dim=(ceildiv(S, QM), B * H),
                block_dim=(QM // 16) * 32,
                shared_mem_bytes=q_smem,
                func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(q_smem)),
            )

    comptime if DeviceContext.default_device_info.api == "cuda" and (
        dtype == DType.bfloat16 or dtype == DType.float16
    ):
        comptime if HD == 0 or HD == 64:
            if D == 64:
                launch[64]()
                return
        comptime if HD == 0 or HD == 128:
            if D == 128:
                launch[128]()
                return
        comptime if HD == 0 or HD == 256:
            if D == 256:
                launch[256]()
                return
    raise Error("fusekit.attention_backward: the tensor-core backward does not cover this call")
