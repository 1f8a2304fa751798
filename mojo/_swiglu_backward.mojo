"""Element-wise kernels of the swiglu_ffn backward (op fusekit.swiglu_ffn_backward, registered in swiglu_ffn.mojo).

The backward's five GEMMs run as torch matmuls on the Python side (cuBLAS on the GPU, as the Triton
backend and Liger-Kernel do); what is element-wise runs here. Semantics = reference_backward in
python/fusekit/ops/swiglu_ffn.py, fp32 math, one rounding to x's dtype per output:
- from dh [T, F] and the saved gu [T, 2F] = [g, u]:  sig = 1 / (1 + exp(-g)),
  h = g sig u,  dg = dh u sig (1 + g (1 - sig)),  du = dh g sig   (same operation order as the reference);
- with a norm (params[0] = has_norm != 0): xn [T, D] = (x * rstd) * norm_weight, recomputed from the
  saved rstd (the forward's rounding point). Without it xn, norm_weight and rstd are [1, 1] / [1]
  dummies that are never touched (the flag is read on the device: the host never sees params);
- without gradients (params[1] = grads == 0): h only, the forward's h = silu(g) u of the GEMM path
  (MojoBackend._swiglu_ffn_forward_gemm: cuBLAS writes g and u into gu's halves), by the same expression,
  so the backward's recomputed h is the forward's bit for bit; dh, dg and du are [1, 1] dummies then.
Byte floor: 6 T F elements (read dh, g, u; write h, dg, du) + 3 T D with a norm (x in, xn out, + rstd);
3 T F for h only (read g, u; write h: one pass where torch took five).
GPU: grid-stride loops over 16-byte vectors when the row length is a multiple of the vector width and
every pointer is 16-byte aligned, else one element per step; no warp-size assumption.
"""

from std.math import exp
from std.sys import align_of
from std.utils import StaticTuple
from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, global_idx, grid_dim, block_dim
from max.gpu.host import DeviceContext

from ._util import vec_width, is_aligned16, cdiv

comptime F32 = DType.float32
comptime FPtr = Pointer[Float32, MutAnyOrigin]
comptime TPB = 256


@always_inline
def swiglu_h[W: Int](g: SIMD[F32, W], u: SIMD[F32, W], sig: SIMD[F32, W]) -> SIMD[F32, W]:
    """h = silu(g) u in fp32 from sig = sigmoid(g) (_sigmoid): the forward's and the backward's h."""
    return g * sig * u


@always_inline
def _sigmoid[W: Int](g: SIMD[F32, W]) -> SIMD[F32, W]:
    return 1.0 / (1.0 + exp(-g))


@always_inline
def swiglu_grads[
    W: Int
](g: SIMD[F32, W], u: SIMD[F32, W], dh: SIMD[F32, W]) -> Tuple[SIMD[F32, W], SIMD[F32, W], SIMD[F32, W]]:
    """(h, dg, du) in fp32 from g, u, dh (reference_backward's expressions, evaluated left to right)."""
    var sig = _sigmoid(g)
    return (swiglu_h(g, u, sig), dh * u * sig * (1.0 + g * (1.0 - sig)), dh * g * sig)


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPB)))
def _swiglu_bwd_kernel[
    dtype: DType, W: Int
](
    h: Pointer[Scalar[dtype], MutAnyOrigin],
    dg: Pointer[Scalar[dtype], MutAnyOrigin],
    du: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    params: FPtr,
    T: Int64,
    F: Int64,
):
    comptime AL = 16 if W > 1 else align_of[dtype]()
    var f = Int(F)
    var per_row = f // W
    var n = Int(T) * per_row
    var grads = params[unsafe_offset=1] != 0  # uniform over the grid: no divergence
    var i = global_idx.x
    while i < n:
        var t = i // per_row
        var c = (i - t * per_row) * W
        var o = t * f + c
        var go = 2 * t * f + c
        var g = gu.unsafe_load[width=W, alignment=AL](go).cast[F32]()
        var u = gu.unsafe_load[width=W, alignment=AL](go + f).cast[F32]()
        if grads:
            var r = swiglu_grads[W](g, u, dh.unsafe_load[width=W, alignment=AL](o).cast[F32]())
            h.unsafe_store[alignment=AL](o, r[0].cast[dtype]())
            dg.unsafe_store[alignment=AL](o, r[1].cast[dtype]())
            du.unsafe_store[alignment=AL](o, r[2].cast[dtype]())
        else:
            h.unsafe_store[alignment=AL](o, swiglu_h(g, u, _sigmoid(g)).cast[dtype]())
        i += grid_dim.x * block_dim.x


