# fusekit.swiglu_ffn: out = (silu(xn @ w_gate^T) * (xn @ w_up^T)) @ w_down^T, xn = rms_norm(x) or x.
#
# Contract: out [T, D], rstd [T] f32 (written when has_norm), gu [T, 2F] = [round(g), round(u)] (written
# when save: a training call, for fusekit.swiglu_ffn_backward), then the workspaces xn, h, g (f32), out_pad
# (rank 1, see FfnScratch; 1-element dummies on the CPU) <- x [T, D], w_gate [F, D], w_up [F, D],
# w_down [D, F], norm_weight [D] (x's dtype or fp32), params [3] f32 = [eps, has_norm, save].
# Precision = python/fusekit/ops/swiglu_ffn.py: xn rounded to x.dtype, g/u accumulated in fp32,
# h = silu(g) * u in fp32 rounded to x.dtype, out accumulated in fp32.
# norm_weight and rstd are not touched when has_norm == 0 (they may be dummies), gu not when save == 0
# (a [1, 1] dummy; the GPU path tells save from gu's shape, [T, 2F] with 2F >= 2, as params live on the
# device). With save the gate/up epilogue (GEMV or tensor-core path) also stores round(g) and round(u).
#
# fusekit.swiglu_ffn_backward (the struct at the end; kernels in _swiglu_backward.mojo) is the backward's
# element-wise part only: the five GEMMs run as torch matmuls in python/fusekit/backends/mojo/__init__.py.
#
# Floors (H200, bf16, D 4096, F 11008):
# - decode (T = 1): the three weight matrices, 3*D*F*2 B = 270 MB, at ~4.3 TB/s -> ~63 us; FLOPs are
#   negligible. Path: a norm kernel, then two GEMV kernels (gate+up with the SiLU*mul epilogue, then
#   down) that stream weight rows with 16-byte loads, one warp per weight row, T <= 16 activations
#   held per lane, warp reductions. Weights are read exactly once.
# - T >= TC_MIN_T with a static (D, F) pair, e.g. prefill (T = 4096): 6*T*D*F = 1.11 TFLOP, ~1.5 ms
#   at ~750 TFLOP/s: compute-bound. Path: a norm
#   kernel (xn, 32 MB), then MAX's Hopper warp-specialised wgmma matmul three times:
#   G = xn @ w_gate^T into an fp32 scratch; xn @ w_up^T with an epilogue lambda that reads G and
#   stores h = silu(g) * u (so h never exists in fp32 and U never touches memory); out = h @ w_down^T.
#   Extra traffic over an ideal dual-B fused kernel: G written + read in fp32 (2 * 180 MB, ~85 us, ~5%).
#   MAX's sm90 dispatch only takes static N and K, so the (D, F) pairs of common models are
#   instantiated in tc/swiglu_ffn_tc.mojo (`_STATIC_DF`); other shapes, fp16 and non-NVIDIA targets run the GEMV kernels
#   over 16-row chunks of T (correct, re-streams the weights per chunk: slow for large T).
#   Caveat: MAX's epilogue receives u already cast to the output dtype (bf16), so h = silu(g) * bf16(u)
#   there; the extra rounding of u is <= 2^-9 relative, the same size as the final rounding of h.
# - Other (D, F): MAX 26.7's multistage_gemm with runtime N/K was tried for them and left most of its
#   output unwritten on an H100 (2026-11-26 probe; static N/K was correct). From TC_MIN_T tokens on they
#   run as torch GEMMs around this package's norm (python/fusekit/backends/mojo/__init__.py), below it on
#   the GEMV kernels.
#
# Index widths (issue #15, inputs past 2^31 elements: T x F h / g / gu, T x D x / xn / out): every element
# offset is an Int (64-bit), including block_idx / global_idx products and the epilogues' row * F + col;
# Int32 kernel arguments carry only D, F, K, N (one matrix dimension each) and T <= DECODE_MAX_T (GEMV),
# and the copy kernel's length T * D is Int64. Grid: the norm kernel launches T blocks on axis x
# (limit 2^31 - 1). MAX's sm90 wgmma matmul takes M = Tp rows (TMA coordinates are 32-bit:
# Tp < 2^31, far above any T whose buffers fit in memory).

