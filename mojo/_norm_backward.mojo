"""Row-normalization backward kernels shared by fusekit.rms_norm_backward and fusekit.layer_norm_backward.

Semantics (CONTRACT.md), per row, all fp32 (xin is h in the residual case, else x):
- rms_norm:   x̂ = xin * rstd; weff = w (casting "fp32"/"llama") or 1 + w ("gemma"); g = dy * weff;
              dx = rstd * (g - x̂ * mean(g x̂)) [+ dh];  dw = Σ_rows dy * x̂  ("llama": dy * round_x(x̂)).
- layer_norm: x̂ = (xin - mean) * rstd; g = dy * w;  dx = rstd * (g - mean(g) - x̂ * mean(g x̂)) [+ dh];
              dw = Σ_rows dy * x̂;  db = Σ_rows dy (only when the op has a bias).
params: rms_norm [eps, casting, has_residual], layer_norm [eps, has_residual, has_bias]; has_residual
says dh is given (else it is a [1, 1] dummy, never read); has_bias says db is given (else [1]). The
flags are read on the device (the host never sees params without a sync).

Byte floor per call: read dy, xin (2*M*N*s) [+ dh M*N*s] + write dx (M*N*s) + weight (N*s_w) + stats
(4-8 B/row) + the fp32 partials (written once, read once: P*N*4 B per weight gradient, P * N <= ~SMs *
8 K elements = 4.3 MB on an H200, small next to the rows for M >> P). 32768x8192 bf16 without dh:
1.61 GB -> 0.38 ms at the 4283 GB/s copy ceiling of the H200.

GPU plan (deterministic, no atomics):
1. A persistent grid: block p takes rows p, p + P, ... (fixed for a given M and device) and keeps fp32
   partials of dw (and db) for its rows, written once at the end to row p of a [P, N] scratch (the
   caller's workspace: no allocation inside the op, see python/fusekit/backends/mojo/specs.py).
   - rms_norm, 16-bit x, N <= 16 * 1024 (aligned), NVIDIA: the cp.async kernel (_rms_bwd_pipe_kernel),
     whole rows per block with 16 columns per thread, each row's xin / dy / dh copied into shared memory
     a row ahead, so the memory pipe stays busy through the row reductions (H200, bf16 32768x8192:
     420 vs 547 us for the register kernel below).
   - N <= 8 * 1024 (aligned): "register" kernel, whole rows per block, the smallest block of
     64..1024 threads with 8 columns per thread (one 16-byte vector of 16-bit x, two of fp32);
     P = min(M, SMs * 1024 / BLK). dy / xin / dh and the dw partials sit in registers, the db
     partials in shared memory; each row needs one block all-reduce of (Σ g x̂, Σ g): warp butterflies,
     one barrier, then every warp reduces the per-warp partials with the same butterfly. Registers:
     <= 64 with no spills at 1024 threads (ptxas sm_90); with 16 columns per thread the 16-bit
     kernels took 114-118 registers and spilled at 1024 threads.
     rms_norm below 1024 threads takes 2 rows per step: both rows' loads in flight before one
     all-reduce of their sums (twice the bytes in flight per barrier; same bits as 1 row per step).
   - longer aligned rows: a row-sums kernel (one block per row: mean(g x̂), mean(g) -> [M, 2]), then
     the register kernel column-tiled: block b takes column chunk b % chunks (8192 columns) of the rows
     b // chunks + i * P, P = cdiv(SMs, chunks) (~one 1024-thread block per SM). dy and xin are read
     twice (10 instead of 6 bytes per element in bf16); a one-kernel version that kept the partials
     in global memory (read-modified-written per row) ran at 1120 (rms) / 775 (ln) GB/s at 4096x65536.
   - unaligned rows (N % 8 != 0 or a misaligned pointer): the W = 1 "loop" kernel (two passes per
     row, partials read-modified-written in global memory by the thread owning the column;
     P = SMs * 1024 / BLK, BLK = 128 up to N = 4096, else 512).
2. A column kernel sums the partials over P in a fixed order (32 columns x 32 partial-row lanes per
   block, 4 independent accumulators each, then a fixed-order combine in shared memory) and casts to
   w's dtype. Two runs are bit-identical.
Measured on an H200 (GB/s over the byte floor, copy 4283; harness/_normh.mojo): 32768x8192 bf16 rms
2988 / ln 2931, with dh and fp32 w rms 3511 / ln 3670, fp32 rms 4182 / ln 4063; 32768x1024 bf16 rms
2564 (2 rows per step; 2108 with 1) / ln 2406; 32768x4096 bf16 rms 2897 (2122 with 1) / ln 2996;
4096x65536 bf16 (column-tiled) rms 1637 / ln 1575.
Row offsets are Int (64-bit). Block reductions use WARP_SIZE (32 on NVIDIA, 64 on AMD).
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, WARP_SIZE, thread_idx, block_idx, grid_dim, barrier
from max.gpu import external_memory, syncwarp
from max.gpu.primitives import warp
from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group
from std.memory import unsafe_stack_allocation
from max.gpu.host import DeviceContext, DeviceAttribute, FuncAttribute
from std.utils import StaticTuple
from std.sys import align_of, size_of

from ._util import vec_width, is_aligned16, cdiv, check_workspace
from ._norm import _block_allsum, MAX_WARPS

comptime F32 = DType.float32
comptime FPtr = Pointer[Float32, MutAnyOrigin]
comptime REG_ELEMS = 8  # columns per thread in the register kernel (1 vector of 16-bit x, 2 of fp32)
comptime LOOP_BLK = 512  # threads of the row-sums kernel and of the unaligned loop kernel for N > 4096
comptime RED_COLS = 32  # columns per block of the partial reduction
comptime RED_ROWS = 32  # partial rows summed in parallel per column (block = 1024 threads)


struct BwdFlags(Copyable, Movable):
    """The backward op's runtime flags, read from `params`."""

    var llama: Bool
    var gemma: Bool
    var has_dh: Bool
    var has_bias: Bool

    @always_inline
    def __init__(out self, llama: Bool, gemma: Bool, has_dh: Bool, has_bias: Bool):
        self.llama = llama
        self.gemma = gemma
        self.has_dh = has_dh
        self.has_bias = has_bias


