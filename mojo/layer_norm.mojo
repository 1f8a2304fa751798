"""Op fusekit.layer_norm: out = (x - mean) * rstd * weight [+ bias] (fp32, biased variance),
mean[M] and rstd[M] f32.

Kernels and the byte floor are in `_norm.mojo` (shared with rms_norm). params = [eps, has_bias]; when
has_bias == 0 the bias input is a dummy (the weight again) and is never read.
"""

# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu.host import DeviceContext

from ._norm import norm_gpu, norm_cpu


@register("fusekit.layer_norm")
struct LayerNorm:
    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString
    ](
        res: MutableInputTensor[dtype=dtype, rank=2, ...],
        mean: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        rstd: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=dtype, rank=1, ...],
        bias: InputTensor[dtype=dtype, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var n = x.dim_size(1)
        comptime if target == "gpu":
            norm_gpu[dtype, True](
                ctx, res.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(), weight.unsafe_ptr(),
                bias.unsafe_ptr(), params.unsafe_ptr(), m, n
            )
        else:
            norm_cpu[dtype, True](
                res.unsafe_ptr(), mean.unsafe_ptr(), rstd.unsafe_ptr(), x.unsafe_ptr(), weight.unsafe_ptr(),
                bias.unsafe_ptr(), params.unsafe_ptr(), m, n
            )
