# Split-KV (flash-decoding) forward of fusekit.attention for few queries against a long KV: the GPU path
# `attention_gpu` (attention.mojo) takes for S <= DECODE_MAX_S and a GQA group of at most DECODE_MAX_ROWS rows
# (H/Hkv * S), D in {64, 128, 256}, every dtype (fp16 / bf16 / fp32), both vendors. Four kernels:
#
# 0. `_decode_mma_kernel[WR, WK]` (NVIDIA, fp16 / bf16, D 64 / 128, groups of 2..128 rows, k and v 16-byte
#    aligned): tensor cores (mma.sync m16n8k16). The group's rows are the M side, padded to 16 per row warp
#    (WR = 1 / 2 / 4 / 8 row warps), one block per (b, kv head) x split; K / V tiles of 64 keys go global ->
#    shared with cp.async (two stages), ldmatrix feeds the MMAs, the online softmax runs on the accumulators
#    (FlashAttention-2's forward, _fa2_kernel in attention.mojo, on one chunk of the keys). With few rows a
#    block also has WK key warps (4 warps in all), each taking its own 16+ keys of every tile, their states
#    merged through shared memory in a fixed order at the end. Partials and the combine as below.
#    Why: the register kernel spends ~150 instructions per key and thread at 4 rows and falls behind as the
#    group grows (R = 4 at 60% of SDPA, R = 8 at 41%, the tile kernel at S = 16 4.5x slower than SDPA; H200,
#    2026-12-03). Measured on the H200 (2026-12-03, harness FUSEKIT_HARNESS_ONLY=attn_decode, wall per call,
#    L2 warm, bf16 D128, the SIMT kernels -> this one in the same run, same split count): B1 H32/8 S1 Skv 2K
#    13.6 -> 10.7 us, 8K 26.2 -> 21.4, 32K 64.0 -> 50.2, 128K 193.8 -> 147.4; B32 Skv 2K 116.6 -> 85.7, 8K
#    377.7 -> 274.4, 32K 1425 -> 1053 (4.08 TB/s); GQA 8 (H32/4) B1 32K 62.1 -> 39.2; H64/8 B32 8K 615.5 ->
#    283.8; D64 B32 8K 194.9 -> 145.2; S = 16 B1 8K 481.4 -> 81.5 (all at 4 blocks per SM). Split probes in
#    the same run: one wave of 2 blocks per SM is the fastest count (B1 32K 33 splits 46.2 us against 66:
#    50.0 and 132: 57.5; S = 16 32 splits 45.1 against 64: 76.6; B32 8K 1 split 264.4 against 3: 273.5);
#    a 3-stage ring is no faster than 2 (2 blocks of 206 registers per SM either way). D256 loses (2x the SIMT
#    kernel's time: its O accumulator and Q fragments spill), so D256 keeps the SIMT kernels. ptxas sm_90a
#    (D64 / D128, WR 1..8): 138-255 registers, at most 16 bytes spilled (the 128-MMA kernels: D128 with 4 or 8
#    row warps); one row warp at D128: 206 registers x 128 threads, 2 blocks per SM. At 5bd4a34 (one wave):
#    B1 8K 15.9 us, 32K 45.3, B32 2K 74.0, 8K 264.1 (L2 warm: B1 8K's 34 MB of KV stay in the 60 MB L2).
#    The benchmark (ops.attention, CUDA events, L2 flushed) gives 25.2 / 54.0 / 82.6 / 272.9 us. The
#    replayed torch graph of a mojo call holds exactly this kernel and the combine (node dump on the H200,
#    .dev probe: 2 kernel nodes, 1 edge; no host, copy or event node), so the gap is the cold L2 and the
#    graph launch, not extra work.
#
# 1. `_decode_reg_kernel[R]` (groups of at most DECODE_REG_ROWS = 8 rows: S = 1 decode with GQA <= 8, MHA, small
#    S; R = 1 / 4 / 8 rows compiled), one block of 128 threads per (b, kv head) x split, no shared memory in its
#    key loop. A key row is read by TPK = D*es/16 threads (at most WARP_SIZE), one 16-byte load each per K and
#    V (fp32 D256 on NVIDIA: two), straight into registers; a warp's load instruction covers WARP_SIZE * 16
#    contiguous bytes. A block holds NKS = 128 / TPK key slots, each taking U keys per batch (U = 4: 64 bytes of
#    K and 64 of V per thread; 2 at 8 rows). Each thread keeps q, and the running max m, sum l and unnormalized
#    o of its columns, of every row in registers; a dot product is summed over its key's TPK lanes with xor
#    shuffles (every lane gets the score), so P.V needs no exchange: each thread accumulates p * v of its own
#    columns. The next batch's K and V loads are issued before the current batch's math (register double
#    buffer): 2U 16-byte loads per thread always in flight. At the end the slots' (m, l, o) are merged, in a
#    warp by xor shuffles, across the warps through shared memory, in a fixed order.
# 2. `_decode_split_kernel` (larger groups, up to 128 rows: the compute-heavier case), one block per
#    (b, kv head, row block) x split, SIMT: the rows r = g * S + s of the GQA group (g the query head within the
#    group, s the query; row r is also row r of the group's q / o block), at most _dec_rb(D) of them per block
#    (more rows: further row blocks), attend to one chunk of the sequence's keys, so each K / V tile is read
#    once per row block instead of once per query head. Per tile: K and V go global -> shared (16-byte loads
#    where aligned), scores s = q.k * scale * log2(e) for the (row, key) pairs a row sees, an online softmax per
#    row (NaN-propagating max, exp2), O += P V with each thread owning one head-dim column of 16 rows.
# Both: the sequence's L_b keys are cut into `splits` chunks (per sequence: with kv_len each block of a
# sequence gets an equal share; whole 16-key grains / BN-key tiles). A row only ever touches the keys it sees
# (loop bounds and visibility from indices, not from masked scores), so keys past kv_len are never read and a
# non-finite V of a key that row does not see is never multiplied. With one split the block writes o and lse
# itself; otherwise an fp32 partial (o normalized by its own l, and its log2-domain lse) into the caller's
# workspace `part` [B*H*S * splits * (D + 1)] (specs.py attention_decode_part mirrors `decode_plan`).
# 3. `_decode_combine_kernel`, one block of 256 threads per output row: the max and the weights 2^(lse_i - M)
#    of the splits once (shared memory), then 256 / D threads per column, each summing every (256/D)-th split
#    with 8 independent loads in flight, their sums added in a fixed order: deterministic (bit-identical
#    repeats, no atomics).
#
# Non-finite rules (attention.mojo's header): a partial of a chunk with no visible key is (o 0, lse -inf);
# a chunk whose max is NaN or +inf gives (NaN, max); one whose visible scores are all -inf gives (its sum of
# 0 * v, which is 0 or NaN, -inf); the combine decides "the row sees no key" from indices (o 0, lse -inf),
# an overall max M of NaN or +inf gives o NaN and lse M, M = -inf (every visible score -inf) the reference's
# zero row (o = 0 x the partials, lse -inf), and a NaN / inf o_i of a weight-0 split still reaches o
# (0 * NaN), as a float64 softmax does. The register
# kernel's slot merge is the same rescaling as its per-batch update (weights 2^(m_i - M), M = 0 where every
# m_i is -inf), so a slot's state follows the rules of one sequential pass.
#
# Split count (`decode_plan`, mirrored by specs.py): register kernel: B * Hkv * splits aims at
# DECODE_REG_CTAS_PER_SM = 8 blocks per SM (2 resident at ~210 registers x 128 threads: ~4 waves),
# at least DECODE_REG_MIN_KEYS = 64 keys per split, at most DECODE_MAX_SPLITS; tile kernel: blocks =
# B * Hkv * row_blocks * splits aim at DECODE_CTAS_PER_SM per SM, at least DECODE_MIN_TILES tiles per split.
# The plan uses Skv (the tensor's length), not kv_len (on the device): ragged batches split every sequence
# into the same number of chunks.
#
# Floor: bytes = the KV read, B * Skv * Hkv * D * 2 * es.
# Measured (H100 80 GB HBM3, ~3.0 TB/s copy ceiling; harness FUSEKIT_HARNESS_ONLY=attn_decode, wall per call,
# L2 warm; bf16 H32 / Hkv8 D128 S1), the tile kernel for every decode shape (before the register kernel):
#   B1 Skv2048 splits 32: 40.5 us (207 GB/s); B32 Skv2048 splits 3: 480 us (559 GB/s)
#   B1 Skv8192 splits 66: 103 us (325 GB/s); B32 Skv8192 splits 3: 1827 us (588 GB/s)
#   B1 Skv32768 splits 66: 297 us (452 GB/s); B32 Skv32768 splits 3: 6916 us (621 GB/s)
#   through ops.attention (do_bench, L2 flushed), B32 Skv32768: 6978 us vs the Triton split-KV kernel 1392 us
#   (3084 GB/s) and SDPA 1391; B1 Skv32768 301 vs 98.7 vs 65; B1 Skv2048 44.5 vs 15.4 vs 14.5.
# Why the tile kernel is slow at S = 1 (4 rows): per 32-key tile a block goes through four barrier-separated
# phases with nothing overlapped: (a) the loads: each thread has one K and one V 16-byte load in flight (a
# runtime-bounded loop that stores to shared before the next load), 8 KB per block; (b) the scores: only
# rows * BN = 128 of 256 threads work, each a serial D-long dot product from shared memory (64 dependent
# 4-byte shared loads of K and q plus an FMA chain, ~2-3k cycles of latency per tile); (c) softmax: 4 of 8 warps;
# (d) P.V: every thread walks 32 keys for its rows. Bytes in flight per SM are a few KB for most of a tile's
# time, far below the ~20-40 KB an H100 SM needs to stream at 3 TB/s / 132 SMs. The old combine (one warp per
# row, every lane looping over all splits with a dependent load and exp2 per split and column) was serial
# too: 4 columns x 66 splits per lane at B1, each iteration a full L2 round trip.
# The register kernel instead keeps 2U = 8 16-byte loads (128 B) per thread in flight at all times (128
# threads x 128 B = 16 KB per block; ptxas -v for sm_90a: bf16/fp16 R=4 D128 210-219 registers, so 2 blocks
# per SM: ~32 KB in flight per SM, which at ~1 us loaded latency covers ~40 GB/s per SM, 5 TB/s over 132
# SMs; R=1 ~122 registers (4 blocks), R=8 255 (2 blocks), no spills), has no barrier in the
# key loop, and spends per key and thread (bf16 D128, 4 rows) ~150 instructions (32 + 32 FMA, 16 shuffles,
# the softmax), ~19 issue cycles per key per SM against the ~39 a 3 TB/s stream allows.
# Measured on an H100 80GB (2026-11-27, harness FUSEKIT_HARNESS_ONLY=attn_decode, sm_90 exe of 23475b4 and of
# the previous commit in the same call; wall per call, L2 warm; bf16 H32/Hkv8 D128 S=1): attn_decode checks
# 1680 ok, 0 failures (1/4/8 rows, fp16/bf16/fp32, forced splits and bit-identical repeats, kv_len, causal
# S 2/4, the non-finite patterns). B1 Skv 2K / 8K / 32K: 14.6 / 36.0 / 78.6 us (575 / 932 / 1708 GB/s; the
# previous kernel 39.9 / 103.8 / 293.0); B32: 134 / 421 / 1522 us (2002 / 2550 / 2823 GB/s; previous 478 /
# 1793 / 6921). Also B32 H64/Hkv8 Skv8K 1783 GB/s, MHA B8 H32 Skv8K 2934, D64 2453, D256 2714, fp32 2818.
# The Triton backend's split-KV kernel, through ops.attention earlier the same day: B32 Skv32K 1392 us, B1
# Skv32K 98.7 (do_bench, L2 flushed: not the same timer).