from std.math import ceildiv, exp
# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import thread_idx, block_idx, lane_id, WARP_SIZE
from max.gpu.host import DeviceContext
from max.gpu.primitives import warp, block

from ._swiglu_backward import swiglu_bwd_gpu, swiglu_bwd_cpu
# No `linalg` import here (issue #14 item 3): `from linalg.matmul.gpu import _matmul_gpu` alone made this
# package's `mojo precompile` 7 s instead of 3 s on a 2-core CPU, paid by every op's first call in a fresh
# process. The wgmma path (fusekit.swiglu_ffn_tc) lives in the subpackage tc/, precompiled into its own
# .mojoc only when a call is first routed to it (python/fusekit/backends/mojo/runtime.py);
# tests/test_mojo_tc_package.py keeps linalg out of the top-level files.
from ._util import check_workspace, is_aligned16, rsqrt_full_range

comptime GEMV_WARPS = 4  # warps per block in the GEMV kernels (one weight row per warp)
comptime NORM_THREADS = 256
comptime DECODE_MAX_T = 16  # GEMV kernels hold <= 16 activation rows per lane
# With a static-shape tensor-core path available, T >= TC_MIN_T uses it. Measured on the H200
# (D4096 F11008 bf16, us): T      1    2    3    4    8   16   32   64 | torch.compile T<=16: 95
#                          GEMV  84  105  119  137  222  612 1252 2489 |
#                          wgmma  -  150  150  149  147  149  151  156 |
# The GEMV re-reads x from L1 per 8 FMAs and per row, so it is issue-bound beyond a few rows; the
# wgmma path costs ~150 us flat at small T (3 matmuls + the fp32 G round trip + small-M tiles).
# MAX's sm90 matmul is given M = T rounded up to TC_PAD rows, never the caller's T: with an M that is
# not a multiple of its tile it wrote whole tiles past the last row (the H200 conformance run at T = 16
# found the caller's `x`, allocated next to `out`, zeroed after the call), and the fused epilogue is
# called for those rows too. So A (xn, h), G, h and the matmul output live in scratch buffers of
# Tp = ceil(T / TC_PAD) * TC_PAD rows (rows >= T hold garbage that only reaches rows >= T), the epilogue
# stores gu for rows < T only, and the first T rows of the output are copied to `o`.
# Every scratch buffer is the caller's workspace (FfnScratch; sizes in python/fusekit/backends/mojo/
# specs.py swiglu_xn / swiglu_h / swiglu_g / swiglu_out): no allocation inside the op.
# The wgmma path gave wrong results at T = 5 before that padding (rel err 25; same cause suspected);
# T < 16 stays on the GEMV path.
comptime TC_MIN_T = 16
comptime TC_PAD = 256  # >= the largest M tile (and, with swapAB for small M, N tile) of MAX's sm90 matmul
comptime _OP = "fusekit.swiglu_ffn"


@always_inline
def _tc_rows(T: Int) -> Int:
    """Rows of every matrix MAX's sm90 matmul sees for T tokens (xn must be allocated this tall)."""
    return ceildiv(T, TC_PAD) * TC_PAD