@__llvm_metadata(MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(TPB)))
def _xn_kernel[
    dtype: DType, wdtype: DType, W: Int
](
    xn: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    nw: Pointer[Scalar[wdtype], MutAnyOrigin],
    rstd: FPtr,
    params: FPtr,
    T: Int64,
    D: Int64,
):
    """xn = round((x * rstd) * nw); returns at once without a norm (xn is then a dummy)."""
    if params[unsafe_offset=0] == 0:
        return
    comptime AL = 16 if W > 1 else align_of[dtype]()
    comptime ALW = 16 if W > 1 else align_of[wdtype]()  # nw's W-vector: W * its size bytes, 16-aligned
    var d = Int(D)
    var per_row = d // W
    var n = Int(T) * per_row
    var i = global_idx.x
    while i < n:
        var t = i // per_row
        var c = (i - t * per_row) * W
        var o = t * d + c
        var xv = x.unsafe_load[width=W, alignment=AL](o).cast[F32]() * rstd[unsafe_offset=t]
        var wv = nw.unsafe_load[width=W, alignment=ALW](c).cast[F32]()
        xn.unsafe_store[alignment=AL](o, (xv * wv).cast[dtype]())
        i += grid_dim.x * block_dim.x


def swiglu_bwd_gpu[
    wdtype: DType, //, dtype: DType
](
    ctx: DeviceContext,
    h: Pointer[Scalar[dtype], MutAnyOrigin],
    dg: Pointer[Scalar[dtype], MutAnyOrigin],
    du: Pointer[Scalar[dtype], MutAnyOrigin],
    xn: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    nw: Pointer[Scalar[wdtype], MutAnyOrigin],
    rstd: FPtr,
    params: FPtr,
    T: Int,
    F: Int,
    Tn: Int,
    Dn: Int,
) raises:
    """T x F: the SwiGLU part (h's shape); Tn x Dn: xn's shape ([1, 1] without a norm: one no-op thread).
    dh, dg, du are [1, 1] dummies without gradients (their alignment is checked all the same: torch's
    allocations are)."""
    comptime VW = vec_width[dtype]()
    var ok = F % VW == 0 and is_aligned16(h) and is_aligned16(dg) and is_aligned16(du)
    ok = ok and is_aligned16(dh) and is_aligned16(gu)
    if ok:
        var grid = max(1, min(cdiv(T * (F // VW), TPB), 1 << 30))
        ctx.enqueue_function[_swiglu_bwd_kernel[dtype, VW]](
            h, dg, du, dh, gu, params, Int64(T), Int64(F), grid_dim=grid, block_dim=TPB
        )
    else:
        var grid = max(1, min(cdiv(T * F, TPB), 1 << 30))
        ctx.enqueue_function[_swiglu_bwd_kernel[dtype, 1]](
            h, dg, du, dh, gu, params, Int64(T), Int64(F), grid_dim=grid, block_dim=TPB
        )
    var xok = Dn % VW == 0 and is_aligned16(xn) and is_aligned16(x) and is_aligned16(nw)
    if xok:
        var grid = max(1, min(cdiv(Tn * (Dn // VW), TPB), 1 << 30))
        ctx.enqueue_function[_xn_kernel[dtype, wdtype, VW]](
            xn, x, nw, rstd, params, Int64(Tn), Int64(Dn), grid_dim=grid, block_dim=TPB
        )
    else:
        var grid = max(1, min(cdiv(Tn * Dn, TPB), 1 << 30))
        ctx.enqueue_function[_xn_kernel[dtype, wdtype, 1]](
            xn, x, nw, rstd, params, Int64(Tn), Int64(Dn), grid_dim=grid, block_dim=TPB
        )


def swiglu_bwd_cpu[
    wdtype: DType, //, dtype: DType
](
    h: Pointer[Scalar[dtype], MutAnyOrigin],
    dg: Pointer[Scalar[dtype], MutAnyOrigin],
    du: Pointer[Scalar[dtype], MutAnyOrigin],
    xn: Pointer[Scalar[dtype], MutAnyOrigin],
    dh: Pointer[Scalar[dtype], MutAnyOrigin],
    gu: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], MutAnyOrigin],
    nw: Pointer[Scalar[wdtype], MutAnyOrigin],
    rstd: FPtr,
    has_norm: Bool,
    grads: Bool,
    T: Int,
    F: Int,
    D: Int,
):
    """Plain loops, the same math as the GPU kernels (W = 1)."""
    for t in range(T):
        for c in range(F):
            var g = gu[unsafe_offset=2 * t * F + c].cast[F32]()
            var u = gu[unsafe_offset=2 * t * F + F + c].cast[F32]()
            if not grads:
                h[unsafe_offset=t * F + c] = swiglu_h[1](g, u, _sigmoid[1](g)).cast[dtype]()
                continue
            var r = swiglu_grads[1](g, u, dh[unsafe_offset=t * F + c].cast[F32]())
            h[unsafe_offset=t * F + c] = r[0].cast[dtype]()
            dg[unsafe_offset=t * F + c] = r[1].cast[dtype]()
            du[unsafe_offset=t * F + c] = r[2].cast[dtype]()
    if not has_norm:
        return
    for t in range(T):
        var r = rstd[unsafe_offset=t]
        for j in range(D):
            var v = x[unsafe_offset=t * D + j].cast[F32]() * r * nw[unsafe_offset=j].cast[F32]()
            xn[unsafe_offset=t * D + j] = v.cast[dtype]()