from std.math import ceildiv, exp2, log2
from std.memory import unsafe_stack_allocation
from std.sys import llvm_intrinsic, size_of
from std.utils import StaticTuple
from max.gpu import thread_idx, block_idx, lane_id, barrier, syncwarp, WARP_SIZE, AddressSpace, external_memory
from max.gpu.host import DeviceContext, DeviceAttribute, FuncAttribute
from max.gpu.primitives import warp
from max.gpu.compute.mma import mma, ld_matrix
from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group

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
# the register kernel (`_decode_reg_kernel`, GQA groups of at most DECODE_REG_ROWS rows: S = 1 decode)
comptime DECODE_REG_ROWS = 8  # rows up to which it runs (q and the accumulators of every row in registers)
comptime DECODE_REG_THREADS = 128  # threads per block (a multiple of 32 and of 64)
comptime DECODE_REG_CTAS_PER_SM = 8  # blocks per SM its split count aims at (2-4 resident: 2-4 waves)
comptime DECODE_REG_MIN_KEYS = 64  # keys per split at least
comptime DECODE_COMBINE_THREADS = 256  # threads per block of the combine (one block per output row)
# the tensor-core kernel (`_decode_mma_kernel`, NVIDIA fp16 / bf16, D 64 / 128, groups of 2..128 rows)
comptime DECODE_MMA_MIN_ROWS = 2  # rows from which 2-byte dtypes at D <= 128 take its plan (on NVIDIA the kernel)
comptime DECODE_MMA_MAX_D = 128  # D256: its 128-register O accumulator and Q fragments spill (2x slower than SIMT)
comptime DECODE_MMA_CTAS_PER_SM = 2  # resident blocks per SM (D128: 206 registers): splits fill one wave of them
comptime DECODE_MMA_MIN_TILES = 2  # block tiles (DECODE_MMA_BN keys) per split at least
comptime DECODE_MMA_BN = 64  # keys per block tile (two stages of K and V: 36 KB at D64, 68 KB at D128)


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
    """(row_blocks, rows per block, splits) of a decode call. fp16 / bf16 at D <= 128 with >= 2 rows: the
    tensor-core kernel's count: B * Hkv * splits fills one wave of DECODE_MMA_CTAS_PER_SM blocks per SM without
    passing it (a second wave for a few blocks costs a whole tile walk: as the Triton backend's split model),
    each split at least DECODE_MMA_MIN_TILES tiles; rows and row blocks as the SIMT kernels that run there
    elsewhere want them. Otherwise, up to DECODE_REG_ROWS rows: the register kernel (one row block,
    DECODE_REG_CTAS_PER_SM blocks per SM, at least DECODE_REG_MIN_KEYS keys per split); more: the tile kernel."""
    var rows = (H // Hkv) * S
    if es == 2 and rows >= DECODE_MMA_MIN_ROWS and D <= DECODE_MMA_MAX_D:
        # the tensor-core kernel's split count (one block per (b, kv head) x split). Where that kernel does not
        # run (AMD, unaligned k / v) the SIMT kernels take the same count, so the host's workspace mirror
        # (specs.py) needs no vendor.
        var max_m = max(1, min(DECODE_MAX_SPLITS, ceildiv(Skv, DECODE_MMA_BN) // DECODE_MMA_MIN_TILES))
        var splits_m = max(1, min(max_m, sms * DECODE_MMA_CTAS_PER_SM // max(B * Hkv, 1)))
        if rows <= DECODE_REG_ROWS:
            return (1, rows, splits_m)
        var rb_m = max(1, ceildiv(rows, _dec_rb(D)))
        return (rb_m, max(1, ceildiv(rows, rb_m)), splits_m)
    if rows <= DECODE_REG_ROWS:
        var max_r = max(1, min(DECODE_MAX_SPLITS, Skv // DECODE_REG_MIN_KEYS))
        var groups_r = max(B * Hkv, 1)
        return (1, max(rows, 1), max(1, min(max_r, ceildiv(sms * DECODE_REG_CTAS_PER_SM, groups_r))))
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
def _finish_log2(m: Float32, l: Float32) -> Tuple[Float32, Float32]:
    """(the factor on the row's sums, lse in natural log) of a row that sees a key, from its log2-domain max
    m and sum l: every visible score -inf (m = -inf): 0 and -inf, the reference's zero row; NaN or +inf: the
    float64 softmax is NaN, lse = m (torch.logsumexp); else 1 / l and (m + log2 l) ln 2. Every GPU forward
    epilogue finishes through it (the CPU path's `_finish_row` works in the natural-log domain)."""
    if m == _NEG_INF:
        return (0, _NEG_INF)
    if _nonfinite(m):
        return (m * 0, m * _LN2)
    return (1.0 / l, (m + log2(l)) * _LN2)


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


@always_inline
def _quad_max(v: SIMD[DType.float32, 2]) -> SIMD[DType.float32, 2]:
    """NaN-propagating max over the 4 lanes of a quad (the lanes that share an MMA accumulator row)."""
    var r = v
    comptime for e in range(2):
        r[e] = _nmax(r[e], warp.shuffle_xor(r[e], 1))
        r[e] = _nmax(r[e], warp.shuffle_xor(r[e], 2))
    return r


@always_inline
def _quad_sum(v: SIMD[DType.float32, 2]) -> SIMD[DType.float32, 2]:
    var r = v
    comptime for e in range(2):
        r[e] += warp.shuffle_xor(r[e], 1)
        r[e] += warp.shuffle_xor(r[e], 2)
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

    # alignment 16: the K / V rows are written and the K rows read as 4-byte words (alignment=4 below); the
    # default is the element's (`.shared .align 2` for fp16 / bf16 in the PTX), so those words were aligned
    # only because every shared array of this kernel happens to be a multiple of 4 bytes long
    var ks = unsafe_stack_allocation[BN * LD, dtype, alignment=16, address_space=AddressSpace.SHARED]()
    var vs = unsafe_stack_allocation[BN * LD, dtype, alignment=16, address_space=AddressSpace.SHARED]()
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
            # every lane read m_s[r] above; lane 0 rewrites it: order the warp's reads before that write
            # (the shuffles already do in practice, but only syncwarp does by the memory model; racecheck
            # flagged the pair on the H200)
            syncwarp()
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
            var sees = Int(vend[i]) > lo  # this chunk holds a key row r sees
            _emit[dtype, D](
                o, lse, part, row0 + r, dcol, acc[i], m_s[unsafe_offset=r], l_s[unsafe_offset=r], sees, n_split, sp,
                Int(plse_off),
            )


@always_inline
def _reg_u(R: Int, ept: Int, es: Int) -> Int:
    """Keys per slot per batch of the register kernel: one batch of K (and of V) is at most 64 bytes per thread
    (4 x 16-byte loads, 16 registers; double-buffered: 64 registers for K and V), halved at 8 rows."""
    var u = max(1, min(4, 64 // (ept * es)))
    return max(1, u // 2) if R > 4 else u


@always_inline
def _ld_kv[
    dtype: DType, D: Int, N: Int, EPT: Int, TPK: Int, NKS: Int
](
    p: Pointer[Scalar[dtype], MutAnyOrigin], base: Int, kb: Int, hi: Int, slot: Int, tl: Int, aligned: Bool
) -> SIMD[dtype, N * EPT]:
    """The thread's columns of the N keys kb + u * NKS + slot (u < N) of one operand, 16-byte loads; keys at or
    past hi are not read (zeros)."""
    comptime VW = 16 // size_of[dtype]()
    comptime NV = EPT // VW
    var res = SIMD[dtype, N * EPT](0)
    var pg = p.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    comptime for u in range(N):
        var key = kb + u * NKS + slot
        if key < hi:
            comptime for j in range(NV):
                var src = base + key * D + (j * TPK + tl) * VW
                if aligned:
                    res = res.insert[offset = (u * NV + j) * VW](pg.unsafe_load[width=VW, alignment=16](src))
                else:
                    comptime for e in range(VW):
                        res[(u * NV + j) * VW + e] = p[unsafe_offset=src + e]
    return res


@always_inline
def _emit[
    dtype: DType, D: Int
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    part: Pointer[Float32, MutAnyOrigin],
    grow: Int,
    d: Int,
    a: Float32,
    m: Float32,
    l: Float32,
    sees: Bool,
    n_split: Int,
    sp: Int,
    plse_off: Int,
):
    """Column d of row grow from its (unnormalized o, max m, sum l) over the block's keys: the answer with one
    split (lo = 0, hi = L: `sees` = the row sees any key), else the partial, o [rows * splits, D] then lse
    [rows * splits] in the log2 domain (the header's non-finite rules). Both split kernels finish through it."""
    if n_split == 1:
        var inv: Float32 = 0
        var lrow = _NEG_INF
        if sees:
            var f = _finish_log2(m, l)
            inv = f[0]
            lrow = f[1]
        o[unsafe_offset=grow * D + d] = (a * inv).cast[dtype]()
        if d == 0:
            lse[unsafe_offset=grow] = lrow
    else:
        var val: Float32 = 0
        var lp = _NEG_INF
        if sees:
            if m != m or m > 0 and _nonfinite(m):  # NaN or +inf
                val = a * (m * 0)
                lp = m
            elif _nonfinite(m):  # every visible score -inf: weight 0, keeps a 0 * NaN of V
                val = a
            else:
                val = a / l
                lp = m + log2(l)
        var prow = grow * n_split + sp
        part[unsafe_offset=prow * D + d] = val
        if d == 0:
            part[unsafe_offset=plse_off + prow] = lp


def _decode_reg_kernel[
    dtype: DType, D: Int, R: Int
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
    splits: Int32,
    plse_off: Int64,
    vec: Int32,
):
    """One block per (b, kv head) x split for a GQA group of at most R rows (R in 1 / 4 / 8): no shared memory
    in the key loop. A key is read by TPK threads (16 bytes each, EPT = D / TPK columns: K and V rows land in
    registers straight from global memory, coalesced: a warp reads WARP_SIZE * 16 contiguous bytes); a block
    holds NKS = threads / TPK such key slots, each taking U keys per batch. Every thread keeps q, the running max
    m, sum l and unnormalized o of its columns for all R rows in registers; dot products are summed over the
    TPK threads of a key with xor shuffles (every lane gets the sum). The next batch's K and V loads are issued
    before the current batch's math (register double buffer). At the end the slots' (m, l, o) are merged:
    within a warp by xor shuffles, across warps through shared memory, in a fixed order."""
    comptime es = size_of[dtype]()
    comptime VW = 16 // es  # elements per 16-byte load
    comptime TPK = min(D // VW, WARP_SIZE)  # threads per key
    comptime EPT = D // TPK  # columns per thread (one or two 16-byte loads per key and operand)
    comptime KPW = WARP_SIZE // TPK  # key slots per warp
    comptime NT = DECODE_REG_THREADS
    comptime NW = NT // WARP_SIZE
    comptime NKS = NT // TPK  # key slots per block
    comptime U = _reg_u(R, EPT, es)
    comptime STEP = NKS * U  # keys per batch of the block

    var sacc = unsafe_stack_allocation[NW * R * D, _F32, address_space=AddressSpace.SHARED]()
    var sml = unsafe_stack_allocation[2 * NW * R, _F32, address_space=AddressSpace.SHARED]()

    var tid = thread_idx.x
    var lane = tid % WARP_SIZE
    var w = tid // WARP_SIZE
    var tl = lane % TPK
    var slot = w * KPW + lane // TPK
    var h_n = Int(H)
    var hkv_n = Int(Hkv)
    var s_len = Int(S)
    var skv = Int(Skv)
    var n_split = Int(splits)
    var group = h_n // hkv_n
    var rows = min(group * s_len, R)  # the caller guarantees group * S <= R
    var pid = block_idx.x
    var sp = block_idx.y
    var b = pid // hkv_n
    var hk = pid % hkv_n
    var causal = params[unsafe_offset=0] != 0
    var scale2 = params[unsafe_offset=1] * _LOG2E
    var L = _seq_len(kv_len, params[unsafe_offset=2] != 0, b, skv)
    # this block's keys: the sequence's L keys in n_split chunks of whole 16-key grains
    var chunk = ceildiv(ceildiv(L, 16), n_split) * 16
    var lo = min(sp * chunk, L)
    var hi = min(lo + chunk, L)
    var row0 = (b * h_n + hk * group) * s_len  # the group's first row in q / o / lse
    var kv_base = ((b * hkv_n + hk) * skv) * D

    # q (fp32) of the thread's columns, and each row's visible keys [lo, kend) (rows >= `rows`: none)
    var qr = SIMD[_F32, R * EPT](0)
    var kend = SIMD[DType.int32, R](Int32(lo))
    comptime for r in range(R):
        if r < rows:
            comptime for j in range(EPT // VW):
                comptime for e in range(VW):
                    qr[r * EPT + j * VW + e] = q[unsafe_offset=(row0 + r) * D + (j * TPK + tl) * VW + e].cast[_F32]()
            kend[r] = Int32(max(lo, min(hi, _last_key(r % s_len, s_len, L, causal) + 1)))

    var m = SIMD[_F32, R](_NEG_INF)
    var l = SIMD[_F32, R](0)
    var acc = SIMD[_F32, R * EPT](0)
    var aligned = vec != 0
    var kb = lo
    var kc = _ld_kv[dtype, D, U, EPT, TPK, NKS](k, kv_base, kb, hi, slot, tl, aligned)
    var vc = _ld_kv[dtype, D, U, EPT, TPK, NKS](v, kv_base, kb, hi, slot, tl, aligned)
    while kb < hi:  # uniform over the block: every lane reaches the shuffles
        var nb = kb + STEP
        # the next batch's loads go out before this batch's math (nothing past hi is read)
        var kn = _ld_kv[dtype, D, U, EPT, TPK, NKS](k, kv_base, nb, hi, slot, tl, aligned)
        var vn = _ld_kv[dtype, D, U, EPT, TPK, NKS](v, kv_base, nb, hi, slot, tl, aligned)
        # partial dots over the thread's columns, then summed over the key's TPK lanes
        var sc = SIMD[_F32, U * R](0)
        comptime for u in range(U):
            var kf = kc.slice[EPT, offset = u * EPT]().cast[_F32]()
            comptime for r in range(R):
                sc[u * R + r] = (qr.slice[EPT, offset = r * EPT]() * kf).reduce_add()
        comptime for t in range(7):
            comptime off = TPK >> (t + 1)
            comptime if off > 0:
                comptime for i in range(U * R):
                    sc[i] = sc[i] + warp.shuffle_xor(sc[i], UInt32(off))
        # online softmax per row over the batch (log2 domain); keys a row does not see: -inf, V not multiplied
        var pv = SIMD[_F32, U * R](0)
        comptime for r in range(R):
            var mx = _NEG_INF
            comptime for u in range(U):
                var s = sc[u * R + r] * scale2
                if kb + u * NKS + slot >= Int(kend[r]):
                    s = _NEG_INF
                sc[u * R + r] = s
                mx = _nmax(mx, s)
            var m_new = _nmax(m[r], mx)
            # a row with nothing visible yet keeps -inf: use 0 there so masked scores give 2^-inf = 0
            var mref = m_new if m_new > _NEG_INF else Float32(0)
            var alpha = exp2(m[r] - mref)
            var lsum: Float32 = 0
            comptime for u in range(U):
                var p = exp2(sc[u * R + r] - mref)
                pv[u * R + r] = p
                lsum += p
            l[r] = l[r] * alpha + lsum
            m[r] = m_new
            acc = acc.insert[offset = r * EPT](acc.slice[EPT, offset = r * EPT]() * alpha)
        comptime for u in range(U):
            var key = kb + u * NKS + slot
            var vf = vc.slice[EPT, offset = u * EPT]().cast[_F32]()
            comptime for r in range(R):
                if key < Int(kend[r]):
                    acc = acc.insert[offset = r * EPT](acc.slice[EPT, offset = r * EPT]() + pv[u * R + r] * vf)
        kb = nb
        kc = kn
        vc = vn

    # merge the key slots of a warp (xor over the slot bits of the lane), then the warps (shared, fixed order)
    comptime for t in range(7):
        comptime off = TPK << t
        comptime if off < WARP_SIZE:
            comptime for r in range(R):
                var mo = warp.shuffle_xor(m[r], UInt32(off))
                var lo_ = warp.shuffle_xor(l[r], UInt32(off))
                var mm = _nmax(m[r], mo)
                var mref = mm if mm > _NEG_INF else Float32(0)
                var wa = exp2(m[r] - mref)
                var wb = exp2(mo - mref)
                l[r] = l[r] * wa + lo_ * wb
                comptime for e in range(EPT):
                    var ao = warp.shuffle_xor(acc[r * EPT + e], UInt32(off))
                    acc[r * EPT + e] = acc[r * EPT + e] * wa + ao * wb
                m[r] = mm
    if lane < TPK:
        comptime for r in range(R):
            comptime for j in range(EPT // VW):
                comptime for e in range(VW):
                    sacc[unsafe_offset=(w * R + r) * D + (j * TPK + tl) * VW + e] = acc[r * EPT + j * VW + e]
            if tl == 0:
                sml[unsafe_offset=w * R + r] = m[r]
                sml[unsafe_offset=(NW + w) * R + r] = l[r]
    barrier()
    for idx in range(tid, rows * D, NT):
        var r = idx // D
        var d = idx % D
        var mm = _NEG_INF
        comptime for ww in range(NW):
            mm = _nmax(mm, sml[unsafe_offset=ww * R + r])
        var mref = mm if mm > _NEG_INF else Float32(0)
        var a: Float32 = 0
        var lsum: Float32 = 0
        comptime for ww in range(NW):
            var wt = exp2(sml[unsafe_offset=ww * R + r] - mref)
            a += sacc[unsafe_offset=(ww * R + r) * D + d] * wt
            lsum += sml[unsafe_offset=(NW + ww) * R + r] * wt
        var sees = min(hi, _last_key(r % s_len, s_len, L, causal) + 1) > lo  # this chunk holds a key row r sees
        _emit[dtype, D](o, lse, part, row0 + r, d, a, mm, lsum, sees, n_split, sp, Int(plse_off))


# ---- the tensor-core kernel (NVIDIA, fp16 / bf16: GQA groups of DECODE_MMA_MIN_ROWS..128 rows) -----------


@always_inline
def _mma_wk(wr: Int) -> Int:
    """Key warps: with few row warps a block still runs 4 warps, each taking its own 16+ keys of every tile
    (merged through shared memory at the end), so an SM has 4x the warps its shared memory would give."""
    return max(1, 4 // wr)


@always_inline
def _mma_smem(d: Int, es: Int, wr: Int) -> Int:
    """Dynamic shared memory of a block: two stages of a K and a V tile (rows padded by 8 elements), reused by
    the final merge of the key warps' fp32 states (it fits: at most 66 KB at D128 with 8 row warps)."""
    var rt = 16 * wr
    var wk = _mma_wk(wr)
    return max(2 * 2 * DECODE_MMA_BN * (d + 8) * es, (wk * rt * d + 2 * wk * rt) * 4)


def _decode_mma_kernel[
    dtype: DType, D: Int, WR: Int, WK: Int
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
    splits: Int32,
    plse_off: Int64,
):
    """One block per (b, kv head) x split: the GQA group's rows (r = g * S + s, contiguous in q / o / lse) are
    the M side of mma.sync m16n8k16 (fp32 accumulation), padded to 16 per row warp, so a group of 4 or 8 rows
    costs the tensor cores 4x / 2x the useful work but the CUDA cores nothing: scores and P.V for a 64-key tile
    are 8 + 8 MMAs per warp where the register kernel spends ~150 instructions per key and thread. K / V tiles
    go global -> shared with cp.async, double-buffered (the next tile's copy overlaps this tile's math), and
    are read with ldmatrix (V transposed), as _fa2_kernel (attention.mojo) does for prefill. WR row warps x WK
    key warps: key warp w takes keys [w * BN / WK, (w + 1) * BN / WK) of every tile with its own online softmax;
    the WK states are merged through shared memory in a fixed order (deterministic). Non-finite V in a tile
    some row does not fully see is zeroed in shared memory (p = 0 times NaN would poison the MMA) and added
    back, once, to the rows that see its key after the merge (vbad: the rare path). NVIDIA only: the lane
    layout is mma.sync's 32-lane one."""
    comptime BN = DECODE_MMA_BN
    comptime KW = BN // WK  # keys of each tile a key warp takes (a multiple of 16: P.V's k side)
    comptime NW = WR * WK
    comptime NT = NW * 32
    comptime RT = WR * 16  # rows the block holds (>= the group's rows)
    comptime LD = D + 8  # padded smem row (halves): ldmatrix rows land in distinct bank groups
    comptime STAGE = 2 * BN * LD  # K tile then V tile (two stages)
    comptime NKC = D // 16  # k-chunks of Q K^T
    comptime NSN = KW // 8  # n-tiles of a warp's S
    comptime NON = D // 8  # n-tiles of O
    comptime CHUNKS = BN * D // 8  # 16-byte chunks per K (or V) tile

    var smem = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16]()
    var vbad = unsafe_stack_allocation[1, DType.int32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var lane = tid % 32
    var wid = tid // 32
    var wr = wid % WR
    var wk = wid // WR
    var g = lane // 4
    var t4 = lane % 4

    var h_n = Int(H)
    var hkv_n = Int(Hkv)
    var s_len = Int(S)
    var skv = Int(Skv)
    var n_split = Int(splits)
    var group = h_n // hkv_n
    var rows = min(group * s_len, RT)  # the caller guarantees group * S <= RT
    var b = block_idx.x // hkv_n
    var hk = block_idx.x % hkv_n
    var sp = block_idx.y
    var causal = params[unsafe_offset=0] != 0
    var scale2 = params[unsafe_offset=1] * _LOG2E
    var L = _seq_len(kv_len, params[unsafe_offset=2] != 0, b, skv)
    var off = L - s_len  # bottom-right causal: query s sees keys <= s + off
    # this block's keys: the sequence's L keys in n_split chunks of whole tiles
    var chunk = ceildiv(ceildiv(L, BN), n_split) * BN
    var lo = min(sp * chunk, L)
    var hi = min(lo + chunk, L)
    var n_tiles = ceildiv(hi - lo, BN)
    var row0 = (b * h_n + hk * group) * s_len  # the group's first row in q / o / lse
    var kv_base = ((b * hkv_n + hk) * skv) * D
    var r0 = wr * 16 + g  # this thread's rows: r0 and r0 + 8 (rows >= `rows` are padding: q = 0)

    # ---- Q fragments in registers (A operand, row-major 16 x 16 per k-chunk)
    var qf = StaticTuple[SIMD[dtype, 8], NKC](fill=0)
    comptime for kc in range(NKC):
        var frag = SIMD[dtype, 8](0)
        comptime for half in range(2):
            var r = r0 + 8 * half
            if r < rows:
                var base = (row0 + r) * D + kc * 16 + 2 * t4
                var lo2 = q.unsafe_load[width=2, alignment=4](base)
                var hi2 = q.unsafe_load[width=2, alignment=4](base + 8)
                frag[2 * half] = lo2[0]
                frag[2 * half + 1] = lo2[1]
                frag[4 + 2 * half] = hi2[0]
                frag[4 + 2 * half + 1] = hi2[1]
        qf[kc] = frag

    var oacc = StaticTuple[SIMD[DType.float32, 4], NON](fill=0)
    var m_i = SIMD[DType.float32, 2](_NEG_INF)  # running max (log2 domain), rows r0 / r0 + 8
    var l_i = SIMD[DType.float32, 2](0)

    var kg = k.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v.unsafe_address_space_cast[AddressSpace.GLOBAL]()

    @always_inline
    def load_tile(tile: Int, stage: Int) {var}:
        var kbase = lo + tile * BN
        comptime for i in range(ceildiv(CHUNKS, NT)):
            var c = tid + i * NT
            if c < CHUNKS:
                var r = c // (D // 8)
                var col = (c % (D // 8)) * 8
                var kr = min(kbase + r, hi - 1)  # clamp: rows past hi are masked to p = 0, never past L
                var src = kv_base + kr * D + col
                var dst = stage * STAGE + r * LD + col
                async_copy[16](kg.unsafe_offset(src), smem.unsafe_offset(dst))
                async_copy[16](vg.unsafe_offset(src), smem.unsafe_offset(dst + BN * LD))
        async_copy_commit_group()

    if tid == 0:
        vbad[] = 0
    if n_tiles > 0:
        load_tile(0, 0)

    var mi = lane // 8
    var rr = lane % 8
    var kw0 = wk * KW  # this warp's first key of a tile
    for it in range(n_tiles):
        var stage = it % 2
        if it + 1 < n_tiles:  # refills the stage the previous iteration read (its closing barrier: all done)
            load_tile(it + 1, 1 - stage)
            async_copy_wait_group(1)
        else:
            async_copy_wait_group(0)
        barrier()

        var ks = smem.unsafe_offset(stage * STAGE)
        var vs = smem.unsafe_offset(stage * STAGE + BN * LD)
        var kbase = lo + it * BN

        # ---- a tile that some row must not fully see (the chunk's end, the causal diagonal; query 0 of the
        # group sees keys <= off): zero its non-finite V values so that p = 0 times V cannot make NaN in the
        # MMA; the rows that do see them get them back after the merge (vbad stays set)
        var block_masked = kbase + BN > hi or (causal and kbase + BN - 1 > off)
        if block_masked:
            comptime for i in range(ceildiv(CHUNKS, NT)):
                var c = tid + i * NT
                if c < CHUNKS:
                    var r = c // (D // 8)
                    var col = (c % (D // 8)) * 8
                    var p8 = vs.unsafe_offset(r * LD + col)
                    var x8 = p8.unsafe_load[width=8, alignment=16](0)
                    var f8 = x8.cast[DType.float32]()
                    var any_bad = False
                    comptime for e in range(8):
                        if _nonfinite(f8[e]):
                            x8[e] = 0
                            any_bad = True
                    if any_bad:
                        p8.unsafe_store[alignment=16](0, x8)
                        vbad[] = 1
            barrier()

        # ---- S = Q K^T over this warp's KW keys (16 x KW)
        var sacc = StaticTuple[SIMD[DType.float32, 4], NSN](fill=0)
        comptime for kc in range(NKC):
            comptime for jn in range(0, NSN, 2):
                var krow = kw0 + 8 * jn + (mi // 2) * 8 + rr
                var kcol = 16 * kc + (mi % 2) * 8
                var kb = ld_matrix[8](ks.unsafe_offset(krow * LD + kcol))
                mma(sacc[jn], qf[kc], kb.slice[4, offset=0](), sacc[jn])
                mma(sacc[jn + 1], qf[kc], kb.slice[4, offset=4](), sacc[jn + 1])

        # ---- mask (keys past the chunk, past a query's causal limit) and scale to the log2 domain
        var wbase = kbase + kw0
        var need_mask = wbase + KW > hi or (causal and wbase + KW - 1 > off)
        comptime for jn in range(NSN):
            var sv = sacc[jn] * scale2
            if need_mask:
                comptime for e in range(4):
                    var key = wbase + 8 * jn + 2 * t4 + (e % 2)
                    var sq = (r0 + 8 * (e // 2)) % s_len
                    if key >= hi or (causal and key > sq + off):
                        sv[e] = _NEG_INF
            sacc[jn] = sv

        # ---- online softmax (rows r0 / r0 + 8; a quad of 4 lanes shares a row); NaN-propagating max
        var mx = m_i
        comptime for jn in range(NSN):
            mx[0] = _nmax(mx[0], _nmax(sacc[jn][0], sacc[jn][1]))
            mx[1] = _nmax(mx[1], _nmax(sacc[jn][2], sacc[jn][3]))
        mx = _quad_max(mx)
        # a row with nothing visible yet keeps -inf: use 0 there so masked scores give exp2(-inf) = 0
        var mref = SIMD[DType.float32, 2](0)
        comptime for r in range(2):
            mref[r] = mx[r] if mx[r] > _NEG_INF else Float32(0)
        var alpha = SIMD[DType.float32, 2](exp2(m_i[0] - mref[0]), exp2(m_i[1] - mref[1]))
        m_i = mx
        var rs = SIMD[DType.float32, 2](0)
        var pf = StaticTuple[SIMD[dtype, 8], NSN // 2](fill=0)
        comptime for jn in range(NSN):
            var p = SIMD[DType.float32, 4](
                exp2(sacc[jn][0] - mref[0]),
                exp2(sacc[jn][1] - mref[0]),
                exp2(sacc[jn][2] - mref[1]),
                exp2(sacc[jn][3] - mref[1]),
            )
            rs[0] += p[0] + p[1]
            rs[1] += p[2] + p[3]
            var pc = p.cast[dtype]()
            comptime for e in range(4):
                pf[jn // 2][(jn % 2) * 4 + e] = pc[e]
        l_i = l_i * alpha + rs
        comptime for jo in range(NON):
            oacc[jo] = oacc[jo] * SIMD[DType.float32, 4](alpha[0], alpha[0], alpha[1], alpha[1])

        # ---- O += P V over this warp's keys
        comptime for kc in range(NSN // 2):
            comptime for jo in range(0, NON, 2):
                var vrow = kw0 + 16 * kc + (mi % 2) * 8 + rr
                var vcol = 8 * jo + (mi // 2) * 8
                var vb = ld_matrix[8, transpose=True](vs.unsafe_offset(vrow * LD + vcol))
                mma(oacc[jo], pf[kc], vb.slice[4, offset=0](), oacc[jo])
                mma(oacc[jo + 1], pf[kc], vb.slice[4, offset=4](), oacc[jo + 1])

        barrier()  # this stage is refilled next iteration

    # ---- merge the key warps through shared memory (the stages are free: the loop ended on a barrier), fp32:
    # o [WK][RT][D], then m [WK][RT] and l [WK][RT]; key warp order fixed, so repeats are bit-identical
    comptime MB = WK * RT * D
    comptime LB = MB + WK * RT
    var fs = smem.unsafe_bitcast[Float32]()
    l_i = _quad_sum(l_i)
    comptime for half in range(2):
        var r = r0 + 8 * half
        comptime for jo in range(NON):
            comptime for c in range(2):
                fs[unsafe_offset=(wk * RT + r) * D + 8 * jo + 2 * t4 + c] = oacc[jo][2 * half + c]
        if t4 == 0:
            fs[unsafe_offset=MB + wk * RT + r] = m_i[half]
            fs[unsafe_offset=LB + wk * RT + r] = l_i[half]
    barrier()
    var any_bad = vbad[] != 0
    for idx in range(tid, rows * D, NT):
        var r = idx // D
        var d = idx % D
        var mm = _NEG_INF
        comptime for w in range(WK):
            mm = _nmax(mm, fs[unsafe_offset=MB + w * RT + r])
        var mref = mm if mm > _NEG_INF else Float32(0)
        var a: Float32 = 0
        var lsum: Float32 = 0
        comptime for w in range(WK):
            var wt = exp2(fs[unsafe_offset=MB + w * RT + r] - mref)
            a += fs[unsafe_offset=(w * RT + r) * D + d] * wt
            lsum += fs[unsafe_offset=LB + w * RT + r] * wt
        var kend = min(hi, _last_key(r % s_len, s_len, L, causal) + 1)
        if any_bad:  # rare: every non-finite V value of a key this row sees reaches it (+-inf or NaN)
            for j in range(lo, kend):
                var val = v[unsafe_offset=kv_base + j * D + d].cast[_F32]()
                if _nonfinite(val):
                    a += val
        _emit[dtype, D](o, lse, part, row0 + r, d, a, mm, lsum, kend > lo, n_split, sp, Int(plse_off))


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
    """One block per output row (b, h, s): the max and the weights 2^(lse_i - M) of the splits once (shared
    memory), then TPD = threads / D threads per column, each summing every TPD-th split with 8 independent
    loads in flight, and the TPD sums added in a fixed order: deterministic."""
    comptime NT = DECODE_COMBINE_THREADS
    comptime NW = NT // WARP_SIZE
    comptime TPD = NT // D  # threads per column: D64 4, D128 2, D256 1
    comptime UN = 8
    var sw = unsafe_stack_allocation[DECODE_MAX_SPLITS, _F32, address_space=AddressSpace.SHARED]()
    var sred = unsafe_stack_allocation[2 * NW, _F32, address_space=AddressSpace.SHARED]()
    var ssum = unsafe_stack_allocation[NT, _F32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var lane = tid % WARP_SIZE
    var wid = tid // WARP_SIZE
    var row = block_idx.x
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
    var mx = _NEG_INF
    for i in range(tid, n_split, NT):
        mx = _nmax(mx, plse[unsafe_offset=base + i])
    mx = _warp_nmax(mx)
    if lane == 0:
        sred[unsafe_offset=wid] = mx
    barrier()
    var M = _NEG_INF
    comptime for ww in range(NW):
        M = _nmax(M, sred[unsafe_offset=ww])
    var ok = sees and not _nonfinite(M)
    var zero_row = sees and M == _NEG_INF  # every visible score -inf: o = 0 x the partials, lse -inf
    var ws: Float32 = 0
    for i in range(tid, n_split, NT):
        var wt: Float32 = 0
        if ok:
            wt = exp2(plse[unsafe_offset=base + i] - M)
        sw[unsafe_offset=i] = wt
        ws += wt
    ws = warp.sum(ws)
    if lane == 0:
        sred[unsafe_offset=NW + wid] = ws
    barrier()
    var wsum: Float32 = 0
    comptime for ww in range(NW):
        wsum += sred[unsafe_offset=NW + ww]
    var d = tid % D
    var g = tid // D
    var a: Float32 = 0
    if ok or zero_row:  # zero_row: every weight is 0, which keeps a 0 * NaN of a partial
        var i = g
        while i + (UN - 1) * TPD < n_split:
            var vals = SIMD[_F32, UN](0)
            comptime for t in range(UN):
                vals[t] = part[unsafe_offset=(base + i + t * TPD) * D + d]
            comptime for t in range(UN):
                a += sw[unsafe_offset=i + t * TPD] * vals[t]
            i += UN * TPD
        while i < n_split:
            a += sw[unsafe_offset=i] * part[unsafe_offset=(base + i) * D + d]
            i += TPD
    ssum[unsafe_offset=tid] = a
    barrier()
    if g == 0:
        var val: Float32 = 0
        if ok:
            var tot: Float32 = 0
            comptime for t in range(TPD):
                tot += ssum[unsafe_offset=t * D + d]
            val = tot / wsum
        elif zero_row:
            comptime for t in range(TPD):
                val += ssum[unsafe_offset=t * D + d]
        elif sees:  # NaN or +inf: o NaN, lse M
            val = M * 0
        o[unsafe_offset=row * D + d] = val.cast[dtype]()
    if tid == 0:
        var lrow = _NEG_INF
        if ok:
            lrow = (M + log2(wsum)) * _LN2
        elif sees and not zero_row:
            lrow = M * _LN2
        lse[unsafe_offset=row] = lrow


def decode_part_len(B: Int, H: Int, S: Int, D: Int, splits: Int) -> Int:
    """Workspace elements the partials need: B*H*S * splits * (D + 1) fp32 (none with one split)."""
    return 0 if splits <= 1 else B * H * S * splits * (D + 1)


def attention_decode_gpu[
    dtype: DType, HD: Int = 0
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
    use_mma: Bool = True,
) raises:
    """Enqueue the split-KV decode kernels (the caller checked decode_applies). force_splits > 0 forces the
    split count (harness), within the workspace given; use_mma False keeps the SIMT kernels (harness A/B).
    HD != 0: only that head dim's kernels are compiled (attention_gpu_ws); 0: every head dim's."""
    if B * H * S == 0:
        return
    var sms = ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
    var plan = decode_plan(B, H, Hkv, S, Skv, D, size_of[dtype](), sms)
    var row_blocks = plan[0]
    var rpp = plan[1]
    var splits = plan[2]
    if force_splits > 0:
        splits = min(force_splits, DECODE_MAX_SPLITS)  # the combine keeps <= DECODE_MAX_SPLITS weights in shared
    var n = B * H * S * splits
    if splits > 1:
        check_workspace("fusekit.attention", "part", part_len, decode_part_len(B, H, S, D, splits))
    var vec = Int32(1) if Int(k) % 16 == 0 and Int(v) % 16 == 0 else Int32(0)
    var plse_off = Int64(n * D if splits > 1 else 0)  # the lse partials follow the o partials

    var rows = (H // Hkv) * S

    @always_inline
    def launch_reg[HD: Int, R: Int]() raises {var}:
        ctx.enqueue_function[_decode_reg_kernel[dtype, HD, R]](
            o, lse, part, q, k, v, kv_len, params, Int32(H), Int32(Hkv), Int32(S), Int32(Skv), Int32(splits),
            plse_off, vec, grid_dim=(B * Hkv, splits), block_dim=DECODE_REG_THREADS,
        )

    @always_inline
    def launch_simt[HD: Int]() raises {var}:
        if rows <= 1:
            launch_reg[HD, 1]()
        elif rows <= 4:
            launch_reg[HD, 4]()
        elif rows <= DECODE_REG_ROWS:
            launch_reg[HD, DECODE_REG_ROWS]()
        else:
            ctx.enqueue_function[_decode_split_kernel[dtype, HD]](
                o, lse, part, q, k, v, kv_len, params, Int32(H), Int32(Hkv), Int32(S), Int32(Skv), Int32(row_blocks),
                Int32(rpp), Int32(splits), plse_off, vec, grid_dim=(B * Hkv * row_blocks, splits),
                block_dim=DECODE_THREADS,
            )

    @always_inline
    def launch_mma[HD: Int, WR: Int]() raises {var}:
        comptime smem_bytes = _mma_smem(HD, size_of[dtype](), WR)
        ctx.enqueue_function[_decode_mma_kernel[dtype, HD, WR, _mma_wk(WR)]](
            o, lse, part, q, k, v, kv_len, params, Int32(H), Int32(Hkv), Int32(S), Int32(Skv), Int32(splits),
            plse_off, grid_dim=(B * Hkv, splits), block_dim=WR * _mma_wk(WR) * 32,
            shared_mem_bytes=smem_bytes,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem_bytes)),
        )

    @always_inline
    def launch_main[HD: Int]() raises {var}:
        """The tensor-core kernel where it applies (NVIDIA, fp16 / bf16, D <= 128, 16-byte aligned k and v,
        4-byte aligned q), else the SIMT kernels."""
        comptime if DeviceContext.default_device_info.api == "cuda" and (
            dtype == DType.bfloat16 or dtype == DType.float16
        ) and HD <= DECODE_MMA_MAX_D:
            # cp.async needs 16-byte aligned k / v (vec), q's paired loads 4-byte alignment: a contiguous view
            # one element into its storage takes the SIMT kernels
            if use_mma and vec != 0 and Int(q) % 4 == 0 and rows >= DECODE_MMA_MIN_ROWS:
                if rows <= 16:
                    launch_mma[HD, 1]()
                elif rows <= 32:
                    launch_mma[HD, 2]()
                elif rows <= 64:
                    launch_mma[HD, 4]()
                else:
                    launch_mma[HD, 8]()
                return
        launch_simt[HD]()

    @always_inline
    def launch[HD: Int]() raises {var}:
        launch_main[HD]()
        if splits > 1:
            ctx.enqueue_function[_decode_combine_kernel[dtype, HD]](
                o, lse, part, kv_len, params, Int64(B * H * S), Int32(H), Int32(S), Int32(Skv), Int32(splits), plse_off,
                grid_dim=B * H * S, block_dim=DECODE_COMBINE_THREADS,
            )

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
    raise Error("fusekit.attention: the decode path takes head dims 64 / 128 / 256")
