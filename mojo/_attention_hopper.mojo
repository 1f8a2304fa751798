# fusekit.attention forward on Hopper (sm_90), bf16 and fp16 at D 64 / 128 / 256: FlashAttention-3's design in
# Mojo, the path attention_gpu_ws (attention.mojo) takes on an sm_90 GPU for 16-byte aligned q / k / v. The
# contract, masking, kv_len and non-finite rules are attention.mojo's (its header); this file only changes
# how a block computes them.
#
# Block = 1 producer warpgroup (warpgroup 0: setmaxnreg.dec; one thread issues TMA) + NWG consumer
# warpgroups (setmaxnreg.inc), each 64 query rows of one (b, h): BM = 64 NWG rows per block, (NWG, BN) =
# (2, 128) at D128, (3, 128) at D64, (2, 64) at D256. Grid: (query blocks, B * H), heaviest (causal) first.
# Shared memory (all tiles in wgmma's 128-byte-swizzle format, which a [rows, 64] TMA box with SWIZZLE_128B
# writes: columns in 64-element blocks, 16-byte chunk j of row r at j ^ (r % 8); bases 1024-byte aligned):
# Q [BM x D], NS = 2 slots each of K and V [BN x D], then the mbarriers q_full, k_full[NS], k_empty[NS],
# v_full[NS], v_empty[NS] and the `vbad` flag.
# Descriptors (host, per launch): q, k, v as 4-D [B, H(kv), S(kv), D] tensor maps, box [1, 1, rows, 64]:
# rows past S (Skv) arrive as zeros, never another head's; expect_tx counts the full box.
# Producer order K_0, V_0, K_1, V_1, ...; it waits on a slot's "empty" mbarrier (every consumer thread
# arrives once its wgmma read the slot) before refilling it.
# Per consumer tile j: wait V_{j-1}, K_j (a masked tile j - 1: the consumers scan V_{j-1} for non-finite
# values, then a named barrier, since both warpgroups read that slot); issue S_j = Q K_j^T (D / 16
# shared-memory wgmmas: Q and K K-major descriptors, SBO 1024 B, +32 B per k-step, a new 64-column block
# every 4) and O += P_{j-1} V_{j-1} (BN / 16 register-A wgmmas: P straight from the S accumulators, which
# are already the A fragment; V MN-major, SBO 1024 B between 8-key groups, LBO BN x 128 B between 64-column
# blocks); wait S_j (release K_j), softmax (P V_{j-1} still on the tensor cores: FA3's intra-warpgroup
# overlap), wait P V (release V_{j-1}), O *= alpha. Pingpong (PP, FA3's inter-warpgroup schedule): each
# consumer warpgroup issues its GEMMs only after the previous one issued its own (named barriers 2..), so
# one warpgroup's softmax runs while the other's GEMMs do.
# Accumulators: the m64nNk16 layout is mma.sync's m16n8 C layout per warp repeated over N / 8, so the online
# softmax is `_fa2_kernel`'s (quad shuffles); warp i of a warpgroup owns rows 16i.., each thread rows g and
# g + 8 (g = lane / 4). fp16: S through the shared-memory wgmma (f16 operands), P V through `_pv_f16` (our
# register-A wgmma asm, one m64n64k16 per 64 output columns: MAX's register-A wgmma is bf16 only).
#
# Measured (H200, harness FUSEKIT_HARNESS_ONLY=attn_fwd, B4 H32 S4096, wall per call), TFLOP/s:
#   bf16 D128 606, causal 528; D64 403 / 347; D256 603 / 549; fp16 D128 543, D64 431 (98bbce5).
#   Steps at D128 (non-causal / causal): `_fa2_kernel` (mma.sync) 224 / 210; this loop with every thread
#   issuing cp.async copies and one block barrier per tile (466fe8e) 406 / 363; the producer warpgroup,
#   TMA and mbarriers 569 / 481; pingpong (e1fbea7) 579 / 503 (non-causal within the +-3% run-to-run
#   noise); the scale folded into the exp2 FMA (98bbce5) 606 / 528.
#   Benchmark (attention.json, GPU time, SDPA in the same run) at e1fbea7: 0.50-0.94x SDPA, median 0.82x.
# Lessons from ptxas (info lines) on this loop:
#   - a branch around wgmma issue (the first P V only from tile 1 on) made ptxas serialise every wgmma
#     (C7513): tile 0 is peeled;
#   - zeroing the S accumulator after the fence did the same: `scale_d = 0` on the first k-step instead;
#   - LLVM hoisted accumulator reads above the wgmma wait (C7514): `_pin` after each wait;
#   - writing P (the A registers) while a P V group is in flight serialises (C7513), converting it inside a
#     wgmma chain injects warpgroup.arrive (C7519): P is converted after the P V wait;
#   - a runtime mask branch was if-converted into ~430 compares and selects per tile (SASS): the masked and
#     unmasked softmax are separate instantiations;
#   - setmaxnreg is ignored (C7508) without `nvvm.minctasm`.
# Tried and not kept: a persistent grid (one block per SM walking the work tiles): +12% at B32 S512 and +8%
# at B8 S2048 non-causal, but 164-420 bytes of spills (the loop's state; the producer at 24 registers) cost
# 6% at S4096 and causal lost up to 40% (static round-robin: with 132 blocks and 22 query blocks per head a
# block drew the same query block every round). A second try (rounds alternating direction, per-tile
# constants recomputed, the producer at 32 registers) still spilled 108-124 bytes at D128 (0 with 256 consumer
# registers) and was not timed: its 32 + 2 x 240 setmaxnreg hung. Also not kept: a conditional O rescale.
# Next, for short sequences (B32 S512: 0.52-0.72x SDPA, each block's Q / K_0 latency and epilogue exposed):
# the persistent grid again, with setmaxnreg 24 / 240 - a work-tile function, rounds alternating direction,
# a q_empty mbarrier the consumers arrive on after their last S, ring positions and the Q phase carried
# across work tiles, vbad per work-tile parity holding an epoch, pingpong reset per work tile. Its D128 main
# loop had no spill instruction in SASS (D64 / D256 did: 160 / 240 registers are tight there).
# compute-sanitizer racecheck and synccheck on the harness: clean (e1fbea7).

