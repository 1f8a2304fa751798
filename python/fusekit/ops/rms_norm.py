"""rms_norm: RMSNorm over the last dim, with an optional fused residual add and HF casting modes."""

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

CASTINGS = ("fp32", "llama", "gemma")


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def reference_forward(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, casting: str
) -> tuple[Tensor, Tensor | None, Tensor]:
    """x [M, N] (+ residual) -> (y [M, N] x dtype, h = x + residual or None, rstd [M]: fp32, fp64 for fp64 x).

    rstd = 1/sqrt(mean(xin^2) + eps) with xin = h (rounded to x's dtype) or x, math in fp32:
    - "fp32": y = xin * rstd * w, one rounding at the end (the most accurate);
    - "llama": y = round(round(xin * rstd) * w): HF LlamaRMSNorm (normalize, cast, then scale);
    - "gemma": y = xin * rstd * (1 + w), one rounding: HF GemmaRMSNorm.
    """
    acc = acc_dtype(x.dtype)
    h = add_residual(x, residual)
    xin = (h if h is not None else x).to(acc)
    rstd = (xin.square().mean(dim=-1) + eps).rsqrt()
    xhat = xin * rstd[:, None]
    w = weight.to(acc)
    if casting == "llama":
        y = xhat.to(x.dtype).to(acc) * w
    elif casting == "gemma":
        y = xhat * (1.0 + w)
    else:
        y = xhat * w
    return y.to(x.dtype), h, rstd  # rstd in acc: fp32 (fp64 for fp64 x)


def reference_backward(
    dy: Tensor, dh: Tensor | None, xin: Tensor, weight: Tensor, rstd: Tensor, eps: float, casting: str
) -> tuple[Tensor, Tensor]:
    """(dx [M, N] x dtype, dw [N] weight dtype); dx also is d residual when the op had one.

    x̂ = xin * rstd; g = dy * w_eff (w, or 1 + w for gemma); dx = rstd * (g - x̂ * mean(g x̂)) [+ dh];
    dw = Σ_rows dy * x̂ (llama: the rounded x̂ the weight multiplied). fp32 math, one rounding each.
    """
    acc = acc_dtype(xin.dtype)
    r = rstd.to(acc)[:, None]
    xhat = xin.to(acc) * r
    w = weight.to(acc)
    g = dy.to(acc) * (1.0 + w if casting == "gemma" else w)
    dx = r * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    if dh is not None:
        dx = dx + dh.to(acc)
    scaled = xhat.to(xin.dtype).to(acc) if casting == "llama" else xhat
    dw = (dy.to(acc) * scaled).sum(dim=0)
    return dx.to(xin.dtype), dw.to(weight.dtype)


SPEC = library.register(
    OpSpec(
        name="rms_norm",
        forward=Phase(
            outputs=(
                t("y", "M N"),
                t("h", "M N", when="residual"),
                t("rstd", "M", "acc", None, grad=False),
            ),
            inputs=(t("x", "M N"), t("residual", "M N", when="residual"), t("weight", "N", "w")),
            conditions=("residual",),
        ),
        backward=Phase(
            outputs=(t("dx", "M N"), t("dw", "N", "w")),
            inputs=(
                t("dy", "M N"),
                t("dh", "M N", when="residual"),
                t("xin", "M N"),
                t("weight", "N", "w"),
                t("rstd", "M", "acc"),
            ),
            conditions=("residual",),
        ),
        scalars=(
            Scalar("eps", float, lambda v: C.real("eps", v, nonnegative=True)),
            Scalar("casting", str, lambda v: C.choice("casting", v, CASTINGS), CASTINGS),
        ),
        dtype_vars=("x", "w"),
        allowed=NORM_DTYPES,
        reference={FORWARD: reference_forward, BACKWARD: reference_backward},
        grad_inputs=("x", "residual", "weight"),
        save=lambda ins, outs: (
            outs["h"] if outs["h"] is not None else ins["x"],
            ins["weight"],
            outs["rstd"],
        ),
        backward_inputs=lambda saved, g, cond: (g["y"], g["h"], saved[0], saved[1], saved[2]),
        input_grads=lambda g, cond: (g["dx"], g["dx"] if cond["residual"] else None, g["dw"]),
    )
)


# --- public ------------------------------------------------------------------------------------------
_MEMO = library.memo()  # validated calls (see library.call_key)


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    *,
    residual: Tensor | None = None,
    casting: str = "fp32",
    return_rstd: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, ...]:
    """RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * weight, math in fp32.

    x [..., N] fp16/bf16/fp32 (fp64 on the torch backend), any strides. weight [N] of x's dtype, or
    fp32 with fp16/bf16 x (mixed precision, as HF keeps norm weights); a bf16/fp16 weight beside fp32 x is
    widened to fp32 (as torch promotes weight * x). y [..., N] in x's dtype.

    residual [..., N] (x's shape; another float dtype is promoted with x's as x + residual would be,
    e.g. an fp32 residual stream with a bf16 x under autocast): fused residual add, h = x + residual is
    normalized and returned too, from one kernel: returns (y, h). `casting` picks where the rounding happens:
    "fp32" (default, most accurate), "llama" (HF LlamaRMSNorm), "gemma" (HF GemmaRMSNorm: 1 + weight).
    `return_rstd` appends rstd [...] (fp32; fp64 for fp64 x), a statistic with no gradient (as torch's
    native_layer_norm's: a loss through it adds nothing to x's). Returns y, (y, h), (y, rstd) or (y, h, rstd).

    backend: "auto" (default), "torch", "triton" or "mojo". Gradients flow to x, residual and weight
    (a backend without a backward for the call raises before running). Errors: TypeError/ValueError
    naming `x`, `weight`, `residual`, `eps` or `casting`.
    """
    if (type(x) not in PLAIN or type(weight) not in PLAIN or type(residual) not in PLAIN) and (
        out := distributed.rms_norm(x, weight, eps, residual, casting, return_rstd, backend)
    ) is not None:
        return out  # DTensor inputs: local compute on the shards (fusekit.distributed)
    if residual is not None:
        x, residual, weight = promote_residual(x, residual, weight)  # dtypes as x + residual
        residual = own_residual_grad(x, residual)
    elif wider(x, weight):
        (weight,) = widen_params(x, weight)  # a bf16 weight beside fp32 x: as torch, in fp32
    key = library.call_key((x, weight, residual), (eps, casting, return_rstd), backend)
    run = _MEMO.get(key) if key is not None else None
    if run is None:  # the checked path (first call of a signature, grad, compile)
        C.flag("return_rstd", return_rstd)  # 'no' must not mean True
        check_norm_inputs(x, weight, None, residual)
        scalars = tuple(s.check(v) for s, v in zip(SPEC.scalars, (eps, casting)))
        C.backend_name(backend)
    r = C.rows(residual) if residual is not None else None
    inputs = (C.rows(x), r, weight.contiguous())
    y, h, rstd = (
        run(inputs)
        if run is not None
        else library.apply_memo(_MEMO, key, SPEC, inputs, scalars, backend, () if return_rstd else ("rstd",))
    )
    return norm_returns(x, y, h, (rstd,) if return_rstd else ())
