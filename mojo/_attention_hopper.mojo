# fusekit.attention forward on Hopper (sm_90): FlashAttention-2's loop on warpgroup MMA (wgmma), the path
# attention_gpu_ws (attention.mojo) takes for bf16 at D 64 / 128 / 256 on an sm_90 GPU. The contract,
# masking, kv_len and non-finite rules are attention.mojo's (its header); this file only changes how the two
# GEMMs of a key tile run.
#
# Why: `_fa2_kernel` issues mma.sync (m16n8k16, one warp each), which reaches ~0.34x SDPA on the H200
# (202 of 604 TFLOP/s at B4 H32 S4096 D128). wgmma is Hopper's asynchronous warpgroup MMA: one instruction
# per 64 x N x 16 step for 4 warps, B (and here Q as A) read straight from swizzled shared memory, P fed
# from registers.
#
# One block = NWG warpgroups (128 threads each) = BM = 64 NWG query rows of one (b, h); warpgroup w owns rows
# 64w..64w+63 (wgmma M = 64), and inside it warp i rows 16i..16i+15, each thread rows g and g+8 (g = lane / 4):
# the m64nNk16 accumulator is mma.sync's m16n8 C layout per warp, repeated over N / 8, so the online softmax
# is `_fa2_kernel`'s (quad shuffles), and the S accumulator registers 8kc..8kc+7 are, in order, the A fragment
# of P for k-step kc of O += P V (no shuffle, no shared memory).
# Shared memory, all tiles in wgmma's 128-byte-swizzle format (_swz: columns in 64-element blocks, 16-byte
# chunk j of row r at j ^ (r % 8), tile bases 1024-byte aligned):
#   Q [BM x D] once, then 2 slots each of K [BN x D] and V [BN x D], filled with cp.async (16 bytes per copy,
#   every thread of the block).
#   (NWG, BN) per head dim: D 64 (1, 64): 8 + 4 x 8 KB = 40 KB; D 128 (2, 128): 32 + 4 x 32 = 160 KB;
#   D 256 (2, 64): 64 + 4 x 32 = 192 KB.
# Per tile j: S_j = Q K_j^T (D / 16 wgmmas, Q and K K-major descriptors, SBO 1024 B), then O += P_{j-1} V_{j-1}
# (BN / 16 wgmmas, A = P from registers, V an MN-major descriptor: SBO 1024 B between 8-key groups, LBO
# BN x 128 B between 64-column blocks) issued right behind it; while both run, the block's threads issue the
# copies of K_{j+1} and V_j; then the S wait, mask, online softmax in the log2 domain (P V_{j-1} still on the
# tensor cores: FA3's intra-warpgroup overlap), the P V wait, O *= alpha. One barrier per tile.
# Registers: S BN / 2 + O D / 2 fp32 + P BN / 4 (ptxas sm_90a: 147-246, no spills at the chosen configs).
# Shared memory written by cp.async or st.shared (the generic proxy) is fenced (fence.proxy.async) before a
# barrier and the wgmma that reads it (the async proxy).
#
# Softmax: `_softmax_tile` has a masked and an unmasked instantiation (a tile crossing kvl or a row's causal
# diagonal takes the masked one: one compare per score against the row's last visible key); S is pinned
# after its wgmma wait (`_pin`); a masked tile's V is scanned for non-finite values after the tile's barrier.
#
# Measured (H200, bf16, B4 H32 S4096, harness FUSEKIT_HARNESS_ONLY=attn_fwd, wall per call, _fa2_kernel in the
# same run), TFLOP/s at 466fe8e: D128 406 (fa2 224), causal 363 (210); D64 299 (152), causal 273 (144); D256
# 478 (198), causal 427 (189). Steps at D128: the FA2 loop on wgmma 286; the overlap with the P V issued only
# from the second tile (a branch around wgmmas) made ptxas serialise every wgmma (info C7513): 263; tile 0
# peeled: 309; one barrier per tile with the copies issued behind the wgmmas: 332; the masked / unmasked
# softmax instantiations and `_pin`: 406. Through the benchmark (attention.json at 466fe8e, SDPA in the same
# run): 0.51-0.74x SDPA over the 36-case sweep, median 0.65x. ncu at 332 TFLOP/s (D128): occupancy 12.5%
# (8 warps per SM: registers and shared memory), ALU pipe the busiest (54%), no eligible warp 53% of cycles.
# Configuration sweep (FUSEKIT_HARNESS_SWEEP=1, at 466fe8e), TFLOP/s non-causal / causal:
#   D128 (2, 128) 404 / 365, (2, 64) 384 / 347, (1, 64) 365 / 334; D64 (1, 64) 299 / 276, (1, 128) 307 / 273,
#   (2, 64) 264 / 240; D256 (2, 64) 478 / 432.
# Tried and slower: the scale folded into the exp2 FMA with a rescale skipped where alpha = 1 (four softmax
# instantiations; D64 299 -> 265, D128 406 -> 405, D256 478 -> 468).
# Not yet: FA3's producer warp with TMA and mbarriers (the copies still cost every thread instructions, and
# the per-tile barrier keeps the warpgroups in lockstep, so their softmaxes coincide: no pingpong), fp16
# (MAX's register-A wgmma is bf16 only: fp16 keeps `_fa2_kernel`). For the producer, these compile for sm_90
# in 26.7 (a probe, not yet run):
#   - `max.gpu.host.nvidia.tma.create_tma_descriptor[dtype, rank, SWIZZLE_128B]` on a non-owning DeviceBuffer of
#     our pointer, with shapes, strides and box outermost first, passed by value with
#     @__llvm_arg_metadata(desc, `nvvm.grid_constant`);
#   - `cp_async_bulk_tensor_shared_cluster_global`, whose coordinates are innermost first;
#   - `SharedMemBarrier` init / expect_bytes / wait / arrive, and `fence_mbarrier_init`;
#   - `warpgroup_reg_alloc` / `warpgroup_reg_dealloc`, which ptxas ignores (C7508) without
#     @__llvm_metadata(`nvvm.minctasm`=...);
#   - `named_barrier`.
# A [rows, 64] box with the 128B swizzle lands in `_swz`'s layout.
# The scan-after-barrier order (compute-sanitizer racecheck found the scan racing the cp.async writes at
# 466fe8e) is built and ptxas-checked but not yet run on a GPU.

