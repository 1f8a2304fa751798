# fusekit.attention: softmax(q k^T * scale [+ causal mask]) v, FlashAttention-2 style on the GPU.
#
# Contract (mojo/../.dev/MOJO_CONTRACT.md): out [B, H, S, D] <- q [B, H, S, D], k/v [B, Hkv, Skv, D],
# params [2] f32 = [scale, causal]. Head h reads kv head h // (H // Hkv). Causal is bottom-right
# aligned: query i sees key j iff j <= i + (Skv - S); a row that sees no key writes zeros.
#
# Floors (H200, bf16, B4 H32 S4096 D128): 4*B*H*S^2*D = 275 TFLOP (non-causal), half causal; at the
# measured ~700-790 TFLOP/s dense bf16 that is ~0.37 ms; bytes (q, k, v, out once) = 0.27 GB -> 63 us,
# so attention is compute-bound and the tensor cores set the ceiling. SDPA (FA) reaches ~604 TFLOP/s.
#
# GPU paths (chosen at compile time per vendor, at run time per dtype / head dim):
# - NVIDIA, fp16/bf16, D in {64, 128, 256}: `_fa2_kernel`, FlashAttention-2 forward with warp-level
#   tensor-core MMA (mma.sync m16n8k16, fp32 accumulation): each warp owns 16 query rows whose Q
#   fragments stay in registers; K/V tiles go global -> shared with cp.async, double-buffered so the
#   copy of tile j+1 overlaps the math on tile j; K and V fragments are read with ldmatrix (V with
#   .trans); S = Q K^T, online softmax (exp2, running max/sum in registers, quad shuffles), P is
#   re-packed from the S accumulators into A fragments without touching shared memory; O += P V.
#   Causal: key tiles past the block's last visible key are skipped, only diagonal tiles are masked;
#   blocks are issued heaviest-first. NOT wgmma: Hopper's warpgroup MMA + TMA + warp specialisation
#   (FA3) is what reaches ~600 TFLOP/s; mma.sync peaks near ~60% of that on H100/H200.
# - everything else (fp32, other head dims, AMD gfx942): `_attn_rowwise_kernel`, one warp per query
#   row, exact fp32 math, no tensor cores (correct, slow; also the harness's GPU reference).
#
# Tile table for `_fa2_kernel` (BM query rows per block = 16 * warps, BN keys per tile):
#   D    BM   BN  warps  regs/thread (S + O acc + Q frags)   smem (2 stages K+V, rows padded +8)
#   64   128  64   8     32 + 32 + 16                        2*2*64*72*2   = 36 KB
#   128  128  64   8     32 + 64 + 32                        2*2*64*136*2  = 68 KB
#   256   64  32   4     16 + 128 + 64  (128x64 would spill) 2*2*32*264*2  = 66 KB
# At D=256 a larger BN/BM doubles the S or O registers past the 255 cap (spills), which is why
# 128x128 tiles lose to smaller ones there.
#
# Measured (H200, bf16, B4 H32 S=Skv=4096, us / TFLOP/s; SDPA = torch 2.11 flash in the same run):
#   D    non-causal             causal                 SDPA non-causal / causal   ptxas regs, spills
#   64   3254 / 169 (0.37x)     1721 / 160 (0.38x)     455 / 418 TFLOP/s          155, 0
#   128  5443 / 202 (0.34x)     2882 / 191 (0.36x)     602 / 528 TFLOP/s          243, 0
#   256  10039 / 219 (0.34x)    5238 / 210 (0.36x)     648 / 588 TFLOP/s          255, 36 B
# SASS: HMMA only (64 / 128 / 128 per kernel), LDSM for K and V; no HGMMA (see the header).

from std.math import ceildiv, exp2
from std.utils import StaticTuple
# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import thread_idx, block_idx, lane_id, barrier, WARP_SIZE, external_memory, AddressSpace
from max.gpu.host import DeviceContext, FuncAttribute
from max.gpu.primitives import warp
from max.gpu.compute.mma import mma, ld_matrix
from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group

comptime LOG2E: Float32 = 1.4426950408889634


@always_inline
def _fa2_bm(d: Int) -> Int:
    return 64 if d == 256 else 128


@always_inline
def _fa2_bn(d: Int) -> Int:
    return 32 if d == 256 else 64


@always_inline
def _quad_max(v: SIMD[DType.float32, 2]) -> SIMD[DType.float32, 2]:
    """Max over the 4 lanes of a quad (the lanes that share an MMA accumulator row)."""
    var r = v
    comptime for e in range(2):
        r[e] = max(r[e], warp.shuffle_xor(r[e], 1))
        r[e] = max(r[e], warp.shuffle_xor(r[e], 2))
    return r


