# fusekit.swiglu_ffn_tc: fusekit.swiglu_ffn (../swiglu_ffn.mojo, its contract and floors) with the bf16
# wgmma prefill path (_ffn_tc: MAX's sm90 matmul three times) compiled in.
#
# Its own package (issue #14 item 3): `from linalg.matmul.gpu import _matmul_gpu` costs ~4 s of
# `mojo precompile` on a 2-core CPU (the whole op package built in 7 s with it, 3 s without), so it is
# kept out of the op package every first call builds. python/fusekit/backends/mojo/runtime.py
# precompiles this subpackage, together with the top-level files it imports (`..swiglu_ffn`, `.._util`,
# ...), into a second .mojoc of its own hash, only when a call is first routed to fusekit.swiglu_ffn_tc;
# that .mojoc also registers the imported files' ops, so it gets its own KernelLibrary.
# The kernels are those of swiglu_ffn.mojo before the split (ca0dcaa), moved unchanged.

from std.math import ceildiv, exp
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu import global_idx
from max.gpu.host import DeviceContext
from layout import TileTensor, row_major, Coord, Idx
from linalg.matmul.gpu import _matmul_gpu

from ..swiglu_ffn import (
    FfnScratch,
    TC_MIN_T,
    _FfnGpuPath,
    _OP,
    _ffn_gemv_path,
    _ffn_norm,
    _swiglu_ffn_execute,
    _tc_rows,
)
from .._util import check_workspace

comptime COPY_THREADS = 256


# (D, F) pairs instantiated for MAX's static-shape Hopper matmul (Llama-2-7B). Each pair costs ~4 min of
# compile (3 sm90 matmuls); add e.g. (4096, 14336) for Llama-3-8B, (5120, 13824) for Llama-2-13B.
comptime _STATIC_DF = [(4096, 11008)]


def _copy_kernel(dst: Pointer[BFloat16, MutAnyOrigin], src: Pointer[BFloat16, MutAnyOrigin], n: Int64):
    """dst[:n] = src[:n], 8 elements (16 bytes) per thread; n is a multiple of 8 (T * D, D % 8 == 0).
    n is Int64: T * D passes 2^31 from T = 524288 at D = 4096, where an Int32 n wrapped (negative: nothing
    copied; past 2^32 a partial copy); global_idx.x is 64-bit (mul.wide.u32 in the PTX)."""
    var i = Int(global_idx.x) * 8
    if i < Int(n):
        dst.unsafe_store[width=8](i, src.unsafe_load[width=8](i))


def _ffn_tc[
    D: Int, F: Int
](
    o: Pointer[BFloat16, MutAnyOrigin],
    xn: Pointer[BFloat16, MutAnyOrigin],
    wg: Pointer[BFloat16, MutAnyOrigin],
    wu: Pointer[BFloat16, MutAnyOrigin],
    wd: Pointer[BFloat16, MutAnyOrigin],
    T: Int,
    ctx: DeviceContext,
    gu: Pointer[BFloat16, MutAnyOrigin],
    save: Bool,
    ws: FfnScratch[DType.bfloat16],
) raises:
    """Prefill on Hopper: three wgmma matmuls (MAX's sm90 kernel) with the SiLU*mul epilogue fused; with
    save the epilogue also stores gu = [round(g), u] (u arrives rounded to bf16 already: exactly gu's u).
    xn holds Tp = ceil(T / TC_PAD) * TC_PAD rows (see TC_PAD); only `o`'s first T rows are written.
    G, h and the padded output live in the workspaces ws.g, ws.h, ws.out_pad (Tp rows each)."""
    var Tp = _tc_rows(T)
    check_workspace(_OP, "g", ws.g_len, Tp * F)
    check_workspace(_OP, "h", ws.h_len, Tp * F)
    check_workspace(_OP, "out_pad", ws.out_pad_len, Tp * D)
    var gp = ws.g()
    var hp = ws.h()
    var op = ws.out_pad()
    var gt = TileTensor(ptr=gp, layout=row_major(Coord(Tp, Idx[F])))
    var ht = TileTensor(ptr=hp, layout=row_major(Coord(Tp, Idx[F])))
    var xt = TileTensor(ptr=xn, layout=row_major(Coord(Tp, Idx[D])))
    var ot = TileTensor(ptr=op, layout=row_major(Coord(Tp, Idx[D])))
    var wgt = TileTensor(ptr=wg, layout=row_major[F, D]())
    var wut = TileTensor(ptr=wu, layout=row_major[F, D]())
    var wdt = TileTensor(ptr=wd, layout=row_major[D, F]())

    @always_inline
    @__parameter
    # by value: a by-reference capture would hand the GPU a host stack address
    @__copy_capture(gp, hp, gu, save, T)
    def silu_mul_epi[
        _dtype: DType, width: SIMDLength, *, alignment: Int = 1
    ](idx: Coord, val: SIMD[_dtype, width]):
        var row = Int(idx[0].value())
        var col = Int(idx[1].value())
        var off = row * F + col
        var g = gp.unsafe_load[width=width](off)
        var u = val.cast[DType.float32]()
        var hv = g / (1.0 + exp(-g)) * u
        hp.unsafe_store[width=width](off, hv.cast[DType.bfloat16]())
        if save and row < T:  # gu is the caller's [T, 2F]: padding rows must not reach it
            gu.unsafe_store[width=width](2 * row * F + col, g.cast[DType.bfloat16]())
            gu.unsafe_store[width=width](2 * row * F + F + col, val.cast[DType.bfloat16]())

    _matmul_gpu[use_tensor_core=True, transpose_b=True](gt, xt, wgt, ctx)
    _matmul_gpu[use_tensor_core=True, transpose_b=True, elementwise_lambda_fn=silu_mul_epi](ht, xt, wut, ctx)
    _matmul_gpu[use_tensor_core=True, transpose_b=True](ot, ht, wdt, ctx)
    ctx.enqueue_function[_copy_kernel](
        o, op, Int64(T * D), grid_dim=ceildiv(T * D, 8 * COPY_THREADS), block_dim=COPY_THREADS
    )


