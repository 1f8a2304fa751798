"""Ops fusekit.layer_norm and fusekit.layer_norm_backward (CONTRACT.md "layer_norm").

forward:  outputs (y [M, N] x, h [M, N] x (residual case, else a [1, 1] dummy), mean [M] f32, rstd [M] f32),
          inputs (x [M, N] x, residual [M, N] x (or [1, 1]), weight [N] w, bias [N] w (or a [1] dummy)),
          params [eps, has_residual, has_bias]
backward: outputs (dx [M, N] x, dw [N] w, db [N] w (or a [1] dummy)), workspaces (sums, part_w,
          part_b: f32, see _norm_backward.mojo),
          inputs (dy [M, N] x, dh [M, N] x (or [1, 1]), xin [M, N] x, weight [N] w, mean [M] f32, rstd [M] f32),
          params [eps, has_residual, has_bias]
Statistics: biased variance, exact two-pass. dtype parameters: `dtype` (x: f32 / f16 / bf16) and
`wdtype` (w and b: dtype or f32). Shapes come from x / xin only; dummies are never read. Kernels and
byte floors: `_norm.mojo` (forward, shared with rms_norm) and `_norm_backward.mojo`.
"""

# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu.host import DeviceContext

from ._norm import norm_gpu, norm_cpu
from ._norm_backward import norm_bwd_gpu, norm_bwd_cpu


@register("fusekit.layer_norm")
struct LayerNorm:
    @staticmethod
    def execute[
        dtype: DType, wdtype: DType, //, target: StaticString
    ](
        y: MutableInputTensor[dtype=dtype, rank=2, ...],
        h: MutableInputTensor[dtype=dtype, rank=2, ...],
        mean: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        rstd: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        residual: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=wdtype, rank=1, ...],
        bias: InputTensor[dtype=wdtype, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var n = x.dim_size(1)
        comptime if target == "gpu":
            norm_gpu[dtype, wdtype, True](
                ctx, y.unsafe_ptr(), h.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                residual.unsafe_ptr(), weight.unsafe_ptr(), bias.unsafe_ptr(), params.unsafe_ptr(), m, n
            )
        else:
            norm_cpu[dtype, wdtype, True](
                y.unsafe_ptr(), h.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(),
                residual.unsafe_ptr(), weight.unsafe_ptr(), bias.unsafe_ptr(), params.unsafe_ptr(), m, n
            )


@register("fusekit.layer_norm_backward")
struct LayerNormBackward:
    @staticmethod
    def execute[
        dtype: DType, wdtype: DType, //, target: StaticString
    ](
        dx: MutableInputTensor[dtype=dtype, rank=2, ...],
        dw: MutableInputTensor[dtype=wdtype, rank=1, ...],
        db: MutableInputTensor[dtype=wdtype, rank=1, ...],
        sums: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        part_w: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        part_b: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        dy: InputTensor[dtype=dtype, rank=2, ...],
        dh: InputTensor[dtype=dtype, rank=2, ...],
        xin: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=wdtype, rank=1, ...],
        mean: InputTensor[dtype=DType.float32, rank=1, ...],
        rstd: InputTensor[dtype=DType.float32, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = xin.dim_size(0)
        var n = xin.dim_size(1)
        comptime if target == "gpu":
            norm_bwd_gpu[dtype, wdtype, True](
                ctx, dx.unsafe_ptr(), dw.unsafe_ptr(), db.unsafe_ptr(), sums.unsafe_ptr(), sums.dim_size(0),
                part_w.unsafe_ptr(), part_w.dim_size(0), part_b.unsafe_ptr(), part_b.dim_size(0), dy.unsafe_ptr(),
                dh.unsafe_ptr(), xin.unsafe_ptr(), weight.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(),
                params.unsafe_ptr(), m, n
            )
        else:  # the CPU path needs no workspace: sums / part_w / part_b are 1-element dummies, never read
            norm_bwd_cpu[dtype, wdtype, True](
                dx.unsafe_ptr(), dw.unsafe_ptr(), db.unsafe_ptr(), dy.unsafe_ptr(), dh.unsafe_ptr(),
                xin.unsafe_ptr(), weight.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), params.unsafe_ptr(), m, n
            )