@always_inline
def bwd_flags[LN: Bool](params: FPtr) -> BwdFlags:
    comptime if LN:
        return BwdFlags(False, False, params[unsafe_offset=1] != 0, params[unsafe_offset=2] != 0)
    else:
        var c = params[unsafe_offset=1]
        return BwdFlags(c == 1, c == 2, params[unsafe_offset=2] != 0, False)


@always_inline
def _weff[
    wdtype: DType, W: Int, AW: Int
](w: Pointer[Scalar[wdtype], MutAnyOrigin], off: Int, f: BwdFlags) -> SIMD[F32, W]:
    var wv = w.unsafe_load[width=W, alignment=AW](off).cast[F32]()
    if f.gemma:
        wv = wv + 1.0
    return wv


@always_inline
def _dw_term[dtype: DType, W: Int](dyv: SIMD[F32, W], xh: SIMD[F32, W], f: BwdFlags) -> SIMD[F32, W]:
    """dy * x̂, with x̂ rounded to x's dtype for "llama" (HF multiplies the weight by the rounded value)."""
    if f.llama:
        return dyv * xh.cast[dtype]().cast[F32]()
    return dyv * xh


@always_inline
def _load_cols[
    dtype: DType, BLK: Int, NV: Int
](p: Pointer[Scalar[dtype], MutAnyOrigin], tid: Int, nv: Int) -> SIMD[dtype, NV * vec_width[dtype]()]:
    """This thread's NV vectors (vector indices tid + k * BLK) of one row, zero past the row's end."""
    comptime VW = vec_width[dtype]()
    var v = SIMD[dtype, NV * VW](0)
    comptime for k in range(NV):
        var j = tid + k * BLK
        if j < nv:
            v = v.insert[offset = k * VW](p.unsafe_load[width=VW, alignment=16](j * VW))
    return v


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _norm_bwd_reg_kernel[
    dtype: DType, wdtype: DType, LN: Bool, BLK: Int, NV: Int, TILED: Bool, R: Int
](
    dx: Pointer[Scalar[dtype], MutAnyOrigin],
    part_w: FPtr,
    part_b: FPtr,
    dy: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    xin: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    mean_in: FPtr,
    rstd_in: FPtr,
    sums: FPtr,
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    """The thread's 8 columns of dy / xin / dh of R rows and its dw partials live in registers, its db
    partials (layer_norm) in shared memory ([element][thread]: conflict-free), which keeps 1024-thread blocks
    within 64 registers. Measured and dropped: prefetching the next row's dy / xin into registers
    before this row's reduction (double buffering) spilled at 1024 threads and ran slower everywhere
    (H200, 32768x8192: bf16 rms 2381 vs 2944 GB/s, ln 1559 vs 1948; fp32 rms 3831 vs 4191).
    R rows per step (rows row, row + step, ..., row + (R - 1) * step of the block's sequence): their loads
    are all in flight before one block reduction of their 1-2 sums each (R times the bytes in flight per
    barrier, for short rows where a block holds little of the memory pipe); the rows' dw / db partials
    are added in the order R = 1 adds them, so the results are bit-identical for every R.
    TILED = False: a block holds whole rows (N <= 8 * BLK) and all-reduces each row's sums itself.
    TILED = True (long rows, R = 1): block b takes column chunk b % chunks (8 * BLK columns) of the rows
    b // chunks, b // chunks + grid / chunks, ...; the row sums (mean(g x̂), mean(g)) come from `sums`
    [M, 2], written by _row_sums_kernel; the block's partials go to row b // chunks of part_w / part_b."""
    comptime VW = vec_width[dtype]()
    comptime C = NV * VW
    comptime K = 2 if LN else 1  # sums per row: mean(g x̂) [, mean(g)]
    var red = unsafe_stack_allocation[K * R * MAX_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var n = Int(n_cols)
    var m = Int(n_rows)
    var nv = n // VW
    var f = bwd_flags[LN](params)
    var tid = thread_idx.x  # this thread's first column vector
    var first_row = block_idx.x
    var step = grid_dim.x
    comptime if TILED:
        var chunks = (nv + BLK * NV - 1) // (BLK * NV)
        tid += (block_idx.x % chunks) * (BLK * NV)
        first_row = block_idx.x // chunks
        step = grid_dim.x // chunks
    var aw = SIMD[F32, C](0)  # this thread's dw partials
    # db partials (layer_norm with bias): element e of thread t at e * BLK + t
    var sb = unsafe_stack_allocation[BLK * C if LN else 1, Float32, address_space=AddressSpace.SHARED]()
    comptime if LN:
        comptime for e in range(C):
            sb[unsafe_offset=e * BLK + thread_idx.x] = 0
    var row = first_row
    while row < m:
        # R rows' columns, row i at offset i * C; a row past M stays 0 (x̂ = g = 0: it adds nothing). Load
        # and compute order per op, as measured (H200 harness, same call): layer_norm reads its row stats
        # after w, as with one row per step (stats first: 32768x1024 84 -> 114 us; its PTX then issued the
        # stats load after the shared db update, which waits on dy); rms_norm reads rstd with its columns
        # (32768x4096 278 us; stats after w: 292). Its guard and its sums-then-dw order below keep that
        # measured PTX (one guard form or one order for both ops changes rms_norm's PTX).
        var xc = SIMD[dtype, R * C](0)
        var gc = SIMD[dtype, R * C](0)
        var hc = SIMD[dtype, R * C](0)
        var mu = SIMD[F32, R](0)
        var r = SIMD[F32, R](0)
        comptime for i in range(R):
            var ri = row + i * step
            if (LN and i == 0) or ri < m:  # layer_norm's row 0 is in range (the loop condition): no branch
                var off = ri * n
                xc = xc.insert[offset = i * C](_load_cols[dtype, BLK, NV](xin.unsafe_offset(off), tid, nv))
                gc = gc.insert[offset = i * C](_load_cols[dtype, BLK, NV](dy.unsafe_offset(off), tid, nv))
                if f.has_dh:  # needed only after the reduction: its latency hides behind it
                    hc = hc.insert[offset = i * C](_load_cols[dtype, BLK, NV](dh.unsafe_offset(off), tid, nv))
                comptime if not LN:
                    r[i] = rstd_in[unsafe_offset=ri]
        var wc = SIMD[F32, C](0)  # weff (w, or 1 + w for gemma): an L1 hit per step, cheaper than C registers
        comptime for k in range(NV):
            var j = tid + k * BLK
            if j < nv:
                wc = wc.insert[offset = k * VW](_weff[wdtype, VW, 16](w, j * VW, f))
        comptime if LN:
            comptime for i in range(R):
                var ri = row + i * step
                if i == 0 or ri < m:
                    mu[i] = mean_in[unsafe_offset=ri]
                    r[i] = rstd_in[unsafe_offset=ri]
        # padding lanes (columns past N) have x = dy = w = 0, so g = 0 and they add nothing below
        var part = SIMD[F32, K * R](0)
        comptime for i in range(R):
            var xh = (xc.slice[C, offset = i * C]().cast[F32]() - mu[i]) * r[i]
            var dyv = gc.slice[C, offset = i * C]().cast[F32]()
            var g = dyv * wc
            comptime if LN:
                part[K * i + 1] = g.reduce_add()
                if f.has_bias:
                    comptime for e in range(C):
                        sb[unsafe_offset=e * BLK + thread_idx.x] += dyv[e]
                aw += _dw_term[dtype](dyv, xh, f)
                part[K * i] = (g * xh).reduce_add()
            else:
                part[K * i] = (g * xh).reduce_add()
                aw += _dw_term[dtype](dyv, xh, f)
        var c: SIMD[F32, K * R]  # the rows' means: mean(g x̂) [, mean(g)]
        comptime if TILED:
            c = SIMD[F32, K * R](0)
            comptime for i in range(K):
                c[i] = sums[unsafe_offset=2 * row + i]
        else:
            c = _block_allsum[BLK, K * R](part, red) / Float32(n)
        comptime for i in range(R):
            var ri = row + i * step
            if (LN and i == 0) or ri < m:
                var off = ri * n
                var xh = (xc.slice[C, offset = i * C]().cast[F32]() - mu[i]) * r[i]
                var g = gc.slice[C, offset = i * C]().cast[F32]() * wc
                var d: SIMD[F32, C]
                comptime if LN:
                    d = r[i] * (g - c[K * i + 1] - xh * c[K * i])
                else:
                    d = r[i] * (g - xh * c[K * i])
                if f.has_dh:
                    d += hc.slice[C, offset = i * C]().cast[F32]()
                var dxr = dx.unsafe_offset(off)
                var dd = d.cast[dtype]()
                comptime for k in range(NV):
                    var j = tid + k * BLK
                    if j < nv:
                        dxr.unsafe_store[alignment=16](j * VW, dd.slice[VW, offset = k * VW]())
        row += R * step
        comptime if not TILED:
            barrier()  # `red` is rewritten for the next step
    var pw = part_w.unsafe_offset(first_row * n)
    var pb = part_b.unsafe_offset(first_row * n)
    comptime for k in range(NV):
        var j = tid + k * BLK
        if j < nv:
            pw.unsafe_store[alignment=16](j * VW, aw.slice[VW, offset = k * VW]())
            comptime if LN:
                if f.has_bias:
                    var bv = SIMD[F32, VW](0)
                    comptime for e in range(VW):
                        bv[e] = sb[unsafe_offset=(k * VW + e) * BLK + thread_idx.x]
                    pb.unsafe_store[alignment=16](j * VW, bv)


comptime PIPE_COLS = 16  # columns per thread of the cp.async kernel: two 16-byte vectors of 16-bit x


def pipe_stages[dtype: DType]() -> Int:
    """Rows in the cp.async kernel's ring per thread (the one being reduced and those in flight): as many as
    ~200 bytes of shared memory per thread hold (1024 resident threads per SM share ~228 KB), at least 2.
    A stage is the thread's 16 columns of xin, dy and dh: 96 bytes in 16-bit, so 2 stages."""
    comptime stage = 3 * PIPE_COLS * size_of[dtype]()
    return max(2, min(4, 208 // stage))


def pipe_smem_bytes[dtype: DType](blk: Int) -> Int:
    """Dynamic shared memory of _rms_bwd_pipe_kernel for a block of blk threads: the data ring, then the
    per-warp rstd ring."""
    comptime S = pipe_stages[dtype]()
    return S * blk * 3 * PIPE_COLS * size_of[dtype]() + S * MAX_WARPS * 4


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
@__llvm_metadata(`nvvm.minctasm`=SIMDLength(1024 // BLK))  # <= 64 registers: 1024 threads per SM (the grid's plan)
def _rms_bwd_pipe_kernel[
    dtype: DType, wdtype: DType, BLK: Int
](
    dx: Pointer[Scalar[dtype], MutAnyOrigin],
    part_w: FPtr,
    dy: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    xin: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    rstd_in: FPtr,
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    """rms_norm's backward for whole rows (N <= 16 * BLK, aligned, 16-bit x) with each row's loads issued
    a row ahead (NVIDIA: cp.async). Each thread copies its own 16 columns of xin, dy (and dh) into its own
    shared-memory slots ([stage][tensor][vector][thread]: 16-byte vectors of consecutive threads,
    conflict-free) and lane 0 of each warp the row's rstd for its warp; cp.async.wait_group orders a
    thread's own copies and a warp sync the rstd, so the data need no block barrier. The next row's bytes
    are in flight through this row's block reduction; the register kernel had its loads in flight only
    from a row's start to its reduction. The row is read from shared memory twice, before and after the
    reduction, so no column value lives across the barrier and the registers hold the dw partials: 16
    columns per thread, half the warps per row of the register kernel (half its reduction and barrier
    cost per row). The sums in `red` alternate between two halves by row parity, so one barrier per row
    (the all-reduce's) suffices: a half is rewritten two rows later, after every thread passed the next
    row's barrier and so finished reading it. Per row the arithmetic is the register kernel's.
    Measured (H200 harness, same call, bf16, against the register kernel): 32768x8192 420 vs 547 us,
    with dh and fp32 w 525 vs 609, 32768x4096 220 vs 274, 32768x1024 76.8 vs 77.7. Not taken:
    - 8 columns per thread (BLK = N / 8, the register kernel's geometry) with the stats copied by every
      thread: 479 / 671 / 251 / 74.2 us, the +dh case loaded dh directly (slower than the register kernel);
    - dh read directly instead of through the ring (3 stages of 64 bytes): 428 / 560 / 227 / 79.3 us;
    - layer_norm on this plan (8 columns, dw and db partials in registers; 16 columns spilled 36-44 bytes
      at the 64-register cap): 544 / 658 / 279 / 89.6 us against its register kernel's 547 / 585 / 266 /
      82.8, so layer_norm keeps the register kernel. ncu of an earlier layer_norm try (db partials
      read-modified-written in shared memory) showed L1 / shared memory as the limit (74% busy)."""
    comptime VW = vec_width[dtype]()
    comptime C = PIPE_COLS
    comptime NV = C // VW
    comptime S = pipe_stages[dtype]()
    comptime TS = NV * BLK * VW  # elements per tensor per stage
    var red = unsafe_stack_allocation[2 * MAX_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var ring = external_memory[Scalar[dtype], address_space=AddressSpace.SHARED, alignment=16]()
    var rstd_ring = ring.unsafe_offset(S * 3 * TS).unsafe_bitcast[Float32]()  # [stage][warp]
    var xg = xin.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var dyg = dy.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var dhg = dh.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var rg = rstd_in.unsafe_address_space_cast[AddressSpace.GLOBAL]()
    var n = Int(n_cols)
    var m = Int(n_rows)
    var nv = n // VW
    var f = bwd_flags[False](params)
    var has_dh = f.has_dh
    var tid = thread_idx.x
    var lane = tid % WARP_SIZE
    var wid = tid // WARP_SIZE
    var step = grid_dim.x

    @always_inline
    def issue(row: Int, slot: Int) {var}:
        """cp.async row `row` into stage `slot` as one group (an empty group past M keeps one group per row)."""
        if row < m:
            var off = row * n
            comptime for k in range(NV):
                var j = tid + k * BLK
                if j < nv:
                    var d = slot * 3 * TS + (k * BLK + tid) * VW
                    async_copy[16](xg.unsafe_offset(off + j * VW), ring.unsafe_offset(d))
                    async_copy[16](dyg.unsafe_offset(off + j * VW), ring.unsafe_offset(d + TS))
                    if has_dh:
                        async_copy[16](dhg.unsafe_offset(off + j * VW), ring.unsafe_offset(d + 2 * TS))
            if lane == 0:
                async_copy[4](rg.unsafe_offset(row), rstd_ring.unsafe_offset(slot * MAX_WARPS + wid))
        async_copy_commit_group()

    var aw = SIMD[F32, C](0)  # this thread's dw partials
    var row = block_idx.x
    comptime for s in range(S - 1):
        issue(row + s * step, s)
    var it = 0
    while row < m:
        var slot = it % S
        issue(row + (S - 1) * step, (it + S - 1) % S)
        async_copy_wait_group(Int32(S - 1))  # this row's group (S - 1 newer groups may stay in flight)
        syncwarp()  # lane 0's rstd copy, visible to its warp
        var base = ring.unsafe_offset(slot * 3 * TS)
        var r = rstd_ring[unsafe_offset=slot * MAX_WARPS + wid]
        # columns past N are never loaded (their partials stay 0, their sums get nothing)
        var part = Float32(0)
        comptime for k in range(NV):
            var j = tid + k * BLK
            if j < nv:
                var e = (k * BLK + tid) * VW
                var xh = base.unsafe_load[width=VW, alignment=16](e).cast[F32]() * r
                var g = base.unsafe_load[width=VW, alignment=16](e + TS).cast[F32]() * _weff[wdtype, VW, 16](w, j * VW, f)
                part += (g * xh).reduce_add()
        var c = _block_allsum[BLK, 1](SIMD[F32, 1](part), red.unsafe_offset((it % 2) * MAX_WARPS))[0] / Float32(n)
        var dxr = dx.unsafe_offset(row * n)
        comptime for k in range(NV):
            var j = tid + k * BLK
            if j < nv:
                var e = (k * BLK + tid) * VW
                var xh = base.unsafe_load[width=VW, alignment=16](e).cast[F32]() * r
                var dyv = base.unsafe_load[width=VW, alignment=16](e + TS).cast[F32]()
                var d = r * (dyv * _weff[wdtype, VW, 16](w, j * VW, f) - xh * c)
                if has_dh:
                    d += base.unsafe_load[width=VW, alignment=16](e + 2 * TS).cast[F32]()
                dxr.unsafe_store[alignment=16](j * VW, d.cast[dtype]())
                aw = aw.insert[offset = k * VW](aw.slice[VW, offset = k * VW]() + _dw_term[dtype](dyv, xh, f))
        row += step
        it += 1
    async_copy_wait_group(0)  # the groups issued past M are empty; nothing may stay in flight at exit
    var pw = part_w.unsafe_offset(block_idx.x * n)
    comptime for k in range(NV):
        var j = tid + k * BLK
        if j < nv:
            pw.unsafe_store[alignment=16](j * VW, aw.slice[VW, offset = k * VW]())


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _row_sums_kernel[
    dtype: DType, wdtype: DType, LN: Bool, BLK: Int, W: Int
](
    sums: FPtr,
    dy: Pointer[Scalar[dtype], MutAnyOrigin],
    xin: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    mean_in: FPtr,
    rstd_in: FPtr,
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    """sums[row] = (mean(g x̂), mean(g)) for the column-tiled kernel: one block per row (grid-stride),
    two vectors of dy and xin in flight per thread."""
    var red = unsafe_stack_allocation[2 * MAX_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var n = Int(n_cols)
    var nw = n // W
    var f = bwd_flags[LN](params)
    var tid = thread_idx.x
    var row = block_idx.x
    while row < Int(n_rows):
        var off = row * n
        var xr = xin.unsafe_offset(off)
        var gr = dy.unsafe_offset(off)
        var mu = Float32(0)
        comptime if LN:
            mu = mean_in[unsafe_offset=row]
        var r = rstd_in[unsafe_offset=row]
        var s1 = SIMD[F32, W](0)
        var s2 = SIMD[F32, W](0)
        var j = tid
        while j + BLK < nw:
            var x0 = xr.unsafe_load[width=W, alignment=16](j * W)
            var x1 = xr.unsafe_load[width=W, alignment=16]((j + BLK) * W)
            var g0 = gr.unsafe_load[width=W, alignment=16](j * W).cast[F32]() * _weff[wdtype, W, 16](w, j * W, f)
            var g1 = gr.unsafe_load[width=W, alignment=16]((j + BLK) * W).cast[F32]() * _weff[wdtype, W, 16](
                w, (j + BLK) * W, f
            )
            s1 += g0 * ((x0.cast[F32]() - mu) * r) + g1 * ((x1.cast[F32]() - mu) * r)
            s2 += g0 + g1
            j += 2 * BLK
        if j < nw:
            var g0 = gr.unsafe_load[width=W, alignment=16](j * W).cast[F32]() * _weff[wdtype, W, 16](w, j * W, f)
            s1 += g0 * ((xr.unsafe_load[width=W, alignment=16](j * W).cast[F32]() - mu) * r)
            s2 += g0
        var tot = _block_allsum[BLK, 2](SIMD[F32, 2](s1.reduce_add(), s2.reduce_add()), red)
        if tid == 0:
            sums[unsafe_offset=2 * row] = tot[0] / Float32(n)
            sums[unsafe_offset=2 * row + 1] = tot[1] / Float32(n)
        row += grid_dim.x
        barrier()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(BLK)))
def _norm_bwd_loop_kernel[
    dtype: DType, wdtype: DType, LN: Bool, BLK: Int, W: Int
](
    dx: Pointer[Scalar[dtype], MutAnyOrigin],
    part_w: FPtr,
    part_b: FPtr,
    dy: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    xin: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    mean_in: FPtr,
    rstd_in: FPtr,
    params: FPtr,
    n_rows: Int64,
    n_cols: Int64,
):
    """Any N / alignment (launched with W = 1 for unaligned rows; W > 1 works too): a row-sum pass and a
    dx pass (dy / xin re-read from L2); the block's partials live in its row of part_w / part_b, each
    element read-modified-written only by the thread that owns the column (no race, no atomics)."""
    comptime AL = 16 if W > 1 else align_of[dtype]()
    comptime AW = 16 if W > 1 else align_of[wdtype]()
    comptime AF = 16 if W > 1 else 4
    var red = unsafe_stack_allocation[2 * MAX_WARPS, Float32, address_space=AddressSpace.SHARED]()
    var n = Int(n_cols)
    var nw = n // W
    var f = bwd_flags[LN](params)
    var tid = thread_idx.x
    var pw = part_w.unsafe_offset(block_idx.x * n)
    var pb = part_b.unsafe_offset(block_idx.x * n)
    var first = True
    var row = block_idx.x
    while row < Int(n_rows):
        var off = row * n
        var xr = xin.unsafe_offset(off)
        var gr = dy.unsafe_offset(off)
        var mu = Float32(0)
        comptime if LN:
            mu = mean_in[unsafe_offset=row]
        var r = rstd_in[unsafe_offset=row]
        var s1 = SIMD[F32, W](0)
        var s2 = SIMD[F32, W](0)
        var j = tid
        while j < nw:
            var xh = (xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() - mu) * r
            var g = gr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() * _weff[wdtype, W, AW](w, j * W, f)
            s1 += g * xh
            comptime if LN:
                s2 += g
            j += BLK
        var tot = _block_allsum[BLK, 2](SIMD[F32, 2](s1.reduce_add(), s2.reduce_add()), red)
        var c1 = tot[0] / Float32(n)
        var c2 = tot[1] / Float32(n)
        var dxr = dx.unsafe_offset(off)
        var dhr = dh.unsafe_offset(off)
        j = tid
        while j < nw:
            var xh = (xr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]() - mu) * r
            var dyv = gr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
            var g = dyv * _weff[wdtype, W, AW](w, j * W, f)
            var d: SIMD[F32, W]
            comptime if LN:
                d = r * (g - c2 - xh * c1)
            else:
                d = r * (g - xh * c1)
            if f.has_dh:
                d += dhr.unsafe_load[width=W, alignment=AL](j * W).cast[F32]()
            dxr.unsafe_store[alignment=AL](j * W, d.cast[dtype]())
            var tw = _dw_term[dtype](dyv, xh, f)
            if not first:
                tw = pw.unsafe_load[width=W, alignment=AF](j * W) + tw
            pw.unsafe_store[alignment=AF](j * W, tw)
            comptime if LN:
                if f.has_bias:
                    var tb = dyv
                    if not first:
                        tb = pb.unsafe_load[width=W, alignment=AF](j * W) + tb
                    pb.unsafe_store[alignment=AF](j * W, tb)
            j += BLK
        first = False
        row += grid_dim.x
        barrier()


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(RED_COLS * RED_ROWS)))
def _partials_sum_kernel[
    wdtype: DType
](res: Pointer[Scalar[wdtype], MutAnyOrigin], part: FPtr, params: FPtr, flag: Int64, n_parts: Int64, n_cols: Int64):
    """res[c] = Σ_p part[p, c] in a fixed order; nothing when params[flag] == 0 (flag >= 0)."""
    if flag >= 0 and params[unsafe_offset=Int(flag)] == 0:
        return  # uniform over the grid: the gradient is not wanted (db of a layer_norm without bias)
    var red = unsafe_stack_allocation[RED_COLS * RED_ROWS, Float32, address_space=AddressSpace.SHARED]()
    var n = Int(n_cols)
    var np = Int(n_parts)
    var c = thread_idx.x % RED_COLS
    var lane = thread_idx.x // RED_COLS
    var col = block_idx.x * RED_COLS + c
    var a = SIMD[F32, 4](0)  # 4 independent chains: 4 loads in flight per thread
    if col < n:
        var p = lane
        while p + 3 * RED_ROWS < np:
            comptime for u in range(4):
                a[u] += part[unsafe_offset=(p + u * RED_ROWS) * n + col]
            p += 4 * RED_ROWS
        while p < np:
            a[0] += part[unsafe_offset=p * n + col]
            p += RED_ROWS
    red[unsafe_offset=lane * RED_COLS + c] = (a[0] + a[1]) + (a[2] + a[3])
    barrier()
    if lane == 0 and col < n:
        var t = Float32(0)
        comptime for i in range(RED_ROWS):
            t += red[unsafe_offset=i * RED_COLS + c]
        res[unsafe_offset=col] = t.cast[wdtype]()


def _whole_row_block(nv: Int, per: Int) -> Int:
    """The smallest block of 64..1024 threads holding a row of nv vectors at `per` vectors per thread (the
    whole-row kernels; specs.py norm_bwd_partials mirrors it)."""
    var blk = 64
    while blk * per < nv:
        blk *= 2
    return blk


def _op_name[LN: Bool]() -> StaticString:
    return "fusekit.layer_norm_backward" if LN else "fusekit.rms_norm_backward"


def _check_parts[LN: Bool](pw_len: Int, pb_len: Int, need: Int) raises:
    """The [P, N] partials workspaces hold need = P * N elements (part_b only for layer_norm)."""
    check_workspace(_op_name[LN](), "part_w", pw_len, need)
    comptime if LN:
        check_workspace(_op_name[LN](), "part_b", pb_len, need)


def norm_bwd_gpu[
    dtype: DType, wdtype: DType, LN: Bool
](
    ctx: DeviceContext,
    dx: Pointer[Scalar[dtype], MutAnyOrigin],
    dw: Pointer[Scalar[wdtype], MutAnyOrigin],
    db: Pointer[Scalar[wdtype], MutAnyOrigin],
    sp: FPtr,
    sums_len: Int,
    pw: FPtr,
    pw_len: Int,
    pb: FPtr,
    pb_len: Int,
    dy: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    xin: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    mean_in: FPtr,
    rstd_in: FPtr,
    params: FPtr,
    m: Int,
    n: Int,
) raises:
    """Pick the kernel by row length and alignment, launch it on a persistent grid, then reduce the
    partials. dh (and db, and mean_in for rms_norm) may be dummies: only dh's address is looked at.
    Workspaces (the caller's, with their lengths in elements): sp the row sums [M, 2] of the column-tiled
    kernel, pw / pb the [P, N] fp32 partials of dw / db (pb only when LN). The bounds, mirrored by
    python/fusekit/backends/mojo/specs.py norm_bwd_sums / norm_bwd_partials (exact mirrors of this plan):
    sums 2 * M for aligned rows of more than 1024 * NV vectors that the cp.async kernel does not take (it
    takes rms_norm's 16-bit rows up to 16 K on NVIDIA), else none; P = progs of the branch taken,
    P <= max(1, min(M, 16 SMs)) on every branch (blocks of >= 64 threads, ~1024 threads per SM)."""
    comptime VW = vec_width[dtype]()
    var sms = ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
    var vec_ok = n % VW == 0 and is_aligned16(dx) and is_aligned16(dy) and is_aligned16(xin)
    vec_ok = vec_ok and is_aligned16(w) and is_aligned16(dh)
    comptime NV = max(1, REG_ELEMS // VW)
    comptime RS = 1 if LN else 2  # rows per step of the whole-row register kernel below 1024 threads
    # rms_norm with 16-bit x on NVIDIA: the cp.async kernel for whole rows (see _rms_bwd_pipe_kernel)
    comptime PIPE = not LN and size_of[dtype]() == 2 and DeviceContext.default_device_info.api == "cuda"
    var nv = n // VW
    var M = Int64(m)
    var N = Int64(n)
    var progs: Int  # rows of partials
    if not vec_ok:
        # unaligned: the W = 1 loop kernel, ~1024 resident threads per SM (P * N <= SMs * 8 * 4096)
        var blk = 128 if n <= 4096 else LOOP_BLK
        progs = min(m, sms * (1024 // blk))
        _check_parts[LN](pw_len, pb_len, progs * n)
        if blk == 128:
            ctx.enqueue_function[_norm_bwd_loop_kernel[dtype, wdtype, LN, 128, 1]](
                dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, params, M, N, grid_dim=progs, block_dim=128
            )
        else:
            ctx.enqueue_function[_norm_bwd_loop_kernel[dtype, wdtype, LN, LOOP_BLK, 1]](
                dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, params, M, N, grid_dim=progs, block_dim=LOOP_BLK
            )
    elif PIPE and n <= 1024 * PIPE_COLS:
        # rms_norm, 16-bit x on NVIDIA: whole rows with their loads a row ahead (cp.async), the smallest
        # block of 64..1024 threads holding the row in 16 columns per thread, ~1024 resident threads per SM
        var blk = _whole_row_block(nv, PIPE_COLS // VW)
        progs = min(m, sms * max(1, 1024 // blk))
        _check_parts[LN](pw_len, pb_len, progs * n)

        @always_inline
        def launch_pipe[BLK: Int]() raises {var}:
            comptime if PIPE:
                var smem = pipe_smem_bytes[dtype](BLK)
                ctx.enqueue_function[_rms_bwd_pipe_kernel[dtype, wdtype, BLK]](
                    dx, pw, dy, dh, xin, w, rstd_in, params, M, N, grid_dim=progs, block_dim=BLK,
                    shared_mem_bytes=smem, func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
                )

        if blk == 64:
            launch_pipe[64]()
        elif blk == 128:
            launch_pipe[128]()
        elif blk == 256:
            launch_pipe[256]()
        elif blk == 512:
            launch_pipe[512]()
        else:
            launch_pipe[1024]()
    elif nv > 1024 * NV:
        # long rows: row sums first, then 1024 x 8-column chunks x row groups, ~one block per SM
        check_workspace(_op_name[LN](), "sums", sums_len, 2 * m)
        ctx.enqueue_function[_row_sums_kernel[dtype, wdtype, LN, LOOP_BLK, VW]](
            sp, dy, xin, w, mean_in, rstd_in, params, M, N, grid_dim=min(m, 1 << 30), block_dim=LOOP_BLK
        )
        var chunks = cdiv(nv, 1024 * NV)
        progs = max(1, min(m, cdiv(sms, chunks)))
        _check_parts[LN](pw_len, pb_len, progs * n)
        ctx.enqueue_function[_norm_bwd_reg_kernel[dtype, wdtype, LN, 1024, NV, True, 1]](
            dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, sp, params, M, N, grid_dim=chunks * progs, block_dim=1024
        )
    else:
        # whole rows in registers: the smallest block holding the row in NV vectors per thread, and
        # ~1024 resident threads per SM (P * N <= SMs * 8 K partials). rms_norm below 1024 threads: 2 rows
        # per step (RS). H200, bf16 backward (harness/_normh.mojo, same call): 32768x4096 380 -> 278 us,
        # 32768x1024 95.6 -> 78.6; layer_norm lost with it in the stats-first load order (269 -> 314,
        # 83.8 -> 107; that order alone cost it at 1 row too, see the kernel) and keeps 1 row per step:
        # 2 rows in its current order lost as well (same call: 32768x1024 83.2 -> 100.8, x4096 267 -> 307)
        var blk = _whole_row_block(nv, NV)
        progs = min(m, sms * max(1, 1024 // blk))
        _check_parts[LN](pw_len, pb_len, progs * n)
        if blk == 64:
            ctx.enqueue_function[_norm_bwd_reg_kernel[dtype, wdtype, LN, 64, NV, False, RS]](
                dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, sp, params, M, N, grid_dim=progs, block_dim=64
            )
        elif blk == 128:
            ctx.enqueue_function[_norm_bwd_reg_kernel[dtype, wdtype, LN, 128, NV, False, RS]](
                dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, sp, params, M, N, grid_dim=progs, block_dim=128
            )
        elif blk == 256:
            ctx.enqueue_function[_norm_bwd_reg_kernel[dtype, wdtype, LN, 256, NV, False, RS]](
                dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, sp, params, M, N, grid_dim=progs, block_dim=256
            )
        elif blk == 512:
            ctx.enqueue_function[_norm_bwd_reg_kernel[dtype, wdtype, LN, 512, NV, False, RS]](
                dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, sp, params, M, N, grid_dim=progs, block_dim=512
            )
        else:
            ctx.enqueue_function[_norm_bwd_reg_kernel[dtype, wdtype, LN, 1024, NV, False, 1]](
                dx, pw, pb, dy, dh, xin, w, mean_in, rstd_in, sp, params, M, N, grid_dim=progs, block_dim=1024
            )
    var grid = cdiv(n, RED_COLS)
    var P = Int64(progs)
    ctx.enqueue_function[_partials_sum_kernel[wdtype]](
        dw, pw, params, Int64(-1), P, N, grid_dim=grid, block_dim=RED_COLS * RED_ROWS
    )
    comptime if LN:
        ctx.enqueue_function[_partials_sum_kernel[wdtype]](
            db, pb, params, Int64(2), P, N, grid_dim=grid, block_dim=RED_COLS * RED_ROWS
        )


def norm_bwd_cpu[
    dtype: DType, wdtype: DType, LN: Bool
](
    dx: Pointer[Scalar[dtype], MutAnyOrigin],
    dw: Pointer[Scalar[wdtype], MutAnyOrigin],
    db: Pointer[Scalar[wdtype], MutAnyOrigin],
    dy: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    xin: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    mean_in: FPtr,
    rstd_in: FPtr,
    params: FPtr,
    m: Int,
    n: Int,
):
    """Plain fp32 loops, rows in order (deterministic); dw / db accumulate in fp32, cast at the end."""
    var f = bwd_flags[LN](params)
    var aw = List[Float32](length=n, fill=0)
    var ab = List[Float32](length=n if LN else 1, fill=0)
    for row in range(m):
        var off = row * n
        var mu = Float32(0)
        comptime if LN:
            mu = mean_in[unsafe_offset=row]
        var r = rstd_in[unsafe_offset=row]
        var s1 = Float32(0)
        var s2 = Float32(0)
        for j in range(n):
            var xh = (xin[unsafe_offset=off + j].cast[F32]() - mu) * r
            var g = dy[unsafe_offset=off + j].cast[F32]() * _weff[wdtype, 1, align_of[wdtype]()](w, j, f)[0]
            s1 += g * xh
            s2 += g
        var c1 = s1 / Float32(n)
        var c2 = s2 / Float32(n)
        for j in range(n):
            var xh = (xin[unsafe_offset=off + j].cast[F32]() - mu) * r
            var dyv = dy[unsafe_offset=off + j].cast[F32]()
            var g = dyv * _weff[wdtype, 1, align_of[wdtype]()](w, j, f)[0]
            var d: Float32
            comptime if LN:
                d = r * (g - c2 - xh * c1)
                ab[j] += dyv
            else:
                d = r * (g - xh * c1)
            if f.has_dh:
                d += dh[unsafe_offset=off + j].cast[F32]()
            dx[unsafe_offset=off + j] = d.cast[dtype]()
            aw[j] += _dw_term[dtype, 1](dyv, xh, f)[0]
    for j in range(n):
        dw[unsafe_offset=j] = aw[j].cast[wdtype]()
        comptime if LN:
            if f.has_bias:
                db[unsafe_offset=j] = ab[j].cast[wdtype]()