@always_inline
def _quad_sum(v: SIMD[DType.float32, 2]) -> SIMD[DType.float32, 2]:
    var r = v
    comptime for e in range(2):
        r[e] += warp.shuffle_xor(r[e], 1)
        r[e] += warp.shuffle_xor(r[e], 2)
    return r


def _fa2_kernel[
    dtype: DType, D: Int, BM: Int, BN: Int
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
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
    var tid = thread_idx.x
    var lane = tid % 32
    var wid = tid // 32
    var g = lane // 4
    var t4 = lane % 4

    var s_len = Int(S)
    var skv = Int(Skv)
    var n_mblk = ceildiv(s_len, BM)
    var mblk = n_mblk - 1 - block_idx.x  # heaviest (causal) blocks first
    var bh = block_idx.y
    var b = bh // Int(H)
    var h = bh % Int(H)
    var hk = h // (Int(H) // Int(Hkv))
    var m0 = mblk * BM
    var scale2 = params[unsafe_offset=0] * LOG2E
    var causal = params[unsafe_offset=1] != 0
    var off = skv - s_len  # bottom-right alignment

    var q_base = (bh * s_len) * D
    var kv_base = ((b * Int(Hkv) + hk) * skv) * D

    # key range this block needs
    var kv_end = skv
    if causal:
        kv_end = min(skv, m0 + BM + off)
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
    var m_i = SIMD[DType.float32, 2](Float32.MIN)  # running max (log2 domain), rows g / g+8
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
                var kr = min(kbase + r, skv - 1)  # clamp: rows past Skv are masked to p = 0
                var src = kv_base + kr * D + col
                var dst = stage * STAGE + r * LD + col
                async_copy[16](kg.unsafe_offset(src), smem.unsafe_offset(dst))
                async_copy[16](vg.unsafe_offset(src), smem.unsafe_offset(dst + BN * LD))
        async_copy_commit_group()

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

        # ---- mask (only tiles that cross Skv or the causal diagonal) and scale to log2 domain
        var kbase = it * BN
        var need_mask = kbase + BN > skv or (causal and kbase + BN - 1 > m0 + wid * 16 + off)
        comptime for jn in range(NSN):
            var sv = sacc[jn] * scale2
            if need_mask:
                comptime for e in range(4):
                    var key = kbase + 8 * jn + 2 * t4 + (e % 2)
                    var qrow = row0 + 8 * (e // 2)
                    var dead = key >= skv or (causal and key > qrow + off)
                    if dead:
                        sv[e] = Float32.MIN
            sacc[jn] = sv

        # ---- online softmax (rows g and g+8; a quad of 4 lanes shares a row)
        var mx = m_i
        comptime for jn in range(NSN):
            mx[0] = max(mx[0], max(sacc[jn][0], sacc[jn][1]))
            mx[1] = max(mx[1], max(sacc[jn][2], sacc[jn][3]))
        mx = _quad_max(mx)
        # a row with nothing visible yet keeps MIN; use 0 there so exp2 gives 0, not NaN
        var mref = SIMD[DType.float32, 2](0)
        comptime for r in range(2):
            mref[r] = mx[r] if mx[r] > Float32.MIN else 0
        var alpha = exp2(m_i - mref)
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

    # ---- finish: divide by the row sums (quad-reduced), write (zeros where no key was visible)
    l_i = _quad_sum(l_i)
    var inv = SIMD[DType.float32, 2](0)
    comptime for r in range(2):
        inv[r] = 1.0 / l_i[r] if l_i[r] > 0 else 0
    comptime for half in range(2):
        var r = row0 + 8 * half
        if r < s_len:
            comptime for jo in range(NON):
                var val = SIMD[DType.float32, 2](oacc[jo][2 * half], oacc[jo][2 * half + 1]) * inv[half]
                o.unsafe_store[width=2, alignment=4](q_base + r * D + 8 * jo + 2 * t4, val.cast[dtype]())


def _attn_rowwise_kernel[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
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
    var scale = params[unsafe_offset=0]
    var causal = params[unsafe_offset=1] != 0
    var kv_base = ((b * Int(Hkv) + hk) * skv) * d
    var qv = SIMD[DType.float32, PER](0)
    var acc = SIMD[DType.float32, PER](0)
    comptime for e in range(PER):
        var dd = lane + e * WARP_SIZE
        if dd < d:
            qv[e] = q[unsafe_offset=row * d + dd].cast[DType.float32]()
    var last = skv - 1
    if causal:
        last = min(last, i + skv - s_len)
    var m = Float32.MIN
    var l: Float32 = 0
    for j in range(last + 1):
        var part: Float32 = 0
        comptime for e in range(PER):
            var dd = lane + e * WARP_SIZE
            if dd < d:
                part += qv[e] * k[unsafe_offset=kv_base + j * d + dd].cast[DType.float32]()
        var s = warp.sum(part) * scale
        var mn = max(m, s)
        var alpha = exp2((m - mn) * LOG2E)
        var p = exp2((s - mn) * LOG2E)
        l = l * alpha + p
        comptime for e in range(PER):
            var dd = lane + e * WARP_SIZE
            if dd < d:
                acc[e] = acc[e] * alpha + p * v[unsafe_offset=kv_base + j * d + dd].cast[DType.float32]()
        m = mn
    var inv: Float32 = 1.0 / l if l > 0 else 0
    comptime for e in range(PER):
        var dd = lane + e * WARP_SIZE
        if dd < d:
            o[unsafe_offset=row * d + dd] = (acc[e] * inv).cast[dtype]()


def attention_cpu[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    scale: Float32,
    causal: Bool,
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
):
    """Plain loops, fp32 math (exact softmax with a max pass), one cast at the end."""
    var sc = List[Float32](length=Skv, fill=0)
    var acc = List[Float32](length=D, fill=0)
    var group = H // Hkv
    for b in range(B):
        for h in range(H):
            var kv_base = ((b * Hkv + h // group) * Skv) * D
            var q_base = ((b * H + h) * S) * D
            for i in range(S):
                var last = Skv - 1
                if causal:
                    last = min(last, i + Skv - S)
                for dd in range(D):
                    acc[dd] = 0
                var mx = Float32.MIN
                for j in range(last + 1):
                    var s: Float32 = 0
                    for dd in range(D):
                        s += (
                            q[unsafe_offset=q_base + i * D + dd].cast[DType.float32]()
                            * k[unsafe_offset=kv_base + j * D + dd].cast[DType.float32]()
                        )
                    sc[j] = s * scale
                    mx = max(mx, sc[j])
                var l: Float32 = 0
                for j in range(last + 1):
                    var p = exp2((sc[j] - mx) * LOG2E)
                    l += p
                    for dd in range(D):
                        acc[dd] += p * v[unsafe_offset=kv_base + j * D + dd].cast[DType.float32]()
                var inv: Float32 = 1.0 / l if l > 0 else 0
                for dd in range(D):
                    o[unsafe_offset=q_base + i * D + dd] = (acc[dd] * inv).cast[dtype]()


def attention_gpu[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    q: Pointer[Scalar[dtype], MutAnyOrigin],
    k: Pointer[Scalar[dtype], MutAnyOrigin],
    v: Pointer[Scalar[dtype], MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    B: Int,
    H: Int,
    Hkv: Int,
    S: Int,
    Skv: Int,
    D: Int,
    ctx: DeviceContext,
    force_rowwise: Bool = False,
) raises:
    """Launch the best kernel for this target / dtype / head dim (see the header table)."""

    @always_inline
    def launch_fa2[HD: Int]() raises {var}:
        comptime BM = _fa2_bm(HD)
        comptime BN = _fa2_bn(HD)
        comptime smem_bytes = 2 * 2 * BN * (HD + 8) * 2
        ctx.enqueue_function[_fa2_kernel[dtype, HD, BM, BN]](
            o,
            q,
            k,
            v,
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
        if not force_rowwise:
            if D == 64:
                launch_fa2[64]()
                return
            elif D == 128:
                launch_fa2[128]()
                return
            elif D == 256:
                launch_fa2[256]()
                return
    if D > 256:
        raise Error("fusekit.attention: head dim > 256 is not supported on the GPU")
    var rows = B * H * S
    ctx.enqueue_function[_attn_rowwise_kernel[dtype]](
        o,
        q,
        k,
        v,
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


@register("fusekit.attention")
struct Attention:
    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString
    ](
        res: MutableInputTensor[dtype=dtype, rank=4, ...],
        q: InputTensor[dtype=dtype, rank=4, ...],
        k: InputTensor[dtype=dtype, rank=4, ...],
        v: InputTensor[dtype=dtype, rank=4, ...],
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
        var qp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](q.unsafe_ptr())
        var kp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](k.unsafe_ptr())
        var vp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](v.unsafe_ptr())
        var pp = rebind[Pointer[Float32, MutAnyOrigin]](params.unsafe_ptr())
        comptime if target == "gpu":
            attention_gpu[dtype](op, qp, kp, vp, pp, B, H, Hkv, S, Skv, D, ctx)
        else:
            attention_cpu[dtype](op, qp, kp, vp, pp[unsafe_offset=0], pp[unsafe_offset=1] != 0, B, H, Hkv, S, Skv, D)