from std.math import ceildiv, exp2
from std.memory import bitcast
from std.sys import _RegisterPackType
from std.sys._assembly import inlined_assembly
from std.utils import IndexList
from std.utils.static_tuple import StaticTuple
from max.gpu import thread_idx, block_idx, barrier, AddressSpace, external_memory, MAX_THREADS_PER_BLOCK_METADATA
from max.gpu.host import DeviceContext, FuncAttribute, DeviceBuffer
from max.gpu.host.nvidia.tma import TensorMapSwizzle, TMADescriptor, create_tma_descriptor
from max.gpu.memory import cp_async_bulk_tensor_shared_cluster_global, fence_async_view_proxy, fence_mbarrier_init
from max.gpu.sync import named_barrier, named_barrier_arrive
from max.gpu.intrinsics import warpgroup_reg_alloc, warpgroup_reg_dealloc
from max.gpu.compute.mma import (
    wgmma_async,
    wgmma_fence_aligned,
    wgmma_commit_group_sync,
    wgmma_wait_group_sync,
    WGMMADescriptor,
)
from layout.tma_async import SharedMemBarrier

from ._attention_decode import _finish_log2, _nmax, _nonfinite, _quad_max, _quad_sum

comptime _NS = 2  # K and V slots each
comptime _LOG2E: Float32 = 1.4426950408889634
comptime _NEG_INF = Float32.MIN  # -inf
comptime _F32 = DType.float32
comptime _SW128 = TensorMapSwizzle.SWIZZLE_128B


@always_inline
def hopper_nwg(d: Int) -> Int:
    """Consumer warpgroups per block: 3 at D 64 (BM 192, as FA3), else 2 (H200 sweep beside the header)."""
    return 3 if d == 64 else 2


@always_inline
def hopper_bn(d: Int) -> Int:
    """Keys per tile: 128 at D 64 / 128, 64 at D 256 (its O accumulator alone is 128 registers)."""
    return 64 if d == 256 else 128