from std.math import ceildiv, exp2, log2
from std.memory import unsafe_stack_allocation
from max.gpu import thread_idx, block_idx, barrier, AddressSpace, external_memory
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group, fence_async_view_proxy
from max.gpu.compute.mma import (
    wgmma_async,
    wgmma_fence_aligned,
    wgmma_commit_group_sync,
    wgmma_wait_group_sync,
    WGMMADescriptor,
)
from max.gpu.host.nvidia.tma import TensorMapSwizzle
from std.sys._assembly import inlined_assembly

from ._attention_decode import _nmax, _nonfinite, _quad_max, _quad_sum

comptime _LOG2E: Float32 = 1.4426950408889634
comptime _LN2: Float32 = 0.6931471805599453
comptime _NEG_INF = Float32.MIN  # -inf
comptime _F32 = DType.float32
comptime _SW128 = TensorMapSwizzle.SWIZZLE_128B


@always_inline
def hopper_nwg(d: Int) -> Int:
    """Warpgroups per block (each 64 query rows, wgmma's M): 2, or 1 at D 64 (H200 sweep beside the header)."""
    return 1 if d == 64 else 2


@always_inline
def hopper_bn(d: Int) -> Int:
    """Keys per tile: 128 at D 128 (S 64 + O 64 + P 32 registers), 64 at D 256 (its O alone is 128) and D 64."""
    return 128 if d == 128 else 64


@always_inline
def hopper_smem_bytes(d: Int, nwg: Int, bn: Int) -> Int:
    """Q + 2 slots each of K and V, 2-byte elements, + 1 KB: the base is rounded up to 1024 bytes in the kernel."""
    return (64 * nwg * d + 4 * bn * d) * 2 + 1024


