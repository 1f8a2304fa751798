# fusekit.attention / fusekit.attention_backward: softmax(q k^T * scale [+ causal mask]) v,
# FlashAttention-2 style forward on the GPU, and its gradient.
#
# Contract (.dev/CONTRACT.md, "attention"):
#   attention:          outputs (o [B, H, S, D], lse [B, H, S] f32), inputs (q [B, H, S, D],
#                       k [B, Hkv, Skv, D], v [B, Hkv, Skv, D], kv_len? [B] int32,
#                       params [3] f32 = [causal, scale, has_kv_len], or [4] with a 4th slot `decode` whose
#                       PRESENCE selects the split-KV decode kernels for decode shapes: on by default,
#                       FUSEKIT_MOJO_ATTN_DECODE=0 leaves the slot out).
#   attention_backward: outputs (dq [B, H, S, D], dk [B, Hkv, Skv, D], dv [B, Hkv, Skv, D]), inputs
#                       (do [B, H, S, D], q, k, v, o, lse [B, H, S] f32, kv_len?, params as above, or
#                       params [4] f32 = [causal, scale, has_kv_len, bwd_tc]). The 4th slot exists
#                       unless FUSEKIT_MOJO_ATTN_BWD_TC=0 (python/fusekit/backends/mojo/specs.py) and then
#                       holds 1: its PRESENCE (params' length, known on the host; its value is on the
#                       device) selects the tensor-core backward (_attention_backward.mojo) where that
#                       covers the call. The CPU path ignores it.
# Head h reads kv head h // (H // Hkv). Sequence b uses keys 0..L_b - 1 only, L_b = clamp(kv_len[b], 0,
# Skv) with has_kv_len (the values are untrusted on CUDA: clamped, so no length reads outside k/v), else
# Skv; keys past L_b are never read and get zero gradients (a KV cache may hold anything there). An
# absent kv_len is a [1] dummy never read. Causal is bottom-right aligned per sequence: query i sees key
# j iff j <= i + (L_b - S). lse = logsumexp over the visible keys of s = q.k * scale (natural log).
# Every kernel below takes L_b where it took Skv for masking; Skv stays the row stride of k / v.
#
# Non-finite inputs behave as a float64 softmax over the VISIBLE keys (issue #16): a row with no visible
# key (L_b = 0, or causal with S > L_b) writes o = 0 and lse = -inf (decided from indices, not from scores);
# a NaN in q row i or in a key k_j that row i sees makes row i NaN (lse NaN); a NaN/Inf in v_j[d] makes
# o[i, d] non-finite for exactly the rows i that see j; a visible score of +inf makes the row NaN with
# lse = +inf, visible scores all -inf make it a zero row with lse = -inf (the reference's rule, as SDPA's
# and the Triton backend's; the backward takes p = 0 there, `_bwd_lse2`); masked keys never matter. This needs care because neither `max` (drops NaN) nor the CPU's `exp2` (clamps its argument:
# exp2(NaN) = 8.5e37, exp2(-inf) = 1.2e-38) propagates NaN: `_nmax` and the GPU's exp2 do, and a tensor-
# core P.V would turn 0 (masked) * NaN into NaN, so masked tiles have their non-finite V zeroed in
# shared memory and re-added (as +-inf / NaN) only to the rows that see them (`_fa2_kernel`).
#
# Floors (H200, bf16, B4 H32 S4096 D128): 4*B*H*S^2*D = 275 TFLOP (non-causal), half causal; at the
# measured ~700-790 TFLOP/s dense bf16 that is ~0.37 ms; bytes (q, k, v, out once) = 0.27 GB -> 63 us,
# so attention is compute-bound and the tensor cores set the ceiling. SDPA (FA) reaches ~604 TFLOP/s.
# Backward: 2.5x the forward FLOPs (5 GEMMs of the forward's size, 2 in the forward).
#
# GPU forward paths (chosen at compile time per vendor, at run time per dtype / head dim):
# - decode shapes, every dtype and vendor: S <= 16, a GQA group of H/Hkv * S <= 128 rows, D in {64, 128,
#   256}: the split-KV (flash-decoding) kernels of _attention_decode.mojo (SIMT, one block per kv head's
#   group rows and KV chunk, fp32 partials in the caller's workspace `part`, deterministic combine).
#   On NVIDIA fp16/bf16, D 64/128: the tensor-core kernel _decode_mma_kernel (H200 figures in
#   _attention_decode.mojo's header; harness: FUSEKIT_HARNESS_ONLY=attn_decode).
# - NVIDIA, fp16/bf16, D in {64, 128, 256}: `_fa2_kernel`, FlashAttention-2 forward with warp-level
#   tensor-core MMA (mma.sync m16n8k16, fp32 accumulation): each warp owns 16 query rows whose Q
#   fragments stay in registers; K/V tiles go global -> shared with cp.async, double-buffered so the
#   copy of tile j+1 overlaps the math on tile j; K and V fragments are read with ldmatrix (V with
#   .trans); S = Q K^T, online softmax (exp2, running max/sum in registers, quad shuffles), P is
#   re-packed from the S accumulators into A fragments without touching shared memory; O += P V.
#   Causal: key tiles past the block's last visible key are skipped, only diagonal tiles are masked;
#   blocks are issued heaviest-first. mma.sync peaks near ~60% of SDPA's ~600 TFLOP/s on H100/H200, so
# - sm_90, fp16/bf16, D in {64, 128, 256} (16-byte aligned q / k / v, B * H <= 65535): `_fa3_kernel` of
#   _attention_hopper.mojo instead, FlashAttention-3's design: a TMA producer warpgroup, mbarrier rings,
#   consumer warpgroups on warpgroup MMA (wgmma) with intra- and inter-warpgroup overlap (2.4-3x
#   `_fa2_kernel`, 0.50-0.94x SDPA: its header). Other GPUs keep `_fa2_kernel`.
# - everything else (fp32, other head dims, AMD gfx942): `_attn_rowwise_kernel`, one warp per query
#   row, exact fp32 math, no tensor cores (correct, slow; also the harness's GPU reference).
# GPU backward, default (every dtype / vendor): SIMT fp32 kernels, deterministic (fixed loop orders, no
# atomics):
#   delta_i = rowsum(do_i * o_i) (one warp per row, into the caller's fp32 workspace [B*H*S]); dK/dV:
#   one warp per kv row j, looping over the GQA group's heads and the query rows that see j; dQ: one warp
#   per query row, looping over its visible keys; p = exp(s - lse) recomputed from the forward's lse.
#   Correct but not tensor-core; rows with no visible key contribute nothing.
# GPU backward, the default (params' 4th slot; FUSEKIT_MOJO_ATTN_BWD_TC=0 drops it): NVIDIA, fp16 / bf16, D 64 / 128 / 256,
#   B * H <= 65535: `attention_backward_tc` in _attention_backward.mojo, FlashAttention-2's backward on
#   mma.sync (a dK/dV kernel per key block walking the GQA group's heads and query blocks, a dQ kernel per
#   query block; deterministic, no atomics), after the same delta kernel. The harness
#   (FUSEKIT_HARNESS_ONLY=attn_bwd_tc) checks it against the SIMT kernels and a float64 host reference.
#   Its non-finite rule is the Triton backend's (see that file), not the SIMT kernels' stricter one.
#
# Tile table for `_fa2_kernel` (BM query rows per block = 16 * warps, BN keys per tile):
#   D    BM   BN  warps  regs/thread (S + O acc + Q frags)   smem (2 stages K+V, rows padded +8)
#   64   128  64   8     32 + 32 + 16                        2*2*64*72*2   = 36 KB
#   128  128  64   8     32 + 64 + 32                        2*2*64*136*2  = 68 KB
#   256   64  32   4     16 + 128 + 64  (128x64 would spill) 2*2*32*264*2  = 66 KB
# At D=256 a larger BN/BM doubles the S or O registers past the 255 cap (spills), which is why
# 128x128 tiles lose to smaller ones there.
#
# Measured before the lse output and the non-finite handling were added (H200, bf16, B4 H32
# S=Skv=4096, us / TFLOP/s; SDPA = torch 2.11 flash in the same run):
#   D    non-causal             causal                 SDPA non-causal / causal   ptxas regs, spills
#   64   3254 / 169 (0.37x)     1721 / 160 (0.38x)     455 / 418 TFLOP/s          155, 0
#   128  5443 / 202 (0.34x)     2882 / 191 (0.36x)     602 / 528 TFLOP/s          243, 0
#   256  10039 / 219 (0.34x)    5238 / 210 (0.36x)     648 / 588 TFLOP/s          255, 36 B
# SASS: HMMA only (64 / 128 / 128 per kernel), LDSM for K and V; no HGMMA (see the header).
# The current kernel (lse, non-finite handling), same-run A/B against the old one on an H200, us:
# D64 3604 (+11%), D128 5039 (-7%), D256 11009 (+11%); causal D64 1905, D128 2678, D256 5821. The
# difference is codegen around the masked-tile V scan and the post-loop rare path (a variant without
# them timed like the old kernel at D64/D256 and 8% slower at D128); the NaN-propagating max costs
# nothing (max.NaN.f32 timed like max.f32). A follow-up could launch a scan-free variant when a
# cheap pre-pass finds V all finite (a device flag both variants read, no host sync).
# Backward (SIMT fp32, bf16 B1 H8 S2048 D128 causal): 8.1 ms = 2.7 TFLOP/s (10 B H S^2 D / 2 FLOP).