@always_inline
def hopper_smem_bytes(d: Int, nwg: Int, bn: Int) -> Int:
    """Q + NS slots each of K and V (2-byte elements) + 1 KB for the run-time 1024-byte round-up + 256 bytes of
    mbarriers and the vbad flag."""
    return (64 * nwg * d + 2 * _NS * bn * d) * 2 + 1024 + 256


@always_inline
def _regs(nwg: Int) -> Tuple[Int, Int]:
    """setmaxnreg (producer, consumer) per thread. The pool is what the block got at entry: 128 (NWG + 1)
    threads x the entry count ptxas picks for .maxntid (65536 / threads rounded down to a multiple of 8: 168 at
    384 threads, 128 at 512), so P + NWG C <= 504 at NWG 2 and <= 512 at NWG 3. Past the pool setmaxnreg.inc
    waits forever (a persistent-grid build with 32 + 2 x 240 hung on the H200)."""
    if nwg == 1:
        return (40, 232)
    if nwg == 2:
        return (24, 240)
    return (24, 160)


@always_inline
def _pv_f16(a: SIMD[DType.float16, 8], desc: WGMMADescriptor, c: SIMD[_F32, 32]) -> SIMD[_F32, 32]:
    """wgmma m64n64k16 f32 += f16 x f16 with A from registers (the mma.sync m16n8k16 A fragment per warp) and B
    MN-major (transposed, V [K, N] row-major) from a shared-memory descriptor; one 64-column block of O."""
    var a0 = bitcast[DType.uint32, 1](a.slice[2, offset=0]())
    var a1 = bitcast[DType.uint32, 1](a.slice[2, offset=2]())
    var a2 = bitcast[DType.uint32, 1](a.slice[2, offset=4]())
    var a3 = bitcast[DType.uint32, 1](a.slice[2, offset=6]())
    # fmt: off
    var r = inlined_assembly[
        """{
        .reg .pred p;
        setp.ne.b32 p, $37, 0;
        wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16
        {$0, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
         $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31},
        {$32, $33, $34, $35}, $36, p, 1, 1, 1;
        }""",
        _RegisterPackType[
            Float32, Float32, Float32, Float32, Float32, Float32, Float32, Float32,
            Float32, Float32, Float32, Float32, Float32, Float32, Float32, Float32,
            Float32, Float32, Float32, Float32, Float32, Float32, Float32, Float32,
            Float32, Float32, Float32, Float32, Float32, Float32, Float32, Float32,
        ],
        constraints="=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,"
        + "r,r,r,r,l,n,"
        + "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31",
    ](
        a0, a1, a2, a3, desc.desc, 1,
        c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12], c[13], c[14], c[15],
        c[16], c[17], c[18], c[19], c[20], c[21], c[22], c[23], c[24], c[25], c[26], c[27], c[28], c[29], c[30],
        c[31],
    )
    return SIMD[_F32, 32](
        r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15],
        r[16], r[17], r[18], r[19], r[20], r[21], r[22], r[23], r[24], r[25], r[26], r[27], r[28], r[29], r[30], r[31],
    )
    # fmt: on


@always_inline
def _pin[N: Int](v: SIMD[_F32, N]) -> SIMD[_F32, N]:
    """v through an empty volatile asm per register (CUTLASS's warpgroup_fence_operand): code reading a
    wgmma accumulator stays after the wgmma wait that precedes this (LLVM sees the accumulators as ready at
    the wgmma itself and hoisted `S * scale` above the wait: ptxas then serialised the wgmmas, C7514)."""
    var r = v
    comptime for i in range(N):
        r[i] = inlined_assembly["", Float32, constraints="=f,0", has_side_effect=True](v[i])
    return r