struct FfnScratch[dtype: DType](Copyable, Movable):
    """The GPU path's workspaces (the caller's; lengths in elements). With Tp = _tc_rows(T) from
    tc_min_t tokens on, else T: xn [Tp, D]; h in x's dtype, [Tp, F] on the wgmma path (_ffn_tc), else one
    GEMV chunk [min(T, DECODE_MAX_T), F]; g [Tp, F] fp32 and out_pad [Tp, D] on the wgmma path only.
    (Struct fields cannot hold AnyOrigin pointers: they are stored untracked, read back as MutAnyOrigin.)"""

    comptime P = Pointer[Scalar[Self.dtype], MutAnyOrigin]
    comptime _U = Pointer[Scalar[Self.dtype], MutUntrackedOrigin]
    var _xn: Self._U
    var xn_len: Int
    var _h: Self._U
    var h_len: Int
    var _g: Pointer[Float32, MutUntrackedOrigin]
    var g_len: Int
    var _out_pad: Self._U
    var out_pad_len: Int

    def __init__(
        out self,
        xn: Self.P,
        xn_len: Int,
        h: Self.P,
        h_len: Int,
        g: Pointer[Float32, MutAnyOrigin],
        g_len: Int,
        out_pad: Self.P,
        out_pad_len: Int,
    ):
        self._xn = rebind[Self._U](xn)
        self.xn_len = xn_len
        self._h = rebind[Self._U](h)
        self.h_len = h_len
        self._g = rebind[Pointer[Float32, MutUntrackedOrigin]](g)
        self.g_len = g_len
        self._out_pad = rebind[Self._U](out_pad)
        self.out_pad_len = out_pad_len

    def xn(self) -> Self.P:
        return rebind[Self.P](self._xn)

    def h(self) -> Self.P:
        return rebind[Self.P](self._h)

    def g(self) -> Pointer[Float32, MutAnyOrigin]:
        return rebind[Pointer[Float32, MutAnyOrigin]](self._g)

    def out_pad(self) -> Self.P:
        return rebind[Self.P](self._out_pad)

    def as_bf16(self) -> FfnScratch[DType.bfloat16]:
        """The same buffers, typed for the bf16-only wgmma path."""
        comptime B = Pointer[BFloat16, MutAnyOrigin]
        return FfnScratch[DType.bfloat16](
            rebind[B](self.xn()), self.xn_len, rebind[B](self.h()), self.h_len, self.g(), self.g_len,
            rebind[B](self.out_pad()), self.out_pad_len,
        )


@always_inline
def _silu_mul(g: Float32, u: Float32) -> Float32:
    return g / (1.0 + exp(-g)) * u