from std.math import ceildiv, exp2
from std.memory import unsafe_stack_allocation
from std.sys import llvm_intrinsic
from std.utils import StaticTuple
# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import thread_idx, block_idx, lane_id, barrier, WARP_SIZE, external_memory, AddressSpace
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.primitives import warp
from max.gpu.compute.mma import mma, ld_matrix
from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group

from ._util import exp_f64, log_f64, check_workspace
from ._attention_backward import attention_backward_tc, tc_backward_supported, _bwd_lse2
from ._attention_decode import attention_decode_gpu, decode_applies, _finish_log2, _quad_max, _quad_sum
from ._attention_hopper import attention_hopper_gpu

comptime LOG2E: Float32 = 1.4426950408889634
comptime NEG_INF = Float32.MIN  # -inf (Float32.MIN is -inf in Mojo; MIN_FINITE is the finite one)
comptime POS_INF = Float32.MAX  # +inf
comptime F32 = DType.float32


# ---- NaN-propagating primitives ------------------------------------------------------------------


@always_inline
def _nmax(a: Float32, b: Float32) -> Float32:
    """max(a, b) that returns NaN when either is NaN (std `max` drops a NaN operand): IEEE 754-2019
    maximum, one `max.NaN.f32` on sm_90 (v_max + v_cmp_o + v_cndmask on gfx942)."""
    return llvm_intrinsic["llvm.maximum.f32", Float32](a, b)


# GPU kernels call std `exp2` directly: it is `ex2.approx.ftz.f32` on sm_90 and `v_exp_f32` on gfx942,
# both IEEE for the cases that matter here (NaN -> NaN, -inf -> +0, tiny -> 0). The CPU exp2 is not
# (it clamps its argument: exp2(NaN) = 8.5e37, exp2(-inf) = 1.2e-38, and is off by up to 1.2e-5), so
# the CPU paths use _exp_acc.


@always_inline
def _exp_acc(x: Float32) -> Float32:
    """e^x through fp64 (CPU paths: std fp32 exp2 on the CPU is off by up to ~1e-5 relative)."""
    return Float32(exp_f64(Float64(x)))


@always_inline
def _nonfinite(x: Float32) -> Bool:
    return x * 0 != 0  # NaN or +-inf


@always_inline
def _seq_len(kv_len: Pointer[Int32, MutAnyOrigin], has_len: Bool, b: Int, skv: Int) -> Int:
    """Sequence b's key count L_b: kv_len[b] clamped to [0, Skv] (untrusted), or Skv without kv_len."""
    if not has_len:
        return skv
    return min(max(Int(kv_len[unsafe_offset=b]), 0), skv)


@always_inline
def _row_last_key(i: Int, s_len: Int, n_keys: Int, causal: Bool) -> Int:
    """The last key row i sees (-1: none), n_keys = its sequence's key count L_b."""
    if causal:
        return min(n_keys - 1, i + n_keys - s_len)
    return n_keys - 1


