"""layer_norm: LayerNorm over the last dim (as F.layer_norm), with an optional fused residual add."""

from __future__ import annotations

from torch import Tensor

from fusekit import distributed, library
from fusekit.distributed import PLAIN
from fusekit.ops import _checks as C
from fusekit.ops._norms import (
    NORM_DTYPES,
    acc_dtype,
    add_residual,
    check_norm_inputs,
    norm_returns,
    own_residual_grad,
    promote_residual,
    widen_params,
    wider,
)
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec, Phase, Scalar, t


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def reference_forward(
    x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """x [M, N] (+ residual) -> (y [M, N] x dtype, h or None, mean [M], rstd [M]: fp32, fp64 for fp64 x).

    Biased variance as torch; y = (xin - mean) * rstd * w + b in fp32, one rounding; xin = h or x.
    """
    acc = acc_dtype(x.dtype)
    h = add_residual(x, residual)
    xin = (h if h is not None else x).to(acc)
    mean = xin.mean(dim=-1)
    # One refinement step: an fp32 sum-then-divide mean can be an ulp off, which on a constant row (the
    # exact answer 0) leaves xc = ulp and, with a tiny eps, y = +-1 (torch's F.layer_norm 0.2); the
    # kernels' two-pass means get such rows exactly.
    mean = mean + (xin - mean[:, None]).mean(dim=-1)
    xc = xin - mean[:, None]
    rstd = (xc.square().mean(dim=-1) + eps).rsqrt()
    y = xc * rstd[:, None] * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype), h, mean, rstd  # statistics in acc: fp32 (fp64 for fp64 x)


def reference_backward(
    dy: Tensor, dh: Tensor | None, xin: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx [M, N] x dtype, dw [N], db [N] in the weight's dtype); dx also is d residual.

    x̂ = (xin - mean) * rstd; g = dy * w; dx = rstd * (g - mean(g) - x̂ * mean(g x̂)) [+ dh];
    dw = Σ_rows dy * x̂; db = Σ_rows dy. fp32 math, one rounding each.
    """
    acc = acc_dtype(xin.dtype)
    r = rstd.to(acc)[:, None]
    xhat = (xin.to(acc) - mean.to(acc)[:, None]) * r
    dyf = dy.to(acc)
    g = dyf * weight.to(acc)
    dx = r * (g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.to(acc)
    return dx.to(xin.dtype), (dyf * xhat).sum(dim=0).to(weight.dtype), dyf.sum(dim=0).to(weight.dtype)


SPEC = library.register(
    OpSpec(
        name="layer_norm",
        forward=Phase(
            outputs=(
                t("y", "M N"),
                t("h", "M N", when="residual"),
                t("mean", "M", "acc", None, grad=False),
                t("rstd", "M", "acc", None, grad=False),
            ),
            inputs=(
                t("x", "M N"),
                t("residual", "M N", when="residual"),
                t("weight", "N", "w"),
                t("bias", "N", "w", when="bias"),
            ),
            conditions=("residual", "bias"),
        ),
        backward=Phase(
            outputs=(t("dx", "M N"), t("dw", "N", "w"), t("db", "N", "w", when="bias")),
            inputs=(
                t("dy", "M N"),
                t("dh", "M N", when="residual"),
                t("xin", "M N"),
                t("weight", "N", "w"),
                t("mean", "M", "acc"),
                t("rstd", "M", "acc"),
            ),
            conditions=("residual", "bias"),
        ),
        scalars=(Scalar("eps", float, lambda v: C.real("eps", v, nonnegative=True)),),
        dtype_vars=("x", "w"),
        allowed=NORM_DTYPES,
        reference={FORWARD: reference_forward, BACKWARD: reference_backward},
        grad_inputs=("x", "residual", "weight", "bias"),
        save=lambda ins, outs: (
            outs["h"] if outs["h"] is not None else ins["x"],
            ins["weight"],
            outs["mean"],
            outs["rstd"],
        ),
        backward_inputs=lambda saved, g, cond: (g["y"], g["h"], *saved),
        input_grads=lambda g, cond: (g["dx"], g["dx"] if cond["residual"] else None, g["dw"], g["db"]),
    )
)


# --- public ------------------------------------------------------------------------------------------
_MEMO = library.memo()  # validated calls (see library.call_key)


def layer_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: Tensor | None = None,
    return_stats: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, ...]:
    """LayerNorm over the last dim as torch.nn.functional.layer_norm (biased variance), math in fp32.

    x [..., N] fp16/bf16/fp32 (fp64 on the torch backend), any strides; weight [N] and bias [N] or None
    of x's dtype, or fp32 with fp16/bf16 x (mixed precision); bf16/fp16 ones beside fp32 x are widened to
    fp32. y [..., N] in x's dtype.

    residual [..., N]: fused residual add, h = x + residual is normalized and returned: (y, h) (a
    residual of another float dtype is promoted with x's, as x + residual would be).
    `return_stats` appends mean [...] and rstd [...] (fp32; fp64 for fp64 x), statistics with no gradient
    (as torch's native_layer_norm's: a loss through them adds nothing to x's). Returns y, (y, h),
    (y, mean, rstd) or (y, h, mean, rstd).

    backend: "auto" (default), "torch", "triton" or "mojo". Gradients flow to x, residual, weight and
    bias (a backend without a backward for the call raises before running). Errors: TypeError/ValueError
    naming `x`, `weight`, `bias`, `residual` or `eps`.
    """
    if (
        type(x) not in PLAIN
        or type(weight) not in PLAIN
        or type(bias) not in PLAIN
        or type(residual) not in PLAIN
    ) and (out := distributed.layer_norm(x, weight, bias, eps, residual, return_stats, backend)) is not None:
        return out  # DTensor inputs: local compute on the shards (fusekit.distributed)
    if residual is not None:
        x, residual, weight, bias = promote_residual(x, residual, weight, bias)  # dtypes as x + residual
        residual = own_residual_grad(x, residual)
    elif wider(x, weight) or (bias is not None and wider(x, bias)):
        weight, bias = widen_params(x, weight, bias)  # bf16 parameters beside fp32 x: as torch, in fp32
    key = library.call_key((x, weight, bias, residual), (eps, return_stats), backend)
    run = _MEMO.get(key) if key is not None else None
    if run is None:  # the checked path (first call of a signature, grad, compile)
        C.flag("return_stats", return_stats)  # 'no' must not mean True
        check_norm_inputs(x, weight, bias, residual)
        scalars = (SPEC.scalars[0].check(eps),)
        C.backend_name(backend)
    r = C.rows(residual) if residual is not None else None
    b = bias.contiguous() if bias is not None else None
    inputs = (C.rows(x), r, weight.contiguous(), b)
    y, h, mean, rstd = (
        run(inputs)
        if run is not None
        else library.apply_memo(
            _MEMO, key, SPEC, inputs, scalars, backend, () if return_stats else ("mean", "rstd")
        )
    )
    return norm_returns(x, y, h, (mean, rstd) if return_stats else ())