def _norm_kernel[
    dtype: DType, wdtype: DType
](
    xn: Pointer[Scalar[dtype], MutAnyOrigin],
    rstd_out: Pointer[Float32, MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    w: Pointer[Scalar[wdtype], MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    D: Int32,
):
    """One block per row: xn = x * rsqrt(mean(x^2) + eps) * w (fp32, one cast), rstd written;
    xn = x if no norm."""
    var row = block_idx.x
    var d = Int(D)
    var base = row * d
    var has_norm = params[unsafe_offset=1] != 0
    if not has_norm:
        for j in range(thread_idx.x, d, NORM_THREADS):
            xn[unsafe_offset=base + j] = x[unsafe_offset=base + j]
        return
    var ss: Float32 = 0
    for j in range(thread_idx.x, d, NORM_THREADS):
        var xv = x[unsafe_offset=base + j].cast[DType.float32]()
        ss += xv * xv
    var tot = block.sum[block_size=NORM_THREADS](ss)
    var rstd = rsqrt_full_range(tot / Float32(d) + params[unsafe_offset=0])
    if thread_idx.x == 0:
        rstd_out[unsafe_offset=row] = rstd
    for j in range(thread_idx.x, d, NORM_THREADS):
        var y = x[unsafe_offset=base + j].cast[DType.float32]() * rstd * w[unsafe_offset=j].cast[DType.float32]()
        xn[unsafe_offset=base + j] = y.cast[dtype]()


def _gemv_kernel[
    dtype: DType, NT: Int, W: Int, GATED: Bool
](
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    xa: Pointer[Scalar[dtype], MutAnyOrigin],
    w1: Pointer[Scalar[dtype], MutAnyOrigin],
    w2: Pointer[Scalar[dtype], MutAnyOrigin],
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    save: Int32,
    T: Int32,
    K: Int32,
    N: Int32,
):
    """res[t, n] = epi(sum_k xa[t, k] * w1[n, k] [, same with w2]) for t < T <= NT, one warp per n.

    GATED: res = silu(x @ w1^T) * (x @ w2^T) (gate/up), and with save != 0 also gu[t, n] = round(x @ w1^T),
    gu[t, N + n] = round(x @ w2^T) (gu rows of 2N); else res = x @ w1^T (w2, gu unused).
    Each lane reads W contiguous weights (16 B for W = 8) per step; activations (<= NT rows) are
    re-read from L1/L2, the weights are streamed from HBM once.
    """
    var n = block_idx.x * GEMV_WARPS + thread_idx.x // WARP_SIZE
    if n >= Int(N):
        return
    var lane = lane_id()
    var k = Int(K)
    var t_len = Int(T)
    var acc1 = SIMD[DType.float32, NT](0)
    var acc2 = SIMD[DType.float32, NT](0)
    var wrow = n * k
    var steps = k // W
    var c = lane
    # two steps per iteration so each lane has >= 2 (4 gated) 16-byte weight loads in flight
    while c + WARP_SIZE < steps:
        var a0 = w1.unsafe_load[width=W, alignment=W * 2](wrow + c * W).cast[DType.float32]()
        var a1 = w1.unsafe_load[width=W, alignment=W * 2](wrow + (c + WARP_SIZE) * W).cast[DType.float32]()
        var b0 = SIMD[DType.float32, W](0)
        var b1 = SIMD[DType.float32, W](0)
        comptime if GATED:
            b0 = w2.unsafe_load[width=W, alignment=W * 2](wrow + c * W).cast[DType.float32]()
            b1 = w2.unsafe_load[width=W, alignment=W * 2](wrow + (c + WARP_SIZE) * W).cast[DType.float32]()
        comptime for t in range(NT):
            if t < t_len:
                var x0 = xa.unsafe_load[width=W, alignment=W * 2](t * k + c * W).cast[DType.float32]()
                var x1 = xa.unsafe_load[width=W, alignment=W * 2](t * k + (c + WARP_SIZE) * W).cast[
                    DType.float32
                ]()
                acc1[t] += (a0 * x0 + a1 * x1).reduce_add()
                comptime if GATED:
                    acc2[t] += (b0 * x0 + b1 * x1).reduce_add()
        c += 2 * WARP_SIZE
    while c < steps:
        var a0 = w1.unsafe_load[width=W, alignment=W * 2](wrow + c * W).cast[DType.float32]()
        var b0 = SIMD[DType.float32, W](0)
        comptime if GATED:
            b0 = w2.unsafe_load[width=W, alignment=W * 2](wrow + c * W).cast[DType.float32]()
        comptime for t in range(NT):
            if t < t_len:
                var x0 = xa.unsafe_load[width=W, alignment=W * 2](t * k + c * W).cast[DType.float32]()
                acc1[t] += (a0 * x0).reduce_add()
                comptime if GATED:
                    acc2[t] += (b0 * x0).reduce_add()
        c += WARP_SIZE
    comptime for t in range(NT):
        if t < t_len:
            var s1 = warp.sum(acc1[t])
            comptime if GATED:
                var s2 = warp.sum(acc2[t])
                if lane == 0:
                    res[unsafe_offset=t * Int(N) + n] = _silu_mul(s1, s2).cast[dtype]()
                    if save != 0:
                        gu[unsafe_offset=2 * t * Int(N) + n] = s1.cast[dtype]()
                        gu[unsafe_offset=2 * t * Int(N) + Int(N) + n] = s2.cast[dtype]()
            else:
                if lane == 0:
                    res[unsafe_offset=t * Int(N) + n] = s1.cast[dtype]()


def _gemv[
    dtype: DType, GATED: Bool
](
    res: Pointer[Scalar[dtype], MutAnyOrigin],
    xa: Pointer[Scalar[dtype], MutAnyOrigin],
    w1: Pointer[Scalar[dtype], MutAnyOrigin],
    w2: Pointer[Scalar[dtype], MutAnyOrigin],
    T: Int,
    K: Int,
    N: Int,
    ctx: DeviceContext,
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    save: Bool,
) raises:
    """Pick the activation-count bucket (compile-time NT) and vector width for one GEMV launch."""

    @always_inline
    def go[NT: Int, W: Int]() raises {var}:
        ctx.enqueue_function[_gemv_kernel[dtype, NT, W, GATED]](
            res,
            xa,
            w1,
            w2,
            gu,
            Int32(1 if save else 0),
            Int32(T),
            Int32(K),
            Int32(N),
            grid_dim=ceildiv(N, GEMV_WARPS),
            block_dim=GEMV_WARPS * WARP_SIZE,
        )

    @always_inline
    def go_w[W: Int]() raises {var}:
        if T <= 1:
            go[1, W]()
        elif T <= 2:
            go[2, W]()
        elif T <= 4:
            go[4, W]()
        elif T <= 8:
            go[8, W]()
        else:
            go[16, W]()

    # 16-byte loads need 16-byte aligned rows: K a whole number of vectors and every base pointer aligned (a
    # weight viewed at an odd offset of a flat buffer would fault the context with a misaligned address)
    if K % 8 == 0 and is_aligned16(xa) and is_aligned16(w1) and is_aligned16(w2):
        go_w[8]()
    else:
        go_w[1]()


# Compile time (issue #14): no function reachable from fusekit.swiglu_ffn may name _ffn_tc, not even in a
# `comptime if` branch that is never taken: such a dead reference (its _matmul_gpu calls) still cost ~20 s
# of the op's first-call compile (bf16 virtual-sm_90 MAX graph compile on a 2-core CPU: 32-38 s with it,
# 14-18 s without; `mojo build` of the forward alone 20 s -> 7 s; byte-identical PTX either way), which
# is why the GEMV-only forward is its own function rather than swiglu_ffn_gpu_save with a with_tc = False
# parameter, and why the ops pick it through a struct parameter (_FfnGpuPath) rather than a comptime if.
def swiglu_ffn_gpu_gemv[
    wdtype: DType, //, dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    rstd: Pointer[Float32, MutAnyOrigin],
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    save: Bool,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    wg: Pointer[Scalar[dtype], MutAnyOrigin],
    wu: Pointer[Scalar[dtype], MutAnyOrigin],
    wd: Pointer[Scalar[dtype], MutAnyOrigin],
    nw: Pointer[Scalar[wdtype], MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    T: Int,
    D: Int,
    F: Int,
    ctx: DeviceContext,
    ws: FfnScratch[dtype],
) raises:
    """swiglu_ffn_gpu_save with the GEMV path only (fusekit.swiglu_ffn): T <= 16 at once, larger T in
    16-row chunks."""
    var xn = _ffn_norm[dtype](rstd, x, nw, params, T, D, T, ctx, ws)
    _ffn_gemv_path[dtype](o, gu, save, xn, wg, wu, wd, T, D, F, ctx, ws)


def _ffn_norm[
    wdtype: DType, //, dtype: DType
](
    rstd: Pointer[Float32, MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    nw: Pointer[Scalar[wdtype], MutAnyOrigin],
    params: Pointer[Float32, MutAnyOrigin],
    T: Int,
    D: Int,
    xn_rows: Int,
    ctx: DeviceContext,
    ws: FfnScratch[dtype],
) raises -> Pointer[Scalar[dtype], MutAnyOrigin]:
    """Launch the norm kernel into ws.xn (checked to hold xn_rows rows) and return ws.xn."""
    check_workspace(_OP, "xn", ws.xn_len, xn_rows * D)
    var xn = ws.xn()
    ctx.enqueue_function[_norm_kernel[dtype, wdtype]](xn, rstd, x, nw, params, Int32(D), grid_dim=T, block_dim=NORM_THREADS)
    return xn


def _ffn_gemv_path[
    dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    save: Bool,
    xn: Pointer[Scalar[dtype], MutAnyOrigin],
    wg: Pointer[Scalar[dtype], MutAnyOrigin],
    wu: Pointer[Scalar[dtype], MutAnyOrigin],
    wd: Pointer[Scalar[dtype], MutAnyOrigin],
    T: Int,
    D: Int,
    F: Int,
    ctx: DeviceContext,
    ws: FfnScratch[dtype],
) raises:
    """The GEMV path after the norm: T <= 16 at once (decode), larger T in 16-row chunks."""
    check_workspace(_OP, "h", ws.h_len, min(T, DECODE_MAX_T) * F)
    var hp = ws.h()
    var t0 = 0
    while t0 < T:
        var tc = min(DECODE_MAX_T, T - t0)
        var gu_t = gu.unsafe_offset(t0 * 2 * F) if save else gu
        _gemv[dtype, True](hp, xn.unsafe_offset(t0 * D), wg, wu, tc, D, F, ctx, gu_t, save)
        _gemv[dtype, False](o.unsafe_offset(t0 * D), hp, wd, wd, tc, F, D, ctx, gu_t, False)
        t0 += tc


trait _FfnGpuPath:
    """The GPU forward an op compiles (see swiglu_ffn_gpu_gemv for why this is a type, not a Bool)."""

    @staticmethod
    def run[
        wdtype: DType, //, dtype: DType
    ](
        o: Pointer[Scalar[dtype], MutAnyOrigin],
        rstd: Pointer[Float32, MutAnyOrigin],
        gu: Pointer[Scalar[dtype], MutAnyOrigin],
        save: Bool,
        x: Pointer[Scalar[dtype], MutAnyOrigin],
        wg: Pointer[Scalar[dtype], MutAnyOrigin],
        wu: Pointer[Scalar[dtype], MutAnyOrigin],
        wd: Pointer[Scalar[dtype], MutAnyOrigin],
        nw: Pointer[Scalar[wdtype], MutAnyOrigin],
        params: Pointer[Float32, MutAnyOrigin],
        T: Int,
        D: Int,
        F: Int,
        ctx: DeviceContext,
        ws: FfnScratch[dtype],
    ) raises:
        ...


struct _GemvPath(_FfnGpuPath):
    """fusekit.swiglu_ffn: the GEMV kernels only."""

    @staticmethod
    def run[
        wdtype: DType, //, dtype: DType
    ](
        o: Pointer[Scalar[dtype], MutAnyOrigin],
        rstd: Pointer[Float32, MutAnyOrigin],
        gu: Pointer[Scalar[dtype], MutAnyOrigin],
        save: Bool,
        x: Pointer[Scalar[dtype], MutAnyOrigin],
        wg: Pointer[Scalar[dtype], MutAnyOrigin],
        wu: Pointer[Scalar[dtype], MutAnyOrigin],
        wd: Pointer[Scalar[dtype], MutAnyOrigin],
        nw: Pointer[Scalar[wdtype], MutAnyOrigin],
        params: Pointer[Float32, MutAnyOrigin],
        T: Int,
        D: Int,
        F: Int,
        ctx: DeviceContext,
        ws: FfnScratch[dtype],
    ) raises:
        swiglu_ffn_gpu_gemv[dtype](o, rstd, gu, save, x, wg, wu, wd, nw, params, T, D, F, ctx, ws)


def swiglu_ffn_cpu[
    wdtype: DType, //, dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    rstd_out: Pointer[Float32, MutAnyOrigin],
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    save: Bool,
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    wg: Pointer[Scalar[dtype], MutAnyOrigin],
    wu: Pointer[Scalar[dtype], MutAnyOrigin],
    wd: Pointer[Scalar[dtype], MutAnyOrigin],
    nw: Pointer[Scalar[wdtype], MutAnyOrigin],
    eps: Float32,
    has_norm: Bool,
    T: Int,
    D: Int,
    F: Int,
):
    """Plain loops with fp32 accumulation; the same roundings as the reference."""
    var xn = List[Float32](length=D, fill=0)
    var hh = List[Float32](length=F, fill=0)
    for t in range(T):
        var rstd: Float32 = 1
        if has_norm:
            var ss: Float32 = 0
            for j in range(D):
                var xv = x[unsafe_offset=t * D + j].cast[DType.float32]()
                ss += xv * xv
            rstd = rsqrt_full_range(ss / Float32(D) + eps)
            rstd_out[unsafe_offset=t] = rstd
        for j in range(D):
            var xv = x[unsafe_offset=t * D + j].cast[DType.float32]()
            if has_norm:
                xv = (xv * rstd * nw[unsafe_offset=j].cast[DType.float32]()).cast[dtype]().cast[DType.float32]()
            xn[j] = xv
        for f in range(F):
            var g: Float32 = 0
            var u: Float32 = 0
            for j in range(D):
                g += xn[j] * wg[unsafe_offset=f * D + j].cast[DType.float32]()
                u += xn[j] * wu[unsafe_offset=f * D + j].cast[DType.float32]()
            hh[f] = _silu_mul(g, u).cast[dtype]().cast[DType.float32]()
            if save:
                gu[unsafe_offset=2 * t * F + f] = g.cast[dtype]()
                gu[unsafe_offset=2 * t * F + F + f] = u.cast[dtype]()
        for d in range(D):
            var acc: Float32 = 0
            for f in range(F):
                acc += hh[f] * wd[unsafe_offset=d * F + f].cast[DType.float32]()
            o[unsafe_offset=t * D + d] = acc.cast[dtype]()


# The op's body, shared by fusekit.swiglu_ffn (Path = _GemvPath) and fusekit.swiglu_ffn_tc (_TcPath in
# tc/swiglu_ffn_tc.mojo: with the wgmma path for _STATIC_DF): the wgmma matmuls cost ~70 s of the GPU
# compile (H100, MAX 26.7), so a call compiles them only when python/fusekit/backends/mojo routes a
# static-pair prefill to fusekit.swiglu_ffn_tc.
def _swiglu_ffn_execute[
    dtype: DType, wdtype: DType, //, target: StaticString, Path: _FfnGpuPath
](
    res: MutableInputTensor[dtype=dtype, rank=2, ...],
    rstd: MutableInputTensor[dtype=DType.float32, rank=1, ...],
    gu: MutableInputTensor[dtype=dtype, rank=2, ...],
    xn: MutableInputTensor[dtype=dtype, rank=1, ...],
    h: MutableInputTensor[dtype=dtype, rank=1, ...],
    g: MutableInputTensor[dtype=DType.float32, rank=1, ...],
    out_pad: MutableInputTensor[dtype=dtype, rank=1, ...],
    x: InputTensor[dtype=dtype, rank=2, ...],
    w_gate: InputTensor[dtype=dtype, rank=2, ...],
    w_up: InputTensor[dtype=dtype, rank=2, ...],
    w_down: InputTensor[dtype=dtype, rank=2, ...],
    norm_weight: InputTensor[dtype=wdtype, rank=1, ...],
    params: InputTensor[dtype=DType.float32, rank=1, ...],
    ctx: DeviceContext,
) raises:
    var T = x.dim_size(0)
    var D = x.dim_size(1)
    var F = w_gate.dim_size(0)
    var op = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](res.unsafe_ptr())
    var rp = rebind[Pointer[Float32, MutAnyOrigin]](rstd.unsafe_ptr())
    var xp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](x.unsafe_ptr())
    var gp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](w_gate.unsafe_ptr())
    var up = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](w_up.unsafe_ptr())
    var dp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](w_down.unsafe_ptr())
    var np = rebind[Pointer[Scalar[wdtype], MutAnyOrigin]](norm_weight.unsafe_ptr())
    var pp = rebind[Pointer[Float32, MutAnyOrigin]](params.unsafe_ptr())
    var gup = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](gu.unsafe_ptr())
    var save = gu.dim_size(1) == 2 * F  # a [1, 1] dummy without save (2F >= 2)
    comptime if target == "gpu":
        comptime P = Pointer[Scalar[dtype], MutAnyOrigin]
        var ws = FfnScratch[dtype](
            rebind[P](xn.unsafe_ptr()),
            xn.dim_size(0),
            rebind[P](h.unsafe_ptr()),
            h.dim_size(0),
            rebind[Pointer[Float32, MutAnyOrigin]](g.unsafe_ptr()),
            g.dim_size(0),
            rebind[P](out_pad.unsafe_ptr()),
            out_pad.dim_size(0),
        )
        Path.run[dtype](op, rp, gup, save, xp, gp, up, dp, np, pp, T, D, F, ctx, ws)
    else:  # the CPU path needs no workspace: xn / h / g / out_pad are 1-element dummies, never read
        var has_norm = pp[unsafe_offset=1] != 0
        swiglu_ffn_cpu[dtype](op, rp, gup, save, xp, gp, up, dp, np, pp[unsafe_offset=0], has_norm, T, D, F)


