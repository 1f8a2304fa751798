"""The public ops. Every op takes `backend="auto" | "torch" | "triton" | "mojo"` and runs on CPU or CUDA.

Inputs may be non-contiguous (they are made contiguous first), may have any number of leading
dimensions where the docstring says `...`, and may be empty (an empty input gives an empty output).
The semantics are defined by `fusekit.reference`; see the README for the backend support matrix.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusekit import library, validation

__all__ = ["attention", "layer_norm", "reduce_sum", "rms_norm", "rope", "swiglu_ffn"]


def _rows(x: Tensor) -> Tensor:
    """[..., N] -> contiguous [M, N] (a view when x is already contiguous)."""
    n = x.shape[-1]
    return x.contiguous().view(-1, n) if n else x.reshape(math.prod(x.shape[:-1]), 0)


def reduce_sum(
    x: Tensor, dim: int | None = None, *, dtype: torch.dtype | None = None, backend: str = "auto"
) -> Tensor:
    """Sum of `x` over all elements (`dim=None`, 0-d result) or over one dimension.

    x: int32, int64, float16, bfloat16 or float32, any shape. Result dtype as torch.sum (integers ->
    int64, floats keep their dtype) unless `dtype` is given. Floating inputs accumulate in fp32,
    integers in int64 (exact). Any `dim` works; a dim other than the last costs a transposing copy.
    """
    out_dtype = validation.reduce_sum(x, dim, dtype)
    validation.backend_name(backend)
    if dim is None or x.dim() == 0:
        rows, shape = x.reshape(1, x.numel()), ()
    else:
        xm = x.movedim(dim, -1)
        rows, shape = _rows(xm), xm.shape[:-1]
    return library.call("reduce_sum", rows.contiguous(), out_dtype, backend).view(shape)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float = 1e-6, *, return_rstd: bool = False, backend: str = "auto"
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim: y = x * rsqrt(mean(x^2) + eps) * weight, math in fp32.

    x [..., N] (fp16, bf16, fp32), weight [N] of x's dtype. Returns y [..., N] in x's dtype, and with
    `return_rstd` also rstd [...] in fp32.
    """
    validation.rms_norm(x, weight, eps)
    validation.backend_name(backend)
    y, rstd = library.call("rms_norm", _rows(x), weight.contiguous(), float(eps), backend)
    y = y.view(x.shape)
    return (y, rstd.view(x.shape[:-1])) if return_rstd else y


def layer_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    return_stats: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dim as torch.nn.functional.layer_norm (biased variance), math in fp32.

    x [..., N], weight [N], bias [N] or None, all of x's dtype. Returns y [..., N]; with `return_stats`
    also mean [...] and rstd [...] in fp32.
    """
    validation.layer_norm(x, weight, bias, eps)
    validation.backend_name(backend)
    b = bias.contiguous() if bias is not None else None
    y, mean, rstd = library.call("layer_norm", _rows(x), weight.contiguous(), b, float(eps), backend)
    y = y.view(x.shape)
    if return_stats:
        return y, mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])
    return y


def rope(
    x: Tensor,
    *,
    start_pos: int = 0,
    theta: float = 10000.0,
    interleaved: bool = False,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Rotary position embedding of x [B, S, H, D] (D even), same dtype out.

    Pairs are the two halves of the head dim (HF Llama) or adjacent elements (`interleaved`), rotated
    by angle (start_pos + s) * theta^(-2i/D), computed in-kernel in fp32. Tables cos/sin
    [St, D/2] (St >= start_pos + S) replace the in-kernel angles; row start_pos + s is used.
    """
    validation.rope(x, start_pos, theta, cos, sin)
    validation.backend_name(backend)
    if cos is not None and sin is not None:
        cos = cos.to(torch.float32).contiguous()
        sin = sin.to(torch.float32).contiguous()
    return library.call(
        "rope", x.contiguous(), cos, sin, int(start_pos), float(theta), bool(interleaved), backend
    )


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

    x [..., D]; w_gate, w_up [F, D]; w_down [D, F]; xn = rms_norm(x, norm_weight, eps) when
    `norm_weight` [D] is given, else x. Returns [..., D] in x's dtype (fp32 accumulation).
    """
    validation.swiglu_ffn(x, w_gate, w_up, w_down, norm_weight, eps)
    validation.backend_name(backend)
    nw = norm_weight.contiguous() if norm_weight is not None else None
    y = library.call(
        "swiglu_ffn",
        _rows(x),
        w_gate.contiguous(),
        w_up.contiguous(),
        w_down.contiguous(),
        nw,
        float(eps),
        backend,
    )
    return y.view(x.shape)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Scaled dot-product attention, softmax(q k^T * scale) v, with GQA.

    q [B, H, S, D]; k, v [B, Hkv, Skv, D] with H a multiple of Hkv (head h reads kv head
    h // (H / Hkv)); D in {64, 128, 256}; fp16/bf16 (fp32 on CPU). scale defaults to 1/sqrt(D).
    `causal` masks aligned to the bottom-right as in FlashAttention: query i sees key j iff
    j <= i + Skv - S, so with S < Skv the queries are the last S positions; a query that sees no key
    (S > Skv) gets a zero output row.
    """
    validation.attention(q, k, v, scale)
    validation.backend_name(backend)
    s = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return library.call("attention", q.contiguous(), k.contiguous(), v.contiguous(), bool(causal), s, backend)