@always_inline
def _swz(r: Int, c: Int, R: Int) -> Int:
    """Element offset of X[r, c] in an [R, C] 2-byte tile in wgmma's 128-byte-swizzle format: C cut into
    64-column blocks, each a dense [R, 64] array of 128-byte rows; 16-byte chunk j of row r at j ^ (r % 8)."""
    var j = (c % 64) // 8
    return (c // 64) * R * 64 + r * 64 + ((j ^ (r % 8)) * 8) + (c % 8)


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


def _fa3_kernel[
    dtype: DType, D: Int, BN: Int, NWG: Int
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
    comptime BM = 64 * NWG
    comptime NT = 128 * NWG
    comptime TILE = BN * D  # elements of one K (or V) tile
    comptime V_OFF = 2 * TILE  # the V ring after the two K slots
    comptime CPR = D // 8  # 16-byte chunks per row
    comptime KV_CHUNKS = BN * CPR
    comptime Q_CHUNKS = BM * CPR
    comptime NON = D // 8  # n8 blocks of O

    var raw = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=1024]()
    var pad = ((Int(raw) + 1023) & ~1023) - Int(raw)  # bytes; 0 when .align 1024 is honoured
    var qs = raw.unsafe_offset(pad // 2)
    var kvs = qs.unsafe_offset(BM * D)
    var vbad = unsafe_stack_allocation[1, DType.int32, address_space=AddressSpace.SHARED]()
    var tid = thread_idx.x
    var wg = tid // 128
    var lane = tid % 32
    var wi = (tid % 128) // 32
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
    var scale2 = params[unsafe_offset=1] * _LOG2E
    var kvl = skv
    if params[unsafe_offset=2] != 0:  # untrusted lengths: clamped, so no read outside k / v
        kvl = min(max(Int(kv_len[unsafe_offset=b]), 0), skv)
    var off = kvl - s_len  # bottom-right alignment against this sequence's length

    var q_base = (bh * s_len) * D
    var kv_base = ((b * Int(Hkv) + hk) * skv) * D
    var kv_end = kvl
    if causal:
        kv_end = min(kvl, m0 + BM + off)
    var n_tiles = ceildiv(kv_end, BN) if kv_end > 0 else 0

    var wrow0 = m0 + 64 * wg + 16 * wi  # this warp's first row
    var row0 = wrow0 + g  # this thread's rows: row0, row0 + 8

    var qg = q.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var kg = k.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var vg = v.unsafe_address_space_cast[AddressSpace.GLOBAL]()

    @always_inline
    def load_rows(src: Pointer[Scalar[dtype], MutAnyOrigin, address_space=AddressSpace.GLOBAL], tile: Int, dst: Int) {var}:
        """One K or V tile (keys tile*BN..) into the slot at element offset dst; no commit."""
        var kbase = tile * BN
        comptime for i in range(ceildiv(KV_CHUNKS, NT)):
            var c = tid + i * NT
            if c < KV_CHUNKS:
                var r = c // CPR
                var col = (c % CPR) * 8
                var kr = min(kbase + r, kvl - 1)  # clamp: rows past kvl are masked to p = 0
                async_copy[16](src.unsafe_offset(kv_base + kr * D + col), kvs.unsafe_offset(dst + _swz(r, col, BN)))

    @always_inline
    def tile_masked(tile: Int) {var} -> Bool:
        """Some row of this block must not see all of the tile's keys (uniform across the block)."""
        var kb = tile * BN
        return kb + BN > kvl or (causal and kb + BN - 1 > m0 + off)

    @always_inline
    def scan_v(tile: Int) {var}:
        """A masked tile: zero its non-finite V values (p = 0 * NaN would be NaN in the MMA); the rows that
        do see them get them back after the loop (vbad)."""
        var vsl = kvs.unsafe_offset(V_OFF + (tile % 2) * TILE)
        comptime for i in range(ceildiv(KV_CHUNKS, NT)):
            var c = tid + i * NT
            if c < KV_CHUNKS:
                var p8 = vsl.unsafe_offset(c * 8)  # the scan is layout-blind: every chunk once
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

    @always_inline
    def pv(pf: SIMD[dtype, BN // 2], tile: Int, acc: SIMD[_F32, D // 2]) {var} -> SIMD[_F32, D // 2]:
        """Issue O += P V for `tile` (async, one commit group): k-step kc = keys 16kc..16kc+15 of the slot."""
        var vsl = kvs.unsafe_offset(V_OFF + (tile % 2) * TILE)
        var res = acc
        wgmma_fence_aligned()
        comptime for kc in range(BN // 16):
            var dv = WGMMADescriptor.create[64, BN * 8, _SW128](vsl.unsafe_offset(kc * 16 * 64))
            res = wgmma_async[64, D, 16, a_type=dtype, b_type=dtype, layout_b="row"](
                pf.slice[8, offset = 8 * kc](), dv, res
            )
        wgmma_commit_group_sync()
        return res

    if tid == 0:
        vbad[] = 0
    if n_tiles > 0:
        # copy groups: (Q, K_0) here, then tile j's (K_{j+1}, V_j) (`loads`), each waited for whole
        comptime for i in range(ceildiv(Q_CHUNKS, NT)):
            var c = tid + i * NT
            if c < Q_CHUNKS:
                var r = c // CPR
                var col = (c % CPR) * 8
                var qr = min(m0 + r, s_len - 1)  # rows past S: computed, never stored
                async_copy[16](qg.unsafe_offset(q_base + qr * D + col), qs.unsafe_offset(_swz(r, col, BM)))
        load_rows(kg, 0, 0)
        async_copy_commit_group()

    var oacc = SIMD[_F32, D // 2](0)
    var m_i = SIMD[_F32, 2](_NEG_INF)  # running max (log2 domain), rows g / g + 8
    var l_i = SIMD[_F32, 2](0)
    var pf_prev = SIMD[dtype, BN // 2](0)  # P of the previous tile, the A operand of its P V (in flight)
    var sacc = SIMD[_F32, BN // 2](0)  # S of the current tile (only wgmmas write it)
    var qw = qs.unsafe_offset(wg * 64 * 64)  # this warpgroup's 64 rows (8 KB into each column block)

    @always_inline
    def top(it: Int) {var}:
        """Copy group it - 1 (K_it, V_{it-1}) landed: publish it to the async proxy, scan V_{it-1} if its
        tile is masked. The barrier also means every warpgroup is past S_{it-1} and P V_{it-2}: K_{it-1}'s
        and V_{it-2}'s slots are free for `loads`."""
        async_copy_wait_group(0)
        fence_async_view_proxy()  # this thread's cp.async data -> the async proxy wgmma reads
        barrier()
        # the scan reads chunks other threads copied (the swizzle permutes them), so only after the barrier
        # (before it, compute-sanitizer racecheck on the H200 reported the scan racing the cp.async writes:
        # a scan could miss a NaN, or write stale data back over the landed tile)
        if it > 0 and tile_masked(it - 1):
            scan_v(it - 1)
            fence_async_view_proxy()  # the scan's stores -> the async proxy
            barrier()

    @always_inline
    def loads(it: Int) {var}:
        """Copy group it: K_{it+1} and V_it, issued once tile it's wgmmas are in flight (the tensor cores
        run while these threads compute addresses); waited for at the top of tile it + 1."""
        if it + 1 < n_tiles:
            load_rows(kg, it + 1, ((it + 1) % 2) * TILE)
        load_rows(vg, it, V_OFF + (it % 2) * TILE)
        async_copy_commit_group()

    @always_inline
    def s_chain(it: Int, acc: SIMD[_F32, BN // 2]) {var} -> SIMD[_F32, BN // 2]:
        """Issue S = Q K_it^T (this warpgroup's 64 rows x BN keys; one commit group). k-step kk is +32 bytes
        inside the swizzled 128-byte row, a new 64-column block every 4 steps. The first step ignores the
        accumulator (scale_d = 0), so acc's registers need no zeroing movs after the fence."""
        var ks = kvs.unsafe_offset((it % 2) * TILE)
        var res = acc
        wgmma_fence_aligned()
        comptime for kk in range(D // 16):
            var da = WGMMADescriptor.create[64, 1, _SW128](qw.unsafe_offset((kk // 4) * BM * 64 + (kk % 4) * 16))
            var db = WGMMADescriptor.create[64, 1, _SW128](ks.unsafe_offset((kk // 4) * BN * 64 + (kk % 4) * 16))
            res = wgmma_async[64, BN, 16, a_type=dtype, b_type=dtype, scale_d = 0 if kk == 0 else 1](da, db, res)
        wgmma_commit_group_sync()
        return res

    # each row's last visible key (-1 or less: none), for the masked tiles
    var last = SIMD[DType.int32, 2](0)
    comptime for hh in range(2):
        last[hh] = Int32(min(kvl - 1, row0 + 8 * hh + off) if causal else kvl - 1)

    @always_inline
    def masked(it: Int) {var} -> Bool:
        """Tile it crosses kvl or this warp's causal diagonal (uniform per warp)."""
        var kb = it * BN
        return kb + BN > kvl or (causal and kb + BN - 1 > wrow0 + off)

    # FA3's intra-warpgroup overlap: tile j's S = Q K_j^T and tile j-1's O += P V_{j-1} are issued back to
    # back; the S wait leaves the P V in flight while the softmax of tile j runs on the CUDA cores.
    # K and V each have 2 slots: K_j and V_{j-1} are read by the wgmmas of tile j while K_{j+1} and V_j land
    # in the other two; one barrier per tile (`top`).
    # Tile 0 is peeled: a loop body that issued its P V only from the second tile on (a branch around the
    # wgmmas) made ptxas serialise every wgmma of the kernel (C7513).
    if n_tiles > 0:
        top(0)
        sacc = s_chain(0, sacc)
        loads(0)
        wgmma_wait_group_sync[0]()
        sacc = _pin[BN // 2](sacc)
        var r0 = (
            _softmax_tile[BN // 2, True](sacc, scale2, last - Int32(2 * t4), m_i, l_i) if masked(0) else
            _softmax_tile[BN // 2, False](sacc, scale2, last, m_i, l_i)
        )
        pf_prev = r0[0].cast[dtype]()  # O is still 0: no rescale
    for it in range(1, n_tiles):
        top(it)
        sacc = s_chain(it, sacc)
        oacc = pv(pf_prev, it - 1, oacc)
        loads(it)
        wgmma_wait_group_sync[1]()  # S done; P V_{it-1} may still run
        sacc = _pin[BN // 2](sacc)
        var r = (
            _softmax_tile[BN // 2, True](sacc, scale2, last - Int32(it * BN + 2 * t4), m_i, l_i) if masked(it) else
            _softmax_tile[BN // 2, False](sacc, scale2, last, m_i, l_i)
        )
        wgmma_wait_group_sync[0]()  # P V_{it-1} done: O may be rescaled
        # P into the A registers only now: written while P V_{it-1} still reads them ptxas would serialise
        # the wgmmas (C7513); converted inside a chain it would inject warpgroup.arrive (C7519)
        pf_prev = r[0].cast[dtype]()
        var alpha = r[1]
        comptime for jo in range(NON):
            comptime for e in range(4):
                oacc[4 * jo + e] = oacc[4 * jo + e] * alpha[e // 2]

    if n_tiles > 0:  # the last tile's P V
        top(n_tiles)
        oacc = pv(pf_prev, n_tiles - 1, oacc)
        wgmma_wait_group_sync[0]()

    # ---- rare path (a masked tile had a non-finite V, zeroed in shared memory): as `_fa2_kernel`'s
    barrier()
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
                var m = m_i[half]
                if _nonfinite(m):  # NaN, or +-inf: the float64 softmax is NaN, lse = m (torch.logsumexp)
                    inv = m * 0
                    lrow = m * _LN2
                else:
                    inv = 1.0 / l_i[half]
                    lrow = (m + log2(l_i[half])) * _LN2
            comptime for jo in range(NON):
                var val = SIMD[_F32, 2](oacc[4 * jo + 2 * half], oacc[4 * jo + 2 * half + 1]) * inv
                o.unsafe_store[width=2, alignment=4](q_base + r * D + 8 * jo + 2 * t4, val.cast[dtype]())
            if t4 == 0:
                lse[unsafe_offset=bh * s_len + r] = lrow


def attention_hopper_gpu[
    dtype: DType, D: Int, NWG: Int = hopper_nwg(D), BN: Int = hopper_bn(D)
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
    """Launch `_fa3_kernel` (the caller checked bf16, D in {64, 128, 256}, an sm_90 target, B * H <= 65535 and
    16-byte aligned q / k / v)."""
    comptime smem = hopper_smem_bytes(D, NWG, BN)
    ctx.enqueue_function[_fa3_kernel[dtype, D, BN, NWG]](
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
        grid_dim=(ceildiv(S, 64 * NWG), B * H),
        block_dim=128 * NWG,
        shared_mem_bytes=smem,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
    )
