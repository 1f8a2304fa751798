"""Op fusekit.rms_norm: out[M, N] = x * rsqrt(mean(x^2) + eps) * weight (fp32 math), rstd[M] f32.

Kernels and the byte floor are in `_norm.mojo` (shared with layer_norm). params = [eps] (f32, on the
op's device, read by the kernel).
"""

# Outputs are MutableInputTensor: the graph passes the caller's buffers (ops.inplace_custom), so the
# kernel writes them directly; an OutputTensor would be a MAX temporary copied out afterwards.
from extensibility import InputTensor, _MutableInputTensor as MutableInputTensor, register
from max.gpu.host import DeviceContext

from ._norm import norm_gpu, norm_cpu


@register("fusekit.rms_norm")
struct RmsNorm:
    @staticmethod
    def execute[
        dtype: DType, //, target: StaticString
    ](
        res: MutableInputTensor[dtype=dtype, rank=2, ...],
        rstd: MutableInputTensor[dtype=DType.float32, rank=1, ...],
        x: InputTensor[dtype=dtype, rank=2, ...],
        weight: InputTensor[dtype=dtype, rank=1, ...],
        params: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var n = x.dim_size(1)
        # rms_norm has no mean output and no bias: pass rstd / weight again (never touched when LN=False)
        var rp = rstd.unsafe_ptr()
        var wp = weight.unsafe_ptr()
        comptime if target == "gpu":
            norm_gpu[dtype, False](
                ctx, res.unsafe_ptr(), rp, rp, x.unsafe_ptr(), wp, wp,
                params.unsafe_ptr(), m, n
            )
        else:
            norm_cpu[dtype, False](
                res.unsafe_ptr(), rp, rp, x.unsafe_ptr(), wp, wp,
                params.unsafe_ptr(), m, n
            )