@always_inline
def _softmax_tile[
    N: Int, MASKED: Bool
](
    sacc: SIMD[_F32, N],
    scale2: Float32,
    rel: SIMD[DType.int32, 2],
    mut m_i: SIMD[_F32, 2],
    mut l_i: SIMD[_F32, 2],
) -> Tuple[SIMD[_F32, N], SIMD[_F32, 2]]:
    """One key tile's online-softmax step on a thread's S accumulators (rows g and g + 8, keys
    8jn + 2t4 + {0, 1} of the tile): scale to the log2 domain, mask, NaN-propagating row max over the quad,
    p = exp2(s - max); updates m_i and l_i, returns (p, alpha).
    MASKED (a tile crossing kvl or a row's causal diagonal): rel[h] is row h's last visible key minus the
    tile's first key minus 2 t4, so key column c of n8 block jn is masked iff 8jn + c > rel[h]: one compare
    per score against an immediate. A runtime mask branch inside one body was if-converted by the compiler
    into ~430 compares and selects on every tile (SASS, H200), hence two instantiations.
    Works on a copy: sacc's registers are an input of the next S wgmma, and written while a P V group is in
    flight they would make ptxas serialise the wgmmas (C7513)."""
    var sv = sacc  # raw scores: the scale is folded into the exp2 FMA (scale2 > 0, so the row max commutes
    # with it exactly: max(s) * c == max(s * c) under round-to-nearest)
    comptime if MASKED:
        comptime for jn in range(N // 4):
            comptime for e in range(4):
                if Int32(8 * jn + (e % 2)) > rel[e // 2]:
                    sv[4 * jn + e] = _NEG_INF
    var mt = SIMD[_F32, 2](_NEG_INF)
    comptime for jn in range(N // 4):
        mt[0] = _nmax(mt[0], _nmax(sv[4 * jn], sv[4 * jn + 1]))
        mt[1] = _nmax(mt[1], _nmax(sv[4 * jn + 2], sv[4 * jn + 3]))
    mt = _quad_max(mt)
    var mx = SIMD[_F32, 2](_nmax(m_i[0], mt[0] * scale2), _nmax(m_i[1], mt[1] * scale2))
    var mref = SIMD[_F32, 2](0)  # a row with nothing visible yet keeps -inf: 0 there
    comptime for r in range(2):
        mref[r] = mx[r] if mx[r] > _NEG_INF else Float32(0)
    var alpha = SIMD[_F32, 2](exp2(m_i[0] - mref[0]), exp2(m_i[1] - mref[1]))
    m_i = mx
    var rs = SIMD[_F32, 2](0)
    comptime for jn in range(N // 4):
        comptime for e in range(4):
            var p = exp2(sv[4 * jn + e].fma(scale2, -mref[e // 2]))
            sv[4 * jn + e] = p
            rs[e // 2] += p
    l_i = l_i * alpha + rs
    return (sv, alpha)


@__llvm_arg_metadata(qd, `nvvm.grid_constant`)
@__llvm_arg_metadata(kd, `nvvm.grid_constant`)
@__llvm_arg_metadata(vd, `nvvm.grid_constant`)
@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(128 * (NWG + 1))))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(1))  # ptxas honours setmaxnreg only when it knows the entry count
def _fa3_kernel[
    dtype: DType, D: Int, BN: Int, NWG: Int, PP: Bool
](
    qd: TMADescriptor,
    kd: TMADescriptor,
    vd: TMADescriptor,
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    lse: Pointer[Float32, MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    kv_len: Pointer[Int32, MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    H: Int32,
    Hkv: Int32,
    S: Int32,
    Skv: Int32,
):
    comptime BM = 64 * NWG
    comptime NC = 128 * NWG  # consumer threads
    comptime TILE = BN * D  # elements of one K (or V) slot
    comptime K_OFF = BM * D
    comptime V_OFF = K_OFF + _NS * TILE
    comptime BAR_OFF = V_OFF + _NS * TILE
    comptime CPR = D // 8  # 16-byte chunks per row
    comptime KV_CHUNKS = BN * CPR
    comptime NON = D // 8  # n8 blocks of O
    comptime PREG = _regs(NWG)[0]
    comptime CREG = _regs(NWG)[1]

    var raw = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024]()
    var pad = ((Int(raw) + 1023) & ~1023) - Int(raw)  # bytes; 0 when .align 1024 is honoured
    var qs = raw.unsafe_offset(pad // 2)
    var bars = qs.unsafe_offset(BAR_OFF).unsafe_bitcast[SharedMemBarrier]()
    var q_full = bars
    var k_full = bars.unsafe_offset(1)
    var k_empty = bars.unsafe_offset(1 + _NS)
    var v_full = bars.unsafe_offset(1 + 2 * _NS)
    var v_empty = bars.unsafe_offset(1 + 3 * _NS)
    var vbad = bars.unsafe_offset(1 + 4 * _NS).unsafe_bitcast[Int32]()

    var tid = thread_idx.x
    var wg = tid // 128
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
    var kvl = skv
    if params[unsafe_offset=2] != 0:  # untrusted lengths: clamped, so no read outside k / v
        kvl = min(max(Int(kv_len[unsafe_offset=b]), 0), skv)
    var off = kvl - s_len  # bottom-right alignment against this sequence's length
    var kv_end = kvl
    if causal:
        kv_end = min(kvl, m0 + BM + off)
    var n_tiles = ceildiv(kv_end, BN) if kv_end > 0 else 0

    if tid == 0:
        q_full[].init(1)
        comptime for s in range(_NS):
            k_full[unsafe_offset=s].init(1)  # one arrival: the producer's arrive.expect_tx
            v_full[unsafe_offset=s].init(1)
            k_empty[unsafe_offset=s].init(Int32(NC))  # every consumer thread, once its wgmma read the slot
            v_empty[unsafe_offset=s].init(Int32(NC))
        vbad[] = 0
        fence_mbarrier_init()
        fence_async_view_proxy()
    barrier()

    if wg == 0:
        # ---------------- producer ----------------
        warpgroup_reg_dealloc[PREG]()
        if tid == 0 and n_tiles > 0:
            var qp = Pointer(to=qd).unsafe_bitcast[NoneType]()
            var kp = Pointer(to=kd).unsafe_bitcast[NoneType]()
            var vp = Pointer(to=vd).unsafe_bitcast[NoneType]()
            q_full[].expect_bytes(Int32(BM * D * 2))
            comptime for j in range(D // 64):  # one [BM, 64] box per 64-column block (innermost coordinate first)
                cp_async_bulk_tensor_shared_cluster_global(
                    qs.unsafe_offset(j * BM * 64), qp, q_full, IndexList[4](64 * j, m0, h, b)
                )
            @always_inline
            def load_kv[IS_V: Bool](t: Int) {var}:
                """K_t (V_t) into slot t % NS once the slot's empty barrier passed (a fresh slot's at once:
                phase 1): D / 64 [BN, 64] boxes (innermost coordinate first) completing on its full barrier."""
                var s = t % _NS
                var full = (v_full if IS_V else k_full).unsafe_offset(s)
                (v_empty if IS_V else k_empty)[unsafe_offset=s].wait(UInt32(((t // _NS) & 1) ^ 1))
                full[].expect_bytes(Int32(TILE * 2))
                comptime for j in range(D // 64):
                    var dst = qs.unsafe_offset((V_OFF if IS_V else K_OFF) + s * TILE + j * BN * 64)
                    var box = IndexList[4](64 * j, t * BN, hk, b)
                    comptime if IS_V:  # (two calls: the descriptor pointers differ in type, by origin)
                        cp_async_bulk_tensor_shared_cluster_global(dst, vp, full, box)
                    else:
                        cp_async_bulk_tensor_shared_cluster_global(dst, kp, full, box)

            for t in range(n_tiles):
                load_kv[False](t)
                load_kv[True](t)
        return

    # ---------------- consumers ----------------
    warpgroup_reg_alloc[CREG]()
    var ct = tid - 128  # consumer thread 0..NC-1
    var cw = wg - 1
    var lane = tid % 32
    var wi = (tid % 128) // 32
    var g = lane // 4
    var t4 = lane % 4
    var scale2 = params[unsafe_offset=1] * _LOG2E
    var q_base = (bh * s_len) * D
    var kv_base = ((b * Int(Hkv) + hk) * skv) * D
    var wrow0 = m0 + 64 * cw + 16 * wi  # this warp's first row
    var row0 = wrow0 + g  # this thread's rows: row0, row0 + 8
    var qw = qs.unsafe_offset(cw * 64 * 64)  # this warpgroup's 64 rows (8 KB into each column block)

    @always_inline
    def tile_masked(tile: Int) {var} -> Bool:
        """Some row of this block must not see all of the tile's keys (uniform across the block)."""
        var kb = tile * BN
        return kb + BN > kvl or (causal and kb + BN - 1 > m0 + off)

    @always_inline
    def scan_v(tile: Int) {var}:
        """A masked tile: the consumers zero its non-finite V values (p = 0 * NaN would be NaN in the MMA); the
        rows that do see them get them back after the loop (vbad). Then the named barrier: no warpgroup's
        P V reads the slot before every chunk is scanned."""
        var vsl = qs.unsafe_offset(V_OFF + (tile % _NS) * TILE)
        comptime for i in range(ceildiv(KV_CHUNKS, NC)):
            var c = ct + i * NC
            if c < KV_CHUNKS:
                var p8 = vsl.unsafe_offset(c * 8)  # layout-blind: every chunk once
                var x8 = p8.unsafe_load[width=8, alignment=16](0)
                var f8 = x8.cast[_F32]()
                var any_bad = False
                comptime for e in range(8):
                    if _nonfinite(f8[e]):
                        x8[e] = 0
                        any_bad = True
                if any_bad:
                    p8.unsafe_store[alignment=16](0, x8)
                    vbad[] = 1
        fence_async_view_proxy()  # the scan's stores -> the async proxy the wgmma reads
        named_barrier[Int32(NC)](1)

    @always_inline
    def wait_v(tile: Int) {var}:
        """V_tile landed (and, on a masked tile, scanned)."""
        v_full[unsafe_offset=tile % _NS].wait(UInt32((tile // _NS) & 1))
        if tile_masked(tile):
            scan_v(tile)

    @always_inline
    def s_chain(it: Int, acc: SIMD[_F32, BN // 2]) {var} -> SIMD[_F32, BN // 2]:
        """Issue S = Q K_it^T (this warpgroup's 64 rows x BN keys; one commit group). The first k-step
        ignores the accumulator (scale_d = 0), so acc's registers need no zeroing movs after the fence."""
        var ks = qs.unsafe_offset(K_OFF + (it % _NS) * TILE)
        var res = acc
        wgmma_fence_aligned()
        comptime for kk in range(D // 16):
            var da = WGMMADescriptor.create[64, 1, _SW128](qw.unsafe_offset((kk // 4) * BM * 64 + (kk % 4) * 16))
            var db = WGMMADescriptor.create[64, 1, _SW128](ks.unsafe_offset((kk // 4) * BN * 64 + (kk % 4) * 16))
            res = wgmma_async[64, BN, 16, a_type=dtype, b_type=dtype, scale_d = 0 if kk == 0 else 1](da, db, res)
        wgmma_commit_group_sync()
        return res

    @always_inline
    def pv(pf: SIMD[dtype, BN // 2], tile: Int, acc: SIMD[_F32, D // 2]) {var} -> SIMD[_F32, D // 2]:
        """Issue O += P V for `tile` (one commit group): k-step kc = keys 16kc..16kc+15 of the slot."""
        var vsl = qs.unsafe_offset(V_OFF + (tile % _NS) * TILE)
        var res = acc
        wgmma_fence_aligned()
        comptime for kc in range(BN // 16):
            comptime if dtype == DType.bfloat16:
                var dv = WGMMADescriptor.create[64, BN * 8, _SW128](vsl.unsafe_offset(kc * 16 * 64))
                res = wgmma_async[64, D, 16, a_type=dtype, b_type=dtype, layout_b="row"](
                    pf.slice[8, offset = 8 * kc](), dv, res
                )
            else:  # fp16: one m64n64 per 64-column block of O (column block j of V at j * BN * 64)
                var a = rebind[SIMD[DType.float16, 8]](pf.slice[8, offset = 8 * kc]())
                comptime for j in range(D // 64):
                    var dv = WGMMADescriptor.create[64, BN * 8, _SW128](vsl.unsafe_offset(j * BN * 64 + kc * 16 * 64))
                    var part = _pv_f16(a, dv, res.slice[32, offset = 32 * j]())
                    res = res.insert[offset = 32 * j](part)
        wgmma_commit_group_sync()
        return res

    # pingpong (PP, FA3's inter-warpgroup schedule): consumer warpgroup c issues its GEMMs only after
    # warpgroup c - 1 issued its own (named barrier 2 + c: 128 threads sync, the previous warpgroup's 128
    # arrive), so the tensor cores run one warpgroup's GEMMs while the other does its softmax. Warpgroup 0
    # goes first (the last warpgroup's arrive up front); the last warpgroup skips its arrive after its last
    # issue, so every barrier ends complete.
    comptime PPON = PP and NWG > 1

    @always_inline
    def sched_sync() {var}:
        comptime if PPON:
            named_barrier[Int32(256)](Int32(2 + cw))

    @always_inline
    def sched_arrive(final: Bool) {var}:
        comptime if PPON:
            if not (final and cw == NWG - 1):
                named_barrier_arrive[Int32(256)](Int32(2 + (cw + 1) % NWG))

    comptime if PPON:
        if cw == NWG - 1 and n_tiles > 0:
            named_barrier_arrive[Int32(256)](Int32(2))

    var oacc = SIMD[_F32, D // 2](0)
    var m_i = SIMD[_F32, 2](_NEG_INF)  # running max (log2 domain), rows g / g + 8
    var l_i = SIMD[_F32, 2](0)
    var pf_prev = SIMD[dtype, BN // 2](0)
    var sacc = SIMD[_F32, BN // 2](0)

    var last = SIMD[DType.int32, 2](0)  # each row's last visible key (-1 or less: none)
    comptime for hh in range(2):
        last[hh] = Int32(min(kvl - 1, row0 + 8 * hh + off) if causal else kvl - 1)

    @always_inline
    def masked(it: Int) {var} -> Bool:
        """Tile it crosses kvl or this warp's causal diagonal (uniform per warp)."""
        var kb = it * BN
        return kb + BN > kvl or (causal and kb + BN - 1 > wrow0 + off)

    if n_tiles > 0:
        q_full[].wait(UInt32(0))
        k_full[].wait(UInt32(0))
        sched_sync()
        sacc = s_chain(0, sacc)
        sched_arrive(False)
        wgmma_wait_group_sync[0]()
        _ = k_empty[].arrive()
        sacc = _pin[BN // 2](sacc)
        var r0 = (
            _softmax_tile[BN // 2, True](sacc, scale2, last - Int32(2 * t4), m_i, l_i) if masked(0) else
            _softmax_tile[BN // 2, False](sacc, scale2, last, m_i, l_i)
        )
        pf_prev = r0[0].cast[dtype]()  # O is still 0: no rescale
    for it in range(1, n_tiles):
        var s = it % _NS
        wait_v(it - 1)
        k_full[unsafe_offset=s].wait(UInt32((it // _NS) & 1))
        sched_sync()
        sacc = s_chain(it, sacc)
        oacc = pv(pf_prev, it - 1, oacc)
        sched_arrive(False)
        wgmma_wait_group_sync[1]()  # S done; P V_{it-1} may still run
        _ = k_empty[unsafe_offset=s].arrive()
        sacc = _pin[BN // 2](sacc)
        var r = (
            _softmax_tile[BN // 2, True](sacc, scale2, last - Int32(it * BN + 2 * t4), m_i, l_i) if masked(it) else
            _softmax_tile[BN // 2, False](sacc, scale2, last, m_i, l_i)
        )
        wgmma_wait_group_sync[0]()  # P V_{it-1} done: O may be rescaled, V_{it-1}'s slot is free
        _ = v_empty[unsafe_offset=(it - 1) % _NS].arrive()
        pf_prev = r[0].cast[dtype]()  # after the P V wait (C7513 / C7519: the header)
        var alpha = r[1]
        comptime for jo in range(NON):
            comptime for e in range(4):
                oacc[4 * jo + e] = oacc[4 * jo + e] * alpha[e // 2]

    if n_tiles > 0:  # the last tile's P V
        wait_v(n_tiles - 1)
        sched_sync()
        oacc = pv(pf_prev, n_tiles - 1, oacc)
        sched_arrive(True)
        wgmma_wait_group_sync[0]()
        _ = v_empty[unsafe_offset=(n_tiles - 1) % _NS].arrive()

    # ---- rare path (a masked tile had a non-finite V, zeroed in shared memory): those rows add the non-finite
    # values they see back from global memory (the float64 result is then non-finite there too). Every
    # scan is followed by a named barrier this warpgroup passed, so vbad is final here.
    if vbad[] != 0:
        comptime for half in range(2):
            var r = row0 + 8 * half
            if r < s_len:
                var jend = min(kvl, r + off + 1) if causal else kvl
                for j in range(jend):
                    comptime for jo in range(NON):
                        comptime for c in range(2):
                            var val = v[unsafe_offset=kv_base + j * D + 8 * jo + 2 * t4 + c].cast[_F32]()
                            if _nonfinite(val):
                                oacc[4 * jo + 2 * half + c] += val

    # ---- finish: divide by the row sums (quad-reduced); lse in natural log; rows with no visible key
    # write o = 0, lse = -inf
    l_i = _quad_sum(l_i)
    comptime for half in range(2):
        var r = row0 + 8 * half
        if r < s_len:
            var inv: Float32 = 0
            var lrow = _NEG_INF
            if kvl > 0 and (not causal or r + off >= 0):
                var f = _finish_log2(m_i[half], l_i[half])
                inv = f[0]
                lrow = f[1]
            comptime for jo in range(NON):
                var val = SIMD[_F32, 2](oacc[4 * jo + 2 * half], oacc[4 * jo + 2 * half + 1]) * inv
                o.unsafe_store[width=2, alignment=4](q_base + r * D + 8 * jo + 2 * t4, val.cast[dtype]())
            if t4 == 0:
                lse[unsafe_offset=bh * s_len + r] = lrow


def _tma_map[
    dtype: DType
](
    ctx: DeviceContext, p: Pointer[Scalar[dtype], MutAnyOrigin], B: Int, H: Int, S: Int, D: Int, rows: Int
) raises -> TMADescriptor:
    """The tensor map of a contiguous [B, H, S, D] tensor (a non-owning view of the caller's pointer), loaded
    as [1, 1, rows, 64] boxes with the 128-byte swizzle; shapes, strides and box outermost first."""
    var view = DeviceBuffer[dtype](ctx, p, B * H * S * D, owning=False)
    return create_tma_descriptor[dtype, 4, _SW128](
        view, IndexList[4](B, H, S, D), IndexList[4](H * S * D, S * D, D, 1), IndexList[4](1, 1, rows, 64)
    )


def attention_hopper_gpu[
    dtype: DType, D: Int, NWG: Int = hopper_nwg(D), BN: Int = hopper_bn(D), PP: Bool = True
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
    ctx: DeviceContext,
) raises:
    """Launch `_fa3_kernel` (the caller checked bf16 / fp16, D in {64, 128, 256}, an sm_90 target,
    B * H <= 65535 and 16-byte aligned q / k / v: TMA needs 16-byte aligned bases and strides)."""
    comptime BM = 64 * NWG
    comptime smem = hopper_smem_bytes(D, NWG, BN)
    var qd = _tma_map(ctx, q, B, H, S, D, BM)
    var kd = _tma_map(ctx, k, B, Hkv, Skv, D, BN)
    var vd = _tma_map(ctx, v, B, Hkv, Skv, D, BN)
    ctx.enqueue_function[_fa3_kernel[dtype, D, BN, NWG, PP]](
        qd,
        kd,
        vd,
        o,
        lse,
        v,
        kv_len,
        params,
        Int32(H),
        Int32(Hkv),
        Int32(S),
        Int32(Skv),
        grid_dim=(ceildiv(S, BM), B * H),
        block_dim=128 * (NWG + 1),
        shared_mem_bytes=smem,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
    )