@register("fusekit.swiglu_ffn")
struct SwigluFfn:
    @staticmethod
    def execute[
        dtype: DType, wdtype: DType, //, target: StaticString
    ](
        res: MutableInputTensor[dtype=dtype, rank=2, ...],
        rstd: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        gu: MutableInputTensor[dtype=dtype, rank=2, ...],
        xn: MutableInputTensor[dtype=dtype, rank=1, ...],
        h: MutableInputTensor[dtype=dtype, rank=1, ...],
        g: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        out_pad: MutableInputTensor[dtype=dtype, rank=1, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        w_gate: InputTensor[dtype=dtype, rank=2, ...],
        w_up: InputTensor[dtype=dtype, rank=2, ...],
        w_down: InputTensor[dtype=dtype, rank=2, ...],
        norm_weight: InputTensor[dtype=wdtype, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        _swiglu_ffn_execute[target, _GemvPath](
            res, rstd, gu, xn, h, g, out_pad, x, w_gate, w_up, w_down, norm_weight, params, ctx
        )


@register("fusekit.swiglu_ffn_backward")
struct SwigluFfnBackward:
    """The backward's element-wise part (_swiglu_backward.mojo): outputs h [T, F], dg, du [T, F] (x's dtype;
    [1, 1] dummies without grads), xn [T, D] (written when has_norm, else a [1, 1] dummy); inputs dh [T, F]
    (a dummy without grads), gu [T, 2F], x [T, D], norm_weight [D] (x's dtype or fp32), rstd [T] f32 (dummies [1]
    without a norm), params [2] = [has_norm, grads]. Without grads it is the GEMM-path forward's h = silu(g) u
    from gu (MojoBackend._swiglu_ffn_forward_gemm)."""

    @staticmethod
    def execute[
        dtype: DType, wdtype: DType, //, target: StaticString
    ](
        h: MutableInputTensor[dtype=dtype, rank=2, ...],
        dg: MutableInputTensor[dtype=dtype, rank=2, ...],
        du: MutableInputTensor[dtype=dtype, rank=2, ...],
        xn: MutableInputTensor[dtype=dtype, rank=2, ...],
        dh: InputTensor[dtype=dtype, rank=2, ...],
        gu: InputTensor[dtype=dtype, rank=2, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        norm_weight: InputTensor[dtype=wdtype, rank=1, ...],
        rstd: InputTensor[dtype=DType.float32, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var T = h.dim_size(0)
        var F = h.dim_size(1)
        var hp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](h.unsafe_ptr())
        var dgp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](dg.unsafe_ptr())
        var dup = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](du.unsafe_ptr())
        var xnp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](xn.unsafe_ptr())
        var dhp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](dh.unsafe_ptr())
        var gup = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](gu.unsafe_ptr())
        var xp = rebind[Pointer[Scalar[dtype], MutAnyOrigin]](x.unsafe_ptr())
        var np = rebind[Pointer[Scalar[wdtype], MutAnyOrigin]](norm_weight.unsafe_ptr())
        var rp = rebind[Pointer[Float32, MutAnyOrigin]](rstd.unsafe_ptr())
        var pp = rebind[Pointer[Float32, MutAnyOrigin]](params.unsafe_ptr())
        comptime if target == "gpu":
            swiglu_bwd_gpu[dtype](
                ctx, hp, dgp, dup, xnp, dhp, gup, xp, np, rp, pp, T, F, xn.dim_size(0), xn.dim_size(1)
            )
        else:
            var has_norm = pp[unsafe_offset=0] != 0
            var grads = pp[unsafe_offset=1] != 0
            swiglu_bwd_cpu[dtype](hp, dgp, dup, xnp, dhp, gup, xp, np, rp, has_norm, grads, T, F, x.dim_size(1))