def swiglu_ffn_gpu[
    wdtype: DType, //, dtype: DType
](
    o: Pointer[Scalar[dtype], MutAnyOrigin],
    rstd: Pointer[Float32, MutAnyOrigin],
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
    allow_tc: Bool = True,
    tc_min_t: Int = TC_MIN_T,
) raises:
    swiglu_ffn_gpu_save[dtype](o, rstd, o, False, x, wg, wu, wd, nw, params, T, D, F, ctx, ws, allow_tc, tc_min_t)


def swiglu_ffn_gpu_save[
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
    allow_tc: Bool = True,
    tc_min_t: Int = TC_MIN_T,
) raises:
    """The forward of swiglu_ffn_gpu, and with save also gu [T, 2F] (both paths); scratch in `ws`.
    With the wgmma path (fusekit.swiglu_ffn_tc); swiglu_ffn_gpu_gemv is the same without it."""
    # the tensor-core path reads xn as a Tp-row matrix (see TC_PAD); rows T.. are never written
    var xn_rows = _tc_rows(T) if T >= tc_min_t and allow_tc else T
    var xn = _ffn_norm[dtype](rstd, x, nw, params, T, D, xn_rows, ctx, ws)

    comptime if dtype == DType.bfloat16 and DeviceContext.default_device_info.api == "cuda":
        if T >= tc_min_t and allow_tc:
            comptime for i in range(len(_STATIC_DF)):
                comptime DD = _STATIC_DF[i][0]
                comptime FF = _STATIC_DF[i][1]
                if D == DD and F == FF:
                    _ffn_tc[DD, FF](
                        rebind[Pointer[BFloat16, MutAnyOrigin]](o),
                        rebind[Pointer[BFloat16, MutAnyOrigin]](xn),
                        rebind[Pointer[BFloat16, MutAnyOrigin]](wg),
                        rebind[Pointer[BFloat16, MutAnyOrigin]](wu),
                        rebind[Pointer[BFloat16, MutAnyOrigin]](wd),
                        T,
                        ctx,
                        rebind[Pointer[BFloat16, MutAnyOrigin]](gu),
                        save,
                        ws.as_bf16(),
                    )
                    return
    _ffn_gemv_path[dtype](o, gu, save, xn, wg, wu, wd, T, D, F, ctx, ws)


struct _TcPath(_FfnGpuPath):
    """fusekit.swiglu_ffn_tc: the wgmma path for _STATIC_DF from TC_MIN_T tokens, else the GEMV kernels."""

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
        swiglu_ffn_gpu_save[dtype](o, rstd, gu, save, x, wg, wu, wd, nw, params, T, D, F, ctx, ws)


@register("fusekit.swiglu_ffn_tc")
struct SwigluFfnTc:
    """fusekit.swiglu_ffn with the wgmma path compiled in (bf16 at a _STATIC_DF pair from TC_MIN_T tokens)."""

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
        _swiglu_ffn_execute[target, _TcPath](
            res, rstd, gu, xn, h, g, out_pad, x, w_gate, w_up, w_down, norm_weight, params, ctx
        )