@always_inline
def _finish_row(m: Float32, l: Float32) -> Tuple[Float32, Float32]:
    """(1/l, 0 or NaN, lse) of a row that sees at least one key, from its max m and sum l = sum e^(s - m)
    (natural-log domain). m = -inf (every visible score -inf): a zero row, lse -inf (the reference's rule);
    NaN or +inf: the float64 softmax is NaN (inf - inf), lse = m."""
    if m == NEG_INF:
        return (0, m)
    if _nonfinite(m):
        return (m * 0, m)
    return (1.0 / l, m + Float32(log_f64(Float64(l))))


@always_inline
def _fa2_bm(d: Int) -> Int:
    return 64 if d == 256 else 128


@always_inline
def _fa2_bn(d: Int) -> Int:
    return 32 if d == 256 else 64


def _fa2_kernel[
    dtype: DType, D: Int, BM: Int, BN: Int
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
):
    comptime NW = BM // 16  # warps; each owns 16 query rows
    comptime NT = NW * 32
    comptime LD = D + 8  # padded smem row (halves): ldmatrix rows land in distinct bank groups
    comptime STAGE = 2 * BN * LD  # K tile then V tile
    comptime NKC = D // 16  # k-chunks of the QK^T product
    comptime NSN = BN // 8  # n-tiles of S
    comptime NON = D // 8  # n-tiles of O
    comptime CHUNKS = BN * D // 8  # 16-byte chunks per K (or V) tile

    var smem = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16]()
    var vbad = unsafe_stack_allocation[1, DType.int32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var lane = tid % 32
    var wid = tid // 32
    var g = lane // 4
    var t4 = lane % 4

    var s_len = Int(S)
    var skv = Int(Skv)  # k/v row stride; the keys this sequence uses are 0..kvl - 1
    var n_mblk = ceildiv(s_len, BM)
    var mblk = n_mblk - 1 - block_idx.x  # heaviest (causal) blocks first
    var bh = block_idx.y
    var b = bh // Int(H)
    var h = bh % Int(H)
    var hk = h // (Int(H) // Int(Hkv))
    var m0 = mblk * BM
    var causal = params[unsafe_offset=0] != 0
    var scale2 = params[unsafe_offset=1] * LOG2E
    var kvl = _seq_len(kv_len, params[unsafe_offset=2] != 0, b, skv)
    var off = kvl - s_len  # bottom-right alignment against this sequence's length

    var q_base = (bh * s_len) * D
    var kv_base = ((b * Int(Hkv) + hk) * skv) * D

    # key range this block needs (keys past kvl are never read)
    var kv_end = kvl
    if causal:
        kv_end = min(kvl, m0 + BM + off)
    var n_tiles = ceildiv(kv_end, BN) if kv_end > 0 else 0

    var row0 = m0 + wid * 16 + g  # this thread's two rows: row0, row0 + 8

    # ---- Q fragments in registers (A operand, row-major 16 x 16 per k-chunk)
    var qf = StaticTuple[SIMD[dtype, 8], NKC](fill=0)
    comptime for kc in range(NKC):
        var frag = SIMD[dtype, 8](0)
        comptime for half in range(2):
            var r = row0 + 8 * half
            if r < s_len:
                var base = q_base + r * D + kc * 16 + 2 * t4
                var lo = q.unsafe_load[width=2, alignment=4](base)
                var hi = q.unsafe_load[width=2, alignment=4](base + 8)
                frag[2 * half] = lo[0]
                frag[2 * half + 1] = lo[1]
                frag[4 + 2 * half] = hi[0]
                frag[4 + 2 * half + 1] = hi[1]
        qf[kc] = frag

    var oacc = StaticTuple[SIMD[DType.float32, 4], NON](fill=0)
    var m_i = SIMD[DType.float32, 2](NEG_INF)  # running max (log2 domain), rows g / g+8
    var l_i = SIMD[DType.float32, 2](0)

    var kg = k.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v.unsafe_address_space_cast[AddressSpace.GLOBAL]()

    @always_inline
    def load_tile(tile: Int, stage: Int) {var}:
        var kbase = tile * BN
        comptime for i in range(ceildiv(CHUNKS, NT)):
            var c = tid + i * NT
            if c < CHUNKS:
                var r = c // (D // 8)
                var col = (c % (D // 8)) * 8
                var kr = min(kbase + r, kvl - 1)  # clamp: rows past kvl are masked to p = 0
                var src = kv_base + kr * D + col
                var dst = stage * STAGE + r * LD + col
                async_copy[16](kg.unsafe_offset(src), smem.unsafe_offset(dst))
                async_copy[16](vg.unsafe_offset(src), smem.unsafe_offset(dst + BN * LD))
        async_copy_commit_group()

    if tid == 0:
        vbad[] = 0
    if n_tiles > 0:
        load_tile(0, 0)

    for it in range(n_tiles):
        var stage = it % 2
        if it + 1 < n_tiles:
            load_tile(it + 1, 1 - stage)
            async_copy_wait_group(1)
        else:
            async_copy_wait_group(0)
        barrier()

        var ks = smem.unsafe_offset(stage * STAGE)
        var vs = smem.unsafe_offset(stage * STAGE + BN * LD)
        var kbase = it * BN

        # ---- a tile that some row of this block must not fully see: zero its non-finite V values so
        # that p = 0 (masked) * V cannot make NaN in the MMA; rows that do see them get them back after
        # the loop (vbad stays set)
        var block_masked = kbase + BN > kvl or (causal and kbase + BN - 1 > m0 + off)
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

        # ---- S = Q K^T (16 x BN per warp)
        var sacc = StaticTuple[SIMD[DType.float32, 4], NSN](fill=0)
        var mi = lane // 8
        var rr = lane % 8
        # kc outer, n-tiles inner: consecutive MMAs go to independent accumulators (kc inner made one
        # dependent HMMA chain per n-tile in SASS); each accumulator still sums kc in the same order.
        comptime for kc in range(NKC):
            comptime for jn in range(0, NSN, 2):
                # x4: m0 = K[8jn..][16kc..], m1 = K[8jn..][16kc+8..], m2/m3 = same for n-tile jn+1
                var krow = 8 * jn + (mi // 2) * 8 + rr
                var kcol = 16 * kc + (mi % 2) * 8
                var kb = ld_matrix[8](ks.unsafe_offset(krow * LD + kcol))
                mma(sacc[jn], qf[kc], kb.slice[4, offset=0](), sacc[jn])
                mma(sacc[jn + 1], qf[kc], kb.slice[4, offset=4](), sacc[jn + 1])

        # ---- mask (only tiles that cross kvl or the causal diagonal) and scale to log2 domain;
        # a masked score is -inf whatever q.k was (a NaN in a masked key never matters)
        var need_mask = kbase + BN > kvl or (causal and kbase + BN - 1 > m0 + wid * 16 + off)
        comptime for jn in range(NSN):
            var sv = sacc[jn] * scale2
            if need_mask:
                comptime for e in range(4):
                    var key = kbase + 8 * jn + 2 * t4 + (e % 2)
                    var qrow = row0 + 8 * (e // 2)
                    var dead = key >= kvl or (causal and key > qrow + off)
                    if dead:
                        sv[e] = NEG_INF
            sacc[jn] = sv

        # ---- online softmax (rows g and g+8; a quad of 4 lanes shares a row); NaN-propagating max
        var mx = m_i
        comptime for jn in range(NSN):
            mx[0] = _nmax(mx[0], _nmax(sacc[jn][0], sacc[jn][1]))
            mx[1] = _nmax(mx[1], _nmax(sacc[jn][2], sacc[jn][3]))
        mx = _quad_max(mx)
        # a row with nothing visible yet keeps -inf: use 0 there so masked scores give exp2(-inf) = 0
        var mref = SIMD[DType.float32, 2](0)
        comptime for r in range(2):
            mref[r] = mx[r] if mx[r] > NEG_INF else Float32(0)
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
            var a4 = SIMD[DType.float32, 4](alpha[0], alpha[0], alpha[1], alpha[1])
            oacc[jo] = oacc[jo] * a4

        # ---- O += P V
        comptime for kc in range(NSN // 2):
            comptime for jo in range(0, NON, 2):
                # x4.trans: m0 = V[16kc..+7][8jo..], m1 = V[16kc+8..][8jo..], m2/m3 for n-tile jo+1
                var vrow = 16 * kc + (mi % 2) * 8 + rr
                var vcol = 8 * jo + (mi // 2) * 8
                var vb = ld_matrix[8, transpose=True](vs.unsafe_offset(vrow * LD + vcol))
                mma(oacc[jo], pf[kc], vb.slice[4, offset=0](), oacc[jo])
                mma(oacc[jo + 1], pf[kc], vb.slice[4, offset=4](), oacc[jo + 1])

        barrier()  # this stage is refilled next iteration

    # ---- rare path (some masked tile had a non-finite V, zeroed in shared memory): every non-finite V
    # value reaches each row that sees its key, weight 1 instead of p > 0 (+-inf or NaN either way, as
    # in float64; values of unmasked tiles, already in the MMA sums, are added again, which changes
    # nothing: x + x keeps NaN, inf and -inf). Outside the main loop so it costs nothing there.
    barrier()
    if vbad[] != 0:
        comptime for half in range(2):
            var r = row0 + 8 * half
            if r < s_len:
                var jend = min(kvl, r + off + 1) if causal else kvl
                for j in range(jend):
                    comptime for jo in range(NON):
                        comptime for c in range(2):
                            var val = v[unsafe_offset=kv_base + j * D + 8 * jo + 2 * t4 + c].cast[DType.float32]()
                            if _nonfinite(val):
                                oacc[jo][2 * half + c] += val

    # ---- finish: divide by the row sums (quad-reduced); lse in natural log; rows with no visible key
    # write o = 0, lse = -inf
    l_i = _quad_sum(l_i)
    comptime for half in range(2):
        var r = row0 + 8 * half
        if r < s_len:
            var inv: Float32 = 0
            var lrow = NEG_INF
            if kvl > 0 and (not causal or r + off >= 0):
                var f = _finish_log2(m_i[half], l_i[half])
                inv = f[0]
                lrow = f[1]
            comptime for jo in range(NON):
                var val = SIMD[DType.float32, 2](oacc[jo][2 * half], oacc[jo][2 * half + 1]) * inv
                o.unsafe_store[width=2, alignment=4](q_base + r * D + 8 * jo + 2 * t4, val.cast[dtype]())
            if t4 == 0:
                lse[unsafe_offset=bh * s_len + r] = lrow


def _attn_rowwise_kernel[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    BH: Int32,
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
    D: Int32,
):
    """One warp per query row; lanes split the head dim (<= 256 / WARP_SIZE per lane)."""
    comptime PER = 256 // WARP_SIZE
    comptime WPB = 4
    var lane = lane_id()
    var row = block_idx.x * WPB + thread_idx.x // WARP_SIZE  # over B*H*S
    var s_len = Int(S)
    var skv = Int(Skv)
    var d = Int(D)
    if row >= Int(BH) * s_len:
        return
    var bh = row // s_len
    var i = row % s_len
    var b = bh // Int(H)
    var h = bh % Int(H)
    var hk = h // (Int(H) // Int(Hkv))
    var causal = params[unsafe_offset=0] != 0
    var scale = params[unsafe_offset=1]
    var kv_base = ((b * Int(Hkv) + hk) * skv) * d
    var qv = SIMD[DType.float32, PER](0)
    var acc = SIMD[DType.float32, PER](0)
    comptime for e in range(PER):
        var dd = lane + e * WARP_SIZE
        if dd < d:
            qv[e] = q[unsafe_offset=row * d + dd].cast[DType.float32]()
    var last = _row_last_key(i, s_len, _seq_len(kv_len, params[unsafe_offset=2] != 0, b, skv), causal)
    var m = NEG_INF  # running max (log2 domain)
    var l: Float32 = 0
    for j in range(last + 1):
        var part: Float32 = 0
        comptime for e in range(PER):
            var dd = lane + e * WARP_SIZE
            if dd < d:
                part += qv[e] * k[unsafe_offset=kv_base + j * d + dd].cast[DType.float32]()
        var s = warp.sum(part) * scale * LOG2E
        var mn = _nmax(m, s)
        var mref = mn if mn > NEG_INF else Float32(0)
        var alpha = exp2(m - mref)
        var p = exp2(s - mref)
        l = l * alpha + p
        comptime for e in range(PER):
            var dd = lane + e * WARP_SIZE
            if dd < d:
                acc[e] = acc[e] * alpha + p * v[unsafe_offset=kv_base + j * d + dd].cast[DType.float32]()
        m = mn
    var inv: Float32 = 0
    var lrow = NEG_INF
    if last >= 0:
        var f = _finish_log2(m, l)
        inv = f[0]
        lrow = f[1]
    comptime for e in range(PER):
        var dd = lane + e * WARP_SIZE
        if dd < d:
            o[unsafe_offset=row * d + dd] = (acc[e] * inv).cast[dtype]()
    if lane == 0:
        lse[unsafe_offset=row] = lrow


def attention_cpu[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    causal: Bool,
    scale: Float32,
    has_len: Bool,
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
):
    """Plain loops, fp32 math (exact softmax with a max pass, e^x through fp64), one cast at the end."""
    var sc = List[Float32](length=Skv, fill=0)
    var acc = List[Float32](length=D, fill=0)
    var group = H // Hkv
    for b in range(B):
        var kvl = _seq_len(kv_len, has_len, b, Skv)
        for h in range(H):
            var kv_base = ((b * Hkv + h // group) * Skv) * D
            var q_base = ((b * H + h) * S) * D
            for i in range(S):
                var last = _row_last_key(i, S, kvl, causal)
                for dd in range(D):
                    acc[dd] = 0
                var mx = NEG_INF
                for j in range(last + 1):
                    var s: Float32 = 0
                    for dd in range(D):
                        s += (
                            q[unsafe_offset=q_base + i * D + dd].cast[DType.float32]()
                            * k[unsafe_offset=kv_base + j * D + dd].cast[DType.float32]()
                        )
                    sc[j] = s * scale
                    mx = _nmax(mx, sc[j])
                var l: Float32 = 0
                if not _nonfinite(mx) or mx == NEG_INF:  # -inf: every visible score -inf, p = 0
                    for j in range(last + 1):
                        var p: Float32 = 0
                        if mx > NEG_INF:
                            p = _exp_acc(sc[j] - mx)
                        l += p
                        for dd in range(D):
                            acc[dd] += p * v[unsafe_offset=kv_base + j * D + dd].cast[DType.float32]()
                var inv: Float32 = 0
                var lrow = NEG_INF
                if last >= 0:
                    var f = _finish_row(mx, l)
                    inv = f[0]
                    lrow = f[1]
                for dd in range(D):
                    o[unsafe_offset=q_base + i * D + dd] = (acc[dd] * inv).cast[dtype]()
                lse[unsafe_offset=(b * H + h) * S + i] = lrow


def attention_gpu[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
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
    force_rowwise: Bool = False,
    hopper: Bool = True,
) raises:
    """`attention_gpu_ws` without a workspace: a decode shape that needs split partials raises (check_workspace)."""
    attention_gpu_ws[dtype](
        o, lse, lse, 0, q, k, v, kv_len, params, B, H, Hkv, S, Skv, D, ctx, force_rowwise=force_rowwise, hopper=hopper
    )


def attention_gpu_ws[
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
    force_rowwise: Bool = False,
    decode: Bool = True,
    force_splits: Int = 0,
    decode_mma: Bool = True,
    hopper: Bool = True,
) raises:
    """Launch the best kernel for this target / dtype / head dim (see the header table). Decode shapes
    (S <= 16, GQA group rows <= 128, D 64 / 128 / 256) take the split-KV kernels of _attention_decode.mojo,
    whose partials go to the caller's workspace `part` (part_len elements; specs.py attention_decode_part),
    unless decode is False or force_rowwise is set (the harness's references); force_splits > 0 forces their
    split count, and decode_mma False keeps the SIMT decode kernels where the tensor-core one would run;
    hopper False keeps `_fa2_kernel` where the wgmma kernel (_attention_hopper.mojo, sm_90) would run.

    HD: the head dim the op was compiled for (the custom op's `head_dim` parameter, one MAX graph per head
    dim: issue #14 item 3), or 0 for every head dim. With HD != 0 only that head dim's flash-attention and
    decode kernels are instantiated (bf16 on NVIDIA: 7 of the 19 kernels; the MAX graph compile is what
    a first call waits for); every runtime decision is the same code, and a call of another head dim raises."""
    comptime if HD != 0:
        if D != HD:
            raise Error(
                String("fusekit.attention: compiled for head dim ", HD, ", called with ", D)
            )
    if decode and not force_rowwise and decode_applies(H, Hkv, S, D):
        attention_decode_gpu[dtype, HD](
            o, lse, part, part_len, q, k, v, kv_len, params, B, H, Hkv, S, Skv, D, ctx, force_splits, decode_mma
        )
        return

    @always_inline
    def launch_fa2[HD: Int]() raises {var}:
        comptime BM = _fa2_bm(HD)
        comptime BN = _fa2_bn(HD)
        comptime smem_bytes = 2 * 2 * BN * (HD + 8) * 2
        ctx.enqueue_function[_fa2_kernel[dtype, HD, BM, BN]](
            o,
            lse,
            q,
            k,
            v,
            kv_len,
            params,
            Int32(H),
            Int32(Hkv),
            Int32(S),
            Int32(Skv),
            grid_dim=(ceildiv(S, BM), B * H),
            block_dim=(BM // 16) * 32,
            shared_mem_bytes=smem_bytes,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem_bytes)),
        )

    comptime if DeviceContext.default_device_info.api == "cuda" and (dtype == DType.bfloat16 or dtype == DType.float16):
        # fa2's grid axis 1 is B * H, which CUDA caps at 65535 blocks: larger batches take the row-wise kernel;
        # so do misaligned views (cp.async reads k / v in 16-byte chunks, q and o move in 4-byte pairs): a
        # contiguous view one element into its storage would otherwise fault (misaligned address)
        var fa2_aligned = Int(k) % 16 == 0 and Int(v) % 16 == 0 and Int(q) % 4 == 0 and Int(o) % 4 == 0
        if not force_rowwise and B * H <= 65535 and fa2_aligned:
            # sm_90: the wgmma kernel (_attention_hopper.mojo; TMA also reads q in 16-byte chunks)
            comptime if DeviceContext.default_device_info.compute == 9.0:
                if hopper and Int(q) % 16 == 0:
                    comptime for di in range(3):
                        comptime HDi = 64 << di
                        comptime if HD == 0 or HD == HDi:
                            if D == HDi:
                                attention_hopper_gpu[dtype, HDi](
                                    o, lse, q, k, v, kv_len, params, B, H, Hkv, S, Skv, ctx
                                )
                                return
            comptime if HD == 0 or HD == 64:
                if D == 64:
                    launch_fa2[64]()
                    return
            comptime if HD == 0 or HD == 128:
                if D == 128:
                    launch_fa2[128]()
                    return
            comptime if HD == 0 or HD == 256:
                if D == 256:
                    launch_fa2[256]()
                    return
    if D > 256:
        raise Error("fusekit.attention: head dim > 256 is not supported on the GPU")
    var rows = B * H * S
    ctx.enqueue_function[_attn_rowwise_kernel[dtype]](
        o,
        lse,
        q,
        k,
        v,
        kv_len,
        params,
        Int32(B * H),
        Int32(H),
        Int32(Hkv),
        Int32(S),
        Int32(Skv),
        Int32(D),
        grid_dim=ceildiv(rows, 4),
        block_dim=4 * WARP_SIZE,
    )


# ---- backward ------------------------------------------------------------------------------------


def attention_backward_cpu[
    dtype: DType
](
    dq: Pointer[Scalar[dtype], MutAnyOrigin],
    dk: Pointer[Scalar[dtype], MutAnyOrigin],
    dv: Pointer[Scalar[dtype], MutAnyOrigin],
    do_: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    causal: Bool,
    scale: Float32,
    has_len: Bool,
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
):
    """Plain loops in fp32: per kv head, dk/dv accumulate over the group's heads and all query rows in
    a fixed order (deterministic); dq per query row. Keys past kv_len: never read, zero gradients."""
    var group = H // Hkv
    var dka = List[Float32](length=Skv * D, fill=0)
    var dva = List[Float32](length=Skv * D, fill=0)
    var dqa = List[Float32](length=D, fill=0)
    for b in range(B):
        var kvl = _seq_len(kv_len, has_len, b, Skv)
        for hk in range(Hkv):
            var kv_base = ((b * Hkv + hk) * Skv) * D
            for t in range(Skv * D):
                dka[t] = 0
                dva[t] = 0
            for h in range(hk * group, (hk + 1) * group):
                var q_base = ((b * H + h) * S) * D
                for i in range(S):
                    var qi = q_base + i * D
                    var last = _row_last_key(i, S, kvl, causal)
                    for dd in range(D):
                        dqa[dd] = 0
                    if last >= 0:
                        var lse_i = lse[unsafe_offset=(b * H + h) * S + i]
                        if lse_i == NEG_INF:  # every visible score -inf: p = 0, the forward's zero row
                            lse_i = POS_INF
                        var delta: Float32 = 0
                        for dd in range(D):
                            delta += do_[unsafe_offset=qi + dd].cast[F32]() * o[unsafe_offset=qi + dd].cast[F32]()
                        for j in range(last + 1):
                            var kj = kv_base + j * D
                            var s: Float32 = 0
                            var dp: Float32 = 0
                            for dd in range(D):
                                s += q[unsafe_offset=qi + dd].cast[F32]() * k[unsafe_offset=kj + dd].cast[F32]()
                                dp += do_[unsafe_offset=qi + dd].cast[F32]() * v[unsafe_offset=kj + dd].cast[F32]()
                            var p = _exp_acc(s * scale - lse_i)
                            var ds = p * (dp - delta)
                            for dd in range(D):
                                dqa[dd] += ds * k[unsafe_offset=kj + dd].cast[F32]()
                                dka[j * D + dd] += ds * q[unsafe_offset=qi + dd].cast[F32]()
                                dva[j * D + dd] += p * do_[unsafe_offset=qi + dd].cast[F32]()
                    for dd in range(D):
                        dq[unsafe_offset=qi + dd] = (dqa[dd] * scale).cast[dtype]()
            for t in range(Skv * D):
                dk[unsafe_offset=kv_base + t] = (dka[t] * scale).cast[dtype]()
                dv[unsafe_offset=kv_base + t] = dva[t].cast[dtype]()


def _attn_bwd_delta_kernel[
    dtype: DType
](
    delta: Pointer[Float32, MutAnyOrigin],
    do_: Pointer[Scalar[dtype], MutAnyOrigin],
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    rows: Int64,
    D: Int32,
):
    """delta[row] = sum_d do[row, d] * o[row, d] (fp32), one warp per row."""
    comptime WPB = 4
    var lane = lane_id()
    var row = block_idx.x * WPB + thread_idx.x // WARP_SIZE
    if row >= Int(rows):
        return
    var d = Int(D)
    var part: Float32 = 0
    for dd in range(lane, d, WARP_SIZE):
        part += do_[unsafe_offset=row * d + dd].cast[F32]() * o[unsafe_offset=row * d + dd].cast[F32]()
    var t = warp.sum(part)
    if lane == 0:
        delta[unsafe_offset=row] = t


def _attn_bwd_dq_kernel[
    dtype: DType
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
    BH: Int32,
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
    D: Int32,
):
    """DQ: one warp per query row over its visible keys; lanes split the head dim."""
    comptime PER = 256 // WARP_SIZE
    comptime WPB = 4
    var lane = lane_id()
    var row = block_idx.x * WPB + thread_idx.x // WARP_SIZE  # over B*H*S
    var s_len = Int(S)
    var skv = Int(Skv)
    var d = Int(D)
    if row >= Int(BH) * s_len:
        return
    var bh = row // s_len
    var i = row % s_len
    var b = bh // Int(H)
    var h = bh % Int(H)
    var hk = h // (Int(H) // Int(Hkv))
    var causal = params[unsafe_offset=0] != 0
    var scale = params[unsafe_offset=1]
    var kv_base = ((b * Int(Hkv) + hk) * skv) * d
    var qv = SIMD[F32, PER](0)
    var dov = SIMD[F32, PER](0)
    var acc = SIMD[F32, PER](0)
    comptime for e in range(PER):
        var dd = lane + e * WARP_SIZE
        if dd < d:
            qv[e] = q[unsafe_offset=row * d + dd].cast[F32]()
            dov[e] = do_[unsafe_offset=row * d + dd].cast[F32]()
    var last = _row_last_key(i, s_len, _seq_len(kv_len, params[unsafe_offset=2] != 0, b, skv), causal)
    var lse2 = _bwd_lse2(lse[unsafe_offset=row])
    var dl = delta[unsafe_offset=row]
    for j in range(last + 1):
        var ps: Float32 = 0
        var pd: Float32 = 0
        comptime for e in range(PER):
            var dd = lane + e * WARP_SIZE
            if dd < d:
                ps += qv[e] * k[unsafe_offset=kv_base + j * d + dd].cast[F32]()
                pd += dov[e] * v[unsafe_offset=kv_base + j * d + dd].cast[F32]()
        var p = exp2(warp.sum(ps) * scale * LOG2E - lse2)
        var ds = p * (warp.sum(pd) - dl)
        comptime for e in range(PER):
            var dd = lane + e * WARP_SIZE
            if dd < d:
                acc[e] += ds * k[unsafe_offset=kv_base + j * d + dd].cast[F32]()
    comptime for e in range(PER):
        var dd = lane + e * WARP_SIZE
        if dd < d:
            dq[unsafe_offset=row * d + dd] = (acc[e] * scale).cast[dtype]()


def _attn_bwd_dkdv_kernel[
    dtype: DType
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
    BHkv: Int32,
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
    D: Int32,
):
    """DK/DV: one warp per kv row j, summing the GQA group's heads and the query rows that see j in a
    fixed order (deterministic, no atomics). Keys past kv_len are not read and get zero gradients."""
    comptime PER = 256 // WARP_SIZE
    comptime WPB = 4
    var lane = lane_id()
    var row = block_idx.x * WPB + thread_idx.x // WARP_SIZE  # over B*Hkv*Skv
    var s_len = Int(S)
    var skv = Int(Skv)
    var d = Int(D)
    if row >= Int(BHkv) * skv:
        return
    var bhk = row // skv
    var j = row % skv
    var b = bhk // Int(Hkv)
    var hk = bhk % Int(Hkv)
    var group = Int(H) // Int(Hkv)
    var causal = params[unsafe_offset=0] != 0
    var scale = params[unsafe_offset=1]
    var kv = SIMD[F32, PER](0)
    var vv = SIMD[F32, PER](0)
    var dka = SIMD[F32, PER](0)
    var dva = SIMD[F32, PER](0)
    var kvl = _seq_len(kv_len, params[unsafe_offset=2] != 0, b, skv)
    var i0 = s_len  # first query row that sees key j (s_len: none, for keys past kvl)
    if j < kvl:
        comptime for e in range(PER):
            var dd = lane + e * WARP_SIZE
            if dd < d:
                kv[e] = k[unsafe_offset=row * d + dd].cast[F32]()
                vv[e] = v[unsafe_offset=row * d + dd].cast[F32]()
        i0 = max(0, j - (kvl - s_len)) if causal else 0
    for h in range(hk * group, (hk + 1) * group):
        var bh = b * Int(H) + h
        for i in range(i0, s_len):
            var qrow = bh * s_len + i
            var ps: Float32 = 0
            var pd: Float32 = 0
            comptime for e in range(PER):
                var dd = lane + e * WARP_SIZE
                if dd < d:
                    ps += q[unsafe_offset=qrow * d + dd].cast[F32]() * kv[e]
                    pd += do_[unsafe_offset=qrow * d + dd].cast[F32]() * vv[e]
            var p = exp2(warp.sum(ps) * scale * LOG2E - _bwd_lse2(lse[unsafe_offset=qrow]))
            var ds = p * (warp.sum(pd) - delta[unsafe_offset=qrow])
            comptime for e in range(PER):
                var dd = lane + e * WARP_SIZE
                if dd < d:
                    dva[e] += p * do_[unsafe_offset=qrow * d + dd].cast[F32]()
                    dka[e] += ds * q[unsafe_offset=qrow * d + dd].cast[F32]()
    comptime for e in range(PER):
        var dd = lane + e * WARP_SIZE
        if dd < d:
            dk[unsafe_offset=row * d + dd] = (dka[e] * scale).cast[dtype]()
            dv[unsafe_offset=row * d + dd] = dva[e].cast[dtype]()


def attention_backward_gpu[
    dtype: DType, HD: Int = 0
](
    dq: Pointer[Scalar[dtype], MutAnyOrigin],
    dk: Pointer[Scalar[dtype], MutAnyOrigin],
    dv: Pointer[Scalar[dtype], MutAnyOrigin],
    delta: Pointer[Float32, MutAnyOrigin],
    delta_len: Int,
    do_: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    o: Pointer[Scalar[dtype], MutAnyOrigin],
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
    tensor_cores: Bool = False,
) raises:
    """tensor_cores: take `attention_backward_tc` where it covers the call (see the header), else SIMT. HD: as
    attention_gpu_ws's (the tensor-core kernels of that head dim only; 0: every head dim)."""
    comptime if HD != 0:
        if D != HD:
            raise Error(
                String("fusekit.attention_backward: compiled for head dim ", HD, ", called with ", D)
            )
    if D > 256:
        raise Error("fusekit.attention_backward: head dim > 256 is not supported on the GPU")
    var rows = B * H * S
    # delta is the caller's workspace: one fp32 per query row (specs.py attention_delta)
    check_workspace("fusekit.attention_backward", "delta", delta_len, rows)
    ctx.enqueue_function[_attn_bwd_delta_kernel[dtype]](
        delta, do_, o, Int64(rows), Int32(D), grid_dim=ceildiv(rows, 4), block_dim=4 * WARP_SIZE
    )
    # the tensor-core kernels read q, do, k and v with 16-byte cp.async and store dq / dk / dv in 4-byte pairs:
    # misaligned views (a contiguous view one element into its storage) take the SIMT kernels
    var tc_aligned = (
        Int(q) % 16 == 0 and Int(do_) % 16 == 0 and Int(k) % 16 == 0 and Int(v) % 16 == 0
        and Int(dq) % 4 == 0 and Int(dk) % 4 == 0 and Int(dv) % 4 == 0
    )
    if tensor_cores and tc_aligned and tc_backward_supported[dtype](B, H, Hkv, D):
        attention_backward_tc[dtype, HD](
            dq, dk, dv, delta, do_, q, k, v, lse, kv_len, params, B, H, Hkv, S, Skv, D, ctx
        )
        return
    ctx.enqueue_function[_attn_bwd_dq_kernel[dtype]](
        dq, do_, q, k, v, lse, delta, kv_len, params, Int32(B * H), Int32(H), Int32(Hkv), Int32(S), Int32(Skv), Int32(D),
        grid_dim=ceildiv(rows, 4), block_dim=4 * WARP_SIZE,
    )
    var kv_rows = B * Hkv * Skv
    ctx.enqueue_function[_attn_bwd_dkdv_kernel[dtype]](
        dk, dv, do_, q, k, v, lse, delta, kv_len, params, Int32(B * Hkv), Int32(H), Int32(Hkv), Int32(S), Int32(Skv),
        Int32(D), grid_dim=ceildiv(kv_rows, 4), block_dim=4 * WARP_SIZE,
    )


# ---- registration --------------------------------------------------------------------------------


@register("fusekit.attention")
struct Attention:
    """Outputs (o [B,H,S,D], lse [B,H,S] f32); workspace (part: the decode kernels' split partials, f32);
    inputs (q, k, v, kv_len? [B] int32, params [causal, scale, has_kv_len]). Parameter head_dim: the GPU graph's
    head dim (its kernels only; runtime.py passes it for GPU devices), 0 (default): every head dim."""

    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString, head_dim: Int = 0
    ](
        res: MutableInputTensor[dtype=dtype, rank=4, ...],
        lse: MutableInputTensor[dtype=DType.float32, rank=3, ...],
        part: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        q: InputTensor[dtype=dtype, rank=4, ...],
        k: InputTensor[dtype=dtype, rank=4, ...],
        v: InputTensor[dtype=dtype, rank=4, ...],
        kv_len: InputTensor[dtype=DType.int32, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var B = q.dim_size(0)
        var H = q.dim_size(1)
        var S = q.dim_size(2)
        var D = q.dim_size(3)
        var Hkv = k.dim_size(1)
        var Skv = k.dim_size(2)
        var op = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](res.unsafe_ptr())
        var lp = rebind[Pointer[Float32, MutAnyOrigin]](lse.unsafe_ptr())
        var qp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](q.unsafe_ptr())
        var kp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](k.unsafe_ptr())
        var vp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](v.unsafe_ptr())
        var ip = rebind[Pointer[Int32, MutAnyOrigin]](kv_len.unsafe_ptr())
        var pp = rebind[Pointer[Float32, MutAnyOrigin]](params.unsafe_ptr())
        comptime if target == "gpu":
            var partp = rebind[Pointer[Float32, MutAnyOrigin]](part.unsafe_ptr())
            # params' 4th slot (decode) is there unless switched off (specs.ATTN_DECODE): its presence is read
            attention_gpu_ws[dtype, head_dim](
                op, lp, partp, part.dim_size(0), qp, kp, vp, ip, pp, B, H, Hkv, S, Skv, D, ctx,
                decode=params.dim_size(0) > 3,
            )
        else:  # the CPU path needs no workspace: part is a 1-element dummy, never read
            attention_cpu[dtype](
                op, lp, qp, kp, vp, ip, pp[unsafe_offset=0] != 0, pp[unsafe_offset=1], pp[unsafe_offset=2] != 0,
                B, H, Hkv, S, Skv, D,
            )


@register("fusekit.attention_backward")
struct AttentionBackward:
    """Outputs (dq [B,H,S,D], dk [B,Hkv,Skv,D], dv [B,Hkv,Skv,D]); workspace (delta [B*H*S] f32); inputs
    (do, q, k, v, o, lse [B,H,S] f32, kv_len? [B] int32, params [causal, scale, has_kv_len(, bwd_tc)]). Parameter
    head_dim: as fusekit.attention's."""

    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString, head_dim: Int = 0
    ](
        dq: MutableInputTensor[dtype=dtype, rank=4, ...],
        dk: MutableInputTensor[dtype=dtype, rank=4, ...],
        dv: MutableInputTensor[dtype=dtype, rank=4, ...],
        delta: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        do_: InputTensor[dtype=dtype, rank=4, ...],
        q: InputTensor[dtype=dtype, rank=4, ...],
        k: InputTensor[dtype=dtype, rank=4, ...],
        v: InputTensor[dtype=dtype, rank=4, ...],
        o: InputTensor[dtype=dtype, rank=4, ...],
        lse: InputTensor[dtype=DType.float32, rank=3, ...],
        kv_len: InputTensor[dtype=DType.int32, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var B = q.dim_size(0)
        var H = q.dim_size(1)
        var S = q.dim_size(2)
        var D = q.dim_size(3)
        var Hkv = k.dim_size(1)
        var Skv = k.dim_size(2)
        comptime P = Pointer[Scalar[dtype], MutAnyOrigin]
        var dqp = rebind[P](dq.unsafe_ptr())
        var dkp = rebind[P](dk.unsafe_ptr())
        var dvp = rebind[P](dv.unsafe_ptr())
        var dop = rebind[P](do_.unsafe_ptr())
        var qp = rebind[P](q.unsafe_ptr())
        var kp = rebind[P](k.unsafe_ptr())
        var vp = rebind[P](v.unsafe_ptr())
        var outp = rebind[P](o.unsafe_ptr())
        var lp = rebind[Pointer[Float32, MutAnyOrigin]](lse.unsafe_ptr())
        var ip = rebind[Pointer[Int32, MutAnyOrigin]](kv_len.unsafe_ptr())
        var pp = rebind[Pointer[Float32, MutAnyOrigin]](params.unsafe_ptr())
        comptime if target == "gpu":
            var deltap = rebind[Pointer[Float32, MutAnyOrigin]](delta.unsafe_ptr())
            # params' 4th slot (bwd_tc) is there unless opted out: its presence is read, not its value
            # (that would need a device -> host read)
            attention_backward_gpu[dtype, head_dim](
                dqp, dkp, dvp, deltap, delta.dim_size(0), dop, qp, kp, vp, outp, lp, ip, pp, B, H, Hkv, S, Skv, D, ctx,
                tensor_cores=params.dim_size(0) > 3,
            )
        else:  # the CPU path needs no workspace: delta is a 1-element dummy, never read
            attention_backward_cpu[dtype](
                dqp, dkp, dvp, dop, qp, kp, vp, outp, lp, ip, pp[unsafe_offset=0] != 0, pp[unsafe_offset=1],
                pp[unsafe_offset=2] != 0, B, H, Hkv, S, Skv, D,
            )
