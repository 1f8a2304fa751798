"""Ops fusekit.rms_norm and fusekit.rms_norm_backward (CONTRACT.md "rms_norm").

forward:  outputs (y [M, N] x, h [M, N] x (residual case, else a [1, 1] dummy), rstd [M] f32),
          inputs (x [M, N] x, residual [M, N] x (or a [1, 1] dummy), weight [N] w),
          params [eps, casting (0 fp32, 1 llama, 2 gemma), has_residual]
backward: outputs (dx [M, N] x, dw [N] w), workspaces (sums, part_w: f32, see _norm_backward.mojo),
          inputs (dy [M, N] x, dh [M, N] x (or a [1, 1] dummy), xin [M, N] x, weight [N] w, rstd [M] f32),
          params [eps, casting, has_residual]
dtype parameters: `dtype` (x: f32 / f16 / bf16) and `wdtype` (w: dtype or f32). Shapes come from x / xin
only; dummies are never read. Kernels and byte floors: `_norm.mojo` (forward, shared with layer_norm)
and `_norm_backward.mojo`.
"""

# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu.host import DeviceContext

from ._norm import norm_gpu, norm_cpu
from ._norm_backward import norm_bwd_gpu, norm_bwd_cpu


@register("fusekit.rms_norm")
struct RmsNorm:
    @staticmethod
    def execute[
        dtype: DType, wdtype: DType, //, target: StaticString
    ](
        y: MutableInputTensor[dtype=dtype, rank=2, ...],
        h: MutableInputTensor[dtype=dtype, rank=2, ...],
        rstd: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        residual: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=wdtype, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var n = x.dim_size(1)
        # rms_norm has no mean output and no bias: pass rstd / weight again (never touched when LN=False)
        var rp = rstd.unsafe_ptr()
        var wp = weight.unsafe_ptr()
        comptime if target == "gpu":
            norm_gpu[dtype, wdtype, False](
                ctx, y.unsafe_ptr(), h.unsafe_ptr(), rp, rp, x.unsafe_ptr(), residual.unsafe_ptr(), wp, wp,
                params.unsafe_ptr(), m, n
            )
        else:
            norm_cpu[dtype, wdtype, False](
                y.unsafe_ptr(), h.unsafe_ptr(), rp, rp, x.unsafe_ptr(), residual.unsafe_ptr(), wp, wp,
                params.unsafe_ptr(), m, n
            )


@register("fusekit.rms_norm_backward")
struct RmsNormBackward:
    @staticmethod
    def execute[
        dtype: DType, wdtype: DType, //, target: StaticString
    ](
        dx: MutableInputTensor[dtype=dtype, rank=2, ...],
        dw: MutableInputTensor[dtype=wdtype, rank=1, ...],
        sums: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        part_w: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        dy: InputTensor[dtype=dtype, rank=2, ...],
        dh: InputTensor[dtype=dtype, rank=2, ...],
        xin: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=wdtype, rank=1, ...],
        rstd: InputTensor[dtype=DType.float32, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = xin.dim_size(0)
        var n = xin.dim_size(1)
        # no bias gradient and no mean: dw / rstd stand in (never touched when LN=False)
        var dwp = dw.unsafe_ptr()
        var rp = rstd.unsafe_ptr()
        comptime if target == "gpu":
            # no db partials either: part_w stands in for part_b (never touched when LN=False)
            var pw = part_w.unsafe_ptr()
            var nw = part_w.dim_size(0)
            norm_bwd_gpu[dtype, wdtype, False](
                ctx, dx.unsafe_ptr(), dwp, dwp, sums.unsafe_ptr(), sums.dim_size(0), pw, nw, pw, nw,
                dy.unsafe_ptr(), dh.unsafe_ptr(), xin.unsafe_ptr(), weight.unsafe_ptr(), rp, rp,
                params.unsafe_ptr(), m, n
            )
        else:  # the CPU path needs no workspace: sums / part_w are 1-element dummies, never read
            norm_bwd_cpu[dtype, wdtype, False](
                dx.unsafe_ptr(), dwp, dwp, dy.unsafe_ptr(), dh.unsafe_ptr(), xin.unsafe_ptr(),
                weight.unsafe_ptr(), rp, rp, params.unsafe_ptr(), m, n
            )
