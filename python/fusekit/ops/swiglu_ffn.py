"""swiglu_ffn: the Llama MLP, (silu(xn W_gate^T) * (xn W_up^T)) W_down^T, with an optional fused RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fusekit import distributed, library
from fusekit.distributed import PLAIN
from fusekit.ops import _amp
from fusekit.ops import _checks as C
from fusekit.ops._spec import BACKWARD, FORWARD, OpSpec, Phase, Scalar, t

F64 = torch.float64


def _acc(dtype: torch.dtype) -> torch.dtype:
    return F64 if dtype == F64 else torch.float32


def _normed(x: Tensor, nw: Tensor | None, eps: float) -> tuple[Tensor, Tensor | None]:
    """(xn rounded to x's dtype, rstd [T]: fp32, fp64 for fp64 x) — xn = x * rstd * nw, or (x, None) without
    a norm."""
    if nw is None:
        return x, None
    acc = _acc(x.dtype)
    xf = x.to(acc)
    rstd = (xf.square().mean(dim=-1) + eps).rsqrt()
    return (xf * rstd[:, None] * nw.to(acc)).to(x.dtype), rstd  # acc: fp32 (fp64 for fp64 x)


# --- reference (what the op means; the torch backend runs it) ---------------------------------------
def reference_forward(x, w_gate, w_up, w_down, norm_weight, eps: float):
    """x [T, D], w_gate/w_up [F, D], w_down [D, F] -> (y [T, D], rstd [T] or None, gu [T, 2F]).

    xn = RMSNorm(x) * norm_weight rounded to x's dtype (or x); g = xn W_gate^T, u = xn W_up^T with fp32
    accumulation; h = silu(g) * u in fp32, rounded to x's dtype; y = h W_down^T accumulated in fp32.
    gu = [g, u] rounded to x's dtype is what a training call saves for backward.
    """
    xn, rstd = _normed(x, norm_weight, eps)
    acc = _acc(x.dtype)
    g = xn.to(acc) @ w_gate.to(acc).T
    u = xn.to(acc) @ w_up.to(acc).T
    h = (F.silu(g) * u).to(x.dtype)
    y = (h.to(acc) @ w_down.to(acc).T).to(x.dtype)
    return y, rstd, torch.cat((g, u), dim=-1).to(x.dtype)


def reference_backward(dy, x, w_gate, w_up, w_down, norm_weight, rstd, gu, eps: float):
    """(dx, dw_gate, dw_up, dw_down, dnorm_weight or None) from the saved gu (and rstd).

    Saved by forward: x, the weights, rstd (with a norm) and gu = [g, u] (pre-activation, x's dtype).
    Recomputed: xn from x, rstd and norm_weight; h = silu(g) * u. Then dh = dy W_down,
    dW_down = dy^T h, dg = dh u silu'(g), du = dh silu(g) (rounded to x's dtype), dxn = dg W_gate + du W_up,
    dW_gate = dg^T xn, dW_up = du^T xn, and with a norm dx / dnorm_weight through xn = x rstd nw.
    """
    acc = _acc(x.dtype)
    f = w_gate.shape[0]
    g, u = gu[:, :f].to(acc), gu[:, f:].to(acc)
    if norm_weight is not None:
        r = rstd.to(acc)[:, None]
        xhat = x.to(acc) * r
        xn = (xhat * norm_weight.to(acc)).to(x.dtype)
    else:
        xn = x
    sig = torch.sigmoid(g)
    h = (g * sig * u).to(x.dtype)
    dyf = dy.to(acc)
    dh = dyf @ w_down.to(acc)
    dw_down = dyf.T @ h.to(acc)
    dg = (dh * u * sig * (1.0 + g * (1.0 - sig))).to(x.dtype).to(acc)
    du = (dh * g * sig).to(x.dtype).to(acc)
    dxn = dg @ w_gate.to(acc) + du @ w_up.to(acc)
    dw_gate = dg.T @ xn.to(acc)
    dw_up = du.T @ xn.to(acc)
    dnw = None
    if norm_weight is not None:
        gw = dxn * norm_weight.to(acc)
        dx = r * (gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
        dnw = (dxn * xhat).sum(dim=0).to(norm_weight.dtype)
    else:
        dx = dxn
    out = x.dtype
    return dx.to(out), dw_gate.to(out), dw_up.to(out), dw_down.to(out), dnw


SPEC = library.register(
    OpSpec(
        name="swiglu_ffn",
        forward=Phase(
            outputs=(
                t("y", "T D"),
                t("rstd", "T", "acc", "norm", grad=False),
                t("gu", "T G", "x", "save", grad=False),
            ),
            inputs=(
                t("x", "T D"),
                t("w_gate", "F D"),
                t("w_up", "F D"),
                t("w_down", "D F"),
                t("norm_weight", "D", "w", "norm"),
            ),
            conditions=("norm", "save"),
            shapes=lambda ins, sc: {"gu": (ins["x"].shape[0], 2 * ins["w_gate"].shape[0])},
        ),
        backward=Phase(
            outputs=(
                t("dx", "T D"),
                t("dw_gate", "F D"),
                t("dw_up", "F D"),
                t("dw_down", "D F"),
                t("dnorm_weight", "D", "w", "norm"),
            ),
            inputs=(
                t("dy", "T D"),
                t("x", "T D"),
                t("w_gate", "F D"),
                t("w_up", "F D"),
                t("w_down", "D F"),
                t("norm_weight", "D", "w", "norm"),
                t("rstd", "T", "acc", "norm"),
                t("gu", "T G"),
            ),
            conditions=("norm",),
        ),
        scalars=(Scalar("eps", float, lambda v: C.real("eps", v, nonnegative=True)),),
        dtype_vars=("x", "w"),
        allowed=frozenset(
            [(d, d) for d in C.ANY_FLOAT] + [(d, torch.float32) for d in (torch.float16, torch.bfloat16)]
        ),
        reference={FORWARD: reference_forward, BACKWARD: reference_backward},
        grad_inputs=("x", "w_gate", "w_up", "w_down", "norm_weight"),
        save=lambda ins, outs: (
            *(ins[n] for n in ("x", "w_gate", "w_up", "w_down", "norm_weight")),
            outs["rstd"],
            outs["gu"],
        ),
        backward_inputs=lambda saved, g, cond: (g["y"], *saved),
        input_grads=lambda g, cond: tuple(
            g[n] for n in ("dx", "dw_gate", "dw_up", "dw_down", "dnorm_weight")
        ),
    )
)


# --- public ------------------------------------------------------------------------------------------
def _check(x: object, w_gate: object, w_up: object, w_down: object, norm_weight: object) -> None:
    x = C.tensor("x", x, C.ANY_FLOAT)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., D] with D > 0, got {tuple(x.shape)}")
    d = x.shape[-1]
    w_gate = C.tensor("w_gate", w_gate, (x.dtype,), ndim=2)
    f = w_gate.shape[0]
    if f == 0:
        raise ValueError("w_gate: the hidden dimension F must be > 0")
    C.like("w_gate", w_gate, "x", x, (f, d))
    C.like("w_up", w_up, "x", x, (f, d))
    C.like("w_down", w_down, "x", x, (d, f))
    if norm_weight is not None:
        C.like("norm_weight", norm_weight, "x", x, (d,), C.weight_dtypes(x))


_MEMO = library.memo()  # validated calls (see library.call_key)


def swiglu_ffn(
    x: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    backend: str = "auto",
) -> Tensor:
    """The Llama MLP: (silu(xn @ w_gate.T) * (xn @ w_up.T)) @ w_down.T.

    x [..., D]; w_gate, w_up [F, D]; w_down [D, F] (HF gate_proj/up_proj/down_proj weights), all of
    x's dtype (fp16, bf16, fp32; fp64 on the torch backend). xn = RMSNorm(x, eps) * norm_weight when
    `norm_weight` [D] (x's dtype or fp32) is given, else x. Returns [..., D] in x's dtype (fp32
    accumulation).

    backend: "auto" (default), "torch", "triton" or "mojo". Gradients flow to x, the three weights and
    norm_weight; a training call saves gu = [x W_gate^T, x W_up^T] (2·T·F elements) and rstd, and the
    backward recomputes xn and silu(g)·u from them. Errors: TypeError/ValueError naming the argument.
    """
    if (
        type(x) not in PLAIN
        or type(w_gate) not in PLAIN
        or type(w_up) not in PLAIN
        or type(w_down) not in PLAIN
        or type(norm_weight) not in PLAIN
    ) and (out := distributed.swiglu_ffn(x, w_gate, w_up, w_down, norm_weight, eps, backend)) is not None:
        return out  # DTensor inputs: local compute on the shards (fusekit.distributed)
    if (cast := _amp.lower(x, w_gate, w_up, w_down)) is not None:  # autocast: as F.linear
        x, w_gate, w_up, w_down = cast
    key = library.call_key((x, w_gate, w_up, w_down, norm_weight), (eps,), backend)
    run = _MEMO.get(key) if key is not None else None
    if run is None:  # the checked path (first call of a signature, grad, compile)
        _check(x, w_gate, w_up, w_down, norm_weight)
        scalars = (SPEC.scalars[0].check(eps),)
        C.backend_name(backend)
    nw = norm_weight.contiguous() if norm_weight is not None else None
    ins = (C.rows(x), w_gate.contiguous(), w_up.contiguous(), w_down.contiguous(), nw)
    y = run(ins)[0] if run is not None else library.apply_memo(_MEMO, key, SPEC, ins, scalars, backend)[0]
    return y if x.dim() == 2 else y.view(*x.shape)
